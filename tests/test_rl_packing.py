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


def _experience(prompt_lens, response_lens, seed=0):
    """An Experience of rows with the given prompt lengths (rows with equal prompt lengths share
    one random prompt) and responses of random tokens."""
    import torch

    from megarl.trainers.rl import Experience

    g = torch.Generator().manual_seed(seed)
    prompts = {p: torch.randint(3, 500, (p,), generator=g) for p in set(prompt_lens)}
    rows = [torch.cat([prompts[p], torch.randint(3, 500, (r,), generator=g)]) for p, r in zip(prompt_lens, response_lens)]
    width = max(len(x) for x in rows) + 1
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    for i, x in enumerate(rows):
        tokens[i, :len(x)] = x
    labels = torch.zeros_like(tokens)
    labels[:, :-1] = tokens[:, 1:]
    plens, lengths = torch.tensor(prompt_lens), [len(x) for x in rows]
    cols = torch.arange(width)
    mask = (cols >= plens[:, None] - 1) & (cols < torch.tensor(lengths)[:, None] - 1)
    n = len(rows)
    exp = Experience(tokens, labels, mask, plens, lengths, torch.ones(n, dtype=torch.bool),
                     torch.randn(tokens.shape, generator=g), torch.randn(n, generator=g))
    exp.advantages = torch.randn(tokens.shape, generator=g)
    return exp


def test_shared_prompt_micro_batch_holds_each_prompt_once():
    """Experience.packed_microbatch(share_prompts=True): a prompt's rows hold it once, each
    response continues it at the positions after it, the head reads the prompt's last column
    once per row; the per-token fields (and unpack) are those of the unshared micro-batch. A
    prompt with one row in the micro-batch, and a row without response tokens, are handled."""
    import torch

    exp = _experience([4, 4, 6, 4, 6, 5], [3, 5, 2, 0, 4, 3])
    assert exp.prompt_ids() == [0, 0, 2, 0, 2, 5]
    rows = [3, 0, 2, 1, 4, 5]
    plain, shared = exp.packed_microbatch(rows), exp.packed_microbatch(rows, share_prompts=True)
    for key in ("labels", "mask", "advantages"):
        assert torch.equal(plain[key], shared[key])
    assert all(torch.equal(a, b) for a, b in zip(plain.unpack, shared.unpack))
    p4, p6 = exp.tokens[0, :4], exp.tokens[2, :6]
    r = [exp.tokens[i, exp.prompt_lens[i]:exp.lengths[i]] for i in range(6)]
    want = torch.cat([p4, r[3], r[0], r[1], p6, r[2], r[4], exp.tokens[5, :exp.lengths[5]]])  # row 3 has none
    assert torch.equal(shared.tokens[0], want)
    params = shared.packed_seq_params
    assert params.cu_seqlens_q.tolist() == [0, 4, 7, 12, 18, 20, 24, 32]
    assert params.prefix_of.tolist() == [-1, 0, 0, -1, 3, 3, -1]
    assert shared.position_ids[0].tolist() == [*range(4), *range(4, 7), *range(4, 9), *range(6), *range(6, 8),
                                                 *range(6, 10), *range(8)]
    # every row's head columns read the tokens its unshared columns read: same predicted labels
    got = shared.tokens[0][shared.output_index]
    assert torch.equal(got, plain.tokens[0][plain.output_index])
    assert shared.output_index.tolist().count(3) == 3  # the 4-token prompt's last column, rows 3, 0, 1


def test_shared_prompt_plan_keeps_a_prompts_rows_together_and_counts_it_once():
    from megarl.trainers.common import plan_microbatches

    # two prompts of 20 tokens (rows 0-3, 4-5), one of 10 (row 6); responses of 5-15 tokens
    lengths = [30, 25, 35, 28, 40, 22, 15]
    prompts = [(0, 20)] * 4 + [(4, 20)] * 2 + [(6, 10)]
    plan = plan_microbatches(lengths, max_rows=8, max_tokens=80, packed=True, prompts=prompts)
    assert plan == [[0, 1, 2, 3], [4, 5, 6]]  # 20 + 10 + 5 + 15 + 8 = 58 and 20 + 20 + 2 + 15 = 57
    assert plan_microbatches(lengths, max_rows=8, max_tokens=80, packed=True) == [[4, 2], [0, 3], [1, 5, 6]]
    # a prompt's rows beyond max_tokens or max_rows on their own are split, still sharing within
    assert plan_microbatches(lengths, max_rows=8, max_tokens=40, packed=True, prompts=prompts) == \
        [[4], [0, 1], [2], [3], [5, 6]]
    assert plan_microbatches(lengths, max_rows=3, max_tokens=80, packed=True, prompts=prompts) == \
        [[0, 1, 2], [4, 5, 3], [6]]
    assert sorted(sum(plan, [])) == list(range(7))


@pytest.mark.slow
def test_shared_prompt_rl_steps_equal_padded_ones(tmp_path, monkeypatch):
    """PPO steps whose micro-batches hold all 4 samples of a prompt once (rl.share_prompts, the
    default with packing) equal the padded steps, at TP1 and PP2, with fixed micro-batches and
    with a token budget."""
    monkeypatch.chdir(os.path.dirname(HERE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    common = ["rl.samples_per_prompt=4", "rl.prompts_per_step=2", "rl.mini_batches=1", "rl.micro_batch_size=4"]
    ref = run_distributed(_body, 1, common, tmp_path / "padded")[0]
    for name, extra, world in (("tp1", [], 1), ("pp2, budget", ["parallel.pp=2", "rl.max_tokens_per_micro_batch=160"], 2)):
        got = run_distributed(_body, world, [*common, "rl.packing=true", *extra], tmp_path / name.replace(", ", "_"))[0]
        assert all(r["train/shared_prompt_fraction"] > 0.2 for r in got), [r["train/shared_prompt_fraction"] for r in got]
        assert all(r["train/padding_waste"] == 0.0 for r in got)
        assert_same_figures(got, ref, name, clip_tol=2 / 32, rel=1e-4, abs_=1e-5)
