"""Describe megarl's compiled extensions for setup.py; each is left out when it cannot be built.

get_extensions() -> (ext_modules, cmdclass), and never raises: megarl._C (the CUDA kernels)
needs a CUDA build of torch *and* a CUDA toolkit (nvcc). Without them, megarl installs and runs
the torch path. The .cu files hold the CUDA kernels, bindings.cpp their Python bindings.
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


# What megarl._C is built for when no GPU is visible and TORCH_CUDA_ARCH_LIST is unset: A100 and
# H100/H200 machine code, plus sm_90 PTX that newer GPUs compile when they load it.
DEFAULT_CUDA_ARCHS = "8.0;9.0+PTX"


def default_cuda_archs(visible_gpus: int):
    """Set TORCH_CUDA_ARCH_LIST to DEFAULT_CUDA_ARCHS where nothing chose the GPUs to build for;
    returns what it set, or None. torch builds for the visible GPUs when the variable is unset,
    and with none visible (a Docker build, a login node, a CPU machine with a CUDA torch and the
    toolkit) its arch detection raises IndexError, which would fail the whole install."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST") or visible_gpus > 0:
        return None
    os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_CUDA_ARCHS
    print(f"megarl: no GPU visible; building megarl._C for compute capabilities {DEFAULT_CUDA_ARCHS} "
          "(set TORCH_CUDA_ARCH_LIST to choose)", file=sys.stderr)
    return DEFAULT_CUDA_ARCHS


def cuda_extension():
    """megarl._C (the .cu kernels + bindings.cpp), or None without a CUDA torch and toolkit."""
    import torch

    if not torch.version.cuda:
        return None
    home = cuda_home()
    if home is None:
        return None
    default_cuda_archs(torch.cuda.device_count())
    from torch.utils.cpp_extension import CUDAExtension

    sources = [os.path.relpath(p, ROOT) for p in kernel_sources()]
    sources.append(os.path.relpath(os.path.join(HERE, "bindings.cpp"), ROOT))
    return CUDAExtension(
        name="megarl._C",
        sources=sources,
        include_dirs=[HERE],
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "-lineinfo"]},
    )


def get_extensions():
    home = cuda_home()
    if home is not None:  # before anything imports torch.utils.cpp_extension, which reads it once;
        os.environ.setdefault("CUDA_HOME", home)  # unset, it takes nvcc's parent (/usr/local/bin/nvcc: /usr/local)
    try:
        ext = cuda_extension()
    except Exception as exc:  # never fail the install: the torch path is always there
        print(f"megarl: not building megarl._C ({exc!r})", file=sys.stderr)
        ext = None
    if ext is None:
        return [], {}
    from torch.utils.cpp_extension import BuildExtension

    return [ext], {"build_ext": BuildExtension}
