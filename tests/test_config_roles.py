"""Role sections inherit the top-level ones field by field (roles.<name>.optim.lr=... changes
only the lr), and role_config() resolves unset sections, precision and init source."""
import textwrap

import pytest

from megarl.config import ConfigError, load_config
from megarl.config.schema import role_config


def _write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_partial_role_optim_override_keeps_top_level_values(tmp_path):
    path = _write(tmp_path, """
        optim: {lr: 2.0e-4, weight_decay: 0.1, beta2: 0.99, clip_grad: 0.5}
        train: {precision: bf16}
    """)
    cfg = load_config(path, ["roles.critic.optim.lr=1e-5"])
    critic, actor = role_config(cfg, "critic"), role_config(cfg, "actor")
    assert critic.optim.lr == 1e-5
    # every other value is the top-level one as written (not the schema default 0.0 / 0.95 / 1.0)
    assert (critic.optim.weight_decay, critic.optim.beta2, critic.optim.clip_grad) == (0.1, 0.99, 0.5)
    assert actor.optim.lr == 2e-4 and actor.optim is cfg.optim
    assert critic.precision == actor.precision == "bf16"


def test_partial_role_model_and_schedule_in_yaml(tmp_path):
    path = _write(tmp_path, """
        model: {num_layers: 4, hidden_size: 96, num_attention_heads: 6}
        lr_schedule: {style: constant, warmup_steps: 7}
        roles:
          reward: {model: {num_layers: 2}, precision: fp32, init_from: /ckpt/rm}
          critic: {lr_schedule: {warmup_steps: 0}}
    """)
    cfg = load_config(path)
    reward = role_config(cfg, "reward")
    assert (reward.model.num_layers, reward.model.hidden_size, reward.model.num_attention_heads) == (2, 96, 6)
    assert reward.init_from == "/ckpt/rm" and reward.precision == "fp32"
    critic = role_config(cfg, "critic")
    assert (critic.lr_schedule.style, critic.lr_schedule.warmup_steps) == ("constant", 0)
    assert critic.model is cfg.model and critic.init_from == "reward_model"
    assert role_config(cfg, "actor").init_from == role_config(cfg, "reference").init_from == "sft"


def test_override_of_top_level_reaches_role_sections_set_in_part(tmp_path):
    path = _write(tmp_path, """
        roles: {actor: {optim: {lr: 1.0e-6}}}
    """)
    cfg = load_config(path, ["optim.weight_decay=0.05"])
    assert role_config(cfg, "actor").optim.weight_decay == 0.05
    assert role_config(cfg, "actor").optim.lr == 1e-6


def test_bad_role_key_is_one_line_error(tmp_path):
    path = _write(tmp_path, """
        roles: {critic: {optim: {lrr: 1.0e-5}}}
    """)
    with pytest.raises(ConfigError, match=r"unknown key 'roles.critic.optim.lrr'.*did you mean 'roles.critic.optim.lr'"):
        load_config(path)


@pytest.mark.parametrize("recipe", ["llama31_8b_grpo", "qwen25_7b_grpo"])
def test_8_gpu_grpo_recipes_validate(recipe):
    from megarl.config import check_config

    cfg = load_config(f"configs/{recipe}.yaml")
    assert check_config(cfg, world_size=8, cuda=True, stage="rl") == []
    assert cfg.rl.algorithm == "grpo" and cfg.model.num_layers in (28, 32)


@pytest.mark.parametrize("recipe", ["tiny_grpo", "tiny_ppo", "tiny_rloo", "tiny_reinforce"])
def test_tiny_rl_recipes_validate(recipe):
    from megarl.config import check_config

    assert check_config(load_config(f"configs/{recipe}.yaml"), world_size=1, cuda=False, stage="rl") == []


def test_rl_rules_name_each_bad_key():
    from megarl.config import check_config

    cfg = load_config(None, ["rl.prompts_per_step=6", "rl.algorithm=grpo", "rl.samples_per_prompt=1",
                             "rl.max_prompt_len=500", "rl.dual_clip=0.5", "rl.reward_fn=null"])
    errs = check_config(cfg, world_size=4, cuda=False, stage="rl")
    text = "\n".join(errs)
    assert "rl.prompts_per_step (6) must be divisible by the data-parallel size (4)" in text
    assert "rl.samples_per_prompt must be >= 2" in text
    assert "exceeds the actor's max_position_embeddings (512)" in text
    assert "rl.dual_clip must be > 1" in text
    assert "no reward" in text
    assert check_config(cfg, world_size=4, cuda=False) == [] or "rl." not in "\n".join(check_config(cfg, 4, False))


def test_eval_temperature_zero_is_greedy_evaluation():
    from megarl.config import check_config
    from megarl.trainers.evaluate import eval_sampling

    cfg = load_config("configs/tiny_grpo.yaml", ["rl.eval_temperature=0"])
    assert check_config(cfg, world_size=1, cuda=False, stage="rl") == []
    params = eval_sampling(cfg.rl, stop_ids=[2])
    assert params.greedy and params.temperature == 1.0 and params.n == cfg.rl.eval_samples and params.stop_ids == (2,)
    assert not eval_sampling(load_config("configs/tiny_grpo.yaml").rl, [2]).greedy
    bad = check_config(load_config("configs/tiny_grpo.yaml", ["rl.eval_temperature=-1", "rl.temperature=0"]),
                       world_size=1, cuda=False, stage="rl")
    assert "rl.eval_temperature must be >= 0 (0: greedy evaluation), got -1.0" in bad
    assert "rl.temperature must be > 0, got 0.0" in bad


def test_reference_starts_where_the_actor_starts():
    cfg = load_config(None, ["roles.actor.init_from=/models/llama"])
    assert role_config(cfg, "reference").init_from == "/models/llama"
    cfg = load_config(None, ["roles.actor.init_from=/models/llama", "roles.reference.init_from=sft"])
    assert role_config(cfg, "reference").init_from == "sft"
