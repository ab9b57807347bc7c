"""Tokenizers: a built-in byte-level one for offline tiny runs, and Hugging Face ones from a directory.

Both expose the same small interface the trainers use:
    vocab_size, pad_id, bos_id (may be None), eos_id (ends a reply: generation stops there),
    stop_ids (every id that may end a generated reply, the chat template's end-of-turn first),
    encode(text) -> ids, decode(ids) -> text,
    encode_chat(messages, add_generation_prompt=False) -> (ids, loss_mask),
    render_chat(messages, add_generation_prompt=False) -> text, save(dir).
Tool observations inside assistant text (GSM8K's `<<48/2=24>>`: `24>>`; `<output>...</output>`)
are tokenised as separate pieces and left out of the loss mask (megarl.data.chat.tool_segments).
Hugging Face tokenizers are read with the `tokenizers` library, so `transformers` is not needed at
run time; chat templates from tokenizer_config.json are rendered with jinja2 as transformers does.
"""
import json
import os
import shutil

from megarl.data.chat import (CHATML_END, CHATML_START, assistant_mask_by_prefixes, compile_jinja_template,
                              encode_with_observations, render_chatml, render_jinja)
from megarl.data.errors import DataError

MARKER_FILE = "megarl_tokenizer.json"  # written by ByteTokenizer.save so "auto" can recognise it


class ByteTokenizer:
    """UTF-8 bytes (ids 0-255) plus five special tokens; vocab_size 261.

    Chat format (ChatML without newlines between turns, to keep tiny sequences short):
        <|bos|><|im_start|>user\\n{content}<|im_end|><|im_start|>assistant\\n{content}<|im_end|>
    As in Qwen's instruct tokenizers, eos_id is <|im_end|>, the token that ends a reply, so
    generation that stops at eos_id stops at the end of the turn; <|endoftext|> is the
    document separator for plain text. Specials are only ever produced by the template, never
    parsed out of text, so data cannot inject them.
    """

    kind = "byte"
    SPECIALS = ("<|pad|>", "<|bos|>", "<|endoftext|>", CHATML_START, CHATML_END)

    def __init__(self):
        self.pad_id, self.bos_id, self.endoftext_id, self.im_start_id, self.im_end_id = range(256, 261)
        self.eos_id = self.im_end_id
        self.vocab_size = 256 + len(self.SPECIALS)
        self.stop_ids = (self.im_end_id, self.endoftext_id)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        out, buf = [], bytearray()
        for i in ids:
            i = int(i)
            if i < 256:
                buf.append(i)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf = bytearray()
            if not skip_special_tokens:
                out.append(self.SPECIALS[i - 256] if i < self.vocab_size else "\ufffd")
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = False):
        ids, mask = [self.bos_id], [0]
        for m in messages:
            head = [self.im_start_id] + self.encode(m["role"] + "\n")
            content, observed = encode_with_observations(self.encode, m["content"])
            ids += head + content + [self.im_end_id]
            learn = int(m["role"] == "assistant")
            mask += [0] * len(head) + [learn * (1 - o) for o in observed] + [learn]
        if add_generation_prompt:
            head = [self.im_start_id] + self.encode("assistant\n")
            ids += head
            mask += [0] * len(head)
        return ids, mask

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.decode(self.encode_chat(messages, add_generation_prompt)[0])

    def save(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, MARKER_FILE), "w") as f:
            json.dump({"kind": "byte", "vocab_size": self.vocab_size, "specials": list(self.SPECIALS)}, f, indent=1)


# Tokens that end an assistant turn in common chat templates; any present become stop ids.
_END_OF_TURN = (CHATML_END, "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>")
_HF_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _token_text(value) -> str | None:
    """tokenizer_config stores special tokens as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """A Hugging Face fast tokenizer read from a directory with tokenizer.json (+ tokenizer_config.json).

    pad_id falls back to eos_id when the tokenizer has no pad token (padding is always loss-masked).
    Conversations use the directory's chat template when it has one (tokenizer_config.json's
    "chat_template" or chat_template.jinja), else the built-in ChatML text template.
    """

    kind = "hf"

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self.path = path
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise DataError(f"no tokenizer.json in tokenizer directory {path}")
        try:
            self._tok = Tokenizer.from_file(tok_file)
        except Exception as e:  # the tokenizers library raises its own exception types
            raise DataError(f"cannot read {tok_file}: {str(e).splitlines()[0]}") from None
        config = {}
        cfg_file = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(cfg_file):
            try:
                with open(cfg_file) as f:
                    config = json.load(f)
            except json.JSONDecodeError as e:
                raise DataError(f"{cfg_file}:{e.lineno}: invalid JSON: {e.msg}") from None

        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        # Special tokens as the template sees them (bos_token, eos_token, ...), like transformers.
        self.special_tokens = {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            text = _token_text(config.get(key))
            if text is not None and text in vocab:
                self.special_tokens[key] = text
        eos = self.special_tokens.get("eos_token") or next((t for t in _END_OF_TURN if t in vocab), None)
        if eos is None:
            raise DataError(f"tokenizer in {path} has no eos_token (set it in tokenizer_config.json)")
        self.eos_id = vocab[eos]
        self.bos_id = vocab.get(self.special_tokens.get("bos_token"))
        self.pad_id = vocab.get(self.special_tokens.get("pad_token"), self.eos_id)
        known = [self.eos_id] + [vocab[t] for t in _END_OF_TURN if t in vocab]

        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        jinja_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_file):
            with open(jinja_file) as f:
                template = f.read()
        self.chat_template = template
        self._template = compile_jinja_template(template) if template else None
        # Stop generation at the template's end-of-turn token first: a base model's eos_token
        # (e.g. <|endoftext|>) is often not what its chat template ends replies with (<|im_end|>).
        self.stop_ids = tuple(dict.fromkeys([t for t in [self._end_of_turn(set(known))] if t is not None] + known))

    def _end_of_turn(self, candidates: set[int]) -> int | None:
        """The token the chat template closes an assistant reply with, if it is one of candidates."""
        probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
        try:
            ids, mask = assistant_mask_by_prefixes(self.render_chat, self.encode, probe, candidates)
        except DataError:
            return None
        last = max((i for i, m in enumerate(mask) if m), default=None)
        return ids[last] if last is not None and ids[last] in candidates else None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        if self._template is None:
            return render_chatml(messages, add_generation_prompt)
        return render_jinja(self._template, messages, add_generation_prompt, self.special_tokens)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = False):
        if add_generation_prompt:  # a prompt for generation: nothing to train on
            ids = self.encode(self.render_chat(messages, True))
            return ids, [0] * len(ids)
        def encode(text):  # piece by piece at tool observations, as the rollout tokenises them
            return encode_with_observations(self.encode, text)[0]

        ids, mask = assistant_mask_by_prefixes(self.render_chat, encode, messages, set(self.stop_ids))
        observed = encode_with_observations(self.encode, self.render_chat(messages, False))[1]
        return ids, [m * (1 - o) for m, o in zip(mask, observed)]

    def save(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        for name in _HF_FILES:
            src = os.path.join(self.path, name)
            if os.path.isfile(src) and os.path.abspath(src) != os.path.abspath(os.path.join(directory, name)):
                shutil.copyfile(src, os.path.join(directory, name))


def load_tokenizer(kind: str, path: str | None = None):
    """kind "byte" (path ignored), "hf" (path: a directory with tokenizer.json), or "auto" (detect
    from path: a directory written by ByteTokenizer.save, or one with tokenizer.json)."""
    if kind == "auto":
        if path and os.path.isfile(os.path.join(path, MARKER_FILE)):
            kind = "byte"
        elif path and os.path.isfile(os.path.join(path, "tokenizer.json")):
            kind = "hf"
        else:
            raise DataError(f"no tokenizer found in {path} (expected tokenizer.json or {MARKER_FILE})")
    if kind == "byte":
        return ByteTokenizer()
    if kind == "hf":
        if not path:
            raise DataError("tokenizer kind 'hf' needs a path to a directory with tokenizer.json")
        if not os.path.isdir(path):
            raise DataError(f"tokenizer directory not found: {path}")
        return HFTokenizer(path)
    raise DataError(f"unknown tokenizer kind {kind!r}: expected 'byte', 'hf' or 'auto'")
