"""The policy loss inside the fused output layer (ops.head_token_loss, rl.fused_head=true):
RL steps with every term of the loss (clip-higher, dual clip, entropy bonus, KL to the
reference as a loss term, a per-sequence aggregation) equal the logits path's (rl.fused_head=
false: [tokens, V] logits, the loss outside) within fp32 rounding, padded and packed."""
import os

import pytest

from dist_helpers import assert_same_figures, rl_stage_steps, run_distributed

HERE = os.path.dirname(__file__)
RL = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.num_attention_heads=4",
      "model.num_kv_heads=2", "tracking.backend=none", "roles.actor.init_from=random",
      "roles.reference.init_from=random", "rl.prompts_per_step=4", "rl.samples_per_prompt=2",
      "rl.max_new_tokens=8", "rl.micro_batch_size=3", "rl.mini_batches=2", "rl.kl_coef=0.05", "rl.kl_in=loss",
      "rl.entropy_coef=0.01", "rl.dual_clip=3.0", "rl.loss_agg=seq-mean-token-mean", "rl.eval_prompts=0",
      "rl.eval_before_train=false", "rl.reward_fn=rl_rewards:digits", "optim.lr=1e-3", "lr_schedule.style=constant"]


def _body(rank, world_size, overrides, run_dir):
    """The figures of two steps, and how many micro-batches took the loss inside the head."""
    from megarl.trainers import rl

    calls, real = [], rl.head_token_loss
    rl.head_token_loss = lambda *a, **k: calls.append(1) or real(*a, **k)
    return rl_stage_steps([*RL, *overrides], run_dir), len(calls)


@pytest.mark.slow
def test_policy_loss_inside_the_head_equals_the_logits_path(tmp_path, monkeypatch):
    monkeypatch.chdir(os.path.dirname(HERE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    ref, calls = run_distributed(_body, 1, ["rl.fused_head=false"], tmp_path / "logits")[0]
    assert calls == 0
    for name, extra in (("fused", []),):
        got, calls = run_distributed(_body, 1, ["rl.fused_head=true", *extra], tmp_path / name.replace(", ", "_"))[0]
        assert calls >= 4  # 2 steps x 2 mini-batches, at least a micro-batch each
        assert any(r["reward/mean"] != 0 for r in got)  # advantages that move the policy
        assert_same_figures(got, ref, name, clip_tol=2 / 16, rel=1e-4, abs_=1e-5)
