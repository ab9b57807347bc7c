"""The training loop every stage shares: steps, evaluation, checkpoints, pre-emption, logging.

Read top to bottom: resume -> for each step: a global batch -> Role.train_step -> log ->
maybe evaluate -> maybe checkpoint -> maybe stop for pre-emption. Stage-specific work (the
loss, the evaluation) comes in through `Stage`.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from megarl.checkpoint.distributed import latest_checkpoint, load_checkpoint, save_checkpoint
from megarl.config.schema import Config
from megarl.runtime.distributed import is_rank0

log = logging.getLogger("megarl")

EXIT_REQUEUE = 75  # EX_TEMPFAIL: "pre-empted, checkpoint saved, requeue me"


class Preempted(Exception):
    """Raised after the pre-emption checkpoint is durable; the CLI exits with EXIT_REQUEUE."""


@dataclass
class Stage:
    name: str  # "sft", "reward_model": also the run sub-directory and the role name
    role: object  # megarl.roles.role.Role
    loss_fn: Callable
    train_data: object  # an iterator of this DP rank's micro-batches with state_dict()
    evaluate: Callable[[], tuple[dict, list[dict]]] | None = None  # -> (metrics, sample rows)
    state: dict = field(default_factory=dict)  # extra state checkpointed with the stage


class PreemptionSignal:
    """SIGTERM / SIGUSR1 set a flag; ranks agree on it at step boundaries (one all-reduce)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.received: int | None = None
        self._previous = {}

    def __enter__(self):
        for s in self.SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):
        self.received = signum

    def __exit__(self, *exc):
        for s, h in self._previous.items():
            signal.signal(s, h)

    def requested(self) -> bool:
        flag = torch.tensor([1 if self.received is not None else 0])
        if dist.is_initialized():
            if torch.cuda.is_available():
                flag = flag.cuda()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


class MetricsFile:
    """<stage_dir>/metrics.jsonl, one line per step; on resume, lines after the checkpoint go."""

    def __init__(self, path: str, resume_step: int):
        self.path = path
        if is_rank0():
            kept = []
            if resume_step > 0 and os.path.exists(path):
                with open(path) as f:
                    kept = [line for line in f if json.loads(line).get("step", 0) <= resume_step]
            with open(path, "w") as f:
                f.writelines(kept)

    def write(self, record: dict) -> None:
        if is_rank0():
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


class Progress:
    """Rank-0 progress: a tqdm bar on a terminal; in logs (no TTY), a line with ETA every
    `every` steps, so batch jobs' log files stay readable."""

    def __init__(self, total: int, initial: int, desc: str, every: int):
        import sys

        from tqdm import tqdm

        self.total, self.done, self.desc, self.every = total, initial, desc, every
        self.start, self.start_step = time.perf_counter(), initial
        self.bar = None
        if is_rank0() and sys.stderr.isatty():
            self.bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, unit="step")

    def update(self, metrics: dict) -> None:
        self.done += 1
        short = {k.split("/")[1]: f"{v:.4g}" for k, v in metrics.items() if k in ("train/loss", "train/accuracy", "train/lr")}
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(short)
        if is_rank0() and (self.done % self.every == 0 or self.done == self.total):
            rate = (time.perf_counter() - self.start) / max(self.done - self.start_step, 1)
            eta = int(rate * (self.total - self.done))
            self.write(f"{self.desc} step {self.done}/{self.total} ({100 * self.done // self.total}%, "
                       f"ETA {eta // 60}:{eta % 60:02d}) | {_fmt(metrics)}")

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        elif is_rank0():
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_stage(cfg: Config, stage: Stage, stage_dir: str, tracker) -> dict:
    """Train `stage` for cfg.train.steps optimizer steps; returns the final metrics."""
    from megatron.core import parallel_state as ps

    t = cfg.train
    ckpt_root = os.path.join(stage_dir, "checkpoints")
    roles = {stage.name: stage.role}
    step = 0
    latest = latest_checkpoint(ckpt_root) if cfg.checkpoint.resume else None
    if latest is not None:
        saved = load_checkpoint(latest, roles)
        stage.train_data.load_state_dict(saved["data"])
        stage.state.update(saved.get("extra", {}))
        step = saved["step"]
        if is_rank0():
            log.info("resumed %s from %s (step %d)", stage.name, latest, step)
    last_saved = step if latest is not None else None  # the newest durable checkpoint's step
    metrics_file = MetricsFile(os.path.join(stage_dir, "metrics.jsonl"), step)
    n_micro = cfg.data.global_batch_size // (cfg.data.micro_batch_size * ps.get_data_parallel_world_size())
    tokens_per_step = cfg.data.global_batch_size * cfg.data.seq_length
    final: dict = {}
    saves = None  # megatron-core's queue of background checkpoint writes (checkpoint.async_save)
    if cfg.checkpoint.async_save:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        saves = AsyncCallsQueue()

    def wait_for_saves() -> None:
        if saves is not None:
            saves.maybe_finalize_async_calls(blocking=True)

    def checkpoint(at: int) -> None:
        nonlocal last_saved
        if last_saved == at:
            return
        wait_for_saves()  # one write in flight at a time: the previous one is published first
        save_checkpoint(ckpt_root, at, roles, {"data": stage.train_data.state_dict(), "extra": stage.state},
                        keep_last=cfg.checkpoint.keep_last, async_queue=saves,
                        on_durable=lambda path: tracker.log_checkpoint(path, at))
        last_saved = at

    def evaluate(at: int) -> dict:
        metrics, rows = stage.evaluate()
        metrics = {f"eval/{k}": v for k, v in metrics.items()}
        tracker.log_metrics(metrics, step=at)
        if rows:
            tracker.log_table(rows, name=f"{stage.name}_samples", step=at)
        metrics_file.write({"step": at, **metrics})
        bar.write(f"{stage.name} eval @ step {at}: {_fmt(metrics)}")
        return metrics

    bar = Progress(t.steps, step, stage.name, t.log_interval)
    try:
        with PreemptionSignal() as preempt:
            while step < t.steps:
                start = time.perf_counter()
                microbatches = [next(stage.train_data) for _ in range(n_micro)]
                result = stage.role.train_step(microbatches, stage.loss_fn)
                step += 1
                dt = time.perf_counter() - start
                record = {f"train/{k}": v for k, v in result.metrics.items()}
                record.update({"train/lr": result.lr, "train/grad_norm": result.grad_norm,
                               "train/step_time_s": dt, "train/tokens_per_s": tokens_per_step / dt})
                if result.skipped:
                    record["train/skipped_steps"] = 1
                tracker.log_metrics(record, step=step)
                # wall-clock figures stay out of the file, so a resumed run's file equals an uninterrupted one's
                metrics_file.write({"step": step, **{k: v for k, v in record.items() if "time" not in k and "per_s" not in k}})
                final.update(record)
                bar.update(record)
                if stage.evaluate is not None and t.eval_interval and (step % t.eval_interval == 0 or step == t.steps):
                    final.update(evaluate(step))
                if cfg.checkpoint.save_interval and step % cfg.checkpoint.save_interval == 0:
                    checkpoint(step)
                if saves is not None and saves.get_num_unfinalized_calls():
                    saves.maybe_finalize_async_calls(blocking=False)  # publish a finished write
                if preempt.requested():
                    checkpoint(step)
                    wait_for_saves()
                    bar.close()
                    raise Preempted(f"{stage.name}: pre-empted at step {step}; checkpoint saved, exiting {EXIT_REQUEUE} for requeue")
        bar.close()
        checkpoint(step)  # the final state (a no-op if this step is already saved)
        wait_for_saves()
    except BaseException as e:
        if saves is not None and not isinstance(e, Preempted):
            for call in saves.async_calls:  # no collectives on a failing rank: stop the writers;
                call.async_caller.close(abort=True)  # their unpublished .tmp- directory is never loaded
        raise
    return final


def train_stage(cfg: Config, name: str, build: Callable[[Config, str], Stage]) -> dict:
    """A stage's whole process: session (processes, run dir, tracking) around `run_stage`."""
    from megarl.trainers.session import stage_session

    with stage_session(cfg, name) as s:
        final = run_stage(cfg, build(cfg, s.stage_dir), s.stage_dir, s.tracker)
        if is_rank0():
            log.info("%s done: %s", name, {k: round(v, 4) for k, v in final.items() if k.startswith("eval/")})
        return final


def _fmt(metrics: dict) -> str:
    return " | ".join(f"{k.split('/', 1)[-1]} {v:.4g}" for k, v in metrics.items() if isinstance(v, (int, float)))
