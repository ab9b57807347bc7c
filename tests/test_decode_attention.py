"""The CPU decode-attention kernel (csrc/cpu_decode_attention.cpp, megarl._cpu) behind
models/decode_attention.py, against a float64 softmax(q K^T * scale) V written here, on fresh
random caches: grouped heads, d of 64 / 128 (compiled) and 40 (run-time d), strided cache views,
left padding and scattered masks, bf16. Then the rollout engine with it against the engine on
SDPA, and the fallbacks (autograd, MEGARL_DISABLE_KERNELS) left to SDPA.
"""
import importlib
import os
import platform
import shutil

import pytest
import torch
import torch.nn.functional as F

from dist_helpers import run_distributed


def _kernel():
    from megarl.models.decode_attention import cpu_kernel

    return cpu_kernel()


needs_kernel = pytest.mark.skipif(_kernel() is None, reason="megarl._cpu is not built here (no C++ compiler)")


def _reference(q, k, v, masked, scale):
    """float64 attention: q [b, n, d], k/v [b, g, S, d], masked [b, S] True = not attended -> [b, n, d]."""
    b, n, d = q.shape
    r = n // k.shape[1]
    k, v = k.double().repeat_interleave(r, 1), v.double().repeat_interleave(r, 1)  # [b, n, S, d]
    scores = torch.einsum("bnd,bnsd->bns", q.double(), k) * scale
    if masked is not None:
        scores = scores.masked_fill(masked[:, None, :], float("-inf"))
    return torch.einsum("bns,bnsd->bnd", torch.softmax(scores, -1), v)


def _case(b, n, g, d, s_max, s, mask, seed):
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(b, g, s_max, d, generator=gen)  # the engine's [B, g, S, d] cache
    v_cache = torch.randn(b, g, s_max, d, generator=gen)
    q = torch.randn(1, b, n, d, generator=gen).permute(1, 2, 0, 3)  # [b, n, 1, d] view, as attention.py has it
    masked = None
    if mask == "left":  # left padding of a few rows, as the engine's ragged prompts give
        pad = torch.randint(0, s - 1, (b,), generator=gen)
        masked = torch.arange(s_max)[None, :] < pad[:, None]
    elif mask == "scattered":
        masked = torch.rand(b, s_max, generator=gen) < 0.3
        masked[:, s - 1] = False  # every row keeps a position
    return q, k_cache[:, :, :s], v_cache[:, :, :s], None if masked is None else masked[:, :s]


def test_the_kernel_is_built_wherever_a_compiler_is():
    if shutil.which(os.environ.get("CXX", "c++")) is None or platform.system() != "Linux":
        pytest.skip("no C++ compiler: setup.py leaves megarl._cpu out and decode runs SDPA")
    try:  # the module itself, whatever MEGARL_DISABLE_KERNELS says
        importlib.import_module("megarl._cpu")
    except ImportError as exc:
        pytest.fail(f"pip install -e . should have built megarl._cpu (csrc/build.py cpu_extension): {exc}")


@needs_kernel
@pytest.mark.parametrize("b,n,g,d,s_max,s,mask", [
    (6, 4, 4, 64, 50, 37, "left"),  # one KV head per query head, compiled d = 64
    (5, 8, 2, 128, 33, 33, "scattered"),  # 4 query heads per KV head, compiled d = 128, the whole cache
    (3, 6, 3, 40, 70, 1, None),  # run-time d, a single cached position
    (4, 2, 1, 64, 300, 257, None),  # multi-query, long
])
def test_fp32_equals_float64_attention(b, n, g, d, s_max, s, mask):
    from megarl.models.decode_attention import decode_attention

    q, k, v, masked = _case(b, n, g, d, s_max, s, mask, seed=b * 1000 + s)
    scale = d ** -0.5
    got = decode_attention(q, k, v, None if masked is None else masked[:, None, None, :], scale=scale)
    assert got.shape == (b, n, 1, d) and got.dtype == torch.float32
    want = _reference(q[:, :, 0], k, v, masked, scale)
    err = (got[:, :, 0].double() - want).abs().max().item()
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=None if masked is None else ~masked[:, None, None, :],
                                          scale=scale, enable_gqa=n != g)
    sdpa_err = (sdpa[:, :, 0].double() - want).abs().max().item()
    print(f"\n[decode attention] b{b} n{n} g{g} d{d} S{s} {mask}: kernel {err:.1e}, SDPA {sdpa_err:.1e} from float64")
    assert err < 2e-6, err
    assert err < 4 * sdpa_err + 1e-7, (err, sdpa_err)  # no worse than SDPA's own fp32 rounding


@needs_kernel
def test_bf16_cache_within_bf16_rounding():
    from megarl.models.decode_attention import decode_attention

    q, k, v, masked = _case(4, 8, 4, 64, 40, 29, "left", seed=7)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    got = decode_attention(q, k, v, masked[:, None, None, :], scale=0.125)
    assert got.dtype == torch.bfloat16
    want = _reference(q[:, :, 0], k, v, masked, 0.125)  # the same bf16 inputs, in float64
    assert (got[:, :, 0].double() - want).abs().max().item() < 1e-2  # one bf16 rounding of values ~1


@needs_kernel
def test_masked_positions_are_never_read():
    """A masked key or value holding NaN must not reach the output (SDPA's -inf semantics)."""
    from megarl.models.decode_attention import decode_attention

    q, k, v, masked = _case(3, 4, 2, 64, 20, 20, "left", seed=3)
    want = decode_attention(q, k, v, masked[:, None, None, :], scale=0.125)
    k, v = k.clone(), v.clone()
    k[masked[:, None, :, None].expand_as(k)] = float("nan")
    v[masked[:, None, :, None].expand_as(v)] = float("nan")
    got = decode_attention(q, k, v, masked[:, None, None, :], scale=0.125)
    assert torch.equal(got, want)
    masked[1] = True  # a row with nothing to attend to: zeros, as torch's CPU SDPA gives
    got = decode_attention(q, k, v, masked[:, None, None, :], scale=0.125)
    assert torch.equal(got[1], torch.zeros_like(got[1])) and torch.equal(got[0], want[0])


@needs_kernel
@pytest.mark.parametrize("d,dtype", [(64, torch.float32), (40, torch.float32), (128, torch.bfloat16)])
def test_shared_prompt_reads_are_the_same_bits_from_the_leading_row(d, dtype):
    """prefix_rows: rows read their first prefix_len positions from their group's first row. Where
    the rows hold copies of the same prompt (as the engine's do) the result is bitwise that of
    reading each row's own copy; with every other row's copy poisoned it still is, so those
    positions are read from the leading row only."""
    from megarl.models.decode_attention import decode_attention

    b, n, g, s_max, s, P = 12, 4, 2, 60, 45, 17
    q, k, v, _ = _case(b, n, g, d, s_max, s, None, seed=d)
    q, k, v = q.to(dtype), k.to(dtype).clone(), v.to(dtype).clone()
    leaders = torch.tensor([0, 0, 0, 3, 4, 4, 4, 4, 8, 8, 10, 10])  # groups of 3, 1, 4, 2, 2 rows
    for x in (k, v):
        x[:, :, :P] = x[leaders, :, :P]  # the engine's copies of each group's prompt
    pads = torch.tensor([3, 0, 5, 9])[leaders % 4]  # a group's rows share its prompt's left padding
    masked = torch.arange(s)[None, :] < pads[:, None]  # [b, s]
    mask = masked[:, None, None, :]
    own = decode_attention(q, k, v, mask, scale=0.125)
    shared = decode_attention(q, k, v, mask, scale=0.125, prefix_rows=leaders, prefix_len=P)
    assert torch.equal(own, shared)
    poisoned = leaders != torch.arange(b)
    for x in (k, v):
        x[poisoned, :, :P] = float("nan")
    assert torch.equal(decode_attention(q, k, v, mask, scale=0.125, prefix_rows=leaders, prefix_len=P), own)
    reads_prompt = poisoned & ~masked[:, :P].all(1)  # rows whose prompt is not all left padding
    assert reads_prompt.sum() == 7
    assert torch.isnan(decode_attention(q, k, v, mask, scale=0.125)[reads_prompt]).all()  # own copies: read


def test_run_leaders():
    from megarl.rollout.engine import _run_leaders

    runs = torch.tensor([0, 0, 0, 1, 2, 2, 5, 5, 5, 7])
    assert _run_leaders(runs).tolist() == [0, 0, 0, 3, 4, 4, 6, 6, 6, 9]
    assert _run_leaders(torch.tensor([4])).tolist() == [0]


@needs_kernel
def test_bad_inputs_raise_one_line_errors():
    op = _kernel()
    q, k, v, _ = _case(2, 4, 2, 64, 10, 10, None, seed=1)
    with pytest.raises(RuntimeError, match="shapes"):
        op(q[:, :3, 0], k, v, None, 0.1)  # 3 query heads over 2 KV heads
    with pytest.raises(RuntimeError, match="masked must be bool"):
        op(q[:, :, 0], k, v, torch.zeros(2, 10), 0.1)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        op(q[:, :, 0].double(), k.double(), v.double(), None, 0.1)
    with pytest.raises(RuntimeError, match=r"prefix_rows\[1\] = 2 is not a row of the cache"):
        op(q[:, :, 0], k, v, None, 0.1, torch.tensor([0, 2]), 4)
    with pytest.raises(RuntimeError, match="prefix_rows must be a contiguous int64"):
        op(q[:, :, 0], k, v, None, 0.1, torch.tensor([0, 0], dtype=torch.int32), 4)
    with pytest.raises(RuntimeError, match=r"prefix_len 11 outside \[0, 10\]"):
        op(q[:, :, 0], k, v, None, 0.1, torch.tensor([0, 0]), 11)


def test_autograd_and_disabled_kernels_are_left_to_sdpa(monkeypatch):
    """decode_attention returns None for what the kernel does not take, and attention.py's
    cached path then runs SDPA (the engine test below runs that path with the kernel off)."""
    import megarl.models.decode_attention as da

    q, k, v, masked = _case(2, 4, 2, 64, 12, 12, "left", seed=2)
    calls = []
    monkeypatch.setattr(da, "cpu_kernel", lambda: lambda *a: calls.append(a) or torch.zeros(2, 4, 64))
    q.requires_grad_(True)
    assert da.decode_attention(q, k, v, masked[:, None, None, :], scale=0.125) is None  # the kernel has no backward
    with torch.no_grad():  # what the kernel does not take never reaches its checks
        per_head = masked[:, None, None, :].expand(2, 4, 1, 12)  # a mask per head, not per row
        assert da.decode_attention(q, k, v, per_head, scale=0.125) is None
        assert da.decode_attention(q.repeat(1, 1, 2, 1), k, v, None, scale=0.125) is None  # two query tokens
        assert da.decode_attention(q.double(), k.double(), v.double(), None, scale=0.125) is None
        assert da.decode_attention(q, k, v.transpose(2, 3).contiguous().transpose(2, 3), None, scale=0.125) is None
        assert da.decode_attention(q, k, v, masked[:, None, None, :], scale=0.125) is not None
    assert len(calls) == 1
    monkeypatch.undo()  # the real loader, loading anew
    monkeypatch.setattr(da.cpu_kernels, "_module", da.cpu_kernels._UNLOADED)
    monkeypatch.setenv("MEGARL_DISABLE_KERNELS", "1")
    assert da.cpu_kernel() is None
    with torch.no_grad():
        assert da.decode_attention(q, k, v, masked[:, None, None, :], scale=0.125) is None


def test_a_build_older_than_the_checkout_is_not_used(monkeypatch, caplog):
    """A megarl._cpu built before a binding this checkout calls (an old .so left in place) is
    treated as missing, with the reason logged, instead of failing at the first call."""
    import types

    from megarl.models import cpu_kernels

    stale = types.SimpleNamespace(decode_attention=None, wide_linear=None, wide_linear_supported=lambda: True)
    monkeypatch.setattr(cpu_kernels, "_module", cpu_kernels._UNLOADED)
    monkeypatch.setattr(cpu_kernels, "import_kernels", lambda name: (stale, ""))
    with caplog.at_level("INFO", logger="megarl.models"):
        assert cpu_kernels.load() is None and cpu_kernels.wide_linear() is None
    assert "lacks decode_layer, sample_rows" in caplog.text and "rebuild" in caplog.text


def _engine_body(rank, world_size):
    import megarl.models.decode_attention as da
    from megarl.config import ModelConfig, ParallelConfig
    from megarl.roles.role import Role
    from megarl.rollout.engine import MegatronRolloutEngine, SamplingParams
    from megarl.runtime.distributed import init_distributed

    init_distributed(1, 1, seed=3)
    mc = ModelConfig(num_layers=3, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_kv_heads=2,
                     vocab_size=100, max_position_embeddings=48, init_std=0.1)
    role = Role("actor", mc, ParallelConfig(), head="lm", seed=4)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 100, (n,), generator=g).tolist() for n in (3, 11, 6, 1, 8)]
    # native_layers off: decode steps reach the kernel through models/decode_attention.py, where
    # this test swaps it (megarl._cpu.decode_layer calls it from C++: tests/test_decode_layer.py)
    engine = MegatronRolloutEngine(role, vocab_size=100, pad_id=0, max_batch_size=8, native_layers=False)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=10)
    real = da.cpu_kernel
    kernel = real()
    calls = [0]

    def counted(*a):
        calls[0] += 1
        return kernel(*a)

    da.cpu_kernel = lambda: counted
    with_kernel = engine.generate(prompts, params, seed=9)
    # the samples of a prompt read it from their group's first row (and again after rows finish
    # and leave the cache: ids below 30 stop a row), or each from its own copy: the same bits
    stopping = SamplingParams(n=3, temperature=1.0, max_new_tokens=12, stop_ids=tuple(range(1, 30)))
    shared_calls = []
    da.cpu_kernel = lambda: lambda *a: shared_calls.append(len(a) > 5) or kernel(*a)
    shared = [engine.generate(prompts, p, seed=9) for p in (params, stopping)]
    engine.shared_prompt_reads = False
    own = [engine.generate(prompts, p, seed=9) for p in (params, stopping)]
    engine.shared_prompt_reads = True
    da.cpu_kernel = lambda: None  # SDPA
    with_sdpa = engine.generate(prompts, params, seed=9)
    da.cpu_kernel = real
    # at PP 1 the CPU shim's TorchFunctionMode is off for the whole call, bookkeeping included
    from megarl.runtime import cpu_compat

    shim_calls, cls = [0], type(cpu_compat._mode)
    original = cls.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):
        shim_calls[0] += 1
        return original(self, func, types, args, kwargs)

    cls.__torch_function__ = counting
    try:
        torch.zeros(1) + 1  # counted: the shim is on outside generate
        engine.generate(prompts, stopping, seed=9)
    finally:
        cls.__torch_function__ = original
    return {"calls": calls[0], "tokens": torch.equal(with_kernel.tokens, with_sdpa.tokens),
            "lp_err": (with_kernel.logprobs - with_sdpa.logprobs).abs().max().item(),
            "shared_equal": all(torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
                                for a, b in zip(shared, own)),
            "shared_calls": sum(shared_calls), "own_calls": len(shared_calls) - sum(shared_calls),
            "compactions": shared[1].stats["compactions"], "shim_calls": shim_calls[0]}


@needs_kernel
def test_rollout_with_the_kernel_equals_rollout_on_sdpa():
    out = run_distributed(_engine_body, 1)[0]
    assert out["calls"] >= 3 * 9, out  # every layer of every decode step (9 steps after the prefill)
    assert out["tokens"], "sampled tokens differ between the kernel and SDPA"
    assert out["lp_err"] < 1e-5, out
    assert out["shared_equal"], "reading a shared prompt from its group's first row changed the samples"
    assert out["compactions"] >= 1 and out["shared_calls"] >= 2 * 3 * 9, out  # both runs: every layer, every step
    assert out["own_calls"] >= 2 * 3 * 9, out  # engine.shared_prompt_reads = False
    assert out["shim_calls"] == 4, out  # torch.zeros and + outside, no_grad's enter and exit; nothing inside
