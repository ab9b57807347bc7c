"""megarl/models/memory.py, the per-GPU memory estimate `megarl validate` prints: parameter counts
against real megatron-core models and published sizes, the KV cache against the rollout engine's
own allocation, and the byte arithmetic of states, offload and activations."""
from __future__ import annotations

import dataclasses

import pytest

from megarl.config import load_config
from megarl.config.schema import Config, ModelConfig, OffloadConfig, ParallelConfig
from megarl.models import memory

TINY = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_kv_heads=2,
                   vocab_size=261, max_position_embeddings=64, transformer_impl="local")
VARIANTS = {"lm": (TINY, "lm"), "tied": (dataclasses.replace(TINY, tie_embeddings=True), "lm"),
            "qwen": (dataclasses.replace(TINY, qkv_bias=True, qk_norm=True, head_dim=32), "lm"),
            "scalar": (TINY, "scalar")}


def _real_model_body(rank, world_size):
    """Parameter counts of real models, and the KV cache bytes the rollout engine allocates."""
    from megarl.models.gpt import build_model
    from megarl.roles.role import Role
    from megarl.rollout.engine import MegatronRolloutEngine
    from megarl.rollout.sampling import SamplingParams
    from megarl.runtime.distributed import init_distributed

    init_distributed(1, 1, seed=0)
    counts = {name: sum(p.numel() for p in build_model(m, ParallelConfig(), head=head).parameters())
              for name, (m, head) in VARIANTS.items()}
    role = Role("actor", TINY, ParallelConfig(), precision="fp32")
    out = MegatronRolloutEngine(role, vocab_size=261, pad_id=0).generate(
        [[5, 6, 7, 8, 9], [3, 4]], SamplingParams(n=3, max_new_tokens=4), seed=0)
    return counts, out.stats["kv_cache_bytes"]


def test_parameter_counts_and_kv_cache_match_real_models():
    from dist_helpers import run_distributed

    counts, kv_bytes = run_distributed(_real_model_body, 1)[0]
    for name, (m, head) in VARIANTS.items():
        assert memory.stage_params(m, 1, 1, head).total == counts[name], name
    cfg = Config(model=TINY)
    assert memory.kv_cache_bytes(TINY, cfg, rows=6, length=5 + 4, precision="fp32") == kv_bytes  # 2 prompts x 3


def test_parameter_counts_of_the_8b_recipes_are_the_published_sizes():
    llama = load_config("configs/llama31_8b_grpo.yaml").model
    qwen = load_config("configs/qwen25_7b_grpo.yaml").model
    assert memory.stage_params(llama, 1, 1).total == 8_030_261_248  # Llama-3.1-8B
    assert memory.stage_params(qwen, 1, 1).total == 7_615_616_512  # Qwen2.5-7B
    # TP shards the GEMMs and the vocabulary; PP: the worst stage holds half the layers + an embedding
    full, tp4, pp2 = (memory.stage_params(llama, tp, pp) for tp, pp in ((1, 1), (4, 1), (1, 2)))
    assert tp4.gemm * 4 == full.gemm and abs(tp4.total * 4 - full.total) < 0.001 * full.total
    v = 128256 * 4096
    assert pp2.gemm * 2 == full.gemm and pp2.total == full.gemm // 2 + (full.other - 2 * v - 4096) // 2 + v + 4096


def test_state_bytes_sharding_and_offload():
    m = dataclasses.replace(TINY, vocab_size=256)
    cfg = Config(model=m, parallel=ParallelConfig(distributed_optimizer=True))
    n = memory.stage_params(m, 1, 1).total
    r = memory.role_memory("actor", m, cfg, dp=4, precision="bf16", trained=True, offload=OffloadConfig())
    assert (r.params, r.grads, r.optimizer) == (2 * n, 4 * n, 12 * n // 4)
    assert memory.role_memory("a", m, cfg, dp=4, precision="fp32", trained=True, offload=OffloadConfig()).optimizer \
        == 8 * n // 4
    frozen = memory.role_memory("reference", m, cfg, dp=4, precision="bf16", trained=False,
                                offload=OffloadConfig(params=True))
    assert (frozen.resident(), frozen.offloaded()) == (0, 2 * n)
    fp8 = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, fp8=dataclasses.replace(
        cfg.train.fp8, format="e4m3", param_gather=True)))
    p = memory.stage_params(m, 1, 1)
    assert memory.role_memory("a", m, fp8, 4, "bf16", True, OffloadConfig()).params == p.gemm + 2 * p.other
    # the peak: every resident state + the largest one role's offloaded states
    e = memory.MemoryEstimate([r, frozen, dataclasses.replace(frozen, name="reward", params=10)], 100, "", 50, "")
    assert e.states_at_peak == r.resident() + 2 * n
    assert e.peak == e.states_at_peak + 100 + memory.OVERHEAD_BYTES


def test_activation_arithmetic():
    m = ModelConfig(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_kv_heads=2,
                    vocab_size=256, make_vocab_size_divisible_by=128)
    per_token_layer = 4 * 64 + (2 * 4 + 2 * 2) * 16 + 3 * 128  # values: norms, q/k/v/out, SwiGLU
    logits = 2 * 1000 * 256 * 2  # logits + their gradient, bf16
    cfg = Config(model=m)
    assert memory.activation_bytes(m, cfg, "bf16", 1000, 1) == 2 * 1000 * per_token_layer * 4 + logits
    assert memory.activation_bytes(m, cfg, "bf16", 2000, 1) == 2 * (2 * 1000 * per_token_layer * 4 + logits)
    sp = Config(model=m, parallel=ParallelConfig(tp=2, sequence_parallel=True))
    assert memory.activation_bytes(m, sp, "bf16", 1000, 1, head="scalar") == 2 * 1000 * per_token_layer // 2 * 4
    pp = Config(model=m, parallel=ParallelConfig(pp=2))  # first stage: 2 layers x 2 micro-batches in flight
    assert memory.activation_bytes(m, pp, "bf16", 1000, 8, head="scalar") == 2 * 1000 * per_token_layer * 2 * 2


@pytest.mark.parametrize("stage", ["sft", "rm"])
def test_estimate_of_a_supervised_stage(stage):
    cfg = load_config("configs/tiny_sft.yaml")
    e = memory.estimate(cfg, 1, stage)
    assert [r.name for r in e.roles] == ["policy" if stage == "sft" else "reward_model"]
    assert e.kv_cache == 0 and e.peak > memory.OVERHEAD_BYTES
    lines = memory.format_estimate(e, 80 * 2**30, "H100")
    assert lines[-1].startswith("  peak ~ ") and lines[-1].endswith("on H100: fits")
