"""train.fp8's rules: what the device, Transformer Engine and the model need for FP8 GEMMs.

Checked with the other cross-field rules (`check_config`), so before any process starts. The device
is a `DeviceInfo`: `detect_device()` reads this machine; tests and `megarl validate --gpu-target`
pass a fake or a named target. The version floors are where megatron-core 0.16's
`fp8_utils.get_fp8_recipe` starts building each TE recipe (below them it raises at the first step).
"""
from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from typing import Optional

from megarl.config.schema import DataConfig, FP8Config, ModelConfig, ParallelConfig, RLConfig

TE_HINT = "install Transformer Engine: pip install 'megarl[gpu]' (CUDA machines only)"
HOPPER, BLACKWELL = (9, 0), (10, 0)
# recipe -> (first Transformer Engine version megatron-core 0.16 builds it with, TE's class)
TE_RECIPES = {
    "delayed": ("1.0", "DelayedScaling"),
    "tensorwise": ("2.2.0.dev0", "Float8CurrentScaling"),
    "blockwise": ("2.3.0.dev0", "Float8BlockScaling"),
    "mxfp8": ("2.1.0", "MXFP8BlockScaling"),
}


@dataclass(frozen=True)
class DeviceInfo:
    """What the FP8 rules (and `megarl doctor`) need to know about the GPU a run will use."""

    cuda: bool
    name: str = ""
    capability: Optional[tuple[int, int]] = None  # (major, minor): 9.0 Hopper, 10.0 Blackwell
    memory_bytes: Optional[int] = None
    te_version: Optional[str] = None  # None: Transformer Engine is not installed

    def describe(self) -> str:
        if not self.cuda:
            return "no CUDA GPU"
        cc = f"{self.capability[0]}.{self.capability[1]}" if self.capability else "?"
        return f"{self.name or 'GPU'} (compute capability {cc})"


GiB = 2**30
# Named targets for validating on a machine that is not the one the run uses (a login node):
# the GPU's properties and megarl's supported Transformer Engine (megatron-core 0.16's range).
TARGETS = {
    "a100": DeviceInfo(True, "NVIDIA A100-SXM4-80GB", (8, 0), 80 * GiB, "2.9.0"),
    "h100": DeviceInfo(True, "NVIDIA H100 80GB HBM3", (9, 0), 80 * GiB, "2.9.0"),
    "h200": DeviceInfo(True, "NVIDIA H200", (9, 0), 141 * GiB, "2.9.0"),
    "b200": DeviceInfo(True, "NVIDIA B200", (10, 0), 180 * GiB, "2.9.0"),
}


def installed_version(*dists: str) -> Optional[str]:
    """The installed version of the first distribution found (metadata only: imports nothing)."""
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def te_version() -> Optional[str]:
    return installed_version("transformer_engine", "transformer-engine", "transformer_engine_torch")


def detect_device(cuda: Optional[bool] = None) -> DeviceInfo:
    """This machine's GPU 0 and Transformer Engine; `cuda=False` reports no GPU without asking torch."""
    import torch

    te = te_version()
    if not (torch.cuda.is_available() if cuda is None else cuda):
        return DeviceInfo(False, te_version=te)
    props = torch.cuda.get_device_properties(0)
    return DeviceInfo(True, props.name, (props.major, props.minor), props.total_memory, te)


def version_at_least(installed: str, floor: str) -> bool:
    from packaging.version import Version

    return Version(installed) >= Version(floor)


def fp8_align(recipe: str) -> int:
    """FP8 GEMM feature dimensions must be multiples of this (megatron-core's get_fp8_align_size)."""
    return 32 if recipe == "mxfp8" else 16


def fp8_rows(recipe: str) -> int:
    """FP8 GEMM token counts (all but the last dimension) must be multiples of this (TE)."""
    return 32 if recipe == "mxfp8" else 8


def fp8_errors(f: FP8Config, models: dict[str, ModelConfig], parallel: ParallelConfig, precisions: dict[str, str],
               distributed_optimizer: bool, device: DeviceInfo) -> list[str]:
    """Every violation of train.fp8's rules, one line each.

    models: where -> ModelConfig ("model", "roles.critic.model"); precisions: where -> precision of
    each model that FP8 applies to ("train.precision", "roles.actor.precision").
    """
    errs: list[str] = []
    if f.format is None:
        for name, on in (("param_gather", f.param_gather), ("rollout", f.rollout == "fp8"),
                         ("bf16_first_layers", f.bf16_first_layers), ("bf16_last_layers", f.bf16_last_layers)):
            if on:
                errs.append(f"train.fp8.{name} needs FP8 on: set train.fp8.format (e4m3 or hybrid)")
        return errs
    for where, precision in precisions.items():
        if precision != "bf16":
            errs.append(f"train.fp8 trains with bf16 weights; set {where}=bf16 (got {precision})")
    if f.amax_history_len < 1:
        errs.append(f"train.fp8.amax_history_len must be >= 1, got {f.amax_history_len}")
    if f.margin < 0:
        errs.append(f"train.fp8.margin must be >= 0, got {f.margin}")
    if f.bf16_first_layers < 0 or f.bf16_last_layers < 0:
        errs.append("train.fp8.bf16_first_layers and bf16_last_layers must be >= 0")
    elif (f.bf16_first_layers or f.bf16_last_layers) and f.recipe == "delayed":
        errs.append("train.fp8.bf16_first_layers/bf16_last_layers need a per-layer recipe (tensorwise, blockwise, "
                    "mxfp8): delayed scaling reduces amax over all layers at once")
    if f.param_gather and not distributed_optimizer:
        errs.append("train.fp8.param_gather needs parallel.distributed_optimizer=true (only the distributed "
                    "optimizer re-quantizes the FP8 weights after a step)")
    align = fp8_align(f.recipe)
    for where, m in models.items():
        errs += _model_errors(f, m, parallel, where, align)

    if device.te_version is None:
        errs.append(f"train.fp8 needs Transformer Engine: {TE_HINT}")
    else:
        floor, cls = TE_RECIPES[f.recipe]
        if not version_at_least(device.te_version, floor):
            errs.append(f"train.fp8.recipe={f.recipe} needs Transformer Engine >= {floor} (megatron-core builds TE's "
                        f"{cls} from it); installed: {device.te_version}")
    if not device.cuda:
        errs.append("train.fp8 needs a CUDA GPU of compute capability >= 9.0 (Hopper or newer); this machine has none")
    elif device.capability is not None and device.capability < HOPPER:
        errs.append(f"train.fp8 needs compute capability >= 9.0 (Hopper or newer); GPU 0 is {device.describe()}")
    elif f.recipe == "mxfp8" and device.capability is not None and device.capability < BLACKWELL:
        errs.append(f"train.fp8.recipe=mxfp8 needs compute capability >= 10.0 (Blackwell); GPU 0 is "
                    f"{device.describe()}: use recipe tensorwise, blockwise or delayed")
    return errs


def fp8_batch_errors(f: FP8Config, data: DataConfig, rl: RLConfig, parallel: ParallelConfig, dp: int,
                     stage: Optional[str]) -> list[str]:
    """TE's FP8 GEMMs take inputs whose token count (the product of all but the last dimension) is
    a multiple of 8 (mxfp8: 32): SFT/RM micro-batches are [micro_batch_size, seq_length] (a
    sequence-parallel rank holds seq_length / tp of them); RL's are rl.micro_batch_size rows of any
    length, so their row count must be the multiple, every micro-batch full, and not chosen by a
    token budget. Generation's decode steps are handled in the model (models/fp8.py)."""
    if f.format is None:
        return []
    rows, errs = fp8_rows(f.recipe), []
    if stage == "rl":
        per_rank = rl.prompts_per_step // max(dp, 1) * rl.samples_per_prompt // max(rl.mini_batches, 1)
        if rl.max_tokens_per_micro_batch is not None:
            errs.append(f"train.fp8 needs fixed RL micro-batches (TE's FP8 GEMMs take token counts divisible by {rows}): "
                        "set rl.max_tokens_per_micro_batch=null and rl.micro_batch_size")
        if rl.micro_batch_size % rows or per_rank % rl.micro_batch_size:
            errs.append(f"train.fp8 ({f.recipe}) needs rl.micro_batch_size ({rl.micro_batch_size}) to be a multiple of "
                        f"{rows} that divides the rows per mini-batch and data-parallel rank ({per_rank})")
    else:
        tokens = data.micro_batch_size * data.seq_length // (parallel.tp if parallel.sequence_parallel else 1)
        if tokens % rows:
            errs.append(f"train.fp8 ({f.recipe}) needs micro-batches of a multiple of {rows} tokens: data.micro_batch_size"
                        f" x data.seq_length{' / parallel.tp' if parallel.sequence_parallel else ''} = {tokens}")
    return errs


def _model_errors(f: FP8Config, m: ModelConfig, p: ParallelConfig, where: str, align: int) -> list[str]:
    errs = []
    if m.transformer_impl == "local":
        errs.append(f"train.fp8 needs Transformer Engine layers: {where}.transformer_impl=local has no FP8 GEMMs "
                    "(use auto or transformer_engine)")
    if m.num_attention_heads < 1 or m.num_layers < 1 or p.tp < 1 or p.pp < 1:
        return errs  # the model rules report these
    head_dim = m.head_dim or m.hidden_size // m.num_attention_heads
    kv = m.num_kv_heads or m.num_attention_heads
    # every GEMM's weight, as this TP rank holds it: [out, in]
    dims = {f"{where}.hidden_size": m.hidden_size,
            f"{where}.ffn_hidden_size / parallel.tp": m.ffn_hidden_size // p.tp,
            "attention width (heads x head_dim) / parallel.tp": m.num_attention_heads * head_dim // p.tp,
            "kv width (num_kv_heads x head_dim) / parallel.tp": kv * head_dim // p.tp}
    bad = [f"{name} = {value}" for name, value in dims.items() if value % align]
    if bad:
        errs.append(f"train.fp8 ({f.recipe}) needs GEMM dimensions divisible by {align}: {', '.join(bad)}")
    per_stage = m.num_layers // p.pp
    for name in ("bf16_first_layers", "bf16_last_layers"):
        if getattr(f, name) > per_stage:
            errs.append(f"train.fp8.{name} ({getattr(f, name)}) must be <= the layers per pipeline stage "
                        f"({where}.num_layers / parallel.pp = {per_stage})")
    if f.bf16_first_layers + f.bf16_last_layers >= m.num_layers:
        errs.append(f"train.fp8.bf16_first_layers + bf16_last_layers ({f.bf16_first_layers + f.bf16_last_layers}) "
                    f"leaves no FP8 layer of {where}.num_layers ({m.num_layers})")
    return errs
