"""The command line as a user meets it: help, one-line errors, exit codes."""
import subprocess

from megarl_run import megarl


def test_help_lists_every_command_and_option():
    out = megarl(["--help"]).stdout
    for cmd in ("sft", "rm", "validate", "preprocess", "synthetic", "convert", "report"):
        assert cmd in out
    sub = megarl(["sft", "--help"]).stdout
    assert "--config" in sub and "KEY=VALUE" in sub
    conv = megarl(["convert", "megarl-to-hf", "--help"]).stdout
    assert "--checkpoint" in conv and "--arch" in conv


def test_config_error_is_one_line_without_traceback(tmp_path):
    out = megarl(["sft", "--config", "configs/tiny_sft.yaml", "optim.lrr=1"], check=False)
    assert out.returncode == 2
    assert out.stderr.strip() == "megarl: error: override 'optim.lrr=1': unknown key 'optim.lrr' (did you mean 'optim.lr'?)"
    assert "Traceback" not in out.stderr + out.stdout


def test_missing_config_file():
    out = megarl(["sft", "--config", "no/such.yaml"], check=False)
    assert out.returncode == 2 and "no/such.yaml: config file not found" in out.stderr and "Traceback" not in out.stderr


def test_validation_errors_listed_before_anything_runs(tmp_path):
    out = megarl(["sft", "--config", "configs/tiny_sft.yaml", "parallel.tp=2", "data.seq_length=4096",
                  f"train.run_dir={tmp_path}/run"], check=False)
    assert out.returncode == 2
    assert "world size 1 must be divisible by parallel.tp*pp*cp" in out.stderr
    assert "data.seq_length (4096) exceeds model.max_position_embeddings" in out.stderr
    assert not (tmp_path / "run").exists(), "nothing may be created for an invalid config"


def test_debug_shows_traceback():
    out = megarl(["--debug", "sft", "--config", "configs/tiny_sft.yaml", "optim.lrr=1"], check=False)
    assert out.returncode != 0 and "Traceback" in out.stderr


def test_bad_data_file_is_one_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    # one global batch (32) of good records first: a smaller file is refused before it is parsed
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n' * 40
                   + '{not json\n')
    out = megarl(["sft", "--config", "configs/tiny_sft.yaml", f"data.train_path={bad}", f"train.run_dir={tmp_path}/r",
                  "tracking.backend=none"], check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"{bad}:41:" in out.stderr and out.stderr.count("\n") == 1


def test_validate_command():
    out = megarl(["validate", "--config", "configs/tiny_sft.yaml", "--world-size", "4", "parallel.tp=2",
                  "data.global_batch_size=32"])
    assert "valid for world size 4" in out.stdout


def test_console_script_installed():
    out = subprocess.run(["megarl", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, "the `megarl` console command is not installed (pip install -e .)"
