"""megarl.ops.gae / gae_packed against a plain float64 reference loop.

Tolerances: fp64 inputs are compared at 1e-10 (the vectorised scan only reorders sums). fp32
outputs accumulate up to T terms of O(1) (gamma = lam = 1 is a plain suffix sum) in fp32, so
they get rtol 1e-5 and an absolute 1e-5 scaled by the largest reference magnitude.
"""
import pytest
import torch

from megarl.ops import gae, gae_packed
from megarl.ops import advantages as gae_mod

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
GAMMA_LAM = [(0.99, 0.95), (1.0, 1.0), (0.9, 0.0), (0.5, 0.7)]


def ref_gae(r, v, m, gamma, lam):
    """Plain loop, float64: per row, walk the valid tokens backwards (masked ones skipped)."""
    B, T = r.shape
    adv, ret = torch.zeros(B, T, dtype=torch.float64), torch.zeros(B, T, dtype=torch.float64)
    rl, vl, ml = r.double().cpu().tolist(), v.double().cpu().tolist(), m.bool().cpu().tolist()
    for i in range(B):
        next_adv = next_value = 0.0  # nothing after the last valid token
        for t in reversed(range(T)):
            if not ml[i][t]:
                continue
            delta = rl[i][t] + gamma * next_value - vl[i][t]
            next_adv = delta + gamma * lam * next_adv
            next_value = vl[i][t]
            adv[i, t], ret[i, t] = next_adv, next_adv + vl[i][t]
    return adv, ret


def assert_close(out, ref, dtype):
    assert out.dtype == dtype
    if dtype == torch.float64:
        tol = dict(rtol=1e-10, atol=1e-10)
    else:
        scale = ref.abs().max().item() if ref.numel() else 0.0
        tol = dict(rtol=1e-5, atol=1e-5 * (1.0 + scale))
    torch.testing.assert_close(out.cpu().double(), ref, **tol)


def check_gae(r, v, m, gamma, lam, dtype=torch.float32):
    """megarl's gae against the float64 loop on the same inputs; returns megarl's (adv, ret)."""
    adv, ret = gae(r, v, m, gamma, lam)
    radv, rret = ref_gae(r, v, m, gamma, lam)
    assert_close(adv, radv, dtype)
    assert_close(ret, rret, dtype)
    return adv, ret


def inputs(B, T, seed, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(B, T, generator=g, dtype=torch.float64).to(dtype).to(device)
    v = torch.randn(B, T, generator=g, dtype=torch.float64).to(dtype).to(device)
    return r, v, g


def right_padded(B, T, g):
    lens = torch.randint(1, T + 1, (B,), generator=g)
    lens[0] = T
    if B > 1:
        lens[1] = 0
    return torch.arange(T)[None] < lens[:, None]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gamma,lam", GAMMA_LAM)
@pytest.mark.parametrize("B,T", [(9, 77), (3, 1), (4, 2050)])
def test_right_padded_matches_loop(device, dtype, gamma, lam, B, T):
    r, v, g = inputs(B, T, seed=B * T, dtype=dtype, device=device)
    m = right_padded(B, T, g).to(device)
    check_gae(r, v, m, gamma, lam, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["holes", "left_padded", "all_masked", "float_mask"])
def test_general_masks_match_loop(device, kind):
    B, T = 7, 300
    r, v, g = inputs(B, T, seed=3, device=device)
    if kind == "holes":   # e.g. tool observations inside a response
        m = torch.rand(B, T, generator=g) < 0.7
    elif kind == "left_padded":
        m = torch.arange(T)[None] >= torch.randint(0, T, (B, 1), generator=g)
    elif kind == "all_masked":
        m = torch.zeros(B, T, dtype=torch.bool)
    else:
        m = (torch.rand(B, T, generator=g) < 0.8).float()
    m = m.to(device)
    check_gae(r, v, m, 0.97, 0.9)


# g = gamma*lam = 0 has no pass-through scan (it is always compacted), so no such case.
HOLED_PATHS = [(path, gamma, lam) for path in ("pass_through", "compaction")
               for gamma, lam in GAMMA_LAM + [(0.6, 0.4)] if path == "compaction" or gamma * lam > 0]


@pytest.mark.parametrize("path,gamma,lam", HOLED_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("B,T", [(6, 77), (3, 2050)])
def test_holed_masks_on_both_cpu_paths(monkeypatch, path, dtype, gamma, lam, B, T):
    """Holed rows take the pass-through scan when gamma*lam >= _MIN_TRANSPARENT_G and are
    compacted otherwise; force each path. At T=2050 the pass-through scan's chunk heads take
    the one-pass fp64 scan for gamma*lam = 0.94 and 1, the chunked recursion for 0.35 and 0.24."""
    monkeypatch.setattr(gae_mod, "_MIN_TRANSPARENT_G", 1e-30 if path == "pass_through" else 2.0)
    r, v, g = inputs(B, T, seed=T + B, dtype=dtype)
    m = right_padded(B, T, g) & (torch.rand(B, T, generator=g) < 0.85)
    m[0, T // 3: T // 2] = False  # one long hole, like a tool observation
    check_gae(r, v, m, gamma, lam, dtype)


@pytest.mark.parametrize("lo,dtype", [(0.3, torch.float64), (0.3, torch.float32), (0.0, torch.float32)])
def test_suffix_scan_with_per_token_decays(lo, dtype):
    """The chunked recursion behind _carries, y_t = x_t + d_t y_{t+1}, against a float64 loop;
    decays down to 0 make products underflow within a chunk (smaller chunks, clamped P)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(5, 1100, generator=g, dtype=torch.float64)
    d = lo + (1 - lo) * torch.rand(5, 1100, generator=g, dtype=torch.float64)
    if lo == 0.0:
        d[:, ::7] = 0.0
    ref, acc = torch.zeros_like(x), torch.zeros(5, dtype=torch.float64)
    for t in reversed(range(x.shape[1])):
        acc = x[:, t] + d[:, t] * acc
        ref[:, t] = acc
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    for L in (4, 32):
        y = gae_mod._suffix_scan(x.to(dtype), d.to(dtype), L, lo)
        torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("C,lo", [(300, 0.2), (300, 1e-5), (2, 0.5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chunk_carries_both_branches(C, lo, dtype):
    """The pass-through scan's carries between chunks, D_c h_{c+1} with h_c = a_c + D_c h_{c+1},
    against a float64 loop: lo = 0.2 over 300 chunks (products down to 1e-210) takes the
    one-pass fp64 reversed cumsum; lo = 1e-5 (products below fp64's range) the chunked recursion."""
    g = torch.Generator().manual_seed(12)
    a = torch.randn(4, C, generator=g, dtype=torch.float64)
    D = lo + (1 - lo) * torch.rand(4, C, generator=g, dtype=torch.float64)
    D[0] = lo  # one row at the bound: its products reach lo^C
    h, acc = torch.zeros_like(a), torch.zeros(4, dtype=torch.float64)
    for c in reversed(range(C)):
        acc = a[:, c] + D[:, c] * acc
        h[:, c] = acc
    ref = D[:, :-1] * h[:, 1:]
    carry = gae_mod._carries(a.to(dtype), D.to(dtype), lo)
    assert carry.dtype == dtype and carry.shape == (4, C - 1)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(carry.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("device", DEVICES)
def test_nothing_leaks_past_the_mask(device):
    """Garbage rewards/values on masked tokens change nothing; masked outputs are 0."""
    B, T = 5, 64
    r, v, g = inputs(B, T, seed=4, device=device)
    m = (right_padded(B, T, g) & (torch.rand(B, T, generator=g) < 0.9)).to(device)
    adv, ret = gae(r, v, m, 0.99, 0.95)
    junk = torch.randn(B, T, generator=g).to(device) * 1e3
    adv2, ret2 = gae(torch.where(m, r, junk), torch.where(m, v, -junk), m, 0.99, 0.95)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)
    assert (adv[~m] == 0).all() and (ret[~m] == 0).all()


def test_many_row_blocks_and_chunks(monkeypatch):
    """Force several row blocks (and a last partial one) and T not a multiple of the chunk."""
    monkeypatch.setattr(gae_mod, "_BLOCK_ELEMS", 3 * 128)
    B, T = 10, 100
    r, v, g = inputs(B, T, seed=5)
    m = right_padded(B, T, g)
    m[4, 50:60] = False  # one holed row inside a block
    check_gae(r, v, m, 0.99, 0.95)


@pytest.mark.parametrize("device", DEVICES)
def test_low_precision_inputs_give_fp32(device):
    B, T = 3, 40
    r, v, g = inputs(B, T, seed=6, dtype=torch.bfloat16, device=device)
    m = right_padded(B, T, g).to(device)
    adv, _ = check_gae(r, v, m, 0.99, 0.95)  # reference on the same bf16-rounded inputs
    assert not adv.requires_grad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_packed_matches_loop_per_sequence(device, with_mask, dtype):
    g = torch.Generator().manual_seed(7)
    lens = [17, 0, 1, 300, 64, 5]
    start = 3  # tokens before cu[0] and after cu[-1] belong to no sequence
    cu = torch.tensor([start] + (torch.tensor(lens).cumsum(0) + start).tolist())
    N = int(cu[-1]) + 4
    r = torch.randn(N, generator=g, dtype=torch.float64).to(dtype).to(device)
    v = torch.randn(N, generator=g, dtype=torch.float64).to(dtype).to(device)
    m = (torch.rand(N, generator=g) < 0.8).to(device) if with_mask else None
    for max_seqlen in (None, max(lens)):
        adv, ret = gae_packed(r, v, cu.to(device), 0.98, 0.92, mask=m, max_seqlen=max_seqlen)
        for i, n in enumerate(lens):
            a, b = int(cu[i]), int(cu[i + 1])
            mm = torch.ones(1, n, dtype=torch.bool) if m is None else m[None, a:b]
            radv, rret = ref_gae(r[None, a:b], v[None, a:b], mm, 0.98, 0.92)
            assert_close(adv[a:b], radv[0], dtype)
            assert_close(ret[a:b], rret[0], dtype)
        assert (adv[:start] == 0).all() and (adv[int(cu[-1]):] == 0).all()
        assert (ret[:start] == 0).all() and (ret[int(cu[-1]):] == 0).all()


def test_packed_equals_padded():
    g = torch.Generator().manual_seed(8)
    lens = torch.tensor([40, 3, 77])
    T = int(lens.max())
    m = torch.arange(T)[None] < lens[:, None]
    r, v = torch.randn(3, T, generator=g), torch.randn(3, T, generator=g)
    adv, ret = gae(r, v, m, 0.99, 0.95)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    padv, pret = gae_packed(r[m], v[m], cu, 0.99, 0.95)
    torch.testing.assert_close(padv, adv[m], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pret, ret[m], rtol=1e-6, atol=1e-6)


def test_empty_and_validation():
    adv, ret = gae(torch.zeros(0, 5), torch.zeros(0, 5), torch.zeros(0, 5, dtype=torch.bool), 1.0, 1.0)
    assert adv.shape == ret.shape == (0, 5)
    adv, ret = gae_packed(torch.randn(4), torch.randn(4), torch.zeros(1, dtype=torch.long), 1.0, 1.0)
    assert (adv == 0).all() and (ret == 0).all()
    with pytest.raises(ValueError):
        gae(torch.randn(2, 3), torch.randn(2, 4), torch.ones(2, 3), 0.9, 0.9)
    with pytest.raises(ValueError):
        gae_packed(torch.randn(2, 3), torch.randn(2, 3), torch.tensor([0, 3]), 0.9, 0.9)
