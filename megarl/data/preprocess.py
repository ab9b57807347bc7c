"""Tokenize a JSONL dataset once into numpy shards that later runs memory-map.

Layout of out_dir (written atomically: a temporary directory renamed into place):
  index.json                          kind, seq_len, pad_id, vocab_size, counts, shard list, skip report
  shard_00000.{side}tokens.npy        int32 [T]    all token ids of the shard, concatenated
  shard_00000.{side}mask.npy          uint8 [T]    1 = assistant token (learned)
  shard_00000.{side}offsets.npy       int64 [n+1]  sequence i is tokens[offsets[i]:offsets[i+1]]
  tokenizer/                          the tokenizer's files, so the shards carry their vocabulary
where side is "" for SFT and "chosen." / "rejected." for preferences.
"""
import json
import os

import numpy as np

from megarl.utils.atomic import atomic_directory
from megarl.data.datasets import (PreferenceDataset, SFTDataset, TokenStore, finish_report, tokenize_preferences,
                                  tokenize_sft)
from megarl.data.errors import DataError, Report
from megarl.data.formats import read_preferences, read_sft

FORMAT = "megarl-token-shards"
SIDES = {"sft": ("",), "preferences": ("chosen.", "rejected.")}


def _write_shard(directory: str, name: str, side: str, seqs: list[tuple[list[int], list[int]]]) -> int:
    lengths = [len(ids) for ids, _ in seqs]
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.fromiter((t for ids, _ in seqs for t in ids), dtype=np.int32, count=int(offsets[-1]))
    mask = np.fromiter((m for _, ms in seqs for m in ms), dtype=np.uint8, count=int(offsets[-1]))
    for field, arr in (("tokens", tokens), ("mask", mask), ("offsets", offsets)):
        np.save(os.path.join(directory, f"{name}.{side}{field}.npy"), arr)
    return int(offsets[-1])


def preprocess(jsonl_path: str, out_dir: str, tokenizer, kind: str, seq_len: int, policy: str = "fail",
               shard_size: int = 100_000, overwrite: bool = False, show_progress: bool = False) -> dict:
    """Tokenize jsonl_path (kind "sft" or "preferences") into shards in out_dir; return the index.

    Bad records follow `policy` exactly as the in-memory loaders do, so both paths hold the same
    samples. show_progress: a tqdm bar (pass True on rank 0 only).
    """
    if kind not in SIDES:
        raise DataError(f"preprocess kind must be 'sft' or 'preferences', got {kind!r}")
    if os.path.exists(out_dir) and os.listdir(out_dir) and not overwrite:
        raise DataError(f"output directory is not empty: {out_dir} (pass overwrite=True to replace it)")
    from tqdm import tqdm

    report = Report(jsonl_path, policy)
    if kind == "sft":
        records = read_sft(jsonl_path, report)
        samples = ((s,) for s in tokenize_sft(records, tokenizer, seq_len, report))
    else:
        records = read_preferences(jsonl_path, report)
        samples = tokenize_preferences(records, tokenizer, seq_len, report)
    sides = SIDES[kind]
    shards, num_tokens = [], 0
    with atomic_directory(out_dir, replace=True) as tmp:
        buffer = []

        def flush():
            nonlocal num_tokens
            name = f"shard_{len(shards):05d}"
            tokens = [_write_shard(tmp, name, side, [s[j] for s in buffer]) for j, side in enumerate(sides)]
            shards.append({"name": name, "num_samples": len(buffer), "num_tokens": sum(tokens)})
            num_tokens += sum(tokens)
            buffer.clear()

        for sample in tqdm(samples, total=len(records), desc=f"tokenize {os.path.basename(jsonl_path)}",
                           disable=not show_progress, unit="rec"):
            buffer.append(sample)
            if len(buffer) == shard_size:
                flush()
        if buffer:
            flush()
        num_samples = sum(s["num_samples"] for s in shards)
        finish_report(report, num_samples)
        tokenizer.save(os.path.join(tmp, "tokenizer"))
        index = {"format": FORMAT, "version": 1, "kind": kind, "seq_len": seq_len, "pad_id": tokenizer.pad_id,
                 "vocab_size": tokenizer.vocab_size, "tokenizer_kind": tokenizer.kind,
                 "num_samples": num_samples, "num_tokens": num_tokens, "shards": shards,
                 "source": os.path.abspath(jsonl_path), "report": report.as_dict()}
        with open(os.path.join(tmp, "index.json"), "w") as f:
            json.dump(index, f, indent=1)
    return index


def read_index(out_dir: str) -> dict:
    path = os.path.join(out_dir, "index.json")
    if not os.path.isfile(path):
        raise DataError(f"no preprocessed data in {out_dir} (index.json missing; run preprocess first)")
    with open(path) as f:
        index = json.load(f)
    if index.get("format") != FORMAT:
        raise DataError(f"{path}: not a megarl token-shard index")
    return index


def load_preprocessed(out_dir: str, packing: bool = False, tokenizer=None):
    """Memory-map the shards of `out_dir` as an SFTDataset or PreferenceDataset.

    With a tokenizer, check that it is the one the shards were made with (same vocab and pad).
    """
    index = read_index(out_dir)
    if tokenizer is not None and (tokenizer.vocab_size, tokenizer.pad_id) != (index["vocab_size"], index["pad_id"]):
        raise DataError(f"{out_dir} was tokenized with vocab_size {index['vocab_size']}, pad_id {index['pad_id']}; "
                        f"this run's tokenizer has vocab_size {tokenizer.vocab_size}, pad_id {tokenizer.pad_id}")

    def store(side: str) -> TokenStore:
        return TokenStore([
            tuple(np.load(os.path.join(out_dir, f"{s['name']}.{side}{field}.npy"), mmap_mode="r")
                  for field in ("tokens", "mask", "offsets"))
            for s in index["shards"]])

    if index["kind"] == "sft":
        return SFTDataset(store(""), index["seq_len"], index["pad_id"], packing)
    if packing:
        raise DataError("packing applies to SFT data only, not preferences")
    return PreferenceDataset(store("chosen."), store("rejected."), index["seq_len"], index["pad_id"])
