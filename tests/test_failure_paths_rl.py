"""Failure paths of issue 27 (pre-emption before the first step, disk full during a checkpoint,
HF weights of another size) and 28.6 (`megarl eval`): one line, the right exit status, nothing
lost."""
import json
import os
import signal
import subprocess
import time

import pytest

from megarl_run import TINY, command, env, megarl
from test_failure_paths import hf_llama  # noqa: F401 - the fixture: a Hugging Face Llama, hidden size 64

HERE = os.path.dirname(__file__)
TINY_RL = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.num_attention_heads=4",
           "model.num_kv_heads=2", "tracking.backend=none", "train.log_interval=1",
           "roles.actor.init_from=random", "roles.reference.init_from=random", "rl.max_new_tokens=8",
           "rl.micro_batch_size=8", "rl.prompts_per_step=4", "rl.samples_per_prompt=2"]


def test_sigterm_during_setup_or_the_step0_evaluation_exits_75(tmp_path):
    """SIGTERM once the session exists (the roles being built, or the step-0 evaluation running):
    exit 75 with one line, no step taken (before: killed by the signal, 143, no message)."""
    run = tmp_path / "run"
    args = ["rl", "--config", "tiny_grpo.yaml", f"train.run_dir={run}", *TINY_RL, "train.steps=3",
            "train.eval_interval=3", "rl.eval_prompts=64", "rl.eval_samples=8", "rl.max_new_tokens=24"]
    proc = subprocess.Popen(command(args), env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.time() + 300
    while not (run / "rl" / "config.yaml").exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, (out[-2000:], err[-2000:])
    assert err.strip().splitlines()[-1] == ("megarl: rl: pre-empted before step 1; nothing to save yet, "
                                            "exiting 75 for requeue")
    steps = [json.loads(line)["step"] for line in open(run / "rl" / "metrics.jsonl")] \
        if (run / "rl" / "metrics.jsonl").exists() else []
    assert set(steps) <= {0}  # at most the step-0 evaluation; no training step
    assert not (run / "rl" / "megarl.lock").exists()


@pytest.mark.parametrize("stage", ["sft", "rl"])
def test_hf_weights_of_another_size_give_the_mismatch_line(tmp_path, hf_llama, stage):
    """model.init_from / roles.actor.init_from at an HF model of another size (hidden 64 against
    32): the one line a checkpoint of another shape gives (before: the layout loader's traceback)."""
    run = tmp_path / "run"
    if stage == "sft":
        args = ["sft", "--config", "tiny_sft.yaml", *TINY, f"train.run_dir={run}", f"model.init_from={hf_llama}",
                "model.hidden_size=32", "model.norm_eps=1e-6"]
    else:
        args = ["rl", "--config", "tiny_grpo.yaml", f"train.run_dir={run}", *TINY_RL, f"roles.actor.init_from={hf_llama}",
                "model.hidden_size=32", "model.norm_eps=1e-6"]
    out = megarl(args, check=False)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    key = "model.init_from" if stage == "sft" else "roles.actor.init_from"  # the setting the user gave
    assert lines == [f"megarl: error: {key}: {hf_llama}: the saved model does not match the configured one: "
                     "model.hidden_size=64 (config: 32), model.head_dim=16 (config: 8); "
                     f"use the model section it was saved with (model.from_hf: {hf_llama} reads it)"], lines


def test_disk_full_is_recognised_and_named(tmp_path):
    """The injected form (any machine): ENOSPC in the chain, also inside torch DCP's per-rank
    failures, becomes one line naming the step, the directory and the last good checkpoint; the
    temp dir goes. Other errors pass through unchanged."""
    import errno

    from torch.distributed.checkpoint.api import CheckpointException

    from megarl.checkpoint.distributed import CheckpointError, disk_full_named, is_disk_full

    full = OSError(errno.ENOSPC, "No space left on device")
    assert is_disk_full(full, str(tmp_path))
    assert is_disk_full(CheckpointException("write", {0: (full, None)}), str(tmp_path))
    assert not is_disk_full(RuntimeError("unexpected pos 704 vs 598"), str(tmp_path))  # space left here
    root, tmp = tmp_path / "checkpoints", tmp_path / "checkpoints" / ".tmp-step_00000006"
    tmp.mkdir(parents=True)
    (tmp / "shard").write_bytes(b"x" * 100)
    with pytest.raises(CheckpointError) as e:
        with disk_full_named(str(root), str(tmp), 6):
            raise CheckpointException("write", {0: (full, None)})
    assert str(e.value) == (f"no space left on device while saving step 6 to {root}; "
                            "the last good checkpoint is none (nothing saved yet)")
    assert not tmp.exists()
    with pytest.raises(ValueError, match="other"):
        with disk_full_named(str(root), str(tmp), 6):
            raise ValueError("other")


@pytest.fixture
def small_fs(tmp_path):
    """A 2.4 MB tmpfs (room for one checkpoint of the TINY model, 1.6 MB, not two); needs root."""
    mnt = tmp_path / "run" / "sft" / "checkpoints"
    mnt.mkdir(parents=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2400k", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root (test_disk_full_is_recognised_and_named covers the logic)")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


@pytest.mark.parametrize("async_save", [False, True])
def test_disk_full_during_a_checkpoint_is_one_line(tmp_path, small_fs, async_save):
    """A real full filesystem under checkpoints/: step 2 is saved, step 4 does not fit. One line
    (before: tracebacks ending in torch's "unexpected pos"), exit non-zero, no temp dir left,
    `latest` still names step 2; with background writes too."""
    run = tmp_path / "run"
    out = megarl(["sft", "--config", "tiny_sft.yaml", *TINY, f"train.run_dir={run}", "train.steps=6",
                  "checkpoint.save_interval=2", "checkpoint.keep_last=3", "train.eval_interval=0",
                  "tracking.backend=mlflow", f"checkpoint.async_save={str(async_save).lower()}"], check=False)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines() == [
        f"megarl: error: no space left on device while saving step 4 to {small_fs}; the last good checkpoint is step 2"
    ], out.stderr[-3000:]
    assert sorted(os.listdir(small_fs)) == ["latest", "step_00000002"]
    assert (small_fs / "latest").read_text().strip() == "step_00000002"


def test_eval_checkpoint_names_a_stage_or_says_what_a_directory_is_not(tmp_path, capsys):
    """`megarl eval --checkpoint rl` (as --help says) evaluates the RL stage's latest checkpoint;
    each eval is its own MLflow run (before: the second kept the first's figures), and its
    console line says how many prompts and samples it used; a directory of the wrong kind is
    named for what it is not (before: "rl does not exist", "megarl_manifest.json: no such file")."""
    from mlflow.tracking import MlflowClient

    from megarl.cli.main import main

    run = tmp_path / "run"
    base = ["--config", "tiny_grpo.yaml", f"train.run_dir={run}", *TINY_RL, "rl.eval_samples=2"]
    empty, afile = tmp_path / "empty", tmp_path / "afile"
    empty.mkdir()
    afile.write_text("x")
    ck = run / "rl" / "checkpoints"
    for args, line in [
        (["--checkpoint", "rl"], f"--checkpoint rl: no checkpoint at {ck}; run `megarl rl` with the same "
                                 "train.run_dir first, or give a checkpoint directory (or --hf DIR)"),
        (["--checkpoint", str(empty)], f"--checkpoint {empty}: not a megarl checkpoint (no megarl_manifest.json: "
                                       "not a step directory; no 'latest': not a checkpoint root)"),
        (["--checkpoint", str(afile)], f"--checkpoint {afile}: is a file, not a checkpoint directory"),
        (["--hf", str(empty)], f"--hf {empty}: not a Hugging Face model directory (no config.json)"),
    ]:
        assert main(["eval", *args, *base]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [f"megarl: error: {line}"]
    assert not run.exists()  # found before anything is written

    megarl(["rl", *base, "train.steps=1", "train.eval_interval=0"])
    assert main(["eval", "--checkpoint", str(run / "rl"), *base]) == 2
    assert capsys.readouterr().err.strip().endswith(f"; it is a stage directory: use {ck}")
    assert main(["eval", "--hf", str(ck), *base]) == 2
    assert capsys.readouterr().err.strip().endswith("; it is a megarl checkpoint: use --checkpoint")

    figures = []
    for prompts in (4, 8):
        out = megarl(["eval", "--checkpoint", "rl", *base, f"rl.eval_prompts={prompts}", "tracking.backend=mlflow"])
        line = next(ln for ln in out.stdout.splitlines() if "eval of " in ln)
        assert f"eval of {ck / 'step_00000001'} on {prompts} prompts x 2 samples" in line, line
        figures.append(json.loads((run / "eval" / "results.json").read_text()))
    client = MlflowClient(f"sqlite:///{run / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("megarl-quickstart").experiment_id],
                              "tags.`megarl.stage` = 'eval'", order_by=["attributes.start_time ASC"])
    assert len(runs) == 2  # before: one run, which kept the first eval's figures
    for mlflow_run, result in zip(runs, figures):
        assert mlflow_run.data.tags["megarl.eval_prompts"] == str(result["n_prompts"])
        for key, value in result.items():
            if key.startswith("eval/"):
                history = client.get_metric_history(mlflow_run.info.run_id, key)
                assert [(m.step, m.value) for m in history] == [(1, pytest.approx(value))], key
