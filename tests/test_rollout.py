"""Rollout engine: KV-cache sampling on the actor's megatron-core model.

References are independent: the no-cache greedy loop of tests/greedy_reference.py, and a float64
softmax with temperature / top-k / top-p written here over a full no-cache forward. Layouts
(TP2, PP2) are in test_rollout_dist.py.
"""
import math

import pytest
import torch

from dist_helpers import megatron_attention, run_distributed

VOCAB, PAD = 100, 0  # vocab 100 is padded to 128 in the model: padded columns must never be sampled
LENS = (1, 5, 9, 2, 13, 7)  # mixed prompt lengths, in no order


def _model_cfg():
    from megarl.config import ModelConfig

    # init_std 0.1: peaked next-token distributions (std 0.02 gives near-uniform ones, where
    # top-p and greedy ties would test little)
    return ModelConfig(num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_kv_heads=2,
                       vocab_size=VOCAB, max_position_embeddings=48, init_std=0.1)


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in LENS]


def _decode(ids):
    return "".join(chr(ord("a") + i % 26) for i in ids)


# ------------------------------------------------------------------ references


@torch.no_grad()
def _full_logits(role, tokens):
    """No-cache forward of right-padded rows [N, L] -> fp64 logits over the true vocabulary [N, L, V]."""
    model = role.model
    was = model.training
    model.eval()
    out = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
    model.train(was)
    return out[..., :VOCAB].double()


def _reference_logprobs(z, token, temperature, top_k, top_p):
    """float64: log p(token) under softmax(z / T) restricted to top-k then top-p; and the support."""
    z = z.double() / temperature
    keep = torch.ones_like(z, dtype=torch.bool)
    if top_k:
        keep &= z >= torch.topk(z, top_k).values[-1]
    if top_p < 1:
        p = torch.softmax(z.masked_fill(~keep, -math.inf), -1)
        order = torch.argsort(p, descending=True)
        before = torch.cumsum(p[order], 0) - p[order]
        kept_sorted = before < top_p
        keep_p = torch.zeros_like(keep)
        keep_p[order] = kept_sorted
        keep &= keep_p
    logp = torch.log_softmax(z.masked_fill(~keep, -math.inf), -1)
    return logp[token].item(), keep


# ------------------------------------------------------------------ single-process checks


def _single_body(rank, world_size):
    from greedy_reference import greedy_generate

    from megarl.config import OptimConfig, ParallelConfig
    from megarl.models.layout import unwrap
    from megarl.roles.role import Role
    from megarl.rollout.engine import MegatronRolloutEngine, SamplingParams
    from megarl.runtime.distributed import init_distributed, teardown

    init_distributed(1, 1, seed=11)
    mc = _model_cfg()
    role = Role("actor", mc, ParallelConfig(), head="lm", seed=5)
    prompts = _prompts()
    out = {}

    # 1. greedy with stop ids hit at different steps, against the no-cache reference
    free = greedy_generate(role, prompts, max_new_tokens=12, stop_ids=(), pad_id=PAD, vocab_size=VOCAB)
    stop_ids = (free[0][2], free[2][6])
    ref = greedy_generate(role, prompts, max_new_tokens=12, stop_ids=stop_ids, pad_id=PAD, vocab_size=VOCAB)
    eng = MegatronRolloutEngine(role, vocab_size=VOCAB, pad_id=PAD, decode=_decode, max_batch_size=4)
    got = eng.generate(prompts, SamplingParams(greedy=True, max_new_tokens=12, stop_ids=stop_ids), seed=0)
    slow = MegatronRolloutEngine(role, vocab_size=VOCAB, pad_id=PAD, max_batch_size=4, compact=False)
    with megatron_attention(role.chunks):  # megatron-core's own cache (keys before RoPE) and core attention
        got_megatron_attention = slow.generate(prompts, SamplingParams(greedy=True, max_new_tokens=12, stop_ids=stop_ids), seed=0)
    out["greedy"] = (ref, got, stop_ids, got_megatron_attention)

    # 2. sampled log-probs against a float64 recomputation over a no-cache forward
    checks = []
    for temperature in (1.0, 0.7):
        for top_k, top_p in ((0, 1.0), (10, 1.0), (0, 0.8), (15, 0.9)):
            params = SamplingParams(n=3, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=8)
            r = eng.generate(prompts, params, seed=123)
            full = _full_logits(role, r.tokens)  # [N, L, V]
            max_err, outside = 0.0, 0
            for i in range(r.tokens.shape[0]):
                p = int(r.prompt_lens[i])
                for j in range(int(r.response_lens[i])):
                    tok = int(r.tokens[i, p + j])
                    want, support = _reference_logprobs(full[i, p + j - 1], tok, temperature, top_k, top_p)
                    max_err = max(max_err, abs(want - float(r.logprobs[i, j])))
                    outside += int(not support[tok])
            sizes = int(r.response_mask.sum())
            checks.append(dict(temperature=temperature, top_k=top_k, top_p=top_p, max_err=max_err,
                               outside=outside, tokens=sizes, masked_zero=bool((r.logprobs[~r.response_mask] == 0).all())))
    out["logprob_checks"] = checks

    # 3. keyed randomness: micro-batching, sample_offset (DP ranks), seeds
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=6)
    whole = eng.generate(prompts, params, seed=9)
    small = MegatronRolloutEngine(role, vocab_size=VOCAB, pad_id=PAD, max_batch_size=3).generate(prompts, params, seed=9)
    tail = eng.generate(prompts[2:], params, seed=9, sample_offset=2 * params.n)  # as a second DP rank would
    other_dp = eng.generate(prompts, params, seed=9, sample_offset=len(prompts) * params.n)
    other_seed = eng.generate(prompts, params, seed=10)
    out["keyed"] = (whole.responses(), small.responses(), tail.responses(), other_dp.responses(),
                    other_seed.responses())

    # 4. stop strings and max_new_tokens
    strings = eng.generate(prompts, SamplingParams(greedy=True, max_new_tokens=12, stop_strings=(_decode(free[1][3:5]),)),
                           seed=0)
    out["stop_strings"] = (free, strings)
    capped = eng.generate(prompts, SamplingParams(n=2, max_new_tokens=5), seed=4)
    out["capped"] = capped

    # 6. errors
    errors = {}
    for name, call in {
        "empty": lambda: eng.generate([[3, 4], []], SamplingParams(max_new_tokens=4), seed=0),
        "too_long": lambda: eng.generate([[5] * 40], SamplingParams(max_new_tokens=9), seed=0),
        "bad_id": lambda: eng.generate([[5, VOCAB]], SamplingParams(max_new_tokens=4), seed=0),
        "no_decode": lambda: MegatronRolloutEngine(role, vocab_size=VOCAB, pad_id=PAD).generate(
            [[5]], SamplingParams(max_new_tokens=4, stop_strings=("x",)), seed=0),
        "temperature": lambda: eng.generate([[5]], SamplingParams(max_new_tokens=4, temperature=0.0), seed=0),
        "top_p": lambda: eng.generate([[5]], SamplingParams(max_new_tokens=4, top_p=0.0), seed=0),
    }.items():
        try:
            call()
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    out["errors"] = errors
    out["fits_exactly"] = eng.generate([[5] * 39], SamplingParams(max_new_tokens=9), seed=0).tokens.shape

    # 7. train/eval mode restored, and training after generation is unaffected by it
    optim = OptimConfig(lr=1e-2, weight_decay=0.0, clip_grad=1.0)
    a = Role("a", mc, ParallelConfig(), head="lm", seed=5, optim=optim)
    b = Role("b", mc, ParallelConfig(), head="lm", seed=5, optim=optim)
    a.model.train()
    unwrap(a.model).decoder.layers[1].eval()  # a mixed state must come back as it was
    before = [m.training for m in a.model.modules()]
    MegatronRolloutEngine(a, vocab_size=VOCAB, pad_id=PAD).generate(prompts, SamplingParams(max_new_tokens=4), seed=1)
    out["modes_restored"] = before == [m.training for m in a.model.modules()]
    out["train_after"] = [_one_train_step(role_) for role_ in (a, b)]

    # 8. padded vocabulary: make the padding columns dominate the raw logits; never sampled
    def boost_padding(module, args, output):
        logits, bias = output
        logits = logits.clone()
        logits[..., VOCAB:] += 1e3  # every padded id becomes the raw argmax
        return logits, bias

    hook = unwrap(role.model).output_layer.register_forward_hook(boost_padding)
    hot = eng.generate(prompts, SamplingParams(n=8, temperature=2.0, max_new_tokens=4), seed=5)
    greedy_hot = eng.generate(prompts, SamplingParams(greedy=True, max_new_tokens=4), seed=5)
    raw_argmax = int(role.model(torch.tensor([prompts[0]]), torch.arange(LENS[0])[None], None)[0, -1].argmax())
    hook.remove()
    out["padded"] = (hot.tokens, greedy_hot.tokens, raw_argmax)
    teardown()
    return out


def _one_train_step(role):
    from megarl.algorithms.losses import masked_nll
    from megarl.trainers.common import token_logprobs

    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, VOCAB, (2, 9), generator=g)
    batch = {"tokens": seq[:, :-1], "labels": seq[:, 1:], "position_ids": torch.arange(8).expand(2, 8),
             "loss_mask": torch.ones(2, 8)}
    r = role.train_step([batch], lambda b, logits: masked_nll(token_logprobs(logits, b["labels"], VOCAB), b["loss_mask"]))
    return r.metrics["loss"], r.grad_norm, torch.cat([p.detach().flatten() for p in role.model.parameters()])


@pytest.fixture(scope="module")
def single():
    return run_distributed(_single_body, 1)[0]


def test_kv_cache_greedy_equals_no_cache_reference(single):
    ref, got, stop_ids, got_megatron_attention = single["greedy"]
    assert got.responses() == ref
    assert got.stats["compactions"] > 0, "finished rows must have left the cache in this test"
    assert got_megatron_attention.responses() == ref  # megatron-core's own attention module, no compaction
    assert got_megatron_attention.stats["compactions"] == 0
    ends = [r[-1] in stop_ids for r in ref]
    assert got.stopped.tolist() == ends
    assert 0 < sum(ends) < len(ref), "the stop ids must end some rows and not others"
    assert len({len(r) for r, e in zip(ref, ends) if e}) > 1, "stops must come at different steps"
    for i, p in enumerate(_prompts()):  # tokens: prompt then response, right-padded
        L = len(p) + len(ref[i])
        assert got.tokens[i, :L].tolist() == p + ref[i]
        assert (got.tokens[i, L:] == PAD).all()


def test_logprobs_equal_float64_recomputation(single):
    for c in single["logprob_checks"]:
        print(f"\n[rollout] T={c['temperature']} top_k={c['top_k']} top_p={c['top_p']}: "
              f"max |logprob - float64 ref| = {c['max_err']:.2e} over {c['tokens']} tokens")
        assert c["tokens"] > 0
        assert c["max_err"] < 1e-4, c
        assert c["outside"] == 0, f"{c['outside']} sampled tokens outside the top-k/top-p support: {c}"
        assert c["masked_zero"]


def test_samples_keyed_by_seed_and_global_id(single):
    whole, small, tail, other_dp, other_seed = single["keyed"]
    n = 4
    assert whole == small, "micro-batching changed samples"
    assert tail == whole[2 * n:], "rows must depend on their global sample id only"
    assert other_dp != whole and other_seed != whole
    # samples of one prompt differ from each other (n > 1 draws independent rows)
    assert all(len({tuple(r) for r in whole[i * n:(i + 1) * n]}) > 1 for i in range(len(LENS)))


def test_stop_strings_and_max_new_tokens(single):
    free, got = single["stop_strings"]
    stop = _decode(free[1][3:5])
    want = []
    for r in free:
        cut = next((j + 1 for j in range(len(r)) if stop in _decode(r[: j + 1])), None)
        want.append(r[:cut] if cut else r)
    assert got.responses() == want
    assert got.stopped.tolist() == [len(w) < len(f) or stop in _decode(f) for w, f in zip(want, free)]
    assert got.stopped[1]
    capped = single["capped"]
    assert (capped.response_lens == 5).all() and not capped.stopped.any()
    assert capped.tokens.shape == (2 * len(LENS), max(LENS) + 5)
    assert capped.response_mask.all() and capped.logprobs.shape == (2 * len(LENS), 5)


def test_bad_inputs_raise_clear_errors(single):
    e = single["errors"]
    assert "prompt 1 is empty" in e["empty"]
    assert "exceeds the model's max sequence length 48" in e["too_long"]
    assert "outside [0, 100)" in e["bad_id"]
    assert "decode" in e["no_decode"]
    assert "temperature" in e["temperature"] and "top_p" in e["top_p"]
    assert single["fits_exactly"] == (1, 48)


def test_mode_restored_and_training_unaffected(single):
    assert single["modes_restored"]
    (la, ga, pa), (lb, gb, pb) = single["train_after"]
    assert la == lb and ga == gb and torch.equal(pa, pb)


def test_padded_vocabulary_never_sampled(single):
    hot, greedy_hot, raw_argmax = single["padded"]
    assert raw_argmax >= VOCAB, "the test must make a padded column the raw argmax"
    assert int(hot.max()) < VOCAB and int(greedy_hot.max()) < VOCAB


# ------------------------------------------------------------------ sampling maths (no model)


def test_inverse_cdf_draw_matches_the_distribution():
    from megarl.rollout.sampling import SamplingParams, filter_logits, row_uniforms, sample_tokens

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 12, generator=g) * 1.5
    params = SamplingParams(temperature=0.9, top_k=8, top_p=0.9)
    filtered = filter_logits(logits, params)
    rows = 20000
    ids, _ = sample_tokens(filtered.expand(rows, -1), params, row_uniforms(5, torch.arange(rows), 3), with_logprobs=False)
    p = torch.softmax(filtered[0].double() / 0.9, -1)
    counts = torch.bincount(ids, minlength=12).double()
    assert (counts[p == 0] == 0).all(), "a filtered-out token was drawn"
    sigma = (rows * p * (1 - p)).sqrt()
    assert ((counts - rows * p).abs() <= 4 * sigma + 1).all(), (counts, rows * p)
    # uniforms: a pure function of (seed, id, step), distinct across each key
    u = row_uniforms(5, torch.arange(4), 3)
    assert torch.equal(u, row_uniforms(5, torch.arange(4), 3))
    assert not torch.equal(u, row_uniforms(6, torch.arange(4), 3))
    assert not torch.equal(u, row_uniforms(5, torch.arange(4), 4))
    assert not torch.equal(u, row_uniforms(5, torch.arange(1, 5), 3))
    assert ((u >= 0) & (u < 1)).all()


@pytest.mark.parametrize("temperature,top_k,top_p,greedy", [(1.0, 0, 1.0, False), (0.7, 20, 0.9, False),
                                                             (0.7, 0, 1.0, True)])
def test_single_pass_logprobs_equal_megarl_ops(temperature, top_k, top_p, greedy):
    """The engine's one-exp-pass draw + log-prob agrees with megarl.ops.logprobs_and_entropy."""
    from megarl.ops import logprobs_and_entropy
    from megarl.rollout.sampling import SamplingParams, filter_logits, row_uniforms, sample_tokens

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 300, generator=g) * 3
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy)
    filtered = filter_logits(logits, params)
    ids, lp = sample_tokens(filtered, params, row_uniforms(1, torch.arange(64), 0))
    ref, _ = logprobs_and_entropy(filtered, ids, temperature=temperature, with_entropy=False)
    assert torch.isfinite(lp).all()
    assert (lp - ref).abs().max() < 2e-6, (lp - ref).abs().max()
    if greedy:
        assert torch.equal(ids, logits.argmax(-1))
    ids_only, none = sample_tokens(filtered, SamplingParams(**{**params.__dict__, "logprobs": False}),
                                   row_uniforms(1, torch.arange(64), 0), with_logprobs=False)
    assert none is None and torch.equal(ids_only, ids)


@pytest.mark.parametrize("vocab,spread", [(300, 4), (5000, 4), (151936, 4), (5000, 40)])
def test_inverse_cdf_equals_a_float64_reference(vocab, spread):
    """The draw picks the ids of a float64 inverse CDF over the vocabulary, with and without
    zero-mass ids (top-k); spread 40: most logits lie far below their row's max (exp underflows)."""
    from megarl.rollout.sampling import SamplingParams, filter_logits, row_uniforms, sample_tokens

    g = torch.Generator().manual_seed(vocab)
    for params in (SamplingParams(), SamplingParams(top_k=37, temperature=0.8)):
        logits = torch.randn(32, vocab, generator=g) * spread
        filtered = filter_logits(logits, params)
        u = row_uniforms(vocab, torch.arange(32), 7)
        ids, lp = sample_tokens(filtered, params, u)
        z = filtered.double() / params.temperature
        e = torch.exp(z - z.amax(-1, keepdim=True))
        cdf = torch.cumsum(e, -1)
        ref = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1)
        assert torch.equal(ids, ref)
        assert torch.isfinite(filtered.gather(1, ids[:, None])).all(), "a zero-mass id was drawn"
        assert torch.allclose(lp.double(), torch.log_softmax(z, -1).gather(1, ids[:, None]).squeeze(1), atol=1e-5)


def test_inverse_cdf_never_draws_zero_mass_at_the_edges():
    """u at its largest (1 - 2^-40) and at 0, mass only in one id (first, inside, last): the id
    drawn is always one of positive mass."""
    from megarl.rollout.sampling import _inverse_cdf

    V = 3 * 2048 + 17
    for hot in (0, 2047, 2048, 2 * 2048 + 5, V - 1):
        e = torch.zeros(2, V)
        e[:, hot] = 1.0
        e[1, V - 1] = 1e-30  # a second, tiny mass after it
        u = torch.tensor([1 - 2.0 ** -40, 0.0], dtype=torch.float64)
        ids, total = _inverse_cdf(e, u)
        assert (e.gather(1, ids[:, None]) > 0).all(), (hot, ids)
        assert int(ids[1]) == hot and total[0] == 1.0


@pytest.mark.parametrize("rows", [[0, 2, 3], [1], [0, 0, 0, 1, 1, 2, 3, 3]])  # finished rows leave / a prompt's row to its samples
def test_take_cache_rows_moves_the_written_positions(rows):
    from types import SimpleNamespace

    from megarl.rollout.engine import _take_cache_rows

    g = torch.Generator().manual_seed(7)
    B, groups, S, d, filled = 4, 2, 9, 3, 5
    caches = {n: tuple(torch.randn(B, groups, S, d, generator=g) for _ in range(2)) for n in (1, 2)}
    want = {n: tuple(c[rows, :, :filled].clone() for c in kv) for n, kv in caches.items()}
    ctx = SimpleNamespace(key_value_memory_dict=dict(caches), max_batch_size=B)
    _take_cache_rows(ctx, torch.tensor(rows), filled)
    assert ctx.max_batch_size == len(rows)
    for n, kv in ctx.key_value_memory_dict.items():
        for got, ref, old in zip(kv, want[n], caches[n]):
            assert got.shape == (len(rows), groups, S, d) and got.is_contiguous()
            assert torch.equal(got[:, :, :filled], ref)
            assert (got.data_ptr() == old.data_ptr()) == (len(rows) <= B)  # a shrinking cache keeps its memory
