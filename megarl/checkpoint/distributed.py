"""Resumable, reshardable, atomic checkpoints on megatron-core dist_checkpointing.

Layout of a stage's checkpoint root:
    checkpoints/
      step_00000100/          one complete checkpoint (dist_checkpointing files + manifest)
        megarl_manifest.json  written last: step, layout, every file with its size
      latest                  text file naming the newest complete checkpoint, replaced last
A save writes into `.tmp-step_...`, makes every file durable, writes the manifest, renames
the directory, then replaces `latest`: a crash at any point leaves the previous checkpoint
intact and `latest` pointing at it. A load verifies the manifest before reading anything.

What is saved, per role: model weights (sharded tensors: any TP/PP/DP layout can load them),
optimizer state, LR scheduler. A LoRA role (model.lora) saves its adapters alone: its frozen
base is rebuilt from where it came from (model.init_from, roles.<name>.init_from) and the
adapters load onto it. Shared: the trainer's `state` dict (step, data position,
tracking run id, any controller state) and per-rank RNG states. RNG states are restored only
into the same layout they were saved from (a different layout has different ranks).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import shutil

import numpy as np
import torch

from megarl.checkpoint.write_results import FileQueue
from megarl.config.hf import model_fields
from megarl.models.lora import is_adapter
from megarl.roles.offload import resident_during
from megarl.runtime.distributed import barrier, is_rank0
from megarl.utils.atomic import write_atomic
from megarl.utils.processes import signals_blocked

MANIFEST = "megarl_manifest.json"
# Which run wrote a checkpoint, per root: the keep-N cleanup deletes only checkpoints of the run
# that is saving (a resumed run continues the id of the checkpoint it loaded), so a root shared
# by mistake (a conversion into a run's checkpoints dir) never loses what another run wrote.
_RUN_IDS: dict[str, str] = {}
# The distributed optimizer's state in a format any DP size can load (megatron-core 0.16 rejects
# the flattened-range default); the plain optimizer ignores it.
OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; str(e) names it and the last good one."""


def _layout() -> dict:
    from megatron.core import parallel_state as ps

    ep = ps.get_expert_model_parallel_world_size()
    return {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(), "cp": ps.get_context_parallel_world_size(),
            **({"ep": ep} if ep > 1 else {})}


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _set_rng_state(s: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if s["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(s["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(s["tracker"])


def _rng_sharded_object(data):
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    shape = (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size(),
             ps.get_data_parallel_world_size(with_context_parallel=True))
    offset = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
              ps.get_data_parallel_rank(with_context_parallel=True))
    return ShardedObject("rng_state", data, shape, offset, replica_id=0)


def _sharded_state_dict(roles: dict, state: dict, rng, is_loading: bool) -> dict:
    from megarl.models.layout import unwrap

    sd = {"state": state, "rng": _rng_sharded_object(rng)} if rng is not None else {"state": state}
    for name, role in roles.items():
        model_sd = unwrap(role.model).sharded_state_dict(prefix=f"{name}.model.")
        if _lora(role) is not None:  # the frozen base is not saved (see the module docstring)
            model_sd = {k: v for k, v in model_sd.items() if is_adapter(k)}
        entry = {"model": model_sd}
        if role.optimizer is not None:
            entry["optimizer"] = role.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=OPTIM_METADATA)
            entry["scheduler"] = role.scheduler.state_dict()
        sd[name] = entry
    return sd


def _lora(role):
    return getattr(getattr(role, "model_cfg", None), "lora", None)


def _fsync_tree(path: str) -> dict:
    """fsync every file and directory under path; return {relative file: size}."""
    files = {}
    for dirpath, _, names in os.walk(path):
        for n in names:
            full = os.path.join(dirpath, n)
            with open(full, "rb") as f:
                os.fsync(f.fileno())
            files[os.path.relpath(full, path)] = os.path.getsize(full)
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return files


def _signal_proof_write_queue() -> None:
    """megatron-core's checkpoint writer returns its results through a module-level queue whose
    default is served by a spawned multiprocessing Manager: it re-imports the user's `__main__`
    and a job's SIGTERM can kill it (write_results.py says why both break). Give megatron a
    FileQueue instead, once per process: no helper process at all."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is not None:  # set, or not this megatron
        return
    filesystem_async._results_queue = FileQueue()


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


@resident_during("roles")  # offloaded roles: resident while read, then as they were
def save_checkpoint(root: str, step: int, roles: dict, state: dict, keep_last: int = 2, *,
                    async_queue=None, on_durable=None) -> str:
    """Save every role plus `state` as checkpoint `step` under `root`; collective.

    With `async_queue` (megatron-core's AsyncCallsQueue) this returns once the tensors are staged
    in host memory and a background process writes them; the checkpoint becomes durable
    (manifest, rename, `latest`) when the queue finalizes the call, on every rank at the same
    step. `on_durable(path)` runs on every rank once it is.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    final = os.path.join(root, step_dir_name(step))
    tmp = os.path.join(root, ".tmp-" + step_dir_name(step))
    if is_rank0():
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # debris of an earlier crash
        os.makedirs(tmp)
    barrier()
    _signal_proof_write_queue()
    sd = _sharded_state_dict(roles, dict(state, step=step), _rng_state(), is_loading=False)

    shapes = {n: model_shape(r.model_cfg) for n, r in roles.items() if getattr(r, "model_cfg", None) is not None}
    # how a reward model is read (algorithms.losses.sequence_reward), so that RL reads it the same way
    pooling = {n: r.reward_pooling for n, r in roles.items() if getattr(r, "reward_pooling", None)}
    adapters = {n: dataclasses.asdict(_lora(r)) for n, r in roles.items() if _lora(r) is not None}

    def publish():
        with disk_full_named(root, tmp, step):
            _publish(root, tmp, final, step, sorted(roles), keep_last, shapes, pooling, adapters)
        if on_durable is not None:
            on_durable(final)

    if async_queue is None:
        with disk_full_named(root, tmp, step), signals_blocked():  # signals: the forked writers' are the trainer's
            dist_checkpointing.save(sd, tmp)
        publish()
    else:
        request = dist_checkpointing.save(sd, tmp, TorchDistSaveShardedStrategy("torch_dist", 1),
                                          async_sharded_save=True)
        request.add_finalize_fn(publish)
        with signals_blocked():  # the forked writer (and the processes it forks) likewise
            async_queue.schedule_async_request(request)
    return final


def is_disk_full(exc: BaseException, path: str) -> bool:
    """ENOSPC anywhere in `exc`'s chain (or a torch DCP failure's per-rank errors), or less than
    1 MiB left where `path` is: torch's writer reports a full disk as "unexpected pos N vs M"."""
    import errno

    stack, seen = [exc], set()
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if not isinstance(e, BaseException):
            continue
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        failures = getattr(e, "failures", None)  # torch DCP: {rank: (exception, traceback)}
        stack += [e.__cause__, e.__context__] + [f[0] if isinstance(f, tuple) else f for f in
                                                 (failures.values() if isinstance(failures, dict) else ())]
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < 1 << 20


@contextlib.contextmanager
def disk_full_named(root: str, tmp: str, step: int):
    """A save that fails for want of space: its temp dir removed, and one line naming the step,
    the directory and the last good checkpoint (instead of the writers' tracebacks)."""
    try:
        yield
    except BaseException as e:  # torch DCP's CheckpointException is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)) or not is_disk_full(e, root):
            raise
        if is_rank0():
            shutil.rmtree(tmp, ignore_errors=True)
        try:
            latest = latest_checkpoint(root)
        except CheckpointError:
            latest = None
        last = f"step {int(os.path.basename(latest).split('_')[1])}" if latest else "none (nothing saved yet)"
        raise CheckpointError(f"no space left on device while saving step {step} to {root}; "
                              f"the last good checkpoint is {last}") from e


def saving(root: str, step: int):
    """disk_full_named for the save of `step` under `root`, e.g. around an async save's publication."""
    return disk_full_named(root, os.path.join(root, ".tmp-" + step_dir_name(step)), step)


def run_id_for(root: str) -> str:
    """The id this process's run stamps on checkpoints under `root` (see _RUN_IDS)."""
    import uuid

    return _RUN_IDS.setdefault(os.path.abspath(root), uuid.uuid4().hex)


# ModelConfig fields that fix the saved tensors' shapes (the rest: numerics, init, impl).
SHAPE_KEYS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_kv_heads", "head_dim",
              "vocab_size", "qkv_bias", "qk_norm", "tie_embeddings", "moe.num_experts", "moe.expert_hidden",
              "moe.shared_expert_hidden")


def model_shape(model_cfg) -> dict:
    """The shape-defining fields of a ModelConfig, with null defaults resolved."""
    fields = model_fields(model_cfg)
    shape = {k: fields[k] for k in SHAPE_KEYS if not k.startswith("moe.")}
    moe = model_cfg.moe
    shape.update({"moe.num_experts": moe.num_experts, "moe.shared_expert_hidden": moe.shared_expert_hidden,
                  "moe.expert_hidden": (moe.expert_hidden or model_cfg.ffn_hidden_size) if moe.num_experts else 0})
    return shape


def check_model_shape(path: str, manifest: dict, saved_role: str, role) -> None:
    """CheckpointError naming every shape field where the checkpoint's model and `role`'s differ
    (instead of megatron's multi-line global shape mismatch). Checkpoints without the record pass."""
    saved = (manifest.get("models") or {}).get(saved_role)
    if saved is None or getattr(role, "model_cfg", None) is None:
        return
    want = model_shape(role.model_cfg)
    diff = [f"{k}={saved[k]} (config: {want[k]})" for k in SHAPE_KEYS if k in saved and saved[k] != want[k]]
    if diff:
        raise CheckpointError(f"{path}: the saved model does not match the configured one: model."
                              + ", model.".join(diff) + "; use the model section it was saved with")


def _load_one_line(load, path: str):
    """dist_checkpointing.load, with a shape mismatch reported in one line."""
    from megatron.core.dist_checkpointing.core import CheckpointingException

    try:
        return load()
    except CheckpointingException as e:
        first = next((ln.strip() for ln in str(e).splitlines() if "shape" in ln.lower()), str(e).splitlines()[0])
        raise CheckpointError(f"{path}: does not fit the configured model ({first[:300]})") from None


def _publish(root: str, tmp: str, final: str, step: int, role_names: list, keep_last: int,
             shapes: dict | None = None, pooling: dict | None = None, adapters: dict | None = None) -> None:
    """Make the written `tmp` durable and the newest checkpoint: fsync, manifest, rename, latest."""
    barrier()
    if is_rank0():
        run = run_id_for(root)
        files = _fsync_tree(tmp)
        manifest = {"step": step, "layout": _layout(), "roles": role_names, "files": files, "run": run,
                    "models": shapes or {}}
        if pooling:
            manifest["reward_pooling"] = pooling
        if adapters:  # roles saved as LoRA adapters alone, with their settings
            manifest["lora"] = adapters
        write_atomic(os.path.join(tmp, MANIFEST), json.dumps(manifest, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        write_atomic(os.path.join(root, LATEST), step_dir_name(step) + "\n")
        for old in stale_checkpoints(root, run, step, keep_last):
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    barrier()


def saved_reward_pooling(path: str, role_name: str) -> str:
    """How the reward model `role_name` saved in step dir `path` reads its per-token values into
    one reward ("last" for checkpoints without the record, HF directories and older megarl)."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            return (json.load(f).get("reward_pooling") or {}).get(role_name, "last")
    except (OSError, ValueError, AttributeError):
        return "last"


def _manifest_run(path: str) -> str | None:
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            return json.load(f).get("run")
    except (OSError, ValueError, AttributeError):
        return None


def stale_checkpoints(root: str, run: str, newest_step: int, keep_last: int) -> list[str]:
    """What keep-N cleanup may delete after `run` saved step `newest_step`: checkpoints `run`
    wrote, older than that step, beyond the newest `keep_last` of them; never the one `latest`
    names, never one another run (or an older megarl without run ids) wrote."""
    pointer = os.path.join(root, LATEST)
    named = open(pointer).read().strip() if os.path.isfile(pointer) else None
    ours = [n for n in list_checkpoints(root) if _manifest_run(os.path.join(root, n)) == run]
    ours = [n for n in ours if n <= step_dir_name(newest_step)]
    return [n for n in ours[:-keep_last] if n != named] if keep_last > 0 else []


def list_checkpoints(root: str) -> list[str]:
    """Complete checkpoint directory names under root, oldest first (no validation)."""
    if not os.path.isdir(root):
        return []
    return sorted(d for d in os.listdir(root) if d.startswith("step_") and os.path.isfile(os.path.join(root, d, MANIFEST)))


def verify_checkpoint(path: str) -> dict:
    """The manifest of a complete, intact checkpoint; CheckpointError otherwise."""
    mpath = os.path.join(path, MANIFEST)
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such checkpoint (expected a step directory or a root with '{LATEST}')")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: is a file, not a checkpoint directory")
    if not os.path.isfile(mpath):
        raise CheckpointError(f"{path}: incomplete checkpoint (no {MANIFEST}; the save did not finish)")
    try:
        with open(mpath) as f:
            manifest = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{mpath}: unreadable manifest ({e})") from None
    for rel, size in manifest["files"].items():
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            raise CheckpointError(f"{path}: corrupt checkpoint, missing file {rel}")
        if os.path.getsize(full) != size:
            raise CheckpointError(f"{path}: corrupt checkpoint, {rel} has {os.path.getsize(full)} bytes, expected {size}")
    return manifest


def _last_good(root: str, exclude: str) -> str:
    for name in reversed(list_checkpoints(root)):
        if name == exclude:
            continue
        try:
            verify_checkpoint(os.path.join(root, name))
            return os.path.join(root, name)
        except CheckpointError:
            continue
    return "none"


def latest_checkpoint(root: str) -> str | None:
    """The checkpoint `latest` names, verified; None when the root has none yet."""
    pointer = os.path.join(root, LATEST)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        name = f.read().strip()
    path = os.path.join(root, name)
    try:
        verify_checkpoint(path)
    except CheckpointError as e:
        raise CheckpointError(f"{e}; last good checkpoint: {_last_good(root, name)}") from None
    return path


def resolve_checkpoint(path: str) -> str:
    """The step directory `path` stands for: the one its `latest` pointer names (verified) when
    `path` is a checkpoint root, else `path` itself (a step dir, verified when it is loaded).
    The one place a `latest` pointer or a step dir given by a user is resolved."""
    if os.path.isfile(os.path.join(path, LATEST)):
        return latest_checkpoint(path)
    return path


@resident_during("roles")
def load_checkpoint(path: str, roles: dict, *, load_optimizer: bool = True) -> dict:
    """Load roles (any layout) from a verified checkpoint; returns the saved `state` dict."""
    from megatron.core import dist_checkpointing

    from megarl.models.layout import unwrap

    manifest = verify_checkpoint(path)
    if manifest.get("run") and is_rank0():  # a resumed run goes on cleaning up its own checkpoints
        _RUN_IDS[os.path.abspath(os.path.dirname(os.path.normpath(path)))] = manifest["run"]
    missing = sorted(set(roles) - set(manifest["roles"]))
    if missing:
        raise CheckpointError(f"{path}: has no role(s) {', '.join(missing)} (saved: {', '.join(manifest['roles'])})")
    for name, role in roles.items():
        check_model_shape(path, manifest, name, role)
    same_layout = manifest["layout"] == _layout()
    saved_ep, ep = manifest["layout"].get("ep", 1), _layout().get("ep", 1)
    if load_optimizer and (saved_ep > 1) != (ep > 1) and any(r.optimizer is not None for r in roles.values()):
        raise CheckpointError(f"{path}: saved at parallel.ep={saved_ep}, resumed at ep={ep}: megatron-core keeps the "
                              "experts' optimizer state apart only under expert parallelism, so it resumes between "
                              "ep > 1 layouts (or ep=1 ones) only; its weights load at any ep (model.init_from)")
    wanted = {n: r for n, r in roles.items()}
    sd = _sharded_state_dict(wanted, {}, _rng_state() if same_layout else None, is_loading=True)
    if not load_optimizer:
        for entry in sd.values():
            if isinstance(entry, dict):
                entry.pop("optimizer", None)
                entry.pop("scheduler", None)
    loaded = _load_one_line(lambda: dist_checkpointing.load(sd, path), path)
    for name, role in roles.items():
        prefix = f"{name}.model."
        weights = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in loaded[name]["model"].items()}
        result = unwrap(role.model).load_state_dict(weights, strict=_lora(role) is None)
        if _lora(role) is not None and ([k for k in result.missing_keys if is_adapter(k)] or result.unexpected_keys):
            raise CheckpointError(f"{path}: the {name}'s adapters do not fit model.lora")
        if load_optimizer and role.optimizer is not None:
            role.optimizer.load_state_dict(loaded[name]["optimizer"])
            role.scheduler.load_state_dict(loaded[name]["scheduler"])
    if same_layout and "rng" in loaded:
        _set_rng_state(loaded["rng"])
    return loaded["state"]


@resident_during("role")
def load_weights(path: str, role, *, saved_role: str | None = None, skip_head: bool = False) -> None:
    """Model weights only (no optimizer) from a checkpoint, into `role` at any layout.

    saved_role: the role name inside the checkpoint (default: its only role). skip_head: leave
    `output_layer.*` as initialised, e.g. a reward model's scalar head started from an SFT model.
    """
    from megatron.core import dist_checkpointing

    from megarl.models.layout import unwrap

    manifest = verify_checkpoint(path)
    if saved_role is None:
        if len(manifest["roles"]) != 1:
            raise CheckpointError(f"{path}: holds roles {', '.join(manifest['roles'])}; name the one to load")
        saved_role = manifest["roles"][0]
    if saved_role not in manifest["roles"]:
        raise CheckpointError(f"{path}: has no role {saved_role} (saved: {', '.join(manifest['roles'])})")
    check_model_shape(path, manifest, saved_role, role)
    prefix = f"{saved_role}.model."
    model = unwrap(role.model)
    sd = model.sharded_state_dict(prefix=prefix)
    if skip_head:
        sd = {k: v for k, v in sd.items() if not k[len(prefix):].startswith("output_layer.")}
    # adapters alone load onto a base already loaded; a dense checkpoint leaves the adapters as they are
    adapters_only = saved_role in (manifest.get("lora") or {})
    if adapters_only and _lora(role) is None:
        raise CheckpointError(f"{path}: holds the {saved_role}'s LoRA adapters only; load them with model.lora set and "
                              "model.init_from at their base, or export them merged (megarl convert megarl-to-hf)")
    sd = {k: v for k, v in sd.items() if is_adapter(k) == adapters_only}
    loaded = _load_one_line(lambda: dist_checkpointing.load(sd, path), path)
    weights = {k[len(prefix):]: v for k, v in loaded.items() if k.startswith(prefix)}
    result = model.load_state_dict(weights, strict=False)
    missing = [k for k in result.missing_keys if not (skip_head and k.startswith("output_layer."))
               and is_adapter(k) == adapters_only]
    if missing or result.unexpected_keys:
        raise CheckpointError(f"{path}: weights do not fit this model (missing {missing}, unexpected {result.unexpected_keys})")
    if getattr(role, "optimizer", None) is not None:  # bf16/fp16: fp32 main params would undo the load at the next step
        role.optimizer.reload_model_params()
