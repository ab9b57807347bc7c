"""`megarl doctor`'s CPU-side logic: version detection and support statuses (fake probes), device
rows (fake devices), skip reasons, the GPU checks' verdicts from fake subprocess results, the table,
and the JSON report's schema. The GPU checks themselves run only on a GPU (`megarl doctor --gpu`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from megarl.cli import doctor
from megarl.config.fp8 import TARGETS

H100 = dataclasses.replace(TARGETS["h100"], te_version="2.10.0")
GPU_ARGS = argparse.Namespace(gpu=True, quick=False, tests=None, hbm_tbps=None, json=None)


def _probe(versions: dict):
    return lambda key: versions.get(key)


BASE = {"python": "3.11.7", "torch": "2.13.0", "megatron-core": "0.16.1", "mlflow": "3.1.0"}


def _status(rows, name):
    return next(r for r in rows if r["name"] == name)["status"]


def test_versions_and_support_statuses_from_fake_probes():
    rows = doctor.version_rows(_probe({**BASE, "cuda": "12.8", "nccl": "2.27.3", "driver": "570.86.15",
                                       "transformer_engine": "2.10.0", "apex": "0.1"}))
    assert {r["name"]: r["status"] for r in rows} == {
        "Python": "ok", "torch": "ok", "CUDA (torch build)": "ok", "NVIDIA driver": "ok", "NCCL": "ok",
        "megatron-core": "ok", "Transformer Engine": "ok", "apex": "not used", "NVIDIA DALI": "absent", "MLflow": "ok"}
    assert next(r for r in rows if r["name"] == "Transformer Engine")["version"] == "2.10.0"
    # outside the supported ranges, and required components absent
    rows = doctor.version_rows(_probe({"python": "3.10.4", "torch": "2.13.0", "megatron-core": "0.15.0",
                                       "transformer-engine": "2.12.0"}))
    assert _status(rows, "Python") == "unsupported"
    assert _status(rows, "megatron-core") == "unsupported"
    assert _status(rows, "Transformer Engine") == "unsupported"  # >= 2.12: beyond megatron-core 0.16's range
    assert _status(rows, "MLflow") == "missing" and _status(rows, "apex") == "not used"
    assert _status(rows, "CUDA (torch build)") == "absent"  # optional: a CPU machine is fine


def test_every_component_is_probed_on_this_machine():
    rows = doctor.version_rows()
    assert [r["name"] for r in rows] == [c.name for c in doctor.COMPONENTS]
    assert _status(rows, "Python") == "ok" and _status(rows, "megatron-core") == "ok"


def test_device_rows_say_what_fp8_each_gpu_supports():
    rows = doctor.device_rows([TARGETS["a100"], H100, TARGETS["b200"]])
    assert [(r["capability"], r["fp8"], r["mxfp8"]) for r in rows] == [("8.0", False, False), ("9.0", True, False),
                                                                       ("10.0", True, True)]
    assert rows[1] == {"index": 1, "name": "NVIDIA H100 80GB HBM3", "memory_bytes": 80 * 2**30, "capability": "9.0",
                       "fp8": True, "mxfp8": False}


def test_csrc_status():
    none = doctor.csrc_status(lambda name: None)
    assert none["built"] is False and "CUDA toolkit" in none["detail"]
    specs = {"megarl._C": argparse.Namespace(origin="/x/megarl/_C.so")}
    assert doctor.csrc_status(specs.get) == {"built": True, "detail": "megarl._C at /x/megarl/_C.so"}


def test_skip_reasons(tmp_path):
    assert doctor.skip_reason("gpu_tests", [], "torch 2.13.0+cpu is a CPU build") == \
        "no CUDA device: torch 2.13.0+cpu is a CPU build"
    assert doctor.skip_reason("gpu_tests", [H100], "") == ""
    assert "needs a megarl checkout" in doctor.skip_reason("gpu_tests", [H100], "", repo=str(tmp_path))
    assert doctor.skip_reason("fp8_vs_bf16", [TARGETS["a100"]], "") == \
        "FP8 needs compute capability >= 9.0; GPU 0 is NVIDIA A100-SXM4-80GB (compute capability 8.0)"
    assert "Transformer Engine" in doctor.skip_reason("fp8_vs_bf16", [dataclasses.replace(H100, te_version=None)], "")
    assert doctor.skip_reason("fp8_vs_bf16", [H100], "") == ""


def test_checks_not_requested_or_without_a_gpu_are_skipped_with_the_reason():
    cpu = argparse.Namespace(**{**vars(GPU_ARGS), "gpu": False})
    checks = doctor.gpu_checks(cpu, [H100], "")
    assert [c.name for c in checks] == list(doctor.GPU_CHECKS)
    assert {(c.status, c.reason) for c in checks} == {("SKIPPED", "not requested (megarl doctor --gpu runs it)")}
    checks = doctor.gpu_checks(GPU_ARGS, [], "no CUDA device is visible (CUDA_VISIBLE_DEVICES, driver)")
    assert {c.status for c in checks} == {"SKIPPED"}
    assert all(c.reason == "no CUDA device: no CUDA device is visible (CUDA_VISIBLE_DEVICES, driver)" for c in checks)


@pytest.mark.parametrize("rc,output,status,reason", [
    (0, "....\n4 passed, 1 deselected in 3.2s", "PASS", "4 passed, 1 deselected"),
    (1, "F.\nFAILED tests/x.py::t\n1 failed, 1 passed in 2s", "FAIL", "pytest exit 1: 1 failed, 1 passed"),
    (5, "no tests ran in 0.1s", "FAIL", "no test ran"),
    (0, "ss\n2 skipped in 0.1s", "FAIL", "no test ran (2 skipped)"),  # a GPU machine that skips them all
])
def test_pytest_verdicts(rc, output, status, reason):
    got_status, got_reason = doctor.pytest_result(rc, output)
    assert got_status == status and got_reason.startswith(reason), got_reason


def _bench_report(pct_fwd=80.0, pct_bwd=70.0, pct_gae=40.0, backend="cuda"):
    row = lambda op, pct, impl="megarl": {"op": op, "shape": "s", "impl": impl, "ms": 1.0, "floor_ms": pct / 100,
                                          "gbps": 33.5 * pct, "pct_of_peak": pct}
    return {"device": "NVIDIA H100 80GB HBM3", "backend": backend, "hbm_tbps": 3.35,
            "rows": [row("logprobs_fwd", pct_fwd), row("logprobs_fwd", 10.0, "naive"), row("logprobs_fwd_bwd", pct_bwd),
                     row("gae_call", 5.0), row("gae_graph", pct_gae)]}


def test_hbm_verdicts():
    status, reason, figures = doctor.hbm_result(_bench_report())
    assert status == "PASS" and set(figures) == {"logprobs_fwd", "logprobs_fwd_bwd", "gae_graph"}  # naive/per-call: info
    assert "logprobs_fwd 2680 GB/s (80%)" in reason
    status, reason, _ = doctor.hbm_result(_bench_report(pct_bwd=42.0))
    assert status == "FAIL" and reason == "below the HBM floor: logprobs_fwd_bwd 42% < 50%"
    status, reason, _ = doctor.hbm_result(_bench_report(backend="torch"))
    assert status == "FAIL" and "not loaded" in reason
    assert doctor.hbm_result({"rows": []})[0] == "FAIL"


def test_rl_step_verdicts():
    row = {"op": "rl_step", "shape": "1B, 64 x (128 + 256)", "seconds": 9.0, "rollout_tokens_per_s": 2100.0,
           "mfu": 0.21}
    status, reason, _ = doctor.rl_step_result({"rows": [row]})
    assert (status, reason) == ("PASS", "rollout 2100 tokens/s, RL step MFU 21.0% (1B, 64 x (128 + 256))")
    assert doctor.rl_step_result({"rows": [{**row, "mfu": float("nan")}]})[0] == "FAIL"
    assert doctor.rl_step_result({"rows": []})[0] == "FAIL"


def _head_report(pct_fwd=1.2, pct_bwd=3.9):
    row = lambda mode, impl, pct, ms: {"op": f"head_{mode}", "shape": "bf16 16384x152064x4096", "impl": impl,
                                       "ms": ms, "tflops": 600.0, "extra_mib": 93.0 * pct, "pct_of_logits": pct}
    return {"rows": [row("fwd", "fused", pct_fwd, 34.2), row("fwd", "unfused", 50.0, 30.8),
                     row("fwd+bwd", "fused", pct_bwd, 142.7), row("fwd+bwd", "unfused", 86.2, 93.1)]}


def test_fused_head_verdicts():
    status, reason, figures = doctor.head_result(_head_report())
    assert status == "PASS" and set(figures) == {"head_fwd", "head_fwd+bwd"}
    assert reason == "fwd 34.2 ms, 112 MiB (1.2% of the logits), fwd+bwd 142.7 ms, 363 MiB (3.9% of the logits)"
    assert figures["head_fwd+bwd"]["unfused_ms"] == 93.1
    status, reason, _ = doctor.head_result(_head_report(pct_bwd=26.3))
    assert status == "FAIL" and reason == "extra peak memory over the bound: head_fwd+bwd 26.3% > 10%"
    assert doctor.head_result(_head_report(pct_fwd=float("nan")))[0] == "FAIL"
    assert doctor.head_result({"rows": _head_report()["rows"][:2]})[0] == "FAIL"  # one mode missing


def _decode_report(eager_tps=2500.0):
    row = {"op": "decode", "shape": "1b", "rows": 64, "decode_step_ms": 2.0, "hbm_floor_ms": 0.8, "x_floor": 2.5}
    return {"rows": [{**row, "way": "eager", "tokens_per_s": eager_tps, "decode_step_ms": 25.0, "x_floor": 31.0},
                     {**row, "way": "static", "tokens_per_s": 3000.0},
                     {**row, "way": "graphs", "tokens_per_s": 20000.0}]}


def test_decode_verdicts():
    status, reason, figures = doctor.decode_result(_decode_report())
    assert status == "PASS" and "graphs 20000 tokens/s (2.5x the HBM floor)" in reason
    assert figures["eager"]["x_floor"] == 31.0
    assert doctor.decode_result(_decode_report(eager_tps=float("nan")))[0] == "FAIL"
    assert doctor.decode_result({"rows": _decode_report()["rows"][:2]})[0] == "FAIL"  # a way missing


def test_run_check_builds_each_command_and_judges_its_result():
    seen = []

    def run(argv, timeout):
        seen.append(argv[1:])
        return 0, "3 passed in 1s"

    def bench(argv, timeout):
        seen.append(argv[1:])
        if "--rl-step" in argv:
            return 0, "", {"rows": [{"op": "rl_step", "shape": "1B", "rollout_tokens_per_s": 1.0, "mfu": 0.1}]}
        if "--head" in argv:
            return 0, "", _head_report()
        if "--decode" in argv:
            return 0, "", _decode_report()
        return 0, "", _bench_report()

    quick = argparse.Namespace(**{**vars(GPU_ARGS), "quick": True, "hbm_tbps": 4.8})
    checks = doctor.gpu_checks(quick, [H100], "", run=run, bench=bench)
    assert [(c.name, c.status) for c in checks] == [(n, "PASS") for n in doctor.GPU_CHECKS]
    assert seen[0] == ["-m", "pytest", "-q", "-m", "gpu", *doctor.QUICK_TESTS]
    assert seen[1] == ["bench/bench_gpu_ops.py", "--hbm-tbps", "4.8", "--skip-naive", "--tokens", "2048", "--iters", "5"]
    assert seen[2][-1].startswith("tests/test_fp8.py::") and seen[3][-1].startswith("tests/test_offload.py::")
    assert seen[4] == ["bench/bench_gpu_ops.py", "--head", "--iters", "3"]
    assert seen[5] == ["bench/bench_gpu_ops.py", "--rl-step", "--quick"]
    assert seen[6] == ["bench/bench_gpu_ops.py", "--decode", "--rows", "64", "--new-tokens", "64"]
    subset = argparse.Namespace(**{**vars(GPU_ARGS), "tests": "fp8 or offload"})
    seen.clear()
    doctor.run_check("gpu_tests", subset, run=run)
    assert seen == [["-m", "pytest", "-q", "-m", "gpu", "tests", "-k", "fp8 or offload"]]
    # a bench that crashes is a FAIL naming its command and last lines
    check = doctor.run_check("kernels_hbm", GPU_ARGS, bench=lambda argv, t: (1, "Traceback\nRuntimeError: boom", {}))
    assert check.status == "FAIL" and check.reason == "bench/bench_gpu_ops.py --skip-naive exited 1: Traceback | RuntimeError: boom"


def _report(checks, versions=None, devices=(H100,)):
    return doctor.build_report(GPU_ARGS, versions or doctor.version_rows(_probe(BASE)), list(devices), "",
                               {"built": False, "detail": "not built"}, checks)


def test_report_follows_its_schema_and_the_checker_catches_departures():
    checks = [doctor.Check("gpu_tests", "PASS", "3 passed", 12.5), doctor.Check("rl_step", "FAIL", "boom", 1.0, {"a": 1})]
    report = json.loads(json.dumps(_report(checks)))  # as written and read back
    assert doctor.check_report(report) == []
    assert report["summary"] == {"pass": 1, "fail": 1, "skipped": 0, "problems": 0}
    bad = json.loads(json.dumps(report))
    bad["checks"][0]["status"] = "OK"
    del bad["devices"][0]["fp8"]
    bad["versions"][0]["extra"] = 1
    bad["schema"] = "megarl-doctor/0"
    assert sorted(doctor.check_report(bad)) == sorted([
        "checks[0].status: 'OK'", "devices[0].fp8: expected <class 'bool'>", "versions[0]: unknown keys ['extra']",
        "schema: 'megarl-doctor/0' != 'megarl-doctor/1'"])


def test_table_shows_every_row_and_the_summary():
    versions = doctor.version_rows(_probe({**BASE, "transformer_engine": "2.5.0"}))
    report = _report([doctor.Check("kernels_hbm", "SKIPPED", "no CUDA device: x")], versions,
                     devices=[H100, TARGETS["a100"]])
    text = doctor.format_report(report)
    assert "Transformer Engine   2.5.0              >= 2.9, < 2.12   unsupported  (megatron-core 0.16's" in text
    assert "GPU 0: NVIDIA H100 80GB HBM3, 80 GiB, compute capability 9.0, FP8 yes, MXFP8 no (needs 10.0)" in text
    assert "GPU 1: NVIDIA A100-SXM4-80GB, 80 GiB, compute capability 8.0, FP8 no (needs compute capability 9.0)" in text
    assert "  kernels_hbm     SKIPPED  no CUDA device: x" in text
    assert text.endswith("0 passed, 0 failed, 1 skipped; 1 version problem(s)")
    assert "none: no GPU here" in doctor.format_report({**report, "devices": [], "no_device": "no GPU here"})


def test_doctor_on_this_cpu_machine_writes_a_valid_report(tmp_path, capsys):
    from megarl.cli.main import main

    out = tmp_path / "doctor.json"
    rc = main(["doctor", "--gpu", "--quick", "--json", str(out)])
    text = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert doctor.check_report(report) == []
    if not report["devices"]:  # this machine: the CPU half, and why each GPU row is skipped
        assert rc == 0 and "devices:\n  none: " in text
        assert {c["status"] for c in report["checks"]} == {"SKIPPED"}
        assert all(c["reason"].startswith("no CUDA device: ") for c in report["checks"])
    assert f"report written: {out}" in text


def _allreduce_body(rank, world_size):
    return doctor.allreduce_bandwidth(sizes_mib=(1, 4), iters=2)


@pytest.mark.slow
def test_allreduce_bandwidth_over_gloo():
    from dist_helpers import run_distributed

    rows = run_distributed(_allreduce_body, 2)[0]
    assert [r["mib"] for r in rows] == [1, 4] and all(r["correct"] for r in rows)
    for r in rows:
        assert r["seconds"] > 0 and r["algbw_gbps"] == pytest.approx(r["mib"] * 2**20 / r["seconds"] / 1e9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"])  # 2(n-1)/n = 1 at n = 2
