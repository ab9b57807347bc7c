"""`megarl convert megarl-to-hf` of a LoRA checkpoint: merged into the base for transformers, or
(--adapter) a peft adapter directory on the HF base; both give megarl's logits (fp32, 1e-4)."""
import dataclasses

import pytest
import torch
import yaml

from dist_helpers import run_distributed
from megarl_run import megarl
from test_convert_cli import hf_llama  # noqa: F401 - the fixture: a random tiny Llama

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
TOL = 1e-4


def _tokens():
    return torch.randint(0, 261, (2, 20), generator=torch.Generator().manual_seed(5))


def _train_body(rank, world_size, hf_dir, root):
    """A LoRA role on the HF base, random non-zero adapters, saved as a one-role checkpoint with
    its config.yaml; returns megarl's logits."""
    from megarl.checkpoint.distributed import save_checkpoint
    from megarl.checkpoint.hf import load_hf_checkpoint
    from megarl.config import Config, ParallelConfig
    from megarl.config.schema import LoRAConfig
    from megarl.models.layout import unwrap
    from megarl.roles.role import Role
    from megarl.runtime.distributed import init_distributed, teardown
    from megarl.trainers.weights import init_weights
    from test_lora import randomise_adapters

    init_distributed(1, 1, seed=1)
    mc, _ = load_hf_checkpoint(hf_dir)
    mc = dataclasses.replace(mc, init_from=hf_dir, lora=LoRAConfig(rank=4, alpha=8.0, targets=[
        "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]))
    role = Role("sft", mc, ParallelConfig(), seed=2)
    init_weights(Config(model=mc), role)
    randomise_adapters(role.model, seed=3)
    save_checkpoint(root, 1, {"sft": role}, {})
    with open(f"{root}/config.yaml", "w") as f:
        yaml.safe_dump({"model": dataclasses.asdict(mc)}, f)
    tokens = _tokens()
    m = unwrap(role.model).eval()
    with torch.no_grad():
        logits = m(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)[..., :mc.vocab_size]
    teardown()
    return logits


def _close(got, want, what):
    err, scale = (got - want).abs().max().item(), want.abs().max().item()
    assert err <= TOL * scale, f"{what}: max abs diff {err:.3g} exceeds {TOL} x {scale:.3g}"


def test_merged_and_peft_exports_match_megarl(tmp_path, request):
    hf_base = request.getfixturevalue("hf_llama")
    root = tmp_path / "ckpt"
    want = run_distributed(_train_body, 1, str(hf_base), str(root))[0]
    megarl(["convert", "megarl-to-hf", "--checkpoint", str(root), "--out", str(tmp_path / "merged"), "--arch", "llama"])
    megarl(["convert", "megarl-to-hf", "--checkpoint", str(root), "--out", str(tmp_path / "adapter"), "--arch",
            "llama", "--adapter"])
    tokens, mask = _tokens(), torch.ones(2, 20, dtype=torch.long)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager")
    with torch.no_grad():
        _close(merged(input_ids=tokens, attention_mask=mask).logits, want, "merged export")
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_base, attn_implementation="eager")
    with torch.no_grad():
        plain = base(input_ids=tokens, attention_mask=mask).logits
    assert (plain - want).abs().max() > 100 * TOL * want.abs().max()  # the adapters matter
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    assert sorted(adapted.peft_config["default"].target_modules) == [
        "down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    with torch.no_grad():
        _close(adapted(input_ids=tokens, attention_mask=mask).logits, want, "peft adapter")
    # --adapter of a model without model.lora: one line, before anything is built
    from megarl.cli.convert import megarl_to_hf
    from megarl.config import ConfigError

    dense = tmp_path / "dense.yaml"
    model = yaml.safe_load((root / "config.yaml").read_text())["model"]
    dense.write_text(yaml.safe_dump({"model": {**model, "lora": None}}))
    with pytest.raises(ConfigError, match="no model.lora"):
        megarl_to_hf(str(root), str(tmp_path / "x"), "LlamaForCausalLM", str(dense), adapter=True)
