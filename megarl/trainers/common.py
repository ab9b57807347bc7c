"""Pieces every trainer shares: token log-probs from vocab-parallel logits, batch slicing."""
from __future__ import annotations

import torch

from megarl.models.gpt import mask_padded_vocab
from megarl.trainers.loop import Stage


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """log p(labels) [b, s] (fp32) from this TP rank's logits shard [b, s, V_pad/tp].

    The fused op reads the logits in their own dtype, row-chunked: no fp32 copy of [b, s, V].
    """
    from megatron.core import parallel_state as ps

    from megarl.ops import logprobs_and_entropy

    logits = mask_padded_vocab(logits, vocab_size)
    logprobs, _ = logprobs_and_entropy(logits, labels, tp_group=ps.get_tensor_model_parallel_group(),
                                       with_entropy=False)
    return logprobs


def dp_microbatches(global_batch: dict, micro_batch_size: int) -> list[dict]:
    """This DP rank's share of a global batch (rows in rank order), cut into microbatches.

    Every tensor in `global_batch` has the global batch as dim 0; None values pass through.
    """
    from megatron.core import parallel_state as ps

    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    n = next(v.shape[0] for v in global_batch.values() if isinstance(v, torch.Tensor))
    per_rank = n // dp
    lo = rank * per_rank
    out = []
    for start in range(lo, lo + per_rank, micro_batch_size):
        out.append({k: (v[start:start + micro_batch_size] if isinstance(v, torch.Tensor) else v)
                    for k, v in global_batch.items()})
    return out


class SupervisedStage(Stage):
    """A stage whose loop step is one optimizer step of one role over one global batch (SFT,
    reward model). `loss_for_step(step)` gives that step's loss closure, so a stage can compute
    costly metrics (SFT's token accuracy) only on the steps that log them."""

    def __init__(self, name: str, role, loss_for_step, train_data, *, global_batch_size: int,
                 micro_batch_size: int, tokens_per_sample: int, evaluate=None):
        from megatron.core import parallel_state as ps

        self.name, self.role, self.loss_for_step, self.train_data = name, role, loss_for_step, train_data
        self.roles = {name: role}
        self.n_micro = global_batch_size // (micro_batch_size * ps.get_data_parallel_world_size())
        self.tokens_per_step = global_batch_size * tokens_per_sample
        self._evaluate = evaluate
        self.has_evaluation = evaluate is not None

    def step(self, step: int) -> dict:
        import time

        start = time.perf_counter()
        microbatches = [next(self.train_data) for _ in range(self.n_micro)]
        result = self.role.train_step(microbatches, self.loss_for_step(step))
        metrics = {f"train/{k}": v for k, v in result.metrics.items()}
        metrics.update({"train/lr": result.lr, "train/grad_norm": result.grad_norm})
        if result.skipped:
            metrics["train/skipped_steps"] = 1
        metrics["perf/tokens_per_s"] = self.tokens_per_step / (time.perf_counter() - start)
        return metrics

    def evaluate(self, step: int):
        return self._evaluate()

    def state_dict(self) -> dict:
        return {"data": self.train_data.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.train_data.load_state_dict(state["data"])


def plan_microbatches(lengths: list[int], *, max_rows: int, max_tokens: int | None = None,
                      packed: bool = False, prompts: list[tuple] | None = None) -> list[list[int]]:
    """Group rows (by index) into micro-batches, each later cut to its own longest row, or packed
    into one sequence (packed: its cost is the sum of the lengths, not rows x longest).

    Rows are sorted longest first and packed greedily while the cost <= max_tokens (padded: verl's
    use_dynamic_bsz) and rows <= max_rows. Without max_tokens: fixed micro-batches of max_rows
    rows in the given order. Which rows share a micro-batch changes no result: losses are sums
    over units divided by the global count (the Role contract).

    prompts (packed rows whose samples share their prompt, Experience.packed_microbatch): per row,
    (prompt id, prompt length). With max_tokens, the rows of a prompt then stay together (split
    only where they exceed max_tokens or max_rows on their own) and cost the prompt once.
    """
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    order = list(range(len(lengths)))
    if max_tokens is None:
        return [order[i:i + max_rows] for i in range(0, len(order), max_rows)]
    if max_tokens < max(lengths, default=0):
        raise ValueError(f"max_tokens_per_micro_batch ({max_tokens}) is below the longest sequence "
                         f"({max(lengths)} tokens)")
    units = [([i], lengths[i]) for i in order]  # (rows, packed cost)
    if packed and prompts is not None:
        units = _prompt_units(lengths, prompts, max_rows, max_tokens)
    units.sort(key=lambda u: -u[1])
    groups, current, total = [], [], 0
    for rows, tokens in units:
        cost = total + tokens if packed else (len(current) + 1) * lengths[current[0] if current else rows[0]]
        if current and (cost > max_tokens or len(current) + len(rows) > max_rows):
            groups.append(current)
            current, total = [], 0
        current.extend(rows)
        total += tokens
    if current:
        groups.append(current)
    return groups


def _prompt_units(lengths: list[int], prompts: list[tuple], max_rows: int, max_tokens: int) -> list[tuple]:
    """The rows of each prompt (in order of first appearance) as packing units of (rows, prompt +
    their responses' tokens), each within max_rows and max_tokens."""
    by_prompt: dict = {}
    for i, (pid, _) in enumerate(prompts):
        by_prompt.setdefault(pid, []).append(i)
    units = []
    for rows in by_prompt.values():
        p = prompts[rows[0]][1]
        unit, tokens = [], 0
        for i in rows:
            extra = lengths[i] - p if unit else lengths[i]
            if unit and (tokens + extra > max_tokens or len(unit) == max_rows):
                units.append((unit, tokens))
                unit, tokens, extra = [], 0, lengths[i]
            unit.append(i)
            tokens += extra
        units.append((unit, tokens))
    return units


def padding_waste(lengths: list[int], groups: list[list[int]]) -> float:
    """Fraction of the computed tokens that are padding when each group is cut to its longest row."""
    computed = sum(len(g) * max(lengths[i] for i in g) for g in groups)
    return 1.0 - sum(lengths) / computed if computed else 0.0


def mix_seed(*values: int) -> int:
    """A 62-bit seed from integers (splitmix-style), the same on every rank: e.g. the rollout
    seed of (train.seed, step), so that every step samples afresh yet reproducibly."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (int(v) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & ((1 << 62) - 1)
