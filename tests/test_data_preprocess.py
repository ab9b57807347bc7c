"""Preprocessing to numpy shards, and the DALI path yielding exactly the DataLoader's batches."""
import json
import os
import sys

import pytest
import torch

from megarl.data.batching import DataIterator
from megarl.data.datasets import build_preference_dataset, build_sft_dataset
from megarl.data.errors import DataError
from megarl.data.preprocess import load_preprocessed, preprocess, read_index
from megarl.config import SyntheticConfig
from megarl.data.synthetic import write_synthetic_dataset
from megarl.data.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def syn(tmp_path_factory):
    root = tmp_path_factory.mktemp("syn")
    paths = write_synthetic_dataset(str(root / "data"), SyntheticConfig(n_train=120, n_test=10, max_ops=3), seed=2)
    with open(paths["train_sft.jsonl"], "a") as f:  # one record too long for seq_len 96, one blank line
        f.write("\n" + json.dumps({"prompt": "x" * 200, "completion": "y"}) + "\n")
    shards = {}
    for kind, name in (("sft", "train_sft.jsonl"), ("preferences", "train_prefs.jsonl")):
        shards[kind] = str(root / f"shards_{kind}")
        preprocess(paths[name], shards[kind], TOK, kind, seq_len=96, policy="skip", shard_size=25)
    return paths, shards


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if a[k] is None or b[k] is None:
            assert a[k] is None and b[k] is None, k
        else:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_preprocess_writes_index_and_shards(syn):
    paths, shards = syn
    index = read_index(shards["sft"])
    memory = build_sft_dataset(paths["train_sft.jsonl"], TOK, seq_len=96, policy="skip")
    assert index["num_samples"] == len(memory) and index["report"] == memory.report.as_dict()
    assert index["report"]["skipped"].get("too_long", 0) >= 1 and index["report"]["blank"] == 1
    assert [s["num_samples"] for s in index["shards"]][0] == 25 and len(index["shards"]) == -(-len(memory) // 25)
    assert (index["kind"], index["seq_len"], index["pad_id"], index["vocab_size"]) == ("sft", 96, TOK.pad_id, 261)
    assert os.path.isfile(os.path.join(shards["sft"], "tokenizer", "megarl_tokenizer.json"))
    mapped = load_preprocessed(shards["sft"], tokenizer=TOK)
    for i in range(len(memory)):
        for k, v in memory[i].items():
            assert (mapped[i][k] == v).all()
    assert not [n for n in os.listdir(os.path.dirname(shards["sft"])) if ".tmp-" in n]


def test_preprocess_overwrite_failure_and_mismatch(syn, tmp_path):
    paths, shards = syn
    out = str(tmp_path / "out")
    preprocess(paths["test_sft.jsonl"], out, TOK, "sft", seq_len=256)
    with pytest.raises(DataError, match="output directory is not empty"):
        preprocess(paths["test_sft.jsonl"], out, TOK, "sft", seq_len=256)
    preprocess(paths["test_sft.jsonl"], out, TOK, "sft", seq_len=256, shard_size=3, overwrite=True)
    assert len(read_index(out)["shards"]) == 4
    # A bad record under "fail" leaves neither an output nor a temporary directory.
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [}\n')
    with pytest.raises(DataError, match=rf"^{bad}:1: invalid JSON"):
        preprocess(str(bad), str(tmp_path / "never"), TOK, "sft", seq_len=256)
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "out"]
    with pytest.raises(DataError, match="no preprocessed data in"):
        load_preprocessed(str(tmp_path))
    with pytest.raises(DataError, match="preprocess kind must be"):
        preprocess(paths["test_sft.jsonl"], str(tmp_path / "x"), TOK, "rl", seq_len=128)

    other = ByteTokenizer()
    other.vocab_size = 300
    with pytest.raises(DataError, match="tokenized with vocab_size 261"):
        load_preprocessed(out, tokenizer=other)


def test_missing_dali_is_a_clear_error(syn, monkeypatch):
    from megarl.data import dali

    monkeypatch.setitem(sys.modules, "nvidia.dali", None)
    with pytest.raises(DataError, match=r"pip install megarl\[dali\].*nvidia-dali-cuda130"):
        dali.DaliDataIterator(syn[1]["sft"], 2, 4)


def _dali():
    pytest.importorskip("nvidia.dali", reason="NVIDIA DALI not installed (pip install nvidia-dali-cuda130)")
    from megarl.data.dali import DaliDataIterator
    return DaliDataIterator


@pytest.mark.parametrize("kind,packing", [("sft", False), ("sft", True), ("preferences", False)])
def test_dali_batches_equal_dataloader_batches(syn, kind, packing):
    DaliDataIterator = _dali()
    paths, shards = syn
    if kind == "sft":
        ds = build_sft_dataset(paths["train_sft.jsonl"], TOK, seq_len=96, policy="skip", packing=packing)
    else:
        ds = build_preference_dataset(paths["train_prefs.jsonl"], TOK, seq_len=96, policy="skip")
    for rank in (0, 1):
        torch_it = DataIterator(ds, 2, 8, dp_rank=rank, dp_size=2, seed=11)
        dali_it = DaliDataIterator(shards[kind], 2, 8, dp_rank=rank, dp_size=2, seed=11, packing=packing)
        steps = 2 * len(ds) // 8 + 3  # more than two epochs of this rank's micro-batches
        for _ in range(steps):
            _same(next(torch_it), next(dali_it))
        assert dali_it.consumed_samples == torch_it.consumed_samples
        dali_it.close()


def test_dali_resume_and_worker_processes(syn):
    DaliDataIterator = _dali()
    paths, shards = syn
    ds = build_sft_dataset(paths["train_sft.jsonl"], TOK, seq_len=96, policy="skip")
    torch_it = DataIterator(ds, 4, 8, seed=5, consumed_samples=16)
    dali_it = DaliDataIterator(shards["sft"], 4, 8, seed=5, py_workers=1)  # parallel external_source
    for _ in range(3):
        next(dali_it)
    dali_it.load_state_dict({"consumed_samples": 16, "seed": 5})
    for _ in range(6):
        _same(next(torch_it), next(dali_it))
    assert dali_it.state_dict() == torch_it.state_dict() == {"consumed_samples": 40, "seed": 5}
    dali_it.close()
