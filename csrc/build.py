"""Describe the megarl._C CUDA extension for setup.py, or nothing when it cannot be built.

get_extensions() -> (ext_modules, cmdclass) is ([], {}) unless torch is a CUDA build *and* a
CUDA toolkit (nvcc) is found; it never raises, so a CPU machine installs megarl and runs the
torch path. The .cu files hold the kernels, bindings.cpp the Python bindings (g++ only);
host_check.cpp is the CPU test harness and is not part of the extension.
"""
import glob
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _is_toolkit(home):
    return bool(home) and os.path.isfile(os.path.join(home, "bin", "nvcc")) and os.path.isfile(
        os.path.join(home, "include", "cuda_runtime.h"))


def cuda_home():
    """Root of an installed CUDA toolkit (bin/nvcc and include/cuda_runtime.h), or None."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:  # /usr/local/bin/nvcc may be a wrapper script, so also try the usual roots
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates += ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    return next((c for c in candidates if _is_toolkit(c)), None)


def nvcc_path():
    """The nvcc to call: the one on PATH, else the toolkit's; None when there is none."""
    home = cuda_home()
    return shutil.which("nvcc") or (os.path.join(home, "bin", "nvcc") if home else None)


def kernel_sources():
    """Kernel translation units (every .cu), as absolute paths."""
    return sorted(glob.glob(os.path.join(HERE, "*.cu")))


def get_extensions():
    try:
        import torch

        if not torch.version.cuda:
            return [], {}
        home = cuda_home()
        if home is None:
            return [], {}
        os.environ.setdefault("CUDA_HOME", home)  # read by torch.utils.cpp_extension on import
        from torch.utils.cpp_extension import BuildExtension, CUDAExtension

        sources = [os.path.relpath(p, ROOT) for p in kernel_sources()]
        sources.append(os.path.relpath(os.path.join(HERE, "bindings.cpp"), ROOT))
        ext = CUDAExtension(
            name="megarl._C",
            sources=sources,
            include_dirs=[HERE],
            extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "-lineinfo"]},
        )
        return [ext], {"build_ext": BuildExtension}
    except Exception as exc:  # never fail the install: the torch path is always there
        print(f"megarl: not building the CUDA kernels ({exc!r})", file=sys.stderr)
        return [], {}
