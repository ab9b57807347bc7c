"""The loop every stage shares: a stage owns its step; the loop owns time.

    step = checkpointer.resume()
    while step < steps:
        metrics = stage.step(step); step += 1          # one loop step (SFT: one optimizer step;
        logger.log(step, metrics)                      #   RL: rollout, scoring, several updates)
        evaluator.maybe(step); checkpointer.maybe(step); preemption.maybe(step)

Checkpointing, evaluation, metric logging and pre-emption are small objects that decide their
own timing. Stage-specific work (data, losses, roles) lives in the stage.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import time

import torch
import torch.distributed as dist

from megarl.checkpoint.distributed import latest_checkpoint, load_checkpoint, save_checkpoint, saving
from megarl.config.schema import Config
from megarl.runtime.distributed import device, is_rank0
from megarl.trainers.stops import EXIT_REQUEUE, Preempted
from megarl.utils.atomic import write_atomic

log = logging.getLogger("megarl")

class Stage:
    """What the loop drives. Subclasses set `name` and `roles` and implement `step`.

    roles: the trained roles, checkpointed with their optimizer and LR schedule state. Frozen
    roles (a reference, a reward model) are not saved: they are rebuilt from where they came
    from. `state_dict()` holds the rest of what a bit-exact resume needs (data position,
    controllers, sampler RNG).
    """

    name: str
    roles: dict

    def step(self, step: int) -> dict:
        """Loop step `step` (0-based); returns {"train/...": float, "perf/...": float}. Metrics
        under "perf/" are wall-clock figures: logged, but not expected to repeat on resume."""
        raise NotImplementedError

    def evaluate(self, step: int) -> tuple[dict, list[dict]] | None:
        """(metrics, sample rows) after `step` steps, or None for a stage without evaluation."""
        return None

    has_evaluation = False
    evaluate_first = False  # also evaluate before the first step (RL: the starting model)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


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
            flag = flag.to(device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


class MetricsFile:
    """<stage_dir>/metrics.jsonl, one line per step (and per evaluation); on resume, the lines
    after the checkpoint's step go, so the file always equals an uninterrupted run's."""

    def __init__(self, path: str, resume_step: int):
        self.path = path
        self.kept: list[dict] = []  # the records before the resume point (rank 0, which owns the file)
        if is_rank0():
            if resume_step > 0 and os.path.exists(path):
                with open(path) as f:
                    self.kept = [r for r in map(json.loads, f) if r.get("step", 0) <= resume_step]
            write_atomic(path, "".join(json.dumps(r) + "\n" for r in self.kept))  # a kill keeps the old file

    def write(self, record: dict) -> None:
        if is_rank0():
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


class Progress:
    """Rank-0 progress: a tqdm bar on a terminal; in logs (no TTY), a line with ETA every
    `every` steps, so batch jobs' log files stay readable."""

    # the progress line's figures (every metric goes to metrics.jsonl and MLflow)
    SHOWN = ("train/loss", "train/token_accuracy", "train/pair_accuracy", "train/reward_accuracy", "train/lr", "train/grad_norm", "reward/mean", "reward/accuracy",
             "kl/mean", "actor/loss", "actor/entropy", "actor/clip_fraction", "critic/loss",
             "critic/explained_variance", "rollout/response_len_mean", "perf/tokens_per_s", "perf/step_time_s")

    def __init__(self, total: int, initial: int, desc: str, every: int, run=None):
        """run: for a stage inside a pipeline, `run(done, total, seconds_per_step) -> str` adds the
        pipeline's part (stage i of n, an ETA for the whole run) to the line."""
        import sys

        from tqdm import tqdm

        self.total, self.done, self.desc, self.every, self.run = total, initial, desc, every, run
        self.start, self.start_step = time.perf_counter(), initial
        self.bar = None
        if is_rank0() and sys.stderr.isatty():
            self.bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, unit="step")

    def update(self, metrics: dict) -> None:
        self.done += 1
        rate = (time.perf_counter() - self.start) / max(self.done - self.start_step, 1)  # s/step, evals included
        run = f"; {self.run(self.done, self.total, rate)}" if self.run is not None else ""
        if self.bar is not None:
            self.bar.update(1)
            shown = [k for k in self.SHOWN if k in metrics][:4]
            self.bar.set_postfix({k.split("/")[1]: f"{metrics[k]:.4g}" for k in shown})
            if run:
                self.bar.set_description(f"{self.desc} ({run[2:]})")
        if is_rank0() and (self.done % self.every == 0 or self.done == self.total):
            self.write(f"{self.desc} step {self.done}/{self.total} ({100 * self.done // self.total}%, "
                       f"ETA {clock(rate * (self.total - self.done))}{run}) | "
                       f"{_fmt({k: metrics[k] for k in self.SHOWN if k in metrics})}")

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        elif is_rank0():
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class MetricLogger:
    """Every step's and evaluation's metrics to MLflow, metrics.jsonl and the progress line."""

    def __init__(self, tracker, stage_dir: str, name: str, total: int, resume_step: int, every: int, run=None):
        self.tracker, self.name = tracker, name
        self.file = MetricsFile(os.path.join(stage_dir, "metrics.jsonl"), resume_step)
        self.progress = Progress(total, resume_step, name, every, run)
        self.final: dict = {}  # the latest value of every metric, the resumed-from part included
        for record in self.file.kept:
            self.final.update({k: v for k, v in record.items() if k != "step"})
        if resume_step > 0:  # the points a killed process never delivered reach MLflow now
            tracker.backfill(self.file.path, resume_step)

    def log(self, step: int, metrics: dict) -> None:
        self.tracker.log_metrics(metrics, step=step)
        self.file.write({"step": step, **metrics})
        self.final.update(metrics)
        self.progress.update(metrics)

    def log_eval(self, step: int, metrics: dict, rows: list[dict]) -> None:
        metrics = {f"eval/{k}": v for k, v in metrics.items()}
        self.tracker.log_metrics(metrics, step=step)
        if rows:
            self.tracker.log_table(rows, name=f"{self.name}_samples", step=step)
        self.file.write({"step": step, **metrics})
        self.final.update(metrics)
        self.progress.write(f"{self.name} eval @ step {step}: {_fmt(metrics)}")


class Evaluator:
    """Evaluates every `interval` steps and after the last one (interval 0: never), and before
    the first step for a stage whose `evaluate_first` is true."""

    def __init__(self, stage: Stage, interval: int, total: int, logger: MetricLogger):
        self.stage, self.interval, self.total, self.logger = stage, interval, total, logger

    def maybe(self, step: int) -> None:
        if not self.stage.has_evaluation or not self.interval:
            return
        if step == 0:
            due = self.stage.evaluate_first
        else:
            due = step % self.interval == 0 or step == self.total
        if due:
            metrics, rows = self.stage.evaluate(step)
            self.logger.log_eval(step, metrics, rows)


class Checkpointer:
    """Saves the stage's trained roles and state every `save_interval` steps, at pre-emption and
    at the end; resumes from `latest`. With checkpoint.async_save, megatron-core's
    AsyncCallsQueue writes in the background and a save is published once written everywhere."""

    def __init__(self, cfg: Config, stage: Stage, root: str, tracker):
        self.cfg, self.stage, self.root, self.tracker = cfg.checkpoint, stage, root, tracker
        self.last_saved: int | None = None  # the newest durable (or in-flight) checkpoint's step
        self.queue = None
        if self.cfg.async_save:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self.queue = AsyncCallsQueue()

    def resume(self) -> int:
        latest = latest_checkpoint(self.root) if self.cfg.resume else None
        if latest is None:
            return 0
        saved = load_checkpoint(latest, self.stage.roles)
        self.stage.load_state_dict(saved["stage"])
        self.last_saved = saved["step"]
        if is_rank0():
            log.info("resumed %s from %s (step %d)", self.stage.name, latest, saved["step"])
        return saved["step"]

    def save(self, step: int) -> None:
        if self.last_saved == step:
            return
        self.wait()  # one write in flight at a time: the previous one is published first
        save_checkpoint(self.root, step, self.stage.roles, {"stage": self.stage.state_dict()},
                        keep_last=self.cfg.keep_last, async_queue=self.queue,
                        on_durable=lambda path: self.tracker.log_checkpoint(path, step))
        self.last_saved = step

    def maybe(self, step: int) -> None:
        if self.cfg.save_interval and step % self.cfg.save_interval == 0:
            self.save(step)
        self._finalize(blocking=False)  # publish a finished write

    def wait(self) -> None:
        self._finalize(blocking=True)

    def _finalize(self, blocking: bool) -> None:
        if self.queue is not None and self.queue.get_num_unfinalized_calls():
            with saving(self.root, self.last_saved):  # a full disk: one line, the temp dir removed
                self.queue.maybe_finalize_async_calls(blocking=blocking)

    def abort(self) -> None:
        """On a failing rank: no collectives; stop the writers. Their unpublished .tmp-
        directory is never loaded."""
        if self.queue is not None:
            for call in self.queue.async_calls:
                call.async_caller.close(abort=True)


def run_stage(cfg: Config, stage: Stage, stage_dir: str, tracker,
              preemption: PreemptionSignal | None = None, run=None) -> dict:
    """Run `stage` for cfg.train.steps loop steps; returns the final metrics. `preemption`: a
    handler installed before the stage was built (train_stage), so that a signal during setup
    or the step-0 evaluation also ends in a clean exit 75. `run`: the pipeline's part of the
    progress line (Progress)."""
    if preemption is None:
        with PreemptionSignal() as preemption:
            return run_stage(cfg, stage, stage_dir, tracker, preemption, run)
    total = cfg.train.steps
    checkpointer = Checkpointer(cfg, stage, os.path.join(stage_dir, "checkpoints"), tracker)
    step = checkpointer.resume()
    if step >= total and is_rank0():
        log.info("%s: already complete (step %d of %d); results in %s (metrics.jsonl, checkpoints/)",
                 stage.name, step, total, stage_dir)
    logger = MetricLogger(tracker, stage_dir, stage.name, total, step, cfg.train.log_interval, run)
    evaluator = Evaluator(stage, cfg.train.eval_interval, total, logger)
    if step == 0 and not preemption.requested():
        evaluator.maybe(0)  # the starting point, for stages that ask (RL: the model it starts from)
    if step < total and preemption.requested():  # during setup or the step-0 evaluation
        logger.progress.close()
        state = f"its checkpoint of step {step} is the latest" if step else "nothing to save yet"
        raise Preempted(f"{stage.name}: pre-empted before step {step + 1}; {state}, exiting {EXIT_REQUEUE} "
                        "for requeue")
    try:
        while step < total:
            start = time.perf_counter()
            metrics = stage.step(step)
            step += 1
            metrics["perf/step_time_s"] = time.perf_counter() - start
            logger.log(step, metrics)
            evaluator.maybe(step)
            checkpointer.maybe(step)
            if preemption.requested():
                checkpointer.save(step)
                checkpointer.wait()
                logger.progress.close()
                raise Preempted(f"{stage.name}: pre-empted at step {step}; checkpoint saved, "
                                f"exiting {EXIT_REQUEUE} for requeue")
        logger.progress.close()
        checkpointer.save(step)  # the final state (a no-op if this step is already saved)
        checkpointer.wait()
    except BaseException as e:
        if not isinstance(e, Preempted):
            checkpointer.abort()
        raise
    return logger.final


def train_stage(cfg: Config, name: str, build, keep_process_group: bool = False, run=None) -> dict:
    """A stage's whole process: session (processes, run dir, tracking) around `run_stage`.
    `build(cfg, stage_dir) -> Stage`; `run`: see Progress."""
    from megarl.trainers.session import stage_session

    with PreemptionSignal() as preemption, stage_session(cfg, name, keep_process_group) as s:
        final = run_stage(cfg, build(cfg, s.stage_dir), s.stage_dir, s.tracker, preemption, run)
        if is_rank0():
            shown = {k: v for k, v in final.items() if k.startswith("eval/")} or \
                {k: v for k, v in final.items() if k.startswith("train/")}
            log.info("%s done: %s | %s", name, _fmt(shown), os.path.join(s.stage_dir, "metrics.jsonl"))
        return final


def clock(seconds: float) -> str:
    """'1:05' (m:ss), or '2:03:10' from an hour on."""
    s = max(int(seconds), 0)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def _fmt(metrics: dict) -> str:
    """'train/loss 1.2 | reward/mean 0.3': train/ and eval/ figures by their short name."""
    def name(k):
        return k.split("/", 1)[1] if k.startswith(("train/", "eval/", "perf/")) else k

    return " | ".join(f"{name(k)} {v:.4g}" for k, v in metrics.items() if isinstance(v, (int, float)))
