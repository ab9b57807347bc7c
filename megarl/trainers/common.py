"""Pieces every trainer shares: token log-probs from vocab-parallel logits, micro-batch planning."""
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
        microbatches = self.prepare([next(self.train_data) for _ in range(self.n_micro)])
        result = self.role.train_step(microbatches, self.loss_for_step(step))
        metrics = {f"train/{k}": v for k, v in result.metrics.items()}
        metrics.update({"train/lr": result.lr, "train/grad_norm": result.grad_norm})
        if result.skipped:
            metrics["train/skipped_steps"] = 1
        metrics["perf/tokens_per_s"] = self.tokens_per_step / (time.perf_counter() - start)
        return metrics

    def prepare(self, microbatches: list) -> list:
        """The step's micro-batches as the role runs them (DPO adds the reference's log-probs)."""
        return microbatches

    def evaluate(self, step: int):
        return self._evaluate()

    def state_dict(self) -> dict:
        return {"data": self.train_data.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.train_data.load_state_dict(state["data"])


def plan_microbatches(lengths: list[int], *, max_rows: int, max_tokens: int | None = None) -> list[list[int]]:
    """Group rows (by index) into micro-batches, each later cut to its own longest row.

    Rows are sorted longest first and grouped greedily while rows x longest <= max_tokens (verl's
    use_dynamic_bsz) and rows <= max_rows. Without max_tokens: fixed micro-batches of max_rows
    rows in the given order. Which rows share a micro-batch changes no result: losses are sums
    over units divided by the global count (the Role contract).
    """
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    order = list(range(len(lengths)))
    if max_tokens is None:
        return [order[i:i + max_rows] for i in range(0, len(order), max_rows)]
    if max_tokens < max(lengths, default=0):
        raise ValueError(f"max_tokens_per_micro_batch ({max_tokens}) is below the longest sequence "
                         f"({max(lengths)} tokens)")
    order.sort(key=lambda i: -lengths[i])
    groups, current = [], []
    for i in order:
        if current and ((len(current) + 1) * lengths[current[0]] > max_tokens or len(current) == max_rows):
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


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
