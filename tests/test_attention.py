"""megarl's self-attention module (models/attention.py) against megatron-core's own.

The reference is megatron-core's `SelfAttention.forward` on the same module objects (the class
switched back to the base, `dist_helpers.megatron_attention`): its RoPE, its local core
attention (baddbmm + masked softmax + bmm, KV heads repeated for GQA) and its static KV cache of
keys before RoPE. The RoPE op is also checked against megatron-core's function in float64.
TP/PP layouts are covered by the layout-parity tests, which run this module.
"""
import pytest
import torch

from dist_helpers import megatron_attention, run_distributed

VOCAB = 96


def _model_cfg(**kw):
    from megarl.config import ModelConfig

    base = dict(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_kv_heads=2,
                vocab_size=VOCAB, max_position_embeddings=64, init_std=0.05)
    base.update(kw)
    return ModelConfig(**base)


def test_rope_matches_megatron_in_float64_and_its_gradient_is_the_inverse_rotation():
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from megarl.models.attention import apply_rope

    g = torch.Generator().manual_seed(0)
    s, b, n, d = 7, 3, 4, 16
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    f = torch.arange(s, dtype=torch.float64)[:, None] * inv[None]
    freqs = torch.cat([f, f], -1)[:, None, None, :]  # [s, 1, 1, d], megatron's convention
    x = torch.randn(s, b, n, d, dtype=torch.float64, generator=g)
    want = _apply_rotary_pos_emb_bshd(x, freqs)
    for out_bnsd in (False, True):
        got = apply_rope(x, freqs, out_bnsd=out_bnsd)
        assert got.shape == x.shape
        torch.testing.assert_close(got, want, rtol=0, atol=1e-14)
    xs = x[:, :, :, :].transpose(1, 2).contiguous().transpose(1, 2)  # strided input
    torch.testing.assert_close(apply_rope(xs, freqs), want, rtol=0, atol=1e-14)
    x.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: apply_rope(t, freqs, out_bnsd=True), (x,))


def _parity_body(rank, world_size, precision, qk_norm, impl="local"):
    from megarl.config import ParallelConfig
    from megarl.models.gpt import build_model
    from megarl.runtime.distributed import device, init_distributed

    init_distributed(1, 1, seed=3)
    dev = device()
    model = build_model(_model_cfg(qk_norm=qk_norm, transformer_impl=impl), ParallelConfig(), precision=precision, seed=7)
    assert sum(type(m).__name__ == "MegarlSelfAttention" for m in model.modules()) == 2  # one per layer
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (3, 20), generator=g).to(dev)
    pos = torch.arange(20, device=dev).expand_as(tokens)
    # packing-style block-diagonal causal mask (True = masked): two documents per row
    causal = torch.ones(20, 20, dtype=torch.bool).triu_(1)
    block = torch.zeros(20, 20, dtype=torch.bool)
    block[12:, :12] = True
    packed = (causal | block)[None, None].expand(3, 1, 20, 20).to(dev)
    weights = torch.randn(3, 20, 128, generator=g).to(dev)  # a random linear loss on the logits

    def run(mask):
        model.zero_grad(set_to_none=True)
        out = model(tokens, pos, mask)
        (out.float() * weights[..., : out.shape[-1]]).sum().backward()
        grads = {n: p.grad.detach().float().cpu().clone() for n, p in model.named_parameters()}
        return out.detach().float().cpu().clone(), grads

    result = {}
    for name, mask in (("causal", None), ("packed", packed)):
        ours = run(mask)
        with megatron_attention([model]):
            ref = run(mask)
        result[name] = (ours, ref)
    return result


@pytest.mark.parametrize("precision,qk_norm,impl", [
    ("fp32", False, "local"), ("fp32", True, "local"), ("bf16", False, "local"),
    # on a GPU with Transformer Engine: TE's layers and core attention, megarl's RoPE around them
    pytest.param("bf16", False, "auto", marks=pytest.mark.gpu)])
def test_training_forward_and_gradients_equal_megatron_core_attention(precision, qk_norm, impl):
    res = run_distributed(_parity_body, 1, precision, qk_norm, impl)[0]
    tol = dict(rtol=1e-5, atol=1e-5) if precision == "fp32" else dict(rtol=2e-2, atol=2e-2)
    for name, ((out, grads), (ref_out, ref_grads)) in res.items():
        assert not torch.equal(out, torch.zeros_like(out))
        torch.testing.assert_close(out, ref_out, **tol, msg=f"{name}: logits")
        assert grads.keys() == ref_grads.keys()
        for k in grads:
            scale = ref_grads[k].abs().max().clamp(min=1e-6)
            err = (grads[k] - ref_grads[k]).abs().max() / scale
            assert err < (1e-4 if precision == "fp32" else 5e-2), f"{name}: grad {k} off by {err:.2e} (relative)"


@pytest.mark.parametrize("heads,groups", [(8, 8), (8, 2), (6, 1), (16, 4)])
def test_decode_attention_folds_grouped_heads_exactly(heads, groups):
    """One new token per row over a masked cache, grouped heads folded into the query axis (so
    CUDA keeps SDPA's fused masked kernels), equals float64 attention with the keys repeated per
    head as GQA defines it."""
    from megarl.models.attention import decode_sdpa

    g = torch.Generator().manual_seed(heads * 10 + groups)
    b, S, d = 5, 37, 16
    q = torch.randn(b, heads, 1, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, groups, S, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, groups, S, d, generator=g, dtype=torch.float64)
    mask = torch.rand(b, 1, 1, S, generator=g) < 0.4
    mask[..., 0] = False  # every row attends somewhere
    rep = heads // groups  # query head h reads KV head h // rep (megatron's group-major heads)
    scores = (q @ k.repeat_interleave(rep, 1).transpose(-1, -2) * 0.25).masked_fill(mask, float("-inf"))
    want = torch.softmax(scores, -1) @ v.repeat_interleave(rep, 1)
    torch.testing.assert_close(decode_sdpa(q, k, v, mask, scale=0.25), want, rtol=0, atol=1e-12)
    torch.testing.assert_close(decode_sdpa(q.float(), k.float(), v.float(), mask, scale=0.25), want.float(),
                               rtol=0, atol=2e-6)


def test_repeated_groups_are_what_enable_gqa_reads():
    """The masked-GQA form CUDA takes (keys and values repeated per query head) equals SDPA's own
    grouped heads."""
    import torch.nn.functional as F

    from megarl.models.attention import repeat_groups

    g = torch.Generator().manual_seed(7)
    q = torch.randn(3, 8, 11, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(3, 2, 11, 16, generator=g, dtype=torch.float64) for _ in range(2))
    keep = ~torch.ones(11, 11, dtype=torch.bool).triu_(1)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, *repeat_groups(k, v, 8), attn_mask=keep), want,
                               rtol=0, atol=1e-12)
