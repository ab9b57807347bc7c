"""Hugging Face interop: import/export of Llama, Qwen2 and Mistral checkpoints.

Tiny random models are built with `transformers` (no downloads) and saved sharded. Import at
TP/PP layouts must reproduce transformers' logits (fp32, eager attention) within 1e-4; export
must load in transformers and match again; megarl -> HF -> megarl is bit-exact; bad checkpoints
fail with one line naming the culprit.
"""
import json
import os
import shutil
from collections.abc import Mapping

import pytest
import torch

from dist_helpers import run_distributed

transformers = pytest.importorskip("transformers")

from megarl.checkpoint.hf import (  # noqa: E402
    canonical_shapes, hf_config_to_model_config, load_hf_checkpoint, model_config_to_hf_config,
    save_hf_checkpoint,
)

BATCH, SEQ, TOL = 2, 32, 1e-4
SMALL_SHARD = 40_000  # bytes: forces several shards for these models
COMMON = dict(hidden_size=64, intermediate_size=96, vocab_size=300, num_attention_heads=4, num_key_value_heads=2,
              rms_norm_eps=1e-5)
# name -> (config class, architecture, config kwargs)
CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(COMMON, num_hidden_layers=4, max_position_embeddings=128, rope_theta=10000.0)),
    "llama3": ("LlamaConfig", "LlamaForCausalLM",
               dict(COMMON, num_hidden_layers=2, max_position_embeddings=16384, rope_theta=500000.0,
                    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(COMMON, num_hidden_layers=2, max_position_embeddings=256, tie_word_embeddings=True,
                   rope_theta=1000000.0)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",  # per-head q/k norms, head_dim 24 != 64 / 4
              dict(COMMON, num_hidden_layers=2, head_dim=24, max_position_embeddings=256, rope_theta=1000000.0)),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(COMMON, num_hidden_layers=2, num_attention_heads=8, max_position_embeddings=256,
                     sliding_window=None)),  # 8 heads / 2 KV groups: 4 query heads per group
}


def _hf_config(name, **overrides):
    cls, arch, kwargs = CASES[name]
    return getattr(transformers, cls)(**{**kwargs, **overrides}), arch


def _randomize(model, seed):
    """Weights far from init (non-zero biases, non-unit norms) so every mapping matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else 0.1 * noise)


def _tokens():
    return torch.randint(0, 300, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))


def _hf_logits(model):
    with torch.no_grad():
        return model(input_ids=_tokens(), attention_mask=torch.ones(BATCH, SEQ, dtype=torch.long)).logits


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """name -> (saved directory, architecture, transformers logits [b, s, V])."""
    out = {}
    for i, name in enumerate(CASES):
        config, arch = _hf_config(name)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
        _randomize(model, seed=i)
        path = str(tmp_path_factory.mktemp("hf") / name)
        model.save_pretrained(path, safe_serialization=True, max_shard_size=SMALL_SHARD)
        assert os.path.exists(os.path.join(path, "model.safetensors.index.json")), "fixture must be sharded"
        out[name] = (path, arch, _hf_logits(model))
    return out


# ------------------------------------------------------------------ megarl forward at TP/PP


def _megarl_body(rank, world_size, tp, pp, dirs):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megarl.checkpoint.hf import load_hf_checkpoint
    from megarl.config import ParallelConfig
    from megarl.models.layout import gather_full_state_dict, load_full_state_dict
    from megarl.roles.role import Role
    from megarl.runtime.distributed import init_distributed, teardown

    init_distributed(tp, pp, seed=3)
    tokens = _tokens()
    mbs = [{"tokens": tokens[i:i + 1], "position_ids": torch.arange(SEQ)[None]} for i in range(BATCH)]
    out = {}
    for name, path in dirs.items():
        mc, lazy = load_hf_checkpoint(path, lazy=True)  # as model.init_from loads it
        reads = _RecordingReads(lazy)
        role = Role(name, mc, ParallelConfig(tp=tp, pp=pp), head="lm", seed=99)  # random init, then overwritten
        load_full_state_dict(role.model, reads, mc.vocab_size)
        canonical = dict(lazy) if rank == 0 else None
        shards = []

        def capture(batch, logits):  # logits: this TP rank's vocab shard [1, s, V_pad/tp]
            shards.append(logits.detach().clone())
            return logits.sum() * 0, torch.tensor(1, dtype=torch.int), {}

        role.evaluate(mbs, capture)
        logits = None
        if ps.is_pipeline_last_stage():
            local = torch.cat(shards)
            parts = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(parts, local, group=ps.get_tensor_model_parallel_group())
            logits = torch.cat(parts, -1)[..., :mc.vocab_size] if ps.get_tensor_model_parallel_rank() == 0 else None
        out[name] = {"logits": logits, "gathered": gather_full_state_dict(role.model, mc.vocab_size),
                     "loaded": canonical, "read": reads.names}
    teardown()
    return out


class _RecordingReads(Mapping):
    """A lazy canonical mapping that records which tensors a rank looked up."""

    def __init__(self, inner):
        self.inner, self.names = inner, []

    def __getitem__(self, name):
        self.names.append(name)
        return self.inner[name]

    def __contains__(self, name):
        return name in self.inner

    def __iter__(self):
        return iter(self.inner)

    def __len__(self):
        return len(self.inner)

    def shape_of(self, name):
        return self.inner.shape_of(name)


_layout_cache = {}


def _layout(hf_models, tp, pp):
    """{name: {logits, gathered, loaded}} merged over ranks; each layout runs once per session."""
    if (tp, pp) not in _layout_cache:
        dirs = {name: path for name, (path, _, _) in hf_models.items()}
        if (tp, pp) == (2, 2):
            dirs = {"qwen2": dirs["qwen2"]}  # 4 processes on 2 cores: the case with every feature
        results = run_distributed(_megarl_body, tp * pp, tp, pp, dirs)
        merged = {}
        for name in dirs:
            merged[name] = {k: next(r[name][k] for r in results if r[name][k] is not None)
                            for k in ("logits", "gathered", "loaded")}
            merged[name]["read"] = [r[name]["read"] for r in results]  # per rank
        _layout_cache[(tp, pp)] = merged
    return _layout_cache[(tp, pp)]


def _max_diff(a, b):
    assert a.shape == b.shape, f"shape {tuple(a.shape)} != {tuple(b.shape)}"
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_import_matches_transformers(hf_models, tp, pp):
    got = _layout(hf_models, tp, pp)
    for name, r in got.items():
        ref = hf_models[name][2]
        diff = _max_diff(r["logits"], ref)
        print(f"\n[hf parity] import {name} tp={tp} pp={pp}: max |logit diff| = {diff:.3g} "
              f"(logit scale {ref.abs().max():.3g})")
        assert diff <= TOL, f"{name} at tp={tp} pp={pp}: max abs logit diff {diff:.3g} > {TOL}"
        # sharding in and gathering back out is lossless at this layout
        assert r["gathered"].keys() == r["loaded"].keys()
        for k, v in r["loaded"].items():
            assert torch.equal(r["gathered"][k], v.float()), f"{name}: {k} changed through tp={tp} pp={pp}"
        # each rank read every tensor it needs once, and nothing of the other pipeline stages
        layers = {int(n.split(".")[2]) for n in r["loaded"] if n.startswith("decoder.layers.")}
        for rank, read in enumerate(r["read"]):
            assert len(read) == len(set(read)), f"rank {rank} read a tensor twice"
            stage = {int(n.split(".")[2]) for n in read if n.startswith("decoder.layers.")}
            assert len(stage) == len(layers) // pp, f"rank {rank} read layers {sorted(stage)} at pp={pp}"
        assert set().union(*map(set, r["read"])) == set(r["loaded"])


@pytest.mark.slow
def test_export_loads_in_transformers_and_round_trips(hf_models, tmp_path):
    """megarl (gathered at TP=2) -> HF: transformers loads it and matches; HF -> megarl is bit-exact."""
    got = _layout(hf_models, 2, 1)
    for name, r in got.items():
        src, arch, ref = hf_models[name]
        mc, _ = load_hf_checkpoint(src)
        out = tmp_path / name
        save_hf_checkpoint(out, mc, r["gathered"], arch, max_shard_bytes=SMALL_SHARD)
        files = sorted(os.listdir(out))
        assert "model.safetensors.index.json" in files and "model-00002-of-" in " ".join(files)
        model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
        assert type(model).__name__ == arch
        diff = _max_diff(_hf_logits(model), ref)
        print(f"\n[hf parity] export {name} -> transformers: max |logit diff| = {diff:.3g}")
        assert diff <= TOL, f"{name}: exported model's logits differ by {diff:.3g}"
        mc2, back = load_hf_checkpoint(out)
        assert mc2 == mc
        assert back.keys() == r["gathered"].keys()
        for k, v in r["gathered"].items():
            assert torch.equal(back[k], v), f"{name}: {k} not bit-exact after megarl -> HF -> megarl"


def test_llama3_scaling_is_exercised(hf_models):
    """The llama3 case would pass trivially if rope scaling did not move these logits."""
    path, _, ref = hf_models["llama3"]
    unscaled_cfg, _ = _hf_config("llama3", rope_scaling=None)
    model = transformers.AutoModelForCausalLM.from_config(unscaled_cfg, attn_implementation="eager").eval()
    model.load_state_dict(transformers.AutoModelForCausalLM.from_pretrained(path).state_dict())
    assert _max_diff(_hf_logits(model), ref) > 10 * TOL


# ------------------------------------------------------------------ pure round trips


@pytest.mark.parametrize("name", list(CASES))
def test_round_trip_bit_exact_and_dtype(hf_models, tmp_path, name):
    path, arch, _ = hf_models[name]
    mc, canonical = load_hf_checkpoint(path)
    assert hf_config_to_model_config(model_config_to_hf_config(mc, arch)) == mc
    assert {k: tuple(v.shape) for k, v in canonical.items()} == canonical_shapes(mc)
    save_hf_checkpoint(tmp_path / "fp32", mc, canonical, arch)  # fits one file: model.safetensors
    assert "model.safetensors" in os.listdir(tmp_path / "fp32")
    _, back = load_hf_checkpoint(tmp_path / "fp32")
    assert all(torch.equal(back[k], v) for k, v in canonical.items())
    save_hf_checkpoint(tmp_path / "bf16", mc, canonical, arch, dtype=torch.bfloat16, max_shard_bytes=SMALL_SHARD)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    _, half = load_hf_checkpoint(tmp_path / "bf16")
    assert all(half[k].dtype == torch.bfloat16 and torch.equal(half[k], v.bfloat16()) for k, v in canonical.items())


def test_tokenizer_copied_and_loadable(hf_models, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1, "world": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(tmp_path / "tok")
    path, arch, _ = hf_models["qwen2"]
    mc, canonical = load_hf_checkpoint(path)
    save_hf_checkpoint(tmp_path / "out", mc, canonical, arch, tokenizer_dir=tmp_path / "tok",
                       extra_config={"eos_token_id": 2})
    for f in os.listdir(tmp_path / "tok"):
        assert (tmp_path / "out" / f).read_bytes() == (tmp_path / "tok" / f).read_bytes()
    # (AutoTokenizer would pick the class from config.json's model_type; this toy vocab is generic)
    assert transformers.PreTrainedTokenizerFast.from_pretrained(tmp_path / "out")("hello world")["input_ids"] == [1, 2]
    assert json.loads((tmp_path / "out" / "config.json").read_text())["eos_token_id"] == 2


def test_export_is_atomic(hf_models, tmp_path):
    path, arch, _ = hf_models["llama"]
    mc, canonical = load_hf_checkpoint(path)
    out = tmp_path / "out"
    # A failure after the shards are written (the tokenizer copy) leaves nothing behind.
    (tmp_path / "tok" / "tokenizer.json").mkdir(parents=True)
    with pytest.raises(OSError):
        save_hf_checkpoint(out, mc, canonical, arch, tokenizer_dir=tmp_path / "tok", max_shard_bytes=SMALL_SHARD)
    assert sorted(os.listdir(tmp_path)) == ["tok"]
    # An existing export is refused, or replaced whole (no stale shard survives).
    save_hf_checkpoint(out, mc, canonical, arch, max_shard_bytes=SMALL_SHARD)
    with pytest.raises(FileExistsError, match="out: exists"):
        save_hf_checkpoint(out, mc, canonical, arch)
    save_hf_checkpoint(out, mc, canonical, arch, overwrite=True)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["out", "tok"]


# ------------------------------------------------------------------ failure paths


def _copy(hf_models, tmp_path, name="llama"):
    dst = tmp_path / name
    shutil.copytree(hf_models[name][0], dst)
    return dst


def _edit_tensors(ckpt, edit):
    """Apply edit(tensors) -> tensors to every shard, keeping the index consistent."""
    from safetensors.torch import load_file, save_file

    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    weight_map = {}
    for fname in sorted(set(index["weight_map"].values())):
        tensors = edit(load_file(ckpt / fname), fname)
        save_file(tensors, ckpt / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in tensors})
    index["weight_map"] = weight_map
    index_path.write_text(json.dumps(index))


def _edit_config(ckpt, **changes):
    path = ckpt / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def _import_error(ckpt) -> str:
    with pytest.raises(ValueError) as e:
        load_hf_checkpoint(ckpt)
    msg = str(e.value)
    assert "\n" not in msg, f"error is not one line: {msg!r}"
    return msg


def test_missing_tensor(hf_models, tmp_path):
    ckpt = _copy(hf_models, tmp_path)
    _edit_tensors(ckpt, lambda t, f: {k: v for k, v in t.items() if k != "model.layers.1.mlp.up_proj.weight"})
    msg = _import_error(ckpt)
    assert "missing tensor model.layers.1.mlp.up_proj.weight" in msg


def test_extra_tensor(hf_models, tmp_path):
    ckpt = _copy(hf_models, tmp_path)
    first = sorted(set(json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"].values()))[0]
    extra = "model.layers.0.self_attn.extra.weight"
    _edit_tensors(ckpt, lambda t, f: {**t, extra: torch.zeros(2)} if f == first else t)
    assert f"unexpected tensor {extra}" in _import_error(ckpt)


def test_wrong_shape(hf_models, tmp_path):
    ckpt = _copy(hf_models, tmp_path)
    name = "model.layers.0.self_attn.k_proj.weight"
    _edit_tensors(ckpt, lambda t, f: {k: (v[:8] if k == name else v) for k, v in t.items()})
    assert f"{name} expected [32, 64] got [8, 64]" in _import_error(ckpt)


def test_missing_shard_file(hf_models, tmp_path):
    ckpt = _copy(hf_models, tmp_path)
    shard = sorted(f for f in os.listdir(ckpt) if f.startswith("model-"))[1]
    os.remove(ckpt / shard)
    msg = _import_error(ckpt)
    assert "missing" in msg and shard in msg


def test_tied_checkpoint_with_redundant_lm_head(hf_models, tmp_path):
    """Some tied checkpoints also store lm_head.weight: fine when equal, an error when not."""
    ckpt = _copy(hf_models, tmp_path, "qwen2")
    mc, ref = load_hf_checkpoint(ckpt)
    _edit_tensors(ckpt, lambda t, f: {**t, "lm_head.weight": t["model.embed_tokens.weight"].clone()}
                  if "model.embed_tokens.weight" in t else t)
    _, got = load_hf_checkpoint(ckpt)
    assert got.keys() == ref.keys()
    _edit_tensors(ckpt, lambda t, f: {**t, "lm_head.weight": t["lm_head.weight"] + 1} if "lm_head.weight" in t else t)
    assert "lm_head.weight differs from model.embed_tokens.weight" in _import_error(ckpt)


def test_unsupported_architecture_in_checkpoint(hf_models, tmp_path):
    ckpt = _copy(hf_models, tmp_path)
    _edit_config(ckpt, architectures=["GPT2LMHeadModel"])
    assert "GPT2LMHeadModel" in _import_error(ckpt)


def test_unsupported_rope_scaling_in_checkpoint(hf_models, tmp_path):
    ckpt = _copy(hf_models, tmp_path, "llama3")
    cfg = json.loads((ckpt / "config.json").read_text())
    key = "rope_parameters" if "rope_parameters" in cfg else "rope_scaling"
    _edit_config(ckpt, **{key: {**cfg[key], "low_freq_factor": 2.0}})
    assert f"{key}.low_freq_factor=2.0" in _import_error(ckpt)


def _llama_json(**changes):
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
           "max_position_embeddings": 128, "rope_theta": 10000.0, "hidden_act": "silu"}
    cfg.update(changes)
    return {k: v for k, v in cfg.items() if v is not ...}


@pytest.mark.parametrize("changes,needle", [
    (dict(architectures=["PhiForCausalLM"]), "PhiForCausalLM"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(architectures=["Qwen2ForCausalLM"], head_dim=32), "head_dim 32"),
    (dict(rope_theta=10000.5), "rope_theta 10000.5"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling type 'yarn'"),
    (dict(rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 4096}), "rope_scaling.original_max_position_embeddings"),
    (dict(rope_theta=..., rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
     "rope_parameters type 'linear'"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (dict(hidden_size=...), "missing required key 'hidden_size'"),
    (dict(architectures=["MistralForCausalLM"], sliding_window=64), "sliding_window 64"),
    (dict(architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=64, max_window_layers=1),
     "sliding_window of 64"),
])
def test_unsupported_configs(changes, needle):
    with pytest.raises(ValueError) as e:
        hf_config_to_model_config(_llama_json(**changes))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_supported_config_variants():
    mistral = hf_config_to_model_config(_llama_json(architectures=["MistralForCausalLM"], sliding_window=128))
    assert not mistral.qkv_bias
    qwen = hf_config_to_model_config(_llama_json(architectures=["Qwen2ForCausalLM"], use_sliding_window=False,
                                                 sliding_window=32, tie_word_embeddings=True))
    assert qwen.qkv_bias and qwen.tie_embeddings
    v5 = hf_config_to_model_config(_llama_json(rope_theta=..., rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}))
    assert (v5.rotary_base, v5.rope_scaling_factor) == (500000.0, 32.0)
    qwen3 = hf_config_to_model_config(_llama_json(architectures=["Qwen3ForCausalLM"], head_dim=32))
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 32
    assert hf_config_to_model_config(_llama_json(head_dim=16)).head_dim is None  # = 64 / 4, the default
    assert hf_config_to_model_config(_llama_json(head_dim=8)).head_dim == 8


def test_export_rejects_bad_input(hf_models, tmp_path):
    path, arch, _ = hf_models["qwen2"]
    mc, canonical = load_hf_checkpoint(path)
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        save_hf_checkpoint(tmp_path / "a", mc, canonical, "GPT2LMHeadModel")
    with pytest.raises(ValueError, match="LlamaForCausalLM cannot express qkv_bias=True"):
        save_hf_checkpoint(tmp_path / "a", mc, canonical, "LlamaForCausalLM")
    q3, q3_canonical = load_hf_checkpoint(hf_models["qwen3"][0])
    with pytest.raises(ValueError, match="LlamaForCausalLM cannot express qk_norm=True"):
        save_hf_checkpoint(tmp_path / "a", q3, q3_canonical, "LlamaForCausalLM")
    broken = {k: v for k, v in canonical.items() if k != "decoder.layers.1.mlp.linear_fc2.weight"}
    broken["output_layer.weight"] = canonical["embedding.word_embeddings.weight"]
    with pytest.raises(ValueError) as e:
        save_hf_checkpoint(tmp_path / "a", mc, broken, arch)
    assert "missing canonical tensor decoder.layers.1.mlp.linear_fc2.weight" in str(e.value)
    assert "unexpected canonical tensor output_layer.weight" in str(e.value)
    with pytest.raises(ValueError, match="may not override derived config.json keys: vocab_size"):
        save_hf_checkpoint(tmp_path / "a", mc, canonical, arch, extra_config={"vocab_size": 1})
    assert not (tmp_path / "a").exists()
