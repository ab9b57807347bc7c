"""A Hugging Face config.json -> the model section it stands for (`ModelConfig`).

Pure functions of a dict, so that the config loader (`model.from_hf`) and the checkpoint
converters (megarl/checkpoint/hf.py) read a config.json the same way. `HF_MODEL_FIELDS` are the
fields a config.json fixes: every one that changes the model's maths (shapes, RoPE, norm eps,
positions, biases, tied embeddings). The activation (SwiGLU with silu) and bias-free MLPs are
megarl's only kind, so a config.json that asks for another is refused here rather than compared.
"""
from __future__ import annotations

import json
import os

from megarl.config.schema import ModelConfig, MoEConfig

# architecture -> (model_type, attention projections carry a bias, per-head q/k RMSNorm)
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", False, False),
    "Qwen2ForCausalLM": ("qwen2", True, False),
    "Qwen3ForCausalLM": ("qwen3", False, True),
    "MistralForCausalLM": ("mistral", False, False),
    "Qwen3MoeForCausalLM": ("qwen3_moe", False, True),
    "MixtralForCausalLM": ("mixtral", False, False),
}
MODEL_TYPES = {model_type: arch for arch, (model_type, _, _) in ARCHITECTURES.items()}  # `--arch` names
# MoE architectures' layer names: (MoE block, expert gate / up / down projections); their routers
# are megatron-core's softmax over the top-k logits (Qwen3-MoE's norm_topk_prob, Mixtral's)
EXPERT_NAMES = {
    "Qwen3MoeForCausalLM": ("mlp", ("gate_proj.weight", "up_proj.weight", "down_proj.weight")),
    "MixtralForCausalLM": ("block_sparse_moe", ("w1.weight", "w3.weight", "w2.weight")),
}
# megatron-core's RotaryEmbedding._apply_scaling hard-codes these (Llama-3.1 values); only the
# factor is configurable (ModelConfig.rope_scaling_factor).
MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# ModelConfig fields a config.json fixes (init_std, dropout, the layer implementation and where
# the weights come from stay the run's own).
HF_MODEL_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_kv_heads", "head_dim",
                   "vocab_size", "max_position_embeddings", "rotary_base", "rope_scaling_factor", "qkv_bias",
                   "qk_norm", "tie_embeddings", "norm_eps")
# model.moe's fields a config.json gives (the rest, e.g. aux_loss_coeff, are training choices)
MOE_HF_FIELDS = ("num_experts", "topk", "score", "expert_hidden")
COMPARED_FIELDS = HF_MODEL_FIELDS + tuple(f"moe.{k}" for k in MOE_HF_FIELDS)


def _names(items, limit: int = 8) -> str:
    items = list(items)
    more = f" (+{len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


# --------------------------------------------------------------------------- config


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path}: not found") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from None


def hf_model_config(hf_dir: str) -> ModelConfig:
    """The model section of the Hugging Face directory `hf_dir` (its config.json); ValueError in one line."""
    path = os.path.join(hf_dir, "config.json")
    return hf_config_to_model_config(_read_json(path), source=path)


def model_fields(mc: ModelConfig) -> dict:
    """COMPARED_FIELDS of `mc`, null defaults resolved (num_kv_heads, head_dim, the experts'
    width), a dense model's moe.* all None, for comparison."""
    out = {k: getattr(mc, k) for k in HF_MODEL_FIELDS}
    out["num_kv_heads"] = out["num_kv_heads"] or mc.num_attention_heads
    out["head_dim"] = out["head_dim"] or mc.hidden_size // max(mc.num_attention_heads, 1)
    moe = mc.moe
    for k in MOE_HF_FIELDS:
        out[f"moe.{k}"] = getattr(moe, k) if moe.num_experts else None
    if moe.num_experts:
        out["moe.expert_hidden"] = moe.expert_hidden or mc.ffn_hidden_size
    return out


def field_diff(have: ModelConfig, want: ModelConfig, keys=COMPARED_FIELDS) -> list[str]:
    """'key=<have's> (config: <want's>)' for each of `keys` where the two differ."""
    h, w = model_fields(have), model_fields(want)
    return [f"{k}={h[k]} (config: {w[k]})" for k in keys if h[k] != w[k]]


def hf_config_to_model_config(config_json: dict, *, source: str = "config.json") -> ModelConfig:
    """A Hugging Face config.json (dict) -> ModelConfig; ValueError naming what is unsupported.

    Accepts both transformers-4 keys (rope_theta / rope_scaling) and transformers-5 keys
    (rope_parameters). Rejects anything megarl would silently compute differently.
    `source` prefixes error messages (the file's path when read from disk).
    """
    try:
        return _model_config(config_json)
    except ValueError as e:  # the rules below say "config.json: ..."; name the real file
        raise ValueError(str(e).replace("config.json:", f"{source}:", 1)) from None


def _model_config(c: dict) -> ModelConfig:
    archs = c.get("architectures") or []
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise ValueError(f"config.json: unsupported architectures {archs!r}; supported: {_names(ARCHITECTURES)}")
    arch = archs[0]
    _, qkv_bias, qk_norm = ARCHITECTURES[arch]

    def need(key):
        if c.get(key) is None:
            raise ValueError(f"config.json: missing required key '{key}' for {arch}")
        return c[key]

    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    kv_heads = int(c.get("num_key_value_heads") or heads)
    max_pos = int(need("max_position_embeddings"))
    head_dim = int(c["head_dim"]) if c.get("head_dim") is not None else None
    if head_dim == hidden // heads and hidden % heads == 0:
        head_dim = None  # the default; ModelConfig keeps null for it
    if (head_dim is None and hidden % heads) or heads % kv_heads:
        raise ValueError(f"config.json: hidden_size {hidden}, num_attention_heads {heads} and "
                         f"num_key_value_heads {kv_heads} must divide evenly")
    if head_dim is not None and arch == "Qwen2ForCausalLM":
        raise ValueError(f"config.json: head_dim {head_dim} != hidden_size/num_attention_heads "
                         f"({hidden // heads}) is unsupported for {arch}")
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act {c['hidden_act']!r} is unsupported (megarl uses SwiGLU with silu)")
    for flag in ("attention_bias", "mlp_bias", "use_mrope"):
        if c.get(flag):
            raise ValueError(f"config.json: {flag}=true is unsupported for {arch}")
    if c.get("quantization_config"):
        raise ValueError("config.json: quantization_config is unsupported (quantized checkpoints)")
    _check_full_attention(c, arch, int(need("num_hidden_layers")), max_pos)
    theta, factor = _rope(c)
    moe = _moe_config(c, arch, need) if arch in EXPERT_NAMES else MoEConfig()
    return ModelConfig(
        num_layers=int(c["num_hidden_layers"]),
        hidden_size=hidden,
        ffn_hidden_size=int(need("intermediate_size")),
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=int(need("vocab_size")),
        max_position_embeddings=max_pos,
        rotary_base=theta,
        rope_scaling_factor=factor,
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        init_std=float(c.get("initializer_range", 0.02)),
        attention_dropout=float(c.get("attention_dropout", 0.0) or 0.0),
        moe=moe,
    )


def _moe_config(c: dict, arch: str, need) -> MoEConfig:
    """An MoE architecture's experts; every layer must be sparse and route as megatron-core does."""
    experts = c.get("num_experts", c.get("num_local_experts"))
    if not experts:
        raise ValueError(f"config.json: missing required key 'num_experts' for {arch}")
    if arch == "Qwen3MoeForCausalLM":
        if int(c.get("decoder_sparse_step", 1)) != 1 or c.get("mlp_only_layers"):
            raise ValueError("config.json: decoder_sparse_step != 1 or mlp_only_layers (dense layers among MoE "
                             "layers) is unsupported; every layer must be MoE")
        if not c.get("norm_topk_prob", False):
            raise ValueError("config.json: norm_topk_prob=false is unsupported (megarl's softmax router "
                             "renormalises the top-k probabilities)")
    hidden = int(need("moe_intermediate_size")) if arch == "Qwen3MoeForCausalLM" else int(need("intermediate_size"))
    return MoEConfig(num_experts=int(experts), topk=int(need("num_experts_per_tok")), score="softmax",
                     expert_hidden=hidden)


def _check_full_attention(c: dict, arch: str, num_layers: int, max_pos: int) -> None:
    """megarl attends causally over the whole sequence: a window must never bind."""
    window = c.get("sliding_window")
    binds = window is not None and int(window) < max_pos
    if arch in ("MistralForCausalLM", "MixtralForCausalLM") and binds:
        raise ValueError(f"config.json: sliding_window {window} < max_position_embeddings {max_pos} is unsupported "
                         "(set sliding_window to null or >= max_position_embeddings)")
    if arch == "Qwen2ForCausalLM":
        layer_types = c.get("layer_types")
        if layer_types is None:  # transformers 4: layers >= max_window_layers slide
            first = int(c.get("max_window_layers", num_layers))
            layer_types = ["sliding_attention" if c.get("use_sliding_window") and i >= first else "full_attention"
                           for i in range(num_layers)]
        sliding = [i for i, t in enumerate(layer_types) if t != "full_attention"]
        if sliding and binds and c.get("use_sliding_window", True):
            raise ValueError(f"config.json: use_sliding_window/layer_types make layers {sliding} use a "
                             f"sliding_window of {window} < max_position_embeddings {max_pos}; unsupported")
    elif any(t != "full_attention" for t in c.get("layer_types") or []):
        raise ValueError(f"config.json: layer_types {sorted(set(c['layer_types']))} unsupported (full_attention only)")


def _rope(c: dict) -> tuple[float, float | None]:
    """(rotary_base, rope_scaling_factor) from either transformers generation of keys."""
    params = c.get("rope_parameters")
    key = "rope_parameters"
    if params is None:
        params = c.get("rope_scaling") or {}
        key = "rope_scaling"
    theta = float(params.get("rope_theta", c.get("rope_theta", 10000.0)))
    if theta != int(theta):
        raise ValueError(f"config.json: rope_theta {theta} is not an integer (megatron-core's rotary_base is an int)")
    partial = params.get("partial_rotary_factor", c.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"config.json: partial_rotary_factor {partial} is unsupported (full rotary only)")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ValueError(f"config.json: {key} type {kind!r} is unsupported (only 'default' and 'llama3')")
    for name, want in MEGATRON_LLAMA3_ROPE.items():
        if params.get(name) is None or float(params[name]) != want:
            raise ValueError(f"config.json: {key}.{name}={params.get(name)} is unsupported; megatron-core's "
                             f"llama3 rope scaling fixes it to {want}")
    if params.get("factor") is None or float(params["factor"]) <= 0:
        raise ValueError(f"config.json: {key}.factor must be a positive number, got {params.get('factor')}")
    return theta, float(params["factor"])
