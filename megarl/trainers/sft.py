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
from megarl.rollout.engine import MegatronRolloutEngine, SamplingParams
from megarl.trainers import data_setup, weights
from megarl.trainers.common import SupervisedStage, token_logprobs
from megarl.trainers.loop import train_stage

STAGE = "sft"


def sft_loss(vocab_size: int, with_accuracy: bool = True, with_exact_match: bool = False):
    """Loss closure for the Role contract. Token accuracy (an argmax over the whole vocabulary,
    so only on the steps that log it) and, in evaluation, sequence exact-match."""

    def loss_fn(batch, logits):  # logits [b, s, V_pad/tp]
        labels, mask = batch["labels"], batch["loss_mask"]
        loss_sum, count, metrics = masked_nll(token_logprobs(logits, labels, vocab_size), mask)
        if not with_accuracy:
            return loss_sum, count, metrics
        with torch.no_grad():
            hit = (vocab_parallel_argmax(logits.detach()) == labels) & (mask > 0)  # [b, s]
            metrics["token_accuracy"] = torch.stack([hit.sum().double(), mask.sum().double()])
            if with_exact_match:
                has = mask.sum(1) > 0
                exact = ((hit | (mask == 0)).all(1) & has).sum()
                metrics["teacher_forced_exact_match"] = torch.stack([exact.double(), has.sum().double()])
        return loss_sum, count, metrics

    return loss_fn


def build_stage(cfg: Config, stage_dir: str) -> SupervisedStage:
    tok = data_setup.tokenizer(cfg)
    paths = data_setup.stage_paths(cfg, STAGE)
    role = Role(STAGE, cfg.model, cfg.parallel, head="lm", precision=cfg.train.precision, fp8=cfg.train.fp8,
                seed=cfg.train.seed, optim=cfg.optim, schedule=cfg.lr_schedule, train_steps=cfg.train.steps)
    weights.init_weights(cfg, role)
    train = data_setup.train_iterator(cfg, paths["train"], "sft", tok, stage_dir)
    eval_ds = data_setup.dataset(cfg, paths["eval"], "sft", tok, packing=False) if paths["eval"] else None
    samples = data_setup.eval_prompts(cfg, paths["eval"], tok, cfg.sft.eval_samples) if paths["eval"] else []
    engine = MegatronRolloutEngine(role, vocab_size=cfg.model.vocab_size, pad_id=tok.pad_id) if samples else None

    def evaluate():
        metrics = role.evaluate(data_setup.eval_microbatches(cfg, eval_ds), sft_loss(cfg.model.vocab_size, True, True))
        rows = []
        if samples:
            greedy = SamplingParams(greedy=True, max_new_tokens=cfg.sft.max_new_tokens, logprobs=False,
                                    stop_ids=tuple(tok.stop_ids))
            outs = engine.generate([s["prompt_ids"] for s in samples], greedy, seed=0).responses()
            from megarl.data import is_correct

            for s, out in zip(samples, outs):
                text = tok.decode(out, skip_special_tokens=True)
                rows.append({"prompt": s["prompt"], "completion": text, "answer": s["answer"],
                             "correct": bool(s["answer"] is not None and is_correct(text, s["answer"]))})
            metrics["sample_accuracy"] = sum(r["correct"] for r in rows) / len(rows)
        return metrics, rows

    t = cfg.train

    def loss_for_step(step: int):  # accuracy on the steps the progress line and the log show
        logged = (step + 1) % t.log_interval == 0 or step + 1 == t.steps
        return sft_loss(cfg.model.vocab_size, with_accuracy=logged)

    return SupervisedStage(STAGE, role, loss_for_step, train, global_batch_size=cfg.data.global_batch_size,
                           micro_batch_size=cfg.data.micro_batch_size, tokens_per_sample=cfg.data.seq_length,
                           evaluate=evaluate if eval_ds is not None else None)


def main(cfg: Config) -> dict:
    return train_stage(cfg, STAGE, build_stage)
