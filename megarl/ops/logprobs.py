"""Per-token log-probs and entropy straight from (vocab-parallel) logits.

The naive `log_softmax(logits.float()).gather(...)` materialises fp32 [tokens, vocab] copies
(~5 GB at 8192 x 152064) and entropy doubles that. Here each row is reduced to four numbers
(max, sum of exp, first moment, target logit), so the forward never holds more than one row
chunk in fp32, and the backward recomputes the softmax from the saved logits and per-row
log-sum-exp instead of storing it. On CUDA tensors the fused kernels of csrc/ do both passes;
elsewhere the row-chunked torch code below does, with the same maths.
"""
import torch
import torch.distributed as dist

from . import _ext

# The target id that means "no token here": log-prob and entropy 0, no gradient.
IGNORE_INDEX = -100
# fp32 elements per row chunk of the torch path: two such workspaces (8 MiB) at most are live.
_CHUNK_ELEMS = 1 << 20
# exp() of anything below this is 0 in fp32; clamping -inf logits (masked vocabulary) to it turns
# their 0 * -inf terms into 0 * finite.
_LOG_TINY = -1.0e4


def logprobs_and_entropy(logits, targets, *, tp_group=None, temperature=1.0, with_entropy=True,
                         ignore_index=IGNORE_INDEX):
    """log p(target) and the entropy of softmax(logits / temperature), per token.

    logits: [..., V/tp] local vocabulary shard (fp32, bf16 or fp16); rank r of tp_group holds
        global columns [r V/tp, (r+1) V/tp) (Megatron's vocab-parallel layout).
    targets: [...] GLOBAL vocabulary ids; positions equal to ignore_index give 0 (and no
        gradient); any other id outside [0, V) gives a NaN log-prob.
    Returns (logprob [...], entropy [...] or None when with_entropy=False), both fp32 and both
    differentiable w.r.t. logits. With tp_group of size > 1 the per-row statistics are reduced
    with one MAX and one packed SUM all-reduce; the backward needs no communication.
    """
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"logits must be fp32, bf16 or fp16, got {logits.dtype}")
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits need a non-empty vocabulary dim, got shape {tuple(logits.shape)}")
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"targets {tuple(targets.shape)} must match logits {tuple(logits.shape)}[:-1]")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise TypeError(f"targets must be integer ids, got {targets.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")

    x, t, restore = _as_rows(logits, targets)  # [N, n], [N]
    tp_size, tp_rank = _group_info(tp_group)
    n = x.shape[1]
    lp, ent = _FusedLogProbs.apply(x, t, tp_group if tp_size > 1 else None, n * tp_rank,
                                   n * tp_size, 1.0 / float(temperature), int(ignore_index))
    return restore(lp), (restore(ent) if with_entropy else None)


def _group_info(group):
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _as_rows(logits, targets):
    """logits [..., n] as rows [N, n] (a view whenever the leading dims can be walked in memory
    order, e.g. a transposed [b, s, n] view of [s, b, n]), targets [N] int64, and a function
    mapping a per-row [N] result back to the leading shape [...]."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    lead = logits.dim() - 1
    order = sorted(range(lead), key=lambda d: -logits.stride(d))  # outermost first, stable
    x = logits.permute(order + [lead])
    shape = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])  # no copy unless the strides really forbid it
    t = targets.permute(order).reshape(-1).to(device=logits.device, dtype=torch.long)
    if order == list(range(lead)):
        return rows, t, lambda y: y.view(shape)
    inverse = sorted(range(lead), key=order.__getitem__)
    return rows, t, lambda y: y.view(shape).permute(inverse).contiguous()


class _FusedLogProbs(torch.autograd.Function):
    """(x [N, n], targets [N]) -> (logprob [N], entropy [N]); saves x and two floats per row."""

    @staticmethod
    def forward(ctx, x, t, group, vocab_start, vocab_size, inv_temp, ignore_index):
        ignored = t == ignore_index
        if _ext.use_kernels(x):
            ext = _ext.load()
            with torch.cuda.device(x.device):
                stream = _ext.stream_of(x)
                if group is None:
                    lp, ent, lse = ext.logprobs_fwd(x, t, vocab_start, vocab_size, ignore_index,
                                                    inv_temp, True, stream)
                else:
                    stats = ext.logprobs_fwd(x, t, vocab_start, vocab_size, ignore_index,
                                             inv_temp, False, stream)
                    lp, ent, lse = _reduce_and_finalize(*stats, t, vocab_size, ignored, group)
        else:
            stats = _local_stats(x, t, vocab_start, inv_temp)
            lp, ent, lse = _reduce_and_finalize(*stats, t, vocab_size, ignored, group)
        ctx.save_for_backward(x, t, lse, ent)
        ctx.consts = (vocab_start, inv_temp, ignore_index)
        ctx.set_materialize_grads(False)
        return lp, ent.clone()  # [N] copy: callers may edit the output in place

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_lp, g_ent):
        x, t, lse, ent = ctx.saved_tensors
        vocab_start, inv_temp, ignore_index = ctx.consts
        if not ctx.needs_input_grad[0] or (g_lp is None and g_ent is None):
            return (None,) * 7
        g_lp = None if g_lp is None else g_lp.float().contiguous()
        g_ent = None if g_ent is None else g_ent.float().contiguous()
        if _ext.use_kernels(x):
            with torch.cuda.device(x.device):
                grad = _ext.load().logprobs_bwd(x, t, lse, ent, g_lp, g_ent, vocab_start,
                                                ignore_index, inv_temp, _ext.stream_of(x))
        else:
            grad = _grad_torch(x, t, lse, ent, g_lp, g_ent, vocab_start, inv_temp, ignore_index)
        return grad, None, None, None, None, None, None


def _reduce_and_finalize(m, s, w, zt, t, vocab_size, ignored, group):
    """Local row stats -> (logprob, entropy, lse) [N], all fp32 nats.

    m = max z, s = sum exp(z - m), w = sum exp(z - m)(z - m), zt = z_target (0 off-shard),
    with z = logits / temperature. Across TP ranks: one MAX all-reduce of m, then s and w are
    rescaled to the global max and (s, w, zt) summed in one packed all-reduce.
    """
    if group is not None:
        gm = m.clone()
        dist.all_reduce(gm, op=dist.ReduceOp.MAX, group=group)
        d = m - gm  # <= 0; -inf for an all -inf shard
        r = torch.exp(d)
        packed = torch.stack([s * r, torch.where(s > 0, r * (w + d * s), 0.0), zt])  # [3, N]
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
        m, (s, w, zt) = gm, packed.unbind(0)
    log_s = torch.log(s)
    lse = m + log_s
    ent = log_s - w / s
    valid = (t >= 0) & (t < vocab_size)
    lp = torch.where(valid, (zt - m) - log_s, float("nan"))
    return lp.masked_fill(ignored, 0.0), ent.masked_fill(ignored, 0.0), lse


def _target_cols(t, vocab_start, n):
    """Target columns local to this shard (clamped, [N]) and whether this shard owns them."""
    local = t - vocab_start
    owned = (local >= 0) & (local < n)
    return local.clamp(0, n - 1), owned


def _scaled_into(out, xc, inv_temp, shift):
    """out[:] = xc * inv_temp - shift[:, None] in fp32 ([c, n]; out may be xc itself)."""
    out.copy_(xc)
    if inv_temp != 1.0:
        out.mul_(inv_temp)
    return out.sub_(shift[:, None])


def _chunking(x):
    """Rows per chunk and two reusable fp32 [rows, n] workspaces (allocated once per call, so
    the chunk loop neither allocates nor page-faults). At most 1/32 of the rows per chunk, so
    the workspaces stay <= 12.5% of half-precision logits (6.25% of fp32) above 32 rows."""
    N, n = x.shape
    step = max(1, min(N, _CHUNK_ELEMS // n, -(-N // 32)))
    return step, [torch.empty(step, n, dtype=torch.float32, device=x.device) for _ in range(2)]


def _local_stats(x, t, vocab_start, inv_temp, with_moment=True):
    """The forward pass over this shard: m, s, w, zt [N] fp32, in row chunks. with_moment=False: w (the entropy's first
    moment, three of the torch path's seven passes over each chunk) is not computed and comes
    back NaN, for callers that never read the entropy."""
    N, n = x.shape
    m, s, w, zt = torch.empty(4, N, dtype=torch.float32, device=x.device).unbind(0)
    if not with_moment:
        w.fill_(float("nan"))
    if N == 0:
        return m, s, w, zt
    cols, owned = _target_cols(t, vocab_start, n)
    step, (zbuf, ebuf) = _chunking(x)
    for r0 in range(0, N, step):
        r1 = min(N, r0 + step)
        xc, z, e, mc = x[r0:r1], zbuf[: r1 - r0], ebuf[: r1 - r0], m[r0:r1]
        torch.amax(z.copy_(xc), -1, out=mc)
        _scaled_into(z, z, inv_temp, mc.mul_(inv_temp))  # z - max z <= 0
        zt[r0:r1] = z.gather(1, cols[r0:r1, None]).squeeze(1)
        torch.exp(z, out=e)
        torch.sum(e, -1, out=s[r0:r1])
        if with_moment:
            torch.sum(z.clamp_(min=_LOG_TINY).mul_(e), -1, out=w[r0:r1])  # -inf logits add 0
    return m, s, w, zt.add_(m).masked_fill_(~owned, 0.0)


def _grad_torch(x, t, lse, ent, g_lp, g_ent, vocab_start, inv_temp, ignore_index, out=None):
    """The backward pass: [N, n] gradient in x's dtype, in row chunks.

    d/dz_j [g_lp lp + g_ent H] = p_j (-g_lp - g_ent (H + log p_j)) + g_lp 1[j = t],
    with log p_j = z_j - lse recomputed from x; times 1/temperature for d/dx.
    out: where the gradient goes; may be x itself (each row chunk is read before it is
    overwritten), which the fused output layer uses to hold one chunk's logits only.
    """
    N, n = x.shape
    grad = torch.empty((N, n), dtype=x.dtype, device=x.device) if out is None else out
    if N == 0:
        return grad
    ignored = t == ignore_index
    keep = (~ignored).float()
    g1 = keep * g_lp if g_lp is not None else torch.zeros_like(keep)
    a = (g1 if g_ent is None else g1 + keep * g_ent * ent) * -inv_temp          # [N]
    b = None if g_ent is None else keep * g_ent * -inv_temp                      # [N]
    cols, owned = _target_cols(t, vocab_start, n)
    c = torch.where(owned, g1 * inv_temp, 0.0)                                   # [N]
    step, (lbuf, pbuf) = _chunking(x)
    for r0 in range(0, N, step):
        r1 = min(N, r0 + step)
        g = grad[r0:r1] if x.dtype == torch.float32 else lbuf[: r1 - r0]         # [c, n] fp32
        logp = _scaled_into(g, x[r0:r1], inv_temp, lse[r0:r1])
        p = torch.exp(logp, out=pbuf[: r1 - r0])
        if b is None:
            torch.mul(p, a[r0:r1, None], out=g)
        else:
            logp.clamp_(min=_LOG_TINY).mul_(b[r0:r1, None]).add_(a[r0:r1, None]).mul_(p)
        g.scatter_add_(1, cols[r0:r1, None], c[r0:r1, None])
        skip = torch.nonzero(ignored[r0:r1]).flatten()
        if skip.numel():
            g.index_fill_(0, skip, 0.0)  # p may overflow on ignored rows (only their rows: no full pass)
        if x.dtype != torch.float32:
            grad[r0:r1].copy_(g)
    return grad
