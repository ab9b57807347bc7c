"""megarl's self-attention for the layer spec: megatron-core's `SelfAttention` with a cat-free
RoPE, torch SDPA, and a KV cache that holds keys *after* RoPE.

Why it exists:
- megatron-core's static KV cache stores keys before RoPE and re-rotates the whole cached key
  tensor in every layer at every decode step (cost grows with cached tokens), and its cache
  layout [S, B, g, d] makes the decode-time attention read keys with a B*g*d stride
  (a slower SDPA than a [B, g, S, d] cache);
- its RoPE (`_apply_rotary_pos_emb_bshd`) runs a `cat` for rotate-half and another to re-attach
  an (empty) pass-through part, for q and k in every layer;
- its local `DotProductAttention` repeats KV heads for GQA and runs baddbmm + masked softmax +
  bmm unfused.

The parameters, their names and the qkv/proj layers are megatron-core's (`linear_qkv`,
`linear_proj`, q/k norms come from the spec), so checkpoints, TP sharding, sequence parallel
and the optimizer see no difference. Only the maths in between is ours, and it is exact
(tests compare it with megatron-core's own path and with Hugging Face transformers). Cases this
module does not cover (packed THD sequences, cross attention, context parallel, output gates,
flash decode, dynamic batching, interleaved or partial RoPE, sliding windows, softmax offsets;
megarl's models use plain RoPE, not YaRN) go to megatron-core's
`SelfAttention.forward` unchanged in training; generation needs this module's cache and says
so in one line for them.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor


class _Rope(torch.autograd.Function):
    """y = x * cos + rotate_half(x) * sin without cats; backward is the inverse rotation.

    x: [s, b, n, d] (any strides); cos, sin: [s, 1, 1, d/2] (the two halves of megatron's
    `cat(freqs, freqs)` are equal); out_bnsd: write the result in [b, n, s, d] memory (returned
    as a [s, b, n, d] view) so that SDPA reads it contiguously.
    """

    @staticmethod
    def forward(ctx, x, cos, sin, out_bnsd: bool):
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, out_bnsd)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, -sin, False), None, None, None


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, out_bnsd: bool) -> Tensor:
    s, b, n, d = x.shape
    h = d // 2
    if out_bnsd:
        out = torch.empty(b, n, s, d, dtype=x.dtype, device=x.device).permute(2, 0, 1, 3)
    else:
        out = torch.empty(s, b, n, d, dtype=x.dtype, device=x.device)
    x1, x2 = x[..., :h], x[..., h:]
    lo, hi = out[..., :h], out[..., h:]
    torch.mul(x1, cos, out=lo)
    lo.addcmul_(x2, sin, value=-1)  # x1 cos - x2 sin
    torch.mul(x2, cos, out=hi)
    hi.addcmul_(x1, sin)  # x2 cos + x1 sin
    return out


def apply_rope(x: Tensor, freqs: Tensor, *, out_bnsd: bool = False) -> Tensor:
    """RoPE of megatron-core's non-interleaved convention.

    x: [s, b, n, d]; freqs: [s, 1, 1, d], megatron's `cat(f, f)` angles (fp32). cos/sin are
    cast to x's dtype first, as megatron-core does, so bf16 runs round alike.
    """
    h = x.shape[-1] // 2
    half = freqs[..., :h]
    cos, sin = torch.cos(half).to(x.dtype), torch.sin(half).to(x.dtype)
    if not (torch.is_grad_enabled() and x.requires_grad):  # scoring, generation: no autograd node
        return _rotate(x, cos, sin, out_bnsd)
    return _Rope.apply(x, cos, sin, out_bnsd)


def sdpa(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, *, causal: bool, scale: float) -> Tensor:
    """Attention over [b, n, sq, d] queries and [b, g, sk, d] keys/values (grouped heads read in
    place). mask: bool, True = masked (megatron's convention), broadcastable to [b, 1, sq, sk].
    -> [b, n, sq, d]."""
    gqa = query.shape[1] != key.shape[1]
    if mask is not None:
        if gqa and query.device.type == "cuda":
            # enable_gqa with a mask takes CUDA's math kernel ([b, n, sq, sk] fp32 scores): keys
            # and values repeated per query head (one copy) keep the fused masked kernels
            key, value, gqa = *repeat_groups(key, value, query.shape[1]), False
        return F.scaled_dot_product_attention(query, key, value, attn_mask=~mask, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(query, key, value, is_causal=causal, scale=scale, enable_gqa=gqa)


def repeat_groups(key: Tensor, value: Tensor, heads: int) -> tuple[Tensor, Tensor]:
    """[b, g, s, d] keys and values -> [b, heads, s, d], KV head j serving query heads
    j * heads/g .. (j+1) * heads/g - 1 (megatron's group-major heads, as enable_gqa reads them)."""
    r = heads // key.shape[1]
    return key.repeat_interleave(r, dim=1), value.repeat_interleave(r, dim=1)


def decode_sdpa(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, *, scale: float) -> Tensor:
    """Attention of one new token per row: [b, n, 1, d] queries over [b, g, S, d] keys/values,
    mask broadcastable to [b, 1, 1, S] (True = masked) -> [b, n, 1, d].

    Grouped heads are folded into the query axis ([b, g, n/g, d]: a group's n/g heads read the
    same keys at the same position), so every head count takes SDPA's masked fused kernels. With
    `enable_gqa` a mask sends SDPA to its math kernel on CUDA, which first copies the whole KV
    cache n/g times over: per decode step, several times the bytes of the cache itself."""
    b, n, _, d = query.shape
    g = key.shape[1]
    if g == n:
        return sdpa(query, key, value, mask, causal=False, scale=scale)
    q = query.reshape(b, g, n // g, d)  # megatron's heads are group-major, as enable_gqa reads them
    if mask is None:
        out = F.scaled_dot_product_attention(q, key, value, scale=scale)
    else:
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=~mask, scale=scale)
    return out.reshape(b, n, 1, d)


@functools.cache
def slot_context_class():
    """megatron-core's StaticInferenceContext for the graph-safe decode step (rollout/decode.py):
    `slots` ([b] long on the device, or None) is the cache slot each row's one new token takes
    (and its RoPE position); the step's attention mask, passed to the model as usual, covers the
    whole cache (masked: padding and slots after each row's); `freqs`, when set, is the RoPE table
    the step reads. Nothing of the step is a host value, so the step has the same shapes and
    reads at every position."""
    from megatron.core.inference.contexts import StaticInferenceContext

    class SlotInferenceContext(StaticInferenceContext):
        slots = None
        # [S, 1, 1, d] RoPE angles the step reads in place of the model's (None: the model's):
        # megatron-core's are an LRU-cached tensor that training forwards of other lengths evict,
        # freeing memory a captured graph would still read
        freqs = None

    return SlotInferenceContext


@functools.cache
def self_attention_class():
    """Built lazily, so that importing megarl needs no megatron-core."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.enums import AttnMaskType

    class MegarlSelfAttention(SelfAttention):
        def _own_path(self, key_value_states, freqs, rotary_pos_cos, attention_bias, packed_seq_params) -> bool:
            c = self.config
            return (key_value_states is None and attention_bias is None
                    and packed_seq_params is None
                    and rotary_pos_cos is None and c.context_parallel_size == 1 and not c.attention_output_gate
                    and not c.flash_decode and not c.rotary_interleaved and not c.multi_latent_attention
                    and c.window_size is None and c.softmax_type == "vanilla"
                    and (freqs is None or freqs.shape[-1] == self.hidden_size_per_attention_head))

        def _softmax_scale(self, head_dim: int) -> float:
            """The scale megatron's core attention applies in all (its local one splits it between
            the scores and the softmax under query-key layer scaling)."""
            core = self.core_attention
            if type(core).__name__ == "DotProductAttention":
                return core.softmax_scale * (core.scale_mask_softmax.scale or 1.0)
            return self.config.softmax_scale or 1.0 / math.sqrt(head_dim)

        def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                    rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                    attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *, inference_params=None):
            inference_context = inference_context if inference_context is not None else inference_params
            freqs = rotary_pos_emb[0] if isinstance(rotary_pos_emb, tuple) else rotary_pos_emb  # [S, 1, 1, d]
            own = self._own_path(key_value_states, freqs, rotary_pos_cos, attention_bias, packed_seq_params)
            if inference_context is not None and not (own and inference_context.is_static_batching()):
                raise NotImplementedError(
                    "megarl generates with its own KV cache (megarl.models.attention): this attention "
                    "configuration (packed sequences, context parallel, output gate, flash decode, "
                    "interleaved/partial RoPE or dynamic batching) is not supported there")
            if not own:
                return super().forward(hidden_states, attention_mask, key_value_states, inference_context,
                                       rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, rotary_pos_cos_sin,
                                       attention_bias, packed_seq_params, sequence_len_offset)
            if self.config.no_rope_freq and self.config.no_rope_freq[self.layer_number - 1]:
                freqs = None

            query, key, value = self.get_query_key_value_tensors(hidden_states, None)  # [s, b, n|g, d]
            if inference_context is None:
                context = self._train_attention(query, key, value, attention_mask, freqs)
            else:
                context = self._cached_attention(query, key, value, attention_mask, freqs, inference_context)
            return self.linear_proj(context)

        def _train_attention(self, query, key, value, mask, freqs):
            """No cache: the spec's core attention, or SDPA in its place where it is exact."""
            core = self.core_attention
            # megatron's local core attention is replaced by SDPA (exact) unless it drops out
            # attention probabilities with its own RNG tracker; other core attentions (TE) stay.
            use_sdpa = type(core).__name__ == "DotProductAttention" and (
                not self.training or core.attention_dropout.p == 0.0)
            if freqs is not None:
                query = apply_rope(query, freqs, out_bnsd=use_sdpa)
                key = apply_rope(key, freqs, out_bnsd=use_sdpa)
            if not use_sdpa:
                return core(query, key, value, mask, attn_mask_type=self.attn_mask_type)
            sq, b, n, d = query.shape
            out = sdpa(query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3), mask,
                       causal=self.attn_mask_type == AttnMaskType.causal and sq > 1,
                       scale=self._softmax_scale(d))  # [b, n, sq, d]
            return out.permute(2, 0, 1, 3).reshape(sq, b, n * d)

        def _cached_attention(self, query, key, value, mask, freqs, ctx):
            """Static-batching KV cache of rotated keys, layout [B, g, S, d] per layer.

            Positions are the cache offsets (as in megatron-core's static inference): the
            engine's left padding stays exact because RoPE is relative.
            """
            sq, b, n, d = query.shape
            if sq == 1 and isinstance(ctx, slot_context_class()) and ctx.slots is not None:
                return self._slot_attention(query, key, value, mask, freqs, ctx)
            start, b0 = ctx.sequence_len_offset, ctx.batch_size_offset
            end = start + sq
            if freqs is not None:
                query = apply_rope(query, freqs[start:end])
                key = apply_rope(key, freqs[start:end])
            if self.layer_number not in ctx.key_value_memory_dict:
                shape = (ctx.max_batch_size, key.shape[2], ctx.max_sequence_length, d)
                # zeros, not garbage: the graph-safe decode step reads unwritten slots under a mask,
                # where a NaN would still poison the row (0 weight x NaN)
                ctx.key_value_memory_dict[self.layer_number] = (
                    torch.zeros(shape, dtype=key.dtype, device=key.device),
                    torch.zeros(shape, dtype=value.dtype, device=value.device))
            k_cache, v_cache = ctx.key_value_memory_dict[self.layer_number]
            k_cache[b0: b0 + b, :, start:end] = key.permute(1, 2, 0, 3)
            v_cache[b0: b0 + b, :, start:end] = value.permute(1, 2, 0, 3)
            keys, values = k_cache[b0: b0 + b, :, :end], v_cache[b0: b0 + b, :, :end]  # [b, g, sk, d]
            if mask is None and sq > 1 and start > 0:  # chunked prefill: causal, bottom-right aligned
                mask = torch.ones(sq, end, dtype=torch.bool, device=query.device).triu_(start + 1)
            query, scale = query.permute(1, 2, 0, 3), self._softmax_scale(d)  # [b, n, sq, d]
            if sq == 1:  # a decode step
                out = decode_sdpa(query, keys, values, mask, scale=scale)
            else:
                out = sdpa(query, keys, values, mask, causal=start == 0 and sq > 1, scale=scale)
            return out.permute(2, 0, 1, 3).reshape(sq, b, n * d)

        def _slot_attention(self, query, key, value, mask, freqs, ctx):
            """One new token per row at its own slot (ctx.slots [b]): RoPE at that position, its key
            and value written there, attention over the whole cache under `mask` ([b, 1, 1, S],
            True = masked). The same maths as _cached_attention's decode step, with fixed shapes
            and no host value (a masked slot weighs exactly 0)."""
            _, b, n, d = query.shape
            slots = ctx.slots
            if freqs is not None and ctx.freqs is not None:
                freqs = ctx.freqs
            if freqs is not None:  # [S, 1, 1, d] -> [1, b, 1, d]: each row's own angle
                f = freqs.index_select(0, slots).transpose(0, 1)
                query, key = apply_rope(query, f), apply_rope(key, f)
            k_cache, v_cache = ctx.key_value_memory_dict[self.layer_number]  # the prefill's [B, g, S, d]
            rows = torch.arange(b, device=slots.device)
            k_cache[rows, :, slots] = key[0]  # [b, g, d] at (row, :, slot)
            v_cache[rows, :, slots] = value[0]
            out = decode_sdpa(query.permute(1, 2, 0, 3), k_cache[:b], v_cache[:b], mask,
                              scale=self._softmax_scale(d))  # [b, n, 1, d]
            return out.permute(2, 0, 1, 3).reshape(1, b, n * d)

    return MegarlSelfAttention
