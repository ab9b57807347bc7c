"""torch.distributed + megatron-core parallel_state, from torchrun or SLURM environments.

One process per GPU (or per CPU worker). The rank layout is megatron-core's (tp fastest,
then cp, dp, pp), so every group comes from `parallel_state` and nothing here keeps its own.
"""
from __future__ import annotations

import datetime
import os
import random
import subprocess
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from megarl.runtime import cpu_compat


@dataclass(frozen=True)
class ProcessEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun", "slurm" or "single"


def _slurm_master_addr(environ) -> str:
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        return "127.0.0.1"
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, check=True, timeout=30)
        return out.stdout.split()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return nodelist.split(",")[0].split("[")[0]  # plain single-host lists


def process_env(environ=None) -> ProcessEnv:
    """Rank/world from torchrun (RANK...) or from srun (SLURM_PROCID...), else one process."""
    environ = os.environ if environ is None else environ
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return ProcessEnv(int(environ["RANK"]), int(environ["WORLD_SIZE"]),
                          int(environ.get("LOCAL_RANK", 0)), environ.get("MASTER_ADDR", "127.0.0.1"),
                          int(environ.get("MASTER_PORT", 29500)), "torchrun")
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        job = int(environ.get("SLURM_JOB_ID", "0") or 0)
        return ProcessEnv(int(environ["SLURM_PROCID"]), int(environ["SLURM_NTASKS"]),
                          int(environ.get("SLURM_LOCALID", 0)),
                          environ.get("MASTER_ADDR") or _slurm_master_addr(environ),
                          int(environ.get("MASTER_PORT", 20000 + job % 20000)), "slurm")
    port = int(environ["MASTER_PORT"]) if "MASTER_PORT" in environ else _free_port()  # lone runs never collide
    return ProcessEnv(0, 1, 0, "127.0.0.1", port, "single")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_ranks(environ=None) -> int:
    """How many ranks share this node (torchrun's LOCAL_WORLD_SIZE, srun's tasks per node), else 1."""
    environ = os.environ if environ is None else environ
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        if environ.get(key, "").isdigit():
            return max(1, int(environ[key]))
    per_node = environ.get("SLURM_TASKS_PER_NODE", "")  # "4" or "4(x2)"
    return max(1, int(per_node.split("(")[0])) if per_node.split("(")[0].isdigit() else 1


def cpu_threads(environ=None, cpus: int | None = None) -> tuple[int, str]:
    """(torch intra-op threads for this rank, why). OMP_NUM_THREADS when set; else this process's
    CPUs (its affinity: what taskset, cgroups or SLURM give it) shared by the node's ranks, less
    one left to the loop's other threads (tracking, data loading, checkpoint writes) and the
    machine's other work. An OpenMP team waits for its slowest thread at every op, so a thread
    that gets descheduled stalls them all, so a thread per core fighting the loop's own threads is
    far slower than one fewer. Fixed per machine, so a run's figures are too."""
    environ = os.environ if environ is None else environ
    given = environ.get("OMP_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) > 0:
        return int(given), "OMP_NUM_THREADS"
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    ranks = local_ranks(environ)
    return max(1, cpus // ranks - 1), f"{cpus} CPUs / {ranks} local rank(s), one left free"


def world_size_from_env(environ=None) -> int:
    """The world size before any process group exists (for config validation)."""
    return process_env(environ).world_size


def init_distributed(tp: int = 1, pp: int = 1, cp: int = 1, *, seed: int = 1234,
                     backend: str = "auto", timeout_minutes: int = 30, ep: int = 1,
                     etp: int | None = None) -> ProcessEnv:
    """Create the default process group and megatron-core's parallel groups, then seed.

    Idempotent for the default group: a caller (a test harness, an outer launcher) may have
    created it already. ep/etp: the experts' parallel sizes (megatron-core's expert groups).
    """
    from megatron.core import parallel_state

    env = process_env()
    torch.set_num_threads(cpu_threads()[0])
    cuda = torch.cuda.is_available()
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    else:
        cpu_compat.enable()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", env.master_addr)
        os.environ.setdefault("MASTER_PORT", str(env.master_port))
        dist.init_process_group(backend, rank=env.rank, world_size=env.world_size,
                                timeout=datetime.timedelta(minutes=timeout_minutes))
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
            expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    set_seed(seed)
    return env


def set_seed(seed: int) -> None:
    """Megatron's convention: the same base seed on every DP replica (identical dropout masks
    are not required, identical weights are), offset per pipeline stage; per-TP-rank streams
    come from the tensor-parallel RNG tracker."""
    from megatron.core import parallel_state, tensor_parallel

    stage_seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed)


def teardown(keep_process_group: bool = False) -> None:
    """Destroy megatron's groups and (unless kept, e.g. between the stages of a pipeline) the
    default group; safe to call twice."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized() and keep_process_group:
        dist.barrier()
    elif dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def device() -> torch.device:
    """Where this rank computes, and where collectives want their tensors (NCCL: CUDA; gloo: CPU)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def dp_group():
    """The data-parallel group (context parallel included) for statistics over the global batch;
    None in a single process (the algorithms then reduce locally)."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group(with_context_parallel=True) if dist.is_initialized() else None


def dp_sum(x: torch.Tensor) -> torch.Tensor:
    """x summed over the data-parallel ranks, in float64 on CPU."""
    y = x.detach().double()
    if dist.is_initialized():
        y = y.to(device())
        dist.all_reduce(y, group=dp_group())
    return y.cpu()


def dp_means(pairs: dict) -> dict:
    """{name: (sum, count)} on this rank -> {name: sum over DP ranks / count over DP ranks}."""
    if not pairs:
        return {}
    names = sorted(pairs)
    packed = dp_sum(torch.tensor([[float(pairs[k][0]), float(pairs[k][1])] for k in names], dtype=torch.float64))
    return {k: (packed[i, 0] / packed[i, 1].clamp(min=1)).item() for i, k in enumerate(names)}


def dp_max(value: float) -> float:
    """The largest of `value` over the data-parallel ranks."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=dp_group())
    return t.item()


def dp_gather_objects(obj) -> list:
    """[obj of DP rank 0, obj of DP rank 1, ...] on every rank (pickled; for small host data
    such as the rows RL's dynamic sampling moves between ranks)."""
    if not dist.is_initialized():
        return [obj]
    group = dp_group()
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_from_last_stage(value):
    """`value` from the last pipeline stage to every stage of this rank's pipeline.

    `value` may nest tensors in lists, tuples and dicts. Tensors travel as tensors (one
    broadcast each, after one small object broadcast of the structure and shapes); everything
    else is pickled with the structure. Other stages pass anything (it is ignored). Tensors
    that were on an accelerator come back on `device()`, the others on CPU.
    """
    from megatron.core import parallel_state as ps

    if not dist.is_initialized() or ps.get_pipeline_model_parallel_world_size() == 1:
        return value
    group, src = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_last_rank()
    last = ps.is_pipeline_last_stage()
    tensors: list[torch.Tensor] = []

    def strip(v):  # tensors -> placeholders recording shape and dtype
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            return _TensorSlot(tuple(v.shape), v.dtype, v.is_cuda)
        if isinstance(v, (list, tuple)):
            return type(v)(strip(x) for x in v)
        if isinstance(v, dict):
            return {k: strip(x) for k, x in v.items()}
        return v

    box = [strip(value) if last else None]
    dist.broadcast_object_list(box, src=src, group=group)
    skeleton, slots = box[0], []

    def collect(v):
        if isinstance(v, _TensorSlot):
            slots.append(v)
        elif isinstance(v, (list, tuple)):
            for x in v:
                collect(x)
        elif isinstance(v, dict):
            for x in v.values():
                collect(x)

    collect(skeleton)
    dev = device()
    received = []
    for i, slot in enumerate(slots):
        buf = tensors[i].to(dev).contiguous() if last else torch.empty(slot.shape, dtype=slot.dtype, device=dev)
        dist.broadcast(buf, src=src, group=group)
        received.append(buf if slot.on_cuda else buf.cpu())
    it = iter(received)

    def fill(v):
        if isinstance(v, _TensorSlot):
            return next(it)
        if isinstance(v, (list, tuple)):
            return type(v)(fill(x) for x in v)
        if isinstance(v, dict):
            return {k: fill(x) for k, x in v.items()}
        return v

    return fill(skeleton)


class _TensorSlot:
    __slots__ = ("shape", "dtype", "on_cuda")

    def __init__(self, shape, dtype, on_cuda):
        self.shape, self.dtype, self.on_cuda = shape, dtype, on_cuda
