"""Tiny Hugging Face tokenizers built on the spot, for tests that must not download anything.

make_tiny_hf_tokenizer(dir) trains a byte-level BPE on a few sentences with the `tokenizers`
library and writes tokenizer.json + tokenizer_config.json with one of the chat templates below.
"""
import json
import os

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Qwen2.5-style: a default system turn is injected when the conversation has none.
CHATML_SYSTEM_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}" + CHATML_TEMPLATE
)

# Llama-3-style: bos from the template, header tokens, content trimmed, <|eot_id|> ends a turn.
LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Renders the final assistant turn differently from earlier ones: not prefix-stable.
UNSTABLE_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.last and message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n<think></think>' + message['content'] + '<|im_end|>\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>"]

_CORPUS = [
    "Tom has 3 apples. He buys 4 more. How many apples now? 3+4=7 #### 7",
    "The quick brown fox jumps over the lazy dog.",
    "system user assistant You are a helpful assistant.",
    "What is the capital of France? Paris is the capital of France.",
    "Hello! How can I help you today? Thanks, goodbye.",
]


def make_tiny_hf_tokenizer(directory: str, chat_template: str | None = CHATML_TEMPLATE, vocab_size: int = 400,
                           eos_token: str = "<|im_end|>", bos_token: str | None = None,
                           pad_token: str | None = "<|endoftext|>") -> str:
    """Train and save a byte-level BPE tokenizer in `directory`; return the directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_token, "model_max_length": 4096}
    if bos_token is not None:
        config["bos_token"] = bos_token
    if pad_token is not None:
        config["pad_token"] = pad_token
    if chat_template is not None:
        config["chat_template"] = chat_template
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return directory
