"""Cross-field rules, checked before any process group or model exists.

`check_config` returns every violation as one line; `validate_config` raises them together,
so a user fixes a config in one round instead of one error per launch.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os

import torch

from megarl.config.fp8 import TE_HINT, DeviceInfo, detect_device, fp8_batch_errors, fp8_errors
from megarl.config.loader import ConfigError
from megarl.config.schema import LORA_TARGETS, Config, ModelConfig


def has_module(name: str) -> bool:
    """Whether an optional package is importable, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


DALI_HINT = "install NVIDIA DALI: pip install 'megarl[dali]'"


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
    if m.num_kv_heads is not None and m.num_kv_heads < 1:  # 0 would silently mean multi-head
        errs.append(f"{where}.num_kv_heads must be >= 1 (or null for num_attention_heads), got {m.num_kv_heads}")
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
    if m.lora is not None:
        errs += _lora_rules(m, where)
        if m.moe.num_experts:
            errs.append(f"{where}.lora with {where}.moe: adapters wrap the dense layers' linears, not the experts'; "
                        "LoRA on a mixture-of-experts model is not supported yet")
        if p.sequence_parallel:
            errs.append(f"{where}.lora with parallel.sequence_parallel: the adapters run on megatron-core's local "
                        "layers, whose torch RMSNorm rejects sequence parallelism")
    return errs + _moe_rules(m, cfg, where, cuda)


def _lora_rules(m, where: str) -> list[str]:
    lo, errs = m.lora, []
    if lo.rank < 1:
        errs.append(f"{where}.lora.rank must be >= 1, got {lo.rank}")
    if not 0.0 <= lo.dropout < 1:
        errs.append(f"{where}.lora.dropout must be in [0, 1), got {lo.dropout}")
    bad = [t for t in lo.targets if t not in LORA_TARGETS]
    if bad or not lo.targets or len(set(lo.targets)) != len(lo.targets):
        errs.append(f"{where}.lora.targets must be distinct names among {', '.join(LORA_TARGETS)}, got {lo.targets}")
    if m.transformer_impl == "transformer_engine":
        errs.append(f"{where}.lora: adapters wrap megatron-core's local linears (TE fuses the norm the adapter "
                    f"reads into its GEMM); set {where}.transformer_impl to auto or local")
    return errs


def _moe_rules(m: ModelConfig, cfg: Config, where: str, cuda: bool) -> list[str]:
    """model.moe against itself and parallel.ep/etp (a dense model: ep must be 1)."""
    moe, p, errs = m.moe, cfg.parallel, []
    if moe.num_experts < 0:
        return [f"{where}.moe.num_experts must be >= 0 (0: a dense MLP), got {moe.num_experts}"]
    if not moe.num_experts:
        return [f"parallel.ep={p.ep} needs a MoE model: set {where}.moe.num_experts"] if p.ep > 1 else []
    if not 1 <= moe.topk <= moe.num_experts:
        errs.append(f"{where}.moe.topk must be in [1, num_experts={moe.num_experts}], got {moe.topk}")
    if moe.num_experts % p.ep:
        errs.append(f"{where}.moe.num_experts ({moe.num_experts}) must be divisible by parallel.ep ({p.ep})")
    etp = p.etp or p.tp
    hidden = moe.expert_hidden or m.ffn_hidden_size
    if hidden < 1 or hidden % etp:
        errs.append(f"{where}.moe.expert_hidden ({hidden}) must be >= 1 and divisible by the experts' "
                    f"tensor parallel size ({etp})")
    if moe.shared_expert_hidden < 0 or moe.shared_expert_hidden % p.tp:
        errs.append(f"{where}.moe.shared_expert_hidden ({moe.shared_expert_hidden}) must be >= 0 and divisible "
                    f"by parallel.tp ({p.tp})")
    if moe.aux_loss_coeff < 0 or moe.bias_update_rate < 0:
        errs.append(f"{where}.moe.aux_loss_coeff and bias_update_rate must be >= 0")
    if moe.bias_update_rate > 0 and moe.score != "sigmoid":
        errs.append(f"{where}.moe.bias_update_rate (aux-loss-free balancing) needs {where}.moe.score=sigmoid "
                    "(megatron-core's expert bias)")
    if p.tp > 1 and not p.sequence_parallel:
        errs.append(f"{where}.moe with parallel.tp > 1 needs parallel.sequence_parallel (megatron-core's MoE layer "
                    "refuses to train without it)")
    if moe.grouped_gemm and not (cuda and has_module("transformer_engine")):
        errs.append(f"{where}.moe.grouped_gemm needs Transformer Engine on a GPU: {TE_HINT}")
    return errs


def _rl_rules(cfg: Config, world_size: int, cuda: bool) -> list[str]:
    r, errs = cfg.rl, []
    dp = data_parallel_size(cfg, world_size)
    for name in ("prompts_per_step", "samples_per_prompt", "max_prompt_len", "max_new_tokens", "rollout_batch_size",
                 "decode_sync_every",
                 "ppo_epochs", "mini_batches", "micro_batch_size", "eval_samples", "max_nonfinite_steps",
                 "kl_ceiling_steps"):
        if getattr(r, name) < 1:
            errs.append(f"rl.{name} must be >= 1, got {getattr(r, name)}")
    if errs:
        return errs
    if cfg.parallel.cp > 1:  # whatever TE offers: the rollout's attention has no CP path
        errs.append(f"parallel.cp={cfg.parallel.cp}: the rl and eval stages generate, and generation (megarl's KV-cache "
                    "attention) does not split the sequence over context-parallel ranks; set parallel.cp=1")
    if r.prompts_per_step % dp:
        errs.append(f"rl.prompts_per_step ({r.prompts_per_step}) must be divisible by the data-parallel size ({dp})")
    elif (r.prompts_per_step // dp * r.samples_per_prompt) % r.mini_batches:
        errs.append(f"rl.mini_batches ({r.mini_batches}) must divide the rows per data-parallel rank "
                    f"(prompts_per_step / dp x samples_per_prompt = {r.prompts_per_step // dp * r.samples_per_prompt})")
    errs += _algorithm_rules(cfg, cuda)
    longest = r.max_prompt_len + r.max_new_tokens
    for name in ("actor", "reference", "critic", "reward"):
        m = getattr(cfg.roles, name).model or cfg.model
        if longest > m.max_position_embeddings:
            errs.append(f"rl.max_prompt_len + rl.max_new_tokens ({longest}) exceeds the {name}'s "
                        f"max_position_embeddings ({m.max_position_embeddings})")
            break
    if r.max_tokens_per_micro_batch is not None and r.max_tokens_per_micro_batch < longest:
        errs.append(f"rl.max_tokens_per_micro_batch ({r.max_tokens_per_micro_batch}) must hold the longest sequence "
                    f"(max_prompt_len + max_new_tokens = {longest})")
    if not r.temperature > 0:
        errs.append(f"rl.temperature must be > 0, got {r.temperature}")
    if not r.eval_temperature >= 0:
        errs.append(f"rl.eval_temperature must be >= 0 (0: greedy evaluation), got {r.eval_temperature}")
    if not 0 < r.top_p <= 1 or r.top_k < 0:
        errs.append(f"rl.top_p must be in (0, 1] and rl.top_k >= 0 (got {r.top_p}, {r.top_k})")
    if r.routing_replay == "rollout" and not cfg.model.moe.num_experts:
        errs.append("rl.routing_replay=rollout needs a MoE model (model.moe.num_experts > 0); set it to none")
    if cfg.model.moe.num_experts and cfg.parallel.pp > 1:
        errs.append("rl with a MoE model needs parallel.pp=1 (the rollout records each token's experts "
                    "for routing replay and its agreement metric at one pipeline stage only)")
    if r.old_logprobs == "rollout" and (r.top_k or r.top_p < 1):
        errs.append("rl.old_logprobs=rollout needs rl.top_k=0 and rl.top_p=1 (the rollout's log-probs are of the "
                    "filtered distribution); use rl.old_logprobs=recompute")
    if r.rollout_correction != "none" and r.old_logprobs == "rollout":
        errs.append(f"rl.rollout_correction={r.rollout_correction} weighs pi_old / pi_rollout, which "
                    "rl.old_logprobs=rollout makes 1; use rl.old_logprobs=recompute")
    if not r.rollout_correction_c > 1:
        errs.append(f"rl.rollout_correction_c must be > 1, got {r.rollout_correction_c}")
    if not 0 < r.rollout_correction_lo <= 1 <= r.rollout_correction_hi:
        errs.append("rl.rollout_correction_lo and _hi need 0 < lo <= 1 <= hi, got "
                    f"{r.rollout_correction_lo} and {r.rollout_correction_hi}")
    if not (0 < r.clip_low < 1 and r.clip_high > 0):
        errs.append(f"rl.clip_low must be in (0, 1) and rl.clip_high > 0 (got {r.clip_low}, {r.clip_high})")
    if r.dual_clip is not None and r.dual_clip <= 1:
        errs.append(f"rl.dual_clip must be > 1 (or null), got {r.dual_clip}")
    if r.kl_coef < 0 or r.entropy_coef < 0 or r.reward_model_coef < 0:
        errs.append("rl.kl_coef, rl.entropy_coef and rl.reward_model_coef must be >= 0")
    if r.kl_target is not None and (r.kl_target <= 0 or r.kl_coef <= 0):
        errs.append("rl.kl_target (adaptive KL) needs rl.kl_target > 0 and an initial rl.kl_coef > 0")
    if not (0 <= r.gamma <= 1 and 0 <= r.lam <= 1):
        errs.append(f"rl.gamma and rl.lam must be in [0, 1] (got {r.gamma}, {r.lam})")
    if r.reward_fn is None and r.reward_model_coef == 0:
        errs.append("rl: no reward: set rl.reward_fn (e.g. final_answer) and/or rl.reward_model_coef > 0")
    if not 0 <= r.max_reward_failures <= 1:
        errs.append(f"rl.max_reward_failures must be in [0, 1], got {r.max_reward_failures}")
    if r.value_clip is not None and r.value_clip <= 0:
        errs.append(f"rl.value_clip must be > 0 (or null), got {r.value_clip}")
    for name in ("actor", "reference", "critic", "reward"):
        role = getattr(cfg.roles, name)
        if role.precision == "fp16" and not cuda:
            errs.append(f"roles.{name}.precision=fp16 needs a CUDA GPU; use fp32 or bf16 on CPU")
        if role.optim is not None and role.optim.lr <= 0:
            errs.append(f"roles.{name}.optim.lr must be > 0, got {role.optim.lr}")
    return errs


def _algorithm_rules(cfg: Config, cuda: bool) -> list[str]:
    """The RL algorithm's own rules (algorithms/spec.py), its DAPO settings, and offload settings
    of roles the run will not have."""
    from megarl import algorithms as A
    from megarl.config.schema import RLConfig

    r = cfg.rl
    errs = A.config_errors(r, RLConfig())
    if errs:
        return errs
    if r.max_resample_rounds < 1:
        errs.append(f"rl.max_resample_rounds must be >= 1, got {r.max_resample_rounds}")
    if r.overlong == "soft" and not 0 < r.overlong_buffer <= r.max_new_tokens:
        errs.append(f"rl.overlong_buffer ({r.overlong_buffer}) must be in [1, rl.max_new_tokens={r.max_new_tokens}]")
    if r.overlong_penalty < 0:
        errs.append(f"rl.overlong_penalty must be >= 0, got {r.overlong_penalty}")
    roles = A.needed_roles(r)
    why = {"reference": "rl.kl_coef is 0", "critic": f"rl.algorithm={r.algorithm} has no critic",
           "reward": "rl.reward_model_coef is 0"}
    for name in ("reference", "critic", "reward"):
        o = getattr(cfg.roles, name).offload
        on = [k for k in ("params", "grads", "optimizer") if getattr(o, k)]
        if name not in roles and on:
            errs.append(f"roles.{name}.offload.{on[0]}=true: this run has no {name} ({why[name]}); remove it")
    return errs


def _fp8_rules(cfg: Config, cuda: bool, device: DeviceInfo | None, world_size: int, stage: str | None) -> list[str]:
    """train.fp8's rules (megarl.config.fp8) for every model FP8 applies to: the policy's and each
    role's own; the device is looked up only when FP8 is on."""
    f = cfg.train.fp8
    if f.format is not None and device is None:  # this machine; TE counts where importable, as above
        device = detect_device(cuda)
        if not has_module("transformer_engine"):
            device = dataclasses.replace(device, te_version=None)
    models, precisions = {"model": cfg.model}, {"train.precision": cfg.train.precision}
    for name in ("actor", "reference", "critic", "reward"):
        r = getattr(cfg.roles, name)
        if r.model is not None:
            models[f"roles.{name}.model"] = r.model
        if r.precision is not None:
            precisions[f"roles.{name}.precision"] = r.precision
    return fp8_errors(f, models, cfg.parallel, precisions, cfg.parallel.distributed_optimizer,
                      device or DeviceInfo(cuda)) + fp8_batch_errors(f, cfg.data, cfg.rl, cfg.parallel,
                                                                     data_parallel_size(cfg, world_size), stage)


TOOL_BUILTINS = ("calculator", "python")  # megarl/rollout/tools.py's BUILTIN_TOOLS (config imports nothing of megarl)


def _tool_rules(cfg: Config) -> list[str]:
    """rl.tools and its limits (rollouts and `megarl eval`); user tools are imported when the stage
    builds them, which names an import error in one line too."""
    r, errs = cfg.rl, []
    for i, spec in enumerate(r.tools):
        module, sep, attr = spec.strip().rpartition(":")
        if spec == "python" and not r.python_tool:
            errs.append("rl.tools has python, which runs model-written code: set rl.python_tool=true to allow it")
        elif spec not in TOOL_BUILTINS and not (sep and module and attr):
            errs.append(f"rl.tools[{i}] is {spec!r}: expected a built-in ({', '.join(TOOL_BUILTINS)}) or 'module:function'")
        elif module.endswith(".py") and not os.path.isfile(module):
            errs.append(f"rl.tools[{i}] is {spec!r}: file not found: {module}")
    if len(set(r.tools)) != len(r.tools):
        errs.append(f"rl.tools lists a tool twice: {r.tools}")
    if r.max_tool_calls < 1:
        errs.append(f"rl.max_tool_calls must be >= 1, got {r.max_tool_calls}")
    if not 0 < r.tool_timeout_s <= 3600:
        errs.append(f"rl.tool_timeout_s must be in (0, 3600] seconds, got {r.tool_timeout_s}")
    if r.tool_max_output_chars < 1:
        errs.append(f"rl.tool_max_output_chars must be >= 1, got {r.tool_max_output_chars}")
    return errs


def check_config(cfg: Config, world_size: int, cuda: bool | None = None, stage: str | None = None,
                 device: DeviceInfo | None = None) -> list[str]:
    """All violations of the cross-field rules, one line each (empty list: valid). stage="rl"
    adds the RL stage's rules. device: the GPU the run will use (default: this machine's)."""
    cuda = (device.cuda if device is not None else torch.cuda.is_available()) if cuda is None else cuda
    # Transformer Engine where the run will be: this machine's, or the one a --gpu-target names
    te = has_module("transformer_engine") if device is None else device.te_version is not None
    p, d, t, errs = cfg.parallel, cfg.data, cfg.train, []
    if world_size < 1:
        return [f"world size must be >= 1, got {world_size}"]
    for name in ("tp", "pp", "cp", "ep"):
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
    etp = p.etp if p.etp is not None else p.tp
    if etp < 1:
        errs.append(f"parallel.etp must be >= 1 (or null for parallel.tp), got {p.etp}")
    elif world_size % (etp * p.ep * p.pp):
        errs.append(f"world size {world_size} must be divisible by parallel.etp*ep*pp = {etp}*{p.ep}*{p.pp} "
                    f"= {etp * p.ep * p.pp} (the experts' layout)")
    if p.dp is not None and p.dp * model_parallel != world_size:
        errs.append(f"parallel.dp ({p.dp}) * tp*pp*cp ({model_parallel}) must equal the world size ({world_size})")
    if d.global_batch_size % (d.micro_batch_size * dp):
        errs.append(f"data.global_batch_size ({d.global_batch_size}) must be divisible by data.micro_batch_size * dp = {d.micro_batch_size}*{dp}")
    if p.sequence_parallel and p.tp == 1:
        errs.append("parallel.sequence_parallel needs parallel.tp > 1")
    if p.sequence_parallel and not te:
        errs.append(f"parallel.sequence_parallel needs Transformer Engine's norms (megatron-core's torch RMSNorm "
                    f"rejects it): {TE_HINT}")
    if p.sequence_parallel and d.seq_length % p.tp:
        errs.append(f"data.seq_length ({d.seq_length}) must be divisible by parallel.tp ({p.tp}) with sequence_parallel")
    if p.cp > 1:
        if d.seq_length % (2 * p.cp):
            errs.append(f"data.seq_length ({d.seq_length}) must be divisible by 2*parallel.cp ({2 * p.cp})")
        if not (te and cuda):
            errs.append(f"parallel.cp > 1 needs Transformer Engine attention on a GPU: {TE_HINT}")

    # parallel.distributed_optimizer has no rule: it runs on CPU (gloo) and GPU, over fused Adam
    # or torch's (whose checkpointing megarl.optim.fix_distributed_torch_adam repairs).
    errs += _model_rules(cfg.model, cfg, "model", cuda)
    for role in ("actor", "reference", "critic", "reward"):
        r = getattr(cfg.roles, role)
        if r.model is not None:
            errs += _model_rules(r.model, cfg, f"roles.{role}.model", cuda)

    if t.precision == "fp16" and not cuda:
        errs.append("train.precision=fp16 needs a CUDA GPU; use fp32 or bf16 on CPU")
    errs += _fp8_rules(cfg, cuda, device, world_size, stage)
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
    if o.fused and not (cuda and te):
        errs.append(f"optim.fused needs a GPU with Transformer Engine (its FusedAdam): {TE_HINT}")
    decay = s.decay_steps if s.decay_steps is not None else t.steps
    if s.warmup_steps < 0 or s.warmup_steps >= decay:
        errs.append(f"lr_schedule.warmup_steps ({s.warmup_steps}) must be in [0, decay steps ({decay})): "
                    "set lr_schedule.decay_steps or train.steps above it")
    if s.wsd_decay_steps is not None and not 0 < s.wsd_decay_steps <= decay - s.warmup_steps:
        errs.append(f"lr_schedule.wsd_decay_steps ({s.wsd_decay_steps}) must be in [1, decay steps - warmup "
                    f"({decay - s.warmup_steps})]")
    if s.wsd_decay_steps is not None and s.style != "wsd":
        errs.append(f"lr_schedule.wsd_decay_steps has no effect with lr_schedule.style={s.style}; set style=wsd or remove it")

    if d.loader == "dali" and not has_module("nvidia.dali"):
        errs.append(f"data.loader=dali needs NVIDIA DALI: {DALI_HINT}")
    if d.num_workers < 0:
        errs.append(f"data.num_workers must be >= 0, got {d.num_workers}")
    if cfg.reward_model.freeze_backbone and p.pp > 1:
        errs.append("reward_model.freeze_backbone needs parallel.pp=1 (earlier stages would hold no trainable parameters)")
    if cfg.dpo.beta <= 0:
        errs.append(f"dpo.beta must be > 0, got {cfg.dpo.beta}")
    if not 0 <= cfg.dpo.label_smoothing < 0.5:
        errs.append(f"dpo.label_smoothing must be in [0, 0.5), got {cfg.dpo.label_smoothing}")
    elif cfg.dpo.label_smoothing and cfg.dpo.loss != "sigmoid":
        errs.append(f"dpo.label_smoothing is conservative DPO's (dpo.loss=sigmoid); dpo.loss={cfg.dpo.loss} ignores it")
    if cfg.tokenizer.kind == "hf" and not cfg.tokenizer.path:
        errs.append("tokenizer.kind=hf needs tokenizer.path (a local directory with tokenizer.json)")
    if cfg.checkpoint.keep_last < 1 or cfg.checkpoint.save_interval < 0:
        errs.append("checkpoint.keep_last must be >= 1 and checkpoint.save_interval >= 0")
    if cfg.launcher.backend == "nccl" and not cuda:
        errs.append("launcher.backend=nccl needs CUDA GPUs; use auto or gloo on CPU")
    errs += _tool_rules(cfg)
    if stage == "rl":
        errs += _rl_rules(cfg, world_size, cuda)
    return errs


def validate_config(cfg: Config, world_size: int, cuda: bool | None = None, stage: str | None = None,
                    device: DeviceInfo | None = None) -> None:
    errs = check_config(cfg, world_size, cuda, stage, device)
    if errs:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errs))
