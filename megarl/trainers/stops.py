"""How a stage ends early: pre-empted (checkpoint saved, requeue) or stopped by itself.

Its own module so that the session, the loop, the stages and the CLI share the exceptions
without importing each other.
"""
from __future__ import annotations

EXIT_REQUEUE = 75  # EX_TEMPFAIL: "pre-empted, checkpoint saved, requeue me"


class Preempted(Exception):
    """Raised after the pre-emption checkpoint is durable; the CLI exits with EXIT_REQUEUE."""


class StageStopped(RuntimeError):
    """A stage stopped itself for the reason its message names (divergence, repeated non-finite
    steps); nothing more is saved, so the last good checkpoint stays the latest. The CLI prints
    the message on one line and exits 1."""
