"""The recipes shipped inside the package (megarl/configs/), for installs without a checkout.

`--config PATH` means the file PATH when it exists. When it does not, and PATH is a shipped
recipe's name (`configs/tiny_sft.yaml`, `tiny_sft.yaml` or `tiny_sft`), the shipped file is used,
so the quickstart's commands work the same from a wheel as from the repository (where
`configs/` is a link to `megarl/configs/`). A local file always wins over a shipped one.
"""
from __future__ import annotations

import os

SHIPPED_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def shipped_configs() -> list[str]:
    """Names of the shipped recipes (`tiny_sft.yaml`, ...)."""
    if not os.path.isdir(SHIPPED_DIR):
        return []
    return sorted(n for n in os.listdir(SHIPPED_DIR) if n.endswith(".yaml"))


def resolve_config_path(path: str) -> str:
    """`path` if it exists, else the shipped recipe it names, else `path` unchanged (the loader
    then reports it as not found, listing the shipped names)."""
    if os.path.exists(path):
        return path
    name = path[len("configs/"):] if path.startswith("configs/") else path
    if os.sep in name or "/" in name:
        return path
    if not name.endswith(".yaml"):
        name += ".yaml"
    shipped = os.path.join(SHIPPED_DIR, name)
    return shipped if os.path.isfile(shipped) else path
