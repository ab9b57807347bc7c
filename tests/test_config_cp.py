"""Context parallelism is refused for the stages that generate (rl, eval), even on a GPU
machine with Transformer Engine, where the generic CP rule passes: megarl's KV-cache attention
has no CP path, so such a run used to be accepted and then fail at the first generation."""
import pytest

from megarl.cli.main import RULES
from megarl.config import check_config, load_config
from megarl.config import validate as validate_mod

CP_OVERRIDES = ["parallel.cp=2", "data.seq_length=128", "rl.max_prompt_len=64", "rl.max_new_tokens=64"]


@pytest.fixture
def te_present(monkeypatch):
    monkeypatch.setattr(validate_mod, "has_module", lambda name: True)  # TE (and apex) importable


@pytest.mark.parametrize("command", ["rl", "eval"])
def test_generating_stages_reject_cp_with_te(te_present, command):
    cfg = load_config("configs/tiny_grpo.yaml", CP_OVERRIDES)
    errs = check_config(cfg, world_size=2, cuda=True, stage=RULES[command])
    cp_errs = [e for e in errs if "parallel.cp" in e]
    assert len(cp_errs) == 1 and "parallel.cp=2" in cp_errs[0] and "set parallel.cp=1" in cp_errs[0], errs
    assert "\n" not in cp_errs[0]


def test_non_generating_stage_keeps_cp_with_te(te_present):
    cfg = load_config("configs/tiny_sft.yaml", ["parallel.cp=2", "data.seq_length=128"])
    assert [e for e in check_config(cfg, world_size=2, cuda=True) if "parallel.cp" in e] == []


def test_cli_validate_rl_rejects_cp_in_one_line(tmp_path):
    from megarl_run import megarl

    out = megarl(["validate", "--config", "configs/tiny_grpo.yaml", "--stage", "rl", "--world-size", "2",
                  *CP_OVERRIDES], check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert sum("the rl and eval stages generate" in line for line in out.stderr.splitlines()) == 1, out.stderr
