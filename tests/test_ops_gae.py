"""GAE against a plain float64 reference loop: megarl.algorithms.gae (the torch path) on CPU
tensors, megarl.ops.gae (the CUDA kernel) on CUDA ones.

Tolerances: fp64 inputs are compared at 1e-10 (the kernel's scan only reorders sums). fp32
outputs accumulate up to T terms of O(1) (gamma = lam = 1 is a plain suffix sum) in fp32, so
they get rtol 1e-5 and an absolute 1e-5 scaled by the largest reference magnitude.
"""
import pytest
import torch

from megarl import algorithms, ops

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


def gae(r, v, m, gamma, lam):
    """The path each device runs: the CUDA kernel on CUDA tensors, the torch path elsewhere."""
    return (ops.gae if r.is_cuda else algorithms.gae)(r, v, m, gamma, lam)


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


@pytest.mark.parametrize("device", DEVICES)
def test_low_precision_inputs_give_fp32(device):
    B, T = 3, 40
    r, v, g = inputs(B, T, seed=6, dtype=torch.bfloat16, device=device)
    m = right_padded(B, T, g).to(device)
    adv, _ = check_gae(r, v, m, 0.99, 0.95)  # reference on the same bf16-rounded inputs
    assert not adv.requires_grad


def test_empty_and_validation():
    adv, ret = gae(torch.zeros(0, 5), torch.zeros(0, 5), torch.zeros(0, 5, dtype=torch.bool), 1.0, 1.0)
    assert adv.shape == ret.shape == (0, 5)
    with pytest.raises(ValueError):
        gae(torch.randn(2, 3), torch.randn(2, 4), torch.ones(2, 3), 0.9, 0.9)
    with pytest.raises(ValueError):
        ops.gae(torch.randn(2, 3), torch.randn(2, 4), torch.ones(2, 3), 0.9, 0.9)
    with pytest.raises(RuntimeError, match="megarl.algorithms.gae is the torch path"):
        ops.gae(torch.randn(2, 3), torch.randn(2, 3), torch.ones(2, 3), 0.9, 0.9)  # CPU tensors: no kernel
