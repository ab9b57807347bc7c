"""Supervised fine-tuning: masked next-token cross entropy on assistant tokens.

    megarl sft --config configs/tiny_sft.yaml [key=value ...]

Outputs <run_dir>/sft/{config.yaml, metrics.jsonl, checkpoints/} for the reward-model and RL
stages to start from.
"""
from __future__ import annotations

import torch

from megarl.algorithms.losses import masked_nll
from megarl.config import Config
from megarl.models.gpt import vocab_parallel_argmax
from megarl.roles.role import Role
from megarl.rollout.greedy import greedy_generate
from megarl.trainers import data_setup
from megarl.trainers.common import token_logprobs
from megarl.trainers.loop import Stage, train_stage

STAGE = "sft"


def sft_loss(vocab_size: int, with_exact_match: bool = False):
    """Loss closure for the Role contract; token accuracy always, sequence exact-match in eval."""

    def loss_fn(batch, logits):  # logits [b, s, V_pad/tp]
        labels, mask = batch["labels"], batch["loss_mask"]
        loss_sum, count, metrics = masked_nll(token_logprobs(logits, labels, vocab_size), mask)
        with torch.no_grad():
            hit = (vocab_parallel_argmax(logits.detach()) == labels) & (mask > 0)  # [b, s]
            metrics["accuracy"] = torch.stack([hit.sum().double(), mask.sum().double()])
            if with_exact_match:
                has = mask.sum(1) > 0
                exact = ((hit | (mask == 0)).all(1) & has).sum()
                metrics["teacher_forced_exact_match"] = torch.stack([exact.double(), has.sum().double()])
        return loss_sum, count, metrics

    return loss_fn


def build_stage(cfg: Config, stage_dir: str) -> Stage:
    tok = data_setup.tokenizer(cfg)
    paths = data_setup.stage_paths(cfg, STAGE)
    role = Role(STAGE, cfg.model, cfg.parallel, head="lm", precision=cfg.train.precision, fp8=cfg.train.fp8,
                seed=cfg.train.seed, optim=cfg.optim, schedule=cfg.lr_schedule, train_steps=cfg.train.steps)
    data_setup.init_weights(cfg, role)
    train = data_setup.train_iterator(cfg, paths["train"], "sft", tok, stage_dir)
    eval_ds = data_setup.dataset(cfg, paths["eval"], "sft", tok, packing=False) if paths["eval"] else None
    samples = data_setup.eval_prompts(cfg, paths["eval"], tok, cfg.sft.eval_samples) if paths["eval"] else []

    def evaluate():
        metrics = role.evaluate(data_setup.eval_microbatches(cfg, eval_ds), sft_loss(cfg.model.vocab_size, True))
        rows = []
        if samples:
            outs = greedy_generate(role, [s["prompt_ids"] for s in samples], max_new_tokens=cfg.sft.max_new_tokens,
                                   stop_ids=tok.stop_ids, pad_id=tok.pad_id, vocab_size=cfg.model.vocab_size)
            from megarl.data import is_correct

            for s, out in zip(samples, outs):
                text = tok.decode(out, skip_special_tokens=True)
                rows.append({"prompt": s["prompt"], "completion": text, "answer": s["answer"],
                             "correct": bool(s["answer"] is not None and is_correct(text, s["answer"]))})
            metrics["sample_accuracy"] = sum(r["correct"] for r in rows) / len(rows)
        return metrics, rows

    return Stage(STAGE, role, sft_loss(cfg.model.vocab_size), train, evaluate if eval_ds is not None else None)


def main(cfg: Config) -> dict:
    return train_stage(cfg, STAGE, build_stage)
