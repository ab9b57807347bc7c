"""YAML files -> typed `Config`, with `extends:` inheritance and dotted overrides.

Every user mistake raises `ConfigError` with one line that names the file or override, the
key, and what is wrong; the CLI prints that line and exits (a traceback only with --debug).
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import sys
import typing
from typing import Any, Literal, Union

import yaml

from megarl.config.hf import HF_MODEL_FIELDS, MOE_HF_FIELDS, field_diff, hf_model_config
from megarl.config.schema import Config
from megarl.config.shipped import resolve_config_path, shipped_configs
from megarl.utils.atomic import write_atomic


_SCI_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


class ConfigError(ValueError):
    """A user-facing configuration mistake; str(e) is one complete line."""


# ---------------------------------------------------------------------------------------
# YAML with `extends:`


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key, mark):
        super().__init__()
        self.key, self.problem_mark = key, mark
        self.problem = f"key '{key}' is given twice (YAML would silently keep the last)"


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key given twice in one mapping."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise _DuplicateKey(key, key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _StrictLoader.construct_mapping)


def read_yaml(path: str, _chain: tuple = ()) -> dict:
    """Read a YAML mapping; `extends: base.yaml` (or a list) is merged underneath it."""
    path = os.path.abspath(path)
    if path in _chain:
        cycle = " -> ".join(os.path.basename(p) for p in (*_chain, path))
        raise ConfigError(f"{path}: 'extends' cycle: {cycle}")
    if os.path.isdir(path):
        raise ConfigError(f"{path}: is a directory, not a config file")
    if not os.path.isfile(path):
        where = f" (extended by {_chain[-1]})" if _chain else f" (shipped configs: {', '.join(shipped_configs())})"
        raise ConfigError(f"{path}: config file not found{where}")
    try:
        with open(path) as f:
            data = yaml.load(f, Loader=_StrictLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}{line}: invalid YAML: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(data).__name__}")
    bases = data.pop("extends", None)
    if bases is None:
        return data
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ConfigError(f"{path}: 'extends' must be a file name or a list of file names")
    merged: dict = {}
    for base in bases:
        base_path = base if os.path.isabs(base) else os.path.join(os.path.dirname(path), base)
        merged = deep_merge(merged, read_yaml(base_path, (*_chain, path)))
    return deep_merge(merged, data)


def deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    if isinstance(top.get("from_hf"), str):  # a model section of another model: the fields beneath are not its
        out = {k: v for k, v in out.items() if k not in HF_MODEL_FIELDS}
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


# ---------------------------------------------------------------------------------------
# Dotted overrides: section.key=value (value parsed as YAML: 1e-5, true, null, [1, 2])


def apply_override(data: dict, override: str) -> dict:
    key, sep, raw = override.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not sep or not key or any(not p or p != p.strip() for p in parts):
        raise ConfigError(f"override '{override}': expected section.key=value (e.g. optim.lr=1e-5)")
    leaf_type = _check_path(Config, parts, f"override '{override}'")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        raise ConfigError(f"override '{override}': value '{raw}' is not valid YAML") from None
    if not dataclasses.is_dataclass(_dataclass_in(leaf_type)):  # a wrong type is the override's fault, not the file's
        _coerce(leaf_type, value, f"override '{override}'", key)
    node = data
    for p in parts[:-1]:
        if not isinstance(node.get(p), dict):
            node[p] = {}
        node = node[p]
    if parts[-1] == "from_hf" and isinstance(value, str):  # as in deep_merge: the files' fields were another model's
        for k in HF_MODEL_FIELDS:
            node.pop(k, None)
    node[parts[-1]] = value
    return data


def from_hf_first(overrides) -> list[str]:
    """Overrides in the order to apply them: a `...from_hf=DIR` one first, so that it clears the
    model fields the files gave, never ones given beside it (those must agree with DIR)."""
    return sorted(overrides, key=lambda o: o.partition("=")[0].strip().rpartition(".")[2] != "from_hf")


def _check_path(cls, parts: list[str], where: str):
    """Reject an override naming a key the schema does not have, before anything runs; returns
    the schema type of the key it names."""
    tp = cls
    for i, p in enumerate(parts):
        hints = typing.get_type_hints(cls)
        if p not in hints:
            raise ConfigError(f"{where}: unknown key '{'.'.join(parts[: i + 1])}'{_suggest(p, hints, parts[:i])}")
        tp = hints[p]
        cls = _dataclass_in(tp)
        if cls is None and i < len(parts) - 1:
            raise ConfigError(f"{where}: '{'.'.join(parts[: i + 1])}' is a value, not a section")
    return tp


def _suggest(key: str, valid, prefix: list[str]) -> str:
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    return f" (did you mean '{'.'.join([*prefix, close[0]])}'?)" if close else ""


def _dataclass_in(tp):
    """The dataclass type in `tp` or Optional[tp], else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) is Union:
        for a in typing.get_args(tp):
            if dataclasses.is_dataclass(a):
                return a
    return None


# ---------------------------------------------------------------------------------------
# dict -> dataclass with type checks


def build(cls, data: Any, where: str, prefix: str = "", problems: list | None = None):
    """Construct dataclass `cls` from a mapping, checking every key and type. problems: a list
    to collect (key, message) in, leaving a bad key at its default, instead of raising."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: '{prefix.rstrip('.') or 'config'}' must be a mapping, got {_show(data)}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        try:
            if key not in hints:
                raise ConfigError(f"{where}: unknown key '{full}'{_suggest(str(key), hints, prefix.rstrip('.').split('.') if prefix else [])}")
            kwargs[key] = _coerce(hints[key], value, where, full, problems)
        except ConfigError as e:
            if problems is None:
                raise
            problems.append((full, str(e)))
    return cls(**kwargs)


def _coerce(tp, value, where: str, key: str, problems: list | None = None):
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Union:  # Optional[X]
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, where, key, problems)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, where, key + ".", problems)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: '{key}' must be one of {', '.join(map(repr, args))}; got {_show(value)}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: '{key}' expects a bool (true/false); got {_show(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: '{key}' expects an int; got {_show(value)}")
        return value
    if tp is float:
        if isinstance(value, str) and _SCI_FLOAT.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads 1e-5 (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: '{key}' expects a float; got {_show(value)}")
        if not math.isfinite(value):
            raise ConfigError(f"{where}: '{key}' must be a finite number; got {value}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: '{key}' expects a string; got {_show(value)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: '{key}' expects a list; got {_show(value)}")
        return [_coerce(args[0], v, where, f"{key}[{i}]") for i, v in enumerate(value)]
    raise TypeError(f"schema type {tp} for '{key}' is not supported by the loader")  # a bug, not user error


def _show(value) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r}"


# ---------------------------------------------------------------------------------------


def load_config(path: str | None = None, overrides: list[str] | tuple = (), problems: list | None = None) -> Config:
    """The resolved, type-checked config (cross-field validation is `validate_config`).
    problems: collect (key, message) of every bad key or override in it, each left at its
    default, instead of raising at the first (the CLI reports them all with the other checks)."""
    data = read_yaml(resolve_config_path(path)) if path else {}
    for o in from_hf_first(overrides):
        try:
            data = apply_override(data, o)
        except ConfigError as e:
            if problems is None:
                raise
            problems.append((o.partition("=")[0].strip(), str(e)))
    return fit_short_run(build_config(data, path or "config", problems=problems))


def build_config(data: dict, where: str, problems: list | None = None) -> Config:
    """The typed Config of merged YAML data: role sections inherited, model.from_hf resolved."""
    data = inherit_role_sections(data)
    return resolve_from_hf(build(Config, data, where, problems=problems), data, where)


def resolve_from_hf(cfg: Config, data: dict, where: str) -> Config:
    """Each model section with `from_hf: DIR` takes HF_MODEL_FIELDS from DIR/config.json; a field
    the config writes itself must agree (ConfigError naming it, the config's and config.json's
    value). A DIR not on this machine leaves the section as written: `megarl validate` on a
    login node checks those fields, and pre-flight names the missing directory."""
    roles = data.get("roles") if isinstance(data.get("roles"), dict) else {}
    owners = {"model": (cfg, data.get("model"))}  # where each model section lives, and as written
    for name in ("actor", "reference", "critic", "reward"):
        if getattr(cfg.roles, name).model is not None:
            owners[f"roles.{name}.model"] = (getattr(cfg.roles, name), (roles.get(name) or {}).get("model"))
    for key, (owner, raw) in owners.items():
        mc = owner.model
        if not mc.from_hf or not os.path.isdir(mc.from_hf):
            continue
        try:
            hf = hf_model_config(mc.from_hf)
        except ValueError as e:
            raise ConfigError(f"{where}: {key}.from_hf: {e}") from None
        raw = raw if isinstance(raw, dict) else {}
        raw_moe = raw.get("moe") if isinstance(raw.get("moe"), dict) else {}
        diff = field_diff(hf, mc, [k for k in HF_MODEL_FIELDS if k in raw]
                          + [f"moe.{k}" for k in MOE_HF_FIELDS if k in raw_moe])
        if diff:
            raise ConfigError(f"{where}: {key}.from_hf: {os.path.join(mc.from_hf, 'config.json')} has {key}."
                              + f", {key}.".join(diff) + f"; remove the key or make it agree (another model: "
                              f"{key}.from_hf: null)")
        owner.model = dataclasses.replace(mc, **{k: getattr(hf, k) for k in HF_MODEL_FIELDS},
                                          moe=dataclasses.replace(mc.moe, **{k: getattr(hf.moe, k) for k in MOE_HF_FIELDS}))
    return cfg


_NOTED: set[str] = set()  # notices already printed by this process


def fit_short_run(cfg: Config, where: str = "") -> Config:
    """A run shorter than its recipe's warm-up (`train.steps=5` on a 20-step warm-up) warms up
    over all but its last step instead of failing; one notice says so. With
    lr_schedule.decay_steps set, the schedule is the user's own and is left to validation."""
    s, steps = cfg.lr_schedule, cfg.train.steps
    if s.decay_steps is None and steps >= 1 and s.warmup_steps >= steps:
        note = (f"megarl: note: {where}lr_schedule.warmup_steps ({s.warmup_steps}) is not below train.steps "
                f"({steps}); warm-up clamped to {steps - 1} step(s)")
        cfg.lr_schedule = dataclasses.replace(s, warmup_steps=steps - 1)
        if note not in _NOTED and os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
            _NOTED.add(note)
            print(note, file=sys.stderr, flush=True)
    return cfg


ROLE_SECTIONS = ("model", "optim", "lr_schedule")


def inherit_role_sections(data: dict) -> dict:
    """roles.<name>.<section> given in part takes its other fields from the top-level section
    (as written, so file and override values, not schema defaults, are inherited)."""
    roles = data.get("roles")
    if not isinstance(roles, dict):
        return data
    for role in roles.values():
        if not isinstance(role, dict):
            continue  # build() reports the type error with its key
        for section in ROLE_SECTIONS:
            top = data.get(section)
            if isinstance(role.get(section), dict) and isinstance(top, dict):
                role[section] = deep_merge(top, role[section])
    return data


def config_to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def config_to_yaml(cfg) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


def save_config(cfg, path: str) -> None:
    """Write the resolved config atomically (a reader never sees half a file)."""
    write_atomic(path, config_to_yaml(cfg))
