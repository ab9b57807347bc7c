"""Cross-field rules, checked before any process group or model exists.

`check_config` returns every violation as one line; `validate_config` raises them together,
so a user fixes a config in one round instead of one error per launch.
"""
from __future__ import annotations

import importlib.util

import torch

from megarl.config.loader import ConfigError
from megarl.config.schema import Config, ModelConfig


def has_module(name: str) -> bool:
    """Whether an optional package is importable, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


TE_HINT = "install Transformer Engine: pip install 'megarl[gpu]' (CUDA machines only)"
DALI_HINT = "install NVIDIA DALI: pip install 'megarl[dali]'"
APEX_HINT = "install NVIDIA apex from source (github.com/NVIDIA/apex) or Transformer Engine: pip install 'megarl[gpu]'"


def data_parallel_size(cfg: Config, world_size: int) -> int:
    p = cfg.parallel
    return cfg.parallel.dp if p.dp is not None else max(world_size // (p.tp * p.pp * p.cp), 1)


def _model_rules(m: ModelConfig, cfg: Config, where: str, cuda: bool) -> list[str]:
    p, errs = cfg.parallel, []
    kv = m.num_kv_heads or m.num_attention_heads
    for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size",
                 "max_position_embeddings", "make_vocab_size_divisible_by"):
        if getattr(m, name) < 1:
            errs.append(f"{where}.{name} must be >= 1, got {getattr(m, name)}")
    if errs:
        return errs
    if m.head_dim is not None and m.head_dim < 1:
        errs.append(f"{where}.head_dim must be >= 1 (or null for hidden_size / num_attention_heads), got {m.head_dim}")
    if m.head_dim is None and m.hidden_size % m.num_attention_heads:
        errs.append(f"{where}.hidden_size ({m.hidden_size}) must be divisible by {where}.num_attention_heads ({m.num_attention_heads})")
    if m.num_attention_heads % p.tp:
        errs.append(f"{where}.num_attention_heads ({m.num_attention_heads}) must be divisible by parallel.tp ({p.tp})")
    if kv < 1 or kv % p.tp:
        errs.append(f"{where}.num_kv_heads ({kv}) must be divisible by parallel.tp ({p.tp})")
    if kv >= 1 and m.num_attention_heads % kv:
        errs.append(f"{where}.num_attention_heads ({m.num_attention_heads}) must be divisible by {where}.num_kv_heads ({kv})")
    if m.ffn_hidden_size % p.tp:
        errs.append(f"{where}.ffn_hidden_size ({m.ffn_hidden_size}) must be divisible by parallel.tp ({p.tp})")
    if m.num_layers % p.pp:
        errs.append(f"{where}.num_layers ({m.num_layers}) must be divisible by parallel.pp ({p.pp})")
    if cfg.data.seq_length > m.max_position_embeddings:
        errs.append(f"data.seq_length ({cfg.data.seq_length}) exceeds {where}.max_position_embeddings ({m.max_position_embeddings})")
    if m.transformer_impl == "transformer_engine":
        if not has_module("transformer_engine"):
            errs.append(f"{where}.transformer_impl=transformer_engine needs Transformer Engine: {TE_HINT}")
        elif not cuda:
            errs.append(f"{where}.transformer_impl=transformer_engine needs a CUDA GPU; use 'local' or 'auto' on CPU")
    if not 0.0 <= m.attention_dropout < 1 or not 0.0 <= m.hidden_dropout < 1:
        errs.append(f"{where}.attention_dropout and hidden_dropout must be in [0, 1)")
    return errs


def check_config(cfg: Config, world_size: int, cuda: bool | None = None) -> list[str]:
    """All violations of the cross-field rules, one line each (empty list: valid)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    p, d, t, errs = cfg.parallel, cfg.data, cfg.train, []

    for name in ("tp", "pp", "cp"):
        if getattr(p, name) < 1:
            errs.append(f"parallel.{name} must be >= 1, got {getattr(p, name)}")
    for sec, name in (("data", "seq_length"), ("data", "micro_batch_size"), ("data", "global_batch_size"),
                      ("train", "steps"), ("train", "log_interval"), ("train", "eval_batches")):
        if getattr(getattr(cfg, sec), name) < 1:
            errs.append(f"{sec}.{name} must be >= 1, got {getattr(getattr(cfg, sec), name)}")
    if errs:
        return errs  # the rules below divide by these

    model_parallel = p.tp * p.pp * p.cp
    if world_size % model_parallel:
        errs.append(f"world size {world_size} must be divisible by parallel.tp*pp*cp = {p.tp}*{p.pp}*{p.cp} = {model_parallel}")
    dp = data_parallel_size(cfg, world_size)
    if p.dp is not None and p.dp * model_parallel != world_size:
        errs.append(f"parallel.dp ({p.dp}) * tp*pp*cp ({model_parallel}) must equal the world size ({world_size})")
    if d.global_batch_size % (d.micro_batch_size * dp):
        errs.append(f"data.global_batch_size ({d.global_batch_size}) must be divisible by data.micro_batch_size * dp = {d.micro_batch_size}*{dp}")
    if p.sequence_parallel and p.tp == 1:
        errs.append("parallel.sequence_parallel needs parallel.tp > 1")
    if p.sequence_parallel and not (has_module("transformer_engine") or has_module("apex")):
        errs.append(f"parallel.sequence_parallel needs Transformer Engine or apex norms (megatron-core's torch norms reject it): {TE_HINT}")
    if p.sequence_parallel and d.seq_length % p.tp:
        errs.append(f"data.seq_length ({d.seq_length}) must be divisible by parallel.tp ({p.tp}) with sequence_parallel")
    if p.cp > 1:
        if d.seq_length % (2 * p.cp):
            errs.append(f"data.seq_length ({d.seq_length}) must be divisible by 2*parallel.cp ({2 * p.cp})")
        if not (has_module("transformer_engine") and cuda):
            errs.append(f"parallel.cp > 1 needs Transformer Engine attention on a GPU: {TE_HINT}")

    if p.distributed_optimizer and not (cuda and (has_module("transformer_engine") or has_module("apex"))):
        errs.append("parallel.distributed_optimizer needs a GPU with Transformer Engine or apex fused Adam "
                    "(megatron-core 0.16 cannot checkpoint it over the torch-Adam fallback); set it false on CPU")
    errs += _model_rules(cfg.model, cfg, "model", cuda)
    for role in ("actor", "reference", "critic", "reward"):
        r = getattr(cfg.roles, role)
        if r.enabled and r.model is not None:
            errs += _model_rules(r.model, cfg, f"roles.{role}.model", cuda)

    if t.precision == "fp16" and not cuda:
        errs.append("train.precision=fp16 needs a CUDA GPU; use fp32 or bf16 on CPU")
    if t.fp8 is not None:
        if not has_module("transformer_engine"):
            errs.append(f"train.fp8 needs Transformer Engine: {TE_HINT}")
        elif not cuda:
            errs.append("train.fp8 needs a CUDA GPU (Hopper or newer)")
        if t.precision != "bf16":
            errs.append(f"train.fp8 trains with bf16 weights; set train.precision=bf16 (got {t.precision})")
    if t.eval_interval < 0:
        errs.append(f"train.eval_interval must be >= 0, got {t.eval_interval}")

    o, s = cfg.optim, cfg.lr_schedule
    if o.lr <= 0:
        errs.append(f"optim.lr must be > 0, got {o.lr}")
    if not 0 <= o.min_lr <= o.lr:
        errs.append(f"optim.min_lr ({o.min_lr}) must be in [0, optim.lr ({o.lr})]")
    if not (0 <= o.beta1 < 1 and 0 <= o.beta2 < 1):
        errs.append("optim.beta1 and optim.beta2 must be in [0, 1)")
    if o.clip_grad < 0 or o.weight_decay < 0:
        errs.append("optim.clip_grad and optim.weight_decay must be >= 0")
    if o.fused and not (cuda and (has_module("transformer_engine") or has_module("apex"))):
        errs.append(f"optim.fused needs a GPU with Transformer Engine or apex: {APEX_HINT}")
    decay = s.decay_steps if s.decay_steps is not None else t.steps
    if s.warmup_steps < 0 or s.warmup_steps >= decay:
        errs.append(f"lr_schedule.warmup_steps ({s.warmup_steps}) must be in [0, decay steps ({decay})): "
                    "set lr_schedule.decay_steps or train.steps above it")

    if d.loader == "dali" and not has_module("nvidia.dali"):
        errs.append(f"data.loader=dali needs NVIDIA DALI: {DALI_HINT}")
    if d.num_workers < 0:
        errs.append(f"data.num_workers must be >= 0, got {d.num_workers}")
    if cfg.reward_model.freeze_backbone and p.pp > 1:
        errs.append("reward_model.freeze_backbone needs parallel.pp=1 (earlier stages would hold no trainable parameters)")
    if cfg.tokenizer.kind == "hf" and not cfg.tokenizer.path:
        errs.append("tokenizer.kind=hf needs tokenizer.path (a local directory with tokenizer.json)")
    if cfg.checkpoint.keep_last < 1 or cfg.checkpoint.save_interval < 0:
        errs.append("checkpoint.keep_last must be >= 1 and checkpoint.save_interval >= 0")
    if cfg.launcher.backend == "nccl" and not cuda:
        errs.append("launcher.backend=nccl needs CUDA GPUs; use auto or gloo on CPU")
    return errs


def validate_config(cfg: Config, world_size: int, cuda: bool | None = None) -> None:
    errs = check_config(cfg, world_size, cuda)
    if errs:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errs))
