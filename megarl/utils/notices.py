"""megatron-core's notices about optional packages (Transformer Engine, apex) and about a
TransformerConfig default megarl leaves as it is: nothing a megarl user can act on (`megarl
validate` names what a setting needs). The CLI ignores them for its whole process; the Python
API (`megarl.Pipeline`) only while a stage runs, so a user's own warning filters stay as they are."""
from __future__ import annotations

import contextlib
import warnings

MEGATRON_NOTICES = ("Transformer Engine and Apex are not installed", "Apex is not installed",
                    "full scope is deprecated")


def ignore_megatron_notices(extra: tuple[str, ...] = ()) -> None:
    """For a process megarl owns (the CLI): ignore the notices (and `extra` texts) from now on."""
    for text in (*MEGATRON_NOTICES, *extra):
        warnings.filterwarnings("ignore", message=f".*{text}.*")


@contextlib.contextmanager
def quiet_megatron_notices():
    """Ignore the notices inside the block only (import megatron-core and build models in it)."""
    with warnings.catch_warnings():
        ignore_megatron_notices()
        yield
