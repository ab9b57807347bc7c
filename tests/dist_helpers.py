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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, fn, world_size, port, outdir, args, init_pg):
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

    A failure on any rank raises here with that rank's traceback.
    """
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(
            _worker, args=(fn, world_size, free_port(), outdir, args, init_process_group),
            nprocs=world_size, join=True, start_method="spawn",
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
