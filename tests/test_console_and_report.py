"""What the console, metrics and report say is what happened (issue 28.9): RL's banner gives
its prompts x samples, eval metric names are the same in metrics.jsonl and MLflow, mean@k only
where it differs from pass@1, one meaning per accuracy name, report plots that keep a flat line
flat and draw a curve once, the stage's own params, and no megatron notices from the Python API."""
import os
import random
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from megarl_run import env


def test_banner_describes_each_stage_batch():
    from megarl.config import load_config
    from megarl.trainers.pipeline import load_pipeline_config
    from megarl.trainers.session import _work

    rl = load_config("configs/tiny_grpo.yaml", ["data.global_batch_size=48"])
    line = _work(rl, "rl")
    assert line.startswith("60 steps of 16 prompts x 8 samples (up to 24 new tokens)") and "48" not in line
    assert "eval: 200 prompts x 4 samples" in line
    assert _work(rl, "eval") == "200 held-out prompts x 4 samples (up to 24 new tokens)"
    pipeline = load_pipeline_config("configs/tiny_pipeline.yaml")["rl"].rl  # `megarl eval` scores what the pipeline does
    assert (pipeline.eval_prompts, pipeline.eval_samples, pipeline.eval_temperature) == \
        (rl.rl.eval_prompts, rl.rl.eval_samples, rl.rl.eval_temperature)
    assert _work(load_config("configs/tiny_sft.yaml"), "sft").startswith("600 steps of 32 sequences x 128 tokens")
    assert _work(load_config("configs/tiny_rm.yaml"), "reward_model").startswith("150 steps of 128 pairs (2 x 128 tokens)")


class _Engine:
    """Stands in for the rollout engine: response i of the flattened prompts x k samples is [i]."""

    def generate(self, prompts, params, seed, sample_offset):
        n = len(prompts) * params.n
        return SimpleNamespace(responses=lambda: [[i] for i in range(n)],
                               response_lens=torch.randint(1, 9, (n,)))


def _eval(scores, k, monkeypatch):
    from megatron.core import parallel_state as ps

    from megarl.trainers.evaluate import pass_at_k_eval

    monkeypatch.setattr(ps, "get_data_parallel_world_size", lambda: 1)
    monkeypatch.setattr(ps, "get_data_parallel_rank", lambda: 0)
    n = len(scores) // k
    data = [{"prompt_ids": [1, 2], "messages": [{"content": f"q{i}"}], "answer": str(i)} for i in range(n)]
    tok = SimpleNamespace(decode=lambda ids, skip_special_tokens: str(ids[0]))

    def reward(prompts, responses, answers):
        return [scores[int(r)] for r in responses]

    metrics, _ = pass_at_k_eval(_Engine(), data, tok, n_prompts=n, k=k, params=SimpleNamespace(n=k), seed=0,
                                reward_fn=reward)
    return metrics


def test_eval_metric_names_are_mlflow_keys_and_mean_at_k_only_when_it_differs(monkeypatch):
    from mlflow.utils.validation import validate_param_and_metric_name

    from megarl.tracking.params import sanitize_key
    from megarl.trainers.evaluate import metric_names

    for name in metric_names(4):  # what metrics.jsonl holds is what MLflow stores: no renaming
        key = f"eval/{name}"
        assert validate_param_and_metric_name(key) and sanitize_key(key) == key, key

    rng = random.Random(7)
    k, n = 4, 9
    binary = [float(rng.random() < 0.4) for _ in range(n * k)]
    m = _eval(binary, k, monkeypatch)
    correct = [sum(binary[i * k:(i + 1) * k]) for i in range(n)]
    assert set(m) == {"pass_at_1", "pass_at_4", "response_len"}  # mean@4 would equal pass@1
    assert m["pass_at_1"] == pytest.approx(sum(c / k for c in correct) / n, abs=1e-12)
    assert m["pass_at_4"] == pytest.approx(sum(c > 0 for c in correct) / n, abs=1e-12)

    graded = [rng.choice([0.0, 0.5, 1.0, -1.0]) for _ in range(n * k)]
    m = _eval(graded, k, monkeypatch)
    assert m["mean_at_4"] == pytest.approx(sum(graded) / (n * k), abs=1e-12)
    assert m["pass_at_1"] == pytest.approx(sum(x > 0 for x in graded) / (n * k), abs=1e-12)
    assert m["mean_at_4"] != pytest.approx(m["pass_at_1"])


def test_accuracy_names_say_which_accuracy():
    """SFT's per-token accuracy and the reward model's pair accuracy have different names."""
    from megarl.trainers.reward_model import rm_loss

    g = torch.Generator().manual_seed(3)
    values = torch.randn(6, 5, 1, generator=g)  # [2n, s, 1]: 3 chosen, 3 rejected
    last = torch.randint(0, 5, (6,), generator=g)
    _, _, metrics = rm_loss(0.0, 0.0)({"last": last}, values)
    r = values.squeeze(-1)[torch.arange(6), last]
    assert "accuracy" not in metrics
    hits, count = metrics["pair_accuracy"].tolist()
    assert (hits, count) == ((r[:3] > r[3:]).sum().item(), 3)
    import inspect

    from megarl.trainers import sft

    assert '"token_accuracy"' in inspect.getsource(sft.sft_loss) and '"accuracy"' not in inspect.getsource(sft)


def test_report_keeps_a_flat_line_flat_and_draws_a_curve_once():
    from megarl.tracking.report import y_limits

    flat = [0.6931, 0.6932, 0.6930, 0.6931]
    lo, hi = y_limits(flat)
    assert hi - lo == pytest.approx(0.1 * 0.6932) and lo < min(flat) and max(flat) < hi
    assert y_limits([0.2, 0.5, 0.9]) is None  # a real change: matplotlib's own limits
    assert y_limits([0.0, 0.0]) is None and y_limits([float("nan")]) is None
    lr = [0.0, 1e-5, 2e-5]
    assert y_limits(lr) is None



def test_report_draws_each_distinct_series_once_with_an_honest_label():
    from megarl.tracking.report import group_identical, plot_panels

    s = {"reward/mean": ([1, 2], [0.25, 0.5]), "reward/accuracy": ([1, 2], [0.25, 0.5 + 1e-12]),
         "reward/std": ([1, 2], [0.25, 0.4])}
    assert group_identical(s) == {"reward/accuracy\nreward/mean\n(2 metrics, identical values)": s["reward/accuracy"],
                                  "reward/std": s["reward/std"]}
    zeros, ones = ([1, 2, 3], [0.0, 0.0, 0.0]), ([1, 2, 3], [1.0, 1.0, 1.0])
    actor = group_identical({"actor/clip_fraction": zeros, "actor/skipped_minibatches": zeros, "actor/minibatches": ones})
    assert list(actor) == ["actor/clip_fraction\nactor/skipped_minibatches\n(2 metrics, all 0 throughout)",
                           "actor/minibatches"]
    assert group_identical({"a": ([1, 2], [0.0, 0.0]), "b": ([2, 3], [0.0, 0.0])}).keys() == {"a", "b"}  # other steps
    # a fraction and a count that coincide are drawn on a plain axis, not a 0-1 one
    assert plot_panels(actor) == [(None, list(actor))]


def test_report_keeps_a_pair_accuracy_off_the_rewards_axis_and_labels_every_axis():
    from megarl.tracking.report import family_figure, plot_panels

    rm = {"eval/pair_accuracy": ([10, 20], [0.6, 0.9]), "eval/reward_chosen": ([10, 20], [1.0, 3.9]),
          "eval/reward_rejected": ([10, 20], [-1.0, -3.2]), "eval/loss": ([10, 20], [0.6, 0.3])}
    assert plot_panels(rm) == [(None, ["eval/loss", "eval/reward_chosen", "eval/reward_rejected"]),
                               ("share (0-1)", ["eval/pair_accuracy"])]
    memory = {f"memory/{r}_device_gib": ([1, 2], [1.5, 2.0]) for r in ("actor", "generate", "peak", "train_actor")}
    memory["memory/host_gib"] = ([1, 2], [0.0, 0.0])
    for series in (rm, memory):
        fig = family_figure("t", series)
        renderer = fig.canvas.get_renderer()
        for ax in fig.axes:
            assert ax.get_ylabel() not in ("", None)
            legend, box = ax.get_legend().get_window_extent(renderer), ax.get_window_extent(renderer)
            assert legend.x0 >= box.x1 and legend.y1 <= box.y1 + 1  # right of its panel, not over the lines
        assert [ax.get_ylabel() for ax in family_figure("m", memory).axes] == ["GiB"]


def test_report_overview_shows_what_an_rl_user_looks_at_first():
    from megarl.tracking.report import overview_panels

    keys = {"eval/pass_at_16", "eval/pass_at_1", "eval/pass_at_4", "reward/mean", "reward/std", "kl/mean",
            "actor/entropy", "rollout/response_len_mean", "eval/mean_at_4", "train/lr"}
    assert overview_panels(keys) == [
        ("held-out pass@k", ["eval/pass_at_1", "eval/pass_at_4", "eval/pass_at_16"]), ("reward", ["reward/mean"]),
        ("KL to the reference", ["kl/mean"]), ("response length (tokens)", ["rollout/response_len_mean"]),
        ("entropy", ["actor/entropy"])]
    assert overview_panels({"train/loss", "eval/loss"}) == []  # an SFT run: no overview


def test_report_best_follows_each_metrics_direction():
    from megarl.tracking.report import direction

    assert {k: direction(k) for k in ("train/loss", "eval/pair_accuracy", "eval/reward_gap", "eval/pass_at_1",
                                      "reward/mean", "critic/explained_variance", "actor/skipped_minibatches",
                                      "train/reward_rejected", "eval/reward_chosen", "kl/mean", "actor/entropy",
                                      "rollout/response_len_mean", "train/lr", "memory/peak_device_gib",
                                      "actor/clip_fraction", "train/grad_norm")} == {
        "train/loss": "lower", "eval/pair_accuracy": "higher", "eval/reward_gap": "higher",
        "eval/pass_at_1": "higher", "reward/mean": "higher", "critic/explained_variance": "higher",
        "actor/skipped_minibatches": "lower", "train/reward_rejected": None, "eval/reward_chosen": None,
        "kl/mean": None, "actor/entropy": None, "rollout/response_len_mean": None, "train/lr": None,
        "memory/peak_device_gib": None, "actor/clip_fraction": None, "train/grad_norm": None}


def test_report_params_are_the_stages_own(tmp_path):
    pytest.importorskip("mlflow")
    from dataclasses import asdict

    from megarl.config import load_config
    from megarl.tracking import Tracker, write_report

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for stage, recipe, own, foreign in (("sft", "tiny_sft", "optim.lr", ("rl", "roles", "reward_model")),
                                        ("rl", "tiny_grpo", "rl.algorithm", ("sft", "reward_model"))):
        tr = Tracker.start(tmp_path / stage, asdict(load_config(f"configs/{recipe}.yaml")), uri=uri, run_name=stage,
                           tags={"megarl.stage": stage}, system_metrics_interval=None, retry_backoff=(0.05, 0.2),
                           flush_timeout=30)
        tr.log_metrics({"train/loss": 1.0}, step=1)
        assert tr.close()
        md = write_report(tmp_path / stage).read_text()
        params = [line.split("`")[1] for line in md.splitlines() if line.startswith("| `")
                  and not line.startswith("| `train/")]
        assert own in params and "train.steps" in params, params
        assert not [p for p in params if p.split(".")[0] in foreign], params


def test_python_api_prints_no_megatron_notices(tmp_path):
    script = ("import megarl\n"
              "megarl.Pipeline('configs/tiny_pipeline.yaml', ['train.run_dir=run', 'tracking.backend=none', "
              "'train.steps=1', 'train.eval_interval=0', 'lr_schedule.warmup_steps=0', 'model.num_layers=1', "
              "'model.hidden_size=32', 'model.ffn_hidden_size=64']).sft()\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    (tmp_path / "configs").symlink_to(os.path.join(root, "configs"))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env(), cwd=tmp_path,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    for notice in ("Transformer Engine and Apex are not installed", "Apex is not installed", "full scope"):
        assert notice not in out.stderr + out.stdout, out.stderr[-3000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine without kernels the line is a warning")
def test_a_cpu_run_prints_nothing_about_cuda_kernels(monkeypatch, caplog):
    """Expected on CPU, so not in every stage's output (`megarl doctor` reports the kernels)."""
    import logging

    from megarl.ops import _ext

    monkeypatch.setattr(_ext, "_ext", _ext._UNLOADED)
    caplog.set_level(logging.DEBUG, logger="megarl.ops")
    assert _ext.load() is None and _ext.load() is None
    assert [r.levelno for r in caplog.records if "CUDA kernels unavailable" in r.getMessage()] == [logging.DEBUG]
