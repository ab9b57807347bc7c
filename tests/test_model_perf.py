"""Step-speed fixes of issue 18 keep results exact.

1. The model returns its logits (and scalar values) as a view of the output layer's result,
   not a copy, and the gradient reaches the output layer contiguous; logits and gradients equal
   megatron-core's own GPTModel on the same weights.
2. The foreach grad norm / clip (megarl.optim.foreach) equals megatron-core's reference
   functions and a float64 formula, and training steps through it (with torch's fused AdamW)
   equal megatron's own steps (per-op AdamW) to fp32 rounding.
"""
import pytest
import torch

from dist_helpers import run_distributed

VOCAB, SEQ, B = 100, 12, 3  # vocab 100 < 128: the padded columns are exercised too


def _model_cfg():
    from megarl.config import ModelConfig

    return ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_kv_heads=2,
                       vocab_size=VOCAB, max_position_embeddings=64)


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, VOCAB, (B, SEQ + 1), generator=g)
    return {"tokens": seq[:, :-1], "labels": seq[:, 1:], "position_ids": torch.arange(SEQ).expand(B, SEQ),
            "attention_mask": None, "loss_mask": (torch.rand(B, SEQ, generator=g) > 0.2).float()}


def _logits_body(rank, world_size):
    from megatron.core.models.gpt import GPTModel

    from megarl.config import ParallelConfig
    from megarl.models.gpt import build_model
    from megarl.runtime.distributed import init_distributed, teardown
    from megarl.trainers.common import token_logprobs

    init_distributed(1, 1, seed=3)
    mc = _model_cfg()
    ours = build_model(mc, ParallelConfig(), head="lm", seed=7)
    ref = build_model(mc, ParallelConfig(), head="lm", seed=7)
    ref.__class__ = GPTModel  # the same module, with megatron-core's own forward
    ref.load_state_dict(ours.state_dict())
    batch = _batch(1)
    out = {}
    for name, model in (("ours", ours), ("ref", ref)):
        seen = {}

        def keep(module, args, result, seen=seen):
            seen["result"] = result[0]  # [s, b, V_pad]
            result[0].register_hook(lambda g: seen.__setitem__("grad_contiguous", g.is_contiguous()))

        handle = model.output_layer.register_forward_hook(keep)
        logits = model(batch["tokens"], batch["position_ids"], None)  # [b, s, V_pad]
        handle.remove()
        shares = logits.untyped_storage().data_ptr() == seen["result"].untyped_storage().data_ptr()
        lp = token_logprobs(logits, batch["labels"], VOCAB)
        (-(lp * batch["loss_mask"]).sum()).backward()
        out[name] = {"logits": logits.detach().clone(), "shares": shares, "shape": tuple(logits.shape),
                     "grad_contiguous": seen["grad_contiguous"],
                     "grads": {k: p.grad.clone() for k, p in model.named_parameters()}}
    scalar = build_model(mc, ParallelConfig(), head="scalar", seed=7)
    seen = {}
    handle = scalar.output_layer.register_forward_hook(lambda m, a, r: seen.__setitem__("result", r[0]))
    values = scalar(batch["tokens"], batch["position_ids"], None)  # [b, s, 1]
    handle.remove()
    out["scalar"] = {"shape": tuple(values.shape),
                     "shares": values.untyped_storage().data_ptr() == seen["result"].untyped_storage().data_ptr(),
                     "equal": torch.equal(values, seen["result"].transpose(0, 1))}
    teardown()
    return out


@pytest.mark.slow
def test_logits_are_a_view_and_match_megatron():
    (r,) = run_distributed(_logits_body, 1)
    ours, ref = r["ours"], r["ref"]
    assert ours["shape"] == ref["shape"] == (B, SEQ, 128)
    assert ours["shares"], "megarl's logits must be a view of the output layer's result"
    assert not ref["shares"], "megatron-core's GPTModel copies (.contiguous()); the check must see it"
    assert ours["grad_contiguous"], "the output layer's gradient must arrive contiguous (no copies in its backward)"
    assert torch.equal(ours["logits"], ref["logits"])
    for k, g in ref["grads"].items():
        torch.testing.assert_close(ours["grads"][k], g, rtol=1e-6, atol=1e-7, msg=k)
    assert r["scalar"]["shape"] == (B, SEQ, 1) and r["scalar"]["shares"] and r["scalar"]["equal"]


def _clip_body(rank, world_size):
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, get_grad_norm_fp32

    from megarl.algorithms.losses import masked_nll
    from megarl.config import LRScheduleConfig, OptimConfig, ParallelConfig
    from megarl.optim.foreach import ForeachClipOptimizer, clip_by_total_norm, global_grad_norm
    from megarl.roles.role import Role
    from megarl.runtime.distributed import init_distributed, teardown
    from megarl.trainers.common import token_logprobs

    init_distributed(1, 1, seed=3)
    mc = _model_cfg()
    # Clipping active; eps=1e-4 as in test_layout_parity: with eps=1e-8, gradients that are ~0
    # turn fp32 rounding differences (fused vs per-op AdamW) into full-size steps.
    optim = OptimConfig(lr=1e-2, clip_grad=0.05, weight_decay=0.1, eps=1e-4)

    def role():
        return Role("policy", mc, ParallelConfig(), head="lm", seed=9, optim=optim,
                    schedule=LRScheduleConfig(style="constant"), train_steps=10)

    def loss_fn(b, logits):
        return masked_nll(token_logprobs(logits, b["labels"], VOCAB), b["loss_mask"])

    out = {}
    # (a) one set of gradients, clipped three ways
    a = role()
    assert isinstance(a.optimizer, ForeachClipOptimizer)
    for c in a.chunks:
        c.zero_grad_buffer()
    a.optimizer.zero_grad()
    a.forward_backward([_batch(2)], loss_fn)
    inner = a.optimizer.inner
    inner.prepare_grads()
    params = inner.get_parameters()
    originals = [p.grad.clone() for p in params]
    squares = [g.double().square().sum() for g in inner.get_main_grads_for_grad_norm()]
    out["f64_norm"] = torch.stack(squares).sum().sqrt().item()
    out["ref_norm"] = get_grad_norm_fp32(inner.get_main_grads_for_grad_norm(),
                                         grad_stats_parallel_group=inner.get_grad_stats_parallel_group())
    clip_grad_by_total_norm_fp32(params, optim.clip_grad, out["ref_norm"])
    ref_clipped = [p.grad.clone() for p in params]
    for p, g in zip(params, originals):
        p.grad.copy_(g)
    out["our_norm"] = global_grad_norm(inner)
    clip_by_total_norm(inner, out["our_norm"])
    out["clipped"] = [(p.grad.clone(), r, g) for p, r, g in zip(params, ref_clipped, originals)]
    # (b) three training steps through the wrapper and through megatron's own step
    runs = {}
    for name in ("foreach", "megatron"):
        r = role()
        if name == "megatron":
            r.optimizer = r.optimizer.inner
            r.scheduler.optimizer = r.optimizer
        norms = [r.train_step([_batch(10 + i)], loss_fn).grad_norm for i in range(3)]
        runs[name] = (norms, {k: p.detach().clone() for k, p in r.model.named_parameters()})
        out[f"fused_{name}"] = [g.get("fused") for g in r.optimizer.param_groups]
    out["runs"] = runs
    teardown()
    return out


@pytest.mark.slow
def test_foreach_clip_matches_megatron_and_float64():
    (r,) = run_distributed(_clip_body, 1)
    assert r["ref_norm"] > 0.05 * 2, "the test must clip"
    assert abs(r["our_norm"] - r["f64_norm"]) <= 1e-6 * r["f64_norm"]
    assert abs(r["our_norm"] - r["ref_norm"]) <= 1e-6 * r["ref_norm"]
    coeff = 0.05 / (r["f64_norm"] + 1e-6)
    for ours, ref, orig in r["clipped"]:
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0)
        torch.testing.assert_close(ours.double(), orig.double() * coeff, rtol=2e-6, atol=1e-12)
    assert all(r["fused_foreach"]) and not any(r["fused_megatron"]), "megarl's step runs torch's fused AdamW"
    (fe_norms, fe_params), (mg_norms, mg_params) = r["runs"]["foreach"], r["runs"]["megatron"]
    for a, b in zip(fe_norms, mg_norms):
        assert abs(a - b) <= 1e-6 * b, (fe_norms, mg_norms)
    for k, v in mg_params.items():
        torch.testing.assert_close(fe_params[k], v, rtol=1e-5, atol=1e-7, msg=k)


def _output_from_body(rank, world_size, sp):
    from megarl.config import ParallelConfig
    from megarl.models.gpt import build_model
    from megarl.runtime.distributed import init_distributed, teardown

    init_distributed(world_size, 1, seed=3)
    mc = _model_cfg()
    pc = ParallelConfig(tp=world_size, sequence_parallel=sp)
    batch = _batch(2)
    out = {}
    for head in ("lm", "scalar"):
        model = build_model(mc, pc, head=head, seed=7)
        full = model(batch["tokens"], batch["position_ids"], None)  # [b, s, .]
        seen = {}
        handle = model.output_layer.register_forward_hook(lambda m, a, r: seen.__setitem__("rows", a[0].shape[0]))
        cut = model(batch["tokens"], batch["position_ids"], None, output_from=5)  # [b, s - 5, .]
        handle.remove()
        (cut.float() * torch.linspace(-1, 1, cut.shape[-1])).sum().backward()
        out[head] = {"full": full.detach()[:, 5:].clone(), "cut": cut.detach().clone(), "head_rows": seen["rows"],
                     "grad": next(model.parameters()).grad is not None}
    teardown()
    return out


@pytest.mark.parametrize("world_size,sp", [(1, False), (2, False)])  # SP needs TE's norms (GPU)
def test_output_from_runs_the_head_on_the_response_columns_only(world_size, sp):
    """RL's micro-batches ask for outputs from the first response column (`output_from`): the
    same numbers as the full forward's columns, and without SP the output layer sees only them."""
    res = run_distributed(_output_from_body, world_size, sp)[0]
    for head in ("lm", "scalar"):
        r = res[head]
        assert r["cut"].shape == r["full"].shape and r["cut"].shape[1] == SEQ - 5
        torch.testing.assert_close(r["cut"], r["full"], rtol=1e-5, atol=1e-6)
        assert r["grad"]
    if not sp:
        assert res["lm"]["head_rows"] == SEQ - 5  # hidden states cut before the LM head's GEMM
