"""Micro-batches (padding and packing), DP-invariant sampling, and exact resume."""
import json

import numpy as np
import pytest
import torch

from megarl.data.batching import Collator, DataIterator, GlobalBatchSampler, epoch_permutation
from megarl.data.datasets import SFTDataset, TokenStore, build_sft_dataset, pack_greedy
from megarl.data.errors import DataError
from megarl.data.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
PAD = TOK.pad_id


def item(tokens, mask, segments=None):
    n = len(tokens)
    return {"tokens": np.array(tokens, np.int32), "target_mask": np.array(mask, np.uint8),
            "segment_ids": np.array(segments if segments is not None else [0] * n, np.int32)}


def test_padding_mode_labels_are_next_tokens_and_mask_is_aligned():
    batch = Collator("sft", seq_len=6, pad_id=PAD)([item([10, 11, 12, 13], [0, 0, 1, 1]),
                                                    item([20, 21, 22, 23, 24, 25], [0, 1, 1, 0, 1, 1])])
    assert batch["tokens"].tolist() == [[10, 11, 12, 13, PAD, PAD], [20, 21, 22, 23, 24, 25]]
    assert batch["labels"].tolist() == [[11, 12, 13, PAD, PAD, PAD], [21, 22, 23, 24, 25, PAD]]
    # loss at t predicts token t+1: on where token t+1 is an assistant token
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 0, 0, 0], [1, 1, 0, 1, 1, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 4, 5]]
    assert batch["attention_mask"] is None
    assert batch["tokens"].dtype == torch.int64 and batch["loss_mask"].dtype == torch.float32


def test_packing_mode_boundaries():
    row = item([1, 2, 3, 4, 5, 6], [0, 1, 1, 0, 1, 1], segments=[0, 0, 0, 1, 1, 2])
    batch = Collator("sft", seq_len=8, pad_id=PAD, packed=True)([row])
    assert batch["tokens"].tolist() == [[1, 2, 3, 4, 5, 6, PAD, PAD]]
    assert batch["labels"].tolist() == [[2, 3, PAD, 5, PAD, PAD, PAD, PAD]]
    assert batch["loss_mask"].tolist() == [[1, 1, 0, 1, 0, 0, 0, 0]]  # zero across every boundary
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]
    seg = [0, 0, 0, 1, 1, 2, -1, -1]
    allowed = torch.tensor([[seg[i] == seg[j] and j <= i for j in range(8)] for i in range(8)])
    assert batch["attention_mask"].shape == (1, 1, 8, 8) and batch["attention_mask"].dtype == torch.bool
    assert torch.equal(batch["attention_mask"][0, 0], ~allowed)  # megatron: True = masked out
    assert not batch["attention_mask"][0, 0].all(dim=-1).any()  # every query sees at least itself


def _conversations(n, seed=0):
    rng = np.random.default_rng(seed)
    return [{"messages": [{"role": "user", "content": "q" * int(rng.integers(1, 12))},
                          {"role": "assistant", "content": f"a{i}" + "z" * int(rng.integers(0, 8))}]}
            for i in range(n)]


@pytest.fixture
def sft_file(tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in _conversations(40)))
    return str(path)


def test_real_conversation_mask_token_by_token(sft_file):
    ds = build_sft_dataset(sft_file, TOK, seq_len=64)
    batch = Collator("sft", 64, PAD)([ds[0]])
    n = len(ds[0]["tokens"])
    targets = batch["labels"][0][batch["loss_mask"][0] > 0]
    reply = json.loads(open(sft_file).readline())["messages"][1]["content"]
    assert TOK.decode(targets) == reply + "<|im_end|>"
    assert batch["labels"][0, n - 1:].eq(PAD).all() and batch["loss_mask"][0, n - 1:].eq(0).all()


def test_packed_dataset_holds_every_conversation_once(sft_file):
    plain = build_sft_dataset(sft_file, TOK, seq_len=96)
    packed = build_sft_dataset(sft_file, TOK, seq_len=96, packing=True)
    assert len(packed) < len(plain)
    rows = [packed[i] for i in range(len(packed))]
    assert all(len(r["tokens"]) <= 96 for r in rows)
    assert sum(int(r["segment_ids"].max()) + 1 for r in rows) == len(plain)
    flat = np.concatenate([r["tokens"] for r in rows])
    assert np.array_equal(flat, np.concatenate([plain[i]["tokens"] for i in range(len(plain))]))
    # The conversations of a packed row keep exactly the loss tokens they have alone.
    k = sum(int(r["segment_ids"].max()) + 1 for r in rows[:2])
    packed_batch = Collator("sft", 96, PAD, packed=True)(rows[:2])
    alone = Collator("sft", 96, PAD)([plain[i] for i in range(k)])
    assert packed_batch["loss_mask"].sum() == alone["loss_mask"].sum()
    assert [g.tolist() for g in pack_greedy([3, 3, 3, 5, 1], 6)] == [[0, 1], [2], [3, 4]]


def _global_batches(num_samples, mb, gbs, dp, steps, seed=0, consumed=0):
    """Global batches as concatenations of the DP shards in rank order."""
    samplers = [iter(GlobalBatchSampler(num_samples, mb, gbs, r, dp, seed, consumed_samples=consumed))
                for r in range(dp)]
    per_rank = gbs // (mb * dp)
    out = []
    for _ in range(steps):
        shards = [[i for _ in range(per_rank) for i in next(s)] for s in samplers]
        out.append([i for shard in shards for i in shard])
    return out


def test_global_batches_do_not_depend_on_dp_size():
    ref = _global_batches(103, mb=2, gbs=8, dp=1, steps=30)
    for dp, mb in ((2, 2), (4, 2), (2, 4), (8, 1)):
        assert _global_batches(103, mb=mb, gbs=8, dp=dp, steps=30) == ref
    # 103 // 8 = 12 batches per epoch: each epoch visits distinct samples, in a new order.
    epoch0, epoch1 = sum(ref[:12], []), sum(ref[12:24], [])
    assert len(set(epoch0)) == 96 and len(set(epoch1)) == 96 and epoch0 != epoch1
    assert epoch0 == epoch_permutation(103, 0, 0)[:96].tolist()


def test_dp_invariance_of_collated_batches(sft_file):
    ds = build_sft_dataset(sft_file, TOK, seq_len=64)
    ref = DataIterator(ds, micro_batch_size=4, global_batch_size=8, seed=3)
    ranks = [DataIterator(ds, micro_batch_size=2, global_batch_size=8, dp_rank=r, dp_size=2, seed=3) for r in (0, 1)]
    for _ in range(6):  # crosses the epoch boundary (40 samples = 5 global batches)
        whole = torch.cat([next(ref)["tokens"], next(ref)["tokens"]])
        parts = [torch.cat([next(it)["tokens"], next(it)["tokens"]]) for it in ranks]
        assert torch.equal(whole, torch.cat(parts))
    assert ref.consumed_samples == ranks[0].consumed_samples == 48 and ref.epoch == 1


def test_iterator_resume_is_exact(sft_file):
    ds = build_sft_dataset(sft_file, TOK, seq_len=64, packing=True)
    run = DataIterator(ds, micro_batch_size=2, global_batch_size=4, seed=7)
    for _ in range(5):
        next(run)
    state = run.state_dict()
    assert state == {"consumed_samples": 10, "seed": 7}
    expected = [next(run) for _ in range(12)]
    resumed = DataIterator(ds, micro_batch_size=2, global_batch_size=4, seed=7)
    resumed.load_state_dict(state)
    for want in expected:
        got = next(resumed)
        assert all(torch.equal(got[k], want[k]) for k in ("tokens", "labels", "loss_mask", "position_ids",
                                                           "attention_mask"))
    with pytest.raises(DataError, match="saved with seed 7"):
        DataIterator(ds, micro_batch_size=2, global_batch_size=4, seed=8).load_state_dict(state)


def test_resume_with_another_dp_size_and_workers():
    store = TokenStore.from_sequences([[i, i + 1, i + 2] for i in range(50)], [[0, 1, 1]] * 50)
    ds = SFTDataset(store, seq_len=4, pad_id=PAD)
    ref = DataIterator(ds, 2, 8, seed=1)
    want = [torch.cat([next(ref)["tokens"] for _ in range(4)]) for _ in range(9)]
    # Run 3 global batches on 1 rank, then resume on 2 ranks (one using a worker process).
    resumed = [DataIterator(ds, 2, 8, r, 2, seed=1, consumed_samples=24, num_workers=r) for r in (0, 1)]
    for g in range(3, 9):
        got = torch.cat([torch.cat([next(it)["tokens"] for _ in range(2)]) for it in resumed])
        assert torch.equal(got, want[g])


def test_sampler_argument_errors():
    with pytest.raises(DataError, match="not a multiple of micro_batch_size x dp_size = 6"):
        GlobalBatchSampler(100, 3, 8, dp_size=2)
    with pytest.raises(DataError, match="dataset has 5 samples, fewer than one global batch"):
        GlobalBatchSampler(5, 2, 8)
    with pytest.raises(DataError, match="consumed_samples 3 is not a multiple"):
        GlobalBatchSampler(100, 2, 8, consumed_samples=3)


def test_prompt_batches_for_rl(tmp_path):
    from megarl.data.datasets import build_prompt_dataset

    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(10)))
    ds = build_prompt_dataset(str(path), TOK, max_prompt_len=32)
    batch = next(DataIterator(ds, micro_batch_size=4, global_batch_size=4, seed=0))
    assert len(batch["prompt_ids"]) == 4 and len(batch["answers"]) == 4
    for ids, answer, msgs in zip(batch["prompt_ids"], batch["answers"], batch["messages"]):
        assert msgs[0]["content"] == f"q{answer}"
        assert TOK.decode(ids).endswith(f"q{answer}<|im_end|><|im_start|>assistant\n")
