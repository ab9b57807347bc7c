"""Pieces every trainer shares: token log-probs from vocab-parallel logits, batch slicing."""
from __future__ import annotations

import torch

from megarl.models.gpt import mask_padded_vocab


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
