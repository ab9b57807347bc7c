"""Direct preference optimisation: the policy learns the preference pairs against a frozen reference.

    megarl dpo --config configs/tiny_dpo.yaml [key=value ...]

Reads the preference JSONL the reward model reads (chosen / rejected; by default the synthetic
task's pairs). The policy is the actor role (roles.actor.init_from, default: this run dir's SFT
checkpoint) and the reference comes from `weights.build_reference` (the reference role, default:
where the actor starts); `dpo.loss=simpo` has none. One loop step is one optimizer step over a
global batch of pairs:
  1. the reference's summed response log-probs of every pair, once per batch (forward only);
  2. the policy's, chosen and rejected rows side by side in each micro-batch, and `dpo.loss` on
     the per-pair sums (algorithms/preference.py).
Log-probs come from the fused head op (ops.head_logprobs), so no [tokens, V] logits exist.
Outputs <run_dir>/dpo/{config.yaml, metrics.jsonl, checkpoints/}; the checkpoint's role is the
actor's, so `megarl eval --checkpoint <run_dir>/dpo/checkpoints` and RL's roles.actor.init_from
read it.
"""
from __future__ import annotations

import dataclasses

import torch

from megarl import algorithms as A
from megarl.config import Config
from megarl.config.schema import DPOConfig
from megarl.ops import IGNORE_INDEX, head_logprobs
from megarl.roles.microbatch import MicroBatch
from megarl.runtime.distributed import is_rank0
from megarl.trainers import data_setup, weights
from megarl.trainers.common import SupervisedStage
from megarl.trainers.loop import train_stage

STAGE = "dpo"


def pair_microbatch(b: dict) -> MicroBatch:
    """A preference micro-batch as the policy runs it: chosen rows [0, n), rejected rows [n, 2n),
    cut to the longest row; the head runs from the first column that predicts a response token
    (no prompt logits) and returns hidden states for the fused head."""
    tokens = torch.cat([b["chosen_tokens"], b["rejected_tokens"]])
    mask = torch.cat([b["chosen_loss_mask"], b["rejected_loss_mask"]]) > 0
    width = int(torch.cat([b["chosen_last"], b["rejected_last"]]).max()) + 1
    start = int(mask.float().argmax(1).min())
    labels = torch.cat([b["chosen_labels"], b["rejected_labels"]]).masked_fill(~mask, IGNORE_INDEX)
    positions = torch.cat([b["chosen_position_ids"], b["rejected_position_ids"]])
    return MicroBatch(tokens[:, :width], positions[:, :width],
                      {"labels": labels[:, start:width], "mask": mask[:, start:width]},
                      output_from=start, return_hidden=True)


def sequence_logps(batch, head) -> torch.Tensor:
    """[2n] summed log-probs of each row's response tokens."""
    logp, _ = head_logprobs(head, batch["labels"])
    return (logp * batch["mask"]).sum(1)


def with_reference(reference, mbs: list[MicroBatch]) -> list[MicroBatch]:
    """The micro-batches with the reference's summed log-probs per row ("ref_logp" [2n]), from
    one forward-only pass over all of them (None: a reference-free loss, unchanged)."""
    if reference is None:
        return mbs
    refs = reference.forward_collect(mbs, lambda b, head: sequence_logps(b, head).float().cpu())
    return [dataclasses.replace(mb, data={**mb.data, "ref_logp": r}) for mb, r in zip(mbs, refs)]


def dpo_loss(d: DPOConfig):
    """Loss closure for the Role contract: the preference loss over the micro-batch's pairs."""

    def loss_fn(batch, head):
        logp = sequence_logps(batch, head)
        lengths = batch["mask"].sum(1)
        n = logp.shape[0] // 2
        ref = batch.get("ref_logp")
        return A.preference_loss(d.loss, logp[:n], logp[n:], None if ref is None else ref[:n],
                                 None if ref is None else ref[n:], lengths[:n], lengths[n:], beta=d.beta,
                                 label_smoothing=d.label_smoothing, gamma=d.simpo_gamma)

    return loss_fn


class DPOStage(SupervisedStage):
    """SupervisedStage with the reference's log-probs added to each step's micro-batches."""

    def __init__(self, cfg: Config, stage_dir: str):
        tok = data_setup.tokenizer(cfg)
        paths = data_setup.stage_paths(cfg, STAGE)
        self.policy = weights.build_role(cfg, "actor", trained=True, train_steps=cfg.train.steps)
        self.reference = None
        if "reference" in weights.dpo_roles(cfg):
            self.reference = weights.build_reference(cfg, self.policy)
            if isinstance(self.reference, weights.AdaptersOff) and is_rank0():
                print("dpo: the reference is the actor with its LoRA adapters off (no second model)", flush=True)
        train = data_setup.train_iterator(cfg, paths["train"], "preferences", tok, stage_dir)
        self.eval_ds = data_setup.dataset(cfg, paths["eval"], "preferences", tok) if paths["eval"] else None
        self.loss = dpo_loss(cfg.dpo)
        self.cfg, self._eval_mbs = cfg, None
        d = cfg.data
        super().__init__(STAGE, self.policy, lambda step: self.loss, train, global_batch_size=d.global_batch_size,
                         micro_batch_size=d.micro_batch_size, tokens_per_sample=2 * d.seq_length,
                         evaluate=self._held_out if self.eval_ds is not None else None)
        self.roles = {"actor": self.policy}  # checkpointed under the actor's name (see the module docstring)

    # step 0 too: the model DPO starts from (its likelihood accuracy on the held-out pairs)
    evaluate_first = True

    def prepare(self, batches: list[dict]) -> list[MicroBatch]:
        return with_reference(self.reference, [pair_microbatch(b) for b in batches])

    def _held_out(self):
        if self._eval_mbs is None:  # the same pairs at every evaluation: the reference's pass once
            self._eval_mbs = self.prepare(data_setup.eval_microbatches(self.cfg, self.eval_ds))
        return self.policy.evaluate(self._eval_mbs, self.loss), []


def build_stage(cfg: Config, stage_dir: str) -> DPOStage:
    return DPOStage(cfg, stage_dir)


def main(cfg: Config) -> dict:
    return train_stage(cfg, STAGE, build_stage)
