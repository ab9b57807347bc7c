"""`megarl convert`: Hugging Face directories <-> megarl checkpoints.

hf-to-megarl writes a one-role checkpoint (weights only) that any stage can start from with
`model.init_from: <out>` (`roles.actor.init_from` for RL), plus `<out>/config.yaml`, the `model:`
section matching the weights and the `tokenizer:` it came with (the file megarl-to-hf reads next
to a checkpoint, as it reads a stage's config.yaml). The HF tokenizer's files are copied into
`<out>/tokenizer/`, so that the export finds them after the HF directory is gone; an HF directory
without them is recorded as such, and its export then asks for --tokenizer instead of writing
megarl's byte tokenizer for a model that never used it.
Both refuse a non-empty destination unless given --overwrite.
megarl-to-hf gathers a checkpoint's weights (whatever layout saved them) into an HF directory
that transformers uses as it is: the tokenizer's special ids in config.json, a
generation_config.json that stops at the chat's end-of-turn token(s), and the tokenizer (the
HF tokenizer's files, or for the byte tokenizer an equivalent tokenizer.json).
Both run as a single process: resharding is dist_checkpointing's job, not the converter's.
"""
from __future__ import annotations

import dataclasses
import os
import shutil

import yaml

from megarl.config import ConfigError, load_config
from megarl.config.hf import MODEL_TYPES
from megarl.utils.atomic import atomic_directory, write_atomic


def _single_process():
    from megarl.runtime.distributed import init_distributed

    init_distributed(1, 1, 1, seed=0)


CONFIG_NAME = "config.yaml"
TOKENIZER_DIR = "tokenizer"  # hf-to-megarl's copy of the HF tokenizer, inside the checkpoint root
LEGACY_CONFIG_NAME = "model.yaml"  # what hf-to-megarl wrote before it wrote config.yaml


def _check_destination(out: str, overwrite: bool) -> None:
    """A writing command's destination: absent or an empty directory, or --overwrite."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"--out {out}: is a file, not a directory")
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise ConfigError(f"--out {out}: exists and is not empty; choose a new directory or pass --overwrite to replace it")


def hf_to_megarl(hf_dir: str, out: str, role_name: str = "sft", overwrite: bool = False) -> str:
    from megarl.checkpoint.distributed import save_checkpoint
    from megarl.checkpoint.hf import TOKENIZER_FILES, load_hf_checkpoint
    from megarl.config import ParallelConfig
    from megarl.models.layout import load_full_state_dict
    from megarl.roles.role import Role
    from megarl.runtime.distributed import teardown

    _check_destination(out, overwrite)
    if not os.path.isdir(hf_dir):
        what = "is a file" if os.path.exists(hf_dir) else "does not exist"
        raise ConfigError(f"--hf {hf_dir}: {what}; expected a Hugging Face model directory (config.json + safetensors)")
    model_cfg, weights = load_hf_checkpoint(hf_dir)
    if overwrite and os.path.isdir(out):
        shutil.rmtree(out)
    _single_process()
    try:
        role = Role(role_name, model_cfg, ParallelConfig())
        load_full_state_dict(role.model, weights, model_cfg.vocab_size)
        del weights
        # the tokenizer and config.yaml before the weights: the save's `latest`, written last, marks a whole import
        tok_files = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(hf_dir, f))]
        tok_dir = os.path.abspath(os.path.join(out, TOKENIZER_DIR)) if tok_files else None
        if tok_dir:
            with atomic_directory(tok_dir, replace=True) as tmp:
                for f in tok_files:
                    shutil.copyfile(os.path.join(hf_dir, f), os.path.join(tmp, f))
        write_atomic(os.path.join(out, CONFIG_NAME), yaml.safe_dump(
            {"model": dataclasses.asdict(model_cfg), "tokenizer": {"kind": "hf", "path": tok_dir}}, sort_keys=False))
        return save_checkpoint(out, 0, {role_name: role}, {"source": os.path.abspath(hf_dir)}, keep_last=1)
    finally:
        teardown()


def _config_for(checkpoint: str, config: str | None, overrides) -> str:
    """The stage's config.yaml next to its checkpoints unless one is given."""
    if config:
        return config
    for where in (checkpoint, os.path.join(checkpoint, ".."), os.path.join(checkpoint, "..", "..")):
        for name in (CONFIG_NAME, LEGACY_CONFIG_NAME):
            if os.path.isfile(os.path.join(where, name)):
                return os.path.normpath(os.path.join(where, name))
    raise ConfigError(f"{checkpoint}: no {CONFIG_NAME} next to it; pass --config with the model section")


def megarl_to_hf(checkpoint: str, out: str, arch: str, config: str | None, overrides=(), tokenizer: str | None = None,
                 overwrite: bool = False, adapter: bool = False) -> None:
    """A LoRA checkpoint (model.lora) loads onto its base (model.init_from); the adapters are
    merged into the base weights, or with `adapter` written as a peft adapter directory."""
    from megarl.checkpoint.distributed import load_weights, resolve_checkpoint
    from megarl.checkpoint.hf import save_hf_checkpoint
    from megarl.config import ParallelConfig
    from megarl.models.layout import gather_full_state_dict
    from megarl.roles.role import Role
    from megarl.runtime.distributed import teardown

    from megarl.checkpoint.distributed import verify_checkpoint

    _check_destination(out, overwrite)
    if not os.path.exists(checkpoint):
        raise ConfigError(f"--checkpoint {checkpoint}: no such checkpoint (a step directory or a root with 'latest')")
    path = resolve_checkpoint(checkpoint)
    verify_checkpoint(path)  # before any config is looked for: a broken checkpoint is named as such
    config = _config_for(checkpoint, config, overrides)
    cfg = load_config(config, overrides)
    if adapter and cfg.model.lora is None:
        raise ConfigError("--adapter: the checkpoint's model has no model.lora; there are no adapters to write")
    tok_dir = tokenizer or _hf_tokenizer(cfg, config)
    special_ids, generation, files = _tokenizer_export(cfg, tok_dir)
    _single_process()
    try:
        role = Role("export", cfg.model, ParallelConfig())
        if cfg.model.lora is not None:  # the base the adapters load onto: the SFT's, or the RL actor's start
            from megarl.config.schema import role_config
            from megarl.trainers.weights import load_role_weights

            base = cfg.model.init_from or role_config(cfg, "actor").init_from
            if base in (None, "random"):
                raise ConfigError(f"{path}: LoRA adapters need their base; set model.init_from")
            load_role_weights(cfg, role, base, "model.init_from")
        load_weights(path, role)
        canonical = gather_full_state_dict(role.model, cfg.model.vocab_size)
        if cfg.model.lora is not None:
            from megarl.models.lora import merge

            if adapter:
                from megarl.checkpoint.hf import save_peft_adapter

                return save_peft_adapter(out, cfg.model, canonical, base=base, overwrite=overwrite)
            canonical = merge(canonical, cfg.model.lora)
        save_hf_checkpoint(out, cfg.model, canonical, arch, tokenizer_dir=tok_dir, tokenizer_files=files,
                           generation_config=generation, extra_config=special_ids, overwrite=overwrite)
    finally:
        teardown()


def _hf_tokenizer(cfg, config: str) -> str | None:
    """The HF tokenizer directory the model's config names (None: megarl's byte tokenizer);
    ConfigError naming --tokenizer when it names none, or one that is gone."""
    t = cfg.tokenizer
    if t.kind != "hf":
        return None
    if not t.path:
        raise ConfigError(f"{config}: no tokenizer recorded (tokenizer.path is null: the Hugging Face directory it "
                          "was imported from had no tokenizer files); pass --tokenizer DIR (the model's Hugging Face "
                          "tokenizer), or tokenizer.kind=byte if it was trained with megarl's byte tokenizer")
    if not os.path.isdir(t.path):
        raise ConfigError(f"{config}: tokenizer.path {t.path} does not exist; pass --tokenizer DIR (the model's "
                          "Hugging Face tokenizer)")
    return t.path


# megarl's byte chat format (data/tokenizer.py ByteTokenizer.encode_chat) as an HF chat template.
BYTE_CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                      "{{ message['content'] }}<|im_end|>{% endfor %}"
                      "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tokenizer_export(cfg, tok_dir: str | None) -> tuple[dict, dict, dict | None]:
    """(config.json's special ids, generation_config.json, tokenizer files to write or None when
    tok_dir's are copied) for the tokenizer the model was trained with."""
    from megarl.checkpoint.hf import byte_tokenizer_files
    from megarl.data import load_tokenizer

    tok = load_tokenizer("hf", tok_dir) if tok_dir else load_tokenizer(cfg.tokenizer.kind, cfg.tokenizer.path)
    ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    too_big = {k: v for k, v in ids.items() if v is not None and v >= cfg.model.vocab_size}
    if too_big:
        raise ConfigError(f"tokenizer ({tok_dir or cfg.tokenizer.kind}): special ids {too_big} do not fit "
                          f"model.vocab_size {cfg.model.vocab_size}")
    generation = {"bos_token_id": tok.bos_id, "eos_token_id": list(tok.stop_ids), "pad_token_id": tok.pad_id}
    files = None
    if tok.kind == "byte":
        specials = list(tok.SPECIALS)
        files = byte_tokenizer_files(specials, bos=specials[tok.bos_id - 256], eos=specials[tok.eos_id - 256],
                                     pad=specials[tok.pad_id - 256], chat_template=BYTE_CHAT_TEMPLATE,
                                     model_max_length=cfg.model.max_position_embeddings)
    return ids, generation, files


def run(args) -> int:
    try:
        if args.direction == "hf-to-megarl":
            path = hf_to_megarl(args.hf, args.out, args.role, overwrite=args.overwrite)
            print(f"wrote {path} (model section: {os.path.join(args.out, CONFIG_NAME)})")
        else:
            megarl_to_hf(args.checkpoint, args.out, MODEL_TYPES[args.arch], args.config, args.overrides, args.tokenizer,
                         overwrite=args.overwrite, adapter=args.adapter)
            print(f"wrote {args.out}")
    except (ValueError, FileExistsError, NotADirectoryError) as e:  # hf.py reports unsupported or broken inputs by name
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(str(e)) from e
    return 0
