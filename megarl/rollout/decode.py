"""The graph-safe decode step: fixed shapes, buffers written in place, no host read.

Every per-row buffer of a `DecodeState` and the KV cache exist before the first step; the step
index is a device tensor; sampling, stop detection and log-probs are tensor ops; the attention
writes each row's key at its slot and attends over the whole cache under a mask. So a step can
be captured once as a CUDA graph (`GraphedStep`) and replayed, and the host reads the finished
flags only at the engine's sync points, where rows move into smaller buckets (`bucket_sizes`).
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
    a padding token, and their outputs are not written."""

    tokens: torch.Tensor     # [B, 1] long: the token each row feeds next
    positions: torch.Tensor  # [B, 1] long: the cache slot (= RoPE position) that token takes
    key_pad: torch.Tensor    # [B, S] bool: slots of left padding (never attended)
    mask: torch.Tensor       # [B, 1, 1, S] bool, True = masked: padding and slots after the token's
    step: torch.Tensor       # [1] long: the response index the next token gets
    uniforms: torch.Tensor   # [B, T] float64: row b's uniform at response index t
    out_ids: torch.Tensor    # [B, T] long
    out_lp: torch.Tensor     # [B, T] fp32
    resp_len: torch.Tensor   # [B] long
    done: torch.Tensor       # [B] bool
    stopped: torch.Tensor    # [B] bool: ended on a stop id
    rows: torch.Tensor       # [B] long (host): the batch row each cache row holds

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    def take(self, keep: torch.Tensor) -> "DecodeState":
        """The state of cache rows `keep` [B'] (ascending), as new tensors (the caller moves the
        KV cache's rows alike)."""
        dev = keep.to(self.tokens.device)
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = v if f.name == "step" else v.index_select(0, keep if f.name == "rows" else dev)
        return DecodeState(**out)

    def refresh_mask(self) -> None:
        """mask = padding | slots after each row's position, in place."""
        slots = torch.arange(self.key_pad.shape[1], device=self.key_pad.device)
        torch.logical_or(self.key_pad, slots[None, :] > self.positions, out=self.mask[:, 0, 0])


def decode_step(model, ctx, st: DecodeState, params: SamplingParams, *, vocab_size: int, pad_id: int,
                stop_ids: torch.Tensor) -> None:
    """One token for every row of `st`, in place, with no host read: the model's forward at the
    rows' slots (ctx.slots is st.positions' column), the draw, the outputs at index st.step, stop
    detection, the next tokens and positions. stop_ids: [K] long on the model's device."""
    logits = model(st.tokens, st.positions, st.mask, inference_context=ctx, runtime_gather_output=True)
    x = logits[:, -1, :vocab_size]  # [B, V]: padded columns never sampled
    filtered = filter_logits(x, params)
    col = st.step.expand(st.size, 1)  # [B, 1]
    uniforms = None if params.greedy else st.uniforms.gather(1, col).squeeze(1)
    ids, lps = sample_tokens(filtered, params, uniforms, with_logprobs=params.logprobs)
    live = ~st.done
    st.out_ids.scatter_(1, col, torch.where(live, ids, pad_id)[:, None])
    if lps is not None:
        st.out_lp.scatter_(1, col, torch.where(live, lps.float(), 0.0)[:, None])
    st.resp_len.add_(live)
    hit = torch.isin(ids, stop_ids) & live
    st.stopped.logical_or_(hit)
    st.done.logical_or_(hit)
    st.tokens.copy_(torch.where(st.done, pad_id, ids)[:, None])
    st.positions.add_(1)
    st.step.add_(1)
    st.refresh_mask()


class GraphedStep:
    """`decode_step` captured as a CUDA graph for one DecodeState's buffers (one bucket), replayed
    with the same tensors: the weights, the KV cache and the state are read where they were at
    capture, so they must stay in place (they do: the optimizer updates weights in place, the
    cache and the state live for the generate call). Captured after two eager warm-up steps on a
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
