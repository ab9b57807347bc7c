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


from megarl.config import Config, config_to_dict, save_config
from megarl.runtime.distributed import ProcessEnv, barrier, init_distributed, is_rank0, teardown

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
    from megarl.tracking import create_tracker
    from megarl.trainers.data_setup import check_preflight

    check_preflight(cfg, stage)  # every rank, before any process group, run dir or MLflow run exists
    p = cfg.parallel
    env = init_distributed(p.tp, p.pp, p.cp, seed=cfg.train.seed, backend=cfg.launcher.backend,
                           timeout_minutes=cfg.launcher.timeout_minutes)
    setup_logging(env.rank)
    run_dir = os.path.abspath(cfg.train.run_dir)
    stage_dir = os.path.join(run_dir, stage)
    parent = tracker = None
    status = "FAILED"
    try:
        if is_rank0():
            os.makedirs(stage_dir, exist_ok=True)
            save_config(cfg, os.path.join(stage_dir, "config.yaml"))
            log.info("megarl %s: world size %d (tp=%d pp=%d cp=%d dp=%d); model %d layers x %d hidden; "
                     "%d steps of %d x %d tokens, lr %g, %s; resolved config: %s",
                     stage, env.world_size, p.tp, p.pp, p.cp, env.world_size // (p.tp * p.pp * p.cp),
                     cfg.model.num_layers, cfg.model.hidden_size, cfg.train.steps, cfg.data.global_batch_size,
                     cfg.data.seq_length, cfg.optim.lr, cfg.train.precision, os.path.join(stage_dir, "config.yaml"))
        barrier()
        t = cfg.tracking
        parent = create_tracker(run_dir, None, backend=t.backend, rank=env.rank, uri=t.uri,
                                experiment=t.experiment, run_name=t.run_name or os.path.basename(run_dir),
                                system_metrics_interval=None)
        tracker = create_tracker(stage_dir, config_to_dict(cfg), backend=t.backend, rank=env.rank, uri=t.uri,
                                 experiment=t.experiment, run_name=stage, parent=parent if t.backend == "mlflow" else None,
                                 tags={"megarl.stage": stage})
        if is_rank0():
            tracker.log_artifact(os.path.join(stage_dir, "config.yaml"))
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
        teardown(keep_process_group)


def _status_of(exc: BaseException) -> str:
    """The MLflow status of a stage that ended in `exc`: KILLED when pre-empted (checkpoint
    saved, requeued) or interrupted, FAILED otherwise."""
    from megarl.trainers.loop import Preempted

    return "KILLED" if isinstance(exc, (Preempted, KeyboardInterrupt)) else "FAILED"
