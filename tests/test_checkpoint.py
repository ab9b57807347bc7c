"""Distributed checkpoints: loading into another layout, and every failure path."""
import os

import pytest
import torch

import test_layout_parity as P
from dist_helpers import run_distributed


def _role(tp, pp, seed=5):
    from megarl.roles.role import Role

    model, parallel, optim, sched = P._configs(tp, pp)
    return Role("policy", model, parallel, head="lm", optim=optim, schedule=sched, train_steps=6, seed=seed)


def _loss(batch, logits):
    from megarl.algorithms.losses import masked_nll
    from megarl.trainers.common import token_logprobs

    return masked_nll(token_logprobs(logits, batch["labels"], P.VOCAB), batch["loss_mask"])


def _step(role, step):
    from dist_helpers import dp_microbatches

    return role.train_step(dp_microbatches(P._global_batch(step), P.MBS), _loss).metrics["loss"]


def _save_body(rank, world, tp, pp, root):
    """Train 2 steps, checkpoint, then train one more: the reference for the continuation."""
    from megarl.checkpoint.distributed import save_checkpoint
    from megarl.models.layout import gather_full_state_dict
    from megarl.runtime.distributed import init_distributed, teardown

    init_distributed(tp, pp, seed=11)
    role = _role(tp, pp)
    _step(role, 0), _step(role, 1)
    save_checkpoint(root, 2, {"policy": role}, {"data": {"consumed_samples": 16}})
    saved = gather_full_state_dict(role.model, P.VOCAB)
    loss = _step(role, 2)
    after = gather_full_state_dict(role.model, P.VOCAB)
    teardown()
    return {"saved": saved, "loss": loss, "after": after}


def _load_body(rank, world, tp, pp, root):
    from megarl.checkpoint.distributed import latest_checkpoint, load_checkpoint
    from megarl.models.layout import gather_full_state_dict
    from megarl.runtime.distributed import init_distributed, teardown

    init_distributed(tp, pp, seed=11)
    role = _role(tp, pp, seed=999)  # different init: everything must come from the checkpoint
    state = load_checkpoint(latest_checkpoint(root), {"policy": role})
    loaded = gather_full_state_dict(role.model, P.VOCAB)
    loss = _step(role, 2)
    after = gather_full_state_dict(role.model, P.VOCAB)
    teardown()
    return {"state": state, "loaded": loaded, "loss": loss, "after": after}


def _close(a, b):
    return (a - b).abs().max().item() <= 1e-5 * b.abs().max().item()


@pytest.mark.slow
@pytest.mark.parametrize("src,dst", [((2, 1, 1), (1, 1, 1)), ((1, 1, 1), (2, 1, 1)), ((1, 2, 1), (1, 1, 1)),
                                     ((1, 1, 1), (1, 1, 2))], ids=["tp2-tp1", "tp1-tp2", "pp2-pp1", "dp1-dp2"])
def test_load_into_another_layout(tmp_path, src, dst):
    root = str(tmp_path / "ckpt")
    saved = run_distributed(_save_body, src[0] * src[1] * src[2], src[0], src[1], root)[0]
    got = run_distributed(_load_body, dst[0] * dst[1] * dst[2], dst[0], dst[1], root)[0]
    assert got["state"]["data"] == {"consumed_samples": 16} and got["state"]["step"] == 2
    for k, v in saved["saved"].items():
        assert torch.equal(got["loaded"][k], v), f"weights of {k} changed in resharding"
    # The continuation matches: the optimizer state (Adam moments, step) was resharded too.
    assert got["loss"] == pytest.approx(saved["loss"], rel=1e-5)
    for k, v in saved["after"].items():
        assert _close(got["after"][k], v), k


def _failures_body(rank, world, root):
    from megarl.checkpoint import distributed as ck
    from megarl.runtime.distributed import init_distributed, teardown

    init_distributed(1, 1, seed=11)
    role = _role(1, 1)
    out = {}
    for step in (1, 2, 3):
        _step(role, step)
        ck.save_checkpoint(root, step, {"policy": role}, {"n": step}, keep_last=2)
    out["kept"] = sorted(os.listdir(root))

    # A crash after the shards are written but before the manifest: latest stays at step 3.
    real = ck._fsync_tree
    ck._fsync_tree = lambda path: (_ for _ in ()).throw(OSError("disk vanished"))
    try:
        ck.save_checkpoint(root, 4, {"policy": role}, {"n": 4})
    except OSError:
        pass
    ck._fsync_tree = real
    out["after_crash_latest"] = ck.latest_checkpoint(root)
    out["debris"] = sorted(d for d in os.listdir(root) if d.startswith(".tmp"))
    out["state_after_crash"] = ck.load_checkpoint(out["after_crash_latest"], {"policy": role})
    # The next save clears the debris of the crashed one.
    ck.save_checkpoint(root, 4, {"policy": role}, {"n": 4}, keep_last=3)
    out["debris_after_next_save"] = sorted(d for d in os.listdir(root) if d.startswith(".tmp"))

    def error(fn):
        try:
            fn()
        except ck.CheckpointError as e:
            return str(e)
        return None

    s4 = os.path.join(root, "step_00000004")
    shard = next(f for f in sorted(os.listdir(s4)) if f.endswith(".distcp"))
    with open(os.path.join(s4, shard), "r+b") as f:  # a torn write
        f.truncate(10)
    out["corrupt"] = error(lambda: ck.latest_checkpoint(root))
    os.remove(os.path.join(s4, shard))
    out["missing"] = error(lambda: ck.verify_checkpoint(s4))
    os.remove(os.path.join(root, "step_00000003", ck.MANIFEST))
    out["incomplete"] = error(lambda: ck.verify_checkpoint(os.path.join(root, "step_00000003")))
    out["wrong_role"] = error(lambda: ck.load_checkpoint(os.path.join(root, "step_00000002"), {"critic": role}))
    teardown()
    return out


def test_atomic_saves_and_failure_paths(tmp_path):
    root = str(tmp_path / "ckpt")
    out = run_distributed(_failures_body, 1, root)[0]
    assert out["kept"] == ["latest", "step_00000002", "step_00000003"]  # keep_last=2
    assert out["after_crash_latest"].endswith("step_00000003")
    assert out["debris"] == [".tmp-step_00000004"] and out["debris_after_next_save"] == []
    assert out["state_after_crash"]["n"] == 3
    assert "step_00000004: corrupt checkpoint" in out["corrupt"] and "bytes, expected" in out["corrupt"]
    assert "last good checkpoint:" in out["corrupt"] and out["corrupt"].endswith("step_00000003")
    assert "corrupt checkpoint, missing file" in out["missing"]
    assert "incomplete checkpoint (no megarl_manifest.json" in out["incomplete"]
    assert "has no role(s) critic (saved: policy)" in out["wrong_role"]
    assert all("\n" not in v for k, v in out.items() if isinstance(v, str))


def _async_body(rank, world, root):
    """Save asynchronously at step 2 and keep training while the background write runs."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from megarl.checkpoint.distributed import latest_checkpoint, load_checkpoint, save_checkpoint
    from megarl.models.layout import gather_full_state_dict
    from megarl.runtime.distributed import init_distributed, teardown

    init_distributed(2, 1, seed=11)
    role = _role(2, 1)
    _step(role, 0), _step(role, 1)
    saved = gather_full_state_dict(role.model, P.VOCAB)
    queue, published = AsyncCallsQueue(), []
    path = save_checkpoint(root, 2, {"policy": role}, {"data": {"consumed_samples": 16}}, async_queue=queue,
                           on_durable=published.append)
    latest_while_writing = latest_checkpoint(root)  # nothing is published before finalization
    _step(role, 2), _step(role, 3)  # in-place updates of the saved parameters and Adam moments
    queue.maybe_finalize_async_calls(blocking=True)
    moved = gather_full_state_dict(role.model, P.VOCAB)
    fresh = _role(2, 1, seed=999)
    state = load_checkpoint(latest_checkpoint(root), {"policy": fresh})
    loaded = gather_full_state_dict(fresh.model, P.VOCAB)
    teardown()
    return {"saved": saved, "moved": moved, "loaded": loaded, "state": state, "path": path,
            "published": published, "latest_while_writing": latest_while_writing}


@pytest.mark.slow
def test_async_save_snapshots_the_step_it_was_called_at(tmp_path):
    root = str(tmp_path / "ckpt")
    outs = run_distributed(_async_body, 2, root)
    got = outs[0]
    assert got["latest_while_writing"] is None
    assert [o["published"] for o in outs] == [[got["path"]]] * 2  # on_durable ran once on every rank
    assert got["state"]["step"] == 2 and got["state"]["data"] == {"consumed_samples": 16}
    assert any(not torch.equal(got["moved"][k], v) for k, v in got["saved"].items())
    for k, v in got["saved"].items():
        assert torch.equal(got["loaded"][k], v), f"{k}: the checkpoint holds later updates"
    assert sorted(os.listdir(root)) == ["latest", "step_00000002"]
