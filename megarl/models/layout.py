"""Map a rank's parameter shards to and from full, layout-independent tensors.

A *canonical* parameter is what a TP=1, PP=1 model holds: global layer numbers, the real
(unpadded) vocabulary, megatron-core local-spec names. Everything that must not depend on the
parallel layout goes through here: initialisation (the same weights whatever TP/PP/DP),
gathering full parameters (tests, export), and loading full tensors (import).

TP sharding follows megatron-core's attributes (`tensor_model_parallel`, `partition_dim`),
with two layouts that are not a plain chunk:
  * vocabulary rows: padded to a TP multiple; the canonical tensor keeps the real rows only;
  * SwiGLU fc1: each rank holds [gate_r; up_r], so the full [gate; up] is chunked per half.
MoE experts: a rank holds its expert-parallel share of the experts (`local_experts.i` is global
expert `mlp.local_expert_indices[i]`), split over the expert-TP group rather than the TP group.
"""
from __future__ import annotations

import math
import re
import zlib
from collections.abc import Mapping

import torch
import torch.distributed as dist

# Transformer Engine fuses the pre-norms into the following linear; canonical names are local-spec.
_TE_RENAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
_SCALED_INIT = ("linear_proj.weight", "linear_fc2.weight")  # residual-branch outputs


def unwrap(model):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


_LOCAL_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.")


def canonical_name(model, local_name: str) -> str:
    """'decoder.layers.0.x' on pipeline stage 1 of 2 (4 layers) -> 'decoder.layers.2.x';
    '...mlp.experts.local_experts.1.y' on expert-parallel rank 1 of 2 (4 experts) -> '...local_experts.3.y'."""
    name = local_name
    for te, local in _TE_RENAMES.items():
        name = name.replace(te, local)
    if name.startswith("decoder.layers."):
        idx, rest = name[len("decoder.layers."):].split(".", 1)
        layer = model.decoder.layers[int(idx)]
        expert = _LOCAL_EXPERT.match(rest)
        if expert:
            rest = (f"mlp.experts.local_experts.{layer.mlp.local_expert_indices[int(expert.group(1))]}."
                    + rest[expert.end():])
        return f"decoder.layers.{layer.layer_number - 1}.{rest}"
    if name == "output_layer.weight" and getattr(model, "share_embeddings_and_output_weights", False):
        return "embedding.word_embeddings.weight"  # the last stage's copy of the tied embedding
    return name


def split_kind(name: str, param) -> tuple[str | None, int]:
    """(kind, dim): kind is None (replicated), 'chunk', 'vocab' or 'swiglu'."""
    if not getattr(param, "tensor_model_parallel", False):
        return None, 0
    dim = param.partition_dim
    if name.endswith("word_embeddings.weight") or name == "output_layer.weight":
        return "vocab", dim
    if name.endswith(("linear_fc1.weight", "linear_fc1.lora_b.weight")):  # LoRA's B: split as fc1's rows
        return "swiglu", dim
    return "chunk", dim


def full_shape(local_shape, kind, dim, tp: int, vocab_size: int) -> tuple:
    shape = list(local_shape)
    if kind == "vocab":
        shape[dim] = vocab_size
    elif kind is not None:
        shape[dim] *= tp
    return tuple(shape)


def shard(full: torch.Tensor, kind, dim: int, tp_rank: int, tp: int, local_shape) -> torch.Tensor:
    """This TP rank's piece of a canonical tensor, in the local parameter's shape."""
    if kind is None:
        return full
    if kind == "vocab":
        rows = local_shape[dim]
        out = full.new_zeros(local_shape)  # padded rows stay zero and are masked out of softmax
        start, stop = tp_rank * rows, min((tp_rank + 1) * rows, full.shape[dim])
        if stop > start:
            out.narrow(dim, 0, stop - start).copy_(full.narrow(dim, start, stop - start))
        return out
    if kind == "swiglu":
        gate, up = full.chunk(2, dim)
        return torch.cat([gate.chunk(tp, dim)[tp_rank], up.chunk(tp, dim)[tp_rank]], dim)
    return full.chunk(tp, dim)[tp_rank]


def unshard(shards: list[torch.Tensor], kind, dim: int, vocab_size: int) -> torch.Tensor:
    """Inverse of `shard` given every TP rank's piece in rank order."""
    if kind is None:
        return shards[0]
    if kind == "vocab":
        return torch.cat(shards, dim).narrow(dim, 0, vocab_size)
    if kind == "swiglu":
        halves = [s.chunk(2, dim) for s in shards]
        return torch.cat([torch.cat([h[0] for h in halves], dim), torch.cat([h[1] for h in halves], dim)], dim)
    return torch.cat(shards, dim)


def is_expert(param) -> bool:
    """An expert's parameter: megatron-core reduces its gradient over the expert-data-parallel
    group, not the data-parallel one (`allreduce` False)."""
    return not getattr(param, "allreduce", True)


def _tp(param=None):
    """(rank, size) of the tensor-parallel group `param` is split over (the expert-TP group for
    an expert's parameter)."""
    from megatron.core import parallel_state as ps

    if param is not None and is_expert(param):
        return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def init_full(canon: str, shape, *, seed: int, std: float, num_layers: int) -> torch.Tensor:
    """The canonical initial value of one parameter: a pure function of (seed, name, shape).

    Norm weights 1, biases 0, residual-branch outputs N(0, std/sqrt(2L)) as in Megatron/GPT-2,
    other matrices N(0, std). float32; callers cast to the parameter dtype.
    """
    if canon.endswith("norm.weight"):
        return torch.ones(shape)
    if canon.endswith(("bias", "lora_b.weight")):  # LoRA's B at zero: the adapted model starts as the base
        return torch.zeros(shape)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(canon.encode())) % (2**63))
    scale = std / math.sqrt(2 * num_layers) if canon.endswith(_SCALED_INIT) else std
    if canon.endswith("lora_a.weight"):  # 1/sqrt(fan-in), as peft's A: B's gradient does not vanish
        scale = 1.0 / math.sqrt(shape[-1])
    return torch.randn(shape, generator=gen) * scale


@torch.no_grad()
def init_parameters(model, *, seed: int, std: float, num_layers: int, vocab_size: int, tied: bool) -> None:
    """Give every local shard its slice of the canonical initial tensors (layout-invariant)."""
    model = unwrap(model)
    for name, p in model.named_parameters():
        tp_rank, tp = _tp(p)
        canon = canonical_name(model, name)
        kind, dim = split_kind(name, p)
        full = init_full(canon, full_shape(p.shape, kind, dim, tp, vocab_size), seed=seed, std=std, num_layers=num_layers)
        p.copy_(shard(full, kind, dim, tp_rank, tp, p.shape))


@torch.no_grad()
def load_full_state_dict(model, full: Mapping[str, torch.Tensor], vocab_size: int, skip_prefixes: tuple = ()) -> None:
    """Copy canonical tensors into this rank's shards; every local parameter must be present,
    except those under `skip_prefixes` (e.g. a reward model's fresh "output_layer." head).

    Only this rank's parameters are looked up, each once when copied, so a lazy mapping
    (checkpoint.hf.LazyCanonical) reads only this pipeline stage's tensors; its `shape_of`
    serves the shape checks, which all pass before anything is copied."""
    model = unwrap(model)
    from megarl.models.lora import is_adapter

    base_only = not any(is_adapter(k) for k in full)  # a base model's tensors: LoRA adapters keep their init
    params = [(n, p) for n, p in model.named_parameters() if not n.startswith(tuple(skip_prefixes))
              and not (base_only and is_adapter(n))]
    missing, wrong = [], []
    for name, p in params:
        canon = canonical_name(model, name)
        kind, dim = split_kind(name, p)
        tp = _tp(p)[1]
        if canon not in full:
            missing.append(canon)
            continue
        want = full_shape(p.shape, kind, dim, tp, vocab_size)
        got = tuple(full.shape_of(canon) if hasattr(full, "shape_of") else full[canon].shape)
        if got != want:
            wrong.append(f"{canon}: expected {list(want)}, got {list(got)}")
    if missing or wrong:
        raise ValueError("cannot load weights: " + "; ".join(
            ([f"missing {', '.join(missing)}"] if missing else []) + wrong))
    for name, p in params:
        kind, dim = split_kind(name, p)
        tp_rank, tp = _tp(p)
        p.copy_(shard(full[canonical_name(model, name)].to(p.dtype), kind, dim, tp_rank, tp, p.shape))


@torch.no_grad()
def gather_full_state_dict(model, vocab_size: int) -> dict[str, torch.Tensor] | None:
    """All canonical parameters (float32, CPU) on global rank 0; None on other ranks.

    All-gathers over TP, then collects pipeline stages on rank 0. Meant for tests, export and
    small models: rank 0 holds the full model in host memory.
    """
    from megatron.core import parallel_state as ps

    model = unwrap(model)
    first_replica = ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0
    # experts: one copy per expert-data-parallel group, each expert-parallel rank holding its share
    first_expert_replica = ps.get_expert_data_parallel_rank() == 0 and ps.get_expert_tensor_parallel_rank() == 0
    stage: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        kind, dim = split_kind(name, p)
        _, tp = _tp(p)
        group = ps.get_expert_tensor_parallel_group() if is_expert(p) else ps.get_tensor_model_parallel_group()
        data = p.detach().to("cpu", torch.float32, copy=True)  # never alias live parameters
        if kind is not None and tp > 1:
            shards = [torch.empty_like(data) for _ in range(tp)]
            dist.all_gather(shards, data.contiguous(), group=group)
        else:
            shards = [data]
        if first_expert_replica if is_expert(p) else first_replica:
            stage[canonical_name(model, name)] = unshard(shards, kind, dim, vocab_size)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return stage
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(stage, gathered, dst=0)
    if dist.get_rank() != 0:
        return None
    merged: dict[str, torch.Tensor] = {}
    for part in gathered:
        for k, v in part.items():
            merged.setdefault(k, v)
    return merged
