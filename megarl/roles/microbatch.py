"""The micro-batch a Role runs: what the model reads, and the per-token data its loss reads.

`tokens` [b, s] right-padded rows; the head runs on columns `output_from:` only (RL reads no
prompt logits), so per-token data is [b, s - output_from], aligned with the head's output.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

# keys of a dict micro-batch that the model reads; every other key is data for the loss
MODEL_KEYS = ("tokens", "position_ids", "attention_mask", "output_from", "return_hidden", "routing")


@dataclass
class MicroBatch:
    tokens: torch.Tensor                   # [b, s] long
    position_ids: torch.Tensor             # [b, s] long
    data: dict = field(default_factory=dict)  # name -> tensor the loss reads (labels, mask, old_logp, ...)
    attention_mask: torch.Tensor | None = None  # [b, 1, s, s] bool (True = masked), or None: causal
    output_from: int = 0                   # the head runs on columns output_from: only
    return_hidden: bool = False            # an LM head returns models.gpt.HeadStates, not logits
    routing: torch.Tensor | None = None    # [b, s, layers, k] MoE experts to replay (-1: the router's own)

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
        if self.routing is not None:
            kw["routing"] = self.routing
        return kw

    def to(self, device: torch.device) -> "MicroBatch":
        """This micro-batch with its tensors on `device`; a tensor already there is not copied."""
        def move(v):
            return v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v

        return dataclasses.replace(self, tokens=move(self.tokens), position_ids=move(self.position_ids),
                                   attention_mask=move(self.attention_mask), routing=move(self.routing),
                                   data={k: move(v) for k, v in self.data.items()})
