"""The micro-batch a Role runs: what the model reads, and the per-token data its loss reads.

Two layouts, one type. Padded: `tokens` [b, s], and per-token data [b, s - output_from] from the
head's first column. Packed (RL's `rl.packing`): b rows concatenated into one [1, T] sequence
(`packed_seq_params`), the head run on the rows' response columns only (`output_index`, [T']),
and the per-token data kept per row, [b, W]; `unpack` maps the head's [1, T'] columns to their
(row, column) there. Consumers never ask which: `head_layout` turns per-row data into the head's
layout and `per_row` the head's output into the data's, each the identity for a padded batch.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

# keys of a dict micro-batch that the model reads; every other key is data for the loss
MODEL_KEYS = ("tokens", "position_ids", "attention_mask", "output_from", "output_index", "return_hidden",
              "packed_seq_params", "unpack")


@dataclass
class MicroBatch:
    tokens: torch.Tensor                   # [b, s] (packed: [1, T])
    position_ids: torch.Tensor             # like tokens
    data: dict = field(default_factory=dict)  # name -> tensor the loss reads (labels, mask, old_logp, ...)
    attention_mask: torch.Tensor | None = None  # [b, 1, s, s] bool (True = masked), or None: causal
    output_from: int = 0                   # the head runs on columns output_from: only
    output_index: torch.Tensor | None = None  # packed: [T'] the columns the head runs on
    return_hidden: bool = False            # an LM head returns models.gpt.HeadStates, not logits
    packed_seq_params: object = None       # packed: megatron's PackedSeqParams of the rows
    unpack: tuple | None = None            # packed: (row [T'], column [T']) of each head column in data

    @classmethod
    def of(cls, mb) -> "MicroBatch":
        """A MicroBatch as it is, or from a dict of MODEL_KEYS and data keys."""
        if isinstance(mb, MicroBatch):
            return mb
        given = {k: v for k, v in mb.items() if k in MODEL_KEYS and v is not None}
        return cls(**given, data={k: v for k, v in mb.items() if k not in MODEL_KEYS})

    # the loss reads its data as from a dict
    def __getitem__(self, name: str) -> torch.Tensor:
        return self.data[name]

    def __contains__(self, name: str) -> bool:
        return name in self.data

    def get(self, name: str, default=None):
        return self.data.get(name, default)

    @property
    def shape(self) -> tuple:
        return tuple(self.tokens.shape)

    def model_kwargs(self) -> dict:
        """The keyword arguments of the model call beyond (tokens, position_ids, attention_mask)."""
        kw = {"output_from": self.output_from} if self.output_from else {}
        if self.return_hidden:
            kw["return_hidden"] = True
        if self.output_index is not None:
            kw["output_index"] = self.output_index
        if self.packed_seq_params is not None:
            kw["packed_seq_params"] = self.packed_seq_params
        return kw

    def head_layout(self, v: torch.Tensor) -> torch.Tensor:
        """Per-row data [b, W] in the head's layout ([1, T'] packed; as it is padded)."""
        return v if self.unpack is None else v[self.unpack][None]

    def per_row(self, x: torch.Tensor) -> torch.Tensor:
        """A per-token output of the head in the data's layout ([1, T'] -> [b, W] packed, with 0
        in columns the head did not run; as it is padded)."""
        if self.unpack is None:
            return x
        out = x.new_zeros(self.data["mask"].shape)
        out[self.unpack] = x[0]
        return out

    def to(self, device: torch.device) -> "MicroBatch":
        """This micro-batch with its tensors (a PackedSeqParams' included) on `device`; a tensor
        already there is not copied."""
        def move(v):
            if isinstance(v, torch.Tensor):
                return v.to(device, non_blocking=True)
            if dataclasses.is_dataclass(v) and not isinstance(v, type):
                return dataclasses.replace(v, **{f.name: move(getattr(v, f.name)) for f in dataclasses.fields(v)
                                                 if isinstance(getattr(v, f.name), torch.Tensor)})
            return v

        return dataclasses.replace(
            self, tokens=move(self.tokens), position_ids=move(self.position_ids),
            attention_mask=move(self.attention_mask), output_index=move(self.output_index),
            packed_seq_params=move(self.packed_seq_params), data={k: move(v) for k, v in self.data.items()})
