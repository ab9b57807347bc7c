"""`megarl pipeline` and the Python API: SFT -> RM -> RL in one run dir; finished stages are
skipped, an interrupted RL stage resumes bit-exactly; per-stage config sections and checks."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from megarl_run import command, env, final_weights, metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.num_attention_heads=4",
        "model.num_kv_heads=2", "tracking.backend=none", "data.micro_batch_size=4", "data.global_batch_size=8",
        "data.synthetic.n_train=200", "data.synthetic.n_test=40", "train.log_interval=1",
        "stages.sft.train.steps=3", "stages.sft.train.eval_interval=0", "stages.sft.lr_schedule.warmup_steps=1",
        "stages.rm.train.steps=2", "stages.rm.train.eval_interval=0", "stages.rm.lr_schedule.warmup_steps=1",
        "stages.rl.train.steps=3", "stages.rl.train.eval_interval=3", "stages.rl.checkpoint.save_interval=1",
        "stages.rl.rl.prompts_per_step=4", "stages.rl.rl.samples_per_prompt=2", "stages.rl.rl.max_new_tokens=6",
        "stages.rl.rl.micro_batch_size=8", "stages.rl.rl.mini_batches=1", "stages.rl.rl.eval_prompts=4",
        "stages.rl.rl.eval_samples=2", "stages.rl.rl.algorithm=ppo", "stages.rl.rl.kl_coef=0.05",
        "stages.rl.rl.reward_model_coef=1.0", "stages.rl.optim.lr=1e-4"]


def pipeline_args(run, *extra):
    return ["pipeline", "--config", "configs/tiny_pipeline.yaml", f"train.run_dir={run}", *TINY, *extra]


def _deterministic(records):
    return [{k: v for k, v in r.items() if not k.startswith("memory/")} for r in records]


@pytest.mark.slow
def test_pipeline_runs_three_stages_skips_finished_ones_and_resumes_rl_bit_exactly(tmp_path):
    full = tmp_path / "full"
    out = subprocess.run(command(pipeline_args(full)), capture_output=True, text=True, env=env(), cwd=ROOT,
                         timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for d in ("sft", "reward_model", "rl", "logs"):
        assert (full / d).is_dir(), d
    for log in ("sft.log", "rm.log", "rl.log", "pipeline.yaml"):
        assert (full / "logs" / log).stat().st_size > 0, log
    assert "rl step 3/3 (100%, ETA 0:00; pipeline stage 3/3, run ETA ~0:00)" in (full / "logs" / "rl.log").read_text()
    assert "; pipeline stage 1/3, run ETA ~" in (full / "logs" / "sft.log").read_text()
    rl_metrics = metrics(full / "rl")
    from megarl.tracking.params import sanitize_key

    names = {k for d in ("sft", "reward_model", "rl") for m in metrics(full / d, wall_clock=True) for k in m}
    assert {k for k in names if sanitize_key(k) != k} == set()  # MLflow stores what metrics.jsonl holds
    steps = [m for m in rl_metrics if "actor/loss" in m]
    assert [m["step"] for m in steps] == [1, 2, 3] and "critic/loss" in steps[0]
    # evaluated before the first step (the SFT model RL starts from) and after the last
    assert [m["step"] for m in rl_metrics if "eval/pass_at_1" in m] == [0, 3]
    assert not any("eval/mean_at_2" in m for m in rl_metrics)  # final_answer is 0/1: mean@k is pass@1

    # Kill the RL stage after its step-2 checkpoint; the rerun skips SFT and RM and resumes RL.
    run = tmp_path / "run"
    proc = subprocess.Popen(command(pipeline_args(run)), env=env(), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 600
    while not ((run / "rl" / "metrics.jsonl").exists() and any(m["step"] >= 3 for m in metrics(run / "rl"))):
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "rl step 3 not reached"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    out = subprocess.run(command(pipeline_args(run)), capture_output=True, text=True, env=env(), cwd=ROOT,
                         timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "sft: already complete" in out.stdout and "rm: already complete" in out.stdout
    assert "resumed rl from" in out.stdout
    assert _deterministic(metrics(run / "rl")) == _deterministic(rl_metrics)
    a, b = final_weights(run / "rl"), final_weights(full / "rl")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # Everything done: a third run only says so.
    out = subprocess.run(command(pipeline_args(run, "--stages", "rm,rl")), capture_output=True, text=True,
                         env=env(), cwd=ROOT, timeout=600)
    assert out.returncode == 0 and "rl: already complete" in out.stdout and "sft:" not in out.stdout


@pytest.mark.slow
def test_python_api_docstring_example_runs(tmp_path):
    """The example in megarl/trainers/pipeline.py's docstring, run statement by statement as
    written (with the tiny settings appended to the overrides it passes): each shown value must
    come out. The stages' progress output is not part of the example."""
    script = textwrap.dedent(f"""
        import doctest, megarl
        import megarl.trainers.pipeline as mod
        class Tiny(mod.Pipeline):
            def __init__(self, config, overrides=()):
                super().__init__(config, [*overrides, *{TINY!r}])
        megarl.Pipeline = Tiny
        examples = doctest.DocTestParser().get_examples(mod.__doc__)
        assert len(examples) >= 3, examples
        scope = {{}}
        for ex in examples:
            if ex.want:
                got = repr(eval(ex.source, scope))
                assert got == ex.want.strip(), (ex.source, got, ex.want)
            else:
                exec(ex.source, scope)
        print("EXAMPLES OK", len(examples))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env(), cwd=tmp_path,
                         timeout=900)
    assert out.returncode == 0 and "EXAMPLES OK" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]
    assert (tmp_path / "runs" / "notebook" / "rl" / "metrics.jsonl").exists()


def test_pipeline_stages_are_the_tiny_recipes():
    """tiny_pipeline.yaml repeats tiny_sft/tiny_rm/tiny_grpo's values (its header says so); the
    two RL differences are the ones its comments give. A recipe edited in one place only fails here."""
    from dataclasses import asdict

    from megarl.config import load_config
    from megarl.trainers.pipeline import load_pipeline_config

    stages = load_pipeline_config("configs/tiny_pipeline.yaml", [])
    for stage, recipe, differ in (("sft", "tiny_sft", {}), ("rm", "tiny_rm", {}),
                                  ("rl", "tiny_grpo", {"old_logprobs": ("rollout", "recompute")})):
        mine, theirs = asdict(stages[stage]), asdict(load_config(f"configs/{recipe}.yaml"))
        assert {k: (mine["rl"][k], theirs["rl"][k]) for k in mine["rl"] if mine["rl"][k] != theirs["rl"][k]} == differ
        mine["rl"], theirs["rl"] = {}, {}
        assert mine == theirs, stage


def test_pipeline_config_sections_and_overrides(tmp_path):
    from megarl.config import ConfigError
    from megarl.trainers.pipeline import load_pipeline_config

    cfgs = load_pipeline_config("configs/tiny_pipeline.yaml", ["train.run_dir=/tmp/p", "stages.rl.optim.lr=2e-5"])
    assert (cfgs["sft"].train.steps, cfgs["rm"].train.steps, cfgs["rl"].train.steps) == (600, 150, 60)
    assert cfgs["rl"].optim.lr == 2e-5 and cfgs["sft"].optim.lr == 3e-3
    assert all(c.train.run_dir == "/tmp/p" for c in cfgs.values())
    # A shared override reaches every stage, also those whose section sets the key (steps, weight
    # decay: all three do); a stage override wins over it in either order.
    for overrides in (["train.steps=5", "optim.weight_decay=0.2", "stages.rl.train.steps=7"],
                      ["stages.rl.train.steps=7", "train.steps=5", "optim.weight_decay=0.2"]):
        cfgs = load_pipeline_config("configs/tiny_pipeline.yaml", overrides)
        assert {s: c.train.steps for s, c in cfgs.items()} == {"sft": 5, "dpo": 5, "rm": 5, "rl": 7}, overrides
        assert {c.optim.weight_decay for c in cfgs.values()} == {0.2}
        assert cfgs["rm"].optim.lr == 1e-3 and cfgs["rl"].train.eval_interval == 30  # the rest is untouched
    with pytest.raises(ConfigError, match=r"stages.rl: tokenizer .* differs"):
        load_pipeline_config("configs/tiny_pipeline.yaml", ["stages.rl.tokenizer.kind=hf"])
    with pytest.raises(ConfigError, match=r"expected stages.<sft\|dpo\|rm\|rl>"):
        load_pipeline_config("configs/tiny_pipeline.yaml", ["stages.ppo.optim.lr=1"])
    with pytest.raises(ConfigError, match=r"unknown key 'optim.lrr'"):
        load_pipeline_config("configs/tiny_pipeline.yaml", ["stages.sft.optim.lrr=1"])


def test_pipeline_checks_every_stage_before_the_first_step(tmp_path):
    """A rule broken in a later stage (RM warm-up >= its decay steps) stops the pipeline before SFT
    trains, in one message that names the stage, as `megarl validate` does."""
    for args in (pipeline_args(tmp_path / "run", "stages.rm.lr_schedule.decay_steps=1"),
                 ["validate", "--config", "configs/tiny_pipeline.yaml", *TINY, "stages.rm.lr_schedule.decay_steps=1"]):
        out = subprocess.run(command(args), capture_output=True, text=True, env=env(), cwd=ROOT, timeout=300)
        assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
        assert "configs/tiny_pipeline.yaml (stage rm): invalid config:" in out.stderr, out.stderr[-2000:]
        assert "lr_schedule.warmup_steps (1) must be in [0, decay steps (1))" in out.stderr
        assert "Traceback" not in out.stderr
    assert not (tmp_path / "run" / "sft").exists()


def test_progress_line_shows_the_pipeline_stage_and_a_run_eta(capsys):
    """Each progress line of a stage in a pipeline says which stage of how many and the ETA of
    the whole run: the running stage's pace, times its own remaining steps plus the later
    stages' work in its units."""
    from megarl.trainers.loop import Progress
    from megarl.trainers.pipeline import RunETA, load_pipeline_config, stage_work

    cfgs = load_pipeline_config("configs/tiny_pipeline.yaml", [])
    work = {s: stage_work(c, s) for s, c in cfgs.items()}
    assert work["rm"][0] == 2 * work["sft"][0] * 128 / 32  # pairs: twice the sequences, 128 a step vs 32
    eta = RunETA({s: cfgs[s] for s in ("sft", "rm", "rl")})  # the stages a default run runs
    seconds = 0.5 * (600 - 300) + 0.5 * (work["rm"][1] + work["rl"][1]) / work["sft"][0]
    assert eta.reporter("sft")(300, 600, 0.5) == f"pipeline stage 1/3, run ETA ~{int(seconds) // 60}:{int(seconds) % 60:02d}"
    assert eta.reporter("rl")(59, 60, 2.0) == "pipeline stage 3/3, run ETA ~0:02"
    assert RunETA({"rl": cfgs["rl"]}).reporter("rl")(0, 60, 61.0) == "pipeline stage 1/1, run ETA ~1:01:00"

    progress = Progress(total=4, initial=0, desc="rm", every=2, run=lambda done, total, rate: f"stage 2/3, run {done}")
    for _ in range(4):
        progress.update({"train/loss": 1.0})
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("rm step")]
    assert len(lines) == 2 and "; stage 2/3, run 2) | loss 1" in lines[0] and lines[1].startswith("rm step 4/4 (100%")


def test_a_finished_stage_asked_for_with_other_settings_stops_and_names_them(tmp_path, monkeypatch, capsys):
    """The README's `megarl sft ... optim.lr=1e-3 train.steps=100` rerun into the quickstart's run
    dir (SFT done at step 600): one line naming the keys and the way out, exit 2 (before:
    `already complete (step 600 of 100)`, exit 0, the lr unused). The same settings, or ones that
    do not change what it trains, pass; the pipeline refuses alike instead of skipping."""
    from megarl.checkpoint import distributed
    from megarl.cli.main import main
    from megarl.config import ConfigError, load_config, save_config
    from megarl.trainers.pipeline import Pipeline

    run = tmp_path / "run"
    step_dir = run / "sft" / "checkpoints" / "step_00000600"
    step_dir.mkdir(parents=True)
    save_config(load_config("configs/tiny_sft.yaml", [f"train.run_dir={run}"]), str(run / "sft" / "config.yaml"))
    monkeypatch.setattr(distributed, "latest_checkpoint",
                        lambda root: str(step_dir) if os.path.samefile(os.path.dirname(step_dir), root) else None)
    base = ["--config", "configs/tiny_sft.yaml", f"train.run_dir={run}"]
    assert main(["sft", *base, "optim.lr=1e-3", "train.steps=100"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"megarl: error: sft: already complete in {run / 'sft'} (step 600) "
                                               "with another config: "), err
    assert "optim.lr (0.003 there, 0.001 asked), train.steps (600 there, 100 asked)" in err[0]
    assert err[0].endswith("use a new train.run_dir, or checkpoint.resume=false to train it again there")
    for same in ([], ["train.log_interval=1", "train.eval_interval=7", "sft.eval_samples=2"]):
        assert main(["validate", "--stage", "sft", *base, *same]) == 0, capsys.readouterr().err
    assert main(["validate", "--stage", "sft", *base, "optim.lr=1e-3", "checkpoint.resume=false"]) == 0
    with pytest.raises(ConfigError, match=r"^sft: already complete .* optim.lr \(0.003 there, 0.001 asked\)"):
        Pipeline("configs/tiny_pipeline.yaml", [f"train.run_dir={run}", "stages.sft.optim.lr=1e-3"]).run(["sft"])
