"""A tiny Hugging Face model directory as a user brings one: weights saved by transformers'
save_pretrained and a tokenizer of its own (a byte-level BPE trained here, saved by
PreTrainedTokenizerFast), unlike megarl's byte tokenizer in ids and specials."""
from __future__ import annotations

from pathlib import Path

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2: none is a byte tokenizer's
TEXT = ["What is 17 + 25? Answer: 42", "Compute 3 * 4 - 5 and give the final answer. The answer is 7.",
        "user assistant system the a of and to is in that it with as for was on are"] * 20


def save_tokenizer(out: Path, vocab_size: int = 320) -> int:
    """Train and save the tokenizer; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(out)
    return len(fast)


def save_qwen2(out: Path, *, tokenizer: bool = True, seed: int = 0, **config) -> Path:
    """A random 2-layer Qwen2 (rope_theta 100000, GQA 4/2 heads) in `out`, with the tokenizer
    above unless tokenizer=False; `config` overrides Qwen2Config's fields."""
    import torch
    import transformers

    out = Path(out)
    vocab = save_tokenizer(out) if tokenizer else 320
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(**{**dict(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=256, rope_theta=100000.0, rms_norm_eps=1e-6,
                                             tie_word_embeddings=False), **config})
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    return out
