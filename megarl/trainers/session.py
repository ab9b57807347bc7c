"""Everything a stage needs around its loop: processes, run directory, config record, tracking.

    with stage_session(cfg, "sft") as s:   # s.stage_dir, s.tracker, s.env
        ...
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
from dataclasses import dataclass

import torch


from megarl.config import Config, config_to_dict, save_config
from megarl.runtime.distributed import ProcessEnv, barrier, cpu_threads, init_distributed, is_rank0, teardown
from megarl.trainers import run_lock

log = logging.getLogger("megarl")


@dataclass
class Session:
    cfg: Config
    env: ProcessEnv
    run_dir: str
    stage_dir: str
    tracker: object


def setup_logging(rank: int) -> None:
    """INFO on rank 0, warnings elsewhere: one readable log, not world_size copies of it."""
    logging.basicConfig(stream=sys.stdout, level=logging.INFO if rank == 0 else logging.WARNING,
                        format="[%(asctime)s megarl] %(message)s", datefmt="%H:%M:%S", force=True)
    for noisy in ("megatron", "mlflow", "alembic", "urllib3"):  # their INFO is not for our users
        logging.getLogger(noisy).setLevel(logging.WARNING)


@contextlib.contextmanager
def stage_session(cfg: Config, stage: str, keep_process_group: bool = False):
    """keep_process_group: the stage runs inside a pipeline (more stages follow in this process),
    which keeps the process group and its lock on the run dir (Pipeline.run releases it)."""
    from megarl.tracking import create_tracker, replay_stage_spills
    from megarl.trainers.data_setup import check_preflight

    check_preflight(cfg, stage)  # every rank, before any process group, run dir or MLflow run exists
    p = cfg.parallel
    env = init_distributed(p.tp, p.pp, p.cp, seed=cfg.train.seed, backend=cfg.launcher.backend,
                           timeout_minutes=cfg.launcher.timeout_minutes, ep=p.ep, etp=p.etp)
    setup_logging(env.rank)
    run_dir = os.path.abspath(cfg.train.run_dir)
    stage_dir = os.path.join(run_dir, stage)
    parent = tracker = None
    replays = []  # other stage dirs' spilled records, delivered alongside (a skipped stage's, too)
    status = "FAILED"
    locked = False
    try:
        locked = _lock(run_dir, stage_dir, stage, pipeline=keep_process_group)
        if is_rank0():
            os.makedirs(stage_dir, exist_ok=True)
            save_config(cfg, os.path.join(stage_dir, "config.yaml"))
            log.info("megarl %s: world size %d (tp=%d pp=%d cp=%d dp=%d, %d torch threads per rank: %s); "
                     "model %d layers x %d hidden; %s; resolved config: %s",
                     stage, env.world_size, p.tp, p.pp, p.cp, env.world_size // (p.tp * p.pp * p.cp),
                     torch.get_num_threads(), cpu_threads()[1], cfg.model.num_layers, cfg.model.hidden_size,
                     _work(cfg, stage), os.path.join(stage_dir, "config.yaml"))
        barrier()
        t = cfg.tracking
        parent = create_tracker(run_dir, None, backend=t.backend, rank=env.rank, uri=t.uri,
                                experiment=t.experiment, run_name=t.run_name or os.path.basename(run_dir),
                                system_metrics_interval=None)
        track_dir = _tracking_dir(stage_dir, stage)
        tracker = create_tracker(track_dir, config_to_dict(cfg), backend=t.backend,
                                 rank=env.rank, uri=t.uri, experiment=t.experiment, run_name=stage,
                                 parent=parent if t.backend == "mlflow" else None, tags={"megarl.stage": stage})
        if is_rank0():
            tracker.log_artifact(os.path.join(stage_dir, "config.yaml"))
            if t.backend == "mlflow":
                replays = replay_stage_spills(run_dir, parent, exclude=[track_dir, *_busy_stage_dirs(run_dir)])
        yield Session(cfg, env, run_dir, stage_dir, tracker)
    except BaseException as e:
        status = _status_of(e)
        if status == "KILLED" and tracker is not None:  # resumes continue this run
            tracker.set_tags({"megarl.preempted": "true"})
        raise
    else:
        status = "FINISHED"
    finally:
        for tr in (tracker, parent):
            if tr is not None:
                tr.close(status)
        for tr in replays:
            tr.close(None)
        if locked:
            run_lock.release(stage_dir)
        teardown(keep_process_group)


def _lock(run_dir: str, stage_dir: str, stage: str, pipeline: bool) -> bool:
    """Rank 0 takes the stage dir's lock (and, in a pipeline, the run dir's, which it keeps);
    every rank learns whether it got them, so all refuse together. True if this call took the
    stage lock. A training stage also refuses while another process's pipeline holds the run
    dir; `megarl eval` does not (evaluating a checkpoint while training goes on is fine)."""
    import torch
    import torch.distributed as dist

    from megarl.runtime.distributed import device

    error, taken = None, False
    if is_rank0():
        try:
            if pipeline:
                run_lock.acquire(run_dir, _command())
                run_lock.check_stages_free(run_dir, ignore=("eval",))
            elif stage != "eval":
                run_lock.check_free(run_dir)
            taken = run_lock.acquire(stage_dir, _command())
        except run_lock.RunDirInUse as e:
            error = e
    ok = torch.tensor([0 if error else 1])
    if dist.is_initialized():
        ok = ok.to(device())
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not ok.item():
        raise error or run_lock.RunDirInUse(f"{stage_dir} is in use by another megarl process (rank 0 names it)")
    return taken


def _tracking_dir(stage_dir: str, stage: str) -> str:
    """Where a stage's tracking state lives: the stage dir, whose MLflow run a resume continues;
    for `megarl eval`, a new dir each time (eval/runs/<time>-<pid>): each eval is its own run,
    and records one eval left unsent are replayed into that eval's run, not the next one's."""
    if stage != "eval":
        return stage_dir
    import time

    return os.path.join(stage_dir, "runs", f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")


def _busy_stage_dirs(run_dir: str) -> list[str]:
    """Stage dirs another live process holds (its own tracker delivers their records)."""
    return [d.path for d in os.scandir(run_dir) if d.is_dir() and run_lock.live_holder(
        os.path.join(d.path, run_lock.LOCK_NAME), run_lock.this_process("")) is not None]


def _command() -> str:
    return " ".join(["megarl"] + sys.argv[1:])[:200]


def _work(cfg: Config, stage: str) -> str:
    """What the stage processes, in its own units: RL and eval sample prompts x samples (the data
    batch plays no part there), SFT trains on sequences and RM on pairs of them."""
    r, t = cfg.rl, cfg.train
    if stage == "rl":
        return (f"{t.steps} steps of {r.prompts_per_step} prompts x {r.samples_per_prompt} samples (up to "
                f"{r.max_new_tokens} new tokens), lr {cfg.optim.lr:g}, {t.precision}"
                + (f"; eval: {r.eval_prompts} prompts x {r.eval_samples} samples" if t.eval_interval else ""))
    if stage == "eval":
        return f"{r.eval_prompts} held-out prompts x {r.eval_samples} samples (up to {r.max_new_tokens} new tokens)"
    d = cfg.data
    rows = (f"{d.global_batch_size} pairs (2 x {d.seq_length} tokens)" if stage in ("reward_model", "dpo")
            else f"{d.global_batch_size} sequences x {d.seq_length} tokens")
    return f"{t.steps} steps of {rows}, lr {cfg.optim.lr:g}, {t.precision}"


def _status_of(exc: BaseException) -> str:
    """The MLflow status of a stage that ended in `exc`: KILLED when pre-empted (checkpoint
    saved, requeued) or interrupted, FAILED otherwise."""
    from megarl.trainers.stops import Preempted

    return "KILLED" if isinstance(exc, (Preempted, KeyboardInterrupt)) else "FAILED"
