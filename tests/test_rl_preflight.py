"""The RL and eval inputs checked before anything is written (issue 27: evaluation files that were
silently ignored without a train file, reward functions found missing only after every role was
built): one line each, and no run dir, config or MLflow run left behind."""
import json
import os

import pytest

from megarl.config import load_config
from megarl.trainers import data_setup
from megarl_run import megarl

EVAL_LINE = {"prompt": "What is 2 + 3?", "answer": "5"}


def _cfg(tmp_path, config="configs/tiny_grpo.yaml", *extra):
    return load_config(config, [f"train.run_dir={tmp_path / 'run'}", *extra])


@pytest.mark.parametrize("stage, config, key", [("rl", "configs/tiny_grpo.yaml", "rl.eval_prompts_path"),
                                                ("eval", "configs/tiny_grpo.yaml", "rl.eval_prompts_path"),
                                                ("sft", "configs/tiny_sft.yaml", "data.eval_path")])
def test_an_eval_file_that_does_not_exist_is_named_without_a_train_file(tmp_path, stage, config, key):
    errs = data_setup.preflight(_cfg(tmp_path, config, f"{key}={tmp_path}/missing.jsonl"), stage)
    assert f"{key}: {tmp_path}/missing.jsonl does not exist" in errs


def test_an_eval_file_without_a_train_file_is_the_one_evaluated(tmp_path):
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text(json.dumps(EVAL_LINE) + "\n")
    cfg = _cfg(tmp_path, "configs/tiny_grpo.yaml", f"rl.eval_prompts_path={held_out}")
    paths = data_setup.stage_paths(cfg, "rl")
    assert paths["eval"] == str(held_out)
    assert paths["train"] == os.path.join(str(tmp_path / "run"), "data", "train_prompts.jsonl")  # synthetic
    assert data_setup.stage_paths(cfg, "eval") == {"train": None, "eval": str(held_out)}
    # a train file without an eval file: no evaluation (not the synthetic held-out set)
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps(EVAL_LINE) + "\n")
    assert data_setup.stage_paths(_cfg(tmp_path, "configs/tiny_grpo.yaml", f"rl.prompts_path={train}"),
                                  "rl") == {"train": str(train), "eval": None}


@pytest.mark.parametrize("override, error", [
    ("rl.reward_fn=final_anwser", "rl.reward_fn: unknown reward function 'final_anwser'"),
    ("rl.reward_fn=no_such_module:score", "rl.reward_fn: reward function 'no_such_module:score': cannot import"),
    ("rl.eval_reward_fn=rl_rewards:missing", "rl.eval_reward_fn: reward function 'rl_rewards:missing': "
                                             "'rl_rewards' has no attribute 'missing'"),
])
def test_a_reward_function_that_does_not_load_is_one_line_before_anything_is_written(tmp_path, override, error):
    assert any(e.startswith(error) for e in data_setup.preflight(_cfg(tmp_path, "configs/tiny_grpo.yaml", override),
                                                                 "rl"))
    out = megarl(["rl", "--config", "configs/tiny_grpo.yaml", f"train.run_dir={tmp_path / 'cli'}",
                  "roles.actor.init_from=random", "tracking.backend=none", override], check=False)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and error.split(": ", 1)[1][:30] in lines[0], out.stderr
    assert not (tmp_path / "cli").exists()
    validate = megarl(["validate", "--config", "configs/tiny_grpo.yaml", "--stage", "rl",
                       f"train.run_dir={tmp_path / 'cli'}", "roles.actor.init_from=random", override], check=False)
    assert validate.returncode == 2 and error.split(": ", 1)[1][:30] in validate.stderr + validate.stdout


LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 261,
         "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
         "tie_word_embeddings": False}


@pytest.mark.parametrize("what", ["other_size", "unsupported", "scalar_head"])
def test_a_role_source_that_does_not_fit_is_one_line_naming_its_key(tmp_path, what):
    """Issue 27.5/27.10: HF weights of another size, an architecture megarl does not read, a
    reward model's checkpoint as the actor: named with roles.actor.init_from before anything
    is written (the load used to raise from the layout loader or name model.init_from)."""
    src = tmp_path / "src"
    src.mkdir()
    if what == "scalar_head":
        step = src / "step_00000010"
        step.mkdir()
        (src / "latest").write_text("step_00000010")
        (step / "megarl_manifest.json").write_text(json.dumps({"roles": ["reward_model"], "models": {}}))
    else:
        config = dict(LLAMA, architectures=["GPT2LMHeadModel"]) if what == "unsupported" else LLAMA
        (src / "config.json").write_text(json.dumps(config))
    cfg = _cfg(tmp_path, "configs/tiny_grpo.yaml", f"roles.actor.init_from={src}")
    errs = data_setup.preflight(cfg, "rl")
    want = {"other_size": "the saved model does not match the configured one: model.num_layers=2 (config: 4)",
            "unsupported": "unsupported architectures ['GPT2LMHeadModel']",
            "scalar_head": "holds a scalar-head model (reward_model); the actor needs a language model"}[what]
    assert any(e.startswith("roles.actor.init_from: ") and want in e for e in errs), errs
    if what == "other_size":  # the SFT stage's model.init_from alike
        sft = _cfg(tmp_path, "configs/tiny_sft.yaml", f"model.init_from={src}")
        assert any(e.startswith("model.init_from: ") and want in e for e in data_setup.preflight(sft, "sft"))
