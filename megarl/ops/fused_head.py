"""Output layer + per-token log-prob/entropy in one op, chunk by chunk: no [tokens, V] logits.

The unfused path materialises the output layer's logits [T, V/tp] and keeps them for the
backward (8 x 4096 tokens x 152k vocab is 20 GB in fp32). Here the hidden states [T, h] go
through the (vocab-parallel) output weight [V/tp, h] a chunk of tokens at a time; each chunk's
logits are reduced straight to the four row statistics of `logprobs.py` (max, sum-exp, first
moment, target logit) and dropped. The TP reductions (one MAX, one packed SUM) run once over all
tokens after the chunk loop, exactly as in `logprobs_and_entropy`. The backward recomputes the
logits a slice of vocabulary columns at a time (all tokens), turns them into their gradient,
writes that slice of grad(W) = dZ^T X with one GEMM and accumulates grad(hidden) += dZ W, so the
peak extra memory is about two chunks' logits whatever the token count (when every token fits in
one chunk, the forward keeps that chunk for the backward instead of recomputing it).
Same maths (and same dtypes: the GEMM runs in the inputs' dtype, the statistics in fp32) as
output layer -> `mask_padded_vocab` -> `logprobs_and_entropy`.
`linear_token_loss` takes the loss into the op instead, when each token's term reads its own
log-prob and entropy only (RL's policy losses, NLL): each chunk's logits become their gradient in
the forward, so nothing is recomputed (three GEMMs, not four).
"""
import torch
import torch.nn.functional as F

from . import _ext
from .logprobs import IGNORE_INDEX, _as_rows, _grad_torch, _group_info, _local_stats, _reduce_and_finalize

# Logit elements per token chunk (one chunk's fp32 logits: 256 MiB): at V = 152k that is 441
# tokens, enough rows for the GEMM to run at full speed and < 3% of 8 x 2048 tokens' logits.
_CHUNK_LOGIT_ELEMS = 1 << 26
# Fewest vocabulary columns in one backward chunk (see _FusedLinearLogProbs.backward).
_MIN_COLS = 256
# Chunk widths (tokens, columns) are multiples of this: a bf16 GEMM with a dimension off the
# tensor cores' alignment ran 5-8x slower on an H100 (4093 vs 4096 columns: 96 vs 761 TFLOP/s).
_ALIGN = 64
# What `models.gpt.mask_padded_vocab` writes into the padding columns: zero probability, and
# finite, so p * logit is 0 (not NaN) in the entropy.
_PAD_LOGIT = -1e30


def linear_logprobs_and_entropy(hidden, weight, targets, *, tp_group=None, vocab_size=None, temperature=1.0,
                                with_entropy=True, ignore_index=IGNORE_INDEX, chunk_size=None,
                                reduce_hidden_grad=True):
    """log p(target) and the entropy of softmax(hidden @ weight.T / temperature), per token.

    hidden: [..., h] (e.g. [b, s, h] or [T, h]; strided views such as a [b, s, h] transpose of
        [s, b, h] are read without a copy); weight: [V_pad/tp, h], this TP rank's rows of the
        output layer (rank r holds global vocabulary ids [r V_pad/tp, (r+1) V_pad/tp)), same
        dtype as hidden (fp32, bf16 or fp16).
    targets: [...] global ids; ignore_index gives 0 and no gradient (as `logprobs_and_entropy`).
    vocab_size: the real vocabulary; columns >= vocab_size are padding and get zero probability
        (None: no padding).
    chunk_size: tokens per chunk (default: _CHUNK_LOGIT_ELEMS / (V_pad/tp)).
    reduce_hidden_grad: all-reduce grad(hidden) over tp_group in the backward, as megatron's
        ColumnParallelLinear does through `copy_to_tensor_model_parallel_region`. Pass False when
        the caller's hidden states come through a region function whose backward already sums
        over TP (sequence parallelism: `gather_from_sequence_parallel_region`'s reduce-scatter).
    Returns (logprob [...], entropy [...] or None), fp32, differentiable w.r.t. hidden and weight.
    """
    x, t, restore = _checked_rows(hidden, weight, targets, temperature, chunk_size)
    tp_size, tp_rank, n, padded, first_pad, step = _vocab_layout(weight, tp_group, vocab_size, chunk_size)
    N = t.numel()
    kept, (t, x) = _kept_rows(t, ignore_index, t, x)
    backward_may_come = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    lp, ent = _FusedLinearLogProbs.apply(
        x, weight, t, tp_group if tp_size > 1 else None, n * tp_rank, padded, first_pad,
        1.0 / float(temperature), int(ignore_index), int(step), bool(reduce_hidden_grad), backward_may_come,
        bool(with_entropy))  # False: the entropy (NaN) is neither returned nor differentiated
    return restore(_all_rows(kept, lp, N)), (restore(_all_rows(kept, ent, N)) if with_entropy else None)


def _checked_rows(hidden, weight, targets, temperature, chunk_size):
    """hidden as rows [N, h], targets [N] and the map back to [...], after checking the arguments."""
    if hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16) or weight.dtype != hidden.dtype:
        raise TypeError(f"hidden and weight must share one of fp32/bf16/fp16, got {hidden.dtype} and {weight.dtype}")
    if hidden.dim() < 1 or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0:
        raise ValueError(f"weight must be [V/tp, h] with h = hidden.shape[-1]: got hidden {tuple(hidden.shape)}, "
                         f"weight {tuple(weight.shape)}")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"targets {tuple(targets.shape)} must match hidden {tuple(hidden.shape)}[:-1]")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise TypeError(f"targets must be integer ids, got {targets.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return _as_rows(hidden, targets)  # [N, h], [N]


def _kept_rows(t, ignore_index, *rows):
    """(kept [N'] or None when every row counts, the rows' tensors at the kept rows). Ignored
    tokens (padding of a padded micro-batch, prompt columns) never reach the output layer: the
    GEMMs run over the rows that count only. Every TP rank holds the same targets, so every rank
    keeps the same rows. (nonzero's size is read on the host: a sync on a GPU.)"""
    kept = (t != ignore_index).nonzero().squeeze(1)                             # [N']
    if kept.numel() == t.numel():
        return None, rows
    return kept, tuple(r.index_select(0, kept) for r in rows)                   # differentiable in x


def _all_rows(kept, v, n):
    """A per-row result [N'] back at all n rows: ignored rows 0 (and no gradient)."""
    return v if kept is None else v.new_zeros(n).index_copy(0, kept, v)


def _vocab_layout(weight, tp_group, vocab_size, chunk_size):
    """(tp_size, tp_rank, local rows n, padded vocabulary, first local padding column, tokens per
    chunk)."""
    tp_size, tp_rank = _group_info(tp_group)
    n = weight.shape[0]
    padded = n * tp_size
    if vocab_size is not None and not 0 < vocab_size <= padded:
        raise ValueError(f"vocab_size ({vocab_size}) must be in [1, {padded}] (the weight's rows x TP size)")
    first_pad = n if vocab_size is None else min(max(vocab_size - n * tp_rank, 0), n)  # local column
    step = chunk_size or max(1, _CHUNK_LOGIT_ELEMS // n)
    if chunk_size is None and step > _ALIGN:
        step = step // _ALIGN * _ALIGN
    return tp_size, tp_rank, n, padded, first_pad, step


def head_logprobs(head, labels, *, temperature=1.0, with_entropy=False, ignore_index=IGNORE_INDEX,
                  chunk_size=None):
    """`linear_logprobs_and_entropy` on what a model returns with `return_hidden=True`
    (`megarl.models.gpt.HeadStates`: hidden [b, s - c, h], the output weight, the TP group, the
    real vocabulary, whether grad(hidden) is already summed over TP). labels: [b, s - c].
    The fused counterpart of `mask_padded_vocab` + `logprobs_and_entropy` on logits."""
    return linear_logprobs_and_entropy(
        head.hidden, head.weight, labels, tp_group=head.tp_group, vocab_size=head.vocab_size,
        temperature=temperature, with_entropy=with_entropy, ignore_index=ignore_index, chunk_size=chunk_size,
        reduce_hidden_grad=not head.hidden_grad_reduced)


def linear_token_loss(hidden, weight, targets, token_loss, *, tp_group=None, vocab_size=None, temperature=1.0,
                      with_entropy=False, ignore_index=IGNORE_INDEX, chunk_size=None, reduce_hidden_grad=True):
    """A loss sum_t l_t(logp_t, entropy_t) through the output layer, its gradient taken inside
    the forward (Liger's fused linear cross-entropy, for any per-token loss).

    token_loss(pos, logp, entropy) -> 0-d tensor: the loss of some tokens, differentiable in
    logp [c] and entropy [c] (None without with_entropy), fp32; pos [c] are the tokens' flat
    indices into targets (targets.reshape(-1)), for the caller's per-token constants (old
    log-probs, advantages, the aggregation's weights). Each token's loss may depend on its own
    log-prob and entropy only: the op calls token_loss on one chunk of tokens at a time (ignored
    targets are never passed).
    Why: with `linear_logprobs_and_entropy` the backward recomputes each chunk's logits (a fourth
    output-layer GEMM after the forward's, grad(hidden)'s and grad(W)'s) unless every token fits
    in one chunk. Here each chunk's logits turn into their gradient as soon as the chunk's
    log-probs are known, and the gradients of hidden [N, h] and of W [V/tp, h] are kept for the
    backward, which scales them by the loss's incoming gradient: three GEMMs at any token count,
    one chunk of logits at a time. The cost: grad(W) is held from the forward to the backward.
    On a GPU with more tokens than one chunk the op takes the recomputing path (see below).
    Arguments otherwise as `linear_logprobs_and_entropy`. Returns (loss 0-d fp32, differentiable
    w.r.t. hidden and weight; logprob [...] and entropy [...] or None, detached).
    """
    x, t, restore = _checked_rows(hidden, weight, targets, temperature, chunk_size)
    # each row's flat index into targets (the rows walk hidden's memory order)
    _, pos, _ = _as_rows(hidden, torch.arange(targets.numel(), device=targets.device).view(targets.shape))
    tp_size, tp_rank, n, padded, first_pad, step = _vocab_layout(weight, tp_group, vocab_size, chunk_size)
    N = t.numel()
    kept, (t, x, pos) = _kept_rows(t, ignore_index, t, x, pos)
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if needs_grad and x.device.type != "cpu" and x.shape[0] > step:
        # On a GPU a chunk's GEMM is short next to adding its [V/tp, h] grad(W) into an fp32 sum
        # (at V = 152k, h = 4096: ~1 ms of traffic a chunk against ~0.7 ms of GEMM), so the
        # backward walking the vocabulary and recomputing the logits is the cheaper one there.
        lp, ent = _FusedLinearLogProbs.apply(
            x, weight, t, tp_group if tp_size > 1 else None, n * tp_rank, padded, first_pad,
            1.0 / float(temperature), int(ignore_index), int(step), bool(reduce_hidden_grad), True,
            bool(with_entropy))
        loss = token_loss(pos, lp, ent if with_entropy else None)
        lp, ent = lp.detach(), ent.detach()
    else:
        loss, lp, ent = _FusedLinearLoss.apply(
            x, weight, t, pos, token_loss, tp_group if tp_size > 1 else None, n * tp_rank, padded, first_pad,
            1.0 / float(temperature), int(ignore_index), int(step), bool(reduce_hidden_grad), needs_grad,
            bool(with_entropy))
    return loss, restore(_all_rows(kept, lp, N)), (restore(_all_rows(kept, ent, N)) if with_entropy else None)


def head_token_loss(head, labels, token_loss, *, temperature=1.0, with_entropy=False, ignore_index=IGNORE_INDEX,
                    chunk_size=None):
    """`linear_token_loss` on what a model returns with `return_hidden=True` (see head_logprobs)."""
    return linear_token_loss(
        head.hidden, head.weight, labels, token_loss, tp_group=head.tp_group, vocab_size=head.vocab_size,
        temperature=temperature, with_entropy=with_entropy, ignore_index=ignore_index, chunk_size=chunk_size,
        reduce_hidden_grad=not head.hidden_grad_reduced)


def _chunk_logits(xc, weight, first_pad):
    """[c, n] logits of one token chunk, padding columns masked (in place)."""
    z = F.linear(xc, weight)
    if first_pad < z.shape[1]:
        z[:, first_pad:] = torch.finfo(z.dtype).min if z.dtype == torch.float16 else _PAD_LOGIT
    return z


def _chunk_stats(z, t, vocab_start, padded, ignore_index, inv_temp, with_entropy):
    """(m, s, w, zt) [c] of one chunk's logits: the CUDA kernel when it serves z (one pass for
    all four), else torch (w only with_entropy: NaN otherwise)."""
    if _ext.use_kernels(z):
        with torch.cuda.device(z.device):
            return _ext.load().logprobs_fwd(z, t, vocab_start, padded, ignore_index, inv_temp, False,
                                            _ext.stream_of(z))
    return _local_stats(z, t, vocab_start, inv_temp, with_moment=with_entropy)


def _chunk_grad(z, t, lse, ent, g_lp, g_ent, vocab_start, inv_temp, ignore_index):
    """d loss / d z of one chunk (the torch path overwrites z with it)."""
    if _ext.use_kernels(z):
        with torch.cuda.device(z.device):
            return _ext.load().logprobs_bwd(z, t, lse, ent, g_lp, g_ent, vocab_start, ignore_index, inv_temp,
                                            _ext.stream_of(z))
    return _grad_torch(z, t, lse, ent, g_lp, g_ent, vocab_start, inv_temp, ignore_index, out=z)


class _FusedLinearLogProbs(torch.autograd.Function):
    """(x [N, h], w [n, h], targets [N]) -> (logprob [N], entropy [N]); saves 2 floats per token."""

    @staticmethod
    def forward(ctx, x, w, t, group, vocab_start, padded, first_pad, inv_temp, ignore_index, step, reduce_grad,
                keep_one, with_entropy):
        N = x.shape[0]
        m, s, mom, zt = torch.empty(4, N, dtype=torch.float32, device=x.device).unbind(0)
        # All tokens in one chunk and a backward to come: keep that chunk's logits for it instead
        # of recomputing them (the same peak, one chunk; one [N, h] x [h, n] GEMM fewer).
        keep = keep_one and N <= step
        z = None
        for r0 in range(0, N, step):
            r1 = min(N, r0 + step)
            z = _chunk_logits(x[r0:r1], w, first_pad)                          # [c, n]
            stats = _chunk_stats(z, t[r0:r1], vocab_start, padded, ignore_index, inv_temp, with_entropy)
            for dst, src in zip((m, s, mom, zt), stats):
                dst[r0:r1] = src
            if not keep:
                z = None  # dropped: the backward recomputes it
        lp, ent, lse = _reduce_and_finalize(m, s, mom, zt, t, padded, t == ignore_index, group)
        ctx.kept_logits = z
        ctx.save_for_backward(x, w, t, lse, ent)
        ctx.consts = (group, vocab_start, first_pad, inv_temp, ignore_index, step, reduce_grad)
        ctx.set_materialize_grads(False)
        return lp, ent.clone()  # [N] copy: callers may edit the output in place

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_lp, g_ent):
        x, w, t, lse, ent = ctx.saved_tensors
        group, vocab_start, first_pad, inv_temp, ignore_index, step, reduce_grad = ctx.consts
        need_x, need_w = ctx.needs_input_grad[:2]
        if not (need_x or need_w) or (g_lp is None and g_ent is None):
            return (None,) * 13
        g_lp = None if g_lp is None else g_lp.float().contiguous()
        g_ent = None if g_ent is None else g_ent.float().contiguous()
        N, n = x.shape[0], w.shape[0]
        # The backward walks the vocabulary, not the tokens: a chunk is the logits of every token
        # for a slice of columns [c0, c1) (as many elements as a forward chunk). Each slice of
        # grad(w) = dZ[:, c0:c1]^T X is then written once, by one GEMM over all tokens; chunking
        # over tokens instead would add every chunk's [n, h] product into an fp32 accumulator (a
        # read and a write of n h fp32 per chunk: on a GPU at V = 152k, h = 4096 that traffic took
        # more time than the GEMMs). What is accumulated over slices is grad(x) [N, h], N h per
        # slice. d loss / d z needs only each row's lse and entropy, which the forward kept.
        # vocab columns per chunk; at least _MIN_COLS: grad(x)'s GEMM runs short in K below that,
        # and each slice adds one more fp32 rounding to grad(x)
        cols = max(_MIN_COLS, (step * n) // max(N, 1) // _ALIGN * _ALIGN)
        kept, ctx.kept_logits = ctx.kept_logits, None  # [N, n] when the forward kept its one chunk
        if kept is not None:
            cols = n  # every logit fits in one chunk: use the forward's
        gx = None  # [N, h], fp32 while accumulating
        gw = torch.empty_like(w, memory_format=torch.contiguous_format) if need_w else None  # [n, h]
        for c0 in range(0, n, cols):
            c1 = min(n, c0 + cols)
            wc = w[c0:c1]                                                      # [vc, h]
            z = kept if kept is not None else _chunk_logits(x, wc, max(first_pad - c0, 0))
            kept = None
            dz = _chunk_grad(z, t, lse, ent, g_lp, g_ent, vocab_start + c0, inv_temp, ignore_index)  # [N, vc]
            del z
            if need_x:
                if gx is None:
                    gx = torch.mm(dz, wc).float()  # a no-op cast for fp32
                elif gx.dtype == dz.dtype:
                    gx.addmm_(dz, wc)
                else:
                    gx.add_(torch.mm(dz, wc))
            if need_w:
                torch.mm(dz.t(), x, out=gw[c0:c1])                             # [vc, h]
            del dz
        if need_x:
            if gx is None:  # no tokens or no columns
                gx = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
            gx = gx.to(x.dtype)
            if group is not None and reduce_grad:
                import torch.distributed as dist

                dist.all_reduce(gx, group=group)  # each rank's vocab shard adds its part of dL/dx
        return gx, gw, None, None, None, None, None, None, None, None, None, None, None


class _FusedLinearLoss(torch.autograd.Function):
    """(x [N, h], w [n, h], targets [N], pos [N], token_loss) -> (loss [], logprob [N], entropy [N]),
    grad(x) and grad(w) computed in the forward (see linear_token_loss)."""

    @staticmethod
    def forward(ctx, x, w, t, pos, token_loss, group, vocab_start, padded, first_pad, inv_temp, ignore_index, step,
                reduce_grad, needs_grad, with_entropy):
        N = x.shape[0]
        need_x = needs_grad and x.requires_grad
        need_w = needs_grad and w.requires_grad
        lp_all = torch.empty(N, dtype=torch.float32, device=x.device)
        ent_all = torch.empty(N, dtype=torch.float32, device=x.device)
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        # gradients in the GEMMs' dtype; grad(w) [n, h] sums over chunks, in fp32 for half weights
        # when there is more than one chunk
        gx = torch.empty(N, x.shape[1], dtype=x.dtype, device=x.device) if need_x else None           # [N, h]
        gw = None
        for r0 in range(0, N, step):
            r1 = min(N, r0 + step)
            tc = t[r0:r1]
            z = _chunk_logits(x[r0:r1], w, first_pad)                          # [c, n]
            m, s, mom, zt = _chunk_stats(z, tc, vocab_start, padded, ignore_index, inv_temp, with_entropy)
            # this chunk's TP reductions now, not once after the loop: its gradient needs them
            lp, ent, lse = _reduce_and_finalize(m, s, mom, zt, tc, padded, tc == ignore_index, group)
            with torch.enable_grad():
                lp_in = lp.detach().requires_grad_(need_x or need_w)
                ent_in = ent.detach().requires_grad_(need_x or need_w) if with_entropy else None
                chunk_loss = token_loss(pos[r0:r1], lp_in, ent_in)
                if not (torch.is_tensor(chunk_loss) and chunk_loss.dim() == 0):
                    raise ValueError(f"token_loss must return a 0-d tensor, got {type(chunk_loss).__name__} "
                                     f"{tuple(getattr(chunk_loss, 'shape', ()))}")
                inputs = [v for v in (lp_in, ent_in) if v is not None]
                grads = (torch.autograd.grad(chunk_loss, inputs, allow_unused=True)
                         if (need_x or need_w) and chunk_loss.requires_grad else [None] * len(inputs))
            loss += chunk_loss.detach().float()
            lp_all[r0:r1], ent_all[r0:r1] = lp, ent
            g_lp, g_ent = grads[0], (grads[1] if with_entropy else None)
            if not (need_x or need_w) or (g_lp is None and g_ent is None):
                if need_x:  # this chunk's loss does not read its log-probs
                    gx[r0:r1] = 0.0
                continue
            g_lp = None if g_lp is None else g_lp.float().contiguous()
            g_ent = None if g_ent is None else g_ent.float().contiguous()
            dz = _chunk_grad(z, tc, lse, ent, g_lp, g_ent, vocab_start, inv_temp, ignore_index)  # [c, n]
            if need_x:
                torch.mm(dz, w, out=gx[r0:r1])                                 # [c, h]
            if need_w and gw is None:
                gw = torch.mm(dz.t(), x[r0:r1])                                # [n, h]
                gw = gw.float() if N > step else gw
            elif need_w:
                gw.addmm_(dz.t(), x[r0:r1]) if gw.dtype == dz.dtype else gw.add_(torch.mm(dz.t(), x[r0:r1]))
            del dz, z
        ctx.grads = (gx, gw)
        ctx.consts = (group, reduce_grad, x.shape, x.dtype, w.dtype)
        ctx.mark_non_differentiable(lp_all, ent_all)
        return loss, lp_all, ent_all

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_loss, _g_lp, _g_ent):
        if ctx.grads is None:
            raise RuntimeError("linear_token_loss: its backward runs once (the gradients it kept were handed on)")
        gx, gw = ctx.grads
        ctx.grads = None
        group, reduce_grad, x_shape, x_dtype, w_dtype = ctx.consts
        need_x, need_w = ctx.needs_input_grad[:2]
        scale = None if g_loss is None else g_loss.float()
        if need_x:
            if gx is None or scale is None:
                gx = torch.zeros(x_shape, dtype=x_dtype, device=g_loss.device if g_loss is not None else None)
            else:
                gx = gx.float().mul_(scale).to(x_dtype) if gx.dtype != torch.float32 else gx.mul_(scale).to(x_dtype)
            if group is not None and reduce_grad:
                import torch.distributed as dist

                dist.all_reduce(gx, group=group)  # each rank's vocab shard adds its part of dL/dx
        if need_w:  # None: no token's loss read the output layer
            gw = None if gw is None or scale is None else gw.mul_(scale).to(w_dtype)
        return (gx if need_x else None, gw if need_w else None) + (None,) * 13
