"""A per-GPU memory estimate of a run, from its config alone (shown by `megarl validate`).

Deliberately simple, and an estimate, not a measurement (the residency ledger and
torch.cuda.max_memory_allocated are the measurements):
- model states per role, on the worst pipeline stage (the one holding the embedding or the output
  layer), after TP/PP sharding: weights in the training precision (GEMM weights 1 byte with
  train.fp8.param_gather), fp32 gradient buffers (megarl reduces gradients in fp32) and Adam state
  (fp32 master copy unless fp32 training, exp_avg, exp_avg_sq), divided over DP with the
  distributed optimizer; a LoRA role (model.lora) has gradients and Adam state for its adapters
  only, and a LoRA actor is its own reference (no reference role: trainers/weights.py);
- offload: a role's offloaded states are on the GPU only in its own phases, so the peak holds
  every role's resident states plus the largest one role's offloaded states;
- MoE layers: this rank's num_experts / ep experts (each 3 h x expert_hidden / etp), the router
  and the shared expert in place of the MLP; the experts' Adam state divides over the
  expert-data-parallel ranks (world / (etp x ep x pp)) with the distributed optimizer;
- activations of one training micro-batch without recomputation, per token and layer:
  4h + (2 heads + 2 kv) head_dim + 3 ffn values (norm inputs/outputs, q/k/v/attention output for
  SDPA/flash attention -- no s x s scores --, SwiGLU's gate, up and product), the TP-sharded parts
  / tp, the h parts / tp only with sequence parallelism (MoE: topk x (3 expert_hidden / etp + 2 h)
  for the experts' SwiGLU and the dispatched copies of the token, plus the shared expert's 3
  widths / tp, in place of 3 ffn); times the micro-batches 1F1B keeps in
  flight on the first stage (min(pp, micro-batches)); plus the vocab-parallel logits and their
  gradient on the last stage;
- generation: the KV cache of one rollout micro-batch (in the actor's precision: FP8 does not
  shrink it);
- a fixed OVERHEAD for the CUDA context, NCCL buffers and allocator fragmentation.
Not counted: TE's FP8 transpose caches and amax histories, temporary GEMM workspaces, the
prefill's logits.
"""
from __future__ import annotations

from dataclasses import dataclass

from megarl.config.schema import Config, ModelConfig, OffloadConfig, role_config
from megarl.models.gpt import padded_vocab_size
from megarl.models.lora import adapter_param_count

GiB = 2**30
OVERHEAD_BYTES = 3 * GiB  # CUDA context (~0.5-1 GiB), NCCL buffers, allocator fragmentation
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass
class ParamCounts:
    """Parameters of this TP rank on the worst pipeline stage: GEMM weights and the rest."""

    gemm: int  # transformer linear weights (what FP8 stores in 1 byte), experts included
    other: int  # embeddings, output layer, norms, biases, scalar head, routers
    expert: int = 0  # the MoE experts' share of gemm (their optimizer state splits over expert DP)

    @property
    def total(self) -> int:
        return self.gemm + self.other


def stage_params(m: ModelConfig, tp: int, pp: int, head: str = "lm", ep: int = 1, etp: int | None = None) -> ParamCounts:
    h, hd = m.hidden_size, m.head_dim or m.hidden_size // m.num_attention_heads
    kv = m.num_kv_heads or m.num_attention_heads
    qkv_out = (m.num_attention_heads + 2 * kv) * hd
    moe = m.moe
    experts = moe.num_experts // ep * 3 * h * (moe.expert_hidden or m.ffn_hidden_size) // (etp or tp)
    mlp = 3 * h * (moe.shared_expert_hidden if moe.num_experts else m.ffn_hidden_size)
    gemm_layer = (h * qkv_out + m.num_attention_heads * hd * h + mlp) // tp + experts
    other_layer = 2 * h + (qkv_out // tp if m.qkv_bias else 0) + (2 * hd if m.qk_norm else 0) + moe.num_experts * h
    layers = m.num_layers // pp
    vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp) * h // tp
    if head == "scalar":
        output = h + 1
    else:
        output = 0 if m.tie_embeddings and pp == 1 else vocab  # tied over PP: the last stage keeps a copy
    first = vocab + (output + h if pp == 1 else 0)
    last = output + h + (vocab if pp == 1 else 0)
    return ParamCounts(gemm=layers * gemm_layer, other=layers * other_layer + max(first, last),
                       expert=layers * experts)


@dataclass
class RoleMemory:
    name: str
    params: int  # bytes
    grads: int
    optimizer: int
    offload: OffloadConfig

    def resident(self) -> int:
        o = self.offload
        return (0 if o.params else self.params) + (0 if o.grads else self.grads) + (0 if o.optimizer else self.optimizer)

    def offloaded(self) -> int:
        o = self.offload
        return (self.params if o.params else 0) + (self.grads if o.grads else 0) + (self.optimizer if o.optimizer else 0)


def role_memory(name: str, m: ModelConfig, cfg: Config, dp: int, precision: str, trained: bool,
                offload: OffloadConfig, head: str = "lm", expert_dp: int = 1) -> RoleMemory:
    p = cfg.parallel
    n = stage_params(m, p.tp, p.pp, head, p.ep, p.etp)
    fp8_weights = cfg.train.fp8.format is not None and cfg.train.fp8.param_gather
    params = (n.gemm * (1 if fp8_weights else BYTES[precision])) + n.other * BYTES[precision]
    trainable = n.total
    if m.lora is not None:  # a frozen base: gradients and Adam state for the adapters only
        trainable = adapter_param_count(m, p.tp, p.pp)
        params += trainable * BYTES[precision]
    if not trained:
        return RoleMemory(name, params, 0, 0, offload)
    per_param = 8 if precision == "fp32" else 12  # (master copy +) exp_avg + exp_avg_sq, fp32
    if m.lora is not None:  # the adapters' states only (dense: the experts' bases are frozen too)
        adam = per_param * trainable
        return RoleMemory(name, params, 4 * trainable, adam // dp if p.distributed_optimizer else adam, offload)
    dense, experts = per_param * (n.total - n.expert), per_param * n.expert
    adam = dense // dp + experts // expert_dp if p.distributed_optimizer else dense + experts
    return RoleMemory(name, params, 4 * n.total, adam, offload)


def activation_bytes(m: ModelConfig, cfg: Config, precision: str, tokens: int, micro_batches: int,
                     head: str = "lm") -> int:
    """One training micro-batch of `tokens` tokens on the first (activations) or last stage
    (plus logits), whichever is larger."""
    p, b = cfg.parallel, BYTES[precision]
    hd = m.head_dim or m.hidden_size // m.num_attention_heads
    kv = m.num_kv_heads or m.num_attention_heads
    h_part = 4 * m.hidden_size // (p.tp if p.sequence_parallel else 1)
    tp_part = ((2 * m.num_attention_heads + 2 * kv) * hd + 3 * m.ffn_hidden_size) // p.tp
    moe = m.moe
    if moe.num_experts:  # top-k experts' SwiGLU values and the dispatched token copies, the shared expert
        tp_part += (3 * moe.shared_expert_hidden - 3 * m.ffn_hidden_size) // p.tp
        h_part += moe.topk * (3 * (moe.expert_hidden or m.ffn_hidden_size) // (p.etp or p.tp) + 2 * m.hidden_size)
    per_layer = tokens * (h_part + tp_part) * b
    layers = m.num_layers // p.pp
    first = per_layer * layers * min(p.pp, micro_batches)
    logits = 0 if head == "scalar" else 2 * tokens * padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, p.tp) // p.tp * b
    last = per_layer * layers + logits
    return max(first, last)


def kv_cache_bytes(m: ModelConfig, cfg: Config, rows: int, length: int, precision: str = "bf16") -> int:
    """K and V of every layer on this stage for `rows` sequences of `length` tokens."""
    p = cfg.parallel
    hd = m.head_dim or m.hidden_size // m.num_attention_heads
    kv = m.num_kv_heads or m.num_attention_heads
    return 2 * (m.num_layers // p.pp) * max(kv // p.tp, 1) * hd * rows * length * BYTES[precision]


@dataclass
class MemoryEstimate:
    roles: list[RoleMemory]
    activations: int
    activation_note: str
    kv_cache: int
    kv_note: str

    @property
    def states_at_peak(self) -> int:
        return sum(r.resident() for r in self.roles) + max((r.offloaded() for r in self.roles), default=0)

    @property
    def peak(self) -> int:
        return self.states_at_peak + max(self.activations, self.kv_cache) + OVERHEAD_BYTES


def estimate(cfg: Config, world_size: int, stage: str, roles: list[str] | None = None) -> MemoryEstimate:
    """stage: sft, rm (one trained model) or rl (`roles`: the RL roles the run builds)."""
    p = cfg.parallel
    dp = p.dp if p.dp is not None else max(world_size // (p.tp * p.pp * p.cp), 1)
    expert_dp = max(world_size // ((p.etp or p.tp) * p.ep * p.pp), 1)
    if stage != "rl":
        head = "scalar" if stage == "rm" else "lm"
        rows = cfg.data.micro_batch_size * (2 if stage == "rm" else 1)  # RM: chosen + rejected rows
        tokens = rows * cfg.data.seq_length
        n_micro = cfg.data.global_batch_size // max(cfg.data.micro_batch_size * dp, 1)
        role = role_memory("policy" if stage == "sft" else "reward_model", cfg.model, cfg, dp, cfg.train.precision,
                           True, OffloadConfig(), head, expert_dp)
        act = activation_bytes(cfg.model, cfg, cfg.train.precision, tokens, n_micro, head)
        return MemoryEstimate([role], act, f"train micro-batch of {tokens} tokens", 0, "")
    r = cfg.rl
    mems = []
    for name in roles or ["actor"]:
        rc = role_config(cfg, name)
        head = "scalar" if name in ("critic", "reward") else "lm"
        trained = name in ("actor", "critic")
        mems.append(role_memory(name, rc.model, cfg, dp, rc.precision, trained, rc.offload, head, expert_dp))
    length = r.max_prompt_len + r.max_new_tokens
    tokens = r.max_tokens_per_micro_batch or r.micro_batch_size * length
    rows_per_rank = r.prompts_per_step // dp * r.samples_per_prompt
    n_micro = max(rows_per_rank // r.mini_batches // max(tokens // length, 1), 1)
    actor = role_config(cfg, "actor")
    act = activation_bytes(actor.model, cfg, actor.precision, tokens, n_micro)
    gen_rows = min(r.rollout_batch_size, rows_per_rank)
    kv = kv_cache_bytes(actor.model, cfg, gen_rows, length, actor.precision)
    return MemoryEstimate(mems, act, f"train micro-batch of {tokens} tokens", kv,
                          f"rollout batch {gen_rows} x {length} tokens")


def gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB // 10 else f"{n / 2**20:.1f} MiB"


def format_estimate(e: MemoryEstimate, device_bytes: int | None = None, device_name: str = "") -> list[str]:
    """The lines `megarl validate` prints."""
    lines = ["memory estimate per GPU (model states on the worst pipeline stage; see megarl/models/memory.py):"]
    for r in e.roles:
        moved = [k for k in ("params", "grads", "optimizer") if getattr(r.offload, k)]
        lines.append(f"  {r.name:<12} params {gib(r.params):>9}  grads {gib(r.grads):>9}  "
                     f"optimizer {gib(r.optimizer):>9}  offloaded: {', '.join(moved) or '-'}")
    lines.append(f"  states at peak {gib(e.states_at_peak)} + activations {gib(e.activations)} ({e.activation_note})"
                 + (f" or KV cache {gib(e.kv_cache)} ({e.kv_note})" if e.kv_note else "")
                 + f" + overhead {gib(OVERHEAD_BYTES)}")
    verdict = ""
    if device_bytes:
        fits = e.peak <= device_bytes
        verdict = (f" of {gib(device_bytes)} on {device_name}: " + ("fits" if fits else
                   "does NOT fit: offload more states, raise tp/pp, or lower the micro-batch"))
    lines.append(f"  peak ~ {gib(e.peak)}{verdict}")
    return lines
