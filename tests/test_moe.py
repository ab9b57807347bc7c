"""Mixture-of-experts models (megatron-core's MoE layer): config rules, the aux loss in the
gradient, and layout parity: the same seed trains identically at EP1 and at EP2 (x DP2, x PP2).
"""
import pytest
import torch

from dist_helpers import dp_microbatches, full_gradients, run_distributed

VOCAB, SEQ, GBS, MBS = 100, 12, 8, 2


def _model(**moe):
    from megarl.config import ModelConfig, MoEConfig

    base = dict(num_experts=4, topk=2, expert_hidden=40, shared_expert_hidden=24, aux_loss_coeff=0.02)
    return ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_kv_heads=2,
                       vocab_size=VOCAB, max_position_embeddings=64, qk_norm=True, moe=MoEConfig(**{**base, **moe}))


def _global_batch(step):
    g = torch.Generator().manual_seed(300 + step)
    seq = torch.randint(0, VOCAB, (GBS, SEQ + 1), generator=g)
    return {"tokens": seq[:, :-1], "labels": seq[:, 1:], "position_ids": torch.arange(SEQ).expand(GBS, SEQ),
            "loss_mask": (torch.rand(GBS, SEQ, generator=g) > 0.3).float()}


def _lm_loss(batch, logits):
    from megarl.algorithms.losses import masked_nll
    from megarl.trainers.common import token_logprobs

    return masked_nll(token_logprobs(logits, batch["labels"], VOCAB), batch["loss_mask"])


def test_config_rules():
    from megarl.config import Config, MoEConfig, ParallelConfig, check_config

    def errs(moe=None, **parallel):
        cfg = Config(parallel=ParallelConfig(**parallel))
        cfg.data.global_batch_size = 16
        cfg.model.moe = moe or MoEConfig(num_experts=4)
        return check_config(cfg, world_size=4, cuda=False)

    assert errs() == []
    assert errs(ep=2) == [] and errs(ep=4) == []
    assert errs(MoEConfig(num_experts=6), ep=4) == [
        "model.moe.num_experts (6) must be divisible by parallel.ep (4)"]
    assert errs(MoEConfig(num_experts=4, topk=5)) == ["model.moe.topk must be in [1, num_experts=4], got 5"]
    assert errs(MoEConfig(num_experts=4, bias_update_rate=1e-3)) == [
        "model.moe.bias_update_rate (aux-loss-free balancing) needs model.moe.score=sigmoid (megatron-core's expert bias)"]
    assert errs(MoEConfig(num_experts=4, score="sigmoid", bias_update_rate=1e-3)) == []
    assert errs(MoEConfig(), ep=2) == ["parallel.ep=2 needs a MoE model: set model.moe.num_experts"]
    assert errs(ep=8) == ["world size 4 must be divisible by parallel.etp*ep*pp = 1*8*1 = 8 (the experts' layout)",
                          "model.moe.num_experts (4) must be divisible by parallel.ep (8)"]
    assert "needs parallel.sequence_parallel" in errs(tp=2)[0]
    rl = Config()
    rl.rl.routing_replay = "rollout"
    assert ("rl.routing_replay=rollout needs a MoE model (model.moe.num_experts > 0); set it to none"
            in check_config(rl, world_size=1, cuda=False, stage="rl"))
    rl.model.moe, rl.parallel.pp, rl.data.global_batch_size = MoEConfig(num_experts=4), 2, 16
    assert any(e.startswith("rl with a MoE model needs parallel.pp=1") for e in check_config(rl, 2, cuda=False, stage="rl"))


def _router_grads(rank, world_size, aux):
    """One forward-backward of a single-process MoE model; the router's gradients, and what the
    aux loss should add to them by hand (megatron-core's Switch loss of every layer)."""
    from megarl.models.layout import unwrap
    from megarl.roles.role import Role
    from megarl.runtime.distributed import init_distributed, teardown

    init_distributed(1, 1, seed=11)
    from megarl.config import OptimConfig
    role = Role("policy", _model(aux_loss_coeff=aux), _parallel(), optim=OptimConfig(), seed=5)
    gpt = unwrap(role.model)
    inputs = []
    hooks = [layer.mlp.router.register_forward_hook(lambda m, a, out: inputs.append(a[0].detach()))
             for layer in gpt.decoder.layers]
    for c in role.chunks:
        c.zero_grad_buffer()
    mbs = dp_microbatches(_global_batch(0), MBS)
    role.forward_backward(mbs, _lm_loss)
    for h in hooks:
        h.remove()
    grads = [layer.mlp.router.weight.main_grad.clone() for layer in gpt.decoder.layers]
    # d(coeff * switch_loss * tokens_in_micro_batch) / d(router weight), divided by the loss tokens
    weights = [layer.mlp.router.weight.detach().clone().requires_grad_() for layer in gpt.decoder.layers]
    total = 0.0
    for i, x in enumerate(inputs):
        x = x.reshape(-1, x.shape[-1]).double()
        logits = x @ weights[i % len(weights)].double().t()
        scores = torch.softmax(logits, -1)
        topk = torch.zeros_like(scores).scatter(1, scores.topk(2, dim=1).indices, 1)
        n, e = scores.shape
        switch = e * (topk.sum(0) / (n * 2) * scores.sum(0) / n).sum()
        total = total + aux * switch * n
    count = sum(mb["loss_mask"].sum() for mb in mbs)
    expected = torch.autograd.grad(total / count, weights) if aux else None
    teardown()
    return grads, expected


def _parallel(**kw):
    from megarl.config import ParallelConfig

    return ParallelConfig(**kw)


def test_aux_loss_enters_the_gradient():
    """megatron-core attaches the load-balancing loss to the router's probabilities
    (MoEAuxLossAutoScaler); through megarl's Role and loss path its gradient must be the
    hand-computed Switch loss's, scaled as megatron scales it under per-token losses."""
    without, _ = run_distributed(_router_grads, 1, 0.0)[0]
    with_aux, expected = run_distributed(_router_grads, 1, 0.5)[0]
    added = [(a - b).double() for a, b in zip(with_aux, without, strict=True)]
    assert all(a.abs().max() > 1e-4 for a in added)
    # the last layer's router sees its own aux loss only (earlier ones also the later layers', through
    # their inputs); the forward is the same, so the LM loss's part cancels
    torch.testing.assert_close(added[-1], expected[-1].double(), rtol=1e-4, atol=1e-8)


def _train(rank, world_size, tp, pp, ep):
    from megarl.config import LRScheduleConfig, OptimConfig
    from megarl.models.layout import gather_full_state_dict
    from megarl.roles.role import Role
    from megarl.runtime.distributed import init_distributed, teardown

    init_distributed(tp, pp, seed=11, ep=ep)
    optim = OptimConfig(lr=3e-3, weight_decay=0.1, clip_grad=0.5, eps=1e-4)
    lm = Role("policy", _model(), _parallel(tp=tp, pp=pp, ep=ep), optim=optim,
              schedule=LRScheduleConfig(style="cosine", warmup_steps=1), train_steps=4, seed=5)
    out = {"grads": full_gradients(lm, dp_microbatches(_global_batch(0), MBS), _lm_loss, VOCAB),
           "loss": [], "grad_norm": []}
    for step in range(2):
        r = lm.train_step(dp_microbatches(_global_batch(step), MBS), _lm_loss)
        out["loss"].append(r.metrics["loss"])
        out["grad_norm"].append(r.grad_norm)
    out["eval_loss"] = lm.evaluate(dp_microbatches(_global_batch(0), MBS), _lm_loss)["loss"]  # after training on it
    out["params"] = gather_full_state_dict(lm.model, VOCAB)
    teardown()
    return out


def _close(a, b, what):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    err, scale = (a - b).abs().max().item(), b.abs().max().item()
    assert err <= 1e-5 * scale, f"{what}: max abs diff {err:.3g} exceeds 1e-5 x {scale:.3g}"


@pytest.mark.slow
def test_expert_parallel_matches_single_process():
    ref = run_distributed(_train, 1, 1, 1, 1)[0]
    assert {f"decoder.layers.1.mlp.experts.local_experts.{i}.linear_fc1.weight" for i in range(4)} <= ref["params"].keys()
    assert ref["eval_loss"] < ref["loss"][0] - 0.05  # it trained
    for world, (tp, pp, ep) in ((2, (1, 1, 2)), (4, (1, 2, 2))):
        got = run_distributed(_train, world, tp, pp, ep)[0]
        where = f"tp={tp} pp={pp} ep={ep} world={world}"
        for key in ("loss", "grad_norm", "eval_loss"):
            _close(got[key], ref[key], f"{key} at {where}")
        for which in ("grads", "params"):
            assert got[which].keys() == ref[which].keys()
            for name, r in ref[which].items():
                _close(got[which][name], r, f"{which}[{name}] at {where}")


def test_recipes_validate_and_the_memory_estimate_counts_experts():
    """The shipped MoE recipes pass the config rules at their layouts; the estimator's parameter
    count of Qwen3-30B-A3B is transformers' (30,532,122,624 on the meta device), its experts
    split over EP, and the 2 x 8 H100 recipe fits an 80 GB GPU by its own estimate."""
    from megarl.config import check_config, load_config
    from megarl.config.fp8 import TARGETS
    from megarl.models import memory

    tiny = load_config("configs/tiny_moe_grpo.yaml")
    assert check_config(tiny, world_size=2, cuda=False, stage="rl") == []
    assert tiny.parallel.ep == 2 and tiny.rl.routing_replay == "rollout"
    big = load_config("configs/qwen3_30b_a3b_grpo.yaml")
    assert check_config(big, world_size=16, stage="rl", device=TARGETS["h100"]) == []
    full = memory.stage_params(big.model, 1, 1)
    assert full.total == 30_532_122_624
    split = memory.stage_params(big.model, 1, 1, ep=16)
    assert split.expert * 16 == full.expert and split.total - split.expert == full.total - full.expert
    estimate = memory.estimate(big, 16, "rl", ["actor", "reference"])
    assert estimate.peak <= TARGETS["h100"].memory_bytes < memory.estimate(
        load_config("configs/qwen3_30b_a3b_grpo.yaml", ["parallel.ep=8"]), 16, "rl", ["actor", "reference"]).peak


def _bias_body(rank, world_size):
    from megarl.config import OptimConfig
    from megarl.models.layout import unwrap
    from megarl.roles.role import Role
    from megarl.runtime.distributed import init_distributed, teardown

    init_distributed(1, 1, seed=11)
    role = Role("policy", _model(score="sigmoid", bias_update_rate=0.01, aux_loss_coeff=0.0), _parallel(),
                optim=OptimConfig(), seed=5)
    routers = [layer.mlp.router for layer in unwrap(role.model).decoder.layers]
    counts = [torch.zeros(4) for _ in routers]
    def count(i):
        def hook(module, args, out):  # out: (probs, routing_map [tokens, experts])
            counts[i].add_(out[1].sum(0).float())
        return hook

    for i, r in enumerate(routers):
        r.register_forward_hook(count(i))
    before = [r.expert_bias.clone() for r in routers]
    role.train_step(dp_microbatches(_global_batch(0), MBS), _lm_loss)
    out = [(b, r.expert_bias.clone(), c) for b, r, c in zip(before, routers, counts)]
    teardown()
    return out


def test_aux_loss_free_bias_moves_towards_balance():
    """model.moe.bias_update_rate: after an optimizer step megatron-core moves each expert's
    routing bias by the rate towards balance (down for experts above the mean load)."""
    for before, after, load in run_distributed(_bias_body, 1)[0]:
        assert torch.equal(before, torch.zeros(4)) and load.sum() == GBS * SEQ * 2
        torch.testing.assert_close(after, 0.01 * torch.sign(load.mean() - load))


def _ckpt_body(rank, world_size, ep, root, save):
    from megarl.checkpoint.distributed import (
        CheckpointError, latest_checkpoint, load_checkpoint, load_weights, save_checkpoint)
    from megarl.config import OptimConfig
    from megarl.models.layout import gather_full_state_dict
    from megarl.roles.role import Role
    from megarl.runtime.distributed import init_distributed, teardown

    init_distributed(1, 1, seed=11, ep=ep)
    role = Role("policy", _model(), _parallel(ep=ep), optim=OptimConfig(lr=3e-3, eps=1e-4), seed=5 if save else 99)
    out = {}
    if save:
        role.train_step(dp_microbatches(_global_batch(0), MBS), _lm_loss)
        save_checkpoint(root, 1, {"policy": role}, {})
    else:
        try:
            load_checkpoint(latest_checkpoint(root), {"policy": role})
        except CheckpointError as e:
            out["resume_error"] = str(e)
        load_weights(latest_checkpoint(root), role)
    out["loaded"] = gather_full_state_dict(role.model, VOCAB)
    teardown()
    return out


@pytest.mark.slow
def test_checkpoint_saved_at_ep2_loads_at_ep1(tmp_path):
    """Experts saved at EP2 x DP2 load into one process bit-exact (model.init_from) and resume at
    EP2; resuming the
    optimizer state across ep=1 and ep>1 is refused in one line (megatron-core's optimizer
    layouts differ there)."""
    saved = run_distributed(_ckpt_body, 2, 2, str(tmp_path), True)[0]
    got = run_distributed(_ckpt_body, 1, 1, str(tmp_path), False)[0]
    assert "saved at parallel.ep=2, resumed at ep=1" in got["resume_error"]
    assert any("local_experts.3." in k for k in got["loaded"])
    again = run_distributed(_ckpt_body, 2, 2, str(tmp_path), False)[0]  # a resume at EP2: optimizer included
    assert "resume_error" not in again
    for k, v in saved["loaded"].items():
        assert torch.equal(got["loaded"][k], v) and torch.equal(again["loaded"][k], v), k
