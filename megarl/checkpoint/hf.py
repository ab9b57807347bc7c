"""Hugging Face interop: Llama / Qwen2 / Qwen3 / Mistral / Qwen3-MoE / Mixtral safetensors <-> canonical tensors.

The canonical dict (see megarl/models/layout.py) is what a TP=1/PP=1 megarl model holds, so
this module never touches process groups: a converter process and a role being built
(`model.init_from: <hf dir>`) call the same pure functions, and `layout.load_full_state_dict`
/ `gather_full_state_dict` do the sharding.

Name mapping per layer i (HF `model.layers.{i}.` -> canonical `decoder.layers.{i}.`):
    input_layernorm.weight              -> input_layernorm.weight
    self_attn.{q,k,v}_proj.{weight,bias} -> self_attention.linear_qkv.{weight,bias}  (fused per
        KV group g: [q heads of g; k_g; v_g], megatron-core's layout)
    self_attn.o_proj.weight             -> self_attention.linear_proj.weight
    self_attn.{q,k}_norm.weight         -> self_attention.{q,k}_layernorm.weight  (Qwen3)
    post_attention_layernorm.weight     -> pre_mlp_layernorm.weight
    mlp.{gate,up}_proj.weight           -> mlp.linear_fc1.weight  ([gate; up])
    mlp.down_proj.weight                -> mlp.linear_fc2.weight
MoE layers (Qwen3-MoE `mlp.`, Mixtral `block_sparse_moe.`; EXPERT_NAMES) instead of the MLP:
    {mlp}.gate.weight                   -> mlp.router.weight
    {mlp}.experts.{j}.{gate,up}         -> mlp.experts.local_experts.{j}.linear_fc1.weight ([gate; up])
    {mlp}.experts.{j}.{down}            -> mlp.experts.local_experts.{j}.linear_fc2.weight
plus model.embed_tokens.weight -> embedding.word_embeddings.weight, model.norm.weight ->
decoder.final_layernorm.weight and lm_head.weight -> output_layer.weight (absent when tied).

Import validates everything (config, files, names, shapes) before reading any tensor data and
reports all problems in one line; export writes into a temporary directory and renames it.
An export is usable as it is: config.json and generation_config.json carry the tokenizer's
special ids (generation stops at the chat's end-of-turn token), and the tokenizer is written
beside the weights (an HF tokenizer's files, or `byte_tokenizer_files` for megarl's bytes).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial

import torch

from megarl.config.hf import (
    ARCHITECTURES, EXPERT_NAMES, MEGATRON_LLAMA3_ROPE, _names, _read_json, hf_config_to_model_config, hf_model_config,
)
from megarl.config.schema import ModelConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")
SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
# Derived buffers some older checkpoints carry; recomputed from the config, never loaded.
_DERIVED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


# --------------------------------------------------------------------------- config


def model_config_to_hf_config(mc: ModelConfig, arch: str, torch_dtype: str = "float32") -> dict:
    """ModelConfig -> config.json dict for `arch` (transformers-4 rope keys, which 5 also reads)."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {_names(ARCHITECTURES)}")
    model_type, arch_bias, arch_qk_norm = ARCHITECTURES[arch]
    if mc.qkv_bias != arch_bias:
        raise ValueError(f"{arch} cannot express qkv_bias={mc.qkv_bias} (its q/k/v projections "
                         f"{'always' if arch_bias else 'never'} have a bias)")
    if mc.qk_norm != arch_qk_norm:
        raise ValueError(f"{arch} cannot express qk_norm={mc.qk_norm} (it "
                         f"{'always' if arch_qk_norm else 'never'} normalises q and k per head)")
    if mc.head_dim is not None and arch == "Qwen2ForCausalLM":
        raise ValueError(f"{arch} cannot express head_dim={mc.head_dim} != hidden_size/num_attention_heads")
    if mc.rotary_base != int(mc.rotary_base):
        raise ValueError(f"rotary_base {mc.rotary_base} is not an integer")
    moe = mc.moe
    if bool(moe.num_experts) != (arch in EXPERT_NAMES):
        raise ValueError(f"{arch} cannot express model.moe.num_experts={moe.num_experts}"
                         + (" (a MoE architecture)" if arch in EXPERT_NAMES else " (a dense architecture)"))
    if moe.num_experts and (moe.score != "softmax" or moe.shared_expert_hidden):
        raise ValueError(f"{arch} cannot express model.moe.score={moe.score} or a shared expert "
                         f"(shared_expert_hidden={moe.shared_expert_hidden}); it routes by softmax without one")
    scaling = None
    if mc.rope_scaling_factor is not None:
        scaling = {"rope_type": "llama3", "factor": float(mc.rope_scaling_factor), **MEGATRON_LLAMA3_ROPE}
    cfg = {
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": mc.hidden_size,
        "intermediate_size": mc.ffn_hidden_size,
        "num_hidden_layers": mc.num_layers,
        "num_attention_heads": mc.num_attention_heads,
        "num_key_value_heads": mc.num_kv_heads or mc.num_attention_heads,
        "vocab_size": mc.vocab_size,
        "max_position_embeddings": mc.max_position_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": mc.norm_eps,
        "initializer_range": mc.init_std,
        "attention_dropout": mc.attention_dropout,
        "rope_theta": float(mc.rotary_base),
        "rope_scaling": scaling,
        "tie_word_embeddings": mc.tie_embeddings,
        "torch_dtype": torch_dtype,
        "use_cache": True,
    }
    if arch != "Qwen2ForCausalLM":
        cfg["head_dim"] = mc.head_dim or mc.hidden_size // mc.num_attention_heads
    if moe.num_experts:
        cfg.update(num_experts_per_tok=moe.topk, router_aux_loss_coef=moe.aux_loss_coeff, output_router_logits=False)
    if arch == "Qwen3MoeForCausalLM":
        cfg.update(num_experts=moe.num_experts, moe_intermediate_size=moe.expert_hidden or mc.ffn_hidden_size,
                   norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    elif arch == "MixtralForCausalLM":
        if (moe.expert_hidden or mc.ffn_hidden_size) != mc.ffn_hidden_size:
            raise ValueError(f"{arch} cannot express model.moe.expert_hidden={moe.expert_hidden} != "
                             f"ffn_hidden_size={mc.ffn_hidden_size} (its experts are intermediate_size wide)")
        cfg["num_local_experts"] = moe.num_experts
    if arch == "LlamaForCausalLM":
        cfg.update(attention_bias=False, mlp_bias=False)
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=mc.num_layers)
        if arch != "Qwen2ForCausalLM":
            cfg["attention_bias"] = False
    else:
        cfg["sliding_window"] = None
    return cfg


# --------------------------------------------------------------------------- names and shapes


@dataclass(frozen=True)
class _Dims:
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    bias: bool
    qk_norm: bool
    tied: bool
    experts: int  # 0: a dense MLP
    expert_ffn: int
    shared_ffn: int

    @classmethod
    def of(cls, mc: ModelConfig) -> "_Dims":
        return cls(mc.num_layers, mc.hidden_size, mc.ffn_hidden_size, mc.num_attention_heads,
                   mc.num_kv_heads or mc.num_attention_heads, mc.head_dim or mc.hidden_size // mc.num_attention_heads,
                   mc.vocab_size, mc.qkv_bias, mc.qk_norm, mc.tie_embeddings, mc.moe.num_experts,
                   mc.moe.expert_hidden or mc.ffn_hidden_size, mc.moe.shared_expert_hidden)


def _expert_names(arch: str | None, d: _Dims):
    """(MoE block prefix, (gate, up, down) suffixes) of `arch`; ValueError for a MoE model of a
    dense architecture."""
    if arch not in EXPERT_NAMES:
        raise ValueError(f"{arch} has no mixture-of-experts layers ({d.experts} experts configured)")
    return EXPERT_NAMES[arch]


def hf_shapes(mc: ModelConfig, arch: str | None = None) -> dict[str, tuple]:
    """Every tensor an HF checkpoint of this model holds, in file order, with its shape
    (`arch` names a MoE model's expert tensors)."""
    d = _Dims.of(mc)
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    out = {"model.embed_tokens.weight": (d.vocab, d.hidden)}
    for i in range(d.layers):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (q, d.hidden), p + "self_attn.k_proj.weight": (kv, d.hidden),
                    p + "self_attn.v_proj.weight": (kv, d.hidden)})
        if d.bias:
            out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                        p + "self_attn.v_proj.bias": (kv,)})
        if d.qk_norm:
            out.update({p + "self_attn.q_norm.weight": (d.head_dim,), p + "self_attn.k_norm.weight": (d.head_dim,)})
        out[p + "self_attn.o_proj.weight"] = (d.hidden, q)
        if d.experts:
            block, (gate, up, down) = _expert_names(arch, d)
            out[p + f"{block}.gate.weight"] = (d.experts, d.hidden)
            for j in range(d.experts):
                e = p + f"{block}.experts.{j}."
                out.update({e + gate: (d.expert_ffn, d.hidden), e + up: (d.expert_ffn, d.hidden),
                            e + down: (d.hidden, d.expert_ffn)})
        else:
            out.update({p + "mlp.gate_proj.weight": (d.ffn, d.hidden), p + "mlp.up_proj.weight": (d.ffn, d.hidden),
                        p + "mlp.down_proj.weight": (d.hidden, d.ffn)})
        out.update({p + "input_layernorm.weight": (d.hidden,), p + "post_attention_layernorm.weight": (d.hidden,)})
    out["model.norm.weight"] = (d.hidden,)
    if not d.tied:
        out["lm_head.weight"] = (d.vocab, d.hidden)
    return out


def canonical_shapes(mc: ModelConfig) -> dict[str, tuple]:
    """Every canonical tensor (layout.py) of this model with its shape."""
    d = _Dims.of(mc)
    qkv = (d.heads + 2 * d.kv_heads) * d.head_dim
    out = {"embedding.word_embeddings.weight": (d.vocab, d.hidden)}
    for i in range(d.layers):
        p = f"decoder.layers.{i}."
        out[p + "input_layernorm.weight"] = (d.hidden,)
        out[p + "self_attention.linear_qkv.weight"] = (qkv, d.hidden)
        if d.bias:
            out[p + "self_attention.linear_qkv.bias"] = (qkv,)
        if d.qk_norm:
            out[p + "self_attention.q_layernorm.weight"] = (d.head_dim,)
            out[p + "self_attention.k_layernorm.weight"] = (d.head_dim,)
        out.update({p + "self_attention.linear_proj.weight": (d.hidden, d.heads * d.head_dim),
                    p + "pre_mlp_layernorm.weight": (d.hidden,)})
        if not d.experts:
            out.update({p + "mlp.linear_fc1.weight": (2 * d.ffn, d.hidden), p + "mlp.linear_fc2.weight": (d.hidden, d.ffn)})
            continue
        out[p + "mlp.router.weight"] = (d.experts, d.hidden)
        for j in range(d.experts):
            e = p + f"mlp.experts.local_experts.{j}."
            out.update({e + "linear_fc1.weight": (2 * d.expert_ffn, d.hidden), e + "linear_fc2.weight": (d.hidden, d.expert_ffn)})
        if d.shared_ffn:
            out.update({p + "mlp.shared_experts.linear_fc1.weight": (2 * d.shared_ffn, d.hidden),
                        p + "mlp.shared_experts.linear_fc2.weight": (d.hidden, d.shared_ffn)})
    out["decoder.final_layernorm.weight"] = (d.hidden,)
    if not d.tied:
        out["output_layer.weight"] = (d.vocab, d.hidden)
    return out


_RENAMES = {  # one-to-one: HF layer suffix -> canonical layer suffix
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
}
_QK_NORM_RENAMES = {  # one-to-one, with qk_norm
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
}
_GLOBAL_RENAMES = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
    "lm_head.weight": "output_layer.weight",
}


def _fuse_qkv(q, k, v, d: _Dims) -> torch.Tensor:
    """q [heads*hd, ...], k/v [kv*hd, ...] -> [kv * (heads/kv + 2) * hd, ...], grouped per KV head."""
    rest = q.shape[1:]
    per_group = d.heads // d.kv_heads * d.head_dim
    q = q.reshape(d.kv_heads, per_group, *rest)
    k = k.reshape(d.kv_heads, d.head_dim, *rest)
    v = v.reshape(d.kv_heads, d.head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def _split_qkv(qkv, d: _Dims) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rest = qkv.shape[1:]
    per_group = d.heads // d.kv_heads * d.head_dim
    q, k, v = qkv.reshape(d.kv_heads, per_group + 2 * d.head_dim, *rest).split(
        [per_group, d.head_dim, d.head_dim], dim=1)
    return tuple(t.reshape(-1, *rest).contiguous() for t in (q, k, v))


def hf_to_canonical(mc: ModelConfig, hf: Mapping[str, torch.Tensor], arch: str | None = None) -> dict[str, torch.Tensor]:
    """HF-named tensors (exactly `hf_shapes(mc, arch)`) -> canonical tensors; dtypes are kept."""
    return {name: make() for name, make in _canonical_recipes(mc, hf, arch).items()}


def _canonical_recipes(mc: ModelConfig, hf: Mapping[str, torch.Tensor],
                       arch: str | None = None) -> dict[str, Callable[[], torch.Tensor]]:
    """Canonical name -> a function building that tensor from the HF tensors it needs."""
    d = _Dims.of(mc)
    gate_up = lambda a, b: torch.cat([hf[a], hf[b]], 0)  # noqa: E731
    out = {c: partial(hf.__getitem__, n) for n, c in _GLOBAL_RENAMES.items()
           if n in hf and not (d.tied and n == "lm_head.weight")}
    for i in range(d.layers):
        p, c = f"model.layers.{i}.", f"decoder.layers.{i}."
        for src, dst in {**_RENAMES, **(_QK_NORM_RENAMES if d.qk_norm else {})}.items():
            out[c + dst] = partial(hf.__getitem__, p + src)
        if not d.experts:
            out[c + "mlp.linear_fc2.weight"] = partial(hf.__getitem__, p + "mlp.down_proj.weight")
        for kind in ("weight", "bias") if d.bias else ("weight",):
            out[c + f"self_attention.linear_qkv.{kind}"] = partial(
                lambda p, kind: _fuse_qkv(*(hf[p + f"self_attn.{x}_proj.{kind}"] for x in "qkv"), d), p, kind)
        if not d.experts:
            out[c + "mlp.linear_fc1.weight"] = partial(gate_up, p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
            continue
        block, (gate, up, down) = _expert_names(arch, d)
        out[c + "mlp.router.weight"] = partial(hf.__getitem__, p + f"{block}.gate.weight")
        for j in range(d.experts):
            e, ce = p + f"{block}.experts.{j}.", c + f"mlp.experts.local_experts.{j}."
            out[ce + "linear_fc1.weight"] = partial(gate_up, e + gate, e + up)
            out[ce + "linear_fc2.weight"] = partial(hf.__getitem__, e + down)
    return out


def canonical_to_hf(mc: ModelConfig, canonical: dict[str, torch.Tensor], arch: str | None = None) -> dict[str, torch.Tensor]:
    """Canonical tensors (exactly `canonical_shapes(mc)`) -> HF-named tensors of `arch` in file order.

    Renamed tensors are the caller's objects; gate/up are views of linear_fc1 (same storage).
    """
    d = _Dims.of(mc)
    out = {hf: canonical[c] for hf, c in _GLOBAL_RENAMES.items() if not (d.tied and hf == "lm_head.weight")}
    for i in range(d.layers):
        p, c = f"model.layers.{i}.", f"decoder.layers.{i}."
        for src, dst in {**_RENAMES, **(_QK_NORM_RENAMES if d.qk_norm else {})}.items():
            out[p + src] = canonical[c + dst]
        for kind in ("weight", "bias") if d.bias else ("weight",):
            q, k, v = _split_qkv(canonical[c + f"self_attention.linear_qkv.{kind}"], d)
            out.update({p + f"self_attn.q_proj.{kind}": q, p + f"self_attn.k_proj.{kind}": k,
                        p + f"self_attn.v_proj.{kind}": v})
        if not d.experts:
            gate, up = canonical[c + "mlp.linear_fc1.weight"].chunk(2, 0)
            out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
            out[p + "mlp.down_proj.weight"] = canonical[c + "mlp.linear_fc2.weight"]
            continue
        block, (gate, up, down) = _expert_names(arch, d)
        out[p + f"{block}.gate.weight"] = canonical[c + "mlp.router.weight"]
        for j in range(d.experts):
            e, ce = p + f"{block}.experts.{j}.", c + f"mlp.experts.local_experts.{j}."
            out[e + gate], out[e + up] = canonical[ce + "linear_fc1.weight"].chunk(2, 0)
            out[e + down] = canonical[ce + "linear_fc2.weight"]
    return {n: out[n] for n in hf_shapes(mc, arch)}


def _check_shapes(got: dict[str, tuple], want: dict[str, tuple], what: str) -> list[str]:
    missing = [n for n in want if n not in got]
    extra = [n for n in got if n not in want]
    wrong = [f"{n} expected {list(want[n])} got {list(got[n])}" for n in want if n in got and tuple(got[n]) != want[n]]
    return ([f"missing {what} {_names(missing)}"] if missing else []) + \
           ([f"unexpected {what} {_names(extra)}"] if extra else []) + \
           ([f"wrong shape: {_names(wrong)}"] if wrong else [])


# --------------------------------------------------------------------------- import


def _checkpoint_tensors(hf_dir: str) -> dict[str, tuple[str, tuple]]:
    """HF tensor name -> (safetensors file, shape), from headers only; every file must exist."""
    single, index = os.path.join(hf_dir, SINGLE_FILE), os.path.join(hf_dir, INDEX_FILE)
    if os.path.exists(single):
        return {n: (single, shape) for n, shape in _header(single).items()}
    if not os.path.exists(index):
        raise ValueError(f"{hf_dir}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors checkpoints are supported)")
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: no 'weight_map'")
    bad = sorted({f for f in weight_map.values() if os.path.basename(f) != f})
    if bad:
        raise ValueError(f"{index}: shard names must be plain file names, got {_names(bad)}")
    missing = sorted({f for f in weight_map.values() if not os.path.exists(os.path.join(hf_dir, f))})
    if missing:
        raise ValueError(f"{index}: referenced shard file(s) missing in {hf_dir}: {_names(missing)}")
    headers = {f: _header(os.path.join(hf_dir, f)) for f in sorted(set(weight_map.values()))}
    absent = [f"{n} (in {f})" for n, f in weight_map.items() if n not in headers[f]]
    if absent:
        raise ValueError(f"{index}: tensors listed but not in their shard: {_names(absent)}")
    return {n: (os.path.join(hf_dir, f), headers[f][n]) for n, f in weight_map.items()}


def _header(path: str) -> dict[str, tuple]:
    """Tensor name -> shape from a safetensors header, without reading tensor data."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            return {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise ValueError(f"{path}: unreadable safetensors file ({e})") from None


def check_hf_model(hf_dir: str, model_cfg: ModelConfig) -> None:
    """CheckpointError in one line naming every field that changes the maths (HF_MODEL_FIELDS:
    shapes, RoPE base and scaling, norm eps, max positions, biases, tied embeddings) where the HF
    model in `hf_dir` (its config.json) differs from `model_cfg`, before any tensor is read: a
    wrong rotary_base loads every tensor and only the logits are wrong."""
    from megarl.checkpoint.distributed import CheckpointError
    from megarl.config.hf import field_diff

    try:
        have = hf_model_config(hf_dir)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    diff = field_diff(have, model_cfg)
    if diff:
        raise CheckpointError(f"{hf_dir}: the saved model does not match the configured one: model."
                              + ", model.".join(diff) + "; use the model section it was saved with "
                              f"(model.from_hf: {hf_dir} reads it)")


def load_hf_checkpoint(hf_dir: str, *, lazy: bool = False) -> tuple[ModelConfig, Mapping[str, torch.Tensor]]:
    """Read a safetensors checkpoint of one of ARCHITECTURES as (ModelConfig, canonical tensors).

    Everything is validated before tensor data is read, and all problems are reported in one
    ValueError, so a bad checkpoint never half-loads. Tensors keep the file's dtype (the model
    casts on load). lazy=False returns a dict: the whole model in host memory. lazy=True
    returns a `LazyCanonical` that reads (and fuses) a tensor only when it is looked up, so a
    rank loading its shards (`layout.load_full_state_dict`) touches only its pipeline stage's
    layers and holds one full tensor at a time.
    """
    from safetensors import safe_open

    hf_dir = os.fspath(hf_dir)
    config_path = os.path.join(hf_dir, "config.json")
    config_json = _read_json(config_path)
    mc = hf_config_to_model_config(config_json, source=config_path)
    arch = config_json["architectures"][0]
    found = {n: v for n, v in _checkpoint_tensors(hf_dir).items() if not _DERIVED.fullmatch(n)}
    shapes = {n: shape for n, (_, shape) in found.items()}
    want = hf_shapes(mc, arch)
    redundant_head = mc.tie_embeddings and "lm_head.weight" in shapes  # some tied checkpoints keep a copy
    if redundant_head:
        want = {**want, "lm_head.weight": want["model.embed_tokens.weight"]}
    problems = _check_shapes(shapes, want, "tensor")
    if problems:
        raise ValueError(f"{hf_dir}: cannot import: " + "; ".join(problems))
    with contextlib.ExitStack() as stack:  # tensors are read one at a time, as the mapping needs them
        opened = {p: safe_open(p, framework="pt") for p in sorted({p for p, _ in found.values()})}
        if not lazy:
            for f in opened.values():
                stack.enter_context(f)
        hf = _LazyTensors({n: opened[p] for n, (p, _) in found.items()})
        if redundant_head and not torch.equal(hf["lm_head.weight"], hf["model.embed_tokens.weight"]):
            raise ValueError(f"{hf_dir}: lm_head.weight differs from model.embed_tokens.weight "
                             "but config.json sets tie_word_embeddings=true")
        if lazy:
            return mc, LazyCanonical(_canonical_recipes(mc, hf, arch), canonical_shapes(mc))
        return mc, hf_to_canonical(mc, hf, arch)


class _LazyTensors(Mapping):
    """Name -> tensor, read from its open safetensors file on access: peak memory stays near
    the canonical dict's instead of twice it (fusing q/k/v and gate/up copies)."""

    def __init__(self, handles: dict):
        self._handles = handles

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._handles[name].get_tensor(name)

    def __contains__(self, name) -> bool:  # without reading the tensor, unlike Mapping's default
        return name in self._handles

    def __iter__(self):
        return iter(self._handles)

    def __len__(self) -> int:
        return len(self._handles)


class LazyCanonical(Mapping):
    """Canonical name -> tensor, built from the open HF files on each lookup (not cached).
    `shape_of` answers from the config without reading, for load_full_state_dict's checks."""

    def __init__(self, recipes: dict[str, Callable[[], torch.Tensor]], shapes: dict[str, tuple]):
        self._recipes, self._shapes = recipes, shapes

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._recipes[name]()

    def __contains__(self, name) -> bool:
        return name in self._recipes

    def __iter__(self):
        return iter(self._recipes)

    def __len__(self) -> int:
        return len(self._recipes)

    def shape_of(self, name: str) -> tuple:
        return self._shapes[name]


# --------------------------------------------------------------------------- export


def _plan_shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Greedy, in file order: a new shard starts when the next tensor would overflow this one."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of the `tokenizers` ByteLevel steps."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer_files(specials: list[str], *, bos: str | None, eos: str, pad: str | None, chat_template: str,
                         model_max_length: int) -> dict[str, str]:
    """tokenizer.json + tokenizer_config.json with which transformers' AutoTokenizer equals a
    byte-level tokenizer: byte b <-> id b (a BPE without merges over the ByteLevel alphabet),
    then `specials` as special tokens with ids 256, 257, ... Unlike megarl's own tokenizer, HF
    tokenizers parse special-token text (as every HF chat template needs)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {char: b for b, char in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    assert [tok.token_to_id(s) for s in specials] == list(range(256, 256 + len(specials)))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos, "pad_token": pad,
              "chat_template": chat_template, "model_max_length": model_max_length,
              "clean_up_tokenization_spaces": False}
    return {"tokenizer.json": tok.to_str(pretty=True) + "\n",
            "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}


def save_hf_checkpoint(out_dir: str, model_cfg: ModelConfig, canonical: dict[str, torch.Tensor], arch: str, *,
                       tokenizer_dir: str | None = None, tokenizer_files: dict[str, str] | None = None,
                       generation_config: dict | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                       dtype: torch.dtype | None = None, extra_config: dict | None = None,
                       overwrite: bool = False) -> None:
    """Write canonical tensors as a Hugging Face checkpoint of `arch` that from_pretrained loads.

    Shards of at most max_shard_bytes (a bigger single tensor gets its own shard) with
    model.safetensors.index.json, or one model.safetensors when everything fits, as
    save_pretrained does. dtype: cast every tensor (None keeps each tensor's dtype).
    extra_config: additional config.json keys (e.g. bos/eos_token_id); may not override derived
    ones. Tokenizer files are copied from tokenizer_dir, or written from tokenizer_files ({name:
    text}); generation_config becomes generation_config.json. Atomic: everything is written to
    a temporary sibling directory, which then replaces out_dir (overwrite=True) or becomes it.
    """
    from safetensors.torch import save_file

    from megarl.utils.atomic import as_created, atomic_directory

    out_dir = os.path.abspath(os.fspath(out_dir))
    config = model_config_to_hf_config(model_cfg, arch)
    problems = _check_shapes({n: tuple(t.shape) for n, t in canonical.items()}, canonical_shapes(model_cfg),
                             "canonical tensor")
    if problems:
        raise ValueError("cannot export: " + "; ".join(problems))
    clash = sorted(k for k, v in (extra_config or {}).items() if k in config and config[k] != v)
    if clash:
        raise ValueError(f"extra_config may not override derived config.json keys: {_names(clash)}")
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    copied = []
    if tokenizer_dir is not None:
        if tokenizer_files:
            raise ValueError("give tokenizer_dir or tokenizer_files, not both")
        copied = [f for f in TOKENIZER_FILES if os.path.exists(os.path.join(tokenizer_dir, f))]
        if not copied:
            raise ValueError(f"{tokenizer_dir}: no tokenizer files ({_names(TOKENIZER_FILES)})")
    if os.path.exists(out_dir) and os.listdir(out_dir) and not overwrite:
        raise FileExistsError(f"{out_dir}: exists and is not empty (refusing to replace it; overwrite=True, or --overwrite on the command line, does)")

    hf, storages = {}, set()
    for n, t in canonical_to_hf(model_cfg, canonical, arch).items():
        t = (t if dtype is None else t.to(dtype)).detach().cpu().contiguous()
        if t.untyped_storage().data_ptr() in storages:  # safetensors refuses shared memory
            t = t.clone()
        storages.add(t.untyped_storage().data_ptr())
        hf[n] = t
    config["torch_dtype"] = str(hf["model.embed_tokens.weight"].dtype).removeprefix("torch.")
    config.update(extra_config or {})
    shards = _plan_shards(hf, max_shard_bytes)
    with atomic_directory(out_dir, replace=True) as tmp:
        if len(shards) == 1:
            save_file(hf, os.path.join(tmp, SINGLE_FILE), metadata={"format": "pt"})
            as_created(os.path.join(tmp, SINGLE_FILE))  # safetensors makes it 0600
        else:
            weight_map = {}
            for k, names in enumerate(shards, 1):
                fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
                save_file({n: hf[n] for n in names}, os.path.join(tmp, fname), metadata={"format": "pt"})
                as_created(os.path.join(tmp, fname))
                weight_map.update({n: fname for n in names})
            total = sum(t.numel() * t.element_size() for t in hf.values())
            _write_json(os.path.join(tmp, INDEX_FILE), {"metadata": {"total_size": total}, "weight_map": weight_map})
        _write_json(os.path.join(tmp, "config.json"), config)
        if generation_config is not None:
            _write_json(os.path.join(tmp, "generation_config.json"), generation_config)
        for f in copied:
            shutil.copyfile(os.path.join(tokenizer_dir, f), os.path.join(tmp, f))
        for name, text in (tokenizer_files or {}).items():
            with open(os.path.join(tmp, name), "w") as f:
                f.write(text)


_PEFT_TARGETS = {"linear_qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")), "linear_proj": ("self_attn", ("o_proj",)),
                 "linear_fc1": ("mlp", ("gate_proj", "up_proj")), "linear_fc2": ("mlp", ("down_proj",))}


def canonical_lora_to_peft(mc: ModelConfig, canonical: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Canonical LoRA factors -> peft's tensors for the HF model. A fused linear's adapter
    becomes one adapter per HF linear: A shared, B split as the fused weight's rows are."""
    d, out = _Dims.of(mc), {}
    for i in range(d.layers):
        for target in mc.lora.targets:
            block, names = _PEFT_TARGETS[target]
            where = "self_attention" if block == "self_attn" else "mlp"
            a = canonical[f"decoder.layers.{i}.{where}.{target}.lora_a.weight"]
            b = canonical[f"decoder.layers.{i}.{where}.{target}.lora_b.weight"]
            parts = _split_qkv(b, d) if target == "linear_qkv" else b.chunk(2, 0) if target == "linear_fc1" else (b,)
            for name, part in zip(names, parts):
                p = f"base_model.model.model.layers.{i}.{block}.{name}."
                out[p + "lora_A.weight"], out[p + "lora_B.weight"] = a.clone(), part.contiguous().clone()
    return out


def save_peft_adapter(out_dir: str, model_cfg: ModelConfig, canonical: dict[str, torch.Tensor], *,
                      base: str | None = None, overwrite: bool = False) -> None:
    """Write model_cfg.lora's adapters as a directory `peft.PeftModel.from_pretrained(base_model,
    out_dir)` loads (adapter_config.json + adapter_model.safetensors); atomic, as save_hf_checkpoint."""
    from safetensors.torch import save_file

    from megarl.utils.atomic import as_created, atomic_directory

    out_dir = os.path.abspath(os.fspath(out_dir))
    if os.path.exists(out_dir) and os.listdir(out_dir) and not overwrite:
        raise FileExistsError(f"{out_dir}: exists and is not empty (refusing to replace it; --overwrite does)")
    lo = model_cfg.lora
    tensors = {k: v.detach().cpu().contiguous() for k, v in canonical_lora_to_peft(model_cfg, canonical).items()}
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lo.rank, "lora_alpha": lo.alpha,
              "lora_dropout": lo.dropout, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
              "target_modules": sorted(n for t in lo.targets for n in _PEFT_TARGETS[t][1]),
              "base_model_name_or_path": base, "inference_mode": True}
    with atomic_directory(out_dir, replace=True) as tmp:
        save_file(tensors, os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
        as_created(os.path.join(tmp, "adapter_model.safetensors"))
        _write_json(os.path.join(tmp, "adapter_config.json"), config)


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


__all__ = [
    "ARCHITECTURES", "LazyCanonical", "byte_tokenizer_files", "canonical_shapes", "canonical_to_hf", "hf_config_to_model_config",
    "hf_shapes", "hf_to_canonical", "load_hf_checkpoint", "model_config_to_hf_config", "save_hf_checkpoint",
    "save_peft_adapter",
]
