"""megarl.ops.logprobs_and_entropy against float64 references (values and gradients), odd
shapes, ignore_index, temperature, and TP=2/4 over gloo against the unsharded op.

Tolerances. The op computes in fp32 from the very logits the float64 reference sees (bf16/fp16
inputs are upcast exactly), so log-probs and entropies only carry fp32 rounding of O(1..30)
quantities: rtol = atol = 2e-5. Gradients are recomputed from p = exp(log p) in fp32 (relative
error ~1e-6) and then stored in the logits dtype, so they are compared within one unit in the
last place of that dtype: 2^-7 relative for bf16 (7 stored mantissa bits), 2^-10 for fp16, plus
an absolute 1e-6 for fp32 noise on tiny entries and fp16 subnormals.
"""
import pytest
import torch
import torch.distributed as dist

from dist_helpers import run_distributed
from megarl.ops import kernel_backend, logprobs_and_entropy
from megarl.ops import logprobs as lp_mod

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
VAL_TOL = dict(rtol=2e-5, atol=2e-5)
GRAD_TOL = {
    torch.float32: dict(rtol=1e-4, atol=1e-6),
    torch.bfloat16: dict(rtol=2.0 ** -7, atol=1e-6),
    torch.float16: dict(rtol=2.0 ** -10, atol=1e-6),
}


def make(shape, dtype, device="cpu", seed=0, scale=3.0, ignore_frac=0.0):
    """Fresh random logits [*shape] (never zeros) and global targets [*shape[:-1]]."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * scale).to(dtype)
    t = torch.randint(0, shape[-1], shape[:-1], generator=g)
    if ignore_frac:
        t[torch.rand(shape[:-1], generator=g) < ignore_frac] = -100
    return x.to(device), t.to(device)


def reference(x, t, temperature=1.0, ignore_index=-100):
    """Naive formula in float64 on the same (rounded) logits; differentiable w.r.t. x64."""
    x64 = x.detach().double().requires_grad_()
    lsm = torch.log_softmax(x64 / temperature, -1)
    ign = t == ignore_index
    lp = lsm.gather(-1, t.clamp(0, x.shape[-1] - 1)[..., None]).squeeze(-1).masked_fill(ign, 0)
    p = lsm.exp()
    ent = -(p * torch.where(p > 0, lsm, 0.0)).sum(-1).masked_fill(ign, 0)  # 0 log 0 = 0
    return x64, lp, ent


def check_values(x, t, temperature=1.0):
    """Log-probs and entropy against the float64 reference."""
    lp, ent = logprobs_and_entropy(x, t, temperature=temperature)
    _, rlp, rent = reference(x, t, temperature)
    torch.testing.assert_close(lp.double(), rlp, **VAL_TOL)
    torch.testing.assert_close(ent.double(), rent, **VAL_TOL)


def check_grads(x, t, temperature=1.0, ignore_index=-100, seed=1, **kw):
    """Backprop a random mix of both outputs through the op and the reference; compare."""
    x = x.detach().requires_grad_()
    lp, ent = logprobs_and_entropy(x, t, temperature=temperature, ignore_index=ignore_index, **kw)
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(lp.shape, generator=g, dtype=torch.float64).to(x.device)
    b = torch.randn(lp.shape, generator=g, dtype=torch.float64).to(x.device)
    ((lp.double() * a).sum() + (ent.double() * b).sum()).backward()
    x64, rlp, rent = reference(x, t, temperature, ignore_index)
    ((rlp * a).sum() + (rent * b).sum()).backward()
    assert x.grad.dtype == x.dtype
    torch.testing.assert_close(x.grad.double(), x64.grad, **GRAD_TOL[x.dtype])
    return x.grad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 1000), (37, 4099), (1, 50257), (2, 1), (7,)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_match_float64(device, dtype, shape, temperature):
    x, t = make(shape, dtype, device, seed=len(shape) + shape[-1], ignore_frac=0.2)
    lp, ent = logprobs_and_entropy(x, t, temperature=temperature)
    _, rlp, rent = reference(x, t, temperature)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == t.shape
    torch.testing.assert_close(lp.double(), rlp, **VAL_TOL)
    torch.testing.assert_close(ent.double(), rent, **VAL_TOL)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 1.3])
def test_gradients_match_autograd_of_naive_formula(device, dtype, temperature):
    x, t = make((4, 9, 3001), dtype, device, seed=11, ignore_frac=0.2)
    check_grads(x, t, temperature)


@pytest.mark.parametrize("device", DEVICES)
def test_logprob_only_and_entropy_only_gradients(device):
    x, t = make((6, 777), torch.float32, device, seed=4)
    x = x.requires_grad_()
    lp, ent = logprobs_and_entropy(x, t, with_entropy=False)
    assert ent is None
    lp.sum().backward()
    x64, rlp, _ = reference(x, t)
    rlp.sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, **GRAD_TOL[torch.float32])
    x.grad = None
    _, ent = logprobs_and_entropy(x, t)
    ent.sum().backward()  # an entropy bonus alone
    x64, _, rent = reference(x, t)
    rent.sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, **GRAD_TOL[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_all_ignore_index(device, dtype):
    x, t = make((3, 4, 513), dtype, device, seed=2)
    t[1] = 7
    t[:] = -1
    t[2, 3] = 5
    grad = check_grads(x, t, ignore_index=-1)
    lp, ent = logprobs_and_entropy(x, t, ignore_index=-1)
    assert (lp[:2] == 0).all() and (ent[:2] == 0).all() and (grad[:2] == 0).all()
    assert (grad[2, 3] != 0).any()


@pytest.mark.parametrize("device", DEVICES)
def test_single_token(device):
    x, t = make((1000,), torch.bfloat16, device, seed=5)  # 1-D logits, 0-dim target
    lp, ent = logprobs_and_entropy(x, t)
    assert lp.shape == ent.shape == ()
    _, rlp, rent = reference(x, t)
    torch.testing.assert_close(lp.double(), rlp, **VAL_TOL)
    torch.testing.assert_close(ent.double(), rent, **VAL_TOL)
    check_grads(x[None, None], t[None, None])


@pytest.mark.parametrize("device", DEVICES)
def test_strided_logits_are_not_copied_and_match(device):
    """A [b, s, V] transpose of [s, b, V] and a column slice of a padded vocabulary."""
    base, t_sb = make((5, 3, 1200), torch.bfloat16, device, seed=6)
    x = base.transpose(0, 1)                                   # [b, s, V], non-contiguous
    t = t_sb.clamp(max=999).transpose(0, 1)
    rows, _, _ = lp_mod._as_rows(x, t)
    assert rows.data_ptr() == base.data_ptr()                  # flattened as a view
    sliced = x[..., :1000]                                     # row stride 1200 > 1000
    rows, _, _ = lp_mod._as_rows(sliced, t)
    assert rows.data_ptr() == base.data_ptr()
    check_values(sliced, t, 0.9)
    check_grads(sliced, t, 0.9)


@pytest.mark.parametrize("device", DEVICES)
def test_many_row_chunks(device, monkeypatch):
    """Force the torch path's row chunking (chunk sizes that do not divide the rows)."""
    monkeypatch.setattr(lp_mod, "_CHUNK_ELEMS", 3 * 1001 + 5)  # 3 rows per chunk
    x, t = make((40, 7, 1001), torch.float16, device, seed=8, ignore_frac=0.1)  # 280 rows
    check_values(x, t, 0.8)
    check_grads(x, t, 0.8)


@pytest.mark.parametrize("device", DEVICES)
def test_neg_inf_logits_and_bad_targets(device):
    x, t = make((4, 300), torch.float32, device, seed=9)
    x[:, 250:] = float("-inf")                                 # padded vocabulary entries
    t = t.clamp(max=249)
    grad = check_grads(x, t)
    assert (grad[:, 250:] == 0).all()
    t[0], t[1] = 300, -5                                       # out of range: NaN log-prob
    lp, ent = logprobs_and_entropy(x, t)
    assert torch.isnan(lp[:2]).all() and torch.isfinite(lp[2:]).all() and torch.isfinite(ent).all()


def test_input_validation():
    x, t = make((2, 10), torch.float32)
    with pytest.raises(TypeError):
        logprobs_and_entropy(x.double(), t)
    with pytest.raises(ValueError):
        logprobs_and_entropy(x, t[:1])
    with pytest.raises(ValueError):
        logprobs_and_entropy(x, t, temperature=0.0)
    with pytest.raises(TypeError):
        logprobs_and_entropy(x, t.float())


def test_backend_reports_and_logs_once(caplog):
    import logging

    from megarl.ops import _ext

    assert kernel_backend() == ("cuda" if torch.cuda.is_available() and _ext.load() else "torch")
    if kernel_backend() == "torch":
        monkey = _ext._ext
        try:
            _ext._ext = _ext._UNLOADED
            with caplog.at_level(logging.DEBUG, logger="megarl.ops"):  # debug on a CPU machine, a warning on a GPU one
                for _ in range(3):
                    logprobs_and_entropy(*make((2, 10), torch.float32))
            msgs = [r.getMessage() for r in caplog.records if r.name == "megarl.ops"]
            assert len(msgs) == 1 and "using the torch path" in msgs[0]
        finally:
            _ext._ext = monkey


# ----------------------------------------------------------------------------- tensor parallel


def _tp_body(rank, world, cases):
    """Each rank runs the op on its vocab shard; counts the collectives of forward/backward."""
    counts = {"fwd": [], "bwd": []}
    real = dist.all_reduce
    phase = {"now": "fwd"}

    def counting(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        name = {dist.ReduceOp.MAX: "MAX", dist.ReduceOp.SUM: "SUM"}.get(op, str(op))
        counts[phase["now"]].append(name)
        return real(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = counting
    group = dist.new_group(list(range(world)))
    out = []
    for x, t, temperature, a, b in cases:
        n = x.shape[-1] // world
        shard = x[..., rank * n:(rank + 1) * n].clone().requires_grad_()
        phase["now"] = "fwd"
        lp, ent = logprobs_and_entropy(shard, t, tp_group=group, temperature=temperature)
        phase["now"] = "bwd"
        ((lp.double() * a).sum() + (ent.double() * b).sum()).backward()
        out.append((lp.detach(), ent.detach(), shard.grad))
    dist.all_reduce = real
    return out, counts


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_equals_unsharded(world):
    cases = []
    for i, (dtype, temperature) in enumerate([(torch.float32, 1.0), (torch.bfloat16, 0.7),
                                              (torch.float16, 1.0)]):
        x, t = make((3, 5, 1000 * world), dtype, seed=20 + i, ignore_frac=0.2)
        g = torch.Generator().manual_seed(i)
        a = torch.randn(t.shape, generator=g, dtype=torch.float64)
        b = torch.randn(t.shape, generator=g, dtype=torch.float64)
        cases.append((x, t, temperature, a, b))
    results = run_distributed(_tp_body, world, cases)
    for rank, (_, counts) in enumerate(results):
        # one MAX and one packed SUM per forward, nothing in the backward
        assert counts["fwd"] == ["MAX", "SUM"] * len(cases), counts
        assert counts["bwd"] == []
    for i, (x, t, temperature, a, b) in enumerate(cases):
        xr = x.clone().requires_grad_()
        lp, ent = logprobs_and_entropy(xr, t, temperature=temperature)   # unsharded op
        ((lp.double() * a).sum() + (ent.double() * b).sum()).backward()
        for rank, (outs, _) in enumerate(results):
            tlp, tent, tgrad = outs[i]
            torch.testing.assert_close(tlp, lp, **VAL_TOL)
            torch.testing.assert_close(tent, ent, **VAL_TOL)
        grad = torch.cat([outs[i][2] for outs, _ in results], -1)
        torch.testing.assert_close(grad.double(), xr.grad.double(), **GRAD_TOL[x.dtype])
        x64, rlp, rent = reference(x, t, temperature)                    # and float64
        ((rlp * a).sum() + (rent * b).sum()).backward()
        torch.testing.assert_close(grad.double(), x64.grad, **GRAD_TOL[x.dtype])
