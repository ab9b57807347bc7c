"""Reward-model training: a scalar-head model read at the last token (or averaged over the
response, reward_model.pooling=mean), Bradley-Terry loss.

    megarl rm --config configs/tiny_rm.yaml [key=value ...]

Starts from the SFT checkpoint by default (reward_model.init_from: sft), outputs
<run_dir>/reward_model/{config.yaml, metrics.jsonl, checkpoints/}.
"""
from __future__ import annotations

import logging
import os

import torch

from megarl.algorithms.losses import bradley_terry, sequence_reward
from megarl.checkpoint.distributed import MANIFEST, load_weights, resolve_checkpoint
from megarl.config import Config, ConfigError
from megarl.roles.role import Role
from megarl.trainers import data_setup, weights
from megarl.trainers.common import SupervisedStage
from megarl.trainers.loop import train_stage

log = logging.getLogger("megarl")

STAGE = "reward_model"


def pair_batch(b: dict) -> dict:
    """Chosen and rejected side by side in one micro-batch: rows [0, n) chosen, [n, 2n) rejected."""
    return {"tokens": torch.cat([b["chosen_tokens"], b["rejected_tokens"]]),
            "position_ids": torch.cat([b["chosen_position_ids"], b["rejected_position_ids"]]),
            "attention_mask": None,
            "last": torch.cat([b["chosen_last"], b["rejected_last"]]),
            # first response token: the column after the first one whose label is a response token
            "first": torch.cat([b["chosen_loss_mask"], b["rejected_loss_mask"]]).argmax(1) + 1}


class PairIterator:
    """Maps a preference iterator to pair batches; checkpoint state passes through."""

    def __init__(self, it):
        self.it = it

    def __iter__(self):
        return self

    def __next__(self):
        return pair_batch(next(self.it))

    def state_dict(self):
        return self.it.state_dict()

    def load_state_dict(self, state):
        self.it.load_state_dict(state)


def rm_loss(margin: float, center_coef: float, pooling: str = "last"):
    def loss_fn(batch, values):  # values [2n, s, 1]
        v = values.squeeze(-1)
        r = sequence_reward(v, batch.get("first"), batch["last"], pooling)  # [2n] one reward per sequence
        chosen, rejected = r.chunk(2)
        loss_sum, count, metrics = bradley_terry(chosen, rejected, margin, center_coef)
        metrics["pair_accuracy"] = metrics.pop("accuracy")  # SFT's is per token: one name, one meaning
        return loss_sum, count, metrics

    return loss_fn


def sft_source(cfg: Config) -> str | None:
    src = cfg.reward_model.init_from
    if not src:
        return None
    root = os.path.join(os.path.abspath(cfg.train.run_dir), "sft", "checkpoints") if src == "sft" else src
    path = resolve_checkpoint(root)
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    hint = "run `megarl sft` with the same train.run_dir first, or set reward_model.init_from=null" if src == "sft" else "expected a checkpoint directory"
    raise ConfigError(f"reward_model.init_from={src}: no checkpoint at {root}; {hint}")


def build_stage(cfg: Config, stage_dir: str) -> SupervisedStage:
    r = cfg.reward_model
    if cfg.model.lora is not None:
        raise ConfigError("model.lora adapts the policy (sft, rl's actor); the reward model trains dense: "
                          "unset model.lora for `megarl rm` (reward_model.freeze_backbone trains the head alone)")
    tok = data_setup.tokenizer(cfg)
    paths = data_setup.stage_paths(cfg, STAGE)
    role = Role(STAGE, cfg.model, cfg.parallel, head="scalar", precision=cfg.train.precision, fp8=cfg.train.fp8,
                seed=cfg.train.seed, optim=cfg.optim, schedule=cfg.lr_schedule, train_steps=cfg.train.steps,
                train_only_head=r.freeze_backbone)
    src = sft_source(cfg)
    if src is not None:
        load_weights(src, role, skip_head=True)
        log.info("reward model backbone initialised from %s", src)
    elif cfg.model.init_from:  # an HF directory or any megarl checkpoint, LM head left out
        weights.init_weights(cfg, role, skip_head=True)
        log.info("reward model backbone initialised from %s", cfg.model.init_from)
    train = PairIterator(data_setup.train_iterator(cfg, paths["train"], "preferences", tok, stage_dir))
    eval_ds = data_setup.dataset(cfg, paths["eval"], "preferences", tok) if paths["eval"] else None
    role.reward_pooling = r.pooling  # saved in the checkpoint's manifest: RL reads it the same way
    loss = rm_loss(r.margin, r.center_coef, r.pooling)

    def evaluate():
        mbs = [pair_batch(b) for b in data_setup.eval_microbatches(cfg, eval_ds)]
        return role.evaluate(mbs, loss), []

    # a pair is two sequences: tokens/s counts both sides
    return SupervisedStage(STAGE, role, lambda step: loss, train, global_batch_size=cfg.data.global_batch_size,
                           micro_batch_size=cfg.data.micro_batch_size, tokens_per_sample=2 * cfg.data.seq_length,
                           evaluate=evaluate if eval_ds is not None else None)


def main(cfg: Config) -> dict:
    return train_stage(cfg, STAGE, build_stage)
