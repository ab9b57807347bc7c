"""Importing user code named in a config (`module` or `path/to/file.py`: reward functions, tools),
and megarl's own compiled extensions (csrc/), which are optional."""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys


def import_user_module(module_name: str, label: str, prefix: str):
    """The module `module_name` (a dotted name, or a .py file loaded as `prefix` + its stem);
    ValueError "`label`: ..." in one line when it is missing or raises while it loads."""
    try:
        if module_name.endswith(".py"):
            if not os.path.isfile(module_name):
                raise ValueError(f"{label}: file not found: {module_name}")
            name = prefix + os.path.splitext(os.path.basename(module_name))[0]
            mod_spec = importlib.util.spec_from_file_location(name, module_name)
            module = importlib.util.module_from_spec(mod_spec)
            sys.modules[name] = module
            mod_spec.loader.exec_module(module)
            return module
        return importlib.import_module(module_name)
    except ValueError:
        raise
    except Exception as e:  # ImportError, or the user module raising while it loads
        raise ValueError(f"{label}: cannot import {module_name!r}: {type(e).__name__}: {e}".replace("\n", " ")) from None


def import_kernels(module_name: str):
    """(the compiled extension `module_name`, "") or (None, why it cannot be used here).
    MEGARL_DISABLE_KERNELS=1 turns every compiled kernel off, for A/B runs against the torch paths."""
    if os.environ.get("MEGARL_DISABLE_KERNELS", "") not in ("", "0"):
        return None, "MEGARL_DISABLE_KERNELS is set"
    try:
        return importlib.import_module(module_name), ""
    except ImportError as exc:
        return None, f"{module_name} is not built: {exc}"
