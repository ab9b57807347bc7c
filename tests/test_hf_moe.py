"""Hugging Face interop of mixture-of-experts models (Qwen3-MoE, Mixtral): tiny random models
built with transformers; megarl's import must reproduce transformers' logits within 1e-4 (fp32,
eager attention) in one process and at EP2, its export must load in transformers and match, and
HF -> megarl -> HF -> megarl is bit-exact."""
import json
import os

import pytest
import torch

from dist_helpers import run_distributed
from test_hf_interop import BATCH, SEQ, _hf_logits, _randomize, _tokens

transformers = pytest.importorskip("transformers")

TOL = 1e-4
COMMON = dict(hidden_size=48, vocab_size=300, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, rms_norm_eps=1e-5, num_experts_per_tok=2)
CASES = {  # name -> (config class, architecture, kwargs)
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(COMMON, intermediate_size=80, moe_intermediate_size=40, num_experts=4, head_dim=16,
                       norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1000000.0)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(COMMON, intermediate_size=40, num_local_experts=4, sliding_window=None, rope_theta=1000000.0)),
}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """name -> (saved directory, transformers logits)."""
    out = {}
    for i, (name, (cls, _, kwargs)) in enumerate(CASES.items()):
        config = getattr(transformers, cls)(**kwargs)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
        _randomize(model, seed=i)  # router and experts far from init too
        out[name] = (str(tmp_path_factory.mktemp("hf") / name), _hf_logits(model))
        model.save_pretrained(out[name][0])
    return out


def _megarl_body(rank, world_size, dirs):
    import torch.distributed as dist

    from megarl.checkpoint.hf import load_hf_checkpoint
    from megarl.config import ParallelConfig
    from megarl.models.layout import gather_full_state_dict, load_full_state_dict
    from megarl.roles.role import Role
    from megarl.runtime.distributed import init_distributed, teardown

    init_distributed(1, 1, seed=3, ep=world_size)
    out = {}
    for name, path in dirs.items():
        mc, lazy = load_hf_checkpoint(path, lazy=True)
        role = Role(name, mc, ParallelConfig(ep=world_size), head="lm", seed=99)
        load_full_state_dict(role.model, lazy, mc.vocab_size)
        logits = []
        mbs = [{"tokens": _tokens()[i:i + 1], "position_ids": torch.arange(SEQ)[None]} for i in range(BATCH)]
        role.evaluate(mbs, lambda b, x: (logits.append(x.detach().clone()), (x.sum() * 0, torch.tensor(1), {}))[1])
        full = gather_full_state_dict(role.model, mc.vocab_size)
        out[name] = {"mc": mc, "logits": torch.cat(logits)[..., :mc.vocab_size], "gathered": full,
                     "loaded": dict(lazy) if dist.get_rank() == 0 else None}
    teardown()
    return out


@pytest.mark.slow
def test_import_matches_transformers_at_ep1_and_ep2(hf_models, tmp_path):
    from megarl.checkpoint.hf import load_hf_checkpoint, save_hf_checkpoint

    dirs = {name: path for name, (path, _) in hf_models.items()}
    one = run_distributed(_megarl_body, 1, dirs)[0]
    two = run_distributed(_megarl_body, 2, dirs)
    for name, (path, ref) in hf_models.items():
        r = one[name]
        assert r["mc"].moe.num_experts == 4 and r["mc"].moe.topk == 2
        for where, logits in (("ep1", r["logits"]), *((f"ep2 rank {k}", t[name]["logits"]) for k, t in enumerate(two))):
            diff = (logits.double() - ref.double()).abs().max().item()
            assert diff <= TOL, f"{name} {where}: max abs logit diff {diff:.3g} > {TOL}"
        for k, v in r["loaded"].items():  # sharded over EP2 and gathered back: lossless
            assert torch.equal(two[0][name]["gathered"][k], v.float()), f"{name}: {k} changed through ep=2"
        # export: transformers loads it and matches; importing the export gives the same tensors
        out = str(tmp_path / f"{name}_export")
        arch = CASES[name][1]
        save_hf_checkpoint(out, r["mc"], r["gathered"], arch)
        assert json.load(open(os.path.join(out, "config.json")))["architectures"] == [arch]
        model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
        diff = (_hf_logits(model).double() - ref.double()).abs().max().item()
        assert diff <= TOL, f"{name} export: max abs logit diff {diff:.3g} > {TOL}"
        _, again = load_hf_checkpoint(out)
        assert again.keys() == r["gathered"].keys()
        assert all(torch.equal(again[k], v) for k, v in r["gathered"].items())


def test_moe_config_rules(tmp_path):
    """What megarl would route differently is refused in one line."""
    from megarl.checkpoint.hf import hf_config_to_model_config, model_config_to_hf_config

    base = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 48, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 80, "moe_intermediate_size": 40,
            "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True, "vocab_size": 300,
            "num_hidden_layers": 2, "max_position_embeddings": 128}
    mc = hf_config_to_model_config(base)
    assert (mc.moe.num_experts, mc.moe.topk, mc.moe.expert_hidden, mc.qk_norm) == (4, 2, 40, True)
    assert hf_config_to_model_config(model_config_to_hf_config(mc, "Qwen3MoeForCausalLM")) == mc
    with pytest.raises(ValueError, match="norm_topk_prob=false is unsupported"):
        hf_config_to_model_config({**base, "norm_topk_prob": False})
    with pytest.raises(ValueError, match="every layer must be MoE"):
        hf_config_to_model_config({**base, "mlp_only_layers": [1]})
    with pytest.raises(ValueError, match="cannot express model.moe.num_experts=4 \\(a dense architecture\\)"):
        model_config_to_hf_config(mc, "Qwen3ForCausalLM")
    mc.moe.shared_expert_hidden = 16
    with pytest.raises(ValueError, match="shared expert"):
        model_config_to_hf_config(mc, "Qwen3MoeForCausalLM")


def _generate_body(rank, world_size, path, prompts, stop_ids):
    from megarl.checkpoint.hf import load_hf_checkpoint
    from megarl.config import ParallelConfig
    from megarl.models.layout import load_full_state_dict
    from megarl.roles.role import Role
    from megarl.rollout.engine import MegatronRolloutEngine, SamplingParams
    from megarl.runtime.distributed import init_distributed, teardown

    init_distributed(1, 1, seed=3, ep=world_size)
    mc, lazy = load_hf_checkpoint(path, lazy=True)
    role = Role("actor", mc, ParallelConfig(ep=world_size), head="lm", seed=99)
    load_full_state_dict(role.model, lazy, mc.vocab_size)
    engine = MegatronRolloutEngine(role, vocab_size=mc.vocab_size, pad_id=0, max_batch_size=2)  # 2 batches vs 1
    engine.record_routing = True  # as RL runs it
    mine = prompts[rank::world_size]  # each EP rank its own prompts: other lengths, other stopping steps
    params = SamplingParams(greedy=True, max_new_tokens=10, stop_ids=stop_ids)
    out = engine.generate(mine, params, seed=0).responses()
    alone = engine.generate(mine if rank == 0 else [], params, seed=0).responses()  # rank 1: nothing to generate
    teardown()
    return out, alone


@pytest.mark.slow
def test_greedy_generation_matches_transformers(hf_models):
    """The rollout engine (left-padded prefill, KV-cache decode through megatron-core's MoE layer)
    continues prompts as transformers' greedy generate does, in one process and at EP2 (where
    the ranks' rows stop at other steps and the all-to-all must still line up)."""
    path, _ = hf_models["qwen3_moe"]
    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 300, (n,), generator=g).tolist() for n in (3, 9, 5, 12, 7)]

    def hf_greedy(stop_ids):
        out = []
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=list(stop_ids) or None,
                                 pad_token_id=0)[0, len(p):].tolist()
            out.append(ids)
        return out

    free = hf_greedy(())
    stop_ids = (free[1][3], free[3][6])  # two rows stop early, at different steps
    ref = hf_greedy(stop_ids)
    assert len({len(r) for r in ref}) > 1
    assert run_distributed(_generate_body, 1, path, prompts, stop_ids)[0] == (ref, ref)
    (out0, alone0), (out1, alone1) = run_distributed(_generate_body, 2, path, prompts, stop_ids)
    assert out0 == alone0 == ref[0::2] and out1 == ref[1::2] and alone1 == []


@pytest.mark.parametrize("name", list(CASES))
def test_convert_cli_round_trips_moe_models_bit_exact(hf_models, tmp_path, name):
    """`megarl convert` both ways, as a user runs it: --arch takes the MoE model types too."""
    from safetensors.torch import load_file

    from megarl_run import megarl

    src = hf_models[name][0]
    megarl(["convert", "hf-to-megarl", "--hf", src, "--out", str(tmp_path / "ckpt")])
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text((tmp_path / "ckpt" / "config.yaml").read_text())
    megarl(["convert", "megarl-to-hf", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "back"),
            "--arch", name, "--config", str(cfg), "tokenizer.kind=byte"])  # the fixture has no tokenizer

    def tensors(d):
        return {k: v for f in sorted(os.listdir(d)) if f.endswith(".safetensors")
                for k, v in load_file(os.path.join(d, f)).items()}

    a, b = tensors(src), tensors(tmp_path / "back")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert json.load(open(tmp_path / "back" / "config.json"))["architectures"] == [CASES[name][1]]


def test_cli_arch_names_are_the_importable_architectures():
    from megarl.cli.main import HF_MODEL_TYPES
    from megarl.config.hf import MODEL_TYPES

    assert HF_MODEL_TYPES == tuple(MODEL_TYPES)
