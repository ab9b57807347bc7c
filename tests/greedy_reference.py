"""Greedy decoding through a Role's pipeline without a KV cache: the reference the rollout
engine's tests compare against.

Every new token re-runs the whole (short) sequence, which is simple and exact at any TP/PP
layout; megarl's rollout engine (batched, KV-cached, sampled) must produce the same tokens.
"""
from __future__ import annotations

import torch

from megarl.models.gpt import mask_padded_vocab, vocab_parallel_argmax


@torch.no_grad()
def greedy_generate(role, prompts: list[list[int]], *, max_new_tokens: int, stop_ids, pad_id: int,
                    vocab_size: int) -> list[list[int]]:
    """Continue each prompt greedily until a stop id (end of turn, eos) or max_new_tokens;
    returns the new tokens only, the stop token included.

    Every rank passes the same prompts and gets the same completions (the last pipeline stage
    decides each token; forward_collect broadcasts it).
    """
    n = len(prompts)
    width = max(len(p) for p in prompts) + max_new_tokens
    tokens = torch.full((n, width), pad_id, dtype=torch.long)  # [n, L] right-padded
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p, dtype=torch.long)
    lengths = torch.tensor([len(p) for p in prompts])  # [n] next write position
    done = torch.zeros(n, dtype=torch.bool)
    positions = torch.arange(width).expand(n, width)
    rows = torch.arange(n)
    stop = torch.tensor(list(stop_ids), dtype=torch.long)

    def next_token(batch, logits):  # logits [n, L, V/tp] on the last stage
        last = logits[rows, lengths - 1]  # [n, V/tp]
        return vocab_parallel_argmax(mask_padded_vocab(last.float(), vocab_size)).cpu()

    for _ in range(max_new_tokens):
        (new,) = role.forward_collect([{"tokens": tokens, "position_ids": positions, "attention_mask": None}], next_token)
        live = ~done
        tokens[rows[live], lengths[live]] = new[live]
        lengths = lengths + live.long()
        done |= live & torch.isin(new, stop)
        if bool(done.all()):
            break
    return [tokens[i, len(p): lengths[i]].tolist() for i, p in enumerate(prompts)]
