"""Bringing your own Hugging Face model: `model.from_hf` takes the model section from config.json,
pre-flight compares every field that changes the maths with the weights' config.json, the
importer keeps the tokenizer for the export, and the README's path from an HF directory to an
RL run (and back) runs as written. A tiny Qwen2 with a tokenizer of its own (hf_fixtures.py)
stands for the user's model; transformers is the reference for what its config.json means."""
import json
import shutil
import textwrap

import pytest

from megarl.config import ConfigError, load_config
from megarl.config.shipped import SHIPPED_DIR
from megarl_run import megarl

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from hf_fixtures import save_qwen2

    return save_qwen2(tmp_path_factory.mktemp("hf") / "qwen")


def _write(tmp_path, text, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


# --------------------------------------------------------------------------- model.from_hf


def test_from_hf_takes_the_model_section_from_config_json(qwen):
    """Over tiny_grpo's own (byte-level, 4-layer) model fields: every field is the checkpoint's,
    as transformers reads its config.json."""
    ref = transformers.AutoConfig.from_pretrained(qwen)
    m = load_config("configs/tiny_grpo.yaml", [f"model.from_hf={qwen}"]).model
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_kv_heads, m.vocab_size,
            m.max_position_embeddings, m.norm_eps, m.tie_embeddings) == (
        ref.num_hidden_layers, ref.hidden_size, ref.intermediate_size, ref.num_attention_heads,
        ref.num_key_value_heads, ref.vocab_size, ref.max_position_embeddings, ref.rms_norm_eps, ref.tie_word_embeddings)
    theta = ref.rope_parameters["rope_theta"] if hasattr(ref, "rope_parameters") else ref.rope_theta
    assert m.rotary_base == theta == 100000 and m.rope_scaling_factor is None
    assert m.qkv_bias and not m.qk_norm  # Qwen2's q/k/v projections carry a bias
    assert m.from_hf == str(qwen) and m.init_from is None
    # `megarl pipeline` (and megarl.Pipeline) reads it alike, in every stage
    from megarl.trainers.pipeline import load_pipeline_config

    stages = load_pipeline_config("configs/tiny_pipeline.yaml", [f"model.from_hf={qwen}"])
    assert all(c.model == m for c in stages.values())


@pytest.mark.parametrize("how", ["file", "override", "override before from_hf"])
def test_a_field_given_beside_from_hf_must_agree(qwen, tmp_path, how):
    if how == "file":
        path, overrides = _write(tmp_path, f"""
            extends: {SHIPPED_DIR}/tiny_sft.yaml
            model: {{from_hf: {qwen}, rotary_base: 10000, num_layers: 2}}
        """), []
    elif how == "override":
        path, overrides = _write(tmp_path, f"model: {{from_hf: {qwen}}}\n"), ["model.rotary_base=10000"]
    else:  # applied in either order: the override is not cleared by the from_hf after it
        path, overrides = "configs/tiny_sft.yaml", ["model.rotary_base=10000", f"model.from_hf={qwen}"]
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"model.from_hf: {qwen}/config.json has model.rotary_base=100000.0 (config: 10000.0);" in msg, msg
    assert "num_layers" not in msg  # the fields that agree are not named


def test_fields_that_agree_and_role_sections(qwen, tmp_path):
    path = _write(tmp_path, f"""
        model: {{from_hf: {qwen}, num_layers: 2, rotary_base: 100000, norm_eps: 1.0e-6, qkv_bias: true}}
        roles: {{actor: {{model: {{transformer_impl: local}}}}}}
    """)
    cfg = load_config(path)
    assert cfg.model.vocab_size == 320 and cfg.roles.actor.model.vocab_size == 320
    assert cfg.roles.actor.model.transformer_impl == "local" and cfg.roles.actor.model.rotary_base == 100000
    # a role section inherits from_hf: a field of its own that changes the maths is named with its key
    with pytest.raises(ConfigError, match=r"roles\.critic\.model\.from_hf: .* has roles\.critic\.model\."
                                          r"num_layers=2 \(config: 1\); .*roles\.critic\.model\.from_hf: null"):
        load_config(path, ["roles.critic.model.num_layers=1"])


def test_from_hf_not_on_this_machine_keeps_the_fields_as_written():
    """A login node without /models: the recipe's fields are validated as written, and pre-flight
    names the directory (the only error `megarl validate` gives there for it)."""
    from megarl.config import check_config
    from megarl.trainers.data_setup import preflight

    cfg = load_config("configs/llama31_8b_grpo.yaml")
    assert cfg.model.from_hf == "/models/Llama-3.1-8B-Instruct" and cfg.model.num_layers == 32
    assert check_config(cfg, world_size=8, cuda=True, stage="rl") == []
    assert "model.from_hf: /models/Llama-3.1-8B-Instruct does not exist (the model fields as written were checked)" \
        in preflight(cfg, "rl")


def test_from_hf_at_a_directory_that_is_not_a_model_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=rf"^config: model\.from_hf: {tmp_path}/config\.json: not found$"):
        load_config(None, [f"model.from_hf={tmp_path}"])
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match=r"^config: model\.from_hf: .*config\.json: unsupported architectures"):
        load_config(None, [f"model.from_hf={tmp_path}"])


# The published config.json files of the shipped recipes' models (transformers 4 keys).
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 128256}
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
    "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 152064}


def _recipes_with_models(tmp_path, llama=LLAMA31_8B, qwen=QWEN25_7B):
    """The shipped 8B/7B recipes with /models/... under tmp_path, each holding its config.json."""
    for name, config in (("Llama-3.1-8B-Instruct", llama), ("Qwen2.5-7B-Instruct", qwen)):
        (tmp_path / "models" / name).mkdir(parents=True)
        (tmp_path / "models" / name / "config.json").write_text(json.dumps(config))
    for f in ("llama31_8b_grpo", "llama31_8b_grpo_fp8", "llama31_8b_gsm8k_tools", "qwen25_7b_grpo",
              "qwen25_7b_grpo_fp8"):
        src = open(f"{SHIPPED_DIR}/{f}.yaml").read().replace("/models/", f"{tmp_path}/models/")
        (tmp_path / f"{f}.yaml").write_text(src)
    return tmp_path


@pytest.mark.parametrize("recipe", ["llama31_8b_grpo", "llama31_8b_grpo_fp8", "llama31_8b_gsm8k_tools",
                                    "qwen25_7b_grpo", "qwen25_7b_grpo_fp8"])
def test_shipped_recipes_agree_with_their_models_config_json(tmp_path, recipe):
    """Where /models is present, every model field a recipe writes is checked against the real
    config.json; the fields equal those of a recipe without from_hf (what validate checks offline)."""
    from megarl.config import check_config
    from megarl.config.fp8 import TARGETS

    d = _recipes_with_models(tmp_path)
    cfg = load_config(str(d / f"{recipe}.yaml"))
    offline = load_config(f"configs/{recipe}.yaml").model
    assert {k: v for k, v in vars(cfg.model).items() if k not in ("from_hf", "init_from")} == \
        {k: v for k, v in vars(offline).items() if k not in ("from_hf", "init_from")}
    assert check_config(cfg, world_size=8, stage="rl", device=TARGETS["h100"]) == []


def test_a_recipe_that_disagrees_with_config_json_is_named(tmp_path):
    d = _recipes_with_models(tmp_path, llama={**LLAMA31_8B, "rope_theta": 10000.0, "rms_norm_eps": 1e-6})
    with pytest.raises(ConfigError) as e:
        load_config(str(d / "llama31_8b_grpo_fp8.yaml"))
    assert "model.rotary_base=10000.0 (config: 500000.0), model.norm_eps=1e-06 (config: 1e-05)" in str(e.value)
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------- pre-flight


SHAPE = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.num_attention_heads=4",
         "model.num_kv_heads=2", "model.vocab_size=320", "model.max_position_embeddings=256", "model.rotary_base=100000",
         "model.norm_eps=1e-6", "model.qkv_bias=true", "model.tie_embeddings=false"]


@pytest.mark.parametrize("wrong,named", [
    ("model.rotary_base=10000", "model.rotary_base=100000.0 (config: 10000.0)"),
    ("model.norm_eps=1e-5", "model.norm_eps=1e-06 (config: 1e-05)"),
    ("model.rope_scaling_factor=8.0", "model.rope_scaling_factor=None (config: 8.0)"),
    ("model.max_position_embeddings=512", "model.max_position_embeddings=256 (config: 512)"),
    ("model.tie_embeddings=true", "model.tie_embeddings=False (config: True)"),
    ("model.qkv_bias=false", "model.qkv_bias=True (config: False)"),
])
@pytest.mark.parametrize("stage", ["sft", "rl"])
def test_preflight_names_each_field_that_changes_the_maths(qwen, tmp_path, capsys, wrong, named, stage):
    """Shapes alone let a wrong rotary_base (10000 against the checkpoint's 100000) load with
    wrong logits: every field that changes the maths is compared before a tensor is read."""
    from megarl.cli.main import main

    key = "model.init_from" if stage == "sft" else "roles.actor.init_from"
    rc = main(["validate", "--config", f"configs/tiny_{'sft' if stage == 'sft' else 'grpo'}.yaml", "--stage", stage,
               f"train.run_dir={tmp_path}", *SHAPE, wrong, f"{key}={qwen}"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip().splitlines() == [
        f"megarl: error: {key}: {qwen}: the saved model does not match the configured one: {named}; "
        f"use the model section it was saved with (model.from_hf: {qwen} reads it)"], err
    # the same model section, right: no error
    assert main(["validate", "--config", "configs/tiny_sft.yaml", "--stage", "sft", f"train.run_dir={tmp_path}",
                 *SHAPE, f"model.init_from={qwen}"]) == 0


# --------------------------------------------------------------------------- the tokenizer through convert


def test_import_keeps_the_tokenizer_and_its_export_writes_it(qwen, tmp_path):
    """hf-to-megarl copies the tokenizer into the checkpoint, so megarl-to-hf without --tokenizer
    writes the model's own tokenizer (not megarl's byte one), even once the HF directory is gone."""
    src = tmp_path / "src"
    shutil.copytree(qwen, src)
    ref = transformers.AutoTokenizer.from_pretrained(src)
    text = "What is 17 + 25? The answer is 42."
    ids = ref.encode(text, add_special_tokens=False)
    megarl(["convert", "hf-to-megarl", "--hf", str(src), "--out", str(tmp_path / "ck")])
    assert (tmp_path / "ck" / "tokenizer" / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    shutil.rmtree(src)
    out = tmp_path / "back"
    megarl(["convert", "megarl-to-hf", "--checkpoint", str(tmp_path / "ck"), "--out", str(out), "--arch", "qwen2"])
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.encode(text, add_special_tokens=False) == ids
    assert tok.eos_token == "<|im_end|>" and tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False) == ref.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False)
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == ref.eos_token_id == 2 and config["bos_token_id"] is None
    # the recorded copy gone: refused, naming the flag, nothing written
    shutil.rmtree(tmp_path / "ck" / "tokenizer")
    res = megarl(["convert", "megarl-to-hf", "--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "o"),
                  "--arch", "qwen2"], check=False)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "tokenizer.path" in res.stderr and "does not exist; pass --tokenizer DIR" in res.stderr
    assert not (tmp_path / "o").exists()


def test_export_of_an_import_without_a_tokenizer_names_the_flag(tmp_path):
    from hf_fixtures import save_qwen2

    src = save_qwen2(tmp_path / "bare", tokenizer=False)
    megarl(["convert", "hf-to-megarl", "--hf", str(src), "--out", str(tmp_path / "ck")])
    out = megarl(["convert", "megarl-to-hf", "--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "o"),
                  "--arch", "qwen2"], check=False)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "no tokenizer recorded" in lines[0] and "pass --tokenizer DIR" in lines[0], lines
    assert not (tmp_path / "o").exists()


# --------------------------------------------------------------------------- the README's path


def test_readme_path_from_an_hf_directory_to_rl_and_back(tmp_path):
    """The README's "Your own Hugging Face model" commands as written (test_docs_commands.py's
    placeholders and tiny step counts): GRPO starts from the HF weights with the model's own
    tokenizer, and the export is the same model with the same tokenizer."""
    from safetensors.torch import load_file

    import test_docs_commands as docs

    text = (docs.REPO / "README.md").read_text().split("## Your own Hugging Face model", 1)[1].split("\n## ", 1)[0]
    commands = [cmd for lang, first, lines in docs.code_blocks(text) if lang in docs.SHELL_LANGS
                for _, cmd in docs.block_commands(lines, first)]
    assert [c.split()[:2] for c in commands] == [["megarl", "rl"], ["megarl", "convert"]]
    (tmp_path / "configs").symlink_to(docs.REPO / "configs")
    docs._hf_qwen2(tmp_path)
    for cmd in commands:
        run = docs.COMMANDS[cmd][0]
        argv = docs.concrete(cmd) + list(run.extra)
        out = docs.execute(argv, tmp_path)
        assert out.returncode == 0 and "Traceback" not in out.stderr, (argv, out.stdout[-2000:], out.stderr[-2000:])
        assert run.prints in out.stdout + out.stderr
    src, back = tmp_path / "models" / "Qwen2-0.5B", tmp_path / "runs" / "qwen2_grpo" / "hf"
    a, b = load_file(src / "model.safetensors"), load_file(back / "model.safetensors")
    assert a.keys() == b.keys()
    moved = max((a[k] - b[k]).abs().max().item() for k in a)
    assert moved < 1e-2, f"the run did not start from the HF weights (max change {moved})"
    assert (back / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    assert json.loads((back / "config.json").read_text())["eos_token_id"] == 2
