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

from megarl.models.cpu_gemm import plain_linear
from megarl.models.layout import unwrap


@dataclass
class DecodePlan:
    """What `decode_logits` needs, checked once per generate call."""
    gpt: object             # the GPTModel (unwrapped)
    fp32_output: bool       # a Float16Module wrapper returns fp32 logits; so does this path
    tp_group: object        # the tensor-parallel group (row-parallel outputs are summed over it)
    tp: int


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


def plan(model) -> DecodePlan | None:
    """A DecodePlan when `decode_logits` serves this model (module docstring), else None.
    Call it in the state the steps run in (eval, sequence parallelism off)."""
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
    return DecodePlan(gpt=gpt, fp32_output=fp32_output, tp_group=ps.get_tensor_model_parallel_group(),
                      tp=ps.get_tensor_model_parallel_world_size())


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
    for layer in gpt.decoder.layers:
        h = _layer(layer, h, mask, freqs, ctx, plan)
    h = _norm(gpt.decoder.final_layernorm, h)
    weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
    logits, _ = gpt.output_layer(h, weight=weight, runtime_gather_output=True)  # [1, A, V_pad]
    logits = logits.transpose(0, 1)  # [A, 1, V_pad]
    return logits.float() if plan.fp32_output and logits.dtype in (torch.float16, torch.bfloat16) else logits
