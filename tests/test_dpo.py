"""DPO, IPO and SimPO (megarl/algorithms/preference.py) against float64 references written here,
and the DPO stage's pieces that reduce a model's output to per-pair sums."""
import math
import os
import subprocess
import sys

import pytest
import torch

from megarl.algorithms import preference_loss


def _inputs(n, seed):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(4, n, generator=g, dtype=torch.float64) * 60  # policy c, r; reference c, r
    lengths = torch.randint(1, 40, (2, n), generator=g)
    return logp, lengths


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def reference_loss(kind, pc, pr, rc, rr, nc, nr, beta, eps, gamma) -> float:
    """The papers' per-pair losses in float64 Python arithmetic, summed over pairs."""
    total = 0.0
    for i in range(len(pc)):
        if kind == "sigmoid":  # Rafailov et al. (2023) eq. 7; cDPO: labels flipped with probability eps
            h = beta * ((pc[i] - rc[i]) - (pr[i] - rr[i]))
            total += -(1 - eps) * _log_sigmoid(h) - eps * _log_sigmoid(-h)
        elif kind == "ipo":  # Azar et al. (2023) eq. 17, tau = beta, on per-token log-ratios
            d = (pc[i] - rc[i]) / nc[i] - (pr[i] - rr[i]) / nr[i]
            total += (d - 1 / (2 * beta)) ** 2
        else:  # SimPO, Meng et al. (2024) eq. 6
            total += -_log_sigmoid(beta * pc[i] / nc[i] - beta * pr[i] / nr[i] - gamma)
    return total


CASES = [("sigmoid", 0.1, 0.0, 0.0), ("sigmoid", 0.5, 0.2, 0.0), ("ipo", 0.1, 0.0, 0.0), ("ipo", 1.0, 0.0, 0.0),
         ("simpo", 2.0, 0.0, 0.5), ("simpo", 0.3, 0.0, 1.4)]


@pytest.mark.parametrize("kind,beta,eps,gamma", CASES)
def test_loss_and_gradient_match_float64_reference(kind, beta, eps, gamma):
    n = 7
    logp, lengths = _inputs(n, seed=CASES.index((kind, beta, eps, gamma)))
    policy = logp[:2].float().clone().requires_grad_(True)
    ref = None if kind == "simpo" else logp[2:].float()
    loss_sum, count, metrics = preference_loss(kind, policy[0], policy[1], None if ref is None else ref[0],
                                               None if ref is None else ref[1], lengths[0], lengths[1], beta=beta,
                                               label_smoothing=eps, gamma=gamma)
    loss_sum.backward()
    cols = [logp[k].tolist() for k in range(4)] + [lengths[0].tolist(), lengths[1].tolist()]
    want = reference_loss(kind, *cols, beta, eps, gamma)
    assert int(count) == n
    assert float(loss_sum.detach()) == pytest.approx(want, rel=1e-5)
    assert metrics["loss"].tolist() == pytest.approx([want, n], rel=1e-5)
    # gradient w.r.t. each policy log-prob: central differences of the float64 reference
    h = 1e-6
    for side in range(2):
        for i in range(n):
            up, down = [list(c) for c in cols], [list(c) for c in cols]
            up[side][i] += h
            down[side][i] -= h
            fd = (reference_loss(kind, *up, beta, eps, gamma) - reference_loss(kind, *down, beta, eps, gamma)) / (2 * h)
            assert float(policy.grad[side, i]) == pytest.approx(fd, rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("kind", ["sigmoid", "ipo", "simpo"])
def test_implicit_rewards_margin_and_accuracies(kind):
    logp, lengths = _inputs(9, seed=5)
    pc, pr, rc, rr = logp
    beta = 0.25
    _, _, m = preference_loss(kind, pc.float(), pr.float(), rc.float(), rr.float(), lengths[0], lengths[1], beta=beta)
    if kind == "simpo":  # its own reward: beta times the mean token log-prob; no reference
        chosen, rejected = beta * pc / lengths[0], beta * pr / lengths[1]
    else:  # beta * (log pi - log ref), summed over the response (TRL logs these for ipo too)
        chosen, rejected = beta * (pc - rc), beta * (pr - rr)
    for name, want in (("reward_chosen", chosen.mean()), ("reward_rejected", rejected.mean()),
                       ("reward_margin", (chosen - rejected).mean()),
                       ("reward_accuracy", (chosen > rejected).double().mean()),
                       ("likelihood_accuracy", (pc > pr).double().mean()),
                       ("logp_chosen", pc.mean()), ("logp_rejected", pr.mean())):
        total, count = m[name].tolist()
        assert total / count == pytest.approx(float(want), rel=1e-5, abs=1e-6), name


def test_dpo_at_the_reference_is_log_2_and_needs_a_reference():
    x = torch.tensor([-3.0, -5.0])
    loss, n, m = preference_loss("sigmoid", x, x - 1, x, x - 1, torch.tensor([2, 3]), torch.tensor([2, 3]), beta=0.1)
    assert float(loss) / int(n) == pytest.approx(math.log(2))
    assert m["reward_accuracy"].tolist() == [0.0, 2.0]  # a tie is not a win
    with pytest.raises(ValueError, match="needs the reference"):
        preference_loss("ipo", x, x, None, None, torch.tensor([1, 1]), torch.tensor([1, 1]), beta=0.1)
    with pytest.raises(ValueError, match="sigmoid, ipo, simpo"):
        preference_loss("hinge", x, x, x, x, torch.tensor([1, 1]), torch.tensor([1, 1]), beta=0.1)


def test_pair_microbatch_cuts_prompt_columns_and_sums_only_response_tokens():
    """Summed log-probs of the stage's micro-batch equal a full-logits float64 computation."""
    from megarl.data.batching import Collator
    from megarl.models.gpt import HeadStates
    from megarl.ops import IGNORE_INDEX
    from megarl.trainers.dpo import pair_microbatch, sequence_logps

    g = torch.Generator().manual_seed(3)
    items = []
    for plen, clen, rlen in ((5, 4, 6), (3, 7, 2)):
        row = {}
        for side, n in (("chosen", clen), ("rejected", rlen)):
            toks = torch.randint(0, 50, (plen + n,), generator=g).numpy().astype("int32")
            mask = torch.tensor([0] * plen + [1] * n, dtype=torch.uint8).numpy()
            row.update({f"{side}_tokens": toks, f"{side}_target_mask": mask,
                        f"{side}_segment_ids": torch.zeros(plen + n, dtype=torch.int32).numpy()})
        items.append(row)
    batch = Collator("preferences", seq_len=16, pad_id=0)(items)
    mb = pair_microbatch(batch)
    assert mb.output_from == 2 and mb.tokens.shape == (4, 11)  # first response label at column 2; longest row 11
    hidden = torch.randn(4, 11 - mb.output_from, 8, generator=g, dtype=torch.float64)
    weight = torch.randn(50, 8, generator=g, dtype=torch.float64)
    head = HeadStates(hidden.float(), weight.float(), None, 50, True)
    got = sequence_logps(mb, head)
    logp = torch.log_softmax(hidden @ weight.T, -1)
    labels = mb["labels"]
    want = torch.where(labels == IGNORE_INDEX, 0.0,
                       logp.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)).sum(1)
    assert got.tolist() == pytest.approx(want.tolist(), rel=1e-5)
    assert mb["mask"].sum(1).tolist() == [4, 7, 6, 2]  # response tokens: chosen rows, then rejected


def test_dpo_pipeline_stages_are_the_tiny_recipes():
    """tiny_dpo_pipeline.yaml repeats tiny_sft.yaml's and tiny_dpo.yaml's values (its header says so)."""
    from dataclasses import asdict

    from megarl.config import load_config
    from megarl.trainers.pipeline import DEFAULT_STAGES, load_pipeline_config

    stages = load_pipeline_config("configs/tiny_dpo_pipeline.yaml", [])
    for stage, recipe in (("sft", "tiny_sft"), ("dpo", "tiny_dpo")):
        assert asdict(stages[stage]) == asdict(load_config(f"configs/{recipe}.yaml")), stage
    assert "dpo" not in DEFAULT_STAGES  # `megarl pipeline` without --stages runs SFT -> RM -> RL


def test_dpo_config_rules():
    from megarl.config import check_config, load_config

    def errors(*overrides):
        return check_config(load_config("configs/tiny_dpo.yaml", list(overrides)), 1)

    assert errors() == []
    assert errors("dpo.beta=-1") == ["dpo.beta must be > 0, got -1.0"]
    assert errors("dpo.label_smoothing=0.5") == ["dpo.label_smoothing must be in [0, 0.5), got 0.5"]
    assert errors("dpo.loss=ipo", "dpo.label_smoothing=0.1") == [
        "dpo.label_smoothing is conservative DPO's (dpo.loss=sigmoid); dpo.loss=ipo ignores it"]
    assert errors("dpo.loss=sigmoid", "dpo.label_smoothing=0.1") == []


def test_pipeline_summary_gives_dpo_before_and_after(tmp_path):
    import json

    from megarl.trainers.pipeline import summary

    (tmp_path / "dpo").mkdir()
    records = [{"step": 0, "eval/likelihood_accuracy": 0.9, "eval/reward_accuracy": 0.0},
               {"step": 1, "train/loss": 0.6},
               {"step": 60, "eval/likelihood_accuracy": 0.95, "eval/reward_accuracy": 0.875}]
    (tmp_path / "dpo" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    rows = summary(str(tmp_path)).splitlines()[2:]
    assert rows == ["| before DPO (the SFT model) | held-out likelihood accuracy 0.900 |",
                    "| after DPO (step 60) | held-out likelihood accuracy 0.950, reward accuracy 0.875 |"]


# ---------------------------------------------------------------------------- the stage, end to end


def dpo_args(run_dir, *extra):
    from megarl_run import TINY

    # policy and reference from the same random initialisation (no SFT run needed)
    return ["dpo", "--config", "configs/tiny_dpo.yaml", f"train.run_dir={run_dir}", *TINY, "roles.actor.init_from=random",
            "lr_schedule.warmup_steps=0", "optim.lr=1e-3", "train.eval_batches=1", *extra]


def test_without_its_sft_checkpoint_or_with_a_bad_beta_it_is_one_line_and_writes_nothing(tmp_path):
    from megarl_run import megarl

    run = tmp_path / "run"
    for extra, line in (((), "megarl: error: roles.actor.init_from=sft: no checkpoint at "),
                        (("dpo.beta=0",), "dpo.beta must be > 0, got 0.0")):
        out = megarl(["dpo", "--config", "configs/tiny_dpo.yaml", f"train.run_dir={run}", *extra], check=False)
        assert out.returncode == 2 and line in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not run.exists()


@pytest.mark.slow
def test_megarl_dpo_learns_logs_checkpoints_and_resumes_exactly(tmp_path):
    """4 steps in one go against 2 steps, then the same run dir to 4 (resumed from step 2). The
    train split is one batch of 8 pairs, so the loss of every step reads the same pairs."""
    import json
    import os

    from megarl.checkpoint.distributed import MANIFEST
    from megarl_run import megarl, metrics

    steps = ("train.eval_interval=2", "checkpoint.save_interval=2", "data.synthetic.n_train=8")
    megarl(dpo_args(tmp_path / "a", "train.steps=4", *steps))
    megarl(dpo_args(tmp_path / "b", "train.steps=2", *steps))
    out = megarl(dpo_args(tmp_path / "b", "train.steps=4", *steps))
    assert "resumed dpo from" in out.stdout
    stage = tmp_path / "a" / "dpo"
    records = metrics(stage)
    assert records == metrics(tmp_path / "b" / "dpo")
    train = [r for r in records if "train/loss" in r]
    evals = [r for r in records if "eval/loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4] and [r["step"] for r in evals] == [0, 2, 4]
    for key in ("loss", "reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy", "likelihood_accuracy"):
        assert all(f"train/{key}" in r for r in train) and all(f"eval/{key}" in r for r in evals), key
    assert evals[0]["eval/loss"] == pytest.approx(math.log(2), abs=1e-6)  # the policy is its reference
    assert train[0]["train/loss"] == pytest.approx(math.log(2), abs=1e-6)
    losses = [r["train/loss"] for r in train]
    assert losses == sorted(losses, reverse=True) and train[-1]["train/reward_margin"] > 0, losses
    with open(stage / "checkpoints" / "latest") as f:
        latest = f.read().strip()
    with open(stage / "checkpoints" / latest / MANIFEST) as f:
        assert json.load(f)["roles"] == ["actor"]  # `megarl eval` and RL's actor read it
    assert os.path.isfile(stage / "config.yaml")


@pytest.mark.slow
def test_lora_dpo_holds_the_policy_to_its_base_with_no_second_model(tmp_path):
    """model.lora: the reference is the actor with its adapters off (weights.AdaptersOff), so
    the first step starts at log 2, as with a second model from the SFT checkpoint, and the
    checkpoint holds the adapters alone."""
    import json

    from megarl.checkpoint.distributed import MANIFEST
    from megarl_run import megarl, metrics

    out = megarl(dpo_args(tmp_path / "a", "train.steps=3", "model.lora.rank=4", "optim.lr=1e-2",
                          "train.eval_interval=3", "data.synthetic.n_train=8"))
    assert "the reference is the actor with its LoRA adapters off" in out.stdout
    records = metrics(tmp_path / "a" / "dpo")
    train = [r for r in records if "train/loss" in r]
    assert train[0]["train/loss"] == pytest.approx(math.log(2), abs=1e-6)  # B = 0: the policy is its base
    assert train[-1]["train/loss"] < train[0]["train/loss"] and train[-1]["train/reward_margin"] > 0
    ckpt = tmp_path / "a" / "dpo" / "checkpoints"
    with open(ckpt / (ckpt / "latest").read_text().strip() / MANIFEST) as f:
        manifest = json.load(f)
    assert manifest["roles"] == ["actor"] and manifest["lora"]["actor"]["rank"] == 4


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2"])
def test_dp2_tp2_and_pp2_match_one_process(tmp_path, layout):
    from megarl_run import megarl, metrics

    steps = ("train.steps=2", "train.eval_interval=2")
    megarl(dpo_args(tmp_path / "one", *steps))
    extra = {"dp2": (), "tp2": ("parallel.tp=2",), "pp2": ("parallel.pp=2",)}[layout]
    megarl(dpo_args(tmp_path / layout, *steps, *extra), nproc=2)
    ref, got = metrics(tmp_path / "one" / "dpo"), metrics(tmp_path / layout / "dpo")
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    for a, b in zip(ref, got):
        for k in a:
            if k.startswith(("train/", "eval/")) and k != "train/lr":
                assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), (layout, a["step"], k)


# ---------------------------------------------------------------------------- against TRL

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRL_PYTHON = os.environ.get("MEGARL_TRL_PYTHON") or os.path.join(REPO, "bench", ".venv-trl", "bin", "python")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(TRL_PYTHON),
                    reason="TRL is not a test dependency: needs its venv (bench/.venv-trl, which bench/bench_rl_step.py "
                           "creates, or $MEGARL_TRL_PYTHON)")
def test_losses_and_metrics_equal_trls_on_the_same_batch_and_weights():
    """bench/trl_dpo_check.py: DPOTrainer's sigmoid and ipo, CPOTrainer's simpo, on the same pairs
    and two random Llamas exported from megarl; it exits 1 beyond 1e-4."""
    out = subprocess.run([sys.executable, os.path.join(REPO, "bench", "trl_dpo_check.py"), "--trl-python", TRL_PYTHON],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "largest difference" in out.stdout and out.stdout.count(" TRL ") == 33
