"""Where a role's weights come from, and the RL roles built from them: one module for the RL
stage, `megarl eval` and the pre-flight checks.

A source is a stage of this run dir (`sft`, `reward_model`: its latest checkpoint), a megarl
checkpoint (root or step dir), a Hugging Face directory (config.json + safetensors), or
`random` (train.seed's layout-invariant initialisation, for tests and benchmarks).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os

from megarl import algorithms as A
from megarl.config import Config, ConfigError
from megarl.config.schema import role_config

log = logging.getLogger("megarl")

STAGE_COMMANDS = {"sft": "megarl sft", "reward_model": "megarl rm"}  # stage sources and what makes them
LM_ROLES = ("sft", "actor", "reference")  # checkpoint role names whose output layer is an LM head
ROLE_ALTERNATIVE = "or point it at a checkpoint or Hugging Face directory"


def _stage_root(cfg: Config, stage: str) -> str:
    return os.path.join(os.path.abspath(cfg.train.run_dir), stage, "checkpoints")


def source_errors(cfg: Config, source: str | None, key: str, alternative: str = ROLE_ALTERNATIVE) -> list[str]:
    """What stops `source` from being loaded, one line (cheap: run before anything is written)."""
    if not source or source == "random":
        return []
    if source in STAGE_COMMANDS:
        root = _stage_root(cfg, source)
        if not os.path.isfile(os.path.join(root, "latest")):
            return [f"{key}={source}: no checkpoint at {root}; run `{STAGE_COMMANDS[source]}` with the same "
                    f"train.run_dir first, {alternative}"]
        return []
    if not os.path.exists(source):
        return [f"{key}: {source} does not exist"]
    return []


def resolve_source(cfg: Config, source: str, key: str) -> str:
    """The directory `source` stands for: a stage's latest (verified) checkpoint, a checkpoint
    root's latest step, or the path itself (a step dir or an HF directory)."""
    from megarl.checkpoint.distributed import latest_checkpoint, resolve_checkpoint

    errs = source_errors(cfg, source, key)
    if errs:
        raise ConfigError(errs[0])
    if source in STAGE_COMMANDS:
        return latest_checkpoint(_stage_root(cfg, source))
    return resolve_checkpoint(source)


def init_weights(cfg: Config, role, model_cfg=None, skip_head: bool = False, key: str = "model.init_from") -> None:
    """model.init_from: a Hugging Face directory (config.json) or a megarl checkpoint.

    skip_head: keep the role's own output layer (a scalar head on an LM's backbone). key: the
    setting errors name (an RL role's roles.<name>.init_from)."""
    from megarl.checkpoint.distributed import CheckpointError

    src = (model_cfg or cfg.model).init_from
    if not src:
        return
    if not os.path.exists(src):
        raise ConfigError(f"{key}: {src} does not exist")
    if os.path.isfile(os.path.join(src, "config.json")):
        from megarl.checkpoint.hf import check_hf_model, load_hf_checkpoint
        from megarl.models.layout import load_full_state_dict

        try:
            check_hf_model(src, model_cfg or cfg.model)  # one line naming the fields, not the loader's traceback
            _, weights = load_hf_checkpoint(src, lazy=True)  # each rank reads only its stage's tensors
        except (ValueError, CheckpointError) as e:
            raise ConfigError(f"{key}: {e}") from e
        load_full_state_dict(role.model, weights, (model_cfg or cfg.model).vocab_size,
                             skip_prefixes=("output_layer.",) if skip_head else ())
        if role.optimizer is not None:  # bf16/fp16: the optimizer's fp32 main copy follows the new weights
            role.optimizer.reload_model_params()
        return
    from megarl.checkpoint.distributed import load_weights, resolve_checkpoint

    load_weights(resolve_checkpoint(src), role, skip_head=skip_head)


def load_role_weights(cfg: Config, role, source: str, key: str) -> str:
    """Initialise `role` from `source` (see the module docstring); returns what it was loaded from.
    A scalar head started from an LM checkpoint keeps its fresh head (the reverse is an error)."""
    from megarl.checkpoint.distributed import MANIFEST, load_weights

    if source == "random":
        return "random initialisation"
    path = resolve_source(cfg, source, key)
    if os.path.isfile(os.path.join(path, "config.json")):  # Hugging Face: an LM (a scalar role keeps its head)
        init_weights(cfg, role, dataclasses.replace(role.model_cfg, init_from=path), skip_head=role.head != "lm",
                     key=key)
        return path
    with open(os.path.join(path, MANIFEST)) as f:
        manifest = json.load(f)
    saved = manifest["roles"]
    name = role.name if role.name in saved else (saved[0] if len(saved) == 1 else None)
    if name is None:
        raise ConfigError(f"{key}: {path} holds roles {', '.join(saved)}; none is named {role.name}")
    saved_head = "lm" if name in LM_ROLES else "scalar"
    if saved_head == "scalar" and role.head == "lm":
        raise ConfigError(f"{key}: {path} holds a scalar-head model ({name}); the {role.name} needs a language model")
    if name in (manifest.get("lora") or {}):  # LoRA adapters alone (a LoRA SFT's): their base first
        if not role.model_cfg.init_from:
            raise ConfigError(f"{key}: {path} holds LoRA adapters only; set model.init_from to their base model")
        init_weights(cfg, role, role.model_cfg, key="model.init_from")
    load_weights(path, role, saved_role=name, skip_head=saved_head != role.head)
    if role.name == "reward":  # read it the way it was trained (reward_model.pooling)
        from megarl.checkpoint.distributed import saved_reward_pooling

        role.reward_pooling = saved_reward_pooling(path, name)
    return path


# ---------------------------------------------------------------------------------------------
# The RL roles


def needed_roles(cfg: Config) -> list[str]:
    """Which roles exist follows the algorithm and the reward (algorithms/spec.py). A LoRA actor
    is its own reference, the same weights with the adapters off: no reference role is built."""
    return [n for n in A.needed_roles(cfg.rl) if not (n == "reference" and lora_reference(cfg))]


def lora_reference(cfg: Config) -> bool:
    """Whether the KL's reference is the LoRA actor with its adapters disabled."""
    return "reference" in A.needed_roles(cfg.rl) and role_config(cfg, "actor").model.lora is not None


def dpo_roles(cfg: Config) -> list[str]:
    """DPO's policy (the actor) and, unless the loss is reference-free, its reference."""
    return ["actor"] + ([] if cfg.dpo.loss in A.REFERENCE_FREE else ["reference"])


def role_source_errors(cfg: Config, names: list[str] | None = None) -> list[str]:
    """source_errors for every RL role (or `names`; actor and reference both from "sft": one line),
    then what the source holds against what the role needs: an architecture megarl reads, the
    model shape, an LM head for the actor and reference. All before anything is written."""
    errs, seen = [], set()
    for name in needed_roles(cfg) if names is None else names:
        rc = role_config(cfg, name)
        key = f"roles.{name}.init_from"
        if (rc.init_from, name in LM_ROLES) in seen:
            continue
        seen.add((rc.init_from, name in LM_ROLES))
        found = source_errors(cfg, rc.init_from, key)
        if not found and rc.init_from != "random":
            found = content_errors(_peek(cfg, rc.init_from), key, rc.model, name)
        errs += found
    return errs


def _peek(cfg: Config, source: str) -> str:
    """The directory `source` names, without verifying a checkpoint (pre-flight is cheap)."""
    root = _stage_root(cfg, source) if source in STAGE_COMMANDS else source
    pointer = os.path.join(root, "latest")
    if os.path.isfile(pointer):
        with open(pointer) as f:
            return os.path.join(root, f.read().strip())
    return root


def content_errors(path: str, key: str, model_cfg, role_name: str) -> list[str]:
    """What in `path` (an HF directory or a megarl step dir) does not fit role `role_name` with
    `model_cfg`, one line naming `key`."""
    from megarl.checkpoint.distributed import MANIFEST, SHAPE_KEYS, CheckpointError, model_shape

    if os.path.isfile(os.path.join(path, "config.json")):
        from megarl.checkpoint.hf import check_hf_model

        try:
            check_hf_model(path, model_cfg)
        except CheckpointError as e:
            return [f"{key}: {e}"]
        return []
    manifest = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest):
        return []  # a partial or foreign directory: the load names it (with the last good checkpoint)
    with open(manifest) as f:
        m = json.load(f)
    saved = m.get("roles", [])
    name = role_name if role_name in saved else (saved[0] if len(saved) == 1 else None)
    if name is None:
        return [f"{key}: {path} holds roles {', '.join(saved)}; none is named {role_name}"]
    if role_name in LM_ROLES and name not in LM_ROLES:
        return [f"{key}: {path} holds a scalar-head model ({name}); the {role_name} needs a language model"]
    have, want = (m.get("models") or {}).get(name), model_shape(model_cfg)
    diff = [f"{k}={have[k]} (config: {want[k]})" for k in SHAPE_KEYS if have and k in have and have[k] != want[k]]
    if diff:
        return [f"{key}: {path}: the saved model does not match the configured one: model."
                + ", model.".join(diff) + "; use the model section it was saved with"]
    return []


def optimizer_steps(cfg: Config) -> int:
    """The RL LR schedule's length: optimizer steps, not loop steps."""
    return cfg.train.steps * cfg.rl.ppo_epochs * cfg.rl.mini_batches


def build_role(cfg: Config, name: str, *, trained: bool, train_steps: int | None = None):
    """The RL role `name` at the run's layout, its settings resolved (roles.<name> over the
    top-level ones), initialised from roles.<name>.init_from. train_steps: the LR schedule's
    optimizer steps (default: RL's)."""
    from megarl.roles.role import Role

    rc = role_config(cfg, name)
    steps = optimizer_steps(cfg) if train_steps is None else train_steps
    role = Role(name, rc.model, cfg.parallel, head="lm" if name in LM_ROLES else "scalar",
                precision=rc.precision, fp8=cfg.train.fp8, seed=cfg.train.seed,
                optim=rc.optim if trained else None, schedule=rc.lr_schedule, train_steps=steps)
    src = load_role_weights(cfg, role, rc.init_from, f"roles.{name}.init_from")
    log.info("%s initialised from %s", name, src)
    return role


def build_reference(cfg: Config, policy):
    """The frozen reference DPO holds `policy` to: a second model from roles.reference.init_from,
    or, for a LoRA policy, the policy itself with its adapters off (no second model). Callers
    only run the result forward (`forward_collect`). RL's KL reference follows the same rule
    through `needed_roles` / `lora_reference` (its phases tell the actor from the reference)."""
    if role_config(cfg, "actor").model.lora is not None:
        return AdaptersOff(policy)
    return build_role(cfg, "reference", trained=False)


class AdaptersOff:
    """A LoRA policy as its own reference: its forward passes with every adapter off, i.e. the
    frozen base model. It holds nothing of its own."""

    def __init__(self, policy):
        self.policy = policy

    def forward_collect(self, microbatches, collect) -> list:
        from megarl.models.lora import adapters_disabled

        with adapters_disabled(self.policy.model):
            return self.policy.forward_collect(microbatches, collect)


def build_roles(cfg: Config) -> dict:
    """RL's roles (`needed_roles`: a LoRA actor is its own reference, so none is built for it)."""
    return {name: build_role(cfg, name, trained=name in ("actor", "critic")) for name in needed_roles(cfg)}
