"""The `megarl` command.

    megarl sft --config configs/tiny_sft.yaml optim.lr=1e-3 train.steps=100
    megarl rm  --config configs/tiny_rm.yaml
    megarl rl  --config configs/tiny_grpo.yaml
    megarl dpo --config configs/tiny_dpo.yaml
    megarl pipeline --config configs/tiny_pipeline.yaml [--stages rm,rl]
    megarl eval --config configs/tiny_grpo.yaml [--checkpoint runs/x/rl/checkpoints | --hf DIR]
    megarl validate --config configs/x.yaml --world-size 8 [--stage sft|rm|rl|eval|pipeline]
    megarl preprocess --input data.jsonl --out shards/ --kind sft --config configs/x.yaml
    megarl synthetic --out data/
    megarl convert hf-to-megarl|megarl-to-hf ...
    megarl report runs/quickstart
    megarl doctor [--gpu] [--quick] [--json out.json]

User mistakes print one line (`megarl: error: ...`) and exit 2; --debug (or MEGARL_DEBUG=1)
shows the traceback. A pre-empted run exits 75 after checkpointing, for the launcher to requeue.
"""
from __future__ import annotations

import argparse
import errno
import os
import sys

EXIT_USAGE = 2
GPU_TARGETS = ("a100", "b200", "h100", "h200")  # megarl.config.fp8.TARGETS (not imported: --help stays fast)
# megarl.config.hf.MODEL_TYPES, megarl-to-hf's --arch names (not imported: --help stays fast)
HF_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral")

OVERRIDES_HELP = "dotted overrides section.key=value, e.g. optim.lr=1e-5 parallel.tp=2"


def _config_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--config", required=required, metavar="FILE", help="YAML config (may 'extends:' others)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=OVERRIDES_HELP)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megarl", description="Megatron-style 3D-parallel post-training: SFT -> reward model -> RL.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("sft", help="supervised fine-tuning (masked next-token loss)")
    _config_args(p)
    p = sub.add_parser("rm", help="reward-model training (pairwise Bradley-Terry)")
    _config_args(p)
    p = sub.add_parser("rl", help="RL on colocated roles: GRPO, PPO (critic + GAE), RLOO, REINFORCE(++)")
    _config_args(p)
    p = sub.add_parser("dpo", help="direct preference optimisation (DPO, IPO, SimPO) on preference pairs")
    _config_args(p)
    p = sub.add_parser("pipeline", help="SFT -> reward model -> RL in one run dir from one config",
                       description="Shared sections apply to every stage; stages.<sft|dpo|rm|rl> hold each stage's own "
                                   "values. Overrides: key=value sets the key in every stage (over the stage sections' values); "
                                   "stages.<stage>.key=value sets one stage and wins over a shared one.")
    p.add_argument("--stages", default="sft,rm,rl", help="comma-separated stages among sft,dpo,rm,rl, run in that order (default: sft,rm,rl)")
    _config_args(p)
    p = sub.add_parser("eval", help="pass@1 / pass@k / mean@k of a model on held-out prompts (sampled)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", default=None,
                     help="a megarl checkpoint (step dir or root with 'latest'), or a stage name: sft, rl "
                          "(default: sft of train.run_dir)")
    src.add_argument("--hf", default=None, help="a Hugging Face model directory")
    _config_args(p)
    p = sub.add_parser("validate", help="check a config against a world size, without running")
    _config_args(p)
    p.add_argument("--world-size", type=int, default=None, help="default: $WORLD_SIZE or 1")
    p.add_argument("--gpu-target", choices=sorted(GPU_TARGETS), default=None,
                   help="check the device rules (FP8) and the memory estimate for this GPU instead of this "
                        "machine's, e.g. on a login node; assumes megarl's supported Transformer Engine there")
    p.add_argument("--stage", choices=["sft", "rm", "rl", "dpo", "eval", "pipeline"], default=None,
                   help="also check that stage's own rules and inputs (rl, eval: batch split, sequence lengths, "
                        "rewards; pipeline: a `megarl pipeline` config, every stage; default: a pipeline config "
                        "is recognised by its 'stages' section)")
    p = sub.add_parser("preprocess", help="tokenize JSONL into numpy shards (for data.loader=dali)")
    p.add_argument("--input", required=True, help="JSONL file (SFT or preference records)")
    p.add_argument("--out", required=True, help="output directory (written atomically)")
    p.add_argument("--kind", required=True, choices=["sft", "preferences"])
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    _config_args(p, required=False)
    p = sub.add_parser("synthetic", help="write the seeded synthetic arithmetic task (SFT, preferences, prompts)",
                       description="Writes the task a stage with the same config writes to <run_dir>/data: "
                                   "data.synthetic and seed data.seed (else train.seed) of --config, or of "
                                   "the defaults. The flags below override those.")
    p.add_argument("--out", required=True)
    p.add_argument("--n-train", type=int, default=None, help="default: data.synthetic.n_train")
    p.add_argument("--n-test", type=int, default=None, help="default: data.synthetic.n_test")
    p.add_argument("--seed", type=int, default=None, help="default: data.seed, else train.seed (as the stages)")
    p.add_argument("--rejects", choices=["operand", "slip"], default=None,
                   help="the preference pairs' kind of mistake (default: data.synthetic.rejects)")
    p.add_argument("--sft-mistakes", type=float, default=None,
                   help="share of train SFT demonstrations with one such mistake (default: data.synthetic.sft_mistakes)")
    _config_args(p, required=False)
    p = sub.add_parser("convert", help="Hugging Face <-> megarl weights")
    conv = p.add_subparsers(dest="direction", required=True, metavar="DIRECTION")
    c = conv.add_parser("hf-to-megarl", help="an HF Llama/Qwen2/Qwen3/Mistral/Qwen3-MoE/Mixtral directory -> a megarl checkpoint")
    c.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors)")
    c.add_argument("--out", required=True, help="megarl checkpoint root to write")
    c.add_argument("--role", default="sft", help="role name inside the checkpoint (default: sft)")
    c.add_argument("--overwrite", action="store_true", help="replace a non-empty --out (default: refuse)")
    c = conv.add_parser("megarl-to-hf", help="a megarl checkpoint -> an HF directory")
    c.add_argument("--checkpoint", required=True, help="megarl checkpoint (a step dir or a root with 'latest')")
    c.add_argument("--out", required=True, help="HF directory to write (atomically)")
    c.add_argument("--arch", required=True, choices=HF_MODEL_TYPES, help="the Hugging Face model_type to write")
    c.add_argument("--tokenizer", default=None, help="directory whose tokenizer files are copied along (default: "
                   "the tokenizer the model's config.yaml names; hf-to-megarl records the HF one)")
    c.add_argument("--overwrite", action="store_true", help="replace a non-empty --out (default: refuse)")
    c.add_argument("--adapter", action="store_true",
                   help="model.lora: write the adapters as a peft adapter directory (default: merge them into the base)")
    _config_args(c, required=False)
    p = sub.add_parser("doctor", help="versions, devices and (--gpu) GPU checks of this machine, as a table and JSON",
                       description="The support table, devices and csrc build of this machine; --gpu runs the "
                                   "GPU checks (gpu tests, kernel bandwidth, FP8 vs BF16, offload, rollout and "
                                   "RL-step figures), each PASS / FAIL / SKIPPED with its reason.")
    from megarl.cli.doctor import add_arguments

    add_arguments(p)
    p = sub.add_parser("report", help="PNG plots and a markdown summary of a run from MLflow")
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="default: <run_dir>/report")
    return parser


RULES = {"rl": "rl", "eval": "rl"}  # commands whose config has rules of its own (validate_config's stage)


def _device(args):
    """The GPU `megarl validate --gpu-target` names (None: this machine's)."""
    from megarl.config.fp8 import TARGETS

    return TARGETS[args.gpu_target] if getattr(args, "gpu_target", None) else None


def _memory_lines(cfg, args) -> list[str]:
    """`megarl validate`'s per-GPU memory estimate (models/memory.py) for the stage checked."""
    from megarl.config.fp8 import detect_device
    from megarl.models.memory import estimate, format_estimate

    stage = {"rl": "rl", "rm": "rm", None: "sft", "sft": "sft"}.get(args.stage)
    if stage is None:  # eval: generation only
        return []
    roles = None
    if stage == "rl":
        from megarl.trainers.weights import needed_roles

        roles = needed_roles(cfg)
    device = _device(args) or detect_device()
    return format_estimate(estimate(cfg, _world(args), stage, roles), device.memory_bytes, device.name)


def _print_memory(cfg, args) -> None:
    for line in _memory_lines(cfg, args):
        print(line, flush=True)


def _load(args):
    """The config, checked in one pass: its keys and values, the cross-field rules and the
    stage's inputs (data files, tokenizer, checkpoints); every problem found is one line of one
    error. Inputs are checked where a key they depend on is wrong too, but not rules, whose
    lines would be about the defaults standing in for the wrong keys."""
    from megarl.config import ConfigError, check_config, load_config
    from megarl.trainers.data_setup import preflight

    problems: list = []
    cfg = load_config(args.config, args.overrides, problems)
    stage = args.stage if args.command == "validate" else args.command
    bad = [key for key, _ in problems]
    rules = [] if bad else check_config(cfg, _world(args), stage=RULES.get(stage), device=_device(args))
    inputs = [line for line in preflight(cfg, stage) if not any(key in line for key in bad)]
    errs = [msg for _, msg in problems] + rules + inputs
    if not errs:
        return cfg
    e = ConfigError(errs[0] if len(errs) == 1 and not rules else
                    ("invalid config:\n  " if bad or rules else "cannot start:\n  ") + "\n  ".join(errs))
    e.config = None if bad or rules else cfg  # a valid config whose inputs are missing
    raise e


def _is_pipeline_config(args) -> bool:
    """`megarl validate --stage pipeline`, or no --stage and a config with a 'stages' section."""
    if args.stage is not None:
        return args.stage == "pipeline"
    from megarl.config.loader import read_yaml
    from megarl.config.shipped import resolve_config_path

    return "stages" in read_yaml(resolve_config_path(args.config))


def _validate_pipeline(args) -> None:
    """Every stage's rules at this world size, and the inputs of its first stage (the later ones
    start from the checkpoints the earlier ones write; `megarl pipeline` checks each at its start)."""
    from megarl.trainers.data_setup import check_preflight
    from megarl.trainers.pipeline import check_stages, load_pipeline_config

    configs = load_pipeline_config(args.config, args.overrides)
    check_stages(configs, _world(args), where=args.config)
    check_preflight(configs["sft"], "sft")


def _world(args) -> int:
    """--world-size when given (0 and negatives are checked, not replaced), else the environment's."""
    from megarl.runtime.distributed import world_size_from_env

    given = getattr(args, "world_size", None)
    return given if given is not None else world_size_from_env()


def run(args) -> int:
    if args.command in ("sft", "rm", "rl", "dpo"):
        cfg = _load(args)
        if args.command == "sft":
            from megarl.trainers.sft import main
        elif args.command == "rm":
            from megarl.trainers.reward_model import main
        elif args.command == "dpo":
            from megarl.trainers.dpo import main
        else:
            from megarl.trainers.rl import main
        main(cfg)
        return 0
    if args.command == "pipeline":
        from megarl.trainers.pipeline import run_pipeline

        run_pipeline(args.config, args.overrides, [x.strip() for x in args.stages.split(",") if x.strip()])
        return 0
    if args.command == "eval":
        from megarl.trainers.evaluate import run_eval

        run_eval(_load(args), checkpoint=args.checkpoint, hf=args.hf)
        return 0
    if args.command == "validate":
        if _is_pipeline_config(args):
            _validate_pipeline(args)
        else:  # the memory estimate of a valid config; its problems and its inputs' in one error
            from megarl.config import ConfigError

            try:
                cfg = _load(args)
            except ConfigError as e:
                cfg = getattr(e, "config", None)
                if cfg is None:
                    raise
                _print_memory(cfg, args)  # the config holds; its inputs are elsewhere (a login node)
                raise
            _print_memory(cfg, args)
        source = "--world-size" if args.world_size is not None else "$WORLD_SIZE or 1"
        print(f"{args.config}: valid for world size {_world(args)} ({source})")
        return 0
    if args.command == "preprocess":
        from megarl.config import load_config
        from megarl.data import load_tokenizer, preprocess

        cfg = load_config(args.config, args.overrides)
        tok = load_tokenizer(cfg.tokenizer.kind, cfg.tokenizer.path)
        index = preprocess(args.input, args.out, tok, args.kind, cfg.data.seq_length, cfg.data.bad_records,
                           overwrite=args.overwrite, show_progress=True)
        print(f"wrote {args.out}: {index}")
        return 0
    if args.command == "synthetic":
        import dataclasses

        from megarl.config import ConfigError, load_config
        from megarl.data.synthetic import check_task, write_synthetic_dataset
        from megarl.trainers.data_setup import data_seed

        if os.path.exists(args.out) and not os.path.isdir(args.out):
            raise ConfigError(f"--out {args.out}: is a file, not a directory")
        cfg = load_config(args.config, args.overrides)
        flags = {"n_train": args.n_train, "n_test": args.n_test, "rejects": args.rejects,
                 "sft_mistakes": args.sft_mistakes}
        task = dataclasses.replace(cfg.data.synthetic, **{k: v for k, v in flags.items() if v is not None})
        seed = data_seed(cfg) if args.seed is None else args.seed
        files = write_synthetic_dataset(args.out, check_task(task), seed)
        print("\n".join(sorted(files.values())))
        return 0
    if args.command == "convert":
        from megarl.cli import convert

        return convert.run(args)
    if args.command == "doctor":
        from megarl.cli import doctor

        return doctor.run(args)
    if args.command == "report":
        from megarl.tracking import write_report

        out = write_report(args.run_dir, args.out)
        print(f"report written: {out}")
        return 0
    raise AssertionError(args.command)


def _rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))


def main(argv=None) -> int:
    from megarl.checkpoint.distributed import CheckpointError
    from megarl.config import ConfigError
    from megarl.data import DataError
    from megarl.rewards import RewardError
    from megarl.trainers.stops import EXIT_REQUEUE, Preempted, StageStopped

    args = build_parser().parse_args(argv)
    debug = args.debug or os.environ.get("MEGARL_DEBUG") == "1"
    if not debug:  # megatron-core's import-time notices about optional packages
        from megarl.utils.notices import ignore_megatron_notices

        ignore_megatron_notices(("is deprecated",))
    try:
        return run(args)
    except Preempted as e:
        if _rank() == 0:
            print(f"megarl: {e}", file=sys.stderr)
        return EXIT_REQUEUE
    except (ConfigError, DataError, CheckpointError, FileNotFoundError) as e:
        if debug:
            raise
        if _rank() == 0 or not isinstance(e, ConfigError):  # config errors are the same on every rank
            msg = f"{e.filename}: no such file" if isinstance(e, FileNotFoundError) and e.filename else str(e)
            print(f"megarl: error: {msg}", file=sys.stderr)
        return EXIT_USAGE
    except (NotADirectoryError, IsADirectoryError, PermissionError, FileExistsError) as e:
        if debug:
            raise
        # a path of the wrong kind, or one that cannot be created: named, with the OS's reason
        where = e.filename or ""
        print(f"megarl: error: {where}{': ' if where else ''}{e.strerror or e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:  # a full disk outside a checkpoint (those name the step and the last good one)
        if debug or e.errno != errno.ENOSPC:
            raise
        print(f"megarl: error: no space left on device{' while writing ' + str(e.filename) if e.filename else ''}",
              file=sys.stderr)
        return 1
    except (StageStopped, RewardError) as e:  # the run stopped itself; its last good checkpoint is kept
        if debug:
            raise
        if _rank() == 0:
            print(f"megarl: stopped: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("megarl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
