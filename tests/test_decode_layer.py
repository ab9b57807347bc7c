"""megarl._cpu.decode_layer (csrc/cpu_decode_layer.cpp): one pre-norm transformer layer at a
decode step, against a float64 layer written here (RMSNorm, fused QKV with its bias, q/k RMSNorm,
non-interleaved RoPE, grouped-query attention over the cache with masks, SwiGLU with a linear
offset, the residuals) on fresh random weights, caches and hidden states; the cache row it writes,
the rows that read a shared prompt from another row, and its argument checks. models/decode_step.py
runs it inside a model (tests/test_decode_step.py).
"""
import math

import pytest
import torch

from megarl.models import cpu_kernels


def _op():
    return None if cpu_kernels.wide_linear() is None else cpu_kernels.load().decode_layer


needs_op = pytest.mark.skipif(_op() is None, reason="megarl._cpu.decode_layer needs the built extension and AVX-512 or AVX2")


def _case(A=5, H=48, g=2, n=4, d=16, F=40, S=12, start=9, qk_norm=True, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    r = n // g
    c = dict(
        h=rnd(A, H), norm1=1 + 0.3 * rnd(H), eps1=1e-5, w_qkv=rnd(g * (r + 2) * d, H, scale=H ** -0.5),
        b_qkv=rnd(g * (r + 2) * d, scale=0.1) if bias else None, groups=g, heads=n, head_dim=d,
        q_norm=1 + 0.3 * rnd(d) if qk_norm else None, q_eps=1e-6, k_norm=1 + 0.3 * rnd(d) if qk_norm else None,
        k_eps=1e-6)
    angles = start * (10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d))  # RoPE at position `start`
    c["cos"], c["sin"] = torch.cos(angles).float(), torch.sin(angles).float()
    c["k_cache"], c["v_cache"] = rnd(A, g, S, d), rnd(A, g, S, d)
    c["start"] = start
    masked = torch.rand(A, start + 1, generator=gen) < 0.3  # scattered masked positions
    masked[A // 2, : start // 2] = True  # a left-padded row
    masked[:, start] = False  # every row attends to its new token
    c.update(masked=masked, scale=1 / math.sqrt(d), prefix_rows=None, prefix_len=0,
             w_proj=rnd(H, n * d, scale=(n * d) ** -0.5), norm2=1 + 0.3 * rnd(H), eps2=1e-5,
             w_fc1=rnd(2 * F, H, scale=H ** -0.5), b_fc1=rnd(2 * F, scale=0.1) if bias else None,
             w_fc2=rnd(H, F, scale=F ** -0.5), glu_offset=0.5)
    return c


def _call(c):
    return _op()(*(c[k] for k in ("h", "norm1", "eps1", "w_qkv", "b_qkv", "groups", "heads", "head_dim", "q_norm",
                                 "q_eps", "k_norm", "k_eps", "cos", "sin", "k_cache", "v_cache", "start", "masked",
                                 "scale", "prefix_rows", "prefix_len", "w_proj", "norm2", "eps2", "w_fc1", "b_fc1",
                                 "w_fc2", "glu_offset")))


def _reference(c):
    """float64 layer -> (output [A, H], k_cache, v_cache with this step's key/value at `start`)."""
    f = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in c.items()}
    A, H = f["h"].shape
    g, n, d, start = f["groups"], f["heads"], f["head_dim"], f["start"]
    r, half = n // g, d // 2

    def rms(x, w, eps):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w

    def rope(x):  # [..., d]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * f["cos"] - x2 * f["sin"], x2 * f["cos"] + x1 * f["sin"]], -1)

    qkv = rms(f["h"], f["norm1"], f["eps1"]) @ f["w_qkv"].T
    if f["b_qkv"] is not None:
        qkv = qkv + f["b_qkv"]
    qkv = qkv.view(A, g, r + 2, d)
    q, k, v = qkv[:, :, :r], qkv[:, :, r], qkv[:, :, r + 1]  # [A, g, r, d], [A, g, d] x 2
    if f["q_norm"] is not None:
        q, k = rms(q, f["q_norm"], f["q_eps"]), rms(k, f["k_norm"], f["k_eps"])
    q, k = rope(q), rope(k)
    k_cache, v_cache = f["k_cache"].clone(), f["v_cache"].clone()
    k_cache[:, :, start], v_cache[:, :, start] = k, v
    keys, values = k_cache[:, :, : start + 1], v_cache[:, :, : start + 1]  # [A, g, s, d]
    scores = torch.einsum("agrd,agsd->agrs", q, keys) * f["scale"]
    scores = scores.masked_fill(f["masked"][:, None, None, :], float("-inf"))
    context = torch.einsum("agrs,agsd->agrd", torch.softmax(scores, -1), values).reshape(A, n * d)
    h1 = f["h"] + context @ f["w_proj"].T
    y = rms(h1, f["norm2"], f["eps2"]) @ f["w_fc1"].T
    if f["b_fc1"] is not None:
        y = y + f["b_fc1"]
    gate, up = y.chunk(2, -1)
    return h1 + (torch.nn.functional.silu(gate) * (up + f["glu_offset"])) @ f["w_fc2"].T, k_cache, v_cache


@needs_op
@pytest.mark.parametrize("shape", [dict(), dict(g=4, n=4, d=64, H=256, F=704, A=16),  # MHA at the realistic shape
                                   dict(g=1, n=8, d=32, A=1, qk_norm=False, bias=False),  # one KV head, one row
                                   dict(d=6, start=0, S=1)])  # run-time head size, the first position
def test_the_layer_equals_a_float64_layer(shape):
    c = _case(**shape)
    before = (c["k_cache"].clone(), c["v_cache"].clone())
    out = _call(c)
    want, k_want, v_want = _reference(c)
    assert out.dtype == torch.float32 and out.shape == c["h"].shape
    assert want.abs().max() > 1.0, "a vacuous comparison"
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    start = c["start"]
    torch.testing.assert_close(c["k_cache"][:, :, start].double(), k_want[:, :, start], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c["v_cache"][:, :, start].double(), v_want[:, :, start], rtol=1e-5, atol=1e-5)
    others = [s for s in range(c["k_cache"].shape[2]) if s != start]  # only position `start` is written
    assert torch.equal(c["k_cache"][:, :, others], before[0][:, :, others])
    assert torch.equal(c["v_cache"][:, :, others], before[1][:, :, others])


@needs_op
def test_a_cache_view_of_a_larger_batch_and_shared_prompt_reads():
    """The engine hands rows b0..b0+A of its [B, g, S, d] cache (a strided view), and rows of one
    prompt read its positions from their group's first row: the same values, the same result."""
    c = _case(A=4, start=10, S=16, seed=3)
    P = 6
    c["k_cache"][1:3, :, :P] = c["k_cache"][0:1, :, :P]  # rows 0-2 share a prompt of 6 positions
    c["v_cache"][1:3, :, :P] = c["v_cache"][0:1, :, :P]
    want = _call({**c, "k_cache": c["k_cache"].clone(), "v_cache": c["v_cache"].clone()})
    big_k, big_v = torch.randn(7, *c["k_cache"].shape[1:]), torch.randn(7, *c["v_cache"].shape[1:])
    big_k[2:6], big_v[2:6] = c["k_cache"], c["v_cache"]
    nan_k, nan_v = big_k.clone(), big_v.clone()
    nan_k[3:5, :, :P] = nan_v[3:5, :, :P] = float("nan")  # rows 1-2's own copies of the prompt: never read
    shared = _call({**c, "k_cache": nan_k[2:6], "v_cache": nan_v[2:6], "prefix_rows": torch.tensor([0, 0, 0, 3]),
                    "prefix_len": P})
    assert torch.equal(shared, want)
    assert torch.equal(_call({**c, "k_cache": big_k[2:6], "v_cache": big_v[2:6]}), want)


@needs_op
def test_bad_inputs_raise_one_line_errors():
    c = _case()
    with pytest.raises(RuntimeError, match=r"decode_layer: w_qkv must be \[128, 48\]"):
        _call({**c, "w_qkv": c["w_qkv"][:-1]})
    with pytest.raises(RuntimeError, match="decode_layer: h must be a contiguous float32"):
        _call({**c, "h": c["h"].double()})
    with pytest.raises(RuntimeError, match="decode_layer: heads 4 must be a multiple of groups 3"):
        _call({**c, "groups": 3})
    with pytest.raises(RuntimeError, match=r"decode_layer: start 12 outside the cache's 12 positions"):
        _call({**c, "start": 12})
    with pytest.raises(RuntimeError, match=r"decode_layer: k_cache / v_cache must be float32 \[A, g, S, d\]"):
        _call({**c, "k_cache": c["k_cache"][:3]})
    with pytest.raises(RuntimeError, match=r"decode_layer: q_norm must be \[16\]"):
        _call({**c, "q_norm": c["q_norm"][:8]})
    with pytest.raises(RuntimeError, match="decode_attention: masked must be bool"):  # the attention's own check
        _call({**c, "masked": c["masked"][:, :5]})
