"""Turn a nested resolved config into MLflow params, and metric names into valid MLflow keys.

MLflow params are flat `str -> str` pairs with limits (key <= 250 chars, value <= 6000 chars,
<= 100 per batch call) and a restricted key alphabet; configs are nested dicts/dataclasses.
Flattening uses dotted keys (`optim.lr`) so a param reads like the override that would set it.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from typing import Any

MAX_KEY_LEN = 250  # mlflow.utils.validation.MAX_ENTITY_KEY_LENGTH
MAX_PARAM_VALUE_LEN = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH (mlflow >= 2.x)
MAX_TAG_VALUE_LEN = 8000  # mlflow.utils.validation.MAX_TAG_VAL_LENGTH
TRUNCATION_MARK = "...[truncated]"

# MLflow accepts alphanumerics, '_', '-', '.', ' ', ':' and '/' in keys; anything else is replaced.
_BAD_KEY_CHARS = re.compile(r"[^0-9A-Za-z_\-. :/]")


def sanitize_key(key: str) -> str:
    """Map an arbitrary name onto MLflow's key alphabet and length limit (deterministically)."""
    key = _BAD_KEY_CHARS.sub("_", str(key)).strip()
    # MLflow also rejects keys that a POSIX path normalisation would change ("a//b", "./a", "a/").
    key = "/".join(p for p in key.split("/") if p not in ("", ".", ".."))
    return key[:MAX_KEY_LEN].rstrip("/") or "_"


def truncate(value: str, limit: int) -> str:
    return value if len(value) <= limit else value[: limit - len(TRUNCATION_MARK)] + TRUNCATION_MARK


def _to_plain(obj: Any) -> Any:
    """Dataclasses / objects with to_dict() / Mappings become dicts; everything else stays."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if hasattr(obj, "to_dict") and callable(obj.to_dict):
        return obj.to_dict()
    return obj


def _scalar_str(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, (str, bool, int, float)):
        return str(value)
    try:
        return json.dumps(value, default=str, sort_keys=True)
    except (TypeError, ValueError):
        return str(value)


def flatten_params(config: Any, prefix: str = "") -> dict[str, str]:
    """Flatten a nested config into `{"a.b.c": "value"}` within MLflow's key/value limits.

    Nested mappings and dataclasses recurse with dotted keys; lists of mappings recurse with the
    index as a key part (`data.sources.0.path`); other lists/tuples become one JSON value, so
    `model.layers_to_freeze=[0, 1]` stays one readable param. Long values are truncated with a
    visible marker rather than rejected.
    """
    out: dict[str, str] = {}
    _flatten_into(_to_plain(config), prefix, out)
    return out


def _flatten_into(obj: Any, prefix: str, out: dict[str, str]) -> None:
    obj = _to_plain(obj)
    if isinstance(obj, Mapping):
        if not obj and prefix:
            out[sanitize_key(prefix)] = "{}"
        for k, v in obj.items():
            _flatten_into(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(obj, (list, tuple)) and obj and all(
        isinstance(_to_plain(x), Mapping) for x in obj
    ):
        for i, v in enumerate(obj):
            _flatten_into(v, f"{prefix}.{i}", out)
    else:
        out[sanitize_key(prefix or "value")] = truncate(_scalar_str(obj), MAX_PARAM_VALUE_LEN)


def metric_value(value: Any) -> float | None:
    """float() of a Python/numpy/torch scalar; None for anything that is not a number."""
    if isinstance(value, bool):
        return float(value)
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars (0-d)
        try:
            value = value.item()
        except (ValueError, RuntimeError):
            return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if not math.isinf(out) else math.copysign(1.7976931348623157e308, out)
