"""Generalised advantage estimation without a Python loop over the response length.

For the valid tokens of a sequence, walking backwards,
    delta_t = r_t + gamma V_next - v_t,   A_t = delta_t + gamma lam A_next,   R_t = A_t + v_t,
where "next" is the next valid token, and V_next = A_next = 0 after the last one: nothing leaks
across the end of a response. Masked tokens are invisible (A = R = 0 there; a hole inside a
response, e.g. a tool observation, is skipped rather than ending it).

On CUDA tensors the chunked-scan kernel of csrc/gae.cu runs; elsewhere the torch path below
computes A as a discounted reverse cumulative sum of delta, one small matmul per level: within
chunks of _PREFIX_CHUNK tokens, then recursively over the chunk heads. This is exact up to
rounding.
Blocks whose masks have holes run a scan whose decay is g = gamma*lam on valid tokens and 1 on
masked ones, so holes pass the running sums through untouched (no compaction): a matmul within
chunks of _CHUNK tokens, then one fp64 reversed cumsum over the chunk heads. For g below
_MIN_TRANSPARENT_G, where that scan's scaling would lose precision, they are compacted instead.
"""
import math

import torch

from . import _ext

_CHUNK = 16            # chunk length of the pass-through scan (holed rows)
_PREFIX_CHUNK = 16     # chunk length of the prefix path's discounted suffix sums
_BLOCK_ELEMS = 1 << 19  # tokens per row block of the torch path (2 MiB fp32 temporaries)
_MIN_TRANSPARENT_G = 0.25  # holed rows: smallest gamma*lam for the pass-through scan (else compact)


def gae(rewards, values, mask, gamma, lam):
    """GAE over a batch of (right-padded or holed) responses.

    rewards, values: [B, T]; mask: [B, T] bool or 0/1, True on response tokens. Entries under
    the mask are never used, but must be finite (the torch path multiplies them by 0).
    Returns (advantages, returns), [B, T], fp32 (fp64 if an input is fp64), zero where masked.
    Not differentiable: values are treated as constants, as GAE targets should be.
    """
    if rewards.dim() != 2 or rewards.shape != values.shape or rewards.shape != mask.shape:
        raise ValueError(f"rewards, values and mask must all be [B, T]; got {tuple(rewards.shape)}, "
                         f"{tuple(values.shape)}, {tuple(mask.shape)}")
    dt = _out_dtype(rewards, values)
    with torch.no_grad():
        r, v = rewards.to(dt).contiguous(), values.to(dt).contiguous()
        m = mask.to(device=r.device, dtype=torch.bool).contiguous()
        if _ext.use_kernels(r):
            with torch.cuda.device(r.device):
                adv, ret = _ext.load().gae(r, v, m, None, float(gamma), float(lam),
                                           _ext.stream_of(r))
            return adv, ret
        return _gae_torch(r, v, m, float(gamma), float(lam))


def gae_packed(rewards, values, cu_seqlens, gamma, lam, *, mask=None, max_seqlen=None):
    """GAE over sequences concatenated along one dim (no padding between them).

    rewards, values: [N]; cu_seqlens: [S + 1] non-decreasing offsets, sequence i being tokens
    [cu_seqlens[i], cu_seqlens[i+1]); mask: optional [N] (e.g. prompt tokens False).
    max_seqlen: optional host int (longest sequence), saves a device sync on the torch path.
    Returns (advantages, returns) [N]; tokens outside every sequence or masked get 0.
    """
    if rewards.dim() != 1 or rewards.shape != values.shape:
        raise ValueError(f"rewards and values must be [N]; got {tuple(rewards.shape)}, "
                         f"{tuple(values.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens must be [S + 1]")
    if mask is not None and mask.shape != rewards.shape:
        raise ValueError(f"mask must be [N] like rewards; got {tuple(mask.shape)}")
    dt = _out_dtype(rewards, values)
    with torch.no_grad():
        r, v = rewards.to(dt).contiguous(), values.to(dt).contiguous()
        cu = cu_seqlens.to(device=r.device, dtype=torch.long).contiguous()
        m = None if mask is None else mask.to(device=r.device, dtype=torch.bool).contiguous()
        if _ext.use_kernels(r):
            with torch.cuda.device(r.device):
                adv, ret = _ext.load().gae(r, v, m, cu, float(gamma), float(lam),
                                           _ext.stream_of(r))
            return adv, ret
        return _gae_packed_torch(r, v, m, cu, float(gamma), float(lam), max_seqlen)


def _out_dtype(*ts):
    return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32


def _scan_mats(g, L, T, dtype, device):
    """Per level of _discounted_suffix_sum over T tokens in chunks of L: (K [L, L] with
    K[s, t] = d^(s-t) for s >= t, tail [L] with tail[j] = d^(L-j)), where level i's decay d
    is g^(L^i) (each chunk head stands for L tokens of the level below). Built in fp64; powers
    that underflow are 0, which is what they are worth."""
    mats, d, C = [], float(g), -(-T // L)
    i = torch.arange(L, dtype=torch.float64, device=device)
    diff = i[:, None] - i[None, :]
    while True:
        K = torch.where(diff >= 0, d ** diff.clamp(min=0), 0.0)
        mats.append((K.to(dtype), (d ** (L - i)).to(dtype)))
        if C == 1:
            return mats
        d, C = d ** L, -(-C // L)


def _discounted_suffix_sum(x, mats, L, out=None):
    """y_t = x_t + g y_{t+1} along the last dim of [n, T] (y_T = 0): within chunks of L one
    matmul with K, then the chunk heads take the same sum recursively (decay g^L) and reach
    each token of the chunk before through tail. `out`: [n, T] to write y into (T % L == 0)."""
    n, T = x.shape
    C = -(-T // L)
    if C * L != T:  # pad with zeros: nothing enters
        x, out = torch.nn.functional.pad(x, (0, C * L - T)), None
    K, tail = mats[0]
    y = torch.mm(x.view(n * C, L), K, out=None if out is None else out.view(n * C, L)).view(n, C, L)
    if C > 1:
        H = _discounted_suffix_sum(y[..., 0].contiguous(), mats[1:], L)   # [n, C] full heads
        y[:, :-1].addcmul_(H[:, 1:, None], tail)
    y = y.view(n, C * L)
    return y if C * L == T else y[:, :T]


def _gae_torch(r, v, m, gamma, lam):
    """[B, T] GAE in row blocks: prefix-shaped masks take _prefix_block; a block with holes takes
    the pass-through scan, or compaction when gamma*lam < _MIN_TRANSPARENT_G."""
    B, T = r.shape
    adv, ret = torch.empty_like(r), torch.empty_like(r)
    if B == 0 or T == 0:
        return adv, ret
    g = gamma * lam
    mats = _scan_mats(g, _PREFIX_CHUNK, T, r.dtype, r.device)
    # Prefix test: sum_t m_t (T - t) reaches cnt T - cnt (cnt - 1) / 2 = cnt (T + 1/2 - cnt/2)
    # only when the cnt valid tokens come first. Every term is an integer <= T^2 (or a half
    # integer below it), exact while T^2 <= 2 / eps (T <= 4096 in fp32); longer rows use a
    # comparison of neighbours instead.
    exact = T * T <= 2.0 / torch.finfo(r.dtype).eps
    ramp = torch.arange(T, 0, -1, dtype=r.dtype, device=r.device) if exact else None
    rows = max(1, _BLOCK_ELEMS // T)
    ones = torch.ones(min(_CHUNK, T), min(_CHUNK, T), dtype=r.dtype, device=r.device).tril_()
    for i in range(0, B, rows):
        j = min(B, i + rows)
        mb = m[i:j]
        mf = mb.view(torch.uint8).to(r.dtype)                   # [b, T] 0/1 (uint8: fast cast)
        if ramp is not None:
            cnt = mf.sum(1)
            holed = bool((torch.mv(mf, ramp) != cnt * (T + 0.5 - 0.5 * cnt)).any())
        else:
            holed = bool((mb[:, 1:] > mb[:, :-1]).any())         # a valid token after a masked one
        if holed and g >= _MIN_TRANSPARENT_G:
            _pass_through_block(r[i:j], v[i:j], mf, gamma, g, ones, adv[i:j], ret[i:j])
        elif holed:
            _holed_block(r[i:j], v[i:j], mb, gamma, mats, adv[i:j], ret[i:j])
        else:
            _prefix_block(r[i:j], v[i:j], mf, gamma, mats, adv[i:j], ret[i:j])
    return adv, ret


def _prefix_block(rb, vb, mf, gamma, mats, out_adv, out_ret):
    """Rows whose valid tokens (mf = 1) form a prefix: zero everything past it, then A is the
    gamma*lam-discounted suffix sum of delta (zero past the prefix, so nothing leaks).
    Masked entries are multiplied by 0, so they must be finite."""
    nvm = torch.addcmul(rb.new_zeros(()), vb, mf, value=-1.0)   # [b, T] -v, 0 past the prefix
    delta = torch.addcmul(nvm, rb, mf)                          # r - v
    delta[:, :-1].sub_(nvm[:, 1:], alpha=gamma)                 # + gamma v_next
    L = mats[0][0].shape[0]
    y = _discounted_suffix_sum(delta, mats, L, out=out_adv if rb.shape[1] % L == 0 else None)
    if y.data_ptr() != out_adv.data_ptr():
        out_adv.copy_(y)
    torch.sub(out_adv, nvm, out=out_ret)                        # A + v


def _pass_through_block(rb, vb, mf, gamma, g, ones, out_adv, out_ret):
    """Rows with holes, without moving tokens: A is the scan y_t = z_t + d_{t+1} y_{t+1} with
    d = g on valid tokens and 1 on masked ones (a hole passes y through), minus a correction.

    With k(t, s) the number of valid tokens in [t, s), A_t = sum_{valid s >= t} g^k(t,s) delta_s
    and delta_s's gamma * V_next term is, summed this way, (gamma/g) sum_{valid s > t} g^k(t,s) v_s.
    So A_t = y_t - (gamma/g) v_t on valid t, with z = m (r + (gamma/g - 1) v) (for valid t < s,
    the product of d over (t, s] is g^k(t,s)). The subtraction costs ~gamma/g ulps of v, hence
    g >= _MIN_TRANSPARENT_G.

    Within chunks of L tokens, with Q_t the product of d over the chunk's tokens up to t,
    y_t = S_t / Q_t where S_t = sum_{s >= t} Q_s z_s + Q_last H_next: one matmul with a triangle
    of ones (Q >= g^L >= 2^-2L: no underflow). The heads H_c = S_c[0] + Q_last,c H_{c+1} are a
    scan over the chunks, which _carries does."""
    b, T = rb.shape
    L = ones.shape[0]
    C = -(-T // L)
    W = C * L
    k = gamma / g
    d = torch.mul(mf, g - 1.0).add_(1.0)                        # [b, T] g on valid, 1 on masked
    z = torch.add(rb, vb, alpha=k - 1.0).mul_(mf)               # [b, T] m (r + (gamma/g - 1) v)
    if W != T:  # pad with z = 0, d = 1: nothing enters, nothing decays
        d = torch.nn.functional.pad(d, (0, W - T), value=1.0)
        z = torch.nn.functional.pad(z, (0, W - T))
    Q = d.view(b * C, L).cumprod_(1)                            # [bC, L] (in place of d)
    S = torch.mm(z.view(b * C, L).mul_(Q), ones, out=out_adv.view(b * C, L) if W == T else None)
    if C > 1:
        S = S.view(b, C, L)
        carry = _carries(S[..., 0], Q[:, -1].view(b, C), g ** L)  # [b, C-1]
        S[:, :-1].add_(carry[..., None])
    y = S.view(b * C, L).div_(Q).view(b, W)[:, :T]
    torch.addcmul(y, vb, mf, value=-k, out=out_adv).mul_(mf)    # 0 on masked tokens
    torch.addcmul(out_adv, vb, mf, out=out_ret)                 # A + v on valid tokens


def _carries(a, D, lo):
    """What reaches each chunk from the chunks after it: carry_c = D_c h_{c+1}, [n, C-1], where
    h_c = a_c + D_c h_{c+1} along the last dim of [n, C], for decays D in [lo, 1].

    When lo^C is well inside fp64's range, one pass in fp64: with Pi_j the product of D up to j,
    carry_c = (D_c / Pi_c) sum_{j >= c} Pi_j a_{j+1}, the suffix sum accumulated from the end (a
    reversed cumsum, so each carry is a direct sum of its own terms, never a large total minus a
    prefix). Otherwise (long rows, small decays) the chunked recursion of _suffix_scan."""
    n, C = a.shape
    if lo ** C < torch.finfo(torch.float64).tiny * 1e8:
        h = _suffix_scan(a.contiguous(), D.contiguous(), _CHUNK, lo)
        return D[:, :-1] * h[:, 1:]
    D64 = D.to(torch.float64)
    Pi = D64.cumprod(1)[:, :-1]                                 # [n, C-1] fp64
    w = torch.mul(a[:, 1:], Pi).flip(1)                         # [n, C-1], last chunk first
    return w.cumsum_(1).flip(1).mul_(D64[:, :-1]).div_(Pi).to(a.dtype)


def _suffix_scan(x, d, L, lo):
    """y_t = x_t + d_t y_{t+1} along the last dim of [n, T] (y_T = 0), for decays d in [lo, 1]:
    the chunk heads' scan when their products leave fp64's range (see _carries).

    Within chunks of Lc <= L tokens, with P_t the product of d over the chunk's tokens before t,
    y_t = (1/P_t) sum_{s >= t} P_s x_s: one matmul with a triangle of ones. Lc keeps P above
    the dtype's underflow (lo^(Lc-1) >= tiny; at Lc = 2 the one P that could underflow is
    clamped, which only rounds a ratio P_1/P_0 that is below _tiny anyway). The chunk heads
    then take the same scan, recursively, with each chunk's total decay (>= lo^Lc)."""
    n, T = x.shape
    tiny = torch.finfo(x.dtype).tiny * 1e8
    Lc = L if lo ** (L - 1) >= tiny else max(2, 1 + int(math.log(tiny) / math.log(lo)) if lo > 0 else 2)
    C = -(-T // Lc)
    W = C * Lc
    if W != T:  # pad with x = 0, d = 1: nothing enters, nothing decays
        x = torch.nn.functional.pad(x, (0, W - T))
        d = torch.nn.functional.pad(d, (0, W - T), value=1.0)
    dc = d.reshape(n * C, Lc)
    P = torch.empty_like(dc)                                    # [nC, Lc] exclusive products
    P[:, 0] = 1.0
    torch.cumprod(dc[:, :-1], 1, out=P[:, 1:])
    if lo ** (Lc - 1) < tiny:
        P.clamp_(min=tiny)
    ones = torch.ones(Lc, Lc, dtype=x.dtype, device=x.device).tril_()  # [s, t]: 1 where s >= t
    y = torch.mm(x.reshape(n * C, Lc).mul(P), ones).view(n, C, Lc)
    if C > 1:
        D = (P[:, -1] * dc[:, -1]).view(n, C)                   # [n, C] decay across each chunk
        H = _suffix_scan(y[..., 0].contiguous(), D, L, lo ** Lc)  # y at each chunk's first token
        y[:, :-1].add_((D[:, :-1] * H[:, 1:])[..., None])       # reaches t scaled by 1 / P_t
    y = y.view(n * C, Lc).div_(P).view(n, W)
    return y if W == T else y[:, :T]


def _holed_block(rb, vb, mb, gamma, mats, out_adv, out_ret):
    """Rows with masked tokens between valid ones: move each row's valid tokens to the front
    (order kept), solve the prefix problem, and move the results back."""
    b, T = rb.shape
    pos = mb.cumsum(1) - 1                                      # rank of each valid token
    dest = torch.where(mb, pos, T)                              # masked tokens -> dump column
    rc = rb.new_zeros(b, T + 1).scatter_(1, dest, rb)[:, :T]
    vc = vb.new_zeros(b, T + 1).scatter_(1, dest, vb)[:, :T]
    mc = (torch.arange(T, device=rb.device) < (pos[:, -1:] + 1)).to(rb.dtype)
    ac, rtc = torch.empty_like(out_adv), torch.empty_like(out_ret)
    _prefix_block(rc, vc, mc, gamma, mats, ac, rtc)
    src = pos.clamp(min=0)
    zero = rb.new_zeros(())
    torch.where(mb, ac.gather(1, src), zero, out=out_adv)
    torch.where(mb, rtc.gather(1, src), zero, out=out_ret)


def _gae_packed_torch(r, v, m, cu, gamma, lam, max_seqlen):
    """Packed GAE by scattering the sequences into a padded [S, max_len] batch and back."""
    adv, ret = torch.zeros_like(r), torch.zeros_like(r)
    lens = cu[1:] - cu[:-1]                                     # [S]
    S = lens.numel()
    if S == 0:
        return adv, ret
    maxlen = int(max_seqlen) if max_seqlen is not None else int(lens.max())
    if maxlen <= 0:
        return adv, ret
    seq = torch.repeat_interleave(torch.arange(S, device=r.device), lens)   # [n_tok]
    first = torch.cumsum(lens, 0) - lens                                     # [S] exclusive
    pos = torch.arange(seq.numel(), device=r.device) - first[seq]            # [n_tok]
    idx = cu[:-1][seq] + pos                                                 # flat token index
    rp = r.new_zeros(S, maxlen)
    vp = r.new_zeros(S, maxlen)
    mp = torch.zeros(S, maxlen, dtype=torch.bool, device=r.device)
    rp[seq, pos] = r[idx]
    vp[seq, pos] = v[idx]
    mp[seq, pos] = True if m is None else m[idx]
    ap, rtp = _gae_torch(rp, vp, mp, gamma, lam)
    adv[idx] = ap[seq, pos]
    ret[idx] = rtp[seq, pos]
    return adv, ret
