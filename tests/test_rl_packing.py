"""Packed rows in RL scoring and training (issue 25, rl.packing): each micro-batch's rows as one
[1, T] sequence with per-row positions and attention within rows, no padding, the head on the
response columns only. An RL step (PPO: actor, reference, critic, reward model) equals the padded
one within fp32 rounding, at TP1, TP2 and PP2, with zero padding waste."""
import os

import pytest

from dist_helpers import assert_same_figures, rl_stage_steps, run_distributed

HERE = os.path.dirname(__file__)
RL = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.num_attention_heads=4",
      "model.num_kv_heads=2", "tracking.backend=none", "roles.actor.init_from=random",
      "roles.reference.init_from=random", "roles.critic.init_from=random", "roles.reward.init_from=random",
      "rl.algorithm=ppo", "rl.prompts_per_step=4", "rl.samples_per_prompt=2", "rl.max_new_tokens=8",
      "rl.micro_batch_size=3", "rl.mini_batches=2", "rl.kl_coef=0.05", "rl.kl_in=reward", "rl.reward_model_coef=0.5",
      "rl.reward_fn=rl_rewards:digits", "rl.value_clip=null", "rl.entropy_coef=0.01", "optim.lr=1e-3",
      "lr_schedule.style=constant"]


def _body(rank, world_size, overrides, run_dir):
    return rl_stage_steps([*RL, *overrides], run_dir)


@pytest.mark.slow
def test_packed_rl_steps_equal_padded_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(os.path.dirname(HERE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    ref = run_distributed(_body, 1, [], tmp_path / "padded")[0]
    assert ref[0]["train/padding_waste"] > 0
    for name, extra, world in (("tp1", [], 1), ("tp2", ["parallel.tp=2"], 2), ("pp2", ["parallel.pp=2"], 2)):
        got = run_distributed(_body, world, ["rl.packing=true", *extra], tmp_path / name)[0]
        assert all(r["train/padding_waste"] == 0.0 for r in got)
        # losses near 0 (advantages whitened to mean 0) get an absolute tolerance
        assert_same_figures(got, ref, name, clip_tol=2 / 32, rel=1e-4, abs_=1e-5)


def test_packing_is_refused_where_megarls_attention_does_not_run():
    from megarl.config import check_config, load_config

    cfg = load_config("configs/tiny_grpo.yaml", ["rl.packing=true", "model.transformer_impl=transformer_engine"])
    assert any("rl.packing packs rows for megarl's own attention" in e for e in check_config(cfg, 1, stage="rl"))


def test_packed_plan_counts_tokens_not_padding():
    from megarl.trainers.common import plan_microbatches

    lengths = [30, 10, 10, 10, 25]
    assert plan_microbatches(lengths, max_rows=8, max_tokens=60) == [[0, 4], [1, 2, 3]]  # 2 x 30 padded
    assert plan_microbatches(lengths, max_rows=8, max_tokens=60, packed=True) == [[0, 4], [1, 2, 3]]
    assert plan_microbatches(lengths, max_rows=8, max_tokens=70, packed=True) == [[0, 4, 1], [2, 3]]
