"""LoRA adapters on megatron-core's linears: y = W x + (alpha / rank) B A dropout(x), W frozen.

The adapted linear is a subclass of the spec's own class (`ColumnParallelLinear`,
`RowParallelLinear`) swapped into the layer spec, so the base keeps its parameter names, TP
sharding and checkpoint keys, and every caller (training, scoring, the rollout engine's prefill
and decode steps) runs the adapters through the same modules. The adapters are its children
`lora_a` [rank, in] and `lora_b` [out, rank]. Tensor parallelism follows the base:
- a column-parallel base (linear_qkv, linear_fc1) splits its output rows, so B is a
  ColumnParallelLinear split like W's rows, and A is replicated: B's input copy (identity
  forward, all-reduce backward) sums grad(A) over TP;
- a row-parallel base (linear_proj, linear_fc2) splits its input columns, so A is a
  RowParallelLinear split like W's columns, whose forward all-reduces the [.., rank] partial
  sums (reduce-scatters them under sequence parallelism), and B is replicated.
Under sequence parallelism a replicated factor sees its rank's sequence shard only, so it is
tagged `sequence_parallel` and megatron-core's finalize_model_grads sums its gradient over TP
as it does the norms'. B starts at zero: the adapted model starts as the base model.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import nn

ADAPTER_KEYS = (".lora_a.", ".lora_b.")


def is_adapter(name: str) -> bool:
    """Whether parameter or state-dict key `name` is a LoRA factor."""
    return any(k in name for k in ADAPTER_KEYS)


@functools.cache
def lora_linear_class(base_cls):
    """`base_cls` (a megatron-core parallel linear) with a LoRA adapter; built lazily."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    column = issubclass(base_cls, ColumnParallelLinear)
    if not (column or issubclass(base_cls, RowParallelLinear)):
        raise TypeError(f"LoRA wraps megatron-core's parallel linears, not {base_cls.__name__}")

    class LoRALinear(base_cls):
        def __init__(self, input_size, output_size, *args, config, lora, lora_target: str, **kw):
            super().__init__(input_size, output_size, *args, config=config, **kw)
            self.lora_scale = lora.alpha / lora.rank
            self.lora_dropout = lora.dropout
            self.lora_enabled = True  # adapters_disabled() turns it off (the RL reference)
            self.lora_swiglu = lora_target == "linear_fc1" and config.gated_linear_unit
            dev, dtype = self.weight.device, config.params_dtype
            zeros = nn.init.zeros_  # layout.init_parameters sets the values layout-invariantly
            if column:
                self.lora_a = nn.Linear(input_size, lora.rank, bias=False, device=dev, dtype=dtype)
                self.lora_b = ColumnParallelLinear(lora.rank, output_size, config=config, init_method=zeros,
                                                   bias=False, gather_output=False, skip_bias_add=True)
                replicated = self.lora_a.weight
            else:
                self.lora_a = RowParallelLinear(input_size, lora.rank, config=config, init_method=zeros, bias=False,
                                                input_is_parallel=True, skip_bias_add=True)
                self.lora_b = nn.Linear(lora.rank, output_size, bias=False, device=dev, dtype=dtype)
                replicated = self.lora_b.weight
            replicated.sequence_parallel = config.sequence_parallel  # see the module docstring

        def forward(self, input_, *args, **kw):
            out, bias = super().forward(input_, *args, **kw)
            if not self.lora_enabled:
                return out, bias
            x = F.dropout(input_, self.lora_dropout, self.training) if self.lora_dropout else input_
            if column:
                delta, _ = self.lora_b(self.lora_a(x))
            else:
                h, _ = self.lora_a(x)
                delta = self.lora_b(h)
            return torch.add(out, delta, alpha=self.lora_scale), bias  # one temporary, not two

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            """The base's, with the split factor sharded as its own layer (the base's call would
            save it as replicated) and fc1's B split per SwiGLU half as fc1's weight is."""
            sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
            name = "lora_b" if column else "lora_a"
            for key in [k for k in sd if k.startswith(f"{prefix}{name}.")]:
                del sd[key]
            sub = getattr(self, name).sharded_state_dict(f"{prefix}{name}.", sharded_offsets, metadata)
            if self.lora_swiglu:
                from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

                key = f"{prefix}lora_b.weight"
                sub[key] = apply_swiglu_sharded_factory(sub[key], sharded_offsets)
            sd.update(sub)
            return sd

    LoRALinear.__name__ = LoRALinear.__qualname__ = f"LoRA{base_cls.__name__}"
    return LoRALinear


def apply_to_spec(spec, lora) -> None:
    """Swap the adapted linears of `lora.targets` into a local layer spec, in place."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    holders = {"linear_qkv": spec.submodules.self_attention.submodules,
               "linear_proj": spec.submodules.self_attention.submodules,
               "linear_fc1": spec.submodules.mlp.submodules, "linear_fc2": spec.submodules.mlp.submodules}
    for target in lora.targets:
        holder = holders[target]
        base = getattr(holder, target)
        setattr(holder, target, ModuleSpec(module=lora_linear_class(base), params={"lora": lora, "lora_target": target}))


def adapted_linears(model) -> list:
    return [m for m in model.modules() if hasattr(m, "lora_enabled")]


@contextlib.contextmanager
def adapters_disabled(model):
    """The base model: every adapter of `model` off inside the block (the RL reference)."""
    mods = adapted_linears(model)
    states = [m.lora_enabled for m in mods]
    try:
        for m in mods:
            m.lora_enabled = False
        yield
    finally:
        for m, s in zip(mods, states):
            m.lora_enabled = s


def merge(canonical: dict, lora) -> dict:
    """Canonical tensors (models/layout.py) with every adapter folded into its base weight,
    W + (alpha / rank) B A, and the adapter tensors dropped: the dense model, in float32."""
    scale = lora.alpha / lora.rank
    out = {k: v for k, v in canonical.items() if not is_adapter(k)}
    for name in canonical:
        if name.endswith(".lora_a.weight"):
            base = name[: -len(".lora_a.weight")]
            a, b = canonical[name].double(), canonical[f"{base}.lora_b.weight"].double()
            out[f"{base}.weight"] = (out[f"{base}.weight"].double() + scale * (b @ a)).float()
    return out


def adapter_param_count(mc, tp: int = 1, pp: int = 1) -> int:
    """Adapter parameters of one TP rank on one pipeline stage, for the memory estimate."""
    lora = mc.lora
    h, hd = mc.hidden_size, mc.head_dim or mc.hidden_size // mc.num_attention_heads
    kv = mc.num_kv_heads or mc.num_attention_heads
    dims = {"linear_qkv": (h, (mc.num_attention_heads + 2 * kv) * hd, True),
            "linear_proj": (mc.num_attention_heads * hd, h, False),
            "linear_fc1": (h, 2 * mc.ffn_hidden_size, True), "linear_fc2": (mc.ffn_hidden_size, h, False)}
    per_layer = 0
    for t in lora.targets:
        fan_in, fan_out, column = dims[t]
        per_layer += lora.rank * (fan_in + fan_out // tp if column else fan_in // tp + fan_out)
    return per_layer * (mc.num_layers // pp)
