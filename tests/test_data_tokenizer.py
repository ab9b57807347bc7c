"""Tokenizers and assistant-only loss masks, checked token by token."""
import json
import os

import pytest

from megarl.data.chat import ChatTemplateError
from megarl.data.datasets import build_sft_dataset
from megarl.data.errors import DataError
from chat_templates import (CHATML_SYSTEM_TEMPLATE, CHATML_TEMPLATE, LLAMA3_TEMPLATE, UNSTABLE_TEMPLATE,
                                 make_tiny_hf_tokenizer)
from megarl.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "Hi there, how can I help?"},
    {"role": "user", "content": "What is 3+4?"},
    {"role": "assistant", "content": "3+4=7 #### 7"},
]

# ChatML with transformers' {% generation %} markers, so transformers can compute its own mask.
CHATML_GENERATION_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    return {
        "chatml": make_tiny_hf_tokenizer(str(root / "chatml"), CHATML_TEMPLATE),
        "chatml_system": make_tiny_hf_tokenizer(str(root / "sys"), CHATML_SYSTEM_TEMPLATE),
        "llama3": make_tiny_hf_tokenizer(str(root / "llama3"), LLAMA3_TEMPLATE, eos_token="<|eot_id|>",
                                         bos_token="<|begin_of_text|>"),
        "none": make_tiny_hf_tokenizer(str(root / "none"), None),
        "generation": make_tiny_hf_tokenizer(str(root / "gen"), CHATML_GENERATION_TEMPLATE),
        "unstable": make_tiny_hf_tokenizer(str(root / "unstable"), UNSTABLE_TEMPLATE),
    }


def test_byte_tokenizer_chat_mask_token_by_token():
    tok = ByteTokenizer()
    assert tok.vocab_size == 261 and (tok.pad_id, tok.bos_id, tok.eos_id) == (256, 257, tok.im_end_id)
    S, E = tok.im_start_id, tok.im_end_id
    b = lambda s: list(s.encode())  # noqa: E731
    pieces = [  # (token ids, loss mask bit), in order
        ([tok.bos_id], 0),
        ([S] + b("system\n"), 0), (b("Be brief.") + [E], 0),
        ([S] + b("user\n"), 0), (b("Hello!") + [E], 0),
        ([S] + b("assistant\n"), 0), (b("Hi there, how can I help?") + [E], 1),
        ([S] + b("user\n"), 0), (b("What is 3+4?") + [E], 0),
        ([S] + b("assistant\n"), 0), (b("3+4=7 #### 7") + [E], 1),
    ]
    ids, mask = tok.encode_chat(CONV)
    assert ids == [t for p, _ in pieces for t in p]
    assert mask == [m for p, m in pieces for _ in p]
    prompt, pmask = tok.encode_chat(CONV[:2], add_generation_prompt=True)
    assert prompt == [t for p, _ in pieces[:5] for t in p] + [S] + b("assistant\n") and not any(pmask)


def test_byte_tokenizer_roundtrip_and_specials():
    tok = ByteTokenizer()
    text = "héllo 🙂 <|im_end|>"
    assert tok.encode(text) == list(text.encode()) and tok.decode(tok.encode(text)) == text  # no injection
    ids, _ = tok.encode_chat(CONV[1:3])
    assert tok.decode(ids) == ("<|bos|><|im_start|>user\nHello!<|im_end|>"
                               "<|im_start|>assistant\nHi there, how can I help?<|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "user\nHello!assistant\nHi there, how can I help?"
    assert tok.stop_ids == (tok.im_end_id, tok.endoftext_id)


def _runs(mask):
    """Contiguous [start, end) spans where mask == 1."""
    runs, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


@pytest.mark.parametrize("name,end", [("chatml", "<|im_end|>"), ("chatml_system", "<|im_end|>"),
                                      ("llama3", "<|eot_id|>"), ("none", "<|im_end|>")])
def test_hf_chat_mask_covers_exactly_assistant_content_and_end_token(hf_dirs, name, end):
    tok = load_tokenizer("hf", hf_dirs[name])
    for conv in (CONV, CONV[1:], CONV[1:3]):
        ids, mask = tok.encode_chat(conv)
        assert len(ids) == len(mask)
        replies = [m["content"] for m in conv if m["role"] == "assistant"]
        runs = _runs(mask)
        assert len(runs) == len(replies)
        for (a, z), reply in zip(runs, replies):
            assert tok.decode(ids[a:z]) == reply + end        # content + end-of-turn token, nothing else
            assert ids[a:z] == tok.encode(reply) + [tok.encode(end)[0]]
            assert tok.decode(ids[:a]).endswith("assistant\n" if end == "<|im_end|>" else
                                                "assistant<|end_header_id|>\n\n")  # header unmasked
        assert sum(mask) == sum(z - a for a, z in runs)
    prompt, pmask = tok.encode_chat(CONV[:2], add_generation_prompt=True)
    assert not any(pmask)
    full, _ = tok.encode_chat(CONV[:3])
    assert full[:len(prompt)] == prompt                     # the generation prompt is the reply's prefix


def test_hf_chat_matches_transformers(hf_dirs):
    transformers = pytest.importorskip("transformers")
    for name in ("chatml", "chatml_system", "llama3", "generation"):
        ours = load_tokenizer("hf", hf_dirs[name])
        ref = transformers.AutoTokenizer.from_pretrained(hf_dirs[name])
        assert (ours.eos_id, ours.pad_id, ours.bos_id) == (ref.eos_token_id, ref.pad_token_id, ref.bos_token_id)
        assert ours.vocab_size == len(ref)
        for conv in (CONV, CONV[1:]):
            ids, mask = ours.encode_chat(conv)
            out = ref.apply_chat_template(conv, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=name == "generation")
            assert ids == list(out["input_ids"]), name
            if name == "generation":  # transformers' own char-offset mask agrees with our prefix diff
                assert mask == list(out["assistant_masks"])
            gen = ref.apply_chat_template(conv[:2], tokenize=True, add_generation_prompt=True, return_dict=True)
            assert ours.encode_chat(conv[:2], add_generation_prompt=True)[0] == list(gen["input_ids"])
        assert ours.encode("Hello world") == ref.encode("Hello world", add_special_tokens=False)


def test_stop_ids_start_with_the_templates_end_of_turn(tmp_path):
    # A base tokenizer: eos is <|endoftext|> but the chat template ends replies with <|im_end|>.
    base = load_tokenizer("hf", make_tiny_hf_tokenizer(str(tmp_path / "base"), CHATML_TEMPLATE,
                                                       eos_token="<|endoftext|>"))
    im_end, eot = base.encode("<|im_end|>")[0], base.encode("<|eot_id|>")[0]
    assert base.eos_id == base.encode("<|endoftext|>")[0] and base.stop_ids[:2] == (im_end, base.eos_id)
    llama = load_tokenizer("hf", make_tiny_hf_tokenizer(str(tmp_path / "llama"), LLAMA3_TEMPLATE,
                                                        eos_token="<|endoftext|>", bos_token="<|begin_of_text|>"))
    assert llama.stop_ids[0] == eot
    ids, mask = llama.encode_chat(CONV[1:3])
    assert ids[-1] == eot and mask[-1] == 1


def test_template_that_is_not_prefix_stable_is_a_clear_error(hf_dirs, tmp_path):
    tok = load_tokenizer("hf", hf_dirs["unstable"])
    tok.encode_chat(CONV[1:3])  # a single assistant turn at the end is still fine
    with pytest.raises(ChatTemplateError, match=r"not prefix-stable: messages\[:2\] .* assistant message 1 "):
        tok.encode_chat(CONV[1:])
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"messages": CONV}) + "\n")
    with pytest.raises(DataError, match=rf"^{path}:1: chat template is not prefix-stable"):
        build_sft_dataset(str(path), tok, seq_len=512)


def test_template_raise_exception_becomes_template_error(tmp_path):
    template = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}" \
               + CHATML_TEMPLATE
    tok = load_tokenizer("hf", make_tiny_hf_tokenizer(str(tmp_path / "t"), template))
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"messages": CONV}) + "\n" + json.dumps({"messages": CONV[1:]}) + "\n")
    with pytest.raises(DataError, match=rf"^{path}:1: chat template refused the conversation: no system role$"):
        build_sft_dataset(str(path), tok, seq_len=512)
    ds = build_sft_dataset(str(path), tok, seq_len=512, policy="skip")
    assert len(ds) == 1 and dict(ds.report.skipped) == {"template_error": 1}


def test_save_and_auto_load(hf_dirs, tmp_path):
    hf = load_tokenizer("hf", hf_dirs["llama3"])
    hf.save(str(tmp_path / "ckpt_hf"))
    again = load_tokenizer("auto", str(tmp_path / "ckpt_hf"))
    assert isinstance(again, HFTokenizer) and again.encode_chat(CONV) == hf.encode_chat(CONV)
    ByteTokenizer().save(str(tmp_path / "ckpt_byte"))
    assert isinstance(load_tokenizer("auto", str(tmp_path / "ckpt_byte")), ByteTokenizer)


def test_chat_template_jinja_file(hf_dirs, tmp_path):
    d = make_tiny_hf_tokenizer(str(tmp_path / "t"), None)
    with open(os.path.join(d, "chat_template.jinja"), "w") as f:
        f.write(LLAMA3_TEMPLATE)
    tok = load_tokenizer("hf", d)
    assert tok.render_chat(CONV[1:2]).startswith("<|start_header_id|>user<|end_header_id|>\n\nHello!<|eot_id|>")


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(DataError, match="unknown tokenizer kind 'sentencepiece'"):
        load_tokenizer("sentencepiece", None)
    with pytest.raises(DataError, match="needs a path"):
        load_tokenizer("hf", None)
    with pytest.raises(DataError, match="tokenizer directory not found"):
        load_tokenizer("hf", str(tmp_path / "missing"))
    with pytest.raises(DataError, match="no tokenizer.json in"):
        load_tokenizer("hf", str(tmp_path))
    with pytest.raises(DataError, match="no tokenizer found in"):
        load_tokenizer("auto", str(tmp_path))
    bad = make_tiny_hf_tokenizer(str(tmp_path / "bad"), "{% for m in messages %}{{ m.content }")
    with pytest.raises(DataError, match="chat template does not compile"):
        load_tokenizer("hf", bad)
