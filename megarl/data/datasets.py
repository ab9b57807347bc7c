"""Tokenized datasets for SFT, preferences and RL prompts, built from JSONL files.

Sequences live in flat numpy arrays (TokenStore) so that the in-memory path and the preprocessed
memory-mapped shards (preprocess.py) are the same object, and the DataLoader and DALI paths read
identical samples. Items are dicts of 1-D numpy arrays; batching.Collator pads and shifts them.
"""
import bisect
import logging

import numpy as np
from torch.utils.data import Dataset

from megarl.data.chat import ChatTemplateError
from megarl.data.errors import DataError, Report
from megarl.data.formats import read_preferences, read_prompts, read_sft

logger = logging.getLogger(__name__)


class TokenStore:
    """Variable-length token sequences with per-token loss masks, in one or more shards.

    Shard k holds tokens (int32 [T]), masks (uint8 [T], 1 = an assistant token to learn) and
    offsets (int64 [n+1]): sequence i of the shard is tokens[offsets[i]:offsets[i+1]].
    """

    def __init__(self, shards: list[tuple[np.ndarray, np.ndarray, np.ndarray]]):
        self.shards = shards
        self.starts = np.cumsum([0] + [len(off) - 1 for _, _, off in shards]).tolist()

    @classmethod
    def from_sequences(cls, ids: list[list[int]], masks: list[list[int]]) -> "TokenStore":
        lengths = [len(x) for x in ids]
        offsets = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = np.fromiter((t for x in ids for t in x), dtype=np.int32, count=int(offsets[-1]))
        mask = np.fromiter((t for x in masks for t in x), dtype=np.uint8, count=int(offsets[-1]))
        return cls([(tokens, mask, offsets)])

    def __len__(self) -> int:
        return self.starts[-1]

    @property
    def lengths(self) -> np.ndarray:
        return np.concatenate([np.diff(off) for _, _, off in self.shards]) if self.shards else np.zeros(0, np.int64)

    def get(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        k = bisect.bisect_right(self.starts, i) - 1
        tokens, mask, offsets = self.shards[k]
        a, b = offsets[i - self.starts[k]], offsets[i - self.starts[k] + 1]
        return np.asarray(tokens[a:b]), np.asarray(mask[a:b])


def pack_greedy(lengths, capacity: int) -> list[np.ndarray]:
    """Group consecutive sequences into rows of at most `capacity` tokens (next-fit, in order).

    Next-fit is O(n) and deterministic; every sequence fits alone because loaders drop longer ones.
    """
    groups, current, used = [], [], 0
    for i, n in enumerate(lengths):
        if current and used + n > capacity:
            groups.append(np.asarray(current, dtype=np.int64))
            current, used = [], 0
        current.append(i)
        used += int(n)
    if current:
        groups.append(np.asarray(current, dtype=np.int64))
    return groups


def _row(store: TokenStore, indices) -> dict[str, np.ndarray]:
    parts = [store.get(int(i)) for i in indices]
    return {
        "tokens": np.concatenate([t for t, _ in parts]).astype(np.int32),
        "target_mask": np.concatenate([m for _, m in parts]).astype(np.uint8),
        "segment_ids": np.concatenate([np.full(len(t), s, np.int32) for s, (t, _) in enumerate(parts)]),
    }


class SFTDataset(Dataset):
    """Tokenized conversations. With packing, item i is a row of several whole conversations.

    Item: {"tokens": int32 [n], "target_mask": uint8 [n], "segment_ids": int32 [n]}, n <= seq_len;
    target_mask[t] = 1 when token t is an assistant token; segment_ids number the conversations.
    """

    kind = "sft"

    def __init__(self, store: TokenStore, seq_len: int, pad_id: int, packing: bool = False, report=None):
        self.store, self.seq_len, self.pad_id, self.packing, self.report = store, seq_len, pad_id, packing, report
        self.groups = pack_greedy(store.lengths, seq_len) if packing else None

    def __len__(self) -> int:
        return len(self.groups) if self.packing else len(self.store)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return _row(self.store, self.groups[i] if self.packing else [i])


class PreferenceDataset(Dataset):
    """Pairs of tokenized conversations; item keys are prefixed "chosen_" and "rejected_"."""

    kind = "preferences"
    packing = False

    def __init__(self, chosen: TokenStore, rejected: TokenStore, seq_len: int, pad_id: int, report=None):
        assert len(chosen) == len(rejected)
        self.chosen, self.rejected, self.seq_len, self.pad_id, self.report = chosen, rejected, seq_len, pad_id, report

    def __len__(self) -> int:
        return len(self.chosen)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        out = {f"chosen_{k}": v for k, v in _row(self.chosen, [i]).items()}
        out.update({f"rejected_{k}": v for k, v in _row(self.rejected, [i]).items()})
        return out


class PromptDataset(Dataset):
    """RL prompts rendered with the generation prompt. Item: {"prompt_ids", "answer", "messages"}."""

    kind = "prompts"
    packing = False

    def __init__(self, prompt_ids: list[list[int]], answers: list, messages: list, report=None):
        self.prompt_ids, self.answers, self.messages, self.report = prompt_ids, answers, messages, report

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def __getitem__(self, i: int) -> dict:
        return {"prompt_ids": self.prompt_ids[i], "answer": self.answers[i], "messages": self.messages[i]}


# ---------------------------------------------------------------------------- builders

def encode_record(tokenizer, messages, report: Report, line: int, limit: int, what: str = "",
                  add_generation_prompt: bool = False):
    """(ids, mask) for one conversation, or None after reporting a template or length problem."""
    try:
        ids, mask = tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt)
    except ChatTemplateError as e:
        report.problem(line, "template_error", str(e))
        return None
    if len(ids) > limit:
        report.problem(line, "too_long", f"{what}too long after tokenisation: {len(ids)} tokens > {limit}")
        return None
    return ids, mask


def tokenize_sft(records, tokenizer, seq_len: int, report: Report):
    """Yield (ids, mask) for each SFT record that fits in seq_len."""
    for rec in records:
        enc = encode_record(tokenizer, rec.messages, report, rec.line, seq_len)
        if enc is not None:
            yield enc


def tokenize_preferences(records, tokenizer, seq_len: int, report: Report):
    """Yield ((chosen ids, mask), (rejected ids, mask)) for each pair where both fit."""
    for rec in records:
        chosen = encode_record(tokenizer, rec.chosen, report, rec.line, seq_len, "chosen is ")
        if chosen is None:
            continue
        rejected = encode_record(tokenizer, rec.rejected, report, rec.line, seq_len, "rejected is ")
        if rejected is not None:
            yield chosen, rejected


def finish_report(report: Report, kept: int) -> Report:
    """Log the file's summary (as a warning when anything was skipped); fail if nothing is left."""
    assert kept == report.kept, (kept, report.kept)
    if kept == 0:
        raise DataError(f"{report.summary()}: no usable records")
    (logger.warning if report.noteworthy else logger.info)(report.summary())
    return report


def build_sft_dataset(path: str, tokenizer, seq_len: int, policy: str = "fail",
                      packing: bool = False) -> SFTDataset:
    """Read and tokenize an SFT JSONL file; conversations longer than seq_len are bad records."""
    report = Report(path, policy)
    pairs = list(tokenize_sft(read_sft(path, report), tokenizer, seq_len, report))
    finish_report(report, len(pairs))
    store = TokenStore.from_sequences([i for i, _ in pairs], [m for _, m in pairs])
    return SFTDataset(store, seq_len, tokenizer.pad_id, packing, report)


def build_preference_dataset(path: str, tokenizer, seq_len: int, policy: str = "fail") -> PreferenceDataset:
    """Read and tokenize a preference JSONL file; a pair is dropped if either side is too long."""
    report = Report(path, policy)
    pairs = list(tokenize_preferences(read_preferences(path, report), tokenizer, seq_len, report))
    finish_report(report, len(pairs))
    chosen = TokenStore.from_sequences([c[0] for c, _ in pairs], [c[1] for c, _ in pairs])
    rejected = TokenStore.from_sequences([r[0] for _, r in pairs], [r[1] for _, r in pairs])
    return PreferenceDataset(chosen, rejected, seq_len, tokenizer.pad_id, report)


def build_prompt_dataset(path: str, tokenizer, max_prompt_len: int, policy: str = "fail") -> PromptDataset:
    """Read RL prompts (JSONL or .txt) and render them with the generation prompt."""
    report = Report(path, policy)
    ids, answers, messages = [], [], []
    for rec in read_prompts(path, report):
        enc = encode_record(tokenizer, rec.messages, report, rec.line, max_prompt_len, "prompt is ",
                            add_generation_prompt=True)
        if enc is not None:
            ids.append(enc[0])
            answers.append(rec.answer)
            messages.append(rec.messages)
    finish_report(report, len(ids))
    return PromptDataset(ids, answers, messages, report)
