"""The graph-safe decode step: fixed shapes, buffers written in place, no host read.

Every per-row buffer of a `DecodeState` and the KV cache exist before the first step; each
row's response index is a device tensor; sampling, stop detection, forced observation tokens
and log-probs are tensor ops; the attention writes each row's key at its slot and attends over
the whole cache under a mask. So a step can be captured once as a CUDA graph (`GraphedStep`) and
replayed, and the host reads the finished and held flags only at the engine's sync points,
where rows move into smaller buckets (`bucket_sizes`) and held rows' text is checked for stop
strings and tool calls. A `DecodeWorkspace` keeps all of it from one generate call to the next.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from megarl.rollout.sampling import SamplingParams, filter_logits, sample_tokens


def bucket_sizes(rows: int, smallest: int = 8) -> list[int]:
    """The row counts a decode batch of `rows` takes as its rows finish: `rows`, then the powers
    of two below it down to `smallest` (largest first)."""
    sizes = [rows]
    b = 1 << (rows - 1).bit_length() - 1 if rows > 1 else 0  # the largest power of two below rows
    while b >= smallest:
        if b < rows:
            sizes.append(b)
        b //= 2
    return sizes


def bucket_for(live: int, sizes: list[int]) -> int:
    """The smallest bucket that holds `live` rows."""
    return min(s for s in sizes if s >= live)


@dataclass
class DecodeState:
    """The decode step's inputs and outputs, one row per cache row ([B, ...] tensors on the
    model's device, written in place). Rows may be finished (`done`): they keep computing, with
    a padding token, and their outputs are not written. A row is `held` after a token that may
    end a stop string or close a tool call, until the host has looked at its text (at the next
    sync point): it keeps computing its next step without taking it. The host queues a tool's
    observation in `forced`, whose tokens then take the samples' place, one per step."""

    tokens: torch.Tensor     # [B, 1] long: the token each row feeds next
    positions: torch.Tensor  # [B, 1] long: the cache slot (= RoPE position) that token takes
    key_pad: torch.Tensor    # [B, S] bool: slots of left padding (never attended)
    mask: torch.Tensor       # [B, 1, 1, S] bool, True = masked: padding and slots after the token's
    uniforms: torch.Tensor   # [B, T] float64: row b's uniform at response index t
    out_ids: torch.Tensor    # [B, T] long
    out_lp: torch.Tensor     # [B, T] fp32
    resp_len: torch.Tensor   # [B] long
    done: torch.Tensor       # [B] bool
    stopped: torch.Tensor    # [B] bool: ended on a stop id
    observed: torch.Tensor   # [B, T] bool: the token at response index t is a forced one
    held: torch.Tensor       # [B] bool: waits for the host's check of its last token
    forced: torch.Tensor     # [B, T] long: the row's queued observation tokens
    forced_len: torch.Tensor  # [B] long: how many of them
    forced_pos: torch.Tensor  # [B] long: how many are fed
    rows: torch.Tensor       # [B] long (host): the batch row each cache row holds

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @classmethod
    def empty(cls, rows: int, seq: int, steps: int, device) -> "DecodeState":
        """Buffers for `rows` cache rows of `seq` slots and `steps` response tokens (filled by `load`)."""
        dev = torch.device(device)
        z = dict(device=dev)
        return cls(tokens=torch.zeros(rows, 1, dtype=torch.long, **z), positions=torch.zeros(rows, 1, dtype=torch.long, **z),
                   key_pad=torch.zeros(rows, seq, dtype=torch.bool, **z),
                   mask=torch.zeros(rows, 1, 1, seq, dtype=torch.bool, **z),
                   uniforms=torch.zeros(rows, steps, dtype=torch.float64, **z),
                   out_ids=torch.zeros(rows, steps, dtype=torch.long, **z),
                   out_lp=torch.zeros(rows, steps, dtype=torch.float32, **z),
                   resp_len=torch.zeros(rows, dtype=torch.long, **z), done=torch.zeros(rows, dtype=torch.bool, **z),
                   stopped=torch.zeros(rows, dtype=torch.bool, **z),
                   observed=torch.zeros(rows, steps, dtype=torch.bool, **z), held=torch.zeros(rows, dtype=torch.bool, **z),
                   forced=torch.zeros(rows, steps, dtype=torch.long, **z),
                   forced_len=torch.zeros(rows, dtype=torch.long, **z), forced_pos=torch.zeros(rows, dtype=torch.long, **z),
                   rows=torch.zeros(rows, dtype=torch.long))

    def load(self, src: "DecodeState", keep: torch.Tensor | None = None) -> "DecodeState":
        """Copy `src`'s cache rows `keep` [size] (ascending; None: all) into this state's own
        buffers, which keep their storage (a captured graph reads them there); returns self."""
        dev = None if keep is None else keep.to(self.tokens.device)
        for f in fields(self):
            v = getattr(src, f.name)
            if f.name == "rows":
                self.rows = v.clone() if keep is None else v.index_select(0, keep)
            elif dev is None:
                getattr(self, f.name).copy_(v)
            else:
                torch.index_select(v, 0, dev, out=getattr(self, f.name))
        return self

    def refresh_mask(self) -> None:
        """mask = padding | slots after each row's position, in place."""
        slots = torch.arange(self.key_pad.shape[1], device=self.key_pad.device)
        torch.logical_or(self.key_pad, slots[None, :] > self.positions, out=self.mask[:, 0, 0])


def decode_step(model, ctx, st: DecodeState, params: SamplingParams, *, vocab_size: int, pad_id: int,
                stop_mask: torch.Tensor, hold_mask: torch.Tensor | None = None) -> None:
    """One token for every row of `st`, in place, with no host read: the model's forward at the
    rows' slots (ctx.slots is st.positions' column), the draw (or the row's next forced token),
    the outputs at each row's response index, stop detection, holds, the next tokens and
    positions. stop_mask: [vocab_size] bool on the model's device, True at the stop ids;
    hold_mask: likewise at the tokens after which a row waits for the host (None: none).
    Masks, not torch.isin: looking ids up is a gather, where isin of more than a few ids sorts
    through torch.unique, whose output size the host must read (no graph could hold it)."""
    logits = model(st.tokens, st.positions, st.mask, inference_context=ctx, runtime_gather_output=True)
    x = logits[:, -1, :vocab_size]  # [B, V]: padded columns never sampled
    filtered = filter_logits(x, params)
    T = st.out_ids.shape[1]
    col = st.resp_len.clamp(max=T - 1)[:, None]  # [B, 1]: the response index this step's token takes
    uniforms = None if params.greedy else st.uniforms.gather(1, col).squeeze(1)
    ids, lps = sample_tokens(filtered, params, uniforms, with_logprobs=params.logprobs)
    live = ~st.done & ~st.held
    forced = st.forced_pos < st.forced_len
    ids = torch.where(forced, st.forced.gather(1, st.forced_pos.clamp(max=T - 1)[:, None]).squeeze(1), ids)
    st.forced_pos.add_(forced & live)
    _put(st.out_ids, col, ids, live)
    if lps is not None:
        _put(st.out_lp, col, torch.where(forced, 0.0, lps.float()), live)
    _put(st.observed, col, forced, live)
    st.resp_len.add_(live)
    hit = stop_mask[ids] & live & ~forced  # an observation never ends a row
    st.stopped.logical_or_(hit)
    st.done.logical_or_(hit | (st.resp_len >= T))
    if hold_mask is not None:
        st.held.logical_or_(hold_mask[ids] & live & ~forced & ~hit)
    st.tokens.copy_(torch.where(st.done, pad_id, torch.where(live, ids, st.tokens[:, 0]))[:, None])
    st.positions.add_(live[:, None])
    st.refresh_mask()


def _put(dst: torch.Tensor, col: torch.Tensor, value: torch.Tensor, live: torch.Tensor) -> None:
    """dst[b, col[b]] = value[b] where live[b]; other rows keep theirs."""
    dst.scatter_(1, col, torch.where(live, value, dst.gather(1, col).squeeze(1))[:, None])


class DecodeWorkspace:
    """The static decode's device memory, kept from one generate call to the next: the KV cache
    of every layer ([rows, g, S, d], allocated by the first prefill, replaced only when a call
    needs more rows or slots), one DecodeState per (bucket, call shape) and, on a GPU, its
    captured step. A graph reads the weights, the cache and its state where they were at capture,
    so it stays valid across RL steps while the optimizer updates the weights in place, and
    `release()` drops it all before the weights move (the actor's offload calls it)."""

    def __init__(self):
        self.cache: dict = {}   # layer number -> (k, v), whole allocations
        self.rows = self.seq = 0  # the cache's capacity
        self.states: dict = {}  # (rows, seq, steps) -> DecodeState
        self.graphs: dict = {}  # (rows, seq, steps, sampling) -> GraphedStep
        self.constants: dict = {}  # key -> device tensors a graph reads (stop and hold id masks, RoPE)
        self.pool = None
        self.graph_bytes = 0  # the allocator's growth over the captures (CUDA)

    def fits(self, rows: int, seq: int) -> bool:
        return bool(self.cache) and rows <= self.rows and seq <= self.seq

    def adopt(self, cache: dict, rows: int, seq: int) -> None:
        """Keep a prefill's freshly allocated cache ({layer: (k, v)} of `rows` x `seq`; release()
        the old one first)."""
        self.cache, self.rows, self.seq = dict(cache), rows, seq

    def rope(self, gpt, device) -> torch.Tensor | None:
        """The RoPE angles [seq, 1, 1, d] of the kept cache's slots, the workspace's own copy (the
        model's are an LRU-cached tensor a graph must not read: evicted, its memory is reused);
        None for a model without RoPE."""
        emb = getattr(gpt, "rotary_pos_emb", None)
        if emb is None:
            return None
        key = ("rope", self.seq)
        if key not in self.constants:
            self.constants[key] = emb.get_emb(self.seq).to(device)
        return self.constants[key]

    def views(self) -> dict:
        """The cache as a context's key_value_memory_dict: new views of the same memory."""
        return {layer: tuple(c[:] for c in kv) for layer, kv in self.cache.items()}

    def state(self, rows: int, steps: int, device) -> DecodeState:
        key = (rows, self.seq, steps)
        if key not in self.states:
            self.states[key] = DecodeState.empty(rows, self.seq, steps, device)
        return self.states[key]

    def id_mask(self, key, ids: tuple, vocab_size: int, device) -> torch.Tensor:
        """[vocab_size] bool on the device, True at `ids` (an id outside the vocabulary is never
        drawn, so it marks nothing): made once per key and kept (a graph reads it)."""
        if key not in self.constants:
            mask = torch.zeros(vocab_size, dtype=torch.bool)
            mask[[i for i in ids if 0 <= i < vocab_size]] = True
            self.constants[key] = mask.to(device)
        return self.constants[key]

    def graph(self, key, run) -> tuple["GraphedStep", int]:
        """The graph of `key`, captured now (running two warm-up steps) if it is new; -> (graph,
        steps run by the capture)."""
        if key in self.graphs:
            return self.graphs[key], 0
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        graph = self.graphs[key] = GraphedStep(run, self.pool)
        torch.cuda.synchronize()
        self.graph_bytes += max(0, torch.cuda.memory_allocated() - before)
        return graph, graph.warm_steps

    def nbytes(self) -> int:
        tensors = [c for kv in self.cache.values() for c in kv]
        tensors += [getattr(st, f.name) for st in self.states.values() for f in fields(st) if f.name != "rows"]
        return sum(t.numel() * t.element_size() for t in tensors) + self.graph_bytes

    def release(self) -> None:
        self.graphs.clear()
        self.states.clear()
        self.constants.clear()
        self.cache.clear()
        self.rows = self.seq = 0
        self.pool, self.graph_bytes = None, 0


class GraphedStep:
    """`decode_step` captured as a CUDA graph for one DecodeState's buffers (one bucket), replayed
    with the same tensors: the weights, the KV cache and the state are read where they were at
    capture, so they must stay in place (they do: the optimizer updates weights in place, the
    cache and the states live in a DecodeWorkspace). Captured after two eager warm-up steps on a
    side stream, as torch.cuda.graphs asks; those steps are real steps of the rollout."""

    def __init__(self, run, pool=None):
        """run(): one decode step on fixed tensors. Runs it twice (warm-up) and captures a third."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()
            run()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            run()
        self.warm_steps = 2  # steps already taken by the warm-up

    def replay(self) -> None:
        self.graph.replay()
