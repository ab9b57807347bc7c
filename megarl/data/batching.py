"""Fixed-shape micro-batches, a DP-invariant seeded sampler, and a resumable iterator.

Collation has two stages so that the DataLoader and DALI paths share the second one exactly:
  1. pad: each item's 1-D arrays are right-padded to seq_len  -> [b, s] numpy (or DALI fn.pad)
  2. finalize: labels, loss_mask, position_ids, attention_mask -> torch tensors

Batch for SFT (s = seq_len; loss at position t predicts token t + 1):
  tokens        int64 [b, s]   input ids, pad_id after the end
  labels        int64 [b, s]   labels[t] = tokens[t + 1] within a sequence, else pad_id
  loss_mask     float [b, s]   1 where labels[t] is an assistant token of the same sequence
  position_ids  int64 [b, s]   restart at 0 at each packed sequence (padding counts as one more)
  attention_mask None (padding mode: plain causal) or bool [b, 1, s, s] (packing: block-diagonal
                causal, megatron convention True = masked out; padding attends within itself)

Sampling: epoch e visits the permutation rng(seed, e) of all samples; global batch g is a slice
of it; DP rank r takes the r-th contiguous shard of each global batch, so the concatenation of the
shards in rank order is the same global batch for any DP size. The position is one number,
consumed_samples, so resuming (even with another DP size) continues the exact sequence.
"""
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader

from megarl.data.errors import DataError
from megarl.utils.processes import signals_blocked

_FILL_SUFFIXES = ("tokens", "target_mask", "segment_ids")


@dataclass(frozen=True)
class Collator:
    """Turns a list of dataset items into one fixed-shape batch (see module doc)."""

    kind: str          # "sft" or "preferences"
    seq_len: int
    pad_id: int
    packed: bool = False

    def fill_value(self, key: str) -> int:
        suffix = next(s for s in _FILL_SUFFIXES if key.endswith(s))
        return {"tokens": self.pad_id, "target_mask": 0, "segment_ids": -1}[suffix]

    def pad(self, items: list[dict]) -> dict[str, np.ndarray]:
        """Stage 1: right-pad every field to seq_len -> {key: [b, s]}."""
        out = {}
        for key in items[0]:
            arr = np.full((len(items), self.seq_len), self.fill_value(key), dtype=items[0][key].dtype)
            for i, item in enumerate(items):
                n = len(item[key])
                if n > self.seq_len:
                    raise DataError(f"sample of {n} tokens exceeds seq_len {self.seq_len}")
                arr[i, :n] = item[key]
            out[key] = arr
        return out

    def finalize(self, padded: dict) -> dict:
        """Stage 2: build the model inputs from padded [b, s] arrays or tensors."""
        t = {k: torch.as_tensor(v) for k, v in padded.items()}
        if self.kind == "sft":
            return sequence_batch(t["tokens"], t["target_mask"], t["segment_ids"], self.pad_id, self.packed)
        if self.kind == "preferences":
            out = {"attention_mask": None}
            for side in ("chosen", "rejected"):
                b = sequence_batch(t[f"{side}_tokens"], t[f"{side}_target_mask"], t[f"{side}_segment_ids"],
                                   self.pad_id, packed=False)
                out.update({f"{side}_{k}": v for k, v in b.items() if k != "attention_mask"})
                out[f"{side}_last"] = (t[f"{side}_segment_ids"] >= 0).sum(1) - 1  # [b] index of last token
            return out
        raise ValueError(f"unknown collator kind {self.kind!r}")

    def __call__(self, items: list[dict]) -> dict:
        return self.finalize(self.pad(items))


def sequence_batch(tokens, target_mask, segment_ids, pad_id: int, packed: bool) -> dict:
    """tokens, target_mask, segment_ids: [b, s] (segment -1 = padding) -> model inputs."""
    b, s = tokens.shape
    dev = tokens.device
    tokens = tokens.long()
    seg = segment_ids.long()
    same_next = (seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] >= 0)              # [b, s-1]
    labels = torch.full_like(tokens, pad_id)
    labels[:, :-1] = torch.where(same_next, tokens[:, 1:], torch.full_like(tokens[:, 1:], pad_id))
    loss_mask = torch.zeros(b, s, dtype=torch.float32, device=dev)
    loss_mask[:, :-1] = (same_next & (target_mask[:, 1:] > 0)).float()
    # Position within the segment: t minus the index where the segment started.
    idx = torch.arange(s, device=dev).expand(b, s)
    starts = torch.ones(b, s, dtype=torch.bool, device=dev)
    starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
    seg_start = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=1).values
    position_ids = idx - seg_start
    attention_mask = None
    if packed:
        same = seg[:, :, None] == seg[:, None, :]                                # [b, s, s]
        causal = idx[0][None, :] <= idx[0][:, None]                             # [s, s] key <= query
        attention_mask = ~(same & causal).unsqueeze(1)                           # [b, 1, s, s]
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids,
            "attention_mask": attention_mask}


def collate_prompts(items: list[dict]) -> dict:
    """RL prompts stay ragged: the generator pads them its own way."""
    return {"prompt_ids": [it["prompt_ids"] for it in items], "answers": [it["answer"] for it in items],
            "messages": [it["messages"] for it in items]}


def make_collator(dataset):
    """The collate function for a dataset from datasets.py (prompts stay ragged)."""
    if dataset.kind == "prompts":
        return collate_prompts
    return Collator(dataset.kind, dataset.seq_len, dataset.pad_id, dataset.packing)


# ---------------------------------------------------------------------------- sampling

def epoch_permutation(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The visiting order of epoch `epoch`; the one source of order for every data path."""
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


class GlobalBatchSampler:
    """This DP rank's micro-batches (lists of sample indices), endless over epochs.

    Each epoch uses num_samples // global_batch_size global batches; the tail of the permutation
    is dropped (a different tail each epoch). Usable as a DataLoader batch_sampler.
    """

    def __init__(self, num_samples: int, micro_batch_size: int, global_batch_size: int, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0, shuffle: bool = True, consumed_samples: int = 0):
        step = micro_batch_size * dp_size
        if global_batch_size % step:
            raise DataError(f"global_batch_size {global_batch_size} is not a multiple of "
                            f"micro_batch_size x dp_size = {step}")
        if num_samples < global_batch_size:
            raise DataError(f"dataset has {num_samples} samples, fewer than one global batch ({global_batch_size})")
        if consumed_samples % step:
            raise DataError(f"consumed_samples {consumed_samples} is not a multiple of micro_batch_size x "
                            f"dp_size = {step}; resume at a micro-batch boundary")
        assert 0 <= dp_rank < dp_size
        self.num_samples, self.micro_batch_size = num_samples, micro_batch_size
        self.global_batch_size = global_batch_size
        self.dp_rank, self.dp_size, self.seed, self.shuffle = dp_rank, dp_size, seed, shuffle
        self.consumed_samples = consumed_samples
        self.batches_per_epoch = num_samples // global_batch_size
        self.micro_per_rank = global_batch_size // step       # micro-batches per rank per global batch
        self._cached = (None, None)                           # (epoch, permutation)

    def _order(self, epoch: int) -> np.ndarray:
        if self._cached[0] != epoch:
            self._cached = (epoch, epoch_permutation(self.num_samples, self.seed, epoch, self.shuffle))
        return self._cached[1]

    def position(self, k: int) -> tuple[int, int, int]:
        """(epoch, global batch within epoch, micro-batch within this rank's shard) of micro-batch k."""
        t = self.consumed_samples // (self.micro_batch_size * self.dp_size) + k
        g, m = divmod(t, self.micro_per_rank)
        epoch, j = divmod(g, self.batches_per_epoch)
        return epoch, j, m

    def micro_batch(self, k: int) -> list[int]:
        """The k-th micro-batch this rank yields, counting from consumed_samples (random access)."""
        epoch, j, m = self.position(k)
        start = j * self.global_batch_size + self.dp_rank * (self.global_batch_size // self.dp_size) \
            + m * self.micro_batch_size
        return self._order(epoch)[start:start + self.micro_batch_size].tolist()

    def __iter__(self):
        k = 0
        while True:
            yield self.micro_batch(k)
            k += 1


class ResumableIterator:
    """Shared by the DataLoader and DALI iterators: the position is consumed_samples (global)."""

    def _start(self, consumed_samples: int) -> None:
        raise NotImplementedError

    def _sampler(self, num_samples: int, consumed_samples: int) -> GlobalBatchSampler:
        self.sampler = GlobalBatchSampler(num_samples, consumed_samples=consumed_samples, **self.args)
        self.consumed_samples = consumed_samples
        return self.sampler

    def _advance(self) -> None:
        self.consumed_samples += self.args["micro_batch_size"] * self.args["dp_size"]

    @property
    def epoch(self) -> int:
        return self.consumed_samples // (self.sampler.batches_per_epoch * self.sampler.global_batch_size)

    def __iter__(self):
        return self

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "seed": self.args["seed"]}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seed", self.args["seed"]) != self.args["seed"]:
            raise DataError(f"data iterator state was saved with seed {state['seed']}, "
                            f"this run uses seed {self.args['seed']}")
        self._start(int(state["consumed_samples"]))


class DataIterator(ResumableIterator):
    """Endless micro-batches for one DP rank through a torch DataLoader, resumable exactly.

    consumed_samples counts global samples (all DP ranks) handed to the trainer, not prefetched
    ones; save state_dict() with a checkpoint and pass it back (or consumed_samples) to resume.
    """

    def __init__(self, dataset, micro_batch_size: int, global_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 seed: int = 0, shuffle: bool = True, consumed_samples: int = 0, num_workers: int = 0,
                 pin_memory: bool = False, collate_fn=None):
        self.dataset = dataset
        self.collate_fn = collate_fn or make_collator(dataset)
        self.args = dict(micro_batch_size=micro_batch_size, global_batch_size=global_batch_size,
                         dp_rank=dp_rank, dp_size=dp_size, seed=seed, shuffle=shuffle)
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self._start(consumed_samples)

    def _start(self, consumed_samples: int) -> None:
        sampler = self._sampler(len(self.dataset), consumed_samples)
        loader = DataLoader(self.dataset, batch_sampler=sampler, collate_fn=self.collate_fn,
                            num_workers=self.num_workers, pin_memory=self.pin_memory)
        with signals_blocked():  # its worker processes start here: the job's SIGTERM is the trainer's
            self._it = iter(loader)

    def __next__(self) -> dict:
        batch = next(self._it)
        self._advance()
        return batch
