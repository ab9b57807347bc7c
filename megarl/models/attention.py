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
import itertools
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
        return F.scaled_dot_product_attention(query, key, value, attn_mask=~mask, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(query, key, value, is_causal=causal, scale=scale, enable_gqa=gqa)


def _rows_packed(packed) -> bool:
    """megarl's packing of RL rows: megatron's PackedSeqParams in the sbhd layout with one
    sequence of batch 1 (THD belongs to Transformer Engine's attention)."""
    return packed.qkv_format == "sbhd" and packed.cu_seqlens_q is not None


@functools.cache
def _rows_params_class():
    """PackedSeqParams of megarl's packed rows, with two fields of its own (dataclass fields, so
    that copies of the params to a device keep them):
    `prefix_of` ([segments] int32 tensor or None): segment j continues segment prefix_of[j]
    (-1: none), i.e. its positions follow that segment's and its tokens attend to it;
    `host_rows`: what the first layer of a forward read back to the host (see _packed_rows)."""
    from dataclasses import dataclass, field

    from megatron.core.packed_seq_params import PackedSeqParams

    @dataclass
    class RowsPackedSeqParams(PackedSeqParams):
        prefix_of: Tensor = None
        host_rows: tuple = field(default=None, repr=False, compare=False)

    return RowsPackedSeqParams


def packed_rows_params(lengths: list[int], prefix_of: list[int] | None = None):
    """The PackedSeqParams of segments of `lengths` tokens packed into one [T] sequence, for this
    module's attention: each segment attends causally within itself, and, where prefix_of[j] = p
    >= 0, to all of segment p before it (p itself continues no segment). This is how the samples
    of a prompt share it: one segment holds the prompt, one per sample its response."""
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    seen = [(n + (lengths[p] if p >= 0 else 0)) for n, p in zip(lengths, prefix_of or [-1] * len(lengths))]
    kw = dict(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(seen, default=0),
              max_seqlen_kv=max(seen, default=0))
    if not prefix_of or all(p < 0 for p in prefix_of):
        return _rows_params_class()(**kw)
    if len(prefix_of) != len(lengths) or any(p >= 0 and (p >= j or prefix_of[p] >= 0) for j, p in enumerate(prefix_of)):
        raise ValueError(f"prefix_of must name an earlier segment that continues none, got {prefix_of}")
    return _rows_params_class()(**kw, prefix_of=torch.tensor(prefix_of, dtype=torch.int32))


def _packed_rows(packed, device: torch.device) -> tuple[list[int], Tensor, list[int] | None]:
    """The segment offsets (host ints), each token's position ([T] on `device`) and each
    segment's prefix segment (host ints, or None) of a packed micro-batch, computed by its first
    layer and kept on megarl's params (`host_rows`) for the others: one host read per forward, not
    one per layer (per layer for another PackedSeqParams)."""
    own = isinstance(packed, _rows_params_class())
    rows = packed.host_rows if own else None
    if rows is None or rows[0] is not packed.cu_seqlens_q or rows[2].device != device:
        cu = packed.cu_seqlens_q.tolist()
        prefix_of = getattr(packed, "prefix_of", None)
        prefix_of = None if prefix_of is None else prefix_of.tolist()
        starts = [0 if prefix_of is None or prefix_of[j] < 0 else cu[prefix_of[j] + 1] - cu[prefix_of[j]]
                  for j in range(len(cu) - 1)]
        positions = torch.cat([torch.arange(a, a + e - s) for a, s, e in zip(starts, cu, cu[1:])]).to(device)
        rows = (packed.cu_seqlens_q, cu, positions, prefix_of)
        if own:
            packed.host_rows = rows
    return rows[1], rows[2], rows[3]


@functools.cache
def self_attention_class():
    """Built lazily, so that importing megarl needs no megatron-core."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.enums import AttnMaskType

    class MegarlSelfAttention(SelfAttention):
        def _own_path(self, key_value_states, freqs, rotary_pos_cos, attention_bias, packed_seq_params) -> bool:
            c = self.config
            return (key_value_states is None and attention_bias is None
                    and (packed_seq_params is None or _rows_packed(packed_seq_params))
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
            if packed_seq_params is not None:
                context = self._packed_attention(query, key, value, freqs, packed_seq_params)
            elif inference_context is None:
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

        def _packed_attention(self, query, key, value, freqs, packed):
            """Rows packed into one sequence ([T, 1, n, d]; segment j is cu[j]:cu[j+1]): RoPE at
            each segment's own positions and causal attention within each segment, after all of
            its prefix segment where it has one (a sample's response after its shared prompt),
            so every row computes what it would alone, without padding or a repeated prompt."""
            core = self.core_attention
            if type(core).__name__ != "DotProductAttention" or (self.training and core.attention_dropout.p > 0):
                raise NotImplementedError("packed rows need megarl's SDPA attention (the local layer spec, "
                                          "no attention dropout); use rl.packing=false")
            cu, positions, prefix_of = _packed_rows(packed, query.device)
            if freqs is not None:
                query = apply_rope(query, freqs[positions])
                key = apply_rope(key, freqs[positions])
            # [1, n|g, T, d], split into the segments' views: split's backward is one cat of
            # their gradients, where a slice per segment would each fill a [1, n, T, d] zero
            # gradient and add it up (O(segments x T) memory traffic a layer)
            sizes = [e - s_ for s_, e in zip(cu, cu[1:])]
            qs, ks, vs = (x.permute(1, 2, 0, 3).split(sizes, dim=2) for x in (query, key, value))
            scale = self._softmax_scale(query.shape[-1])
            outs = []
            for j, (s_, e) in enumerate(zip(cu, cu[1:])):
                p = -1 if prefix_of is None else prefix_of[j]
                if p < 0:
                    outs.append(sdpa(qs[j], ks[j], vs[j], None, causal=e - s_ > 1, scale=scale))
                    continue
                ps_, pe = cu[p], cu[p + 1]  # the prefix: every query sees all of it, then its own past
                keys = torch.cat([ks[p], ks[j]], dim=2)
                values = torch.cat([vs[p], vs[j]], dim=2)
                mask = torch.ones(e - s_, e - s_, dtype=torch.bool, device=query.device).triu_(1)
                mask = torch.cat([mask.new_zeros(e - s_, pe - ps_), mask], dim=1)  # True = masked
                outs.append(sdpa(qs[j], keys, values, mask, causal=False, scale=scale))
            out = torch.cat(outs, dim=2)  # [1, n, T, d]
            T, b, n, d = query.shape
            return out.permute(2, 0, 1, 3).reshape(T, b, n * d)

        def _cached_attention(self, query, key, value, mask, freqs, ctx):
            """Static-batching KV cache of rotated keys, layout [B, g, S, d] per layer.

            Positions are the cache offsets (as in megatron-core's static inference): the
            engine's left padding stays exact because RoPE is relative.
            """
            sq, b, n, d = query.shape
            start, b0 = ctx.sequence_len_offset, ctx.batch_size_offset
            end = start + sq
            if freqs is not None:
                query = apply_rope(query, freqs[start:end])
                key = apply_rope(key, freqs[start:end])
            if self.layer_number not in ctx.key_value_memory_dict:
                shape = (ctx.max_batch_size, key.shape[2], ctx.max_sequence_length, d)
                ctx.key_value_memory_dict[self.layer_number] = (
                    torch.empty(shape, dtype=key.dtype, device=key.device),
                    torch.empty(shape, dtype=value.dtype, device=value.device))
            k_cache, v_cache = ctx.key_value_memory_dict[self.layer_number]
            k_cache[b0: b0 + b, :, start:end] = key.permute(1, 2, 0, 3)
            v_cache[b0: b0 + b, :, start:end] = value.permute(1, 2, 0, 3)
            keys, values = k_cache[b0: b0 + b, :, :end], v_cache[b0: b0 + b, :, :end]  # [b, g, sk, d]
            if mask is None and sq > 1 and start > 0:  # chunked prefill: causal, bottom-right aligned
                mask = torch.ones(sq, end, dtype=torch.bool, device=query.device).triu_(start + 1)
            query, scale = query.permute(1, 2, 0, 3), self._softmax_scale(d)  # [b, n, sq, d]
            out = sdpa(query, keys, values, mask, causal=start == 0 and sq > 1, scale=scale)
            return out.permute(2, 0, 1, 3).reshape(sq, b, n * d)

    return MegarlSelfAttention
