"""Run a function in N real processes over gloo, the way torchrun would, and collect results.

Usage in a test:
    def _body(rank, world_size, x):      # module-level, so spawn can import it
        ...                               # torch.distributed is initialised (gloo)
        return something_picklable
    results = run_distributed(_body, 2, x)   # list indexed by rank
"""
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Imported once by the fork server of a pytest process; each worker forks from it with them loaded
# (~0.1 s a run on 2 cores) instead of importing torch, megatron-core and megarl anew (~5 s).
FORKSERVER_PRELOAD = ["megarl.trainers.rl", "megarl.trainers.sft", "megarl.trainers.reward_model",
                      "megarl.trainers.pipeline", "dist_helpers"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, fn, world_size, port, outdir, args, init_pg, env):
    os.environ.clear()  # the caller's environment now (a monkeypatched variable included), not the fork server's
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)  # N processes share 2 cores
    if init_pg:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(outdir, f"{rank}.pt"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size, *args, init_process_group=True):
    """Spawn `world_size` processes running fn(rank, world_size, *args); return results by rank.

    A failure on any rank raises here with that rank's traceback. Workers start from a fork
    server (FORKSERVER_PRELOAD) where there is one, else by spawn: either way a fresh interpreter
    state with none of this process's changes but its environment, working directory and sys.path.
    """
    method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    if method == "forkserver":
        mp.set_forkserver_preload(FORKSERVER_PRELOAD)  # read when the server starts
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(
            _worker, args=(fn, world_size, free_port(), outdir, args, init_process_group, dict(os.environ)),
            nprocs=world_size, join=True, start_method=method,
        )
        return [torch.load(os.path.join(outdir, f"{r}.pt"), weights_only=False) for r in range(world_size)]


class megatron_attention:
    """Within the block, the models' self-attention runs megatron-core's own `SelfAttention.forward`
    (its RoPE, core attention and KV cache) instead of megarl's: the same module objects and
    parameters, with the class switched back to megarl's subclass's base. The independent
    reference for megarl.models.attention."""

    def __init__(self, models):
        self.models = list(models)

    def __enter__(self):
        from megatron.core.transformer.attention import SelfAttention

        self.swapped = [m for model in self.models for m in model.modules()
                        if isinstance(m, SelfAttention) and type(m) is not SelfAttention]
        self.classes = [type(m) for m in self.swapped]
        for m in self.swapped:
            m.__class__ = SelfAttention
        return self

    def __exit__(self, *exc):
        for m, cls in zip(self.swapped, self.classes):
            m.__class__ = cls
        return False


def rl_stage_steps(overrides, run_dir, steps=2, prepare=None):
    """In this (spawned) process: an RL stage of configs/tiny_grpo.yaml with `overrides` at their
    layout, `steps` loop steps; the figures a rerun must repeat (no perf/ or memory/) per step.
    prepare(stage): e.g. hooks on the roles before the first step."""
    from megarl.config import load_config
    from megarl.runtime.distributed import init_distributed, teardown
    from megarl.trainers.rl import RLStage

    cfg = load_config("configs/tiny_grpo.yaml", [f"train.run_dir={run_dir}", *overrides])
    init_distributed(cfg.parallel.tp, cfg.parallel.pp, seed=cfg.train.seed, ep=cfg.parallel.ep, etp=cfg.parallel.etp)
    stage = RLStage(cfg, str(run_dir / "rl"))
    if prepare is not None:
        prepare(stage)
    out = [{k: v for k, v in stage.step(i).items() if not k.startswith(("perf/", "memory/"))} for i in range(steps)]
    teardown()
    return out


def assert_same_figures(got, ref, name, *, clip_tol, rel=1e-5, abs_=1e-6):
    """Per-step figures of a layout against the reference run's: every key, within fp32 rounding;
    a clip indicator may flip on a token at the boundary (clip_tol); padding waste and the tokens
    shared prompts save are properties of each rank's micro-batches."""
    import pytest

    assert len(got) == len(ref), name
    for a, b in zip(got, ref):
        assert a.keys() == b.keys(), name
        for k in b:
            if k in ("train/padding_waste", "train/shared_prompt_fraction"):
                continue
            tol = dict(abs=clip_tol) if "clip_fraction" in k else dict(rel=rel, abs=abs_)
            assert a[k] == pytest.approx(b[k], **tol), (name, k, a[k], b[k])


def dp_microbatches(global_batch: dict, micro_batch_size: int) -> list[dict]:
    """This DP rank's share of a global batch (rows in rank order), cut into microbatches.

    Every tensor in `global_batch` has the global batch as dim 0; None values pass through.
    """
    from megatron.core import parallel_state as ps

    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    n = next(v.shape[0] for v in global_batch.values() if isinstance(v, torch.Tensor))
    per_rank = n // dp
    lo = rank * per_rank
    out = []
    for start in range(lo, lo + per_rank, micro_batch_size):
        out.append({k: (v[start:start + micro_batch_size] if isinstance(v, torch.Tensor) else v)
                    for k, v in global_batch.items()})
    return out


def full_gradients(role, microbatches, loss_fn, vocab_size):
    """The canonical gradients of one forward-backward of `role` (rank 0; None elsewhere),
    gathered through the same path as parameters; the role's weights are left as they were."""
    from megarl.models.layout import gather_full_state_dict, unwrap

    for c in role.chunks:
        c.zero_grad_buffer()
    role.forward_backward(microbatches, loss_fn)
    params = list(unwrap(role.model).parameters())
    saved = [p.detach().clone() for p in params]
    for p in params:
        p.data.copy_(p.main_grad)
    grads = gather_full_state_dict(role.model, vocab_size)
    for p, v in zip(params, saved):
        p.data.copy_(v)
    return grads


def masked_mse(values: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor):
    """Squared error of per-token values (critic regression), summed over masked-in tokens.

    values, targets, mask: [b, s].
    """
    m = mask.to(values.dtype)
    err = (values.float() - targets.float()) ** 2 * m
    loss_sum = 0.5 * err.sum()
    count = m.sum().to(torch.int)
    return loss_sum, count, {"value_loss": torch.stack([loss_sum.detach().double(), count.double()])}
