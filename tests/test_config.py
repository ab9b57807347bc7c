"""Config loading errors and cross-field validation: one test (case) per rule."""
import os

import pytest

from megarl.config import ConfigError, check_config, load_config, save_config
from megarl.config import validate as validate_mod

# ------------------------------------------------------------------------- loading errors


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_defaults_load_and_validate():
    cfg = load_config(None, [])
    assert check_config(cfg, world_size=1, cuda=False) == []


def test_unknown_key_suggests_closest(tmp_path):
    path = write(tmp_path, "c.yaml", "optim:\n  lrr: 0.1\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert "unknown key 'optim.lrr'" in msg and "did you mean 'optim.lr'" in msg and path in msg
    assert "\n" not in msg


def test_unknown_section_suggests_closest(tmp_path):
    path = write(tmp_path, "c.yaml", "paralel:\n  tp: 2\n")
    with pytest.raises(ConfigError, match=r"unknown key 'paralel' \(did you mean 'parallel'\?\)"):
        load_config(path)


@pytest.mark.parametrize("text,expect", [
    ("parallel:\n  tp: two\n", "'parallel.tp' expects an int; got str 'two'"),
    ("parallel:\n  tp: 2.5\n", "'parallel.tp' expects an int; got float 2.5"),
    ("parallel:\n  tp: true\n", "'parallel.tp' expects an int; got bool True"),
    ("optim:\n  lr: fast\n", "'optim.lr' expects a float; got str 'fast'"),
    ("data:\n  packing: 1\n", "'data.packing' expects a bool (true/false); got int 1"),
    ("train:\n  run_dir: 3\n", "'train.run_dir' expects a string; got int 3"),
    ("lr_schedule:\n  style: cosinus\n",
     "'lr_schedule.style' must be one of 'constant', 'linear', 'cosine', 'wsd'; got str 'cosinus'"),
    ("reward_model:\n  pooling: max\n", "'reward_model.pooling' must be one of 'last', 'mean'; got str 'max'"),
    ("model: 3\n", "'model' must be a mapping, got int 3"),
    ("roles:\n  actor:\n    model:\n      num_layers: x\n", "'roles.actor.model.num_layers' expects an int"),
])
def test_wrong_type_names_key_and_expected_type(tmp_path, text, expect):
    path = write(tmp_path, "c.yaml", text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert expect in str(e.value)


def test_int_accepted_for_float_and_null_for_optional(tmp_path):
    cfg = load_config(write(tmp_path, "c.yaml", "optim:\n  lr: 1\nmodel:\n  num_kv_heads: null\n"))
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float) and cfg.model.num_kv_heads is None


def test_missing_file():
    with pytest.raises(ConfigError, match=r"/nonexistent/x.yaml: config file not found"):
        load_config("/nonexistent/x.yaml")


def test_invalid_yaml_names_line(tmp_path):
    path = write(tmp_path, "c.yaml", "optim:\n  lr: 1\n  bad: [unclosed\n")
    with pytest.raises(ConfigError, match=rf"{path}:\d+: invalid YAML"):
        load_config(path)


def test_top_level_must_be_mapping(tmp_path):
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(write(tmp_path, "c.yaml", "- a\n- b\n"))


def test_extends_merges_and_child_wins(tmp_path):
    write(tmp_path, "base.yaml", "optim:\n  lr: 0.1\n  weight_decay: 0.2\nparallel:\n  tp: 2\n")
    child = write(tmp_path, "child.yaml", "extends: base.yaml\noptim:\n  lr: 0.5\n")
    cfg = load_config(child)
    assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.parallel.tp) == (0.5, 0.2, 2)


def test_extends_missing_base(tmp_path):
    child = write(tmp_path, "child.yaml", "extends: nope.yaml\n")
    with pytest.raises(ConfigError, match=r"nope.yaml: config file not found \(extended by .*child.yaml\)"):
        load_config(child)


def test_extends_cycle(tmp_path):
    write(tmp_path, "a.yaml", "extends: b.yaml\n")
    write(tmp_path, "b.yaml", "extends: a.yaml\n")
    with pytest.raises(ConfigError, match="'extends' cycle: a.yaml -> b.yaml -> a.yaml"):
        load_config(str(tmp_path / "a.yaml"))


def test_overrides_apply_with_yaml_values():
    cfg = load_config(None, ["optim.lr=1e-5", "parallel.tp=2", "data.packing=true", "model.num_kv_heads=null",
                             "train.run_dir=runs/x"])
    assert (cfg.optim.lr, cfg.parallel.tp, cfg.data.packing, cfg.model.num_kv_heads, cfg.train.run_dir) == \
        (1e-5, 2, True, None, "runs/x")


def test_override_into_optional_section():
    cfg = load_config(None, ["roles.critic.optim.lr=2e-6"])
    assert cfg.roles.critic.optim.lr == 2e-6 and cfg.roles.critic.optim.beta1 == 0.9


@pytest.mark.parametrize("override,expect", [
    ("optim.lr", "expected section.key=value"),
    ("=3", "expected section.key=value"),
    ("optim..lr=3", "expected section.key=value"),
    ("optim.lrr=3", "unknown key 'optim.lrr' (did you mean 'optim.lr'?)"),
    ("optim.lr.x=3", "'optim.lr' is a value, not a section"),
    ("optim.lr=[1", "value '[1' is not valid YAML"),
    ("optim.lr=abc", "'optim.lr' expects a float; got str 'abc'"),
])
def test_bad_override(override, expect):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert expect in str(e.value)


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["optim.lr=0.25", "roles.actor.offload.params=true"])
    save_config(cfg, str(tmp_path / "config.yaml"))
    assert load_config(str(tmp_path / "config.yaml")) == cfg
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


# --------------------------------------------------------------------- validation rules

RULES = [
    (["model.num_attention_heads=6", "model.num_kv_heads=2", "model.hidden_size=66", "model.ffn_hidden_size=32",
      "parallel.tp=4"], 4, "model.num_attention_heads (6) must be divisible by parallel.tp (4)"),
    (["model.num_kv_heads=1", "parallel.tp=2"], 2, "model.num_kv_heads (1) must be divisible by parallel.tp (2)"),
    (["model.num_kv_heads=3"], 1, "model.num_attention_heads (4) must be divisible by model.num_kv_heads (3)"),
    (["model.hidden_size=66"], 1, "model.hidden_size (66) must be divisible by model.num_attention_heads (4)"),
    (["model.head_dim=0"], 1, "model.head_dim must be >= 1 (or null for hidden_size / num_attention_heads), got 0"),
    (["model.ffn_hidden_size=175", "parallel.tp=2"], 2, "model.ffn_hidden_size (175) must be divisible by parallel.tp (2)"),
    (["model.num_layers=3", "parallel.pp=2"], 2, "model.num_layers (3) must be divisible by parallel.pp (2)"),
    (["parallel.tp=2", "parallel.pp=2"], 6, "world size 6 must be divisible by parallel.tp*pp*cp = 2*2*1 = 4"),
    (["parallel.dp=3"], 2, "parallel.dp (3) * tp*pp*cp (1) must equal the world size (2)"),
    (["data.global_batch_size=10", "data.micro_batch_size=4"], 1, "data.global_batch_size (10) must be divisible by data.micro_batch_size * dp = 4*1"),
    (["data.global_batch_size=8", "data.micro_batch_size=2"], 8, "data.global_batch_size (8) must be divisible by data.micro_batch_size * dp = 2*8"),
    (["data.seq_length=1024"], 1, "data.seq_length (1024) exceeds model.max_position_embeddings (512)"),
    (["parallel.sequence_parallel=true"], 1, "parallel.sequence_parallel needs parallel.tp > 1"),
    (["parallel.sequence_parallel=true", "parallel.tp=2"], 2, "parallel.sequence_parallel needs Transformer Engine's norms"),
    (["parallel.sequence_parallel=true", "parallel.tp=2", "data.seq_length=127"], 2, "data.seq_length (127) must be divisible by parallel.tp (2) with sequence_parallel"),
    (["parallel.cp=2", "data.seq_length=126"], 2, "data.seq_length (126) must be divisible by 2*parallel.cp (4)"),
    (["parallel.cp=2"], 2, "parallel.cp > 1 needs Transformer Engine attention on a GPU"),
    (["parallel.tp=0"], 1, "parallel.tp must be >= 1, got 0"),
    (["data.micro_batch_size=0"], 1, "data.micro_batch_size must be >= 1, got 0"),
    (["train.steps=0"], 1, "train.steps must be >= 1, got 0"),
    (["model.num_layers=0"], 1, "model.num_layers must be >= 1, got 0"),
    (["model.attention_dropout=1.5"], 1, "model.attention_dropout and hidden_dropout must be in [0, 1)"),
    (["model.transformer_impl=transformer_engine"], 1, "model.transformer_impl=transformer_engine needs Transformer Engine"),
    (["train.precision=fp16"], 1, "train.precision=fp16 needs a CUDA GPU"),
    (["train.fp8.format=e4m3"], 1, "train.fp8 needs Transformer Engine"),
    (["train.fp8.format=e4m3"], 1, "train.fp8 trains with bf16 weights; set train.precision=bf16"),
    (["train.eval_interval=-1"], 1, "train.eval_interval must be >= 0"),
    (["optim.lr=0"], 1, "optim.lr must be > 0"),
    (["optim.min_lr=0.1", "optim.lr=0.01"], 1, "optim.min_lr (0.1) must be in [0, optim.lr (0.01)]"),
    (["optim.beta2=1.0"], 1, "optim.beta1 and optim.beta2 must be in [0, 1)"),
    (["optim.clip_grad=-1"], 1, "optim.clip_grad and optim.weight_decay must be >= 0"),
    (["optim.fused=true"], 1, "optim.fused needs a GPU with Transformer Engine (its FusedAdam)"),
    (["lr_schedule.warmup_steps=50", "lr_schedule.decay_steps=50"], 1, "lr_schedule.warmup_steps (50) must be in [0, decay steps (50))"),
    (["lr_schedule.warmup_steps=10", "lr_schedule.decay_steps=5"], 1, "lr_schedule.warmup_steps (10) must be in [0, decay steps (5))"),
    (["lr_schedule.style=wsd", "lr_schedule.wsd_decay_steps=0"], 1, "lr_schedule.wsd_decay_steps (0) must be in [1, "),
    (["lr_schedule.style=wsd", "lr_schedule.warmup_steps=10", "train.steps=50", "lr_schedule.wsd_decay_steps=41"], 1,
     "lr_schedule.wsd_decay_steps (41) must be in [1, decay steps - warmup (40)]"),
    (["lr_schedule.wsd_decay_steps=10"], 1, "lr_schedule.wsd_decay_steps has no effect with lr_schedule.style=cosine"),
    (["data.num_workers=-1"], 1, "data.num_workers must be >= 0"),
    (["tokenizer.kind=hf"], 1, "tokenizer.kind=hf needs tokenizer.path"),
    (["checkpoint.keep_last=0"], 1, "checkpoint.keep_last must be >= 1"),
    (["launcher.backend=nccl"], 1, "launcher.backend=nccl needs CUDA GPUs"),
    (["reward_model.freeze_backbone=true", "parallel.pp=2", "model.num_layers=2"], 2, "reward_model.freeze_backbone needs parallel.pp=1"),
    (["roles.critic.model.num_layers=3", "parallel.pp=2", "model.num_layers=2"], 2,
     "roles.critic.model.num_layers (3) must be divisible by parallel.pp (2)"),
]


@pytest.mark.parametrize("overrides,world,expect", RULES, ids=[r[2][:60] for r in RULES])
def test_validation_rule(monkeypatch, overrides, world, expect):
    monkeypatch.setattr(validate_mod, "has_module", lambda name: False)  # no TE/apex/DALI here
    errs = check_config(load_config(None, overrides), world_size=world, cuda=False)
    assert any(expect in e for e in errs), errs
    assert all("\n" not in e for e in errs)


def test_a_run_shorter_than_its_warm_up_clamps_it_with_one_notice(monkeypatch, capsys):
    """`train.steps=5` on tiny_sft's 20-step warm-up runs (warm-up over 4 steps), with one notice
    per process; a decay_steps of the user's own stays a validation error."""
    from megarl.config import loader

    monkeypatch.setattr(validate_mod, "has_module", lambda name: False)
    monkeypatch.setattr(loader, "_NOTED", set())
    for _ in range(2):
        cfg = load_config("configs/tiny_sft.yaml", ["train.steps=5"])
        assert cfg.lr_schedule.warmup_steps == 4 and check_config(cfg, world_size=1, cuda=False) == []
    assert capsys.readouterr().err.splitlines() == [
        "megarl: note: lr_schedule.warmup_steps (20) is not below train.steps (5); warm-up clamped to 4 step(s)"]
    assert load_config("configs/tiny_sft.yaml", ["train.steps=21"]).lr_schedule.warmup_steps == 20
    cfg = load_config("configs/tiny_sft.yaml", ["train.steps=5", "lr_schedule.decay_steps=10"])
    assert cfg.lr_schedule.warmup_steps == 20 and check_config(cfg, world_size=1, cuda=False)


def test_dali_loader_without_dali(monkeypatch):
    monkeypatch.setattr(validate_mod, "has_module", lambda name: False)
    errs = check_config(load_config(None, ["data.loader=dali"]), world_size=1, cuda=False)
    assert errs == ["data.loader=dali needs NVIDIA DALI: install NVIDIA DALI: pip install 'megarl[dali]'"]


def test_all_violations_reported_together(monkeypatch):
    monkeypatch.setattr(validate_mod, "has_module", lambda name: False)
    cfg = load_config(None, ["model.num_layers=3", "parallel.pp=2", "data.seq_length=1024", "optim.lr=0"])
    with pytest.raises(ConfigError) as e:
        validate_mod.validate_config(cfg, world_size=2, cuda=False)
    lines = str(e.value).splitlines()
    assert lines[0] == "invalid config:" and len(lines) == 4


def test_valid_parallel_layouts_pass():
    for tp, pp, world in [(2, 1, 2), (1, 2, 2), (2, 2, 4), (1, 1, 4)]:
        cfg = load_config(None, [f"parallel.tp={tp}", f"parallel.pp={pp}", "data.global_batch_size=16"])
        assert check_config(cfg, world_size=world, cuda=False) == [], (tp, pp, world)


def test_distributed_optimizer_accepted_on_cpu(monkeypatch):
    """ZeRO-1 over DP runs on gloo with torch Adam (tests/test_distributed_optimizer.py trains it)."""
    monkeypatch.setattr(validate_mod, "has_module", lambda name: False)  # no TE/apex
    for world in (1, 2, 4):
        cfg = load_config(None, ["parallel.distributed_optimizer=true", "train.precision=bf16", "data.global_batch_size=16"])
        assert check_config(cfg, world_size=world, cuda=False) == [], world


def test_wsd_schedule_warms_up_holds_then_decays_linearly():
    """lr_schedule.style=wsd: linear warm-up, the peak lr, then the last wsd_decay_steps (default
    the last 20% after warm-up) linear to optim.min_lr, through megatron's scheduler."""
    from megarl.config.schema import LRScheduleConfig, OptimConfig
    from megarl.optim import build_scheduler

    class Groups:
        def __init__(self):
            self.param_groups = [{"lr": 0.0, "weight_decay": 0.0}]

    def lrs(schedule, steps):
        sched = build_scheduler(Groups(), OptimConfig(lr=1e-3, min_lr=1e-5), schedule, steps)
        out = []
        for _ in range(steps):
            sched.step(1)
            out.append(sched.optimizer.param_groups[0]["lr"])
        return out

    got = lrs(LRScheduleConfig(style="wsd", warmup_steps=10, wsd_decay_steps=30), 100)
    assert got[4] == pytest.approx(5e-4) and got[9] == pytest.approx(1e-3)
    assert all(x == pytest.approx(1e-3) for x in got[9:70])
    for step in range(71, 101):  # step s (1-based) of the 30 decay steps: linear from 1e-3 to 1e-5
        assert got[step - 1] == pytest.approx(1e-5 + (1e-3 - 1e-5) * (1 - (step - 70) / 30))
    default = lrs(LRScheduleConfig(style="wsd", warmup_steps=0), 100)
    assert default[79] == pytest.approx(1e-3) and default[80] < 1e-3 and default[-1] == pytest.approx(1e-5)


def test_every_config_and_input_problem_is_reported_in_one_pass(tmp_path, capsys):
    """A missing data file with a bad key, or with a broken rule: one error, one line each
    (before: the first problem only, the next after it was fixed)."""
    from megarl.cli.main import main

    missing = tmp_path / "train.jsonl"
    base = ["--config", "configs/tiny_sft.yaml", f"train.run_dir={tmp_path / 'run'}", f"data.train_path={missing}"]
    assert main(["sft", *base, "optim.lrr=1", "model.hidden_size=abc"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "megarl: error: invalid config:" and len(lines) == 4, lines
    assert "unknown key 'optim.lrr' (did you mean 'optim.lr'?)" in lines[1]
    assert "'model.hidden_size' expects an int" in lines[2]
    assert lines[3] == f"  data.train_path: {missing} does not exist"
    assert main(["validate", *base, "train.steps=0"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["megarl: error: invalid config:", "  train.steps must be >= 1, got 0",
                     f"  data.train_path: {missing} does not exist"], lines
    assert not (tmp_path / "run").exists()
