"""GEMMs on a CPU (models/cpu_gemm.py). bf16/fp16 through fp32 sgemm: the same arithmetic as the
half kernels (exact products, fp32 sums, one rounding) checked against float64; weights converted
once per block and never stale; fp32 work untouched; attention routed only where it pays; the
fused output layer's fp32 logits; and a bf16 Role and rollout engine running under the mode.
fp32 no-grad linears through oneDNN: equal to a float64 product in either weight memory order,
megatron's own path everywhere else, and an fp32 Role scoring through it but training without."""
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dist_helpers import run_distributed
from megarl.models.cpu_gemm import HalfGemmsInFp32, _cpu_forward_impl, fp32_for_half, onednn_available, onednn_pays
from megarl.ops.fused_head import fp32_gemm_mode

HALF = [torch.bfloat16, torch.float16]
UNIT = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}  # half an ulp, relative


def _close_to_rounded(out, ref, dtype, k):
    """|out - ref| within one rounding to `dtype` plus fp32 summation error over k terms."""
    bound = ref.abs() * UNIT[dtype] * 1.01 + k * 2.0 ** -23 * ref.abs().max()
    return bool(((out.double() - ref).abs() <= bound).all())


def test_settings():
    assert fp32_for_half("fp32", torch.device("cpu")) is True
    assert fp32_for_half("native", "cpu") is False
    assert fp32_for_half("fp32", "cuda") is False  # never off the CPU
    with pytest.raises(ValueError, match="train.cpu_half_gemm must be one of native, fp32, got 'fast'"):
        fp32_for_half("fast", "cpu")


def test_config_key():
    from megarl.config import ConfigError, load_config

    base = str(Path(__file__).resolve().parents[1] / "megarl" / "configs" / "tiny_grpo.yaml")
    assert load_config(base).train.cpu_half_gemm == "native"
    assert load_config(base, ["train.cpu_half_gemm=fp32"]).train.cpu_half_gemm == "fp32"
    with pytest.raises(ConfigError, match="'train.cpu_half_gemm' must be one of 'native', 'fp32'"):
        load_config(base, ["train.cpu_half_gemm=fast"])


@pytest.mark.parametrize("dtype", HALF)
def test_gemms_round_once_like_the_half_kernels(dtype):
    g = torch.Generator().manual_seed(11)
    a, b = torch.randn(37, 300, generator=g).to(dtype), torch.randn(300, 53, generator=g).to(dtype)
    bias = torch.randn(53, generator=g).to(dtype)
    a3, b3 = torch.randn(3, 37, 300, generator=g).to(dtype), torch.randn(3, 300, 53, generator=g).to(dtype)
    w = torch.randn(53, 300, generator=g).to(dtype)
    out = torch.empty(37, 53, dtype=dtype)
    with HalfGemmsInFp32() as mode:
        got = {"mm": a @ b, "addmm": torch.addmm(bias, a, b), "bmm": torch.bmm(a3, b3),
               "mm.out": torch.mm(a, b, out=out), "linear 3d": F.linear(a3, w)}
    assert mode.gemms == 5
    ref = {"mm": a.double() @ b.double(), "addmm": bias.double() + a.double() @ b.double(),
           "bmm": a3.double() @ b3.double(), "mm.out": a.double() @ b.double(), "linear 3d": a3.double() @ w.double().t()}
    for name, r in ref.items():
        assert got[name].dtype == dtype, name
        assert _close_to_rounded(got[name], r, dtype, 300), name
    assert got["mm.out"] is out
    # the half kernels' own results differ from these by summation order only
    assert ((got["mm"].double() - (a @ b).double()).abs() <= (ref["mm"].abs() * 4 * UNIT[dtype] + 1e-3)).all()


def test_fp32_and_mixed_operands_pass_through():
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(8, 16, generator=g), torch.randn(16, 4, generator=g)
    with HalfGemmsInFp32() as mode:
        c = a @ b
        d = torch.bmm(a[None], b[None])
    assert mode.gemms == 0 and torch.equal(c, torch.mm(a, b)) and torch.equal(d[0], c)


def test_weights_are_converted_once_per_block_and_never_stale():
    g = torch.Generator().manual_seed(5)
    lin = torch.nn.Linear(24, 40, bias=False).bfloat16()
    x = torch.randn(6, 24, generator=g).bfloat16().requires_grad_()
    with HalfGemmsInFp32(list(lin.parameters())) as mode:
        for _ in range(3):
            lin(x).float().square().sum().backward()
        kept = len(mode._fp32)  # the weight as forward reads it (W^T) and as the input grad reads it (W)
        with torch.no_grad():
            lin.weight.add_(1.0)  # a new version: converted again, not read from the old copy
        y = lin(x)
    assert mode.gemms == 3 * 3 + 1
    assert kept == 2
    ref = x.detach().double() @ lin.weight.detach().double().t()
    assert _close_to_rounded(y, ref, torch.bfloat16, 24)


def test_attention_runs_in_fp32_for_many_queries_only():
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, 4, 33, 16, generator=g).bfloat16().requires_grad_() for _ in range(3))
    with HalfGemmsInFp32() as mode:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.float().square().sum().backward()
        decode = F.scaled_dot_product_attention(q[:, :, -1:].detach(), k.detach(), v.detach())
    assert mode.attentions == 2  # forward and backward; the one-query (decode) call stays native
    assert out.dtype == q.grad.dtype == decode.dtype == torch.bfloat16
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
    ref.square().sum().backward()
    assert (out.double() - ref).abs().max() < 0.02
    for got, want in zip((q.grad, k.grad, v.grad), (qd.grad, kd.grad, vd.grad)):
        assert (got.double() - want).abs().max() < 0.02 * want.abs().max()


@pytest.mark.parametrize("chunk_size", [None, 64])  # one kept chunk; several, recomputed in the backward
def test_fused_head_keeps_fp32_logits_under_the_mode(chunk_size):
    from megarl.ops.fused_head import linear_logprobs_and_entropy

    g = torch.Generator().manual_seed(13)
    N, h, V = 300, 64, 1000
    x = torch.randn(N, h, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(V, h, generator=g) * 0.3).bfloat16().requires_grad_()
    t = torch.randint(0, V, (N,), generator=g)
    t[torch.randperm(N, generator=g)[:20]] = -100
    assert fp32_gemm_mode() is None
    with HalfGemmsInFp32([w]) as mode:
        assert fp32_gemm_mode() is mode
        lp, ent = linear_logprobs_and_entropy(x, w, t, chunk_size=chunk_size)
        (lp.sum() + 0.1 * ent.sum()).backward()
    assert fp32_gemm_mode() is None
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    logp = (xd @ wd.t()).log_softmax(-1)
    ignored = t < 0
    lp_ref = logp.gather(1, t.clamp(min=0)[:, None]).squeeze(1).masked_fill(ignored, 0)
    ent_ref = -(logp.exp() * logp).sum(-1).masked_fill(ignored, 0)
    (lp_ref.sum() + 0.1 * ent_ref.sum()).backward()
    # fp32 logits of the bf16 operands: log-probs as exact as fp32 (bf16 logits would be ~1e-2 off)
    assert (lp.double() - lp_ref).abs().max() < 1e-5
    assert (ent.double() - ent_ref).abs().max() < 1e-5
    assert x.grad.dtype == w.grad.dtype == torch.bfloat16
    assert (x.grad.double() - xd.grad).abs().max() <= 2 * UNIT[torch.bfloat16] * xd.grad.abs().max()
    assert (w.grad.double() - wd.grad).abs().max() <= 2 * UNIT[torch.bfloat16] * wd.grad.abs().max()
    assert lp[ignored].eq(0).all() and x.grad[ignored].eq(0).all()


VOCAB, SEQ, GBS = 96, 12, 4


def _body(rank, world_size):
    from megarl.algorithms.losses import masked_nll
    from megarl.config import ModelConfig, OptimConfig, ParallelConfig
    from megarl.roles import role as role_module
    from megarl.roles.role import Role
    from megarl.rollout.engine import MegatronRolloutEngine, SamplingParams
    from megarl.runtime.distributed import init_distributed, teardown
    from megarl.trainers.common import dp_microbatches, token_logprobs

    init_distributed(1, 1, seed=3)
    modes = []
    plain = role_module.half_gemms_in_fp32

    def recording(chunks, enabled):
        ctx = plain(chunks, enabled)
        modes.append(ctx)
        return ctx

    role_module.half_gemms_in_fp32 = recording
    mc = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_kv_heads=2,
                     vocab_size=VOCAB, max_position_embeddings=32, init_std=0.1)
    g = torch.Generator().manual_seed(21)
    seq = torch.randint(0, VOCAB, (GBS, SEQ + 1), generator=g)
    batch = {"tokens": seq[:, :-1], "labels": seq[:, 1:], "position_ids": torch.arange(SEQ).expand(GBS, SEQ),
             "loss_mask": torch.ones(GBS, SEQ)}

    def loss(b, logits):
        return masked_nll(token_logprobs(logits, b["labels"], VOCAB), b["loss_mask"])

    out, prompts = {}, [seq[i, :5].tolist() for i in range(3)]
    for setting in ("fp32", "native"):
        role = Role("actor", mc, ParallelConfig(), head="lm", precision="bf16", seed=5, optim=OptimConfig(lr=1e-2),
                    cpu_half_gemm=setting)
        steps = [role.train_step(dp_microbatches(batch, 2), loss) for _ in range(2)]
        engine = MegatronRolloutEngine(role, vocab_size=VOCAB, pad_id=0)
        rollout = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=6), seed=0)
        out[setting] = dict(flag=role.half_gemms_fp32, engine_flag=engine.half_gemms_fp32,
                            losses=[s.metrics["loss"] for s in steps], norms=[s.grad_norm for s in steps],
                            responses=rollout.responses(), logprobs=rollout.logprobs)
    out["fp32_gemms"] = [getattr(m, "gemms", None) for m in modes]

    # fp32: scoring (forward only) through oneDNN, equal to megatron's path; training never
    role = Role("actor", mc, ParallelConfig(), head="lm", seed=5, optim=OptimConfig(lr=1e-2))

    def onednn_calls(fn):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            result = fn()
        return result, sum(ev.count for ev in prof.key_averages() if ev.key == "mkldnn::_linear_pointwise")

    scored = {}
    for flag in (False, True):
        role.onednn_linears = flag
        scored[flag] = onednn_calls(lambda: role.forward_collect(
            dp_microbatches(batch, 2), lambda b, o: token_logprobs(o, b["labels"], VOCAB)))
    role.onednn_linears = True
    _, train_calls = onednn_calls(lambda: role.train_step(dp_microbatches(batch, 2), loss))
    out["scoring"] = dict(calls=[scored[f][1] for f in (False, True)], train_calls=train_calls,
                          diff=max(float((a - b).abs().max()) for a, b in zip(scored[False][0], scored[True][0])),
                          routed_after=sum("_forward_impl" in vars(m) for m in role.chunks[0].modules()))
    teardown()
    return out


@pytest.fixture(scope="module")
def roles():
    return run_distributed(_body, 1)[0]


def test_a_bf16_role_and_its_rollout_run_their_gemms_in_fp32(roles):
    fast, native = roles["fp32"], roles["native"]
    assert fast["flag"] and fast["engine_flag"] and not native["flag"] and not native["engine_flag"]
    # the two training steps of the fp32 role ran their GEMMs (backward included) in the mode
    gemms = roles["fp32_gemms"]
    assert len(gemms) == 4 and gemms[:2] == [2 * (2 * 4 + 1) * 3] * 2 and gemms[2:] == [None, None]
    for a, b in zip(fast["losses"] + fast["norms"], native["losses"] + native["norms"]):
        assert abs(a - b) <= 0.02 * abs(b)
    same = [i for i, (a, b) in enumerate(zip(fast["responses"], native["responses"])) if a == b]
    assert same, "greedy decoding diverged on every row"
    for i in same:
        assert (fast["logprobs"][i] - native["logprobs"][i]).abs().max() < 0.05


def test_an_fp32_role_scores_through_onednn_and_trains_without(roles):
    r = roles["scoring"]
    if onednn_available():
        assert r["calls"] == [0, 2 * (2 * 4 + 1)]  # two micro-batches x (4 linears x 2 layers + the LM head)
    assert r["train_calls"] == 0 and r["routed_after"] == 0
    assert 0.0 <= r["diff"] < 1e-5, r["diff"]


def _fake_megatron_impl(calls):
    def impl(input, weight, bias=None, sequence_parallel=False, **kwargs):
        calls.append(kwargs)
        out = torch.matmul(input, weight.t())
        return out + bias if bias is not None else out
    return impl


@pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("rows", [2, 5, 64])
@pytest.mark.parametrize("in_major", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_onednn_linear_equals_a_float64_product(rows, in_major, with_bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 1, 48, generator=g)  # [s, b, in], as megatron's linears see it
    w = torch.randn(80, 48, generator=g) / 7
    if in_major:
        w = w.t().contiguous().t()  # [out, in] shape, [in, out] memory: the decode layout
    bias = torch.randn(80, generator=g) if with_bias else None
    calls = []
    with torch.no_grad():
        y = _cpu_forward_impl(_fake_megatron_impl(calls))(
            input=x, weight=w, bias=bias, gradient_accumulation_fusion=False, allreduce_dgrad=False,
            sequence_parallel=False, tp_group=None, grad_output_buffer=None)
    ref = x.double() @ w.double().t() + (bias.double() if with_bias else 0)
    assert calls == [] and y.shape == (rows, 1, 80) and y.dtype == torch.float32
    assert float((y.double() - ref).abs().max()) < 1e-5 * float(ref.abs().max())


def test_onednn_linear_leaves_everything_else_to_megatron():
    calls = []
    impl = _cpu_forward_impl(_fake_megatron_impl(calls))
    w = torch.randn(8, 4, requires_grad=True)
    kw = dict(bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False, tp_group=None, grad_output_buffer=None)
    impl(input=torch.randn(3, 1, 4), weight=w, sequence_parallel=False, **kw)  # autograd on: training
    with torch.no_grad():
        impl(input=torch.randn(1, 1, 4), weight=w, sequence_parallel=False, **kw)  # 1 row: MKL's gemv wins
        impl(input=torch.randn(3, 1, 4), weight=w, sequence_parallel=True, **kw)  # input all-gathered by megatron
        impl(input=torch.randn(3, 1, 4, dtype=torch.bfloat16), weight=w.detach().bfloat16(), sequence_parallel=False, **kw)
    assert len(calls) == 4
    assert all(set(c) == {"gradient_accumulation_fusion", "allreduce_dgrad", "tp_group", "grad_output_buffer"}
               for c in calls)  # megatron's settings passed through untouched


# megatron-core's other keywords to a linear's `_forward_impl` (its backward's settings)
_IMPL_KW = dict(gradient_accumulation_fusion=False, allreduce_dgrad=False, sequence_parallel=False, tp_group=None,
                grad_output_buffer=None)


def _assert_float64_linear(y, x, weight, bias):
    """y: x [rows, 1, in] through weight [out, in] (+ bias), contiguous, equal to float64 within
    fp32 rounding."""
    ref = x.double() @ weight.double().t() + (bias.double() if bias is not None else 0)
    assert y.shape == ref.shape and y.is_contiguous()
    assert float((y.double() - ref).abs().max()) < 1e-5 * float(ref.abs().max())


def _wide_kernel():
    from megarl.models import cpu_kernels

    return cpu_kernels.wide_linear()


@pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("kernel,avx512", [("megarl", True), ("megarl", False), (None, True)])
def test_a_wide_weight_at_few_rows_reads_its_out_major_tensor(with_bias, kernel, avx512, monkeypatch):
    """The LM head at few rows reads the [out, in] tensor generation kept: megarl._cpu's
    wide_linear at 1-32 rows where built and the CPU has AVX-512, at 2-32 where it has AVX2 only
    (1 row: megatron's path, MKL's matrix-vector product), MKL's (W @ x.T).T at 2-4 rows without
    the kernel; at more rows, without that tensor, or on a narrower weight it runs oneDNN; every
    result equal to float64."""
    from megarl.models import cpu_gemm, cpu_kernels

    real = _wide_kernel()
    if kernel and real is None:
        pytest.skip("megarl._cpu.wide_linear needs the built extension and an AVX-512 or AVX2 CPU")
    # the row range follows /proc/cpuinfo's flags; the kernel itself picks its AVX-512 or AVX2 form
    monkeypatch.setattr(cpu_gemm, "_cpuinfo", lambda *a: ("AuthenticAMD", frozenset({"avx512f"} if avx512 else {"avx2"})))
    kernel_calls = []
    monkeypatch.setattr(cpu_kernels, "wide_linear",
                        lambda: (lambda x, w: kernel_calls.append(x.shape[0]) or real(x, w)) if kernel else None)
    g = torch.Generator().manual_seed(11)
    stored = torch.randn(cpu_gemm.OUT_MAJOR_MIN_OUT + 3, 40, generator=g) / 6  # [out, in] memory
    w = torch.nn.Parameter(stored.t().contiguous().t(), requires_grad=False)  # the decode layout
    narrow = torch.nn.Parameter(torch.randn(cpu_gemm.OUT_MAJOR_MIN_OUT - 64, 40, generator=g), requires_grad=False)
    bias = torch.randn(stored.shape[0], generator=g) if with_bias else None
    calls = []
    impl = _cpu_forward_impl(_fake_megatron_impl(calls), {id(w): stored, id(narrow): narrow.data})

    def libraries(rows, weight, b=None, run=impl):
        x = torch.randn(rows, 1, 40, generator=g)
        before = len(kernel_calls)
        with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            y = run(input=x, weight=weight, bias=b, **_IMPL_KW)
        _assert_float64_linear(y, x, weight, b)
        keys = {e.key for e in prof.key_averages()}
        return ("oneDNN" if "mkldnn::_linear_pointwise" in keys else "") + ("MKL" if "aten::mm" in keys else "") + (
            "megarl" if len(kernel_calls) > before else "")

    if kernel:
        one = "megarl" if avx512 else "MKL"  # 1 row without AVX-512: megatron's path
        assert [libraries(r, w, bias) for r in (1, 2, 3, 4, 5, 8, 32, 33)] == [one] + ["megarl"] * 6 + ["oneDNN"]
        assert kernel_calls == ([1] if avx512 else []) + [2, 3, 4, 5, 8, 32]
    else:
        assert [libraries(r, w, bias) for r in (2, 3, 4, 5, 8)] == ["MKL"] * 3 + ["oneDNN"] * 2
    assert libraries(3, narrow) == "oneDNN"  # not wide: oneDNN wins there
    assert libraries(3, w, bias, _cpu_forward_impl(_fake_megatron_impl(calls))) == "oneDNN"  # no [out, in] kept
    first = 0 if (avx512 or not kernel) else 1  # megatron's path so far: the 1-row call without AVX-512
    assert len(calls) == first
    # without oneDNN (an Intel CPU): the kernel where it runs, megatron's own path (MKL) for the rest
    no_onednn = _cpu_forward_impl(_fake_megatron_impl(calls), {id(w): stored, id(narrow): narrow.data}, onednn=False)
    rows = (1, 2, 3, 32, 33)
    assert [libraries(r, w, bias, no_onednn) for r in rows] == (
        [one] + ["megarl"] * 3 + ["MKL"] if kernel else ["MKL"] * 5)
    assert libraries(3, narrow, None, no_onednn) == "MKL"
    # megatron's path: 33 rows and the narrow weight (+ 1-32 without the kernel, + 1 row without AVX-512)
    assert len(calls) == first + (2 if kernel else 6) + (0 if avx512 or not kernel else 1)


@pytest.mark.parametrize("text,onednn,layers", [
    ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nflags\t\t: fpu avx2 avx512f avx512dq\n"
     "processor\t: 1\nflags\t\t: fpu\n", True, True),  # Zen 4; only the first flags line counts
    ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nflags\t\t: fpu avx2 fma\n", False, True),  # Zen 3
    ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 23\nflags\t\t: fpu avx\n", False, False),  # no AVX2
    ("processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nflags\t\t: avx2 avx512f\n", False, False),
    ("processor\t: 0\nCPU implementer\t: 0x41\n", False, False),  # an Arm CPU: no vendor_id line
])
def test_onednn_and_the_layers_kernel_route_only_on_an_amd_cpu(tmp_path, text, onednn, layers):
    from megarl.models.cpu_gemm import layer_kernel_pays

    info = tmp_path / "cpuinfo"
    info.write_text(text)
    assert onednn_pays(str(info)) == (onednn and onednn_available())
    assert layer_kernel_pays(str(info)) == layers
    assert onednn_pays(str(tmp_path / "missing")) is False and layer_kernel_pays(str(tmp_path / "missing")) is False


@pytest.mark.parametrize("onednn", [True, False])
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_layer_s_weight_at_decode_rows_runs_the_kernel_with_layer_kernel(onednn, with_bias, monkeypatch):
    """layer_kernel: a (narrow) weight generation kept in [out, in] memory runs megarl._cpu's
    kernel at 1-64 rows (LAYER_KERNEL_ROWS; the wide LM head's range stays 1-32), oneDNN or MKL
    above and without it; a weight not kept, and every weight without layer_kernel, as before.
    Every result equal to float64."""
    from megarl.models import cpu_gemm, cpu_kernels

    if onednn and not onednn_available():
        pytest.skip("torch built without oneDNN")
    real = _wide_kernel()
    if real is None:
        pytest.skip("megarl._cpu.wide_linear needs the built extension and an AVX-512 or AVX2 CPU")
    kernel_calls = []
    monkeypatch.setattr(cpu_kernels, "wide_linear", lambda: lambda x, w: kernel_calls.append(x.shape[0]) or real(x, w))
    g = torch.Generator().manual_seed(12)
    stored = torch.randn(72, 40, generator=g) / 6  # [out, in] memory; 72 outputs: a 4-row block tail-free
    w = torch.nn.Parameter(stored.t().contiguous().t(), requires_grad=False)  # the decode layout
    odd = torch.randn(70, 36, generator=g) / 6  # outputs and inputs off the kernel's 4 x 16 blocks
    w_odd = torch.nn.Parameter(odd.t().contiguous().t(), requires_grad=False)
    not_kept = torch.nn.Parameter(torch.randn(72, 40, generator=g), requires_grad=False)
    bias = torch.randn(72, generator=g) if with_bias else None
    calls = []
    kept = {id(w): stored, id(w_odd): odd}
    impl = cpu_gemm._cpu_forward_impl(_fake_megatron_impl(calls), kept, onednn, layer_kernel=True)

    def ran(rows, weight, b=None, run=impl):
        x = torch.randn(rows, 1, weight.shape[1], generator=g)
        before = len(kernel_calls)
        with torch.no_grad():
            y = run(input=x, weight=weight, bias=b, **_IMPL_KW)
        _assert_float64_linear(y, x, weight, b)
        return len(kernel_calls) > before

    assert cpu_gemm.LAYER_KERNEL_ROWS == (1, 64)
    assert [ran(r, w, bias) for r in (1, 2, 5, 32, 33, 64, 65)] == [True] * 6 + [False]
    assert [ran(r, w_odd) for r in (1, 3, 64)] == [True] * 3
    assert not ran(3, not_kept)
    without = cpu_gemm._cpu_forward_impl(_fake_megatron_impl(calls), kept, onednn)  # layer_kernel off
    assert not any(ran(r, w, bias, without) for r in (1, 2, 64))
    # megatron's path: with oneDNN only 1 row without layer_kernel; without oneDNN also 65 rows, the
    # weight not kept and 2 and 64 rows without layer_kernel
    assert len(calls) == (1 if onednn else 5)


@pytest.mark.skipif(_wide_kernel() is None, reason="megarl._cpu.wide_linear needs the built extension and AVX-512 or AVX2")
@pytest.mark.parametrize("rows,out,h", [(1, 1001, 256), (3, 4096, 40), (4, 517, 250), (7, 2050, 512), (24, 333, 16),
                                        (13, 64, 7)])
def test_wide_linear_equals_a_float64_product(rows, out, h):
    """megarl._cpu.wide_linear over row counts off its 4-row blocks, weights off its 4-row blocks
    and widths off its 16 lanes (masked tails), on fresh random inputs."""
    g = torch.Generator().manual_seed(rows * 100 + h)
    x, w = torch.randn(rows, h, generator=g), torch.randn(out, h, generator=g)
    y = _wide_kernel()(x, w)
    ref = x.double() @ w.double().t()
    assert y.shape == (rows, out) and y.dtype == torch.float32
    # fp32 sums of h products of N(0, 1) values: a few ulp of sqrt(h)
    assert float((y.double() - ref).abs().max()) < 2e-6 * h ** 0.5 * 8, float((y.double() - ref).abs().max())


@pytest.mark.skipif(_wide_kernel() is None, reason="megarl._cpu.wide_linear needs the built extension and AVX-512 or AVX2")
@pytest.mark.parametrize("h", [256, 40])
def test_wide_linear_gives_a_row_the_same_bits_whatever_rows_come_with_it(h):
    """At 1-4 rows the kernel reads the weight's rows in turn, from 5 rows on side by side; each
    row's sums run in the same order either way, so a row's logits do not depend on how many rows
    a decode step still has (rows finish one by one) or where it sits among them."""
    g = torch.Generator().manual_seed(h)
    x, w = torch.randn(32, h, generator=g), torch.randn(1030, h, generator=g)
    kernel = _wide_kernel()
    alone = torch.cat([kernel(x[r:r + 1], w) for r in range(32)])
    for rows in (2, 3, 4, 5, 7, 8, 13, 32):
        for r0 in (0, 32 - rows):
            assert torch.equal(kernel(x[r0:r0 + rows], w), alone[r0:r0 + rows]), (rows, r0)


@pytest.mark.skipif(_wide_kernel() is None, reason="megarl._cpu.wide_linear needs the built extension and AVX-512 or AVX2")
def test_wide_linear_bad_inputs_raise_one_line_errors():
    op = _wide_kernel()
    x, w = torch.randn(2, 32), torch.randn(8, 32)
    for args, msg in (((x.double(), w), "float32 only"), ((x, w[:, :16]), r"x \[R, h\] and w \[V, h\]"),
                      ((x, w.t().contiguous().t()), "contiguous")):
        with pytest.raises(RuntimeError, match="megarl._cpu.wide_linear: .*" + msg) as err:
            op(*args)
        assert "\n" not in str(err.value)


def test_generation_moves_the_wide_weights_the_kernel_streams_to_huge_pages(monkeypatch):
    """cpu_linears collapses each wide [out, in] tensor of out_major (the LM head the kernel reads
    whole every decode step) to huge pages, only where the kernel runs; narrow ones and None are left."""
    from megarl.models import cpu_gemm, cpu_kernels
    from megarl.runtime import huge_pages

    seen = []
    monkeypatch.setattr(huge_pages, "collapse", lambda t: seen.append(t) or True)
    wide = torch.randn(cpu_gemm.OUT_MAJOR_MIN_OUT, 4)
    narrow = torch.randn(cpu_gemm.OUT_MAJOR_MIN_OUT - 1, 4)
    out_major = {1: wide, 2: narrow, 3: None}
    monkeypatch.setattr(cpu_kernels, "wide_linear", lambda: (lambda x, w: x @ w.t()))
    with cpu_gemm.cpu_linears([], onednn=False, out_major=out_major):
        pass
    assert len(seen) == 1 and seen[0] is wide
    seen.clear()
    monkeypatch.setattr(cpu_kernels, "wide_linear", lambda: None)  # no kernel: MKL reads the weights as they are
    with cpu_gemm.cpu_linears([], onednn=False, out_major=out_major):
        pass
    assert seen == []
