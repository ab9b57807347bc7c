"""Batched KV-cache generation on the actor's own megatron-core model, at any TP/PP layout.

The model that trains is the model that samples: no weight copy, no second engine. One prefill
over left-padded prompts (explicit [b, 1, sq, sk] mask), then one token per step with
megatron-core's `StaticInferenceContext` holding the KV cache, which megarl's attention module
fills with keys after RoPE, in a [B, g, S, d] layout (models/attention.py). On a GPU the decode
steps after the prefill run rollout/decode.py's graph-safe step (no host read per token, CUDA
graphs per bucket of rows kept across calls; tool calls and stop strings checked at sync points;
`static_decode`). megatron-core's own
engines do not fit RL on CPU (megatron-core 0.16): the dynamic one needs CUDA kernels, the legacy static
one samples padded-vocabulary ids, ignores the temperature in its log-probs and seeds every
rank alike.

Layouts. TP: the output layer gathers the logits over TP (`runtime_gather_output`), so every TP
rank holds the same full logits and draws the same token from the same counter-based uniform,
with no extra communication. PP: each step goes through megatron's forward-only schedule
(the rows split into pipeline micro-batches that share one cache via `batch_size_offset`), and
only the sampled ids and their log-probs are broadcast from the last stage.

Tools (megarl/rollout/tools.py). With a Toolbox, each row's text since its last observation is
watched for a closed call; the tool's observation is tokenised and queued on that row, and the
queue is consumed one token per decode step before sampling resumes: a forced token goes through
the very decode step a sampled one does, so the KV cache is that of the full sequence. A forced
token has no log-prob (0), is not a sample (`Rollout.sampled_mask` False) and never ends a row.
Sampled tokens keep their keys (global sample id, position in the response), so a row without
calls is the row the engine draws without tools. The tool runs on the first rank of the
model-parallel group, whose observation tokens are broadcast to the others: every TP/PP rank
injects the same tokens even when a tool is not deterministic (timeouts). Observations count
against `max_new_tokens`: prompt + response (sampled and observed) stays within the model's
sequence length; an observation that does not fit is cut there (the row ends on the budget).
A call beyond `Toolbox.max_calls` is not run: the row ends (`hit_call_limit`).
"""
from __future__ import annotations

import abc
import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from megarl.models.attention import slot_context_class
from megarl.models import moe
from megarl.models.layout import unwrap
from megarl.rollout.decode import DecodeState, DecodeWorkspace, bucket_for, bucket_sizes, decode_step
from megarl.rollout.sampling import SamplingParams, filter_logits, row_uniforms, sample_tokens, uniform_table
from megarl.rollout.tools import ERROR, TIMEOUT, Toolbox
from megarl.runtime import cpu_compat

__all__ = ["SamplingParams", "Rollout", "RolloutEngine", "MegatronRolloutEngine"]


@dataclass
class Rollout:
    """N = len(prompts) * n rows; sample j of prompt i is row i * n + j."""
    tokens: torch.Tensor         # [N, L] long: prompt then response, right-padded with pad_id
    prompt_lens: torch.Tensor    # [N] long
    response_lens: torch.Tensor  # [N] long
    logprobs: torch.Tensor       # [N, R] fp32 log-prob of each response token under the sampled distribution; 0 where masked
    response_mask: torch.Tensor  # [N, R] bool
    stopped: torch.Tensor        # [N] bool: ended on a stop id/string (False = hit max_new_tokens)
    stats: dict = field(default_factory=dict)  # timings and sizes of the call (not part of the result's meaning)
    # Tools (all filled by the engine; without tools sampled_mask == response_mask and the counts are 0):
    sampled_mask: torch.Tensor | None = None      # [N, R] bool: sampled by the policy (False: observation or padding)
    tool_calls: torch.Tensor | None = None        # [N] long: tool calls run (limit-refused calls not counted)
    tool_errors: torch.Tensor | None = None       # [N] long: calls whose observation is an error (timeouts included)
    tool_timeouts: torch.Tensor | None = None     # [N] long: calls that hit the tool's timeout
    observation_tokens: torch.Tensor | None = None  # [N] long: forced tokens in the response
    hit_call_limit: torch.Tensor | None = None    # [N] bool: ended on a call beyond max_tool_calls
    # MoE with record_routing: [N, L, layers, k] int16, the experts each token went to (this
    # stage's MoE layers), aligned with tokens; -1 where unknown (a row's last token, padding)
    routing: torch.Tensor | None = None

    def __post_init__(self):
        N = self.tokens.shape[0]
        if self.sampled_mask is None:
            self.sampled_mask = self.response_mask.clone()
        for name in ("tool_calls", "tool_errors", "tool_timeouts", "observation_tokens"):
            if getattr(self, name) is None:
                setattr(self, name, torch.zeros(N, dtype=torch.long))
        if self.hit_call_limit is None:
            self.hit_call_limit = torch.zeros(N, dtype=torch.bool)

    def responses(self) -> list[list[int]]:
        """Response token ids per row (the stop token included)."""
        return [self.tokens[i, p: p + r].tolist()
                for i, (p, r) in enumerate(zip(self.prompt_lens.tolist(), self.response_lens.tolist()))]


class RolloutEngine(abc.ABC):
    """What the RL trainer and evaluation call; a vLLM/SGLang backend can implement it later."""

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams, *, seed: int,
                 sample_offset: int = 0) -> Rollout:
        """Sample `params.n` responses per prompt. Row r's randomness is keyed by
        (seed, sample_offset + r, decode step): DP ranks pass different offsets."""


def _model_chunks(role) -> list:
    """role.chunks (a Role), or a bare / wrapped model."""
    chunks = list(getattr(role, "chunks", None) or [getattr(role, "model", role)])
    if len(chunks) != 1:
        raise ValueError(f"rollout needs one model chunk per rank; got {len(chunks)} (virtual pipeline stages)")
    return chunks


class MegatronRolloutEngine(RolloutEngine):
    def __init__(self, role, *, vocab_size: int, pad_id: int, decode: Callable[[list[int]], str] | None = None,
                 max_batch_size: int = 64, max_seq_len: int | None = None, pp_microbatches: int | None = None,
                 compact: bool = True, tools: Toolbox | None = None, encode: Callable[[str], list[int]] | None = None,
                 static_decode: bool | None = None, sync_every: int = 8, cuda_graphs: bool = True):
        """role: a megarl Role (or its model, possibly DDP / Float16Module wrapped) with an LM head.
        vocab_size: the true vocabulary (padded columns are never sampled).
        max_batch_size: rows per KV cache (micro-batch); the cache is freed after each.
        max_seq_len: longest prompt + response; default the model's max_position_embeddings.
        pp_microbatches: at PP > 1, pipeline micro-batches per step (default: PP size).
        compact: drop finished rows from the KV cache once a quarter of its rows are done (the
            live rows' written positions move down in place, ~log(rows) / log(4/3) times a batch).
        tools: a Toolbox (tools + max calls per sample); needs decode and encode (observation text -> ids).
        static_decode: decode steps through rollout/decode.py's graph-safe step (fixed shapes, no
            host read; the finished and held flags read every `sync_every` steps, tool calls, stop
            strings and compaction into buckets of rows then) at PP 1; at PP > 1 the per-step
            path below. None: on a CUDA device. Its KV cache, states and graphs live in
            `self.workspace` across calls (released with `release()`, which the actor's offload
            calls). cuda_graphs: on a CUDA device, each bucket's step is captured once and replayed
            in every later call of the same shape (not where `graph_blocker` names a reason)."""
        self.chunks = _model_chunks(role)
        self.model = self.chunks[0]
        self.gpt = unwrap(self.model)
        if getattr(self.gpt, "megarl_head", "lm") != "lm":
            raise ValueError(f"rollout needs an LM head, got head={self.gpt.megarl_head!r}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.vocab_size, self.pad_id, self.decode = int(vocab_size), int(pad_id), decode
        self.max_batch_size = int(max_batch_size)
        self.max_seq_len = int(max_seq_len or self.gpt.max_sequence_length)
        self.config = self.gpt.config
        self.pp_microbatches = pp_microbatches or self.config.pipeline_model_parallel_size
        self.device = next(self.gpt.parameters()).device
        self.compact = compact
        self.tools = tools if tools is not None and tools.tools else None
        self.encode = encode
        self.static_decode = self.device.type == "cuda" if static_decode is None else bool(static_decode)
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        self.sync_every, self.cuda_graphs = int(sync_every), bool(cuda_graphs)
        # the caller hands it to the role's offload (roles.offload.register_workspace), which
        # releases it before the weights move and counts it in the ledger
        self.workspace = DecodeWorkspace()
        self._holds: dict = {}  # last characters -> token ids that may end such a string
        if self.tools is not None and (decode is None or encode is None):
            raise ValueError("MegatronRolloutEngine(tools=...) needs decode and encode functions (the tokenizer's)")
        self.ep_group = _expert_parallel_group(self.config)
        self.record_routing = False  # MoE: record each token's experts (Rollout.routing), per-step path only

    def _ep_max(self, value: int) -> int:
        """The largest `value` over the expert-parallel group. Its ranks run every MoE forward's
        all-to-all together, so each runs as many KV-cache batches and decode steps as the
        busiest one: a rank whose rows are done steps on with them as padding."""
        if self.ep_group is None:
            return value
        t = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ep_group)
        return int(t.item())

    # ------------------------------------------------------------------ public

    def release(self) -> None:
        """Free the static decode's KV cache, states and CUDA graphs (rebuilt by the next call)."""
        self.workspace.release()

    @torch.no_grad()  # not inference_mode: megatron's global buffers must stay usable in training
    def generate(self, prompts: list[list[int]], params: SamplingParams, *, seed: int,
                 sample_offset: int = 0) -> Rollout:
        params.validate()
        self._check_prompts(prompts, params)
        # PP 1: no schedule asks for a "cuda" device, so megatron's CPU shim is off for the call
        with cpu_compat.suspended() if self.config.pipeline_model_parallel_size == 1 else contextlib.nullcontext():
            out = self._generate(prompts, params, seed, sample_offset)
        if self.workspace.cache:
            out.stats["workspace_bytes"] = self.workspace.nbytes()
        return out

    def _generate(self, prompts, params, seed, sample_offset):
        n = params.n
        rows = [list(map(int, prompts[r // n])) for r in range(len(prompts) * n)]
        N = len(rows)
        # Shortest prompts together: less left padding. Rows are keyed by their global id, so
        # the grouping changes no sample.
        order = sorted(range(N), key=lambda r: len(rows[r]))
        responses: list = [None] * N
        logprobs: list = [None] * N
        stopped = torch.zeros(N, dtype=torch.bool)
        extras: dict = {k: [None] * N for k in _ROW_EXTRAS}
        stats = {"prefill_s": 0.0, "decode_s": 0.0, "forwards": 0, "kv_cache_bytes": 0, "kv_cache_tokens": 0,
                 "batches": 0, "compactions": 0}
        if self.tools is not None:
            stats["tool_s"] = 0.0
        batches = range(0, N, self.max_batch_size)
        with _inference_mode(self.chunks, self.gpt):
            for _ in range(self._ep_max(len(batches)) - len(batches)):  # match the expert-parallel ranks' batches
                self._generate_batch([[self.pad_id]], torch.zeros(1, dtype=torch.long), params, seed, {**stats})
            for b0 in batches:
                batch = order[b0: b0 + self.max_batch_size]
                out = self._generate_batch([rows[r] for r in batch],
                                           torch.tensor([sample_offset + r for r in batch], dtype=torch.long),
                                           params, seed, stats)
                for k, r in enumerate(batch):
                    responses[r], logprobs[r], stopped[r] = out[0][k], out[1][k], out[2][k]
                    for name in _ROW_EXTRAS:
                        extras[name][r] = out[3][name][k]
                stats["batches"] += 1
        return self._assemble(rows, responses, logprobs, stopped, stats, extras)

    # ------------------------------------------------------------------ checks

    def _check_prompts(self, prompts, params):
        if params.stop_strings and self.decode is None:
            raise ValueError("SamplingParams.stop_strings need a decode function: MegatronRolloutEngine(..., decode=...)")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
            if len(p) + params.max_new_tokens > self.max_seq_len:
                raise ValueError(f"prompt {i} has {len(p)} tokens: with max_new_tokens={params.max_new_tokens} "
                                 f"it exceeds the model's max sequence length {self.max_seq_len}")
            lo, hi = min(p), max(p)
            if lo < 0 or hi >= self.vocab_size:
                raise ValueError(f"prompt {i} holds token id {lo if lo < 0 else hi} outside [0, {self.vocab_size})")

    # ------------------------------------------------------------------ one KV-cache batch

    def _generate_batch(self, prompts, sample_ids, params, seed, stats):
        """Rows of one KV cache -> (responses, logprobs, stopped) per row, on every rank."""
        dev = self.device
        B, T = len(prompts), params.max_new_tokens
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        P = int(lens.max())
        S = P + T
        rt = _RowTools(B, T) if self.tools is not None else None
        static = (self.static_decode and self.config.pipeline_model_parallel_size == 1 and not self.record_routing
                  and self.ep_group is None)
        ws = self.workspace
        if static:  # slots in steps of 256 (at most the model's): calls of close lengths share graphs
            S = min(-(-S // 256) * 256, max(S, self.max_seq_len))
            if ws.fits(B, S):
                S = ws.seq  # the kept cache's slots: its states and graphs have that shape
            else:
                ws.release()  # before the new cache is allocated
        pads = P - lens  # [B] left padding per row
        tokens = torch.full((B, P), self.pad_id, dtype=torch.long)
        for i, p in enumerate(prompts):
            tokens[i, P - len(p):] = torch.tensor(p, dtype=torch.long)
        key_pad = torch.arange(S)[None, :] < pads[:, None]  # [B, S] True = padding key
        causal = torch.ones(P, P, dtype=torch.bool).triu_(1)  # [P, P] True = future key
        mask = causal[None, None] | key_pad[:, None, None, :P]  # [B, 1, P, P]
        mask.diagonal(dim1=-2, dim2=-1).fill_(False)  # padding queries see themselves: no all-masked row (NaN in SDPA)
        mask = mask.to(dev)
        key_pad = key_pad.to(dev)
        tokens, pads = tokens.to(dev), pads.to(dev)

        stop_ids = torch.tensor(sorted(set(params.stop_ids)), dtype=torch.long)
        out_ids = torch.full((B, T), self.pad_id, dtype=torch.long)  # [B, T]
        out_lp = torch.zeros(B, T, dtype=torch.float32)
        resp_len = torch.zeros(B, dtype=torch.long)
        done = torch.zeros(B, dtype=torch.bool)
        stopped = torch.zeros(B, dtype=torch.bool)
        scan_from = rt.scan_from if rt is not None else [0] * B  # response index after the last observation

        # One prefill per prompt: the n samples of a prompt are consecutive rows (the order is
        # sorted stably by length), so each run of equal rows is prefilled once and its KV entries
        # are copied to the run's rows before the first token is sampled.
        first, expand = _prompt_runs(prompts)  # [U] prefilled rows, [B] -> index of the row's run
        if not static:
            ctx = slot_context_class()(len(first), S)
        elif ws.fits(B, S):  # the cache of earlier calls, at its own size (the graphs read it there)
            ctx = slot_context_class()(ws.rows, ws.seq)
            ctx.key_value_memory_dict.update(ws.views())
        else:  # allocated by the prefill, kept by the workspace
            ctx = slot_context_class()(max(B, self.max_batch_size), S)
        ctx.materialize_only_last_token_logits = True
        active = torch.arange(B)  # batch row of each cache row (shrinks as rows finish)
        stack = contextlib.ExitStack()
        route = None  # [B, S, layers, k]: the experts of the token fed at each column
        try:
            routers = stack.enter_context(moe.recording(self.gpt)) if self.record_routing else None
            step_tokens, offset = tokens, 0
            for t in range(T):
                t0 = time.perf_counter()
                positions = (torch.arange(offset, offset + step_tokens.shape[1], device=dev)[None, :]
                             - pads[:, None]).clamp_(min=0)  # [A, s] (RoPE in static inference uses the offset)
                if t == 0 and len(first) < B:
                    u = first.to(dev)
                    ids, lps = self._step(step_tokens[u], positions[u], mask[u], ctx, params, seed, sample_ids, t,
                                          expand=expand)  # [B]
                else:
                    ids, lps = self._step(step_tokens, positions, mask, ctx, params, seed, sample_ids[active], t)  # [A]
                if t == 0 and static and not ws.cache:
                    ws.adopt(ctx.key_value_memory_dict, ctx.max_batch_size, ctx.max_sequence_length)
                if t == 0 and len(first) < B:
                    _take_cache_rows(ctx, expand.to(dev), P)  # [U] -> [B] cache rows: a prompt's keys to its samples
                if routers:
                    route = self._record(routers, route, offset, step_tokens.shape[1], active if t else None,
                                         expand if t == 0 and len(first) < B else None, B, S)
                offset += step_tokens.shape[1]
                ctx.increment_sequence_len_offset(step_tokens.shape[1])
                if t == 0:
                    stats["kv_cache_bytes"] = max(stats["kv_cache_bytes"], _cache_bytes(ctx))
                    stats["prefill_rows"] = stats.get("prefill_rows", 0) + len(first)
                    stats["kv_cache_tokens"] = max(stats["kv_cache_tokens"], B * S)
                stats["prefill_s" if t == 0 else "decode_s"] += time.perf_counter() - t0
                stats["forwards"] += 1

                if rt is not None:
                    ids, lps = rt.force(active, ids, lps, t)  # queued observation tokens replace samples
                live = ~done[active]  # [A]
                rows = active[live]
                out_ids[rows, t] = ids[live]
                out_lp[rows, t] = lps[live]
                resp_len[rows] += 1
                hit = torch.isin(ids[live], stop_ids)
                if rt is not None:
                    hit &= ~rt.observed[rows, t]  # an observation never ends a row
                if params.stop_strings:
                    for k in torch.nonzero(~hit).flatten().tolist():
                        if rt is not None and rt.observed[rows[k], t]:
                            continue
                        text = self.decode(out_ids[rows[k], scan_from[int(rows[k])]: t + 1].tolist())
                        if any(s_ in text for s_ in params.stop_strings):
                            hit[k] = True
                stopped[rows[hit]] = True
                done[rows[hit]] = True
                if rt is not None and t + 1 < T:
                    t1 = time.perf_counter()
                    ends = self._tool_calls(rt, [(r, t) for r in rows[~hit].tolist()], out_ids)
                    done[ends] = True
                    stats["tool_s"] += time.perf_counter() - t1
                if self._ep_max(int(not bool(done.all()))) == 0:
                    break
                alive = ~done[active]  # [A]
                if (self.compact and not static  # the static path compacts into buckets
                        and len(active) - int(alive.sum()) >= max(1, (len(active) + 3) // 4)):
                    keep = torch.nonzero(alive).flatten()  # finished rows leave the cache: less work per step
                    keep = keep if len(keep) else torch.zeros(1, dtype=torch.long)  # stepping for other EP ranks
                    _take_cache_rows(ctx, keep.to(dev), offset)
                    active, ids, key_pad, pads = active[keep], ids[keep], key_pad[keep.to(dev)], pads[keep.to(dev)]
                    stats["compactions"] += 1
                step_tokens = torch.where(done[active], self.pad_id, ids).to(dev)[:, None]  # [A, 1]
                mask = key_pad[:, None, None, : offset + 1]  # [A, 1, 1, sk]: the new token sees all real keys
                if static:  # steps 1.. on the device (rollout/decode.py)
                    t0 = time.perf_counter()
                    observed = rt.observed if rt is not None else torch.zeros(B, T, dtype=torch.bool)
                    self._decode_static(ctx, active, step_tokens, key_pad, offset,
                                        (out_ids, out_lp, resp_len, done, stopped, observed), sample_ids, params,
                                        seed, stats, rt)
                    stats["decode_s"] += time.perf_counter() - t0
                    break
        finally:
            stack.close()
            ctx.key_value_memory_dict.clear()  # free the cache now, not at the next GC
        responses = [out_ids[b, : resp_len[b]].tolist() for b in range(B)]
        logprobs = [out_lp[b, : resp_len[b]] for b in range(B)]
        extras = rt.rows(resp_len) if rt is not None else {
            "observed": [torch.zeros(int(n), dtype=torch.bool) for n in resp_len], "calls": [0] * B,
            "errors": [0] * B, "timeouts": [0] * B, "hit_limit": [False] * B}
        extras["routing"] = [None] * B
        if route is not None:  # a row's tokens; its last one was never fed (its routing unknown)
            extras["routing"] = [torch.cat([route[b, P - lens[b]: P + resp_len[b] - 1],
                                            route.new_full((1, *route.shape[2:]), -1)]) for b in range(B)]
        return responses, logprobs, stopped.tolist(), extras

    @staticmethod
    def _record(routers, route, col, s, active, expand, B, S):
        """The routers' top-k of the last forward into route [B, S, layers, k] at columns
        col..col+s: rows `active` (decode), or every batch row from its prompt's prefill row."""
        idx = moe.recorded(routers).cpu().to(torch.int16)  # [s * rows, layers, k]
        for r in routers:
            r.router_replay.recorded.clear()
        idx = idx.view(s, -1, *idx.shape[1:]).transpose(0, 1)  # [rows, s, layers, k]
        if route is None:
            route = torch.full((B, S, *idx.shape[2:]), -1, dtype=torch.int16)
        if active is not None:
            route[active, col: col + s] = idx
        else:
            route[:, col: col + s] = idx if expand is None else idx[expand]
        return route

    def _decode_static(self, ctx, active, tokens, key_pad, offset, outputs, sample_ids, params, seed, stats, rt):
        """Decode steps 1.. of one KV-cache batch with rollout/decode.py's graph-safe step; the
        results land in `outputs` (host out_ids, out_lp, resp_len, done, stopped, observed,
        indexed by batch row), as the per-step loop writes them. The host reads the finished and
        held flags every sync_every steps: held rows' text is checked for stop strings and tool
        calls as the per-step loop does at every token (a call's observation is queued on the
        device, the row resumes), and the live rows move into the smallest bucket that holds them.
        The states, constants and graphs are the workspace's: a later call of the same shape
        replays the graphs captured here."""
        dev, T, ws = self.device, params.max_new_tokens, self.workspace
        st = ws.state(len(active), T, dev)
        st.tokens.copy_(tokens)
        st.positions.fill_(offset)
        st.key_pad.copy_(key_pad)
        st.uniforms.copy_(uniform_table(seed, sample_ids[active], range(T)))
        for name, v in zip(_STATE_OUT, outputs):
            getattr(st, name).copy_(v[active])
        st.held.zero_()
        st.forced_len.zero_()
        st.forced_pos.zero_()
        if rt is not None:  # observations queued by the prefill's token
            for i, r in enumerate(active.tolist()):
                self._queue_forced(st, i, rt, r)
        st.rows = active.clone()
        st.refresh_mask()
        stops = tuple(sorted(set(params.stop_ids)))
        stop_mask = ws.id_mask(("stop", stops), stops, self.vocab_size, dev)
        holds, ids = self._hold_ids(params)
        hold_mask = ws.id_mask(("hold", holds), ids, self.vocab_size, dev) if holds is not None else None
        sampling = (params.greedy, params.temperature, params.top_k, params.top_p, params.logprobs, stops, holds)
        sizes = bucket_sizes(st.size)
        blocker = graph_blocker(self.config, self.gpt)
        use_graphs = self.cuda_graphs and self._can_capture() and blocker is None
        if self.cuda_graphs and self._can_capture() and blocker is not None:
            stats["cuda_graphs_off"] = blocker
        captured = 0

        def run(state):
            decode_step(self.model, ctx, state, params, vocab_size=self.vocab_size, pad_id=self.pad_id,
                        stop_mask=stop_mask, hold_mask=hold_mask)

        ctx.slots = st.positions[:, 0]
        ctx.freqs = ws.rope(self.gpt, dev)
        taken = 1  # decode steps since the prefill (a row without holds has taken as many tokens)
        try:
            while True:
                key = (st.size, ws.seq, T, sampling)
                steps = 0
                if use_graphs and (key in ws.graphs or T - taken >= 3):  # a capture runs two warm-up steps
                    graph, steps = ws.graph(key, lambda state=st: run(state))
                    captured += steps > 0
                    if not steps:
                        graph.replay()
                else:
                    run(st)
                steps = max(steps, 1)
                taken += steps
                stats["forwards"] += steps
                if taken % self.sync_every and taken < T:
                    continue
                stats["host_syncs"] = stats.get("host_syncs", 0) + 1
                if holds is not None:  # the only host reads: at sync points
                    self._release_holds(st, outputs, rt, params, stats)
                if bool(st.done.all()):
                    break
                if taken > T * (self.sync_every + 1):
                    raise RuntimeError(f"static decode: rows still live after {taken} steps of {T} tokens")
                live = int((~st.done).sum())
                target = bucket_for(live, sizes) if self.compact else st.size
                if target < st.size:  # live rows first, then finished ones to fill the bucket
                    _write_back(st, outputs)
                    keep = torch.argsort(st.done.to(torch.uint8).cpu(), stable=True)[:target].sort().values
                    _take_cache_rows(ctx, keep.to(dev), offset + taken - 1)
                    st = ws.state(target, T, dev).load(st, keep)
                    ctx.slots = st.positions[:, 0]
                    stats["compactions"] += 1
        finally:
            ctx.slots = ctx.freqs = None
        _write_back(st, outputs)
        stats["static_decode"] = True
        stats["cuda_graphs_captured"] = stats.get("cuda_graphs_captured", 0) + captured
        stats["cuda_graphs"] = len(ws.graphs)

    def _can_capture(self) -> bool:
        """Whether the device captures CUDA graphs (a CUDA device; tests on CPU stand a recorder in)."""
        return self.device.type == "cuda"

    def _hold_ids(self, params) -> tuple[tuple, tuple] | tuple[None, None]:
        """(the last characters, the token ids after which a row waits for the host): the ids
        whose text holds the last character of a stop string or of a tool's call close (a string
        can only be completed by a token holding its last character, where the tokenizer decodes
        a sequence as its tokens' texts joined). (None, None): nothing to check. The characters
        name the ids in keys (a few, where the ids may be thousands)."""
        ends = {s_[-1] for s_ in params.stop_strings}
        if self.tools is not None:
            ends |= {tool.call_close[-1] for tool in self.tools.tools}
        if not ends:
            return None, None
        key = tuple(sorted(ends))
        if key not in self._holds:
            self._holds[key] = tuple(i for i in range(self.vocab_size) if any(c in self.decode([i]) for c in key))
        return key, self._holds[key]

    def _release_holds(self, st, outputs, rt, params, stats) -> None:
        """At a sync point: the held rows' text as the per-step loop checks it after each token
        (stop strings, then tool calls); their outcome goes back to the device, the rows resume."""
        held = torch.nonzero(st.held.cpu()).flatten().tolist()
        if not held:
            return
        _write_back(st, outputs)
        out_ids, _, resp_len, _, _, observed = outputs
        T = out_ids.shape[1]
        scan_from = rt.scan_from if rt is not None else None
        calls = []
        for i in held:
            r = int(st.rows[i])
            t = int(resp_len[r]) - 1  # the held token's response index
            if params.stop_strings and not observed[r, t]:
                text = self.decode(out_ids[r, (scan_from[r] if scan_from else 0): t + 1].tolist())
                if any(s_ in text for s_ in params.stop_strings):
                    st.stopped[i] = st.done[i] = True
                    continue
            if rt is not None and t + 1 < T:
                calls.append((r, t))
        if calls:
            t1 = time.perf_counter()
            ends = set(self._tool_calls(rt, calls, out_ids).tolist())
            stats["tool_s"] += time.perf_counter() - t1
            for i in held:
                r = int(st.rows[i])
                if r in ends:
                    st.done[i] = True
                else:
                    self._queue_forced(st, i, rt, r)
        st.held.zero_()

    @staticmethod
    def _queue_forced(st, i: int, rt, r: int) -> None:
        """Batch row r's queued observation tokens (rt.pending) into cache row i's device queue."""
        ids = rt.pending[r][: st.forced.shape[1]]
        if not ids:
            return
        st.forced[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        st.forced_len[i], st.forced_pos[i] = len(ids), 0
        rt.pending[r] = []

    # ------------------------------------------------------------------ tools

    def _tool_calls(self, rt: "_RowTools", rows: list, out_ids: torch.Tensor) -> torch.Tensor:
        """Rows whose token at response index t closed a tool call (rows: (batch row, t) pairs):
        run the calls, queue their observations; returns the rows that end on the call limit."""
        box = self.tools
        pending, ends = [], []
        for r, t in rows:
            if rt.observed[r, t]:
                continue
            lo = rt.scan_from[r]
            tail = self.decode(out_ids[r, max(lo, t + 1 - box.tail_chars): t + 1].tolist())
            if not any(tool.call_close in tail for tool in box.tools):  # cheap test before the full scan
                continue
            call = box.find_call(self.decode(out_ids[r, lo: t + 1].tolist()))
            if call is None:
                continue
            if rt.calls[r] >= box.max_calls:
                rt.hit_limit[r] = True
                ends.append(r)
                continue
            pending.append((r, t, call))
        if pending:
            observations = self._run_tools([c for _, _, c in pending])
            for (r, t, _), (ids, status) in zip(pending, observations):
                rt.queue(r, ids, status, t)
        return torch.tensor(ends, dtype=torch.long)

    def _run_tools(self, calls) -> list[tuple[list[int], str]]:
        """(observation ids, status) per call, identical on every rank of the model-parallel group:
        the group's first rank runs the tools and broadcasts the tokens."""
        group = _model_parallel_group()
        src = dist.get_global_rank(group, 0) if group is not None else None
        if group is None or dist.get_rank() == src:
            results = self.tools.run(calls)
            out = [([int(i) for i in self.encode(res.text)], res.status) for res in results]
        if group is None:
            return out
        codes = {s: k for k, s in enumerate(_STATUSES)}
        head = torch.zeros(2 * len(calls) + 1, dtype=torch.long)  # [lengths..., statuses..., total]
        if dist.get_rank() == src:
            head[: len(calls)] = torch.tensor([len(ids) for ids, _ in out])
            head[len(calls): 2 * len(calls)] = torch.tensor([codes[s] for _, s in out])
            head[-1] = sum(len(ids) for ids, _ in out)
        head = head.to(self.device)
        dist.broadcast(head, src=src, group=group)
        head = head.cpu()
        flat = torch.zeros(int(head[-1]), dtype=torch.long)
        if dist.get_rank() == src and len(flat):
            flat = torch.tensor([i for ids, _ in out for i in ids], dtype=torch.long)
        if len(flat):
            flat = flat.to(self.device)
            dist.broadcast(flat, src=src, group=group)
            flat = flat.cpu()
        pieces = torch.split(flat, head[: len(calls)].tolist())
        return [(p.tolist(), _STATUSES[int(c)]) for p, c in zip(pieces, head[len(calls): 2 * len(calls)])]

    def _sample(self, logits, params, seed, sample_ids, step):
        """Last-position logits [b, 1|s, V_pad] (full vocabulary on every TP rank) -> ids, log-probs [b]."""
        x = logits[:, -1, : self.vocab_size]  # [b, V]: padded columns dropped, never sampled
        filtered = filter_logits(x, params)
        uniforms = None if params.greedy else row_uniforms(seed, sample_ids, step).to(x.device)
        ids, lps = sample_tokens(filtered, params, uniforms, with_logprobs=params.logprobs)
        return ids, (lps if lps is not None else torch.zeros(ids.shape, dtype=torch.float32, device=ids.device))

    def _step(self, tokens, positions, mask, ctx, params, seed, sample_ids, step, expand=None):
        """One forward (prefill or decode) and the sampled ids [B] / log-probs [B] on every rank (CPU).
        expand: [B] the forward row each sampled row reads (a prompt prefilled once for its
        samples); None: row i reads forward row i."""
        pp = self.config.pipeline_model_parallel_size
        if pp == 1:
            logits = self.model(tokens, positions, mask, inference_context=ctx, runtime_gather_output=True)
            if expand is not None:
                logits = logits[expand.to(logits.device)]
            ids, lps = self._sample(logits, params, seed, sample_ids, step)
            return ids.cpu(), lps.float().cpu()
        return self._pipeline_step(tokens, positions, mask, ctx, params, seed, sample_ids, step, expand)

    def _pipeline_step(self, tokens, positions, mask, ctx, params, seed, sample_ids, step, expand=None):
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        U, s = tokens.shape
        if expand is None:
            expand = torch.arange(U)
        B = len(expand)
        m = max(d for d in range(1, min(self.pp_microbatches, U) + 1) if U % d == 0)  # equal shapes for p2p
        mb = U // m

        def sample(k, o):  # the sampled rows reading forward rows k*mb..(k+1)*mb (expand is sorted)
            sel = (expand >= k * mb) & (expand < (k + 1) * mb)
            return self._sample(o[(expand[sel] - k * mb).to(o.device)], params, seed, sample_ids[sel], step)

        def forward_step(data_iterator, model):
            k = next(data_iterator)
            rows = slice(k * mb, (k + 1) * mb)
            ctx.batch_size_offset = k * mb  # micro-batches share one cache
            out = model(tokens[rows], positions[rows], mask[rows], inference_context=ctx, runtime_gather_output=True)
            return out, lambda o, non_loss_data=True: sample(k, o)

        try:
            results = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(range(m)), model=self.chunks,
                num_microbatches=m, seq_length=s, micro_batch_size=mb, forward_only=True,
                collect_non_loss_data=True)
        finally:
            ctx.batch_size_offset = 0
        if ps.is_pipeline_last_stage():
            ids = torch.cat([r[0] for r in results])
            lps = torch.cat([r[1] for r in results]).float()
            packed = torch.stack([ids.double(), lps.double()]).to(self.device)  # [2, B]; ids exact in fp64
        else:
            packed = torch.empty(2, B, dtype=torch.float64, device=self.device)
        dist.broadcast(packed, src=ps.get_pipeline_model_parallel_last_rank(),
                       group=ps.get_pipeline_model_parallel_group())
        packed = packed.cpu()
        return packed[0].long(), packed[1].float()

    # ------------------------------------------------------------------ result

    def _assemble(self, rows, responses, logprobs, stopped, stats, extras) -> Rollout:
        N = len(rows)
        prompt_lens = torch.tensor([len(p) for p in rows], dtype=torch.long)
        response_lens = torch.tensor([len(r) for r in responses], dtype=torch.long)
        L = int((prompt_lens + response_lens).max()) if N else 0
        R = int(response_lens.max()) if N else 0
        tokens = torch.full((N, L), self.pad_id, dtype=torch.long)
        lp = torch.zeros(N, R, dtype=torch.float32)
        for i, (p, r) in enumerate(zip(rows, responses)):
            tokens[i, : len(p)] = torch.tensor(p, dtype=torch.long)
            tokens[i, len(p): len(p) + len(r)] = torch.tensor(r, dtype=torch.long)
            lp[i, : len(r)] = logprobs[i]
        mask = torch.arange(R)[None, :] < response_lens[:, None]
        sampled = mask.clone()
        for i, observed in enumerate(extras["observed"]):
            sampled[i, : len(observed)] &= ~observed
        counts = {k: torch.tensor(extras[k], dtype=torch.long) for k in ("calls", "errors", "timeouts")}
        routing = None
        if N and extras["routing"][0] is not None:
            routing = torch.full((N, L, *extras["routing"][0].shape[1:]), -1, dtype=torch.int16)
            for i, r in enumerate(extras["routing"]):
                routing[i, : len(r)] = r
        return Rollout(tokens, prompt_lens, response_lens, lp, mask, stopped, stats, sampled_mask=sampled,
                       tool_calls=counts["calls"], tool_errors=counts["errors"], tool_timeouts=counts["timeouts"],
                       observation_tokens=(mask & ~sampled).sum(1), hit_call_limit=torch.tensor(extras["hit_limit"],
                                                                                                 dtype=torch.bool),
                       routing=routing)


_ROW_EXTRAS = ("observed", "calls", "errors", "timeouts", "hit_limit", "routing")
_STATE_OUT = ("out_ids", "out_lp", "resp_len", "done", "stopped", "observed")  # DecodeState's outputs, as _write_back takes them


def _write_back(st: DecodeState, outputs) -> None:
    """A DecodeState's outputs into the host tensors (out_ids, out_lp, resp_len, done, stopped, observed)
    at its batch rows."""
    for name, dst in zip(_STATE_OUT, outputs):
        dst[st.rows] = getattr(st, name).cpu()
_STATUSES = ("ok", ERROR, TIMEOUT)


class _RowTools:
    """Per-row tool state of one KV-cache batch: observation queues, counters, scan positions."""

    def __init__(self, B: int, T: int):
        self.T = T
        self.pending: list[list[int]] = [[] for _ in range(B)]  # forced tokens still to feed, per row
        self.observed = torch.zeros(B, T, dtype=torch.bool)  # [B, T] True = a forced (observation) token
        self.scan_from = [0] * B  # response index just after the row's last observation
        self.calls, self.errors, self.timeouts = [0] * B, [0] * B, [0] * B
        self.hit_limit = [False] * B

    def force(self, active, ids, lps, t):
        """ids, lps [A] of the active rows with each row's next queued token in place of its sample."""
        forced = [(a, r) for a, r in enumerate(active.tolist()) if self.pending[r]]
        if not forced:
            return ids, lps
        ids, lps = ids.clone(), lps.clone()
        for a, r in forced:
            ids[a] = self.pending[r].pop(0)
            lps[a] = 0.0
            self.observed[r, t] = True
        return ids, lps

    def queue(self, r: int, ids: list[int], status: str, t: int):
        self.pending[r] = list(ids)
        self.calls[r] += 1
        self.errors[r] += int(status != "ok")
        self.timeouts[r] += int(status == TIMEOUT)
        self.scan_from[r] = t + 1 + len(ids)  # the next call is looked for after this observation

    def rows(self, resp_len) -> dict:
        return {"observed": [self.observed[b, : int(n)].clone() for b, n in enumerate(resp_len)],
                "calls": self.calls, "errors": self.errors, "timeouts": self.timeouts, "hit_limit": self.hit_limit}


def graph_blocker(config, gpt) -> str | None:
    """Why the graph-safe decode step of this model cannot be captured as a CUDA graph (None: it
    can); the step then runs uncaptured, with the same results.
    - MoE: megatron-core's token dispatchers size their permutations on the host (`tolist`,
      `masked_select`) in every forward.
    - FP8 GEMMs in generation (train.fp8.rollout: fp8): Transformer Engine's autocast keeps its
      scaling state outside the step."""
    if config.num_moe_experts:
        return "MoE: megatron-core's token dispatch reads expert counts on the host"
    if config.fp8 is not None and getattr(gpt, "fp8_rollout", "bf16") != "bf16":
        return "FP8 rollout GEMMs: Transformer Engine's scaling state lives outside the step"
    return None


def _expert_parallel_group(config):
    """The group a MoE layer's token dispatch spans (expert TP x EP) when it has more than one rank."""
    if not config.num_moe_experts or not dist.is_initialized():
        return None
    from megatron.core import parallel_state as ps

    group = ps.get_expert_tensor_and_model_parallel_group(check_initialized=False)
    return group if group is not None and dist.get_world_size(group) > 1 else None


def _model_parallel_group():
    """This rank's TP x PP group when it has more than one rank (else None: nothing to share)."""
    if not dist.is_initialized():
        return None
    from megatron.core import parallel_state as ps

    group = ps.get_model_parallel_group(check_initialized=False)
    return group if group is not None and dist.get_world_size(group) > 1 else None


def _prompt_runs(prompts: list) -> tuple[torch.Tensor, torch.Tensor]:
    """(first row of each run of equal consecutive prompts [U], run index of every row [B])."""
    first, expand = [], []
    for i, p in enumerate(prompts):
        if not first or prompts[first[-1]] != p:
            first.append(i)
        expand.append(len(first) - 1)
    return torch.tensor(first, dtype=torch.long), torch.tensor(expand, dtype=torch.long)


def _take_cache_rows(ctx, rows, filled: int):
    """Row i of every layer's cache (this stage's; every rank takes the same rows) becomes row
    rows[i] [A'] (ascending: finished rows leave, or a prompt's row goes to each of its samples).
    Only the first `filled` positions are moved; the rest is unwritten. The cache is megarl's
    attention's (models/attention.py): [B, g, S, d] per layer. A shrinking cache keeps its memory
    (rows move down in place, one index_select of the written positions each) instead of gathering
    whole caches into fresh ones. A growing cache is allocated anew."""
    n = len(rows)
    for layer, caches in list(ctx.key_value_memory_dict.items()):
        taken = []
        for c in caches:  # key, value
            written = c[:, :, :filled].index_select(0, rows)  # [A', g, filled, d]: a copy, so in place is safe
            dst = c[:n] if n <= c.shape[0] else c.new_zeros((n,) + tuple(c.shape[1:]))  # finite, as allocated
            dst[:, :, :filled] = written
            taken.append(dst)
        ctx.key_value_memory_dict[layer] = tuple(taken)
    ctx.max_batch_size = n


def _cache_bytes(ctx) -> int:
    return sum(t.numel() * t.element_size() for kv in ctx.key_value_memory_dict.values() for t in kv)


class _inference_mode:
    """eval() for the call (no dropout) and sequence parallelism off (a 1-token decode step
    cannot be split over TP), both restored after: every module's train/eval flag, the SP setting."""

    def __init__(self, chunks, gpt):
        self.chunks, self.gpt = chunks, gpt

    def __enter__(self):
        self.modes = [(m, m.training) for c in self.chunks for m in c.modules()]
        self.sp = bool(self.gpt.config.sequence_parallel)
        for c in self.chunks:
            c.eval()
        if self.sp:
            from megatron.core.transformer.utils import set_model_to_sequence_parallel
            set_model_to_sequence_parallel(self.gpt, False)
        return self

    def __exit__(self, *exc):
        if self.sp:
            from megatron.core.transformer.utils import set_model_to_sequence_parallel
            set_model_to_sequence_parallel(self.gpt, True)
        for m, mode in self.modes:
            m.training = mode
        return False
