"""The one typed schema for every megarl run.

Plain dataclasses: the YAML file, the command-line overrides and the code all speak these
names. A field's type annotation is enforced by `megarl.config.loader`; cross-field rules
live in `megarl.config.validate`. Defaults describe a tiny CPU-friendly model so that an
empty config runs; real recipes set the model explicitly (see configs/).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional


@dataclass
class ModelConfig:
    """A Llama/Qwen2/Qwen3/Mistral-style decoder: RMSNorm, SwiGLU, RoPE, GQA."""

    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int = 176
    num_attention_heads: int = 4
    num_kv_heads: Optional[int] = None  # None: multi-head attention (= num_attention_heads)
    head_dim: Optional[int] = None  # None: hidden_size / num_attention_heads (Qwen3 sets its own)
    vocab_size: int = 262  # the tokenizer's true vocabulary; padded internally for TP
    make_vocab_size_divisible_by: int = 128
    max_position_embeddings: int = 512
    rotary_base: float = 10000.0
    rope_scaling_factor: Optional[float] = None  # Llama-3.1 style scaling when set
    qkv_bias: bool = False  # Qwen2 sets true
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE (Qwen3)
    tie_embeddings: bool = False  # Qwen2-small and many tiny models tie
    norm_eps: float = 1e-5
    init_std: float = 0.02
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    # Layer implementation: "auto" picks Transformer Engine when it is installed and a GPU is
    # present, else megatron-core's local modules.
    transformer_impl: Literal["auto", "local", "transformer_engine"] = "auto"
    init_from: Optional[str] = None  # a megarl checkpoint or Hugging Face directory


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor parallel
    pp: int = 1  # pipeline parallel
    cp: int = 1  # context parallel
    dp: Optional[int] = None  # None: world_size // (tp * pp * cp); if set it must match
    sequence_parallel: bool = False
    distributed_optimizer: bool = False  # shard optimizer state over DP (needs NCCL)


@dataclass
class OptimConfig:
    name: Literal["adamw"] = "adamw"
    lr: float = 3e-4
    min_lr: float = 0.0
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad: float = 1.0  # global-norm clip over all parallel ranks; 0 disables
    fused: bool = False  # fused Adam kernels: need Transformer Engine or apex


@dataclass
class LRScheduleConfig:
    style: Literal["constant", "linear", "cosine"] = "cosine"
    warmup_steps: int = 0
    decay_steps: Optional[int] = None  # None: decay over train.steps - warmup


@dataclass
class OffloadConfig:
    """Which of a role's states move to pinned host memory between phases."""

    params: bool = False
    grads: bool = False
    optimizer: bool = False


@dataclass
class RoleConfig:
    """One of the four RL roles. Unset sections inherit the top-level ones."""

    enabled: bool = False
    model: Optional[ModelConfig] = None
    optim: Optional[OptimConfig] = None
    offload: OffloadConfig = field(default_factory=OffloadConfig)


@dataclass
class RolesConfig:
    actor: RoleConfig = field(default_factory=RoleConfig)
    reference: RoleConfig = field(default_factory=RoleConfig)
    critic: RoleConfig = field(default_factory=RoleConfig)
    reward: RoleConfig = field(default_factory=RoleConfig)


@dataclass
class TokenizerConfig:
    kind: Literal["byte", "hf"] = "byte"
    path: Optional[str] = None  # a local directory with tokenizer.json (kind=hf)


@dataclass
class SyntheticConfig:
    """The built-in arithmetic task (megarl.data.synthetic), written to <run_dir>/data."""

    n_train: int = 2000
    n_test: int = 200
    min_ops: int = 1        # operations per problem
    max_ops: int = 2
    max_operand: int = 10
    ops: str = "+-"         # any of "+-*"
    max_factor: int = 3
    rejects: Literal["operand", "slip"] = "operand"  # the preference pairs' kind of mistake


@dataclass
class DataConfig:
    train_path: Optional[str] = None  # None: the built-in synthetic task (data.synthetic)
    eval_path: Optional[str] = None
    seq_length: int = 128
    micro_batch_size: int = 4
    global_batch_size: int = 8
    packing: bool = False
    loader: Literal["torch", "dali"] = "torch"
    bad_records: Literal["fail", "skip"] = "fail"
    num_workers: int = 0
    seed: Optional[int] = None  # None: train.seed
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)


@dataclass
class TrainConfig:
    steps: int = 50
    seed: int = 1234
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    fp8: Optional[Literal["e4m3", "hybrid"]] = None  # Transformer Engine FP8 (H100+)
    log_interval: int = 5
    eval_interval: int = 25  # 0 disables evaluation
    eval_batches: int = 2
    run_dir: str = "runs/default"


@dataclass
class CheckpointConfig:
    save_interval: int = 0  # 0: only at the end of the run
    keep_last: int = 2
    resume: bool = True  # pick up <run_dir>/.../checkpoints/latest if present
    # write tensors in a background process (megatron-core async save): training goes on once
    # they are staged in host memory; the checkpoint is published when the write has finished
    async_save: bool = False


@dataclass
class TrackingConfig:
    backend: Literal["mlflow", "none"] = "mlflow"
    uri: Optional[str] = None  # None: $MLFLOW_TRACKING_URI, else an embedded store in run_dir
    experiment: str = "megarl"
    run_name: Optional[str] = None


@dataclass
class LauncherConfig:
    """How processes are started; the runtime reads the environment torchrun/srun set."""

    backend: Literal["auto", "nccl", "gloo"] = "auto"
    timeout_minutes: int = 30
    nnodes: int = 1
    nproc_per_node: Optional[int] = None  # None: one per GPU, or 1 on CPU


@dataclass
class SFTConfig:
    eval_samples: int = 4  # held-out prompts decoded greedily at each evaluation (0: none)
    max_new_tokens: int = 48


@dataclass
class RewardModelConfig:
    """Pairwise Bradley-Terry: loss = -log sigmoid(r_chosen - r_rejected - margin)."""

    margin: float = 0.0
    center_coef: float = 0.0  # + coef * (r_chosen + r_rejected)^2 keeps rewards centred at 0
    freeze_backbone: bool = False  # train only the scalar head (a remedy for RM overfitting)
    # "sft": <run_dir>/sft/checkpoints/latest; a path: that checkpoint; null: model.init_from
    # (an HF directory or checkpoint) when set, else random init
    init_from: Optional[str] = "sft"


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    roles: RolesConfig = field(default_factory=RolesConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
