"""`megarl doctor`: what this machine has, whether megarl supports it, and (--gpu) whether it works.

    megarl doctor [--gpu] [--quick] [--tests EXPR] [--hbm-tbps X] [--json out.json]
    torchrun ... -m megarl.cli.main doctor --allreduce [--min-busbw GBPS]   # once per rank

The CPU half always runs: the version table (each component, the versions megarl supports, and a
status), the devices (memory, compute capability, FP8 support) and whether the csrc extension is
built. --gpu adds the checks no CPU can make, each PASS / FAIL / SKIPPED with its reason:

  gpu_tests       the `gpu`-marked tests (pytest -m gpu; --tests EXPR: a -k subset; --quick: the
                  kernel and attention files)
  kernels_hbm     bench/bench_gpu_ops.py: the fused kernels' achieved GB/s against the device's HBM
                  peak; PASS when every megarl row reaches HBM_FLOORS
  fp8_vs_bf16     tests/test_fp8.py's 50-step SFT loss curves, FP8 against BF16 (Hopper+ and TE)
  offload_memory  tests/test_offload.py's CUDA offload: bit-exact, and device memory freed
  fused_head      bench/bench_gpu_ops.py --head: the fused output layer + log-prob at 8 x 2,048
                  tokens and V = 152k (bf16); PASS when its extra peak memory, scoring and
                  training, stays <= HEAD_MEMORY_PCT of one fp32 [tokens, V] logits tensor
  rl_step         bench/bench_gpu_ops.py --rl-step: rollout tokens/s and the RL step's MFU at a
                  1B-class shape (PASS: it ran and gave finite figures; the numbers are the result)
  decode          bench/bench_gpu_ops.py --decode: the rollout at the 1B shape, 64 rows, decode
                  steps eager / graph-safe / CUDA graphs: tokens/s and the step against its HBM
                  floor (PASS: all three ran with finite figures; the numbers are the result)

--allreduce (every rank, under torchrun: launchers/slurm/doctor.sbatch on 2 nodes) measures the
all-reduce bus bandwidth (fp32, 1/16/256 MiB, checked sums) over NCCL, or gloo on CPU.

The checks run as subprocesses of this checkout's tests/ and bench/ (an installed wheel has neither:
then they are SKIPPED). The exit status is 1 when a required component is missing or a check
FAILs, else 0 (on a CPU machine the GPU rows are SKIPPED, which is not a failure).

--json PATH writes the report (schema "megarl-doctor/1", checked by `check_report`):
  schema, megarl, time (UTC, ISO 8601), host, gpu (bool: --gpu given), quick (bool)
  versions: [{name, version (null: absent), supported (the range, words), status, note}]
            status: ok | unsupported | missing (required, absent) | absent (optional) | not used
  devices:  [{index, name, memory_bytes, capability "9.0", fp8 (bool), mxfp8 (bool)}]
  csrc:     {built (bool), detail, cpu: {built (bool), detail}}
  checks:   [{name, status PASS|FAIL|SKIPPED, reason, seconds, details {}}]
  summary:  {pass, fail, skipped, problems (versions missing or unsupported)}
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from megarl.config.fp8 import BLACKWELL, HOPPER, DeviceInfo, installed_version, version_at_least

SCHEMA = "megarl-doctor/1"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout's root
# megarl's own kernels must reach this share of the HBM peak (bench_gpu_ops.py's % of peak):
# the log-prob op is one read (fwd) or read + read + write (fwd+bwd) of the logits; GAE is a
# 12.5 us kernel on an H100, where launch and tail effects weigh more
HBM_FLOORS = {"logprobs_fwd": 50.0, "logprobs_fwd_bwd": 50.0, "gae_graph": 25.0}
# the fused head's extra peak memory (bench_gpu_ops.py --head), % of one fp32 [tokens, V] logits
# tensor: one chunk of logits (and its gradient) at 8 x 2,048 tokens, V = 152k
HEAD_MEMORY_PCT = 10.0
QUICK_TESTS = ["tests/test_ops_logprobs.py", "tests/test_ops_gae.py", "tests/test_attention.py"]


# ------------------------------------------------------------------------------------ versions


@dataclass(frozen=True)
class Component:
    name: str
    dists: tuple  # probe keys, first found wins: distribution names, or python, cuda, nccl, driver
    required: bool
    low: Optional[str] = None  # supported: low <= version < high
    high: Optional[str] = None
    note: str = ""


COMPONENTS = [
    Component("Python", ("python",), True, "3.11", note="pyproject: requires-python >= 3.11"),
    Component("torch", ("torch",), True, "2.6", note="2.13.0 pinned on Python 3.11"),
    Component("CUDA (torch build)", ("cuda",), False, "12.1", note="GPU runs: Transformer Engine needs CUDA 12"),
    Component("NVIDIA driver", ("driver",), False),
    Component("NCCL", ("nccl",), False, "2.18"),
    Component("megatron-core", ("megatron-core", "megatron_core"), True, "0.16", "0.17"),
    Component("Transformer Engine", ("transformer_engine", "transformer-engine", "transformer_engine_torch"), False,
              "2.9", "2.12", "megatron-core 0.16's tested range; FP8, sequence parallelism, fused Adam and norms"),
    Component("apex", ("apex",), False,
              note="TE provides the fused norms and Adam; apex's fused norm is LayerNorm-only (megarl: RMSNorm)"),
    Component("NVIDIA DALI", ("nvidia-dali-cuda130", "nvidia-dali-cuda120", "nvidia-dali-cuda110"), False,
              note="data.loader=dali"),
    Component("MLflow", ("mlflow",), True, "2.14"),
]


def _torch_probe(key: str) -> Optional[str]:
    import torch

    if key == "python":
        return platform.python_version()
    if key == "cuda":
        return torch.version.cuda
    if key == "nccl":
        if not (torch.version.cuda and hasattr(torch.cuda, "nccl")):
            return None
        try:
            v = torch.cuda.nccl.version()
        except Exception:  # a CUDA build without NCCL; the version is all the table needs
            return None
        return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    if key == "driver":
        smi = shutil.which("nvidia-smi")
        if smi is None:
            return None
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
        return out.stdout.splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else None
    return installed_version(key)


def version_of(c: Component, probe: Callable[[str], Optional[str]] = _torch_probe) -> Optional[str]:
    for dist in c.dists:
        v = probe(dist)
        if v:
            return v
    return None


def supported_range(c: Component) -> str:
    if c.name == "apex":
        return "not used"
    if c.low and c.high:
        return f">= {c.low}, < {c.high}"
    return f">= {c.low}" if c.low else "any"


def version_status(c: Component, version: Optional[str]) -> str:
    if c.name == "apex":
        return "not used"
    if version is None:
        return "missing" if c.required else "absent"
    try:
        ok = (c.low is None or version_at_least(version, c.low)) and (c.high is None or not version_at_least(version, c.high))
    except ValueError:  # not a PEP 440 version (a driver string): nothing to compare
        ok = True
    return "ok" if ok else "unsupported"


def version_rows(probe: Callable[[str], Optional[str]] = _torch_probe) -> list[dict]:
    rows = []
    for c in COMPONENTS:
        v = version_of(c, probe)
        rows.append({"name": c.name, "version": v, "supported": supported_range(c), "status": version_status(c, v),
                     "note": c.note})
    return rows


# ------------------------------------------------------------------------------------ devices


def detect_devices() -> tuple[list[DeviceInfo], str]:
    """Every visible GPU, and why there are none (empty when there are)."""
    import torch

    from megarl.config.fp8 import te_version

    if not torch.version.cuda:
        return [], f"torch {torch.__version__} is a CPU build"
    if not torch.cuda.is_available():
        return [], "no CUDA device is visible (CUDA_VISIBLE_DEVICES, driver)"
    te = te_version()
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append(DeviceInfo(True, p.name, (p.major, p.minor), p.total_memory, te))
    return out, ""


def device_rows(devices: list[DeviceInfo]) -> list[dict]:
    return [{"index": i, "name": d.name, "memory_bytes": d.memory_bytes,
             "capability": f"{d.capability[0]}.{d.capability[1]}" if d.capability else None,
             "fp8": bool(d.capability and d.capability >= HOPPER),
             "mxfp8": bool(d.capability and d.capability >= BLACKWELL)} for i, d in enumerate(devices)]


def csrc_status(find_spec: Callable = importlib.util.find_spec) -> dict:
    """Whether megarl._C (csrc/'s CUDA kernels) is built into this install; loading it needs a CUDA
    device too."""
    def spec_of(name):
        try:
            return find_spec(name)
        except (ImportError, ValueError):
            return None

    spec = spec_of("megarl._C")
    return ({"built": True, "detail": f"megarl._C at {spec.origin}"} if spec is not None else
           {"built": False, "detail": "megarl._C is not built: setup.py compiles csrc/ only with a CUDA toolkit and "
                                      "a CUDA torch (pip install --no-build-isolation -e '.[gpu]'); ops use torch"})


# ------------------------------------------------------------------------------------ GPU checks


@dataclass
class Check:
    name: str
    status: str  # PASS, FAIL, SKIPPED
    reason: str
    seconds: float = 0.0
    details: dict = field(default_factory=dict)


def run_command(argv: list[str], timeout: int) -> tuple[int, str]:
    """(exit status, stdout+stderr) of a check's subprocess, in the checkout's root."""
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    try:
        out = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return 124, f"timed out after {timeout} s\n{e.stdout or ''}{e.stderr or ''}"
    return out.returncode, out.stdout + out.stderr


def pytest_result(rc: int, output: str) -> tuple[str, str]:
    """PASS / FAIL and a reason from a pytest run's exit status and summary line."""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)", output)}
    summary = ", ".join(f"{n} {k}" for k, n in counts.items()) or "no summary"
    if rc == 0 and counts.get("passed", 0) > 0:
        return "PASS", summary
    if rc == 5 or (rc == 0 and not counts.get("passed")):
        return "FAIL", f"no test ran ({summary})"
    return "FAIL", f"pytest exit {rc}: {summary}; last lines: {' | '.join(output.strip().splitlines()[-3:])}"


def hbm_result(report: dict) -> tuple[str, str, dict]:
    """PASS when each of megarl's kernel rows reaches its HBM floor (HBM_FLOORS)."""
    rows = [r for r in report.get("rows", []) if r.get("impl") == "megarl" and r.get("op") in HBM_FLOORS]
    if not rows:
        return "FAIL", "bench_gpu_ops.py reported no megarl kernel rows", {}
    low = [f"{r['op']} {r['pct_of_peak']:.0f}% < {HBM_FLOORS[r['op']]:.0f}%" for r in rows
           if r["pct_of_peak"] < HBM_FLOORS[r["op"]]]
    figures = {r["op"]: {"gbps": round(r["gbps"], 1), "pct_of_peak": round(r["pct_of_peak"], 1)} for r in rows}
    backend = report.get("backend")
    if backend != "cuda":
        return "FAIL", f"the CUDA kernels are not loaded (backend {backend!r}): megarl._C", figures
    if low:
        return "FAIL", "below the HBM floor: " + "; ".join(low), figures
    return "PASS", ", ".join(f"{op} {f['gbps']:.0f} GB/s ({f['pct_of_peak']:.0f}%)" for op, f in figures.items()), figures


def rl_step_result(report: dict) -> tuple[str, str, dict]:
    row = next((r for r in report.get("rows", []) if r.get("op") == "rl_step"), None)
    if row is None:
        return "FAIL", "bench_gpu_ops.py --rl-step reported no row", {}
    tps, mfu = row.get("rollout_tokens_per_s"), row.get("mfu")
    if not all(isinstance(x, (int, float)) and x == x and x > 0 for x in (tps, mfu)):
        return "FAIL", f"non-finite figures: tokens/s {tps}, MFU {mfu}", row
    return "PASS", f"rollout {tps:.0f} tokens/s, RL step MFU {100 * mfu:.1f}% ({row['shape']})", row


def decode_result(report: dict) -> tuple[str, str, dict]:
    rows = {r.get("way"): r for r in report.get("rows", []) if r.get("op") == "decode"}
    if set(rows) != {"eager", "static", "graphs"}:
        return "FAIL", "bench_gpu_ops.py --decode did not report eager, static and graphs", {}
    figures = {way: {k: round(r[k], 2) for k in ("tokens_per_s", "decode_step_ms", "x_floor")} for way, r in rows.items()}
    if not all(v == v and v > 0 for f in figures.values() for v in f.values()):
        return "FAIL", f"non-finite figures: {figures}", figures
    return "PASS", ", ".join(f"{way} {f['tokens_per_s']:.0f} tokens/s ({f['x_floor']:.1f}x the HBM floor)"
                             for way, f in figures.items()), figures


def head_result(report: dict) -> tuple[str, str, dict]:
    """PASS when the fused head's extra peak memory stays <= HEAD_MEMORY_PCT in both modes."""
    rows = {r["op"]: r for r in report.get("rows", []) if r.get("impl") == "fused"}
    unfused = {r["op"]: r for r in report.get("rows", []) if r.get("impl") == "unfused"}
    if set(rows) != {"head_fwd", "head_fwd+bwd"}:
        return "FAIL", "bench_gpu_ops.py --head reported no fused rows for both modes", {}
    figures = {op: {"ms": round(r["ms"], 2), "extra_mib": round(r["extra_mib"], 1),
                    "pct_of_logits": round(r["pct_of_logits"], 1),
                    "unfused_ms": round(unfused[op]["ms"], 2) if op in unfused else None}
               for op, r in rows.items()}
    over = [f"{op} {r['pct_of_logits']:.1f}% > {HEAD_MEMORY_PCT:.0f}%" for op, r in rows.items()
            if not r["pct_of_logits"] <= HEAD_MEMORY_PCT]
    if over:
        return "FAIL", "extra peak memory over the bound: " + "; ".join(over), figures
    return "PASS", ", ".join(f"{op.removeprefix('head_')} {f['ms']:.1f} ms, {f['extra_mib']:.0f} MiB "
                             f"({f['pct_of_logits']:.1f}% of the logits)" for op, f in figures.items()), figures


GPU_CHECKS = ("gpu_tests", "kernels_hbm", "fp8_vs_bf16", "offload_memory", "fused_head", "rl_step", "decode")


def skip_reason(name: str, devices: list[DeviceInfo], no_device: str, repo: str = REPO) -> str:
    """Why a GPU check cannot run here ("" when it can)."""
    if not devices:
        return f"no CUDA device: {no_device}"
    if not (os.path.isdir(os.path.join(repo, "tests")) and os.path.isdir(os.path.join(repo, "bench"))):
        return f"needs a megarl checkout (tests/, bench/ beside the package); {repo} has none"
    d = devices[0]
    if name == "fp8_vs_bf16":
        if d.capability is not None and d.capability < HOPPER:
            return f"FP8 needs compute capability >= 9.0; GPU 0 is {d.describe()}"
        if d.te_version is None:
            return "FP8 needs Transformer Engine (pip install 'megarl[gpu]')"
    return ""


def run_bench(argv: list[str], timeout: int) -> tuple[int, str, dict]:
    """(exit status, output, the --json report) of a bench/bench_gpu_ops.py run."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.json")
        rc, out = run_command([*argv, "--json", path], timeout)
        report = json.load(open(path)) if rc == 0 and os.path.exists(path) else {}
    return rc, out, report


def run_check(name: str, args, run: Callable = run_command, bench: Callable = run_bench) -> Check:
    """One GPU check in a subprocess (`run`, `bench`: replaced by fakes in tests)."""
    py, t0 = sys.executable, time.perf_counter()
    if name in ("gpu_tests", "fp8_vs_bf16", "offload_memory"):
        if name == "gpu_tests":
            target = QUICK_TESTS if args.quick and not args.tests else ["tests"]
            argv = [py, "-m", "pytest", "-q", "-m", "gpu", *target, *(["-k", args.tests] if args.tests else [])]
        elif name == "fp8_vs_bf16":
            argv = [py, "-m", "pytest", "-q", "tests/test_fp8.py::test_fp8_sft_loss_curve_tracks_bf16_over_50_steps"]
        else:
            argv = [py, "-m", "pytest", "-q",
                    "tests/test_offload.py::test_cuda_offload_is_bit_exact_and_frees_device_memory"]
        rc, out = run(argv, 3600)
        status, reason = pytest_result(rc, out)
        return Check(name, status, reason, time.perf_counter() - t0, {"command": " ".join(argv[1:])})
    argv = [py, "bench/bench_gpu_ops.py"]
    if name == "kernels_hbm":
        argv += [*(["--hbm-tbps", str(args.hbm_tbps)] if args.hbm_tbps else []), "--skip-naive",
                 *(["--tokens", "2048", "--iters", "5"] if args.quick else [])]
        judge = hbm_result
    elif name == "fused_head":
        argv, judge = [*argv, "--head", "--iters", "3" if args.quick else "10"], head_result
    elif name == "decode":
        argv += ["--decode", "--rows", "64", "--new-tokens", "64" if args.quick else "256"]
        judge = decode_result
    else:
        argv, judge = [*argv, "--rl-step", *(["--quick"] if args.quick else [])], rl_step_result
    rc, out, report = bench(argv, 1800)
    if rc != 0:
        last = " | ".join(out.strip().splitlines()[-3:])
        return Check(name, "FAIL", f"{' '.join(argv[1:])} exited {rc}: {last}", time.perf_counter() - t0)
    status, reason, details = judge(report)
    return Check(name, status, reason, time.perf_counter() - t0, details)


def gpu_checks(args, devices: list[DeviceInfo], no_device: str, **runners) -> list[Check]:
    checks = []
    for name in GPU_CHECKS:
        if not args.gpu:
            checks.append(Check(name, "SKIPPED", "not requested (megarl doctor --gpu runs it)"))
            continue
        why = skip_reason(name, devices, no_device)
        checks.append(Check(name, "SKIPPED", why) if why else run_check(name, args, **runners))
    return checks


# ------------------------------------------------------------------------------------ report


def build_report(args, versions: list[dict], devices: list[DeviceInfo], no_device: str, csrc: dict,
                 checks: list[Check]) -> dict:
    return {
        "schema": SCHEMA, "megarl": installed_version("megarl") or "unknown",
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(), "gpu": bool(args.gpu), "quick": bool(args.quick),
        "versions": versions, "devices": device_rows(devices), "no_device": no_device, "csrc": csrc,
        "checks": [dataclasses.asdict(c) for c in checks],
        "summary": {"pass": sum(c.status == "PASS" for c in checks), "fail": sum(c.status == "FAIL" for c in checks),
                    "skipped": sum(c.status == "SKIPPED" for c in checks),
                    "problems": sum(v["status"] in ("missing", "unsupported") for v in versions)},
    }


# key -> type (or (type, ...)) of the report and of each list's items; `check_report` enforces it
REPORT_KEYS = {"schema": str, "megarl": str, "time": str, "host": str, "gpu": bool, "quick": bool, "versions": list,
               "devices": list, "no_device": str, "csrc": dict, "checks": list, "summary": dict}
ITEM_KEYS = {
    "versions": {"name": str, "version": (str, type(None)), "supported": str, "status": str, "note": str},
    "devices": {"index": int, "name": str, "memory_bytes": (int, type(None)), "capability": (str, type(None)),
                "fp8": bool, "mxfp8": bool},
    "checks": {"name": str, "status": str, "reason": str, "seconds": float, "details": dict},
}
STATUSES = {"versions": {"ok", "unsupported", "missing", "absent", "not used"}, "checks": {"PASS", "FAIL", "SKIPPED"}}


def check_report(report: dict) -> list[str]:
    """Where a report departs from the schema (empty: it follows it)."""
    errs = [f"{k}: expected {t}" for k, t in REPORT_KEYS.items() if not isinstance(report.get(k), t)]
    if report.get("schema") != SCHEMA:
        errs.append(f"schema: {report.get('schema')!r} != {SCHEMA!r}")
    for section, keys in ITEM_KEYS.items():
        for i, item in enumerate(report.get(section) or []):
            errs += [f"{section}[{i}].{k}: expected {t}" for k, t in keys.items() if not isinstance(item.get(k), t)]
            extra = set(item) - set(keys)
            if extra:
                errs.append(f"{section}[{i}]: unknown keys {sorted(extra)}")
            if section in STATUSES and item.get("status") not in STATUSES[section]:
                errs.append(f"{section}[{i}].status: {item.get('status')!r}")
    for k in ("pass", "fail", "skipped", "problems"):
        if not isinstance((report.get("summary") or {}).get(k), int):
            errs.append(f"summary.{k}: expected int")
    if not isinstance((report.get("csrc") or {}).get("built"), bool):
        errs.append("csrc.built: expected bool")
    return errs


def _gib(n: Optional[int]) -> str:
    return f"{n / 2**30:.0f} GiB" if n else "?"


def format_report(report: dict) -> str:
    """The table a person reads in seconds."""
    lines = [f"megarl {report['megarl']} doctor on {report['host']} ({report['time']})", "",
             f"{'component':<20} {'version':<18} {'supported':<16} status"]
    for v in report["versions"]:
        note = f"  ({v['note']})" if v["status"] != "ok" and v["note"] else ""
        lines.append(f"{v['name']:<20} {v['version'] or '-':<18} {v['supported']:<16} {v['status']}{note}")
    lines += ["", "devices:"]
    for d in report["devices"]:
        fp8 = "FP8 yes" + (", MXFP8 yes" if d["mxfp8"] else ", MXFP8 no (needs 10.0)") if d["fp8"] else \
            "FP8 no (needs compute capability 9.0)"
        lines.append(f"  GPU {d['index']}: {d['name']}, {_gib(d['memory_bytes'])}, compute capability "
                     f"{d['capability']}, {fp8}")
    if not report["devices"]:
        lines.append(f"  none: {report['no_device']}")
    c = report["csrc"]
    lines.append(f"csrc extension: {'built' if c['built'] else 'not built'} ({c['detail']})")
    lines += ["", "GPU checks:"]
    for ch in report["checks"]:
        took = f" [{ch['seconds']:.0f} s]" if ch["seconds"] >= 1 else ""
        lines.append(f"  {ch['name']:<15} {ch['status']:<8} {ch['reason']}{took}")
    s = report["summary"]
    lines += ["", f"{s['pass']} passed, {s['fail']} failed, {s['skipped']} skipped; {s['problems']} version problem(s)"]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ all-reduce


def allreduce_bandwidth(sizes_mib=(1, 16, 256), iters: int = 10, device=None) -> list[dict]:
    """All-reduce bus bandwidth over the default group (every rank calls it): per size, the sum is
    checked (world size), then `iters` timed fp32 all-reduces; busbw = bytes / time x 2(n-1)/n,
    the figure nccl-tests reports (comparable across world sizes)."""
    import torch
    import torch.distributed as dist

    n, rows = dist.get_world_size(), []
    for mib in sizes_mib:
        x = torch.ones(mib * 2**20 // 4, device=device)
        dist.all_reduce(x)  # also the warm-up (connections, NCCL channels)
        correct = bool((x == n).all())
        dist.barrier()
        if x.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        if x.is_cuda:
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - t0) / iters
        algbw = mib * 2**20 / seconds / 1e9
        rows.append({"mib": mib, "seconds": seconds, "algbw_gbps": algbw, "busbw_gbps": algbw * 2 * (n - 1) / max(n, 1),
                     "correct": correct})
    return rows


def run_allreduce(args) -> int:
    """`megarl doctor --allreduce`, once per rank under torchrun (launchers/slurm/doctor.sbatch)."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        rows = allreduce_bandwidth(device="cuda" if cuda else None)
        n, rank = dist.get_world_size(), dist.get_rank()
    finally:
        dist.destroy_process_group()
    ok = all(r["correct"] for r in rows) and (args.min_busbw is None or rows[-1]["busbw_gbps"] >= args.min_busbw)
    if rank == 0:
        backend = "NCCL" if cuda else "gloo"
        for r in rows:
            print(f"all-reduce {backend} x{n}: {r['mib']:>4} MiB  {1e3 * r['seconds']:8.2f} ms  "
                  f"busbw {r['busbw_gbps']:7.1f} GB/s{'' if r['correct'] else '  WRONG SUM'}")
        floor = f" (floor {args.min_busbw} GB/s)" if args.min_busbw is not None else ""
        print(f"allreduce {'PASS' if ok else 'FAIL'}{floor}", flush=True)
        if args.json:
            from megarl.utils.atomic import write_atomic

            write_atomic(args.json, json.dumps({"schema": SCHEMA + "/allreduce", "world_size": n, "backend": backend,
                                                "rows": rows, "status": "PASS" if ok else "FAIL"}, indent=1) + "\n")
    return 0 if ok else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu", action="store_true", help="also run the GPU checks (tests, kernel bandwidth, FP8, "
                                                      "offload, rollout and RL-step figures)")
    p.add_argument("--quick", action="store_true", help="the short form of each GPU check (minutes, not tens)")
    p.add_argument("--tests", default=None, metavar="EXPR", help="gpu_tests: only the gpu tests pytest -k EXPR selects")
    p.add_argument("--hbm-tbps", type=float, default=None,
                   help="kernels_hbm: the GPU's HBM peak in TB/s (default: bench_gpu_ops.py's table by device name)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON (to attach to a bug)")
    p.add_argument("--allreduce", action="store_true",
                   help="instead: all-reduce bus bandwidth over every rank (run once per rank under torchrun)")
    p.add_argument("--min-busbw", type=float, default=None, metavar="GBPS",
                   help="--allreduce: FAIL below this bus bandwidth at 256 MiB")


def run(args) -> int:
    if args.allreduce:
        return run_allreduce(args)
    from megarl.utils.atomic import write_atomic

    versions = version_rows()
    devices, no_device = detect_devices()
    checks = gpu_checks(args, devices, no_device)
    report = build_report(args, versions, devices, no_device, csrc_status(), checks)
    print(format_report(report), flush=True)
    if args.json:
        write_atomic(args.json, json.dumps(report, indent=1) + "\n")
        print(f"report written: {args.json}")
    return 1 if report["summary"]["fail"] or any(v["status"] == "missing" for v in versions) else 0
