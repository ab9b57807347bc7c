"""Each RL algorithm defined once (megarl/algorithms/spec.py): its advantages against float64
references, its whitening default and override, the roles it needs, the config rules it brings,
the docs table; DAPO's group filter and overlong penalty against plain loops."""
import re
from pathlib import Path

import pytest
import torch

from megarl.algorithms import (ALGORITHMS, AdvantageSettings, compute_advantages, config_errors, groups_with_signal,
                               needed_roles, overlong_penalty)
from megarl.config import load_config
from megarl.config.schema import RLConfig

torch.set_num_threads(1)
DOC = Path(__file__).resolve().parents[1] / "docs" / "ARCHITECTURE.md"


def _batch(seed, groups=3, n=4, T=9):
    g = torch.Generator().manual_seed(seed)
    N = groups * n
    lens = torch.randint(2, T + 1, (N,), generator=g)
    mask = torch.arange(T)[None, :] < lens[:, None]
    mask[0, 1] = False  # a hole (an observation token) inside a response
    scores = torch.randn(N, generator=g)
    values = torch.randn(N, T, generator=g)
    penalty = torch.rand(N, T, generator=g) * 0.1 * mask
    return scores, mask, values, penalty


def _reference(name, scores, mask, values, penalty, s: AdvantageSettings):
    """float64 loops: per-token advantages before whitening."""
    N, T = mask.shape
    n = s.group_size
    out = [[0.0] * T for _ in range(N)]
    if name in ("grpo", "rloo", "reinforce"):
        seq = [scores[i].item() - sum(penalty[i, t].item() for t in range(T) if mask[i, t]) for i in range(N)]
        for i in range(N):
            grp = seq[(i // n) * n:(i // n + 1) * n]
            mean = sum(grp) / n
            if name == "grpo":
                std = (sum((x - mean) ** 2 for x in grp) / (n - 1)) ** 0.5
                a = (seq[i] - mean) / (std + 1e-6)
            elif name == "rloo":
                a = seq[i] - (sum(grp) - seq[i]) / (n - 1)
            else:
                a = seq[i] - mean
            for t in range(T):
                out[i][t] = a if mask[i, t] else 0.0
        return out
    for i in range(N):  # token-level: score on the last valid token minus the penalty
        valid = [t for t in range(T) if mask[i, t]]
        r = {t: -penalty[i, t].item() for t in valid}
        r[valid[-1]] += scores[i].item()
        a_next = v_next = 0.0
        for t in reversed(valid):
            if name == "ppo":
                delta = r[t] + s.gamma * v_next - values[i, t].item()
                a_next = delta + s.gamma * s.lam * a_next
                v_next = values[i, t].item()
            else:  # return-to-go
                a_next = r[t] + s.gamma * a_next
            out[i][t] = a_next
    return out


def _whitened(ref, mask):
    vals = [ref[i][t] for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]]
    mean = sum(vals) / len(vals)
    std = (sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5
    return [[(x - mean) / std if mask[i, t] else 0.0 for t, x in enumerate(row)] for i, row in enumerate(ref)]


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
@pytest.mark.parametrize("whiten", [None, True, False])
def test_every_algorithm_against_float64(name, whiten):
    scores, mask, values, penalty = _batch(7)
    s = AdvantageSettings(group_size=4, gamma=0.95, lam=0.9)
    spec = ALGORITHMS[name]
    adv, returns = compute_advantages(spec, scores, mask, s, kl_penalty=penalty, values=values,
                                      whiten_advantages=whiten)
    ref = _reference(name, scores, mask, values, penalty, s)
    if (spec.whiten if whiten is None else whiten):
        ref = _whitened(ref, mask)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv.double(), torch.tensor(ref, dtype=torch.float64), rtol=1e-5, atol=1e-5)
    assert (returns is not None) == spec.critic


def test_whiten_advantages_false_is_honoured_for_reinforce_pp():
    """The schema's rl.whiten_advantages=false used to be ignored for reinforce_pp (it whitened
    inside its estimator): now the raw return-to-go comes out."""
    scores, mask, values, penalty = _batch(3)
    s = AdvantageSettings(group_size=4, gamma=1.0)
    raw, _ = compute_advantages(ALGORITHMS["reinforce_pp"], scores, mask, s, whiten_advantages=False)
    default, _ = compute_advantages(ALGORITHMS["reinforce_pp"], scores, mask, s)
    ref = torch.tensor(_reference("reinforce_pp", scores, mask, values, torch.zeros_like(values), s))
    torch.testing.assert_close(raw.double(), ref.double(), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(raw, default, atol=1e-3)
    assert abs(default[mask].mean().item()) < 1e-5  # whitened by default


def test_the_docs_table_is_the_spec():
    text = DOC.read_text()
    rows = re.findall(r"^\| `(\w+)` \| (.*?) \| .*? \| (yes|no) \| (.*?) \|$", text, re.M)
    assert {r[0] for r in rows} == set(ALGORITHMS)
    for name, roles, whitened, fields in rows:
        spec = ALGORITHMS[name]
        assert ("critic" in roles) == spec.critic, name
        assert (whitened == "yes") == spec.whiten, name
        assert set(re.findall(r"`(\w+)`", fields)) == set(spec.fields), name


@pytest.mark.parametrize("overrides, roles", [
    ([], ["actor"]),
    (["rl.kl_coef=0.1"], ["actor", "reference"]),
    (["rl.algorithm=ppo", "rl.reward_fn=null", "rl.reward_model_coef=1"], ["actor", "critic", "reward"]),
    (["rl.algorithm=reinforce_pp", "rl.kl_coef=0.05", "rl.kl_target=0.01"], ["actor", "reference"]),
])
def test_roles_follow_the_algorithm(overrides, roles):
    assert needed_roles(load_config("configs/tiny_grpo.yaml", overrides).rl) == roles


@pytest.mark.parametrize("overrides, error", [
    (["rl.algorithm=grpoo"], "rl.algorithm: 'grpoo' is not one of grpo"),
    (["rl.algorithm=rloo", "rl.samples_per_prompt=1"], "rl.samples_per_prompt must be >= 2"),
    (["rl.lam=0.9"], "rl.lam=0.9 has no effect with rl.algorithm=grpo (read only by ppo)"),
    (["rl.algorithm=ppo", "rl.scale_by_std=false"], "rl.scale_by_std=False has no effect with rl.algorithm=ppo"),
    (["rl.algorithm=reinforce_pp", "rl.dynamic_sampling=true"], "rl.dynamic_sampling keeps prompt groups"),
    (["roles.critic.offload.params=true"], "roles.critic.offload.params=true: this run has no critic"),
    (["roles.reference.offload.optimizer=true"], "roles.reference.offload.optimizer=true: this run has no reference"),
    (["rl.overlong=soft", "rl.overlong_buffer=0"], "rl.overlong_buffer (0) must be in [1, rl.max_new_tokens=24]"),
])
def test_config_rules_of_the_algorithm(overrides, error):
    from megarl.config import check_config

    errs = check_config(load_config("configs/tiny_grpo.yaml", overrides), 1, stage="rl")
    assert any(error in e for e in errs), errs


def test_settings_of_the_algorithm_in_use_are_fine():
    cfg = load_config("configs/tiny_ppo.yaml", ["rl.lam=0.9", "rl.gamma=0.99"])
    assert config_errors(cfg.rl, RLConfig()) == []
    cfg = load_config("configs/tiny_dapo.yaml")
    assert config_errors(cfg.rl, RLConfig()) == []


def test_groups_with_signal():
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.7])
    assert groups_with_signal(scores, 3).tolist() == [False, False, True]
    with pytest.raises(ValueError):
        groups_with_signal(scores, 4)


@pytest.mark.parametrize("max_new, buffer, factor", [(24, 8, 1.0), (10, 10, 0.5), (64, 1, 2.0)])
def test_overlong_penalty_against_float64(max_new, buffer, factor):
    lens = torch.randint(1, max_new + 1, (200,), generator=torch.Generator().manual_seed(max_new))
    got = overlong_penalty(lens, max_new, buffer, factor)
    for y, p in zip(lens.tolist(), got.tolist()):
        start = max_new - buffer
        want = 0.0 if y <= start else factor * (start - y) / buffer  # DAPO eq. 13, y <= max_new always
        assert p == pytest.approx(want, abs=1e-6)
    assert got[lens == max_new].eq(-factor).all() and got[lens <= max_new - buffer].eq(0).all()
    with pytest.raises(ValueError):
        overlong_penalty(lens, max_new, max_new + 1)
