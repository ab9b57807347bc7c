"""`python -m megarl.tracking report RUN_DIR [--out DIR]` and `... replay RUN_DIR [--uri URI]`."""
import argparse
import logging
import sys

from . import replay_spill, write_report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megarl.tracking")
    sub = ap.add_subparsers(dest="cmd", required=True)
    rep = sub.add_parser("report", help="write PNG plots and report.md for a run dir")
    rep.add_argument("run_dir")
    rep.add_argument("--out", default=None, help="default: <run_dir>/report")
    rep.add_argument("--uri", default=None, help="default: the store recorded in tracking.json")
    rp = sub.add_parser("replay", help="deliver the tracking_spill*.jsonl of a run dir and of its stage and eval "
                                       "dirs to MLflow")
    rp.add_argument("run_dir")
    rp.add_argument("--uri", default=None)
    rp.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.cmd == "report":
        print(write_report(args.run_dir, args.out, uri=args.uri))
        return 0
    return 0 if replay_spill(args.run_dir, uri=args.uri, timeout=args.timeout) else 1


if __name__ == "__main__":
    sys.exit(main())
