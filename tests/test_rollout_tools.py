"""Tool calls inside rollouts: observation tokens forced through the KV cache, masks, limits, layouts.

The tiny random model knows nothing of tools, so a forward hook on its output layer raises the
logits of `<` and `=` (and digits): sampled rows then write `<<...=` often, which closes
calculator calls (most arguments are garbage: error observations are calls too). References are
independent of the engine's cache: a no-cache forward of the final sequences (float64 log-probs),
and a no-cache greedy loop that runs the tools itself.
"""
import pytest
import torch

from dist_helpers import run_distributed

VOCAB = 261  # the byte tokenizer's vocabulary
LENS = (3, 7, 12, 5, 9, 4)
# Logit offsets: every other token -6, so rows write arithmetic-looking text with calls in it.
BIAS = {"<": 2.5, "=": 1.5, "+": 0.0, "*": 0.0, **{str(d): 0.0 for d in range(10)}}
OTHERS = -6.0


def _model_cfg():
    from megarl.config import ModelConfig

    return ModelConfig(num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_kv_heads=2,
                       vocab_size=VOCAB, max_position_embeddings=64, init_std=0.1)


def _prompts():
    from megarl.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    g = torch.Generator().manual_seed(3)
    words = ["twelve", "sum", "3*4", "apples", "ok", "go"]
    return [[tok.bos_id] + tok.encode(" ".join(words[int(i) % len(words)] for i in torch.randint(0, 6, (n,), generator=g)))[: 2 * n]
            for n in LENS]


def _bias_hook(role):
    from megarl.models.layout import unwrap

    gpt = unwrap(role.model)
    if not hasattr(gpt, "output_layer"):  # an earlier pipeline stage
        return None
    offset = torch.full((VOCAB,), OTHERS)
    for ch, v in BIAS.items():
        offset[ord(ch)] = v
    offset[260] = -1.0  # <|im_end|>: some rows stop

    def hook(module, args, output):
        logits, b = output
        logits = logits.clone()
        logits[..., :VOCAB] += offset.to(logits.dtype)  # the full vocabulary (gathered over TP)
        return logits, b

    return gpt.output_layer.register_forward_hook(hook)


def _toolbox(max_calls=3, extra=()):
    from megarl.rollout.tools import Calculator, Toolbox

    return Toolbox([Calculator(timeout_s=2.0, max_output_chars=12), *extra], max_calls=max_calls)


def _engine(role, tools, **kw):
    from megarl.data.tokenizer import ByteTokenizer
    from megarl.rollout.engine import MegatronRolloutEngine

    tok = ByteTokenizer()
    return MegatronRolloutEngine(role, vocab_size=VOCAB, pad_id=tok.pad_id, decode=tok.decode, encode=tok.encode,
                                 tools=tools, **kw)


@torch.no_grad()
def _full_logits(role, tokens):
    """No-cache forward (the role is built in eval-equivalent state: no dropout) -> fp64 [N, L, V]."""
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    return role.model(tokens, positions, None)[..., :VOCAB].double()


@torch.no_grad()
def _reference_rollout(role, prompts, n, toolbox, max_new_tokens, stop_ids, seed):
    """No-cache sampling at temperature 1 that runs the tools itself, the independent reference:
    every token is drawn by float64 inverse CDF from a full forward of the sequence so far, with
    the engine's keyed uniforms (seed, global sample id, response position)."""
    from megarl.data.tokenizer import ByteTokenizer
    from megarl.rollout.sampling import row_uniforms

    tok = ByteTokenizer()
    out = []
    for row in range(len(prompts) * n):
        seq, resp, observed, queue, scan, calls = list(prompts[row // n]), [], [], [], 0, 0
        while len(resp) < max_new_tokens:
            if queue:
                nxt, obs = queue.pop(0), True
            else:
                p = torch.softmax(_full_logits(role, torch.tensor([seq]))[0, -1], -1)
                u = float(row_uniforms(seed, torch.tensor([row]), len(resp))[0])
                nxt, obs = int(torch.searchsorted(torch.cumsum(p, 0), torch.tensor([u], dtype=torch.float64),
                                                  right=True)[0]), False
            seq.append(nxt)
            resp.append(nxt)
            observed.append(obs)
            if obs:
                continue
            if nxt in stop_ids:
                break
            call = toolbox.find_call(tok.decode(resp[scan:]))
            if call is not None and len(resp) < max_new_tokens:
                if calls >= toolbox.max_calls:
                    break
                calls += 1
                queue = tok.encode(call.tool.call(call.argument).text)
                scan = len(resp) + len(queue)
        out.append((resp, observed))
    return out


def _single_body(rank, world_size):
    from megarl.config import ParallelConfig
    from megarl.data.tokenizer import ByteTokenizer
    from megarl.roles.role import Role
    from megarl.rollout.engine import SamplingParams
    from megarl.runtime.distributed import init_distributed, teardown

    init_distributed(1, 1, seed=11)
    tok = ByteTokenizer()
    role = Role("actor", _model_cfg(), ParallelConfig(), head="lm", seed=5)
    hook = _bias_hook(role)
    prompts = _prompts()
    out = {}

    # 1. sampled, with tools: log-probs of every sampled token against a no-cache float64 forward
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=24, stop_ids=tuple(tok.stop_ids))
    box = _toolbox(max_calls=2)
    r = _engine(role, box, max_batch_size=8).generate(prompts, params, seed=21)
    full = _full_logits(role, r.tokens)  # [N, L, V]
    errs, after_obs = [], 0
    for i in range(r.tokens.shape[0]):
        p = int(r.prompt_lens[i])
        seen_obs = False
        for j in range(int(r.response_lens[i])):
            if not r.sampled_mask[i, j]:
                seen_obs = True
                continue
            tok_id = int(r.tokens[i, p + j])
            want = torch.log_softmax(full[i, p + j - 1], -1)[tok_id].item()
            errs.append(abs(want - float(r.logprobs[i, j])))
            after_obs += seen_obs
    out["sampled"] = r
    out["logprob_err"], out["after_obs"] = max(errs), after_obs
    out["no_tools"] = _engine(role, None, max_batch_size=8).generate(prompts, params, seed=21)
    out["small_batches"] = _engine(role, box, max_batch_size=3).generate(prompts, params, seed=21)

    # 2. the same rows from the no-cache reference that runs the tools itself
    out["reference"] = _reference_rollout(role, prompts, 4, box, 24, set(tok.stop_ids), seed=21)

    # 3. limits: one call per sample; a small budget that cuts observations
    out["one_call"] = _engine(role, _toolbox(max_calls=1)).generate(prompts, params, seed=21)
    out["zero_calls"] = _engine(role, _toolbox(max_calls=0)).generate(prompts, params, seed=21)
    out["tight"] = _engine(role, box).generate(prompts, SamplingParams(n=4, max_new_tokens=9,
                                                                       stop_ids=tuple(tok.stop_ids)), seed=21)

    # 4. a tool that raises and one that hangs: error observations, the rollout goes on
    from megarl.rollout.tools import FunctionTool, Toolbox

    def boom(arg):
        raise RuntimeError("kaput")

    def hang(arg):
        import time
        time.sleep(30)

    for name, fn in (("boom", boom), ("hang", hang)):
        bad = FunctionTool(fn, name=name, timeout_s=0.2, max_output_chars=20)
        bad.call_open, bad.call_close = "<<", "="  # in place of the calculator: the biased model calls it
        out[name] = _engine(role, Toolbox([bad], max_calls=2)).generate(prompts, params, seed=21)

    # 5. the static (graph-safe) decode path: held rows, calls and stop strings checked at sync points
    out["static"] = []
    strings = SamplingParams(n=4, max_new_tokens=24, stop_ids=tuple(tok.stop_ids), stop_strings=("+1", "9<"))
    short = SamplingParams(n=4, max_new_tokens=9, stop_ids=tuple(tok.stop_ids))
    for sync_every, p_, tools in ((1, params, box), (5, params, box), (3, strings, box), (4, strings, None),
                                  (2, short, _toolbox(max_calls=1))):
        ref = _engine(role, tools, max_batch_size=8, static_decode=False).generate(prompts, p_, seed=21)
        got = _engine(role, tools, max_batch_size=8, static_decode=True, sync_every=sync_every).generate(
            prompts, p_, seed=21)
        out["static"].append((sync_every, ref, got))
    if hook is not None:
        hook.remove()
    teardown()
    return out


@pytest.fixture(scope="module")
def single():
    return run_distributed(_single_body, 1)[0]


def _observations(r, i):
    """The observed (forced) spans of row i as lists of token ids."""
    p, n = int(r.prompt_lens[i]), int(r.response_lens[i])
    spans, cur = [], []
    for j in range(n):
        if not r.sampled_mask[i, j]:
            cur.append(int(r.tokens[i, p + j]))
        elif cur:
            spans.append(cur)
            cur = []
    return spans + ([cur] if cur else [])


def test_static_decode_gives_the_per_step_paths_rows_with_tools_and_stop_strings(single):
    """Tool calls and stop strings in the graph-safe path: a row holds after a token that may
    close a call or end a stop string and the host checks it at the next sync point, so the rows
    (tokens, observations, counts, stops) are the per-step path's whatever sync_every."""
    calls = 0
    for sync_every, ref, got in single["static"]:
        assert got.stats.get("static_decode") and not ref.stats.get("static_decode")
        assert got.responses() == ref.responses(), sync_every
        for name in ("sampled_mask", "stopped", "tool_calls", "tool_errors", "observation_tokens", "hit_call_limit"):
            assert torch.equal(getattr(got, name), getattr(ref, name)), (name, sync_every)
        torch.testing.assert_close(got.logprobs, ref.logprobs, rtol=0, atol=1e-5)
        if sync_every > 1:
            assert got.stats["host_syncs"] < got.stats["forwards"]
        calls += int(ref.tool_calls.sum())
    from megarl.data.tokenizer import ByteTokenizer

    stop_ids = set(ByteTokenizer().stop_ids)
    on_strings = [r for _, ref, _ in single["static"][2:4] for r, resp in enumerate(ref.responses())
                  if ref.stopped[r] and resp[-1] not in stop_ids]
    assert calls > 10 and on_strings, (calls, on_strings)


def test_observations_keep_the_kv_cache_exact(single):
    r = single["sampled"]
    print(f"\n[tools] {int(r.tool_calls.sum())} calls, {int(r.tool_errors.sum())} errors, "
          f"{int(r.observation_tokens.sum())} observation tokens; {single['after_obs']} sampled tokens after one; "
          f"max |logprob - float64 no-cache| = {single['logprob_err']:.2e}")
    assert int(r.tool_calls.sum()) >= 4 and single["after_obs"] >= 10, "the test must force calls"
    assert single["logprob_err"] < 1e-4


def test_masks_and_observations(single):
    from megarl.data.tokenizer import ByteTokenizer
    from megarl.rollout.tools import calculate, ToolError

    tok = ByteTokenizer()
    r = single["sampled"]
    assert r.sampled_mask.dtype == torch.bool and r.sampled_mask.shape == r.response_mask.shape
    assert not (r.sampled_mask & ~r.response_mask).any()
    obs = r.response_mask & ~r.sampled_mask
    assert (r.logprobs[obs] == 0).all() and (r.logprobs[r.sampled_mask] != 0).any()
    assert torch.equal(r.observation_tokens, obs.sum(1))
    box = _toolbox()
    checked = 0
    for i in range(r.tokens.shape[0]):
        spans = _observations(r, i)
        assert len(spans) == int(r.tool_calls[i])
        # each observation is the calculator's answer to the call just before it
        resp = r.responses()[i]
        scan, j = 0, 0
        for span in spans:
            while True:  # walk to the end of the call that produced this span
                j += 1
                call = box.find_call(tok.decode(resp[scan:j]))
                if call is not None:
                    break
            try:
                want = calculate(call.argument) + ">>"
            except ToolError as e:
                want = f"error: {e}"[:12] + ">>"
            at_end = j + len(span) == len(resp) == 24  # cut by the budget
            got = tok.decode(span)
            assert got == want or (at_end and want.startswith(got)), (tok.decode(resp), got, want)
            checked += 1
            j += len(span)
            scan = j
    assert checked == int(r.tool_calls.sum())
    assert int(r.tool_errors.sum()) < checked, "some calls must succeed"


def test_rows_without_calls_are_the_rows_without_tools(single):
    r, ref = single["sampled"], single["no_tools"]
    assert torch.equal(ref.sampled_mask, ref.response_mask) and int(ref.tool_calls.sum()) == 0
    untouched = (r.tool_calls == 0) & ~r.hit_call_limit
    assert untouched.any() and not untouched.all()
    for i in range(r.tokens.shape[0]):
        if untouched[i]:
            assert r.responses()[i] == ref.responses()[i]
        else:  # the same sample up to its first call
            first = int((~r.sampled_mask[i, : int(r.response_lens[i])]).nonzero()[0]) if r.tool_calls[i] else None
            if first is not None:
                assert r.responses()[i][:first] == ref.responses()[i][:first]
    small = single["small_batches"]
    assert torch.equal(small.tokens, r.tokens) and torch.equal(small.sampled_mask, r.sampled_mask)


def test_samples_with_tools_equal_the_no_cache_reference(single):
    got, ref = single["sampled"], single["reference"]
    assert got.responses() == [resp for resp, _ in ref]
    small = single["small_batches"]  # 3 rows per cache: finished rows leave it (compaction)
    assert small.stats["compactions"] > 0 and small.responses() == got.responses()
    for i, (resp, observed) in enumerate(ref):
        assert (~got.sampled_mask[i, : len(resp)]).tolist() == observed


def test_call_limit_and_budget(single):
    one, zero, tight = single["one_call"], single["zero_calls"], single["tight"]
    assert (one.tool_calls <= 1).all() and one.hit_call_limit.any()
    for i in torch.nonzero(one.hit_call_limit).flatten().tolist():
        assert not one.stopped[i] and int(one.response_lens[i]) < 24  # ended on the refused call
    assert int(zero.tool_calls.sum()) == 0 and zero.hit_call_limit.any() and int(zero.observation_tokens.sum()) == 0
    # observations count against max_new_tokens: an observation that does not fit is cut there
    assert (tight.response_lens <= 9).all()
    cut = [i for i in range(tight.tokens.shape[0]) if tight.tool_calls[i] and not tight.sampled_mask[i, 8]
           and not _observations(tight, i)[-1][-2:] == list(b">>")]
    assert cut and all(int(tight.response_lens[i]) == 9 and not tight.stopped[i] for i in cut)


def test_failing_tools_give_error_observations(single):
    from megarl.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    for name, status in (("boom", "tool_errors"), ("hang", "tool_timeouts")):
        r = single[name]
        assert int(r.tool_calls.sum()) > 0 and torch.equal(getattr(r, status), r.tool_calls), name
        texts = {tok.decode(s) for i in range(r.tokens.shape[0]) for s in _observations(r, i)}
        want = "<output>error: RuntimeError: kaput" if name == "boom" else "<output>error: timed out after"
        assert all(t.startswith(want[: len(t)]) for t in texts), texts


# ------------------------------------------------------------------ layouts

PARAMS = dict(n=4, temperature=1.0, max_new_tokens=20)


def _layout_body(rank, world_size, tp, pp):
    from megarl.config import ParallelConfig
    from megarl.data.tokenizer import ByteTokenizer
    from megarl.roles.role import Role
    from megarl.rollout.engine import SamplingParams
    from megarl.runtime.distributed import init_distributed, teardown
    from megatron.core import parallel_state as ps

    init_distributed(tp, pp, seed=11)
    tok = ByteTokenizer()
    role = Role("actor", _model_cfg(), ParallelConfig(tp=tp, pp=pp), head="lm", seed=5)
    _bias_hook(role)
    prompts = _prompts()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per = len(prompts) // dp
    params = SamplingParams(stop_ids=tuple(tok.stop_ids), **PARAMS)
    r = _engine(role, _toolbox(max_calls=2), max_batch_size=8).generate(
        prompts[dp_rank * per: (dp_rank + 1) * per], params, seed=77, sample_offset=dp_rank * per * params.n)
    teardown()
    return r


@pytest.fixture(scope="module")
def layout_reference():
    return run_distributed(_layout_body, 1, 1, 1)[0]


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,world", [(2, 1, 2), (1, 2, 2), (1, 1, 2)])
def test_layouts_draw_the_same_samples_with_tools(layout_reference, tp, pp, world):
    ref = layout_reference
    assert int(ref.tool_calls.sum()) > 0 and ref.stopped.any() and not ref.stopped.all()
    results = run_distributed(_layout_body, world, tp, pp)
    dp = world // (tp * pp)
    rows = ref.tokens.shape[0] // dp
    for rank, r in enumerate(results):
        d = rank if dp == world else 0  # this process's data-parallel rank (TP2 / PP2 here: one DP rank)
        sl = slice(d * rows, (d + 1) * rows)
        L = int((r.prompt_lens + r.response_lens).max())
        assert torch.equal(r.tokens, ref.tokens[sl, :L]), f"rank {rank} at tp={tp} pp={pp} dp={dp} drew other samples"
        for name in ("sampled_mask", "tool_calls", "tool_errors", "observation_tokens", "hit_call_limit", "stopped"):
            got, want = getattr(r, name), getattr(ref, name)[sl]
            if name == "sampled_mask":
                want = want[:, : got.shape[1]]
            assert torch.equal(got, want), (rank, name)
        err = (r.logprobs - ref.logprobs[sl, : r.logprobs.shape[1]]).abs().max().item()
        assert err < 1e-4, f"rank {rank}: log-probs differ by {err:.2e}"

