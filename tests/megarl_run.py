"""Run the real `megarl` CLI in subprocesses (one process, or torchrun for several)."""
import json
import os
import subprocess
import sys

TINY = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.num_attention_heads=4",
        "model.num_kv_heads=2", "data.micro_batch_size=4", "data.global_batch_size=8", "train.log_interval=1",
        "tracking.backend=none", "sft.eval_samples=2", "sft.max_new_tokens=8", "lr_schedule.warmup_steps=1"]


def command(args, nproc: int = 1):
    if nproc == 1:
        return [sys.executable, "-m", "megarl.cli.main", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "megarl.cli.main", *args]


def env():
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    e.pop("RANK", None)
    e.pop("WORLD_SIZE", None)
    return e


def megarl(args, nproc: int = 1, timeout: int = 600, check: bool = True):
    out = subprocess.run(command(args, nproc), capture_output=True, text=True, timeout=timeout, env=env())
    if check and out.returncode != 0:
        raise AssertionError(f"megarl {' '.join(args)} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out


def metrics(stage_dir: str, wall_clock: bool = False) -> list[dict]:
    """metrics.jsonl's records; without wall_clock, the "perf/" figures (step times, tokens/s),
    which no two runs repeat, are left out so that runs can be compared exactly."""
    with open(os.path.join(stage_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    if wall_clock:
        return records
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in records]


def train_losses(stage_dir: str) -> list[float]:
    return [m["train/loss"] for m in metrics(stage_dir) if "train/loss" in m]


def final_weights(stage_dir) -> dict:
    """Every tensor of a stage's latest checkpoint (weights and optimizer state), read without
    starting processes."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    stage_dir = str(stage_dir)
    with open(os.path.join(stage_dir, "checkpoints", "latest")) as f:
        latest = f.read().strip()
    flat = os.path.join(stage_dir, "flat.pt")
    dcp_to_torch_save(os.path.join(stage_dir, "checkpoints", latest), flat)
    tensors = {k: v for k, v in torch.load(flat, weights_only=False).items() if isinstance(v, torch.Tensor)}
    assert any(".model." in k for k in tensors)
    return tensors
