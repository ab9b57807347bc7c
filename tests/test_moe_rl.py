"""Routing replay (rl.routing_replay): the experts each token went to in the rollout are forced
in the actor's training forward, with the router's own probabilities at those experts, and the
agreement metric when they are not."""
import os

import pytest
import torch

from dist_helpers import assert_same_figures, rl_stage_steps, run_distributed

HERE = os.path.dirname(__file__)
VOCAB, PAD = 100, 0


def _replay_body(rank, world_size):
    from megarl.algorithms.losses import masked_nll
    from megarl.config import MoEConfig, ModelConfig, OptimConfig, ParallelConfig
    from megarl.models import moe
    from megarl.models.layout import unwrap
    from megarl.roles.role import Role
    from megarl.rollout.engine import MegatronRolloutEngine, SamplingParams
    from megarl.runtime.distributed import init_distributed, teardown
    from megarl.trainers.common import token_logprobs
    from megarl.trainers.rl import experience_from_rollout

    init_distributed(1, 1, seed=11)
    mc = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, vocab_size=VOCAB,
                     max_position_embeddings=64, moe=MoEConfig(num_experts=8, topk=2, expert_hidden=24))
    actor = Role("actor", mc, ParallelConfig(), optim=OptimConfig(lr=1e-3), seed=5)
    engine = MegatronRolloutEngine(actor, vocab_size=VOCAB, pad_id=PAD, max_batch_size=4)
    engine.record_routing = True
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (4, 9, 6)]
    rollout = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=7,
                                                      stop_ids=tuple(range(1, 20))), seed=1)
    exp = experience_from_rollout(rollout, PAD)
    rows = list(range(len(exp.lengths)))

    def loss(batch, logits):
        return masked_nll(token_logprobs(logits, batch["labels"], VOCAB), batch["mask"])

    def run(replay):
        """Grads of the routers and the experts every router chose, [b, s, layers, k]."""
        mb = exp.microbatch(rows, routing=replay)
        for c in actor.chunks:
            c.zero_grad_buffer()
        with moe.recording(actor.model) as routers:
            actor.forward_backward([mb], loss)
        width = mb.tokens.shape[1]
        got = moe.recorded(routers).view(width, len(rows), len(routers), -1).transpose(0, 1)
        return [r.weight.main_grad.clone() for r in routers], got, exp.routing[:, :width].long()

    out = {"known": int((exp.routing >= 0).all(-1).sum()), "tokens": int(sum(exp.lengths)),
           "compactions": rollout.stats["compactions"], "lengths": rollout.response_lens.tolist()}
    natural_grads, natural, rolled = run(False)
    replay_grads, replayed, _ = run(True)
    out["unperturbed"] = (moe.agreement(natural, rolled), moe.agreement(replayed, rolled),
                          max((a - b).abs().max().item() for a, b in zip(natural_grads, replay_grads)),
                          min(a.abs().max().item() for a in replay_grads))
    with torch.no_grad():  # as after an update: training now routes some tokens elsewhere
        for p_name, p in unwrap(actor.model).named_parameters():
            if p_name.endswith("router.weight"):
                p.add_(torch.randn(p.shape, generator=g) * 0.5 * p.abs().mean())
    _, natural, _ = run(False)
    grads, replayed, _ = run(True)
    known = (rolled >= 0).all(-1)
    same = (replayed.sort(-1).values == rolled.sort(-1).values).all(-1)
    out["perturbed"] = (moe.agreement(natural, rolled), moe.agreement(replayed, rolled), bool(same[known].all()),
                        min(a.abs().max().item() for a in grads))
    teardown()
    return out


@pytest.mark.slow
def test_training_routes_as_the_rollout_did():
    r = run_distributed(_replay_body, 1)[0]
    assert r["compactions"] > 0 and len(set(r["lengths"])) > 1  # rows stopped apart and left the cache
    assert r["known"] == (r["tokens"] - 6) * 2  # every token but each row's last (never fed back), 2 layers
    (nat, n1), (rep, n2), grad_diff, grad = r["unperturbed"]
    assert n1 == n2 == r["known"] and nat == rep == n1  # same weights: the training forward routes as the rollout
    assert grad_diff < 1e-6 and grad > 1e-5  # replaying the router's own choice changes no gradient
    (nat, n), (rep, _), exact, grad = r["perturbed"]
    assert nat < 0.97 * n  # without replay some tokens now go to other experts
    assert rep == n and exact  # with replay every known token takes the rollout's experts
    assert grad > 1e-5  # and the routers still learn through the forced experts' probabilities


def _rl_body(rank, world_size, replay, run_dir, *extra):
    return rl_stage_steps([*RL, f"rl.routing_replay={replay}", *extra], run_dir)


RL = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.num_attention_heads=4",
      "model.num_kv_heads=2", "model.moe.num_experts=4", "model.moe.topk=2", "model.moe.expert_hidden=64",
      "model.moe.aux_loss_coeff=0.01", "tracking.backend=none", "roles.actor.init_from=random",
      "rl.prompts_per_step=4", "rl.samples_per_prompt=2", "rl.max_new_tokens=8", "rl.micro_batch_size=4",
      "rl.ppo_epochs=2", "rl.eval_prompts=0", "rl.eval_before_train=false", "rl.reward_fn=rl_rewards:digits",
      "optim.lr=1e-2", "lr_schedule.style=constant"]


@pytest.mark.slow
def test_rl_steps_with_and_without_replay(tmp_path, monkeypatch):
    """Without replay each step reports how many (token, layer) routings the actor's scoring
    forward shared with the rollout; with replay there is nothing to measure. At EP2 x DP2 the
    replayed steps equal the single process's."""
    monkeypatch.chdir(os.path.dirname(HERE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    off = run_distributed(_rl_body, 1, "none", tmp_path / "off")[0]
    on = run_distributed(_rl_body, 1, "rollout", tmp_path / "on")[0]
    for m in off:
        assert 0.9 < m["moe/routing_agreement"] <= 1.0
    assert all("moe/routing_agreement" not in m for m in on)
    assert all(torch.isfinite(torch.tensor(m["actor/loss"])) for m in on + off)
    ep2 = run_distributed(_rl_body, 2, "rollout", tmp_path / "ep2", "parallel.ep=2")[0]
    assert_same_figures(ep2, on, "ep2", clip_tol=2 / 16)  # rel 1e-5
