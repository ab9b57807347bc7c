"""The `megarl` command.

    megarl sft --config configs/tiny_sft.yaml optim.lr=1e-4 parallel.tp=2
    megarl rm  --config configs/tiny_rm.yaml
    megarl validate --config configs/x.yaml --world-size 8
    megarl preprocess --input data.jsonl --out shards/ --kind sft --config configs/x.yaml
    megarl synthetic --out data/
    megarl convert hf-to-megarl|megarl-to-hf ...
    megarl report runs/quickstart

User mistakes print one line (`megarl: error: ...`) and exit 2; --debug (or MEGARL_DEBUG=1)
shows the traceback. A pre-empted run exits 75 after checkpointing, for the launcher to requeue.
"""
from __future__ import annotations

import argparse
import os
import sys

EXIT_USAGE = 2

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
    p = sub.add_parser("validate", help="check a config against a world size, without running")
    _config_args(p)
    p.add_argument("--world-size", type=int, default=None, help="default: $WORLD_SIZE or 1")
    p = sub.add_parser("preprocess", help="tokenize JSONL into numpy shards (for data.loader=dali)")
    p.add_argument("--input", required=True, help="JSONL file (SFT or preference records)")
    p.add_argument("--out", required=True, help="output directory (written atomically)")
    p.add_argument("--kind", required=True, choices=["sft", "preferences"])
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    _config_args(p, required=False)
    p = sub.add_parser("synthetic", help="write the seeded synthetic arithmetic task (SFT, preferences, prompts)")
    p.add_argument("--out", required=True)
    p.add_argument("--n-train", type=int, default=2000)
    p.add_argument("--n-test", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rejects", choices=["operand", "slip"], default="operand",
                   help="the preference pairs' kind of mistake (default: operand)")
    p = sub.add_parser("convert", help="Hugging Face <-> megarl weights")
    conv = p.add_subparsers(dest="direction", required=True, metavar="DIRECTION")
    c = conv.add_parser("hf-to-megarl", help="an HF Llama/Qwen2/Qwen3/Mistral directory -> a megarl checkpoint")
    c.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors)")
    c.add_argument("--out", required=True, help="megarl checkpoint root to write")
    c.add_argument("--role", default="sft", help="role name inside the checkpoint (default: sft)")
    c = conv.add_parser("megarl-to-hf", help="a megarl checkpoint -> an HF directory")
    c.add_argument("--checkpoint", required=True, help="megarl checkpoint (a step dir or a root with 'latest')")
    c.add_argument("--out", required=True, help="HF directory to write (atomically)")
    c.add_argument("--arch", required=True, choices=["llama", "qwen2", "qwen3", "mistral"])
    c.add_argument("--tokenizer", default=None, help="directory whose tokenizer files are copied along")
    _config_args(c, required=False)
    p = sub.add_parser("report", help="PNG plots and a markdown summary of a run from MLflow")
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, help="default: <run_dir>/report")
    return parser


def _load(args):
    from megarl.config import load_config, validate_config
    from megarl.runtime.distributed import world_size_from_env

    cfg = load_config(args.config, args.overrides)
    world = getattr(args, "world_size", None) or world_size_from_env()
    validate_config(cfg, world)
    return cfg


def run(args) -> int:
    if args.command in ("sft", "rm"):
        cfg = _load(args)
        if args.command == "sft":
            from megarl.trainers.sft import main
        else:
            from megarl.trainers.reward_model import main
        main(cfg)
        return 0
    if args.command == "validate":
        cfg = _load(args)
        print(f"{args.config}: valid for world size {args.world_size or 'from environment'}")
        del cfg
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
        from megarl.data import write_synthetic_dataset
        from megarl.data.synthetic import Difficulty

        files = write_synthetic_dataset(args.out, n_train=args.n_train, n_test=args.n_test, seed=args.seed,
                                        difficulty=Difficulty(rejects=args.rejects))
        print("\n".join(sorted(files.values())))
        return 0
    if args.command == "convert":
        from megarl.cli import convert

        return convert.run(args)
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
    from megarl.trainers.loop import EXIT_REQUEUE, Preempted

    args = build_parser().parse_args(argv)
    debug = args.debug or os.environ.get("MEGARL_DEBUG") == "1"
    if not debug:  # megatron-core's import-time notices about optional packages
        import warnings

        for text in ("Transformer Engine and Apex are not installed", "Apex is not installed",
                     "full scope is deprecated", "is deprecated"):
            warnings.filterwarnings("ignore", message=f".*{text}.*")
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
            msg = str(e) if not isinstance(e, FileNotFoundError) else f"{e.filename}: no such file"
            print(f"megarl: error: {msg}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("megarl: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
