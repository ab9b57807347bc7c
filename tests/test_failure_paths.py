"""Failure paths a user can hit (issue 13): no data loss, one clear line, rc 2, early checks."""
import os

import pytest

from dist_helpers import run_distributed
from megarl_run import TINY, megarl


# --------------------------------------------------------------------------- data loss


def _tiny_role(seed, hidden=32):
    from megarl.config import LRScheduleConfig, ModelConfig, OptimConfig, ParallelConfig
    from megarl.roles.role import Role

    model = ModelConfig(num_layers=2, hidden_size=hidden, ffn_hidden_size=64, num_attention_heads=4,
                        vocab_size=64, max_position_embeddings=32)
    return Role("policy", model, ParallelConfig(), head="lm", optim=OptimConfig(lr=1e-3),
                schedule=LRScheduleConfig(warmup_steps=0), train_steps=20, seed=seed)


def _three_writers(rank, world, root):
    """A run saving steps 5 and 12 (keep_last=2); another writer (a conversion, a fresh run) saving
    step 0 into the same root with keep_last=1; the first run resumed from step 12 saving 13 and 14.
    Clearing the run-id registry stands for a new process."""
    import megarl.checkpoint.distributed as ck
    from megarl.runtime.distributed import init_distributed, teardown

    init_distributed(1, 1, seed=1)
    role, listings = _tiny_role(1), []
    for step in (5, 12):
        ck.save_checkpoint(root, step, {"policy": role}, {"n": step}, keep_last=2)
    listings.append(sorted(os.listdir(root)))
    ck._RUN_IDS.clear()
    ck.save_checkpoint(root, 0, {"policy": _tiny_role(2)}, {"n": 0}, keep_last=1)
    listings.append(sorted(os.listdir(root)))
    ck._RUN_IDS.clear()
    resumed = _tiny_role(3)
    ck.load_checkpoint(os.path.join(root, "step_00000012"), {"policy": resumed}, load_optimizer=False)
    for step in (13, 14):
        ck.save_checkpoint(root, step, {"policy": resumed}, {"n": step}, keep_last=2)
    listings.append(sorted(os.listdir(root)))
    try:  # resuming with another model shape: one line naming the keys
        ck.load_checkpoint(os.path.join(root, "step_00000014"), {"policy": _tiny_role(4, hidden=64)})
        mismatch = None
    except ck.CheckpointError as e:
        mismatch = str(e)
    teardown()
    return listings, mismatch


@pytest.mark.slow
def test_cleanup_never_deletes_another_runs_checkpoints(tmp_path):
    root = str(tmp_path / "ckpt")
    (first, other, resumed), mismatch = run_distributed(_three_writers, 1, root)[0]
    assert mismatch is not None and "\n" not in mismatch
    assert "the saved model does not match the configured one: model.hidden_size=32 (config: 64)" in mismatch
    assert first == ["latest", "step_00000005", "step_00000012"]
    # before the fix, keep_last=1 deleted step_5 and step_12 (with an older step than theirs, the new one too)
    assert other == ["latest", "step_00000000", "step_00000005", "step_00000012"]
    assert resumed == ["latest", "step_00000000", "step_00000013", "step_00000014"]
    assert open(os.path.join(root, "latest")).read().strip() == "step_00000014"


def test_stale_checkpoints_spares_latest_and_newer(tmp_path):
    import json

    from megarl.checkpoint.distributed import LATEST, MANIFEST, stale_checkpoints

    root = tmp_path / "ckpt"
    for step, run in ((1, "a"), (2, "a"), (3, "b"), (4, "a"), (9, "a")):
        d = root / f"step_{step:08d}"
        d.mkdir(parents=True)
        (d / MANIFEST).write_text(json.dumps({"step": step, "run": run, "files": {}}))
    (root / LATEST).write_text("step_00000002\n")
    # run a saved step 4: step 9 is newer (never deleted), step 3 is b's, step 2 is what latest names
    assert stale_checkpoints(str(root), "a", 4, 1) == ["step_00000001"]
    assert stale_checkpoints(str(root), "b", 3, 1) == []


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=261, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False)
    d = tmp_path_factory.mktemp("hf")
    transformers.LlamaForCausalLM(cfg).save_pretrained(d, safe_serialization=True)
    return d


def test_hf_to_megarl_refuses_a_non_empty_destination(tmp_path, hf_llama):
    run = tmp_path / "ckpt"
    (run / "step_00000012").mkdir(parents=True)
    (run / "step_00000012" / "weights").write_text("a run's checkpoint")
    (run / "latest").write_text("step_00000012\n")
    out = megarl(["convert", "hf-to-megarl", "--hf", str(hf_llama), "--out", str(run)], check=False)
    assert out.returncode == 2, out.stderr
    assert "exists and is not empty" in out.stderr and "--overwrite" in out.stderr
    assert sorted(os.listdir(run)) == ["latest", "step_00000012"]  # untouched
    assert (run / "latest").read_text() == "step_00000012\n"


@pytest.mark.slow
def test_convert_round_trip_reads_the_config_it_wrote_and_names_shape_mismatch(tmp_path, hf_llama):
    ck = tmp_path / "ck"
    megarl(["convert", "hf-to-megarl", "--hf", str(hf_llama), "--out", str(ck)])
    assert (ck / "config.yaml").is_file()
    # megarl-to-hf finds the config hf-to-megarl wrote (it asked for a config.yaml that was named model.yaml)
    # (hf_llama has no tokenizer files: the export asks for one, here megarl's byte tokenizer by name)
    megarl(["convert", "megarl-to-hf", "--checkpoint", str(ck), "--out", str(tmp_path / "hf"), "--arch", "llama",
            "tokenizer.kind=byte"])
    # a config that does not match: one line naming the keys, not megatron's shape-mismatch traceback
    out = megarl(["convert", "megarl-to-hf", "--checkpoint", str(ck), "--out", str(tmp_path / "hf2"), "--arch", "llama",
                  "tokenizer.kind=byte", "model.hidden_size=32"], check=False)
    # overrides after --config-less megarl-to-hf apply to the found config
    assert out.returncode == 2, out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "model.hidden_size=64 (config: 32)" in line and "does not match" in line
    # a non-empty HF destination: refused with the flag that exists
    out = megarl(["convert", "megarl-to-hf", "--checkpoint", str(ck), "--out", str(tmp_path / "hf"), "--arch", "llama",
                  "tokenizer.kind=byte"], check=False)
    assert out.returncode == 2 and "--overwrite" in out.stderr and "overwrite=True" not in out.stderr


# --------------------------------------------------------------------------- one line, rc 2


def _fails(args, expect, capsys):
    """In-process `megarl ...` (the same main() the console script runs): rc 2, one line, no traceback."""
    from megarl.cli.main import main

    capsys.readouterr()
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 2, (rc, err)
    assert expect in err, err
    assert err.startswith("megarl: error:") and "Traceback" not in err
    return err


def test_config_values_that_passed(tmp_path, capsys):
    dup = tmp_path / "dup.yaml"
    dup.write_text("optim:\n  lr: 1.0e-4\n  lr: 2.0e-4\n")
    _fails(["validate", "--config", str(dup)], f"{dup}:3: invalid YAML: key 'lr' is given twice", capsys)
    for value in (".inf", ".nan", "-.inf"):
        _fails(["validate", "--config", "tiny_sft.yaml", f"optim.lr={value}"], "'optim.lr' must be a finite number", capsys)
    inf = tmp_path / "inf.yaml"
    inf.write_text("optim:\n  lr: .inf\n")
    _fails(["validate", "--config", str(inf)], f"{inf}: 'optim.lr' must be a finite number", capsys)
    _fails(["validate", "--config", "tiny_sft.yaml", "model.num_kv_heads=0"], "model.num_kv_heads must be >= 1", capsys)
    for size in ("-4", "0"):
        _fails(["validate", "--config", "tiny_sft.yaml", "--world-size", size], f"world size must be >= 1, got {size}", capsys)
    from megarl.cli.main import main

    assert main(["validate", "--config", "tiny_sft.yaml", "--world-size", "1"]) == 0
    assert "valid for world size 1 (--world-size)" in capsys.readouterr().out
    _fails(["synthetic", "--out", str(tmp_path / "syn"), "--n-train", "-5"], "n_train >= 1", capsys)
    assert not (tmp_path / "syn").exists()


def test_messages_that_misled(tmp_path, capsys):
    _fails(["report", str(tmp_path / "nonexistent")], f"{tmp_path / 'nonexistent'}: no such run directory", capsys)
    _fails(["convert", "megarl-to-hf", "--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "o"),
            "--arch", "llama"], "no such checkpoint", capsys)
    _fails(["validate", "--config", "tiny_sft.yaml", "optim.lr=abc"], "override 'optim.lr=abc': 'optim.lr' expects a float", capsys)
    _fails(["validate", "--config", str(tmp_path)], f"{tmp_path}: is a directory, not a config file", capsys)
    # a file where a directory is needed: one line, rc 2 (before: NotADirectoryError tracebacks, temp-path names)
    afile = tmp_path / "afile"
    afile.write_text("x")
    _fails(["synthetic", "--out", str(afile)], f"--out {afile}: is a file, not a directory", capsys)
    _fails(["convert", "hf-to-megarl", "--hf", str(afile), "--out", str(tmp_path / "o")],
           f"--hf {afile}: is a file; expected a Hugging Face model directory", capsys)
    _fails(["validate", "--stage", "sft", "--config", "tiny_sft.yaml", f"train.run_dir={afile}"],
           f"train.run_dir: {afile} is a file, not a directory", capsys)
    _fails(["sft", "--config", "tiny_sft.yaml", f"train.run_dir={afile}/run"],
           f"train.run_dir: {afile}/run cannot be created: {afile} is a file", capsys)
    assert sorted(os.listdir(tmp_path)) == ["afile"]  # nothing written, no debris


# --------------------------------------------------------------------------- tracking tells the truth


def test_resume_after_kill_logs_one_point_per_step(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from megarl.tracking import Tracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    fast = dict(system_metrics_interval=None, retry_backoff=(0.05, 0.2), flush_timeout=30)
    killed = Tracker.start(tmp_path / "run", uri=uri, **fast)
    for step in range(1, 14):  # checkpoint at 12, killed (-9) after logging 13
        killed.log_metrics({"train/loss": 1.0 / step, "perf/step_time_s": 0.5}, step=step)
    assert killed.close(status=None)  # a kill -9 sets no status
    resumed = Tracker.start(tmp_path / "run", uri=uri, **fast)
    for step in range(13, 16):  # the resumed process repeats step 13
        resumed.log_metrics({"train/loss": 1.0 / step, "perf/step_time_s": 0.7}, step=step)
    assert resumed.close()
    client = MlflowClient(uri)
    for key in ("train/loss", "perf/step_time_s"):
        steps = sorted(m.step for m in client.get_metric_history(resumed.run_id, key))
        assert steps == list(range(1, 16)), (key, steps)  # before the fix: 16 points, 13 twice


def _failing_stages(rank, world, run_dirs):
    """One stage that fails and one that is pre-empted, each in its own run dir."""
    from megarl.config import load_config
    from megarl.trainers.stops import Preempted
    from megarl.trainers.session import stage_session

    for run_dir, error in zip(run_dirs, (RuntimeError("boom"), Preempted("pre-empted"))):
        cfg = load_config(None, [f"train.run_dir={run_dir}", "tracking.backend=mlflow"])
        try:
            with stage_session(cfg, "sft"):
                raise error
        except (Preempted, RuntimeError):
            pass
    return True


@pytest.mark.slow
def test_stage_that_ends_in_an_error_is_marked(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from megarl.tracking import write_report
    from megarl.tracking.state import RunState

    run_dirs = [tmp_path / "failed", tmp_path / "preempted"]
    for d in run_dirs:
        d.mkdir()
        MlflowClient(f"sqlite:///{d / 'mlflow.db'}").search_experiments()  # the store's tables, made ahead
    run_distributed(_failing_stages, 1, [str(d) for d in run_dirs])
    for run_dir, status in zip(run_dirs, ("FAILED", "KILLED")):
        parent, stage = RunState(run_dir).load(), RunState(run_dir / "sft").load()
        client = MlflowClient(parent["tracking_uri"])
        assert client.get_run(parent["run_id"]).info.status == status  # before the fix: FINISHED
        child = client.get_run(stage["run_id"])
        assert child.info.status == status
        assert (child.data.tags.get("megarl.preempted") == "true") == (status == "KILLED")
        report = write_report(run_dir).read_text()
        assert report.count(f"- status: {status}") == 2


# --------------------------------------------------------------------------- early checks


def test_inputs_are_checked_before_the_run_dir_is_touched(tmp_path, capsys):
    few = tmp_path / "few.jsonl"
    few.write_text("".join('{"messages": [{"role": "user", "content": "%d"}, {"role": "assistant", "content": "x"}]}\n' % i
                           for i in range(3)))
    tok_file = tmp_path / "tok.json"
    tok_file.write_text("{}")
    run = tmp_path / "run"
    cases = [
        ("sft", ["data.train_path=/nonexistent/train.jsonl"], "data.train_path: /nonexistent/train.jsonl does not exist"),
        ("sft", ["tokenizer.kind=hf", "tokenizer.path=/nonexistent/tok"], "tokenizer.path: /nonexistent/tok does not exist"),
        ("sft", ["tokenizer.kind=hf", f"tokenizer.path={tok_file}"], "is a file; expected a directory"),
        ("sft", ["model.vocab_size=100"], "model.vocab_size (100) is smaller than the tokenizer's vocabulary (261)"),
        ("sft", [f"data.train_path={few}"], f"{few} has 3 records, fewer than one batch (data.global_batch_size=8)"),
        ("sft", ["data.synthetic.n_train=4"], "data.synthetic.n_train (4) is smaller than one batch"),
        ("rm", [], f"reward_model.init_from=sft: no checkpoint at {run / 'sft' / 'checkpoints'}"),
        ("rl", [], f"roles.actor.init_from=sft: no checkpoint at {run / 'sft' / 'checkpoints'}"),
    ]
    for command, overrides, expect in cases:
        args = ["--config", "tiny_sft.yaml", *TINY, f"train.run_dir={run}", *overrides]
        _fails([command, *args], expect, capsys)
        assert not run.exists(), (command, overrides)  # before the fix: run dir, mlflow.db, config.yaml
        stage = {"sft": "sft", "rm": "rm", "rl": "rl"}[command]
        # `megarl validate --stage` finds the same problem (it passed all of these)
        _fails(["validate", "--stage", stage, *args], expect, capsys)
    # without --stage, validate still checks the data and tokenizer every stage needs
    _fails(["validate", "--config", "tiny_sft.yaml", *TINY, f"data.train_path={few}"], "has 3 records", capsys)


# --------------------------------------------------------------------------- several processes


def _run_sh(args, cwd):
    """launchers/local/run.sh as the README shows it, with this tree's megarl (PYTHONPATH)."""
    import subprocess

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "MEGARL_TORCHRUN_ARGS"):
        env.pop(k, None)
    return subprocess.run([os.path.join(repo, "launchers", "local", "run.sh"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_run_sh_finds_a_config_error_once_before_any_rank_starts(tmp_path):
    """The README's multi-process way: a config mistake is one line and exit 2, before torchrun
    starts (bare torchrun: every rank fails on it, torchrun reports ChildFailedError and exits 1)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cases = [
        (["2", "sft", "configs/tiny_sft.yaml", "optim.lr=abc"],
         "megarl: error: override 'optim.lr=abc': 'optim.lr' expects a float; got str 'abc'"),
        (["2", "eval", "configs/tiny_grpo.yaml", "--checkpoint", "x=y", "rl.eval_samples=abc"],  # option values skipped
         "megarl: error: override 'rl.eval_samples=abc': 'rl.eval_samples' expects an int; got str 'abc'"),
        (["2", "rm", "configs/tiny_rm.yaml", f"train.run_dir={tmp_path}/run"],
         f"megarl: error: reward_model.init_from=sft: no checkpoint at {tmp_path}/run/sft/checkpoints; run `megarl sft` "
         "with the same train.run_dir first, or set reward_model.init_from=null"),
        (["2", "train", "configs/tiny_sft.yaml"],  # the stage the old header example named
         "megarl launcher: unknown stage 'train': expected sft, rm, rl, eval or pipeline (or -- COMMAND [ARGS ...])"),
    ]
    for args, line in cases:
        out = _run_sh(args, repo)
        assert (out.returncode, out.stderr.strip(), out.stdout) == (2, line, ""), (args, out.stderr)
    assert os.listdir(tmp_path) == []  # nothing started, nothing written


# --------------------------------------------------------------------------- noise


def test_known_cpu_warnings_are_silenced_and_others_kept():
    import warnings

    from megarl.runtime import cpu_compat

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cpu_compat.silence_known_warnings()
        warnings.warn("When using async grad allreduce it is recommended to set the environment variable "
                      "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup", UserWarning)
        warnings.warn("Please use DTensor instead and we are deprecating ShardedTensor.", FutureWarning)
        warnings.warn("something else", UserWarning)
        warnings.warn("deprecating ShardedTensor, as a UserWarning", UserWarning)
    assert [str(w.message) for w in caught] == ["something else", "deprecating ShardedTensor, as a UserWarning"]


def test_preflight_accepts_random_roles_and_present_checkpoints(tmp_path):
    from megarl.config import load_config
    from megarl.trainers.data_setup import preflight

    run = tmp_path / "run"
    base = [f"train.run_dir={run}", *TINY]
    rl_random = [f"roles.{r}.init_from=random" for r in ("actor", "reference", "critic", "reward")]
    assert preflight(load_config("tiny_grpo.yaml", base + rl_random), "rl") == []
    (run / "sft" / "checkpoints").mkdir(parents=True)
    (run / "sft" / "checkpoints" / "latest").write_text("step_00000002\n")
    assert preflight(load_config("tiny_rm.yaml", base), "rm") == []
    assert preflight(load_config("tiny_sft.yaml", base), "eval") == []
