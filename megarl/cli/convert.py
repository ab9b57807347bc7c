"""`megarl convert`: Hugging Face directories <-> megarl checkpoints.

hf-to-megarl writes a one-role checkpoint (weights only) that any stage can start from with
`model.init_from: <out>`, plus `<out>/model.yaml`, the `model:` section matching the weights.
megarl-to-hf gathers a checkpoint's weights (whatever layout saved them) into an HF directory.
Both run as a single process: resharding is dist_checkpointing's job, not the converter's.
"""
from __future__ import annotations

import dataclasses
import os

import yaml

from megarl.config import ConfigError, load_config


def _single_process():
    from megarl.runtime.distributed import init_distributed

    init_distributed(1, 1, 1, seed=0)


def hf_to_megarl(hf_dir: str, out: str, role_name: str = "sft") -> str:
    from megarl.checkpoint.distributed import save_checkpoint
    from megarl.checkpoint.hf import load_hf_checkpoint
    from megarl.config import ParallelConfig
    from megarl.models.layout import load_full_state_dict
    from megarl.roles.role import Role
    from megarl.runtime.distributed import teardown

    model_cfg, weights = load_hf_checkpoint(hf_dir)
    _single_process()
    try:
        role = Role(role_name, model_cfg, ParallelConfig())
        load_full_state_dict(role.model, weights, model_cfg.vocab_size)
        del weights
        path = save_checkpoint(out, 0, {role_name: role}, {"source": os.path.abspath(hf_dir)}, keep_last=1)
        with open(os.path.join(out, "model.yaml"), "w") as f:
            yaml.safe_dump({"model": dataclasses.asdict(model_cfg)}, f, sort_keys=False)
        return path
    finally:
        teardown()


def _config_for(checkpoint: str, config: str | None, overrides) -> str:
    """The stage's config.yaml next to its checkpoints unless one is given."""
    if config:
        return config
    for up in (os.path.join(checkpoint, "..", "config.yaml"), os.path.join(checkpoint, "..", "..", "config.yaml")):
        if os.path.isfile(up):
            return os.path.normpath(up)
    raise ConfigError(f"{checkpoint}: no config.yaml next to it; pass --config with the model section")


def megarl_to_hf(checkpoint: str, out: str, arch: str, config: str | None, overrides=(), tokenizer: str | None = None) -> None:
    from megarl.checkpoint.distributed import latest_checkpoint, load_weights
    from megarl.checkpoint.hf import save_hf_checkpoint
    from megarl.config import ParallelConfig
    from megarl.models.layout import gather_full_state_dict
    from megarl.roles.role import Role
    from megarl.runtime.distributed import teardown

    cfg = load_config(_config_for(checkpoint, config, overrides), overrides)
    path = latest_checkpoint(checkpoint) if os.path.isfile(os.path.join(checkpoint, "latest")) else checkpoint
    if path is None:
        raise ConfigError(f"{checkpoint}: no checkpoint")
    tok_dir = tokenizer or (cfg.tokenizer.path if cfg.tokenizer.kind == "hf" else None)
    _single_process()
    try:
        role = Role("export", cfg.model, ParallelConfig())
        load_weights(path, role)
        canonical = gather_full_state_dict(role.model, cfg.model.vocab_size)
        save_hf_checkpoint(out, cfg.model, canonical, arch, tokenizer_dir=tok_dir)
    finally:
        teardown()


ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
        "mistral": "MistralForCausalLM"}


def run(args) -> int:
    try:
        if args.direction == "hf-to-megarl":
            path = hf_to_megarl(args.hf, args.out, args.role)
            print(f"wrote {path} (model section: {os.path.join(args.out, 'model.yaml')})")
        else:
            megarl_to_hf(args.checkpoint, args.out, ARCH[args.arch], args.config, args.overrides, args.tokenizer)
            print(f"wrote {args.out}")
    except (ValueError, FileExistsError) as e:  # hf.py reports unsupported or broken inputs by name
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(str(e)) from e
    return 0
