"""Decode steps outside megatron-core's module calls (models/decode_step.py): the same logits, bit
for bit, as the model's own forward at every decode step, for each configuration `plan` accepts
(GQA and MHA, q/k norms, QKV bias, tied embeddings, bf16 under megatron's Float16Module, the CPU's
GEMM routings: MKL, oneDNN, megarl._cpu's kernel for the layers too; TP 2); the same rollouts
from the engine with the path on and off; and the model's own path (plan None) for what the path
does not cover. With native layers (megarl._cpu.decode_layer, fp32 at TP 1, where built) the
logits and cache are the model's within fp32 rounding instead (the kernel against a float64 layer:
tests/test_decode_layer.py), and rollouts sample the same tokens.
"""
import pytest
import torch

from dist_helpers import run_distributed

VOCAB, PAD = 100, 0
CONFIGS = {  # name: (ModelConfig fields, precision)
    "gqa": (dict(num_kv_heads=2), "fp32"),
    "mha, tied, qk norm, qkv bias": (dict(num_kv_heads=4, tie_embeddings=True, qk_norm=True, qkv_bias=True), "fp32"),
    "bf16": (dict(num_kv_heads=2), "bf16"),
}
PARAMS = dict(n=3, temperature=0.8, top_k=0, top_p=1.0, max_new_tokens=20, stop_ids=(7, 11, 42, 63, 90))


def dtype_of(name):
    return CONFIGS[name][1]


def _cfg(**fields):
    from megarl.config import ModelConfig

    return ModelConfig(**{**dict(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                                 vocab_size=VOCAB, max_position_embeddings=48, init_std=0.1), **fields})


def _prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (3, 11, 6, 1)]


def _decode_steps(role, route, steps=3):
    """Prefill 5 rows through the model, then `steps` decode steps both ways on the same cache:
    -> (logits equal at every step, caches equal after every step, largest |logit|, plan found, dtype,
    native layers planned, largest |logit| and |cache| differences)."""
    from megatron.core.inference.contexts import StaticInferenceContext

    from megarl.models import cpu_gemm, decode_layout, decode_step
    from megarl.models.layout import unwrap
    from megarl.rollout.engine import _inference_mode

    g = torch.Generator().manual_seed(11)
    B, P = 5, 7
    S = P + steps
    tokens = torch.randint(1, VOCAB, (B, P), generator=g)
    key_pad = torch.zeros(B, S, dtype=torch.bool)
    key_pad[1, :2] = key_pad[3, :4] = True  # left padding of two rows (RoPE is relative: positions as the engine's)
    mask = torch.ones(P, P, dtype=torch.bool).triu_(1)[None, None] | key_pad[:, None, None, :P]
    mask.diagonal(dim1=-2, dim2=-1).fill_(False)
    positions = torch.arange(P)[None].expand(B, P)
    same_logits, same_cache, scale, logit_diff, cache_diff = [], [], 0.0, 0.0, 0.0
    with (torch.no_grad(), _inference_mode(role.chunks, unwrap(role.model)),
          decode_layout.in_major_weights(role.chunks) as out_major,
          cpu_gemm.cpu_linears(role.chunks, route[0], out_major, route[1])):
        plan = decode_step.plan(role.model, out_major, native=route[2])
        ctx = StaticInferenceContext(B, S)
        ctx.materialize_only_last_token_logits = True
        role.model(tokens, positions, mask, inference_context=ctx, runtime_gather_output=True)
        ctx.increment_sequence_len_offset(P)
        for t in range(steps):
            step = torch.randint(1, VOCAB, (B, 1), generator=g)
            pos = torch.full((B, 1), P + t)
            step_mask = key_pad[:, None, None, : P + t + 1]
            before = {k: (a.clone(), b.clone()) for k, (a, b) in ctx.key_value_memory_dict.items()}
            theirs = role.model(step, pos, step_mask, inference_context=ctx, runtime_gather_output=True)
            their_cache = {k: (a.clone(), b.clone()) for k, (a, b) in ctx.key_value_memory_dict.items()}
            ctx.key_value_memory_dict.update(before)
            mine = decode_step.decode_logits(plan, step, pos, step_mask, ctx)
            same_logits.append(mine.dtype == theirs.dtype and mine.shape == theirs.shape and torch.equal(mine, theirs))
            end = P + t + 1  # the positions written so far (the rest of the cache is uninitialised memory)
            cache = ctx.key_value_memory_dict
            same_cache.append(all(torch.equal(cache[k][i][:, :, :end], their_cache[k][i][:, :, :end])
                                  for k in their_cache for i in (0, 1)))
            scale = max(scale, theirs.abs().max().item())
            logit_diff = max(logit_diff, (mine.double() - theirs.double()).abs().max().item())
            cache_diff = max([cache_diff] + [(cache[k][i][:, :, :end].double() - their_cache[k][i][:, :, :end].double())
                                             .abs().max().item() for k in their_cache for i in (0, 1)])
            ctx.increment_sequence_len_offset(1)
    return (same_logits, same_cache, scale, plan is not None, mine.dtype, plan.native is not None, logit_diff,
            cache_diff)


def _generate(role, fast, route=(None, None, False)):
    from megarl.rollout.engine import MegatronRolloutEngine, SamplingParams

    eng = MegatronRolloutEngine(role, vocab_size=VOCAB, pad_id=PAD, max_batch_size=8, onednn_linears=route[0],
                                layer_kernel=route[1], decode_fast_path=fast, native_layers=route[2])
    return eng.generate(_prompts(), SamplingParams(**PARAMS), seed=5)


def _same_rollout(a, b, logprob_tol=0.0) -> bool:
    """The same tokens, ends and log-probs (equal, or within logprob_tol)."""
    return (torch.equal(a.tokens, b.tokens) and torch.allclose(a.logprobs, b.logprobs, rtol=0, atol=logprob_tol)
            and torch.equal(a.stopped, b.stopped) and torch.equal(a.response_lens, b.response_lens))


def _random_norms(role, seed=13):
    """Every RMSNorm weight away from its initial ones, each its own (so that a norm read in the
    wrong place changes the logits)."""
    from megarl.models.layout import unwrap

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in unwrap(role.model).modules():
            if isinstance(m, torch.nn.RMSNorm) and m.weight is not None:
                m.weight.add_((0.3 * torch.randn(m.weight.shape, generator=g)).to(m.weight.dtype))


def _single_body(rank, world_size):
    from megatron.core.transformer.mlp import MLP

    from megarl.config import ParallelConfig
    from megarl.models import cpu_gemm, cpu_kernels, decode_step
    from megarl.models.layout import unwrap
    from megarl.roles.role import Role
    from megarl.runtime.distributed import init_distributed, teardown

    init_distributed(1, 1, seed=3)
    out = {"steps": {}, "rollouts": {}, "layer_kernel_calls": {}, "kernel": cpu_kernels.wide_linear() is not None}
    kernel, layer_calls = cpu_kernels.wide_linear(), [0]  # megarl._cpu's GEMM on a layer's (not the head's) weight
    cpu_kernels.wide_linear = lambda: kernel and (lambda x, w: layer_calls.__setitem__(
        0, layer_calls[0] + (w.shape[0] < cpu_gemm.OUT_MAJOR_MIN_OUT)) or kernel(x, w))
    # (oneDNN, the layers' linears through megarl._cpu's kernel, native layers): MKL; oneDNN; the
    # kernel at 1-64 rows (where built), oneDNN above; a decode step's layers in megarl._cpu.decode_layer
    routes = ((False, False, False), (True, False, False), (True, True, False), (True, True, True)) if (
        cpu_gemm.onednn_available()) else ((False, False, False), (False, True, False), (False, True, True))
    for name, (fields, precision) in CONFIGS.items():
        role = Role("actor", _cfg(**fields), ParallelConfig(), head="lm", seed=5, precision=precision)
        _random_norms(role)
        for route in routes:
            layer_calls[0] = 0
            out["steps"][name, route] = _decode_steps(role, route)
            out["layer_kernel_calls"][name, route] = layer_calls[0]
            fast, slow = _generate(role, True, route), _generate(role, False, route)
            out["rollouts"][name, route] = (_same_rollout(fast, slow, 1e-5 if route[2] else 0.0),
                                             fast.stats["decode_fast_path"], slow.stats["decode_fast_path"],
                                             fast.stopped.any().item(), fast.stats["native_layers"])

    role = Role("actor", _cfg(num_kv_heads=2), ParallelConfig(), head="lm", seed=5)
    role.model.train()
    out["plan_in_training"] = decode_step.plan(role.model)
    # a layer module the path does not know (here: a subclass of megatron's MLP): the model's own path
    layer = unwrap(role.model).decoder.layers[1]
    reference = _generate(role, False)
    layer.mlp.__class__ = type("OtherMLP", (MLP,), {})
    other = _generate(role, True)
    out["other_module"] = (other.stats["decode_fast_path"], _same_rollout(other, reference))
    teardown()
    return out


@pytest.fixture(scope="module")
def single():
    return run_distributed(_single_body, 1)[0]


def _native_expected(single, name, route) -> bool:
    """Native layers serve fp32 models at TP 1 where megarl._cpu's kernel runs, when asked."""
    return route[2] and single["kernel"] and dtype_of(name) == "fp32"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_decode_steps_give_the_model_s_logits_bit_for_bit(single, name):
    for (config, route), steps in single["steps"].items():
        if config != name:
            continue
        same_logits, same_cache, scale, planned, dtype, native, logit_diff, cache_diff = steps
        assert planned, f"{name}: plan() declined a configuration it serves"
        assert scale > 1.0, "the logits must not be near zero (a vacuous comparison)"
        assert dtype == torch.float32, f"{name}: logits must come back in fp32 as from the model, got {dtype}"
        assert native == _native_expected(single, name, route), (name, route, native)
        if native:  # C++ elementwise work: the model's logits and cache up to fp32 rounding
            assert logit_diff <= 1e-5 * scale and cache_diff <= 1e-5, (name, route, logit_diff, cache_diff)
            continue
        assert all(same_logits), f"{name} (oneDNN, layer kernel: {route}): decode-step logits differ from the model's"
        assert all(same_cache), f"{name} (oneDNN, layer kernel: {route}): the KV cache differs from the model's"
        # the layers' linears ran megarl._cpu's kernel exactly when asked and built (fp32 weights only)
        ran = single["layer_kernel_calls"][config, route]
        assert (ran > 0) == (route[1] and single["kernel"] and dtype_of(name) == "fp32"), (name, route, ran)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_rollouts_are_the_same_with_and_without_the_path(single, name):
    for (config, route), (same, fast_used, slow_used, stopped, native) in single["rollouts"].items():
        if config != name:
            continue
        assert fast_used and not slow_used, f"{name}: decode_fast_path stat {fast_used}, {slow_used}"
        assert native == _native_expected(single, name, route), (name, route, native)
        assert stopped, "some row must stop on a stop id"
        assert same, f"{name} (oneDNN, layer kernel: {route}): the rollout changed with the decode path"


def test_the_model_s_own_path_for_what_the_path_does_not_cover(single):
    assert single["plan_in_training"] is None, "a model in training mode must not take the decode path"
    used, same = single["other_module"]
    assert not used, "a layer module the path does not know must send the steps to the model"
    assert same, "the fallback must sample what the model samples"


def _tp_body(rank, world_size):
    from megarl.config import ParallelConfig
    from megarl.roles.role import Role
    from megarl.runtime.distributed import init_distributed, teardown

    init_distributed(2, 1, seed=3)
    role = Role("actor", _cfg(num_kv_heads=2, qkv_bias=True), ParallelConfig(tp=2), head="lm", seed=5)
    fast, slow = _generate(role, True), _generate(role, False)
    # MKL; each rank's shards of the layers through the kernel; native layers asked for, not taken at TP 2
    steps = _decode_steps(role, (False, True, True))
    teardown()
    return _same_rollout(fast, slow), fast.stats["decode_fast_path"], steps


@pytest.mark.slow
def test_tensor_parallel_decode_steps_are_the_model_s(single):
    for rank, (same, used, steps) in enumerate(run_distributed(_tp_body, 2)):
        same_logits, same_cache, _, planned, _, native, _, _ = steps
        assert used and planned and not native, f"rank {rank}: TP 2 must take the decode path's torch operations"
        assert all(same_logits) and all(same_cache), f"rank {rank}: TP 2 decode steps differ from the model's"
        assert same, f"rank {rank}: TP 2 rollouts changed with the decode path"


def test_native_layers_take_only_what_decode_layer_takes():
    """fp32 CPU rows within the kernel's 1-64, a bool mask broadcastable to [A, 1, 1, sk]; every
    other step keeps the torch operations (which the tests above compare bit for bit)."""
    import types

    from megarl.models.cpu_gemm import LAYER_KERNEL_ROWS
    from megarl.models.decode_step import _native_serves

    ctx = types.SimpleNamespace(sequence_len_offset=9)  # this step writes position 9: sk = 10
    h = torch.randn(1, 5, 8)
    mask = torch.rand(5, 1, 1, 10) < 0.3
    assert _native_serves(h, mask, ctx) and _native_serves(h, None, ctx) and _native_serves(h, mask[:1], ctx)
    assert _native_serves(h, mask[..., :1], ctx)
    assert not _native_serves(h.double(), mask, ctx)
    assert not _native_serves(h.bfloat16(), mask, ctx)
    assert not _native_serves(torch.randn(1, LAYER_KERNEL_ROWS[1] + 1, 8), None, ctx)  # above the kernel's rows
    assert not _native_serves(h, mask.float(), ctx)  # an additive mask
    assert not _native_serves(h, torch.rand(5, 1, 1, 12) < 0.3, ctx)  # more keys than the cache holds
    assert not _native_serves(h, torch.rand(5, 4, 1, 10) < 0.3, ctx)  # a mask per head
