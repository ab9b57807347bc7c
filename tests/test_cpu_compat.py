"""The CPU compatibility layer: a no-op when CUDA is available, real bridges when it is not.

Each case runs in a fresh interpreter, because enable() patches torch process-wide.
"""
import subprocess
import sys
import textwrap


def run_py(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_noop_when_cuda_is_available():
    out = run_py("""
        from unittest import mock
        import torch
        before = (torch.cuda.current_device, torch.cuda.synchronize, torch.Tensor.cuda, torch.Tensor.type)
        from megatron.core.tensor_parallel import random as r
        tracker_before = r._CUDA_RNG_STATE_TRACKER
        with mock.patch("torch.cuda.is_available", return_value=True):
            from megarl.runtime import cpu_compat
            assert cpu_compat.enable() is False
        after = (torch.cuda.current_device, torch.cuda.synchronize, torch.Tensor.cuda, torch.Tensor.type)
        assert before == after, "torch was patched although CUDA is available"
        assert r._CUDA_RNG_STATE_TRACKER is tracker_before
        assert not cpu_compat.is_enabled()
        assert torch._C._len_torch_function_stack() == 0, "a TorchFunctionMode was pushed"
        print("noop ok")
    """)
    assert "noop ok" in out


def test_bridges_on_cpu():
    out = run_py("""
        import torch
        from megarl.runtime import cpu_compat
        assert cpu_compat.enable() is True and cpu_compat.enable() is True  # idempotent
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.empty(2, device=0).device.type == "cpu"
        assert torch.ones(2, device=torch.device("cuda", 0)).device.type == "cpu"
        t = torch.randn(3)
        assert t.cuda() is t and t.to("cuda").device.type == "cpu"
        assert t.to(torch.float64).dtype == torch.float64          # dtype arguments untouched
        assert torch.cuda.current_device() == torch.device("cpu")
        torch.cuda.synchronize()
        assert t.type() == "torch.cuda.FloatTensor" and t.half().type() == "torch.cuda.HalfTensor"
        assert t.type("torch.cuda.DoubleTensor").dtype == torch.float64
        # The TP RNG tracker forks the CPU generator: reproducible and isolated from the default stream.
        from megatron.core import tensor_parallel
        tracker = tensor_parallel.get_cuda_rng_tracker()
        tracker.add("model-parallel-rng", 123)
        torch.manual_seed(0)
        with tracker.fork():
            a = torch.rand(3)
        outside = torch.rand(3)
        torch.manual_seed(0)
        assert torch.equal(outside, torch.rand(3)), "fork leaked into the default generator"
        tracker2 = cpu_compat.CPURNGStatesTracker()
        tracker2.add("model-parallel-rng", 123)
        with tracker2.fork():
            assert torch.equal(a, torch.rand(3))
        print("bridges ok")
    """)
    assert "bridges ok" in out
