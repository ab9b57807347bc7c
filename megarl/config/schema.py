"""The one typed schema for every megarl run.

Plain dataclasses: the YAML file, the command-line overrides and the code all speak these
names. A field's type annotation is enforced by `megarl.config.loader`; cross-field rules
live in `megarl.config.validate`. Defaults describe a tiny CPU-friendly model so that an
empty config runs; real recipes set the model explicitly (see configs/).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, Optional


LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # megatron-core's linears of a layer


@dataclass
class LoRAConfig:
    """Low-rank adapters on the transformer's linears (megarl/models/lora.py); the base is frozen."""

    rank: int = 8
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # on the adapter's input
    # any of linear_qkv (fused q/k/v), linear_proj (attention output), linear_fc1, linear_fc2 (MLP)
    targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))


@dataclass
class MoEConfig:
    """Mixture-of-experts MLPs (megatron-core's MoE layer) in every layer; num_experts 0: dense.

    Each token goes to its `topk` experts by the router's scores; the softmax router takes the
    top-k logits and normalises over them (Qwen3-MoE's norm_topk_prob, Mixtral), the sigmoid
    router normalises the top-k sigmoids (DeepSeek-V3).
    """

    num_experts: int = 0
    topk: int = 2
    score: Literal["softmax", "sigmoid"] = "softmax"
    expert_hidden: Optional[int] = None  # each expert's FFN width; None: model.ffn_hidden_size
    shared_expert_hidden: int = 0  # an always-on shared expert of this width (0: none)
    aux_loss_coeff: float = 0.0  # Switch-style load-balancing loss, added to the training loss
    # aux-loss-free balancing (DeepSeek-V3): a per-expert routing bias moved by this rate towards
    # balance after each optimizer step (0: off)
    bias_update_rate: float = 0.0
    dispatcher: Literal["alltoall", "allgather"] = "alltoall"  # how tokens reach the experts' EP ranks
    grouped_gemm: bool = False  # all local experts in one grouped GEMM (needs Transformer Engine)


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
    # a Hugging Face directory whose config.json gives every field that changes the maths (shapes,
    # RoPE, norm eps, ...: config/hf.py); fields written beside it must agree (loader.py)
    from_hf: Optional[str] = None
    lora: Optional[LoRAConfig] = None  # set: train low-rank adapters only (the base is frozen)
    moe: MoEConfig = field(default_factory=MoEConfig)


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor parallel
    pp: int = 1  # pipeline parallel
    cp: int = 1  # context parallel
    dp: Optional[int] = None  # None: world_size // (tp * pp * cp); if set it must match
    ep: int = 1  # expert parallel: the experts split over ep ranks of the data-parallel group
    etp: Optional[int] = None  # experts' own tensor parallel size; None: tp
    sequence_parallel: bool = False
    distributed_optimizer: bool = False  # shard optimizer state over DP (ZeRO-1; NCCL or gloo)


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
    # wsd: warmup-stable-decay, the peak lr until the last `wsd_decay_steps` of decay_steps, then
    # linear to optim.min_lr (a run that sits on a plateau keeps its full lr until it has left it)
    style: Literal["constant", "linear", "cosine", "wsd"] = "cosine"
    warmup_steps: int = 0
    decay_steps: Optional[int] = None  # None: decay over train.steps - warmup
    wsd_decay_steps: Optional[int] = None  # style wsd: the final steps that decay (None: the last 20%)


@dataclass
class OffloadConfig:
    """Which of a role's states move to pinned host memory between phases."""

    params: bool = False
    grads: bool = False
    optimizer: bool = False


@dataclass
class RoleConfig:
    """One of the four RL roles (actor, reference, critic, reward).

    Unset fields inherit the top-level ones, field by field: `roles.critic.optim.lr=1e-5`
    changes only the critic's lr and keeps every other top-level optim value (the loader
    merges; `role_config(cfg, name)` gives the resolved view).
    """

    model: Optional[ModelConfig] = None
    optim: Optional[OptimConfig] = None
    lr_schedule: Optional[LRScheduleConfig] = None
    precision: Optional[Literal["fp32", "bf16", "fp16"]] = None  # None: train.precision
    # Where the weights start: "sft" / "reward_model" (that stage's latest checkpoint in this
    # run dir), a megarl checkpoint path, a Hugging Face directory, or "random" (train.seed's
    # initialisation). None: the role's default (actor and reference: sft; critic and reward:
    # reward_model; the reference: the actor's).
    init_from: Optional[str] = None
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
    """The built-in arithmetic task (megarl.data.synthetic), written to <run_dir>/data with seed
    data.seed (else train.seed); its one schema, also used by `megarl synthetic`."""

    n_train: int = 2000
    n_test: int = 200
    min_ops: int = 1        # operations per problem
    max_ops: int = 2
    max_operand: int = 10
    ops: str = "+-"         # any of "+-*"
    max_factor: int = 3
    rejects: Literal["operand", "slip"] = "operand"  # the preference pairs' kind of mistake
    sft_mistakes: float = 0.0  # share of train SFT demonstrations with one mistake of that kind (a noisy teacher)
    # share of SFT demonstrations that do their products with the calculator tool, `<<23*47=1081>>`
    # (megarl/rollout/tools.py); pair it with a large max_factor, where products are beyond a tiny model
    calculator: float = 0.0


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
class FP8Config:
    """FP8 GEMMs through Transformer Engine (compute capability 9.0+), on top of train.precision=bf16.

    `format: null` is off. megarl.models.fp8 maps each field onto megatron-core's TransformerConfig
    and TE's recipe; megarl.config.fp8 holds the device and version rules.
    """

    format: Optional[Literal["e4m3", "hybrid"]] = None  # hybrid: e4m3 forward, e5m2 gradients
    # delayed: scales from an amax history; tensorwise: per-tensor current scaling;
    # blockwise: 1x128/128x128 block scales (DeepSeek-V3 style); mxfp8: 1x32 block scales (Blackwell)
    recipe: Literal["delayed", "tensorwise", "blockwise", "mxfp8"] = "delayed"
    amax_history_len: int = 1024  # delayed only: steps of amax history a scale is taken from
    amax_compute_algo: Literal["max", "most_recent"] = "max"  # delayed only
    margin: int = 0  # delayed only: scale = fp8_max / amax / 2**margin
    bf16_first_layers: int = 0  # the first N transformer layers stay in BF16 (not with delayed)
    bf16_last_layers: int = 0  # the last N
    param_gather: bool = False  # weights stored and all-gathered in FP8 (needs the distributed optimizer)
    rollout: Literal["bf16", "fp8"] = "bf16"  # generation's GEMMs; scoring and training use FP8


@dataclass
class TrainConfig:
    steps: int = 50
    seed: int = 1234
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    fp8: FP8Config = field(default_factory=FP8Config)  # FP8 GEMMs (Hopper+): train.fp8.format=e4m3
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
    # which tokens give the reward: "last" (the last token, as HF sequence classifiers read it) or
    # "mean" (the mean over the response tokens); saved with the checkpoint, RL reads it the same way
    pooling: Literal["last", "mean"] = "last"
    # "sft": <run_dir>/sft/checkpoints/latest; a path: that checkpoint; null: model.init_from
    # (an HF directory or checkpoint) when set, else random init
    init_from: Optional[str] = "sft"


@dataclass
class DPOConfig:
    """Direct preference optimisation (`megarl dpo`) on the preference JSONL the reward model reads.

    The policy is the actor role and the frozen reference the reference role: roles.actor.init_from
    (default: this run dir's SFT checkpoint) and roles.reference.init_from (default: the actor's).
    """

    loss: Literal["sigmoid", "ipo", "simpo"] = "sigmoid"  # DPO; IPO (beta is its tau); SimPO (no reference)
    beta: float = 0.1
    label_smoothing: float = 0.0  # sigmoid: conservative DPO's probability that a label is flipped
    simpo_gamma: float = 0.5  # simpo: the target reward margin


@dataclass
class RLConfig:
    """The RL stage (`megarl rl`): rollouts on the actor, scoring, advantages, PPO-style updates.

    One loop step = `prompts_per_step` prompts x `samples_per_prompt` samples, generated, scored
    and trained on for `ppo_epochs` x `mini_batches` optimizer steps per trained role.
    """

    algorithm: str = "grpo"  # one of megarl/algorithms/spec.py's ALGORITHMS: grpo, ppo, rloo, reinforce, reinforce_pp
    prompts_path: Optional[str] = None  # None: the synthetic task's train prompts
    eval_prompts_path: Optional[str] = None  # None: the synthetic task's held-out prompts
    prompts_per_step: int = 8  # global, over all DP ranks
    samples_per_prompt: int = 4  # the group size of GRPO / RLOO
    max_prompt_len: int = 64
    # sampling
    max_new_tokens: int = 48
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    rollout_batch_size: int = 64  # rows per generation micro-batch (bounds the KV cache)
    # on a GPU, decode steps run the graph-safe step (no host read per token), captured as CUDA
    # graphs kept across RL steps (false: the same step uncaptured); the host reads the finished
    # flags, tool calls and stop strings every decode_sync_every steps. PP > 1: the per-step path.
    cuda_graphs: bool = True
    decode_sync_every: int = 8
    # the behaviour policy's log-probs: recomputed by a forward of the actor (exact: ratio 1 on
    # the first mini-batch), or the rollout's own (saves that forward; needs top_k 0 and top_p 1,
    # since they are log-probs of the filtered distribution)
    old_logprobs: Literal["recompute", "rollout"] = "recompute"
    # the engine's log-probs against the recomputed ones (megarl/algorithms/mismatch.py): every
    # step logs mismatch/* (with old_logprobs=recompute); corrections of the policy loss: "tis"
    # weights each token's loss by min(pi_old / pi_rollout, rollout_correction_c), "mis" drops
    # rows whose geometric-mean ratio leaves [rollout_correction_lo, rollout_correction_hi].
    # rollout_correction_c also bounds the ratios mismatch/ratio_out_fraction counts ([1/C, C])
    rollout_correction: Literal["none", "tis", "mis"] = "none"
    rollout_correction_c: float = 2.0
    rollout_correction_lo: float = 0.99
    rollout_correction_hi: float = 1.01
    # MoE: "rollout" replays the experts each token went to in generation in the actor's (and the
    # reference's) scoring and training forwards (R3); "none" measures their agreement instead
    # ("none", not "off": YAML reads an unquoted off as false)
    routing_replay: Literal["none", "rollout"] = "none"
    # log-probs in scoring and training straight from the hidden states and the output weight,
    # chunked (megarl.ops.head_logprobs): the [tokens, V] logits never exist; false:
    # through the logits (same results within fp32 rounding)
    fused_head: bool = True
    # updates
    ppo_epochs: int = 1
    mini_batches: int = 1  # optimizer steps per epoch and trained role
    micro_batch_size: int = 8  # sequences per micro-batch, or
    max_tokens_per_micro_batch: Optional[int] = None  # a token budget instead (dynamic batch size)
    clip_low: float = 0.2
    clip_high: float = 0.2  # > clip_low: DAPO's clip-higher
    dual_clip: Optional[float] = None  # e.g. 3.0: bound the loss of negative advantages
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    entropy_coef: float = 0.0
    # KL to the reference
    kl_coef: float = 0.0  # 0: no reference role
    kl_in: Literal["loss", "reward"] = "loss"  # GRPO-style loss term, or a per-token reward penalty
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_target: Optional[float] = None  # set: Ziegler et al.'s adaptive coefficient
    kl_horizon: int = 10000
    kl_ceiling: Optional[float] = None  # stop (last good checkpoint kept) when KL stays above it
    kl_ceiling_steps: int = 3
    # advantages
    gamma: float = 1.0
    lam: float = 0.95
    scale_by_std: bool = True  # GRPO's std normalisation (false: Dr. GRPO)
    whiten_advantages: Optional[bool] = None  # None: the algorithm's default (algorithms/spec.py: ppo, reinforce_pp)
    value_clip: Optional[float] = 0.2
    # rewards
    # a built-in (final_answer, gsm8k, exact_match, format) or module:function; null: RM only
    reward_fn: Optional[str] = "final_answer"
    reward_model_coef: float = 0.0  # > 0: add coef x the reward model's score (needs reward_model/)
    reward_clip: Optional[float] = None
    max_reward_failures: float = 0.1  # fraction of a batch a user reward function may fail on
    max_nonfinite_steps: int = 3  # non-finite loss/reward: skip the step; this many in a row stop
    # DAPO (Yu et al. 2025): dynamic sampling replaces groups whose rewards are all equal (no
    # group-relative signal) by groups of further prompts, up to max_resample_rounds generations
    # per step (then the batch is filled with groups without signal, in order)
    dynamic_sampling: bool = False
    max_resample_rounds: int = 3
    # responses that hit max_new_tokens: "filter" masks them out of the loss; "soft" adds DAPO's
    # linear penalty (0 to -overlong_penalty) over the last overlong_buffer tokens before the limit
    overlong: Literal["none", "filter", "soft"] = "none"
    overlong_buffer: int = 16
    overlong_penalty: float = 1.0
    # evaluation (every train.eval_interval steps)
    eval_before_train: bool = True  # step 0: the model RL starts from, evaluated the same way
    eval_prompts: int = 64
    eval_samples: int = 4  # k of pass@k (samples per held-out prompt)
    eval_reward_fn: str = "final_answer"  # a sample passes when this reward is > 0
    eval_temperature: float = 1.0  # 0: greedy (every sample of a prompt the argmax; pass@k = pass@1)
    # tools the policy may call inside a response, in rollouts and in evaluation (`megarl eval`)
    # (megarl/rollout/tools.py): built-in names (calculator; python) or module:function
    tools: list[str] = field(default_factory=list)
    max_tool_calls: int = 4  # per sample; a call beyond it ends the sample (counted, never an error)
    tool_timeout_s: float = 5.0  # per call; a timeout is an `error: ...` observation
    tool_max_output_chars: int = 256  # a tool's output is cut there
    python_tool: bool = False  # allow the python tool (runs model-written code in a limited subprocess)


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
    dpo: DPOConfig = field(default_factory=DPOConfig)
    rl: RLConfig = field(default_factory=RLConfig)


ROLE_INIT_DEFAULTS = {"actor": "sft", "reference": "sft", "critic": "reward_model", "reward": "reward_model"}


@dataclass
class ResolvedRole:
    """A role's effective settings: its own where set, the top-level ones elsewhere."""

    name: str
    model: ModelConfig
    optim: OptimConfig
    lr_schedule: LRScheduleConfig
    precision: str
    init_from: str
    offload: OffloadConfig


def role_config(cfg: "Config", name: str) -> ResolvedRole:
    r: RoleConfig = getattr(cfg.roles, name)
    init_from = r.init_from
    if init_from is None:  # the reference is the actor's starting point, wherever that is
        init_from = role_config(cfg, "actor").init_from if name == "reference" else ROLE_INIT_DEFAULTS[name]
    model = r.model or cfg.model
    if name in ("critic", "reward") and model.lora is not None:  # LoRA serves the policy; scalar heads train dense
        model = dataclasses.replace(model, lora=None)
    return ResolvedRole(name=name, model=model, optim=r.optim or cfg.optim,
                        lr_schedule=r.lr_schedule or cfg.lr_schedule, precision=r.precision or cfg.train.precision,
                        init_from=init_from, offload=r.offload)
