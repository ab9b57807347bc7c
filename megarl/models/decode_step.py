"""One decode step (one new token per row over the KV cache) on the model's own modules'
tensors, without megatron-core's per-module call chain.

A decode step multiplies a few rows by every weight. There, the Python around the maths costs
as much as some of the maths: megatron-core's TransformerLayer reaches its GEMMs through about
30 module calls, autograd-Function wrappers (also under no_grad) and argument plumbing per layer.
With a model too small to compute anything, a decode step of the realistic benchmark's shape
(4 layers, 16 rows) took 3.6-3.8 ms on one CPU core, 2.4-2.7 ms with this path; whole generate
phases took 0.90-0.93x of their time (docs/benchmarks.md).
`decode_logits` runs the same torch operations, in the same order, on the same tensors as
megatron-core's modules and megarl's attention do for this case (megatron-core 0.16's
TransformerLayer, MLP, Column/RowParallelLinear), so the logits are the same bits; only the calls
in between are gone. tests/test_decode_step.py compares the two paths for every configuration
`plan` accepts.

Native layers. With `plan(model, out_major, native=True)` (the rollout engine's default where the
layers' linears run megarl._cpu's kernel, an AMD CPU: models/cpu_gemm.py), a decode step of 1-64
rows at TP 1 in fp32 runs each layer as one call of megarl._cpu.decode_layer
(csrc/cpu_decode_layer.cpp): the same maths on the same weights ([out, in] memory, the kernel's
GEMMs and decode attention), the elementwise work in C++ loops instead of ~70 torch operations.
Its results differ from the torch path's in the last bits (RMSNorm sums its squares in double):
tests/test_decode_layer.py holds the kernel to a float64 layer, tests/test_decode_step.py its
logits and cache to the model's within fp32 rounding. A decode step of a model too small to
compute anything (hidden 16, 4 layers, 16 rows) took 0.87 ms against 1.85 ms; the realistic
workload's generate phase 0.90x of its time (docs/benchmarks.md).

`plan(model)` accepts the layer spec megarl builds without Transformer Engine (megatron-core's
local modules with megarl's attention: RMSNorm, fused QKV with optional bias and q/k norms,
SwiGLU MLP without bias) at pipeline size 1, any TP size, in eval mode, and returns None for
anything else (Transformer Engine layers, MoE, fp8, recompute, offloading, multi-token
prediction, sequence parallelism, context parallelism, ...): the rollout engine then calls the
model as before. Prefill (more than one token per row) always takes the model's own path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megarl.models import cpu_kernels
from megarl.models.cpu_gemm import LAYER_KERNEL_ROWS, plain_linear
from megarl.models.decode_attention import kernel_mask_and_prefix, mask_fits
from megarl.models.layout import unwrap


@dataclass
class DecodePlan:
    """What `decode_logits` needs, checked once per generate call."""
    gpt: object             # the GPTModel (unwrapped)
    fp32_output: bool       # a Float16Module wrapper returns fp32 logits; so does this path
    tp_group: object        # the tensor-parallel group (row-parallel outputs are summed over it)
    tp: int
    native: list | None = None  # per layer: megarl._cpu.decode_layer's fixed arguments (_native_layers), or None
    native_op: object = None    # megarl._cpu.decode_layer


def _why_not(gpt) -> str | None:
    """None when `decode_logits` computes exactly what the model's forward does; else the reason."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megarl.models.attention import self_attention_class

    c = gpt.config
    if not isinstance(gpt, GPTModel) or not (gpt.pre_process and gpt.post_process):
        return "not a whole GPTModel on this rank (pipeline parallel)"
    if gpt.training:
        return "training mode"
    if (c.sequence_parallel or c.context_parallel_size != 1 or c.fp8 or getattr(c, "fp4", None)
            or c.num_moe_experts or c.mtp_num_layers or getattr(gpt, "mtp_process", False)
            or c.fp32_residual_connection or getattr(c, "inference_fuse_tp_communication", False)
            or c.bias_activation_fusion or c.use_te_activation_func or c.activation_func is not F.silu
            or not c.gated_linear_unit or getattr(c, "activation_func_clamp_value", None) is not None
            or getattr(c, "fine_grained_activation_offloading", False) or c.cpu_offloading):
        return "model configuration"
    head_dim = c.kv_channels
    if (gpt.position_embedding_type != "rope" or c.multi_latent_attention or c.flash_decode
            or gpt.rotary_pos_emb.inv_freq.numel() * 2 != head_dim):  # partial RoPE: megatron's own path
        return "positional embedding"
    attention_class = self_attention_class()
    rms = torch.nn.RMSNorm
    if type(gpt.decoder.final_layernorm) is not rms:
        return "final norm"
    for layer in gpt.decoder.layers:
        attn, mlp = layer.self_attention, layer.mlp
        if type(layer) is not TransformerLayer or not isinstance(attn, attention_class) or type(mlp) is not MLP:
            return "layer modules"
        if (type(layer.input_layernorm) is not rms or type(layer.pre_mlp_layernorm) is not rms
                or not isinstance(layer.pre_cross_attn_layernorm, IdentityOp)
                or not isinstance(layer.cross_attention, IdentityOp)
                or not isinstance(layer.cross_attn_bda, IdentityFuncOp)):
            return "layer norms"
        if any(getattr(layer, f, False) for f in ("recompute_input_layernorm", "recompute_pre_mlp_layernorm",
                                                   "recompute_mlp", "offload_attn_norm", "offload_mlp_norm")):
            return "recompute or offload"
        if not attn._own_path(None, None, None, None, None) or attn.config.no_rope_freq:
            return "attention configuration"
        if c.num_query_groups < attn.world_size:
            return "fewer KV heads than TP ranks"
        for norm in (attn.q_layernorm, attn.k_layernorm):
            if not (norm is None or type(norm) is rms or isinstance(norm, IdentityOp)):
                return "q/k norm"
        for col in (attn.linear_qkv, mlp.linear_fc1):
            if type(col) is not ColumnParallelLinear or col.gather_output or col.skip_bias_add and col.bias is not None:
                return "column-parallel linear"
        for row in (attn.linear_proj, mlp.linear_fc2):
            if (type(row) is not RowParallelLinear or not row.input_is_parallel or row.explicit_expert_comm
                    or row.bias is not None):
                return "row-parallel linear"
    return None


def plan(model, out_major: dict | None = None, native: bool = False) -> DecodePlan | None:
    """A DecodePlan when `decode_logits` serves this model (module docstring), else None.
    Call it in the state the steps run in (eval, sequence parallelism off). native: run the layers
    through megarl._cpu.decode_layer where it serves them (module docstring), reading the linears'
    [out, in] tensors from out_major (models/decode_layout.py's {id(weight): tensor})."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.module import Float16Module

    gpt = unwrap(model)
    try:
        if _why_not(gpt) is not None:
            return None
    except AttributeError:  # another megatron-core's modules: their own path
        return None
    fp32_output, m = False, model
    while hasattr(m, "module"):  # DDP / Float16Module wrappers, as layout.unwrap walks them
        fp32_output |= isinstance(m, Float16Module)
        m = m.module
    tp = ps.get_tensor_model_parallel_world_size()
    layers = _native_layers(gpt, out_major) if native and out_major and tp == 1 else None
    return DecodePlan(gpt=gpt, fp32_output=fp32_output, tp_group=ps.get_tensor_model_parallel_group(), tp=tp,
                      native=layers, native_op=None if layers is None else cpu_kernels.load().decode_layer)


def _eps(norm) -> float:
    """torch.nn.RMSNorm's epsilon: its own, else float32's machine epsilon (as F.rms_norm takes None)."""
    return float(norm.eps) if norm.eps is not None else float(torch.finfo(torch.float32).eps)


def _native_layers(gpt, out_major: dict) -> list | None:
    """Per layer, megarl._cpu.decode_layer's arguments that stay fixed for a generate call, or None
    where it does not serve (no kernel build or neither AVX-512 nor AVX2, a weight not fp32 on the
    CPU or not kept in [out, in] memory, a norm without weight). `_why_not` has accepted the model."""
    module = cpu_kernels.load()
    if module is None or cpu_kernels.wide_linear() is None:
        return None
    layers = []
    for layer in gpt.decoder.layers:
        attn, mlp = layer.self_attention, layer.mlp
        weights = [out_major.get(id(lin.weight)) for lin in (attn.linear_qkv, attn.linear_proj, mlp.linear_fc1,
                                                              mlp.linear_fc2)]
        norms = [layer.input_layernorm, layer.pre_mlp_layernorm]
        qk = [n if type(n) is torch.nn.RMSNorm else None for n in (attn.q_layernorm, attn.k_layernorm)]
        biases = [lin.bias for lin in (attn.linear_qkv, mlp.linear_fc1)]
        tensors = weights + [n.weight for n in norms + [n for n in qk if n is not None]] + [b for b in biases
                                                                                            if b is not None]
        if any(t is None or t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous()
               for t in tensors):
            return None
        d = attn.hidden_size_per_attention_head
        layers.append(dict(
            number=attn.layer_number, norm1=norms[0].weight, eps1=_eps(norms[0]), w_qkv=weights[0], b_qkv=biases[0],
            groups=attn.num_query_groups_per_partition, heads=attn.num_attention_heads_per_partition, head_dim=d,
            q_norm=None if qk[0] is None else qk[0].weight, q_eps=0.0 if qk[0] is None else _eps(qk[0]),
            k_norm=None if qk[1] is None else qk[1].weight, k_eps=0.0 if qk[1] is None else _eps(qk[1]),
            scale=attn._softmax_scale(d), w_proj=weights[1], norm2=norms[1].weight, eps2=_eps(norms[1]),
            w_fc1=weights[2], b_fc1=biases[1], w_fc2=weights[3], glu_offset=float(mlp.config.glu_linear_offset)))
    return layers


def _norm(norm, x):
    return F.rms_norm(x, norm.normalized_shape, norm.weight, norm.eps)  # torch.nn.RMSNorm.forward


def _local_gemm(linear, x, bias):
    """A megatron linear's `_forward_impl` on this rank's shard: models/cpu_gemm.py's routing while
    generating on a CPU (megatron's maths without its autograd Function where it hands back), else
    that maths directly."""
    impl = vars(linear).get("_forward_impl")
    if impl is not None:
        return impl(input=x, weight=linear.weight, bias=bias, sequence_parallel=False, plain=True)
    return plain_linear(x, linear.weight, bias)


def _column(linear, x):
    """ColumnParallelLinear(x)[0] without gathering: the input is copied to every TP rank
    (an identity in the forward), each rank computes its output shard."""
    return _local_gemm(linear, x, None if linear.skip_bias_add else linear.bias)


def _row(linear, x, plan: DecodePlan):
    """RowParallelLinear(x)[0] (no bias): each rank's partial product, summed over TP."""
    out = _local_gemm(linear, x, None)
    if plan.tp > 1:
        dist.all_reduce(out, group=plan.tp_group)  # megatron's reduce_from_tensor_model_parallel_region
    return out


def _add_residual(x, residual):
    """megatron-core's bias-dropout-add in eval without bias: in place, dropout is the identity."""
    return x.add_(residual if residual.dtype == x.dtype else residual.to(x.dtype))


def _layer(layer, h, mask, freqs, ctx, plan: DecodePlan):
    """One TransformerLayer at a decode step. h: [1, A, H] -> [1, A, H]."""
    attn, mlp = layer.self_attention, layer.mlp
    # attention (megatron's get_query_key_value_tensors, then megarl's cached attention)
    qkv = _column(attn.linear_qkv, _norm(layer.input_layernorm, h))  # [1, A, g * (n/g + 2) * d] on this rank
    g, d = attn.num_query_groups_per_partition, attn.hidden_size_per_attention_head
    per_group = attn.num_attention_heads_per_partition // g
    qkv = qkv.view(*qkv.shape[:-1], g, (per_group + 2) * d)
    query, key, value = torch.split(qkv, [per_group * d, d, d], dim=3)  # [1, A, g, n/g * d], [1, A, g, d] x 2
    query = query.reshape(query.size(0), query.size(1), -1, d)  # [1, A, n, d]
    if type(attn.q_layernorm) is torch.nn.RMSNorm:  # else None or megatron's IdentityOp
        query = _norm(attn.q_layernorm, query)
    if type(attn.k_layernorm) is torch.nn.RMSNorm:
        key = _norm(attn.k_layernorm, key)
    context = attn._cached_attention(query, key, value, mask, freqs, ctx)  # [1, A, n * d]
    h = _add_residual(_row(attn.linear_proj, context, plan), h)
    # MLP: SwiGLU
    y = _column(mlp.linear_fc1, _norm(layer.pre_mlp_layernorm, h))  # [1, A, 2 * ffn / tp]
    gate, up = torch.chunk(y, 2, dim=-1)
    y = mlp.config.activation_func(gate) * (up + mlp.config.glu_linear_offset)
    return _add_residual(_row(mlp.linear_fc2, y, plan), h)


def _native_serves(h, mask, ctx) -> bool:
    """Whether this step's inputs are what megarl._cpu.decode_layer takes: fp32 CPU hidden states
    of LAYER_KERNEL_ROWS rows (where the layers' linears run the kernel) and a bool mask
    broadcastable to [A, 1, 1, sk] (or none); anything else takes the torch operations."""
    A = h.shape[1]
    return (h.dtype == torch.float32 and h.device.type == "cpu" and LAYER_KERNEL_ROWS[0] <= A <= LAYER_KERNEL_ROWS[1]
            and mask_fits(mask, A, ctx.sequence_len_offset + 1))


def _native_layers_step(plan: DecodePlan, h, mask, freqs, ctx):
    """Every layer through megarl._cpu.decode_layer (module docstring). h: [1, A, H] -> [1, A, H]."""
    _, A, H = h.shape
    start, b0 = ctx.sequence_len_offset, ctx.batch_size_offset
    end = start + 1
    d = plan.native[0]["head_dim"]
    half = freqs[start, 0, 0, : d // 2]  # this step's angles (every row at the cache offset), as apply_rope takes
    cos, sin = torch.cos(half).float().contiguous(), torch.sin(half).float().contiguous()
    masked, prefix_rows, prefix_len = kernel_mask_and_prefix(  # as models/attention.py hands them to the kernel
        mask, A, end, getattr(ctx, "prefix_rows", None) if b0 == 0 else None, getattr(ctx, "prefix_len", 0))
    x = h.reshape(A, H).contiguous()  # [A, H]
    for p in plan.native:
        k_cache, v_cache = ctx.key_value_memory_dict[p["number"]]  # [B, g, S, d] each (models/attention.py)
        x = plan.native_op(x, p["norm1"], p["eps1"], p["w_qkv"], p["b_qkv"], p["groups"], p["heads"], d,
                           p["q_norm"], p["q_eps"], p["k_norm"], p["k_eps"], cos, sin, k_cache[b0: b0 + A],
                           v_cache[b0: b0 + A], start, masked, p["scale"], prefix_rows, prefix_len, p["w_proj"],
                           p["norm2"], p["eps2"], p["w_fc1"], p["b_fc1"], p["w_fc2"], p["glu_offset"])
    return x.view(1, A, H)


def decode_logits(plan: DecodePlan, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                  ctx) -> torch.Tensor:
    """tokens, positions [A, 1]; mask [A, 1, 1, sk] bool (True = masked) or None; ctx megatron's
    StaticInferenceContext (megarl's attention keeps its cache there) -> logits [A, 1, V_pad]
    gathered over TP, as `model(tokens, positions, mask, inference_context=ctx,
    runtime_gather_output=True)` returns them (fp32 under a Float16Module). The caller advances
    the context's offset, as after a model call."""
    gpt = plan.gpt
    hidden, rotary, *_ = gpt._preprocess(input_ids=tokens, position_ids=positions, inference_context=ctx)
    h = hidden.unwrap() if hasattr(hidden, "unwrap") else hidden  # [1, A, H]
    freqs = rotary[0] if isinstance(rotary, tuple) else rotary  # [S, 1, 1, d] RoPE angles
    if plan.native is not None and _native_serves(h, mask, ctx):
        h = _native_layers_step(plan, h, mask, freqs, ctx)
    else:
        for layer in gpt.decoder.layers:
            h = _layer(layer, h, mask, freqs, ctx, plan)
    h = _norm(gpt.decoder.final_layernorm, h)
    weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
    logits, _ = gpt.output_layer(h, weight=weight, runtime_gather_output=True)  # [1, A, V_pad]
    logits = logits.transpose(0, 1)  # [A, 1, V_pad]
    return logits.float() if plan.fp32_output and logits.dtype in (torch.float16, torch.bfloat16) else logits
