"""Config -> tokenizer, datasets and iterators for a stage, and the checks of its inputs
before anything is written (initial weights: weights.py).

The glue between `megarl.data` (plain functions of paths and ints) and the trainers.
"""
from __future__ import annotations

import os
import re

from megarl.config import Config, ConfigError
from megarl.runtime.distributed import barrier, is_rank0
from megarl.trainers import weights

# Which synthetic-task file each stage trains and evaluates on when data.train_path is unset.
SYNTHETIC = {"sft": ("train_sft.jsonl", "test_sft.jsonl"),
             "reward_model": ("train_prefs.jsonl", "test_prefs.jsonl"),
             "dpo": ("train_prefs.jsonl", "test_prefs.jsonl"),
             "rl": ("train_prompts.jsonl", "test_prompts.jsonl")}


def tokenizer(cfg: Config):
    from megarl.data import load_tokenizer

    tok = load_tokenizer(cfg.tokenizer.kind, cfg.tokenizer.path)
    if tok.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the tokenizer's "
                          f"vocabulary ({tok.vocab_size}); set model.vocab_size={tok.vocab_size}")
    return tok


def stage_paths(cfg: Config, stage: str) -> dict:
    """Train/eval files: the configured ones (data.train_path / eval_path; RL and eval:
    rl.prompts_path / eval_prompts_path). Without a train file, the seeded synthetic task under
    <run_dir>/data stands in for it and for an eval file not given; a train file without an eval
    file means no evaluation. `megarl eval` reads the eval file only."""
    section, keys = _sections(stage)
    given = getattr(cfg, section)
    paths = {}
    for which, key in zip(("train", "eval"), keys):
        paths[which] = getattr(given, key)
        if paths[which] and not os.path.exists(paths[which]):
            raise ConfigError(f"{section}.{key}: {paths[which]} does not exist")
    if stage == "eval":  # `megarl eval` reads held-out prompts only
        paths["train"] = None
    synthetic = not getattr(given, keys[0]) or stage == "eval"
    missing = [w for w in (("eval",) if stage == "eval" else ("train", "eval")) if synthetic and not paths[w]]
    if missing:
        out = os.path.join(os.path.abspath(cfg.train.run_dir), "data")
        _synthetic_task(cfg, out)
        names = dict(zip(("train", "eval"), SYNTHETIC["rl" if stage == "eval" else stage]))
        for which in missing:
            paths[which] = os.path.join(out, names[which])
    return paths


def _sections(stage: str) -> tuple[str, tuple[str, str]]:
    if stage in ("rl", "eval"):
        return "rl", ("prompts_path", "eval_prompts_path")
    return "data", ("train_path", "eval_path")


def data_seed(cfg: Config) -> int:
    """The seed of the data order and of the synthetic task: data.seed, else train.seed."""
    return cfg.data.seed if cfg.data.seed is not None else cfg.train.seed


def _synthetic_task(cfg: Config, out: str) -> None:
    """Write the synthetic task once per run dir (rank 0); a later stage with other settings is
    an error, since its data would no longer match the earlier stages'. Collective: every rank
    checks the settings and the written meta.json, so an error stops all ranks alike."""
    import json

    from megarl.data.synthetic import check_task, difficulty, write_synthetic_dataset

    syn = check_task(cfg.data.synthetic)
    seed = data_seed(cfg)
    meta_path = os.path.join(out, "meta.json")
    written = os.path.exists(meta_path)
    barrier()  # every rank has looked before rank 0 may write
    if not written:
        if is_rank0():
            write_synthetic_dataset(out, syn, seed)
        barrier()
        return
    with open(meta_path) as f:
        meta = json.load(f)
    want = {"seed": seed, "n_train": syn.n_train, "n_test": syn.n_test, "difficulty": difficulty(syn)}
    have = {k: meta.get(k) for k in want}
    # written before rejects / sft_mistakes existed
    have["difficulty"] = {"rejects": "slip", "sft_mistakes": 0.0, **(have["difficulty"] or {})}
    if have != want:
        diff = [f"{k}={have[k]}" for k in want if have[k] != want[k] and k != "difficulty"]
        diff += [f"synthetic.{k}={v}" for k, v in have["difficulty"].items() if want["difficulty"].get(k) != v]
        raise ConfigError(f"data.synthetic: {out} was generated with other settings ({', '.join(diff)}); "
                          "use those, a new train.run_dir, or delete that directory")


def dataset(cfg: Config, path: str, kind: str, tok, packing: bool | None = None):
    from megarl.data import build_preference_dataset, build_sft_dataset

    d = cfg.data
    if kind == "sft":
        return build_sft_dataset(path, tok, d.seq_length, d.bad_records, d.packing if packing is None else packing)
    return build_preference_dataset(path, tok, d.seq_length, d.bad_records)


def _dp():
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()


def train_iterator(cfg: Config, path: str, kind: str, tok, stage_dir: str):
    """This DP rank's micro-batches: torch DataLoader by default, DALI over preprocessed shards."""
    from megarl.data import DataIterator

    d = cfg.data
    rank, size = _dp()
    seed = data_seed(cfg)
    if d.loader == "dali":
        import torch

        from megarl.data import preprocess
        from megarl.data.dali import DaliDataIterator

        shards = path if os.path.isdir(path) else os.path.join(stage_dir, "shards")
        if shards != path and is_rank0() and not os.path.exists(os.path.join(shards, "index.json")):
            preprocess(path, shards, tok, "sft" if kind == "sft" else "preferences", d.seq_length,
                       d.bad_records, show_progress=True)
        barrier()
        device = torch.cuda.current_device() if torch.cuda.is_available() else None
        return DaliDataIterator(shards, d.micro_batch_size, d.global_batch_size, rank, size, seed=seed,
                                packing=d.packing and kind == "sft", device_id=device)
    return DataIterator(dataset(cfg, path, kind, tok), d.micro_batch_size, d.global_batch_size, rank, size,
                        seed=seed, num_workers=d.num_workers)


def eval_microbatches(cfg: Config, ds) -> list[dict]:
    """The same held-out micro-batches at every evaluation (no shuffling, from the start)."""
    from megarl.data import DataIterator

    d = cfg.data
    rank, size = _dp()
    it = DataIterator(ds, d.micro_batch_size, d.global_batch_size, rank, size, seed=0, shuffle=False)
    n_micro = d.global_batch_size // (d.micro_batch_size * size)
    return [next(it) for _ in range(cfg.train.eval_batches * n_micro)]


def eval_prompts(cfg: Config, path: str, tok, n: int) -> list[dict]:
    """The first n held-out conversations as prompts (all turns but the last assistant reply)."""
    if n <= 0:
        return []
    from megarl.data import Report, extract_answer
    from megarl.data.formats import read_sft

    out = []
    for rec in read_sft(path, Report(path, "skip")):
        prompt = rec.messages[:-1]
        ids, _ = tok.encode_chat(prompt, add_generation_prompt=True)
        out.append({"prompt_ids": ids, "prompt": prompt[-1]["content"],
                    "answer": extract_answer(rec.messages[-1]["content"])})
        if len(out) == n:
            break
    return out


def prompt_dataset(cfg: Config, path: str):
    """RL prompts (JSONL with prompt/answer, bare strings, GSM8K) rendered with the generation prompt."""
    from megarl.data import build_prompt_dataset

    return build_prompt_dataset(path, tokenizer(cfg), cfg.rl.max_prompt_len, cfg.data.bad_records)


# ---------------------------------------------------------------------------------------------
# Checks before anything is written (stage_session, `megarl validate`)

STAGE_ALIASES = {"rm": "reward_model"}


def preflight(cfg: Config, stage: str | None) -> list[str]:
    """What would make `stage` fail on its inputs, one line each: a run dir that cannot be made,
    missing data or tokenizer files, a tokenizer larger than model.vocab_size, a dataset smaller
    than one batch, no checkpoint to start from, a finished stage asked for with another config.
    stage: "sft", "reward_model"/"rm", "rl", "dpo"; None:
    the checks every stage shares; another name (e.g. "eval"): run dir and tokenizer only.
    Cheap (counts lines, loads the tokenizer); runs before the run dir is touched, on every rank."""
    stage = STAGE_ALIASES.get(stage, stage)
    errs = _run_dir_errors(cfg.train.run_dir) + _from_hf_errors(cfg) + _tokenizer_errors(cfg)
    if stage in ("rl", "eval"):
        errs += _reward_fn_errors(cfg, stage) + tool_errors(cfg)
    if stage == "eval":  # its held-out prompts; the checkpoint is named on the command line
        return errs + _data_errors(cfg, "rl", ("eval_prompts_path",), 0, "")
    if stage not in (None, "sft", "reward_model", "rl", "dpo"):
        return errs
    if stage == "rl":
        r = cfg.rl
        errs += _data_errors(cfg, "rl", ("prompts_path", "eval_prompts_path"), r.prompts_per_step,
                             "rl.prompts_per_step")
        errs += weights.role_source_errors(cfg)
    else:
        errs += _data_errors(cfg, "data", ("train_path", "eval_path"), cfg.data.global_batch_size,
                             "data.global_batch_size", synthetic=stage is not None)
        init = cfg.model.init_from
        if stage == "sft" and init:
            found = weights.source_errors(cfg, init, "model.init_from")
            errs += found or weights.content_errors(init, "model.init_from", cfg.model, "sft")
    if stage == "dpo":
        errs += weights.role_source_errors(cfg, weights.dpo_roles(cfg))
    if stage == "reward_model":
        errs += weights.source_errors(cfg, cfg.reward_model.init_from, "reward_model.init_from",
                                      "or set reward_model.init_from=null")
    return errs + (finished_stage_errors(cfg, stage) if stage is not None else [])


# What a finished stage is compared on: the sections it reads, less what does not change its
# weights (where it logs, how often it logs or evaluates, evaluation sizes, residency, workers).
_TRAINED_SECTIONS = ("model", "tokenizer", "data", "optim", "lr_schedule", "train")
_OWN_SECTIONS = {"sft": ("sft",), "reward_model": ("reward_model",), "rl": ("rl", "roles")}
_NEUTRAL = re.compile(r"^train\.(run_dir|log_interval|eval_interval|eval_batches)$|(^|\.)eval_|\.offload\.|"
                      r"^data\.num_workers$")
_NOT_READ = {"rl": re.compile(r"^data\.(?!synthetic\.|seed$|bad_records$)")}  # RL's batch is its prompts


def config_changes(saved: dict, asked: dict, stage: str) -> list[tuple[str, str, str]]:
    """(key, saved value, asked value) of each key that changes what `stage` trains."""
    from megarl.tracking import flatten_params

    sections = _TRAINED_SECTIONS + _OWN_SECTIONS.get(stage, ())
    old, new = flatten_params(saved), flatten_params(asked)
    unread = _NOT_READ.get(stage)
    return [(k, old.get(k, "-"), new.get(k, "-")) for k in sorted(set(old) | set(new))
            if k.split(".", 1)[0] in sections and not _NEUTRAL.search(k) and not (unread and unread.search(k))
            and old.get(k) != new.get(k)]


def finished_stage_errors(cfg: Config, stage: str) -> list[str]:
    """A stage finished in this run dir (its latest checkpoint at or past train.steps) with
    another config than the one asked for: one line naming the keys and the way out, instead of
    `already complete` with the new values silently unused."""
    import yaml

    from megarl.checkpoint.distributed import latest_checkpoint
    from megarl.config import config_to_dict

    stage_dir = os.path.join(os.path.abspath(cfg.train.run_dir), stage)
    saved_path = os.path.join(stage_dir, "config.yaml")
    latest = latest_checkpoint(os.path.join(stage_dir, "checkpoints")) if cfg.checkpoint.resume else None
    if latest is None or not os.path.isfile(saved_path):
        return []
    step = int(os.path.basename(latest).split("_")[1])
    if step < cfg.train.steps:
        return []  # unfinished: it resumes (and may continue with other settings, as pre-emption needs)
    with open(saved_path) as f:
        changes = config_changes(yaml.safe_load(f) or {}, config_to_dict(cfg), stage)
    if not changes:
        return []
    shown = ", ".join(f"{k} ({old} there, {new} asked)" for k, old, new in changes[:4])
    more = f" and {len(changes) - 4} more" if len(changes) > 4 else ""
    return [f"{stage}: already complete in {stage_dir} (step {step}) with another config: {shown}{more}; "
            "use a new train.run_dir, or checkpoint.resume=false to train it again there"]


def check_preflight(cfg: Config, stage: str | None) -> None:
    errs = preflight(cfg, stage)
    if errs:
        raise ConfigError("cannot start:\n  " + "\n  ".join(errs) if len(errs) > 1 else errs[0])


def _run_dir_errors(run_dir: str) -> list[str]:
    """train.run_dir must be a directory, or creatable: its nearest existing ancestor a writable directory."""
    path = os.path.abspath(run_dir)
    if os.path.exists(path):
        if not os.path.isdir(path):
            return [f"train.run_dir: {run_dir} is a file, not a directory"]
        return [] if os.access(path, os.W_OK) else [f"train.run_dir: {run_dir} is not writable"]
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return [f"train.run_dir: {run_dir} cannot be created: {parent} is a file"]
    if not os.access(parent, os.W_OK):
        return [f"train.run_dir: {run_dir} cannot be created: no write permission in {parent}"]
    return []


def _from_hf_errors(cfg: Config) -> list[str]:
    """A model.from_hf directory this machine lacks (the loader used the fields as written)."""
    models = {"model": cfg.model, **{f"roles.{n}.model": getattr(cfg.roles, n).model
                                     for n in ("actor", "reference", "critic", "reward")}}
    missing = {}
    for key, m in models.items():
        if m is not None and m.from_hf and not os.path.isdir(m.from_hf):
            missing.setdefault(m.from_hf, key)
    return [f"{key}.from_hf: {path} does not exist (the model fields as written were checked)"
            for path, key in missing.items()]


def _tokenizer_errors(cfg: Config) -> list[str]:
    from megarl.data import DataError, load_tokenizer

    t = cfg.tokenizer
    if t.path and not os.path.exists(t.path):
        return [f"tokenizer.path: {t.path} does not exist"]
    if t.path and not os.path.isdir(t.path):
        return [f"tokenizer.path: {t.path} is a file; expected a directory (with tokenizer.json)"]
    try:
        tok = load_tokenizer(t.kind, t.path)
    except (DataError, OSError, ValueError) as e:
        return [f"tokenizer: {e}"]
    if tok.vocab_size > cfg.model.vocab_size:
        return [f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the tokenizer's vocabulary "
                f"({tok.vocab_size}); set model.vocab_size={tok.vocab_size}"]
    return []


def _count_records(path: str) -> int | None:
    """Non-blank lines of a JSONL/text file (None for other kinds, e.g. a shard directory)."""
    if os.path.isdir(path) or path.endswith((".json", ".parquet")):
        return None
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def _data_errors(cfg: Config, section: str, keys: tuple, batch: int, batch_key: str, synthetic: bool = True) -> list[str]:
    """Every configured file of `keys` exists (an eval file counts without a train file too); the
    first key's file, or the synthetic task in its place, holds at least one batch."""
    given = getattr(cfg, section)
    errs = [f"{section}.{key}: {getattr(given, key)} does not exist" for key in keys
            if getattr(given, key) and not os.path.exists(getattr(given, key))]
    if errs or not batch:
        return errs
    train = getattr(given, keys[0])
    if not train:
        n = cfg.data.synthetic.n_train
        if synthetic and n < batch:
            return [f"data.synthetic.n_train ({n}) is smaller than one batch ({batch_key}={batch})"]
        return []
    n = _count_records(train)
    if n is not None and n < batch:
        errs.append(f"{section}.{keys[0]}: {train} has {n} records, fewer than one batch ({batch_key}={batch})")
    return errs


def tool_errors(cfg: Config) -> list[str]:
    """The python tool where its sandbox cannot run (bwrap missing, namespaces refused): one line
    before any role loads, never a fallback to running model-written code unsandboxed."""
    if not (cfg.rl.python_tool and "python" in cfg.rl.tools):
        return []
    from megarl.rollout.sandbox import unavailable

    reason = unavailable()
    return [f"rl.tools has python: {reason}"] if reason else []


def _reward_fn_errors(cfg: Config, stage: str) -> list[str]:
    """rl.reward_fn (RL) and rl.eval_reward_fn load: a typo or a missing module is one line here,
    not a traceback after every role is built."""
    from megarl.rewards import load_reward_fn

    keys = ("reward_fn", "eval_reward_fn") if stage == "rl" else ("eval_reward_fn",)
    errs = []
    for key in keys:
        spec = getattr(cfg.rl, key)
        if spec is None:
            continue
        try:
            load_reward_fn(spec)
        except Exception as e:  # a user module may raise anything on import
            errs.append(f"rl.{key}: {e}".splitlines()[0])
    return errs
