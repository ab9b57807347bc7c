"""megarl.ops.linear_logprobs_and_entropy (output layer + log-prob/entropy, chunked)
against float64 references (values, grad of the hidden states and of the weight), against
today's unfused path (output layer -> mask_padded_vocab -> logprobs_and_entropy), at TP=2 over
gloo, and through a Role (`return_hidden=True`) at TP1/TP2/PP2 with tied and untied embeddings.

Tolerances. fp32 GEMMs of h <= 64 terms and the fp32 row statistics: values within 2e-5, grads
within 1e-4 relative (as tests/test_ops_logprobs.py) of float64, and 2e-5 absolute: the grads
here reach ~10, and grad(x) sums ~300 vocabulary terms per element (a few fp32 ulps of the
largest element; one token per forward chunk, whose logits the backward recomputes with a
differently blocked GEMM, gives the largest such error).
"""
import pytest
import torch
import torch.nn.functional as F

from dist_helpers import run_distributed
from megarl.ops import (head_logprobs, head_token_loss, linear_logprobs_and_entropy, linear_token_loss,
                        logprobs_and_entropy)
from megarl.ops import fused_head

VAL_TOL = dict(rtol=2e-5, atol=2e-5)
GRAD_TOL = dict(rtol=1e-4, atol=2e-5)


def make(T, h, n, *, seed=0, ignore_frac=0.2, vocab_size=None, dtype=torch.float32):
    """Fresh hidden [T, h], weight [n, h] (logits of O(3)) and targets [T] < vocab_size."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, h, generator=g).to(dtype)
    w = (torch.randn(n, h, generator=g) * (3.0 / h ** 0.5)).to(dtype)
    t = torch.randint(0, vocab_size or n, (T,), generator=g)
    t[torch.rand(T, generator=g) < ignore_frac] = -100
    return x, w, t


def reference(x, w, t, vocab_size=None, temperature=1.0, ignore_index=-100):
    """float64 output layer + log_softmax; padding columns at -inf. Differentiable in x64, w64."""
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    z = (x64 @ w64.T) / temperature
    if vocab_size is not None:
        z = z.masked_fill(torch.arange(z.shape[-1]) >= vocab_size, float("-inf"))
    lsm = torch.log_softmax(z, -1)
    ign = t == ignore_index
    lp = lsm.gather(-1, t.clamp(min=0)[..., None]).squeeze(-1).masked_fill(ign, 0)
    p = lsm.exp()
    ent = -(p * torch.where(p > 0, lsm, 0.0)).sum(-1).masked_fill(ign, 0)
    return x64, w64, lp, ent


def backprop_mix(lp, ent, seed=1):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(lp.shape, generator=g, dtype=torch.float64)
    b = torch.randn(lp.shape, generator=g, dtype=torch.float64)
    ((lp.double() * a).sum() + (ent.double() * b).sum()).backward()


@pytest.mark.parametrize("chunk", [None, 1, 7, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_grads_match_float64(chunk, temperature):
    x, w, t = make(53, 24, 300, seed=3, vocab_size=290)
    x.requires_grad_(), w.requires_grad_()
    lp, ent = linear_logprobs_and_entropy(x, w, t, vocab_size=290, temperature=temperature, chunk_size=chunk)
    x64, w64, rlp, rent = reference(x, w, t, 290, temperature)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == t.shape
    torch.testing.assert_close(lp.double(), rlp, **VAL_TOL)
    torch.testing.assert_close(ent.double(), rent, **VAL_TOL)
    backprop_mix(lp, ent)
    backprop_mix(rlp, rent)
    torch.testing.assert_close(x.grad.double(), x64.grad, **GRAD_TOL)
    torch.testing.assert_close(w.grad.double(), w64.grad, **GRAD_TOL)
    assert (w.grad[290:] == 0).all()  # padding rows of the weight get no gradient


@pytest.mark.parametrize("chunk", [None, 7])
def test_logprobs_only_skip_the_entropy_passes_and_match_float64(chunk, monkeypatch):
    """with_entropy=False (RL without an entropy bonus, reference scoring): the same log-probs and
    gradients (float64 reference), and the torch path never computes the entropy's moment."""
    from megarl.ops import logprobs as ops_logprobs

    moments = []
    real = ops_logprobs._local_stats
    monkeypatch.setattr(fused_head, "_local_stats",
                        lambda *a, **k: moments.append(k.get("with_moment", True)) or real(*a, **k))
    x, w, t = make(53, 24, 300, seed=5, vocab_size=290)
    x.requires_grad_(), w.requires_grad_()
    lp, ent = linear_logprobs_and_entropy(x, w, t, vocab_size=290, temperature=0.7, chunk_size=chunk,
                                          with_entropy=False)
    assert ent is None and moments and not any(moments)
    x64, w64, rlp, _ = reference(x, w, t, 290, 0.7)
    torch.testing.assert_close(lp.double(), rlp, **VAL_TOL)
    g = torch.randn(lp.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    (lp.double() * g).sum().backward()
    (rlp * g).sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, **GRAD_TOL)
    torch.testing.assert_close(w.grad.double(), w64.grad, **GRAD_TOL)
    assert (x.grad[t == -100] == 0).all()  # ignored rows: zero gradient


def test_strided_bsh_hidden_and_single_outputs():
    """[b, s, h] as the model hands it (a transpose of [s, b, h]); log-prob only, entropy only."""
    base, w, t = make(5 * 3, 16, 111, seed=4)
    hidden = base.view(5, 3, 16).transpose(0, 1).detach().requires_grad_(False)  # [b=3, s=5, h]
    labels = t.view(5, 3).transpose(0, 1)
    for which in ("lp", "ent"):
        h = hidden.detach().clone().requires_grad_()  # contiguous [b, s, h] leaf...
        hs = h.transpose(0, 1).contiguous().transpose(0, 1)  # ...seen through a strided view
        ww = w.detach().clone().requires_grad_()
        lp, ent = linear_logprobs_and_entropy(hs, ww, labels, chunk_size=4, with_entropy=which == "ent")
        assert lp.shape == labels.shape
        x64, w64, rlp, rent = reference(hidden.reshape(-1, 16), w, labels.reshape(-1))
        (lp.sum() if which == "lp" else ent.sum()).backward()
        (rlp.sum() if which == "lp" else rent.sum()).backward()
        torch.testing.assert_close(lp.reshape(-1).double(), rlp, **VAL_TOL)
        torch.testing.assert_close(h.grad.reshape(-1, 16).double(), x64.grad, **GRAD_TOL)
        torch.testing.assert_close(ww.grad.double(), w64.grad, **GRAD_TOL)
        if which == "lp":
            assert ent is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_unfused_path(dtype):
    """Output layer -> padding mask -> logprobs_and_entropy, in the same dtype, as RL runs today."""
    x, w, t = make(40, 32, 256, seed=5, vocab_size=250, dtype=dtype)
    xf, wf = x.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = linear_logprobs_and_entropy(xf, wf, t, vocab_size=250, temperature=0.9, chunk_size=9)
    backprop_mix(lp, ent)
    xu, wu = x.clone().requires_grad_(), w.clone().requires_grad_()
    logits = F.linear(xu, wu)
    logits[:, 250:] = -1e30  # models.gpt.mask_padded_vocab
    ulp, uent = logprobs_and_entropy(logits, t, temperature=0.9)
    backprop_mix(ulp, uent)
    tol = VAL_TOL if dtype == torch.float32 else dict(rtol=0, atol=0)  # bf16: the same bf16 logits
    torch.testing.assert_close(lp, ulp, **tol)
    torch.testing.assert_close(ent, uent, **tol)
    gtol = GRAD_TOL if dtype == torch.float32 else dict(rtol=2 ** -6, atol=2e-3)  # bf16 chunk sums
    torch.testing.assert_close(xf.grad.float(), xu.grad.float(), **gtol)
    torch.testing.assert_close(wf.grad.float(), wu.grad.float(), **gtol)
    assert xf.grad.dtype == wf.grad.dtype == dtype


def test_no_logits_saved_for_backward_and_chunk_bounded(monkeypatch):
    """The autograd graph keeps nothing of [T, V] size, and no logits tensor exceeds one chunk:
    the forward's are `chunk` tokens x V, the backward's every token x a slice of columns."""
    T, h, n, chunk = 96, 16, 5000, 10
    x, w, t = make(T, h, n, seed=6, ignore_frac=0.0)  # every token counts: chunks of exactly `chunk` rows
    x.requires_grad_(), w.requires_grad_()
    saved = []
    shapes = []
    real = fused_head._chunk_logits

    def chunk_logits(xc, ww, fp):
        shapes.append((xc.shape[0], ww.shape[0]))
        return real(xc, ww, fp)

    monkeypatch.setattr(fused_head, "_chunk_logits", chunk_logits)
    with torch.autograd.graph.saved_tensors_hooks(lambda s: saved.append(s.numel()) or s, lambda s: s):
        lp, ent = linear_logprobs_and_entropy(x, w, t, chunk_size=chunk)
    (lp.sum() + ent.sum()).backward()
    assert max(saved) <= max(T * h, n * h), saved  # inputs and per-token stats only
    forward, backward = shapes[: -(-T // chunk)], shapes[-(-T // chunk):]
    assert {c for c, _ in forward} == {chunk, T % chunk} and {v for _, v in forward} == {n}
    cols = chunk * n // T // 64 * 64  # 512 columns: about as many logits as a forward chunk, 64-aligned
    assert [v for _, v in backward] == [cols] * (n // cols) + [n % cols] and {c for c, _ in backward} == {T}
    assert max(c * v for c, v in shapes) <= chunk * n


def test_backward_slices_stop_at_min_cols(monkeypatch):
    """Many tokens per forward chunk's elements: the backward's column slices stop at _MIN_COLS
    (all tokens x 256 columns, more than a forward chunk's logits) and the grads still match
    float64."""
    T, h, n, chunk = 96, 16, 600, 2  # backward: 96 x 256 > a forward chunk's 2 x 600
    x, w, t = make(T, h, n, seed=9, ignore_frac=0.0)
    x.requires_grad_(), w.requires_grad_()
    shapes, real = [], fused_head._chunk_logits
    monkeypatch.setattr(fused_head, "_chunk_logits",
                        lambda xc, ww, fp: shapes.append((xc.shape[0], ww.shape[0])) or real(xc, ww, fp))
    lp, ent = linear_logprobs_and_entropy(x, w, t, chunk_size=chunk)
    backprop_mix(lp, ent)
    assert shapes[T // chunk:] == [(T, 256), (T, 256), (T, n - 512)]  # after the forward chunks
    x64, w64, lp64, ent64 = reference(x, w, t)
    backprop_mix(lp64, ent64)
    torch.testing.assert_close(x.grad.double(), x64.grad, **GRAD_TOL)
    torch.testing.assert_close(w.grad.double(), w64.grad, **GRAD_TOL)


def test_one_chunk_keeps_its_logits_for_the_backward(monkeypatch):
    """All tokens in one chunk: the backward reuses the forward's logits (one logits GEMM, not
    two) and gives the same gradients as recomputing them; without grad nothing is kept."""
    T, h, n = 40, 16, 300
    x, w, t = make(T, h, n, seed=8, vocab_size=290, ignore_frac=0.0)
    calls = []
    real = fused_head._chunk_logits
    monkeypatch.setattr(fused_head, "_chunk_logits",
                        lambda xc, ww, fp: calls.append(xc.shape[0]) or real(xc, ww, fp))
    grads = {}
    for chunk in (T, T - 1):  # one chunk (kept) vs two chunks (recomputed)
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        calls.clear()
        lp, ent = linear_logprobs_and_entropy(xx, ww, t, vocab_size=290, chunk_size=chunk)
        backprop_mix(lp, ent)
        grads[chunk] = (calls[:], xx.grad, ww.grad)
    # two chunks: forward 39 + 1 tokens, backward every token over columns [0, 292) and [292, 300)
    assert grads[T][0] == [T] and grads[T - 1][0] == [T - 1, 1, T, T]
    torch.testing.assert_close(grads[T][1], grads[T - 1][1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[T][2], grads[T - 1][2], rtol=1e-5, atol=1e-6)
    kept = []
    real_apply = fused_head._FusedLinearLogProbs.apply
    # the Function's last two inputs are keep_one and with_entropy
    monkeypatch.setattr(fused_head._FusedLinearLogProbs, "apply", lambda *a: kept.append(a[-2]) or real_apply(*a))
    with torch.no_grad():  # scoring: no backward will come
        linear_logprobs_and_entropy(x.clone().requires_grad_(), w.clone().requires_grad_(), t)
    linear_logprobs_and_entropy(x, w, t)  # nothing requires grad
    assert kept == [False, False]


def test_input_validation():
    x, w, t = make(4, 8, 10)
    with pytest.raises(TypeError):
        linear_logprobs_and_entropy(x, w.double(), t)
    with pytest.raises(ValueError):
        linear_logprobs_and_entropy(x, w[:, :4], t)
    with pytest.raises(ValueError):
        linear_logprobs_and_entropy(x, w, t[:2])
    with pytest.raises(ValueError):
        linear_logprobs_and_entropy(x, w, t, vocab_size=11)
    with pytest.raises(ValueError):
        linear_logprobs_and_entropy(x, w, t, chunk_size=0)
    with pytest.raises(ValueError):
        linear_logprobs_and_entropy(x, w, t, temperature=0)


# ----------------------------------------------------------------------------- tensor parallel


def _tp_body(rank, world, cases):
    import torch.distributed as dist

    group = dist.new_group(list(range(world)))
    out = []
    for x, w, t, vocab_size, reduce_grad in cases:
        n = w.shape[0] // world
        xr = x.clone().requires_grad_()
        wr = w[rank * n:(rank + 1) * n].clone().requires_grad_()
        lp, ent = linear_logprobs_and_entropy(xr, wr, t, tp_group=group, vocab_size=vocab_size, temperature=0.8,
                                              chunk_size=6, reduce_hidden_grad=reduce_grad)
        backprop_mix(lp, ent)
        out.append((lp.detach(), ent.detach(), xr.grad, wr.grad))
    return out


@pytest.mark.slow
def test_tensor_parallel_matches_float64():
    world = 2
    cases = [make(31, 16, 2 * 200, seed=7, vocab_size=390) + (390, True),   # rank 1's tail is padding
             make(20, 16, 2 * 8, seed=8, vocab_size=7) + (7, True),         # rank 1 holds padding only
             make(25, 16, 2 * 150, seed=9) + (None, False)]                 # SP-style: caller sums grad(x)
    results = run_distributed(_tp_body, world, cases)
    for i, (x, w, t, vocab_size, reduce_grad) in enumerate(cases):
        x64, w64, rlp, rent = reference(x, w, t, vocab_size, 0.8)
        backprop_mix(rlp, rent)
        for outs in results:
            torch.testing.assert_close(outs[i][0].double(), rlp, **VAL_TOL)
            torch.testing.assert_close(outs[i][1].double(), rent, **VAL_TOL)
        gx = [outs[i][2] for outs in results]
        if reduce_grad:
            for g in gx:  # every rank holds the full (all-reduced) grad of the hidden states
                torch.testing.assert_close(g.double(), x64.grad, **GRAD_TOL)
        else:
            torch.testing.assert_close(sum(gx).double(), x64.grad, **GRAD_TOL)
        gw = torch.cat([outs[i][3] for outs in results])
        torch.testing.assert_close(gw.double(), w64.grad, **GRAD_TOL)


# ----------------------------------------------------------------------------- through a Role

VOCAB, SEQ, GBS, MBS, PROMPT = 100, 12, 4, 2, 5  # vocab 100: TP padding (128)


def _role_body(rank, world, tp, pp):
    from megatron.core import parallel_state as ps

    from megarl.config import LRScheduleConfig, ModelConfig, OptimConfig, ParallelConfig
    from megarl.models.gpt import HeadStates
    from megarl.models.layout import gather_full_state_dict
    from megarl.roles.role import Role
    from megarl.runtime.distributed import init_distributed, teardown
    from dist_helpers import dp_microbatches
    from megarl.trainers.common import token_logprobs

    init_distributed(tp, pp, seed=11)
    g = torch.Generator().manual_seed(3)
    seq = torch.randint(0, VOCAB, (GBS, SEQ + 1), generator=g)
    mask = (torch.rand(GBS, SEQ - PROMPT, generator=g) > 0.3).float()
    batch = {"tokens": seq[:, :-1], "position_ids": torch.arange(SEQ).expand(GBS, SEQ), "output_from": PROMPT,
             "labels": seq[:, PROMPT + 1:], "mask": mask}

    def loss(lp, ent, b):  # NLL and an entropy bonus: both outputs' gradients are used
        loss_sum = -(lp * b["mask"]).sum() - 0.1 * (ent * b["mask"]).sum()
        count = b["mask"].sum().to(torch.int)
        return loss_sum, count, {"loss": torch.stack([loss_sum.detach(), count.double()])}

    def logits_loss(b, logits):
        from megarl.models.gpt import mask_padded_vocab
        assert torch.is_tensor(logits) and logits.shape[1] == SEQ - PROMPT
        lp, ent = logprobs_and_entropy(mask_padded_vocab(logits, VOCAB), b["labels"],
                                       tp_group=ps.get_tensor_model_parallel_group())
        return loss(lp, ent, b)

    def fused_loss(b, head):
        assert isinstance(head, HeadStates) and head.hidden.shape[1] == SEQ - PROMPT
        lp, ent = head_logprobs(head, b["labels"], with_entropy=True, chunk_size=3)
        return loss(lp, ent, b)

    def folded_loss(b, head):  # the same loss, its gradient taken inside the head (linear_token_loss)
        w = b["mask"].reshape(-1)

        def token_loss(pos, lp, ent):
            return -(lp * w[pos]).sum() - 0.1 * (ent * w[pos]).sum()

        loss_sum, _, _ = head_token_loss(head, b["labels"], token_loss, with_entropy=True, chunk_size=3)
        count = b["mask"].sum().to(torch.int)
        return loss_sum, count, {"loss": torch.stack([loss_sum.detach(), count.double()])}

    out = {}
    for tied in (False, True):
        model = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4,
                            vocab_size=VOCAB, max_position_embeddings=32, tie_embeddings=tied)
        optim = OptimConfig(lr=1e-2, clip_grad=1.0, eps=1e-4)
        roles = {name: Role(name, model, ParallelConfig(tp=tp, pp=pp), optim=optim, schedule=LRScheduleConfig(),
                            train_steps=2, seed=5) for name in ("logits", "fused", "folded")}
        mbs = dp_microbatches(batch, MBS)
        fused_mbs = [dict(mb, return_hidden=True) for mb in mbs]
        collected = {
            "logits": roles["logits"].forward_collect(mbs, lambda b, o: token_logprobs(o, b["labels"], VOCAB)),
            "fused": roles["fused"].forward_collect(fused_mbs, lambda b, o: head_logprobs(o, b["labels"])[0]),
        }
        steps = {"logits": roles["logits"].train_step(mbs, logits_loss).metrics["loss"],
                 "fused": roles["fused"].train_step(fused_mbs, fused_loss).metrics["loss"],
                 "folded": roles["folded"].train_step(fused_mbs, folded_loss).metrics["loss"]}
        params = {k: gather_full_state_dict(r.model, VOCAB) for k, r in roles.items()}
        out[tied] = {"collected": collected, "loss": steps, "params": params}
        del roles
    teardown()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_role_train_step_fused_equals_logits(tp, pp):
    """Same collected log-probs, same loss and the same parameter update (every parameter,
    embedding included when tied) as the logits path, within 1e-5: the fused op with the loss
    outside it, and with the loss inside it (head_token_loss)."""
    result = run_distributed(_role_body, tp * pp, tp, pp)[0]
    for tied, r in result.items():
        for a, b in zip(r["collected"]["fused"], r["collected"]["logits"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        logits = r["params"]["logits"]
        for way in ("fused", "folded"):
            assert abs(r["loss"][way] - r["loss"]["logits"]) <= 1e-5 * abs(r["loss"]["logits"]), (tied, r["loss"])
            got = r["params"][way]
            assert got.keys() == logits.keys()
            assert not tied or not any("output_layer" in k for k in got)  # tied: the embedding is the head
            for k in logits:
                torch.testing.assert_close(got[k], logits[k], rtol=1e-5, atol=1e-6, msg=f"{k} ({way}, tied={tied})")


@pytest.mark.gpu
@pytest.mark.parametrize("with_entropy", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_chunks_use_kernels_and_match_cpu(dtype, with_entropy):
    """On a GPU each chunk's statistics and gradient come from csrc's kernels: same results,
    with and without the entropy (log-probs only: no entropy gradient reaches the kernel)."""
    x, w, t = make(70, 32, 520, seed=12, vocab_size=500, dtype=dtype)
    grads = {}
    for device in ("cpu", "cuda"):
        # detach: x.to("cpu") is x itself, and a grad-requiring x would make the CUDA copy a non-leaf
        xd, wd = x.detach().to(device).requires_grad_(), w.detach().to(device).requires_grad_()
        lp, ent = linear_logprobs_and_entropy(xd, wd, t.to(device), vocab_size=500, chunk_size=16,
                                              with_entropy=with_entropy)
        assert (ent is None) == (not with_entropy)
        (lp.sum() - (0.3 * ent.sum() if with_entropy else 0.0)).backward()
        grads[device] = [v.detach().float().cpu() for v in (lp, ent, xd.grad, wd.grad) if v is not None]
    tol = GRAD_TOL if dtype == torch.float32 else dict(rtol=2 ** -6, atol=2e-3)
    for a, b in zip(grads["cuda"], grads["cpu"]):
        torch.testing.assert_close(a, b, **tol)


def test_no_tokens_and_all_ignored_give_zero_gradients():
    """Edge cases of the vocabulary-walking backward: zero tokens, and tokens that are all
    ignore_index (every slice's gradient is zero; grad(W) is still written, as zeros)."""
    g = torch.Generator().manual_seed(21)
    w = torch.randn(300, 8, generator=g).requires_grad_()
    for shape, fill in (((0,), 0), ((2, 3), -100)):
        x = torch.randn(*shape, 8, generator=g).requires_grad_()
        w.grad = None
        lp, ent = linear_logprobs_and_entropy(x, w, torch.full(shape, fill), chunk_size=1)
        (lp.sum() + ent.sum()).backward()
        assert lp.shape == shape and not lp.any() and not ent.any()
        assert x.grad.shape == x.shape and not x.grad.any()
        assert w.grad.shape == w.shape and not w.grad.any()


def test_ignored_tokens_never_reach_the_output_layer(monkeypatch):
    """A padded micro-batch's ignored tokens are left out of the GEMMs (forward and backward),
    with the same log-probs, entropies and gradients as when every token goes through."""
    x, w, t = make(60, 16, 400, seed=23, ignore_frac=0.4)
    n_valid = int((t != -100).sum())
    assert 0 < n_valid < 60
    rows = []
    real = fused_head._chunk_logits
    monkeypatch.setattr(fused_head, "_chunk_logits",
                        lambda xc, ww, fp, *ws: rows.append(xc.shape[0]) or real(xc, ww, fp, *ws))
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = linear_logprobs_and_entropy(xx, ww, t, chunk_size=7)
    backprop_mix(lp, ent)
    assert sum(rows[: -(-n_valid // 7)]) == n_valid and max(rows) == n_valid  # forward chunks, then backward
    # every token through the op (targets made valid), the ignored ones' contributions masked off
    monkeypatch.setattr(fused_head, "_chunk_logits", real)
    x2, w2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    keep = t != -100
    lp2, ent2 = linear_logprobs_and_entropy(x2, w2, t.clamp(min=0), chunk_size=7)
    lp2, ent2 = lp2 * keep, ent2 * keep
    backprop_mix(lp2, ent2)
    torch.testing.assert_close(lp, lp2, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent, ent2, rtol=1e-6, atol=1e-6)
    assert not lp[~keep].any() and not ent[~keep].any() and not xx.grad[~keep].any()
    torch.testing.assert_close(xx.grad, x2.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ww.grad, w2.grad, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- a loss inside the head

def ppo_like(lp, ent, old, adv, weight):
    """A per-token loss that reads both outputs and is not linear in them: PPO's clipped surrogate
    (clip 0.2, dual clip 3), an entropy bonus and a k3 KL to a reference, weighted per token."""
    from megarl.algorithms import ppo_token_loss

    per_token, _ = ppo_token_loss(lp, old, adv, clip_low=0.2, clip_high=0.28, dual_clip=3.0, entropy=ent,
                                  entropy_coef=0.05, ref_logp=old - 0.1, kl_coef=0.3, kl_kind="k3")
    return (per_token * weight).sum()


def loss_case(T, seed):
    """Per-token constants near the current log-probs (so some ratios clip and some do not)."""
    g = torch.Generator().manual_seed(seed + 100)
    return (torch.randn(T, generator=g, dtype=torch.float64) * 0.3,   # old log-prob offset from lp
            torch.randn(T, generator=g, dtype=torch.float64),         # advantages
            torch.rand(T, generator=g, dtype=torch.float64) + 0.5)    # aggregation weights


def folded_against_float64(x, w, t, vocab_size, temperature, chunk, with_entropy, seed, **kw):
    """(loss, lp, ent, grad x, grad w) of linear_token_loss and of the float64 reference."""
    x64, w64, rlp, rent = reference(x, w, t, vocab_size, temperature)
    off, adv, weight = loss_case(t.numel(), seed)
    valid = (t != -100).reshape(-1)
    old = (rlp.detach().reshape(-1) + off)  # float64 constants, read in fp32 by the op's loss
    calls = []

    def token_loss(pos, lp, ent):
        calls.append(pos.clone())
        assert lp.dtype == torch.float32 and lp.requires_grad and (ent is None) == (not with_entropy)
        e = ent if with_entropy else torch.zeros_like(lp)
        return ppo_like(lp, e, old[pos].float(), adv[pos].float(), weight[pos].float())

    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss, lp, ent = linear_token_loss(xr, wr, t, token_loss, vocab_size=vocab_size, temperature=temperature,
                                      chunk_size=chunk, with_entropy=with_entropy, **kw)
    loss.backward()
    rent_in = rent.reshape(-1) if with_entropy else torch.zeros_like(rlp.reshape(-1))
    ref_loss = ppo_like(rlp.reshape(-1)[valid], rent_in[valid], old[valid], adv[valid], weight[valid])
    ref_loss.backward()
    seen = torch.cat(calls) if calls else torch.empty(0, dtype=torch.long)
    assert sorted(seen.tolist()) == valid.nonzero().flatten().tolist()  # every valid token once, no other
    return (loss, lp, ent, xr.grad, wr.grad), (ref_loss, rlp, rent, x64.grad, w64.grad)


@pytest.mark.parametrize("chunk", [None, 1, 7, 64])
@pytest.mark.parametrize("with_entropy", [True, False])
def test_token_loss_values_and_grads_match_float64(chunk, with_entropy):
    x, w, t = make(53, 24, 300, seed=5, vocab_size=290)
    got, ref = folded_against_float64(x, w, t, 290, 0.7, chunk, with_entropy, seed=5)
    loss, lp, ent, gx, gw = got
    assert loss.dim() == 0 and not lp.requires_grad and (ent is None or not ent.requires_grad)
    torch.testing.assert_close(loss.double(), ref[0], **VAL_TOL)
    torch.testing.assert_close(lp.double(), ref[1], **VAL_TOL)
    if with_entropy:
        torch.testing.assert_close(ent.double(), ref[2], **VAL_TOL)
    else:
        assert ent is None
    torch.testing.assert_close(gx.double(), ref[3], **GRAD_TOL)
    torch.testing.assert_close(gw.double(), ref[4], **GRAD_TOL)
    assert (gw[290:] == 0).all()


def test_token_loss_computes_each_chunks_logits_once_and_scales_by_the_incoming_grad(monkeypatch):
    """Three output-layer GEMMs at any token count: the forward's chunk logits are never
    recomputed in the backward, which only scales what the forward computed."""
    x, w, t = make(40, 16, 120, seed=6, ignore_frac=0.0)
    chunks = []
    real = fused_head._chunk_logits
    monkeypatch.setattr(fused_head, "_chunk_logits", lambda xc, *a: chunks.append(xc.shape[0]) or real(xc, *a))

    def nll(pos, lp, ent):
        return -lp.sum()

    grads = []
    for scale in (1.0, 2.5):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss, _, _ = linear_token_loss(xr, wr, t, nll, chunk_size=8)
        n_forward = len(chunks)
        (loss * scale).backward()
        assert len(chunks) == n_forward  # no logits in the backward
        grads.append((xr.grad, wr.grad))
    assert chunks == [8] * 10  # 5 chunks per call, two calls
    torch.testing.assert_close(grads[1][0], grads[0][0] * 2.5)
    torch.testing.assert_close(grads[1][1], grads[0][1] * 2.5)
    # the same gradients as the recomputing op with the loss outside
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    lp, _ = linear_logprobs_and_entropy(xr, wr, t, chunk_size=8, with_entropy=False)
    (-lp.sum()).backward()
    torch.testing.assert_close(xr.grad, grads[0][0], **GRAD_TOL)
    torch.testing.assert_close(wr.grad, grads[0][1], **GRAD_TOL)


def test_token_loss_without_grad_and_bad_losses():
    x, w, t = make(20, 16, 50, seed=7)
    with torch.no_grad():
        loss, lp, _ = linear_token_loss(x, w, t, lambda pos, lp, ent: -lp.sum(), chunk_size=3)
    ref_lp, _ = linear_logprobs_and_entropy(x, w, t, with_entropy=False)
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(loss, -ref_lp.sum())
    assert not loss.requires_grad
    with pytest.raises(ValueError, match="0-d tensor"):
        linear_token_loss(x.requires_grad_(), w, t, lambda pos, lp, ent: -lp, chunk_size=3)
    # a loss that does not read the log-probs gives zero gradients, not an error
    xr = x.detach().clone().requires_grad_()
    loss, _, _ = linear_token_loss(xr, w, t, lambda pos, lp, ent: lp.new_zeros(()), chunk_size=3)
    loss.backward()
    assert xr.grad is not None and not xr.grad.any()


def test_token_loss_in_bf16_matches_the_recomputing_op():
    x, w, t = make(48, 32, 256, seed=8, dtype=torch.bfloat16)

    def run(fold):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        if fold:
            loss, _, _ = linear_token_loss(xr, wr, t, lambda pos, lp, ent: -(lp * 0.5).sum() - ent.sum() * 0.1,
                                           chunk_size=16, with_entropy=True)
        else:
            lp, ent = linear_logprobs_and_entropy(xr, wr, t, chunk_size=16)
            loss = -(lp * 0.5).sum() - ent.sum() * 0.1
        loss.backward()
        return loss.detach(), xr.grad.float(), wr.grad.float()

    for a, b in zip(run(True), run(False)):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def _tp_loss_body(rank, world, x, w, t, vocab_size, reduce_grad, old):
    import torch.distributed as dist

    group = dist.new_group(list(range(world)))
    n = w.shape[0] // world
    _, adv, weight = loss_case(t.numel(), seed=9)
    xr = x.clone().requires_grad_()
    wr = w[rank * n:(rank + 1) * n].clone().requires_grad_()

    def token_loss(pos, lp, ent):
        return ppo_like(lp, ent, old[pos].float(), adv[pos].float(), weight[pos].float())

    loss, lp, ent = linear_token_loss(xr, wr, t, token_loss, tp_group=group, vocab_size=vocab_size,
                                      temperature=0.8, chunk_size=6, with_entropy=True, reduce_hidden_grad=reduce_grad)
    loss.backward()
    return loss.detach(), lp, ent, xr.grad, wr.grad


@pytest.mark.slow
@pytest.mark.parametrize("reduce_grad", [True, False])
def test_token_loss_tensor_parallel_matches_float64(reduce_grad):
    x, w, t = make(31, 16, 2 * 200, seed=10, vocab_size=390)
    x64, w64, rlp, rent = reference(x, w, t, 390, 0.8)
    off, adv, weight = loss_case(t.numel(), seed=9)
    old = rlp.detach() + off  # near the current log-probs: some ratios clip, some do not
    results = run_distributed(_tp_loss_body, 2, x, w, t, 390, reduce_grad, old)
    v = t != -100
    ref_loss = ppo_like(rlp[v], rent[v], old[v], adv[v], weight[v])
    ref_loss.backward()
    for loss, lp, ent, _, _ in results:
        torch.testing.assert_close(loss.double(), ref_loss.detach(), **VAL_TOL)
        torch.testing.assert_close(lp.double(), rlp.detach(), **VAL_TOL)
        torch.testing.assert_close(ent.double(), rent.detach(), **VAL_TOL)
    gx = [r[3] for r in results]
    if reduce_grad:
        for g in gx:
            torch.testing.assert_close(g.double(), x64.grad, **GRAD_TOL)
    else:
        torch.testing.assert_close(sum(gx).double(), x64.grad, **GRAD_TOL)
    torch.testing.assert_close(torch.cat([r[4] for r in results]).double(), w64.grad, **GRAD_TOL)


def test_token_loss_backward_runs_once_with_a_clear_error():
    x, w, t = make(12, 8, 40, seed=12)
    xr = x.clone().requires_grad_()
    loss, _, _ = linear_token_loss(xr, w, t, lambda pos, lp, ent: -lp.sum(), chunk_size=5)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="linear_token_loss: its backward runs once"):
        loss.backward()
