"""Experiment tracking (MLflow, rank 0 only) and run reports.

    from megarl.tracking import create_tracker
    tracker = create_tracker(cfg.train.run_dir, cfg_dict, backend="mlflow", rank=rank)
    tracker.log_metrics({"train/loss": 2.3, "train/lr": 1e-4}, step=10)
    tracker.close()

See tracker.py for the delivery guarantees and docs/launching.md for reading results.
"""
from .params import flatten_params
from .tracker import NullTracker, Tracker, create_tracker, default_tracking_uri, replay_spill, replay_stage_spills


def write_report(run_dir, out_dir=None, **kwargs):
    """Plots + report.md for the run(s) of run_dir (see report.py); imports matplotlib lazily."""
    from .report import write_report as _write_report

    return _write_report(run_dir, out_dir, **kwargs)


__all__ = ["Tracker", "NullTracker", "create_tracker", "default_tracking_uri", "flatten_params",
           "replay_spill", "replay_stage_spills", "write_report"]
