"""Llama/Qwen2/Qwen3/Mistral-style decoders on megatron-core's GPTModel, with an LM or scalar head.

`ModelConfig` -> `TransformerConfig` is the only translation; after it, TransformerConfig is
the single source of model truth (as in megatron-core). The layer spec is swapped, never
the model code: megatron-core's local modules on CPU, Transformer Engine's on GPU when installed.
"""
from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megarl.config.schema import FP8Config, ModelConfig, ParallelConfig
from megarl.config.validate import has_module
from megarl.models import fp8 as fp8_map
from megarl.models import layout
from megarl.models import moe as moe_map

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Pad the vocabulary to a multiple of lcm(divisible_by, tp).

    Megatron-LM pads to divisible_by * tp, which makes the padded size (and so the embedding's
    global shape) depend on TP; with the lcm it is the same for every TP dividing
    `divisible_by`, so checkpoints reshard across TP without touching the vocabulary.
    """
    multiple = math.lcm(divisible_by, tp)
    return -(-vocab_size // multiple) * multiple


def use_transformer_engine(mc: ModelConfig) -> bool:
    if mc.transformer_impl == "local" or mc.lora is not None:  # LoRA reads the normed input TE fuses away
        return False
    available = torch.cuda.is_available() and has_module("transformer_engine")
    return available if mc.transformer_impl == "auto" else True


def transformer_config(mc: ModelConfig, pc: ParallelConfig, precision: str = "fp32", fp8: FP8Config | None = None):
    from megatron.core.transformer import TransformerConfig

    dtype = DTYPES[precision]
    return TransformerConfig(
        num_layers=mc.num_layers,
        hidden_size=mc.hidden_size,
        ffn_hidden_size=mc.ffn_hidden_size,
        num_attention_heads=mc.num_attention_heads,
        num_query_groups=mc.num_kv_heads or mc.num_attention_heads,
        kv_channels=mc.head_dim or mc.hidden_size // mc.num_attention_heads,
        qk_layernorm=mc.qk_norm,
        normalization="RMSNorm",
        layernorm_epsilon=mc.norm_eps,
        gated_linear_unit=True,  # SwiGLU
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=mc.qkv_bias,
        attention_dropout=mc.attention_dropout,
        hidden_dropout=mc.hidden_dropout,
        init_method_std=mc.init_std,
        tensor_model_parallel_size=pc.tp,
        pipeline_model_parallel_size=pc.pp,
        context_parallel_size=pc.cp,
        sequence_parallel=pc.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        **fp8_map.transformer_config_fields(fp8),  # train.fp8 (models/fp8.py); none when off
        # Fusions that need CUDA kernels stay off; TE brings its own when it is the spec.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        # megatron-core initialises on the device (and only then tags TP-split parameters with
        # tensor_model_parallel / partition_dim, which grad-norm and layout code rely on);
        # build_model then overwrites every value layout-invariantly (see layout.py).
        perform_initialization=True,
        calculate_per_token_loss=True,  # losses are token sums; grads scaled by total tokens
        deallocate_pipeline_outputs=True,
        **moe_fields(mc, pc),
    )


def moe_fields(mc: ModelConfig, pc: ParallelConfig) -> dict:
    """model.moe and parallel.ep/etp as TransformerConfig fields (none for a dense model)."""
    moe = mc.moe
    if not moe.num_experts:
        return {}
    moe_map.patch_megatron()
    balance = moe.bias_update_rate > 0
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.topk,
        moe_router_score_function=moe.score,
        moe_router_pre_softmax=False,  # softmax over the top-k logits: the top-k probabilities renormalised
        moe_router_dtype="fp32",
        moe_ffn_hidden_size=moe.expert_hidden or mc.ffn_hidden_size,
        moe_shared_expert_intermediate_size=moe.shared_expert_hidden or None,
        moe_router_load_balancing_type="aux_loss" if moe.aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=moe.aux_loss_coeff,
        moe_router_enable_expert_bias=balance,
        moe_router_bias_update_rate=moe.bias_update_rate if balance else 1e-3,
        moe_token_dispatcher_type=moe.dispatcher,
        moe_grouped_gemm=moe.grouped_gemm,
        expert_model_parallel_size=pc.ep,
        expert_tensor_parallel_size=pc.etp,
    )


def layer_spec(mc: ModelConfig):
    """megatron-core's layer spec (local, or Transformer Engine's) with megarl's self-attention
    module swapped in (models/attention.py: cat-free RoPE, SDPA, KV cache of rotated keys);
    every other module and every parameter stay megatron-core's."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    from megarl.models.attention import self_attention_class

    moe = dict(num_experts=mc.moe.num_experts or None, moe_grouped_gemm=mc.moe.grouped_gemm)
    if use_transformer_engine(mc):
        spec = specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=mc.qk_norm, **moe)
    else:
        spec = specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=mc.qk_norm, **moe)
    spec.submodules.self_attention.module = self_attention_class()
    if mc.lora is not None:
        from megarl.models.lora import apply_to_spec

        apply_to_spec(spec, mc.lora)
    return spec


class ScalarHead(nn.Module):
    """One value per token: the critic's V(s_t) and the reward model's r (read at the last token).

    Replicated (not split) over TP: every TP rank holds the same full hidden states after the
    final norm, so all ranks compute identical values, and identical gradients keep the copies
    equal. Takes GPTModel's output-layer call so it drops in for `output_layer`.
    """

    def __init__(self, hidden_size: int, sequence_parallel: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden_size, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(1, dtype=dtype))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        # hidden_states: [s(/tp with SP), b, h] -> values [s, b, 1]
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states)
        return F.linear(hidden_states, self.weight, self.bias), None


@dataclass
class HeadStates:
    """What the LM head would read, returned instead of logits with `return_hidden=True`, so
    that a loss calls `megarl.ops.head_logprobs` (output layer + log-probs fused, chunked over
    tokens: the [b, s, V/tp] logits never exist)."""
    hidden: torch.Tensor        # [b, s - output_from, h] after the final norm (a view of [s, b, h])
    weight: torch.Tensor        # [V_pad/tp, h] the output layer's weight (the embedding's when tied)
    tp_group: object            # the tensor-parallel group the vocabulary is split over
    vocab_size: int             # real vocabulary: columns >= it are padding
    hidden_grad_reduced: bool   # grad(hidden) is summed over TP by the sequence-parallel gather

    @property
    def device(self) -> torch.device:
        """megatron's schedule reads the output's device after a forward-only collect (the MoE
        aux-loss scale), whatever the output is."""
        return self.hidden.device


@functools.cache
def gpt_model_class():
    """megatron-core's GPTModel returning logits as a [b, s, V] VIEW of the output layer's [s, b, V],
    optionally for the columns `output_from:` only.

    GPTModel ends with `logits.transpose(0, 1).contiguous()`: a full copy of the logits in the
    forward, and a gradient that reaches the output layer non-contiguous, which its backward
    copies twice more. megarl's consumers (the fused log-prob op, `[rows, cols]` indexing, the
    scalar head's reads) take the strided view, and the fused op's gradient comes back in the
    logits' own memory order, so the output layer's backward gets a contiguous [s, b, V] grad.

    `model(..., output_from=c)` runs the output layer on columns c: only (RL scores and trains
    response tokens; the prompt columns' logits are never read): [b, s - c, V]. Without
    sequence parallelism the hidden states are cut before the output layer (its GEMM and the
    logits' memory shrink by the prompt's share); with it, the logits are cut after.
    Only the plain training/scoring call is changed; labels, MTP, inference contexts and the
    config logger take megatron's own path. Built lazily: importing megarl needs no megatron.

    `model(..., routing=r)` (MoE) forces the experts of r [b, s, layers, k] (models/moe.py's replay).

    `model(..., return_hidden=True)` (LM head) returns `HeadStates` instead of logits: the
    final hidden states of those columns and the output weight, for the fused head op. Under
    sequence parallelism the hidden states are gathered as ColumnParallelLinear gathers them.
    """
    from megatron.core.config_logger import has_config_logger_enabled
    from megatron.core.models.gpt import GPTModel

    class MegarlGPTModel(GPTModel):
        output_from = 0  # set for the duration of one forward call
        return_hidden = False  # likewise
        fp8_rollout = "bf16"  # train.fp8.rollout: the GEMM precision of generation (KV-cache) steps
        megarl_head = "lm"  # "lm" or "scalar" (critic, reward model), set by build_model
        megarl_vocab_size = None  # the real vocabulary (the output layer's columns past it are padding)

        def forward(self, *args, output_from: int = 0, return_hidden: bool = False, routing=None, **kw):
            if return_hidden and self.megarl_head != "lm":
                raise ValueError("return_hidden=True needs the LM head (the scalar head has no vocabulary)")
            self.output_from, self.return_hidden = int(output_from), bool(return_hidden)
            generating = kw.get("inference_context") is not None or kw.get("inference_params") is not None
            try:
                tokens = args[0].numel() if args and torch.is_tensor(args[0]) else 0  # input ids [b, s]
                with fp8_map.generation_precision(self.config, self.fp8_rollout, generating, tokens), \
                        moe_map.replaying(self, routing) if routing is not None else contextlib.nullcontext():
                    return super().forward(*args, **kw)
            finally:
                self.output_from, self.return_hidden = 0, False

        def _postprocess(self, hidden_states, *args, **kw):
            c = self.output_from
            if (args or not self.post_process or kw.get("labels") is not None or kw.get("mtp_in_postprocess")
                    or kw.get("inference_context") is not None or kw.get("inference_params") is not None
                    or has_config_logger_enabled(self.config)):
                if self.return_hidden and self.post_process:
                    raise ValueError("return_hidden=True serves the plain training/scoring call only "
                                     "(no labels, MTP or inference context)")
                out = super()._postprocess(hidden_states, *args, **kw)
                return out[:, c:] if c and self.post_process and torch.is_tensor(out) else out
            cut_before = c and not self.config.sequence_parallel
            if cut_before:
                hidden_states = hidden_states[c:]  # [s - c, b, h]
            weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
            if self.return_hidden:
                return self._head_states(hidden_states, weight, 0 if cut_before else c)
            logits, _ = self.output_layer(hidden_states, weight=weight,
                                          runtime_gather_output=kw.get("runtime_gather_output"))
            logits = logits.transpose(0, 1)  # [s, b, V/tp] -> [b, s, V/tp], no copy
            return logits[:, c:] if c and not cut_before else logits

        def _head_states(self, hidden_states, weight, c):
            from megatron.core import parallel_state as ps

            sp = self.config.sequence_parallel
            if sp:  # [s/tp, b, h] -> [s, b, h]; backward reduce-scatters (sums over TP)
                from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

                hidden_states = gather_from_sequence_parallel_region(hidden_states)[c:]
            return HeadStates(hidden=hidden_states.transpose(0, 1),
                              weight=self.output_layer.weight if weight is None else weight,
                              tp_group=ps.get_tensor_model_parallel_group(),
                              vocab_size=self.megarl_vocab_size, hidden_grad_reduced=sp)

    return MegarlGPTModel


@functools.cache
def vocab_parallel_embedding_class():
    """megatron-core's VocabParallelEmbedding with its TP > 1 masking written as masked_fill.

    megatron-core masks the ids outside this rank's shard with `x[mask] = 0`: a boolean index,
    whose CUDA kernel counts the mask's nonzeros on the host, so no CUDA graph could hold the
    embedding, and the rollout's decode step runs it inside its graph. The same values and the
    same reduction."""
    from megatron.core.tensor_parallel import VocabParallelEmbedding
    from megatron.core.tensor_parallel.mappings import (reduce_from_tensor_model_parallel_region,
                                                        reduce_scatter_to_sequence_parallel_region)

    class MegarlVocabParallelEmbedding(VocabParallelEmbedding):
        def forward(self, input_):
            if self.tp_group.size() == 1:
                return super().forward(input_)
            outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            ids = (input_ - self.vocab_start_index).masked_fill_(outside, 0)
            out = self.weight[ids] if self.deterministic_mode else F.embedding(ids, self.weight)
            out = out.masked_fill_(outside[..., None], 0.0)
            if self.reduce_scatter_embeddings:  # [b, s, h] -> [s, b, h], as megatron-core
                return reduce_scatter_to_sequence_parallel_region(out.transpose(0, 1).contiguous(),
                                                                  group=self.tp_group)
            return reduce_from_tensor_model_parallel_region(out, group=self.tp_group)

    return MegarlVocabParallelEmbedding


def build_model(mc: ModelConfig, pc: ParallelConfig, *, head: str = "lm", precision: str = "fp32",
                fp8: FP8Config | None = None, seed: int = 1234):
    """Build this rank's stage of the model and initialise it layout-invariantly.

    head="lm": logits over this TP rank's vocabulary shard, [b, s, V_pad/tp].
    head="scalar": values [b, s, 1] on the last pipeline stage.
    Both are transposed views of the output layer's [s, b, .] result (see `gpt_model_class`).
    """
    from megatron.core import parallel_state as ps

    if head not in ("lm", "scalar"):
        raise ValueError(f"head must be 'lm' or 'scalar', got {head!r}")
    config = transformer_config(mc, pc, precision, fp8)
    vocab = padded_vocab_size(mc.vocab_size, mc.make_vocab_size_divisible_by, pc.tp)
    model = gpt_model_class()(
        config=config,
        transformer_layer_spec=layer_spec(mc),
        vocab_size=vocab,
        max_sequence_length=mc.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=mc.tie_embeddings and head == "lm",
        position_embedding_type="rope",
        rotary_base=mc.rotary_base,  # float thetas (e.g. 1e6) pass through exactly
        rope_scaling=mc.rope_scaling_factor is not None,
        rope_scaling_factor=mc.rope_scaling_factor or 8.0,
    )
    if head == "scalar" and model.post_process:
        model.output_layer = ScalarHead(mc.hidden_size, pc.sequence_parallel, config.params_dtype)
    if model.pre_process and pc.tp > 1:  # the same module and weights, graph-capturable masking
        model.embedding.word_embeddings.__class__ = vocab_parallel_embedding_class()
    model.megarl_head = head
    if fp8_map.enabled(fp8):
        model.fp8_rollout = fp8.rollout
    model.megarl_vocab_size = mc.vocab_size
    if torch.cuda.is_available():  # as Megatron-LM's get_model: what megatron-core and megarl build on
        model.cuda(torch.cuda.current_device())  # the host (norms, the scalar head) joins the rest
    layout.init_parameters(model, seed=seed, std=mc.init_std, num_layers=mc.num_layers,
                           vocab_size=mc.vocab_size, tied=mc.tie_embeddings and head == "lm")
    return model


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Give the TP padding columns of a vocab shard zero probability, in place.

    logits: [..., V_pad/tp] on TP rank r, holding global columns [r*V_pad/tp, (r+1)*V_pad/tp).
    Padding must not take softmax mass, or the loss would depend on TP (the padded size does).
    A large finite negative (not -inf) keeps p*logit = 0 in entropy sums instead of NaN.
    """
    from megatron.core import parallel_state as ps

    width = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * width
    first_pad = max(vocab_size - start, 0)
    if first_pad < width:
        fill = torch.finfo(logits.dtype).min if logits.dtype == torch.float16 else -1e30
        logits[..., first_pad:] = fill
    return logits


def vocab_parallel_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Global token ids of the row maxima of vocab-sharded logits [..., V/tp] -> [...].

    Ties resolve to the lowest id, as torch.argmax does on unsharded logits.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    local_max, local_idx = logits.max(dim=-1)
    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1:
        return local_idx
    global_idx = local_idx + ps.get_tensor_model_parallel_rank() * logits.shape[-1]
    packed = torch.stack([local_max.float(), global_idx.float()])  # ids < 2^24 are exact in fp32
    gathered = [torch.empty_like(packed) for _ in range(tp)]
    dist.all_gather(gathered, packed.contiguous(), group=ps.get_tensor_model_parallel_group())
    stacked = torch.stack(gathered)  # [tp, 2, ...]
    winner = stacked[:, 0].argmax(dim=0, keepdim=True)  # first (lowest-rank) maximum
    return stacked[:, 1].gather(0, winner).squeeze(0).long()
