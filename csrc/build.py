"""Describe megarl's compiled extensions for setup.py; each is left out when it cannot be built.

get_extensions() -> (ext_modules, cmdclass), and never raises: megarl._cpu (the CPU decode
attention and the LM head's decode GEMM) needs a C++ compiler and is optional (a failed compile
is a warning); megarl._C (the CUDA kernels) needs a CUDA build of torch *and* a CUDA toolkit
(nvcc). Without either, megarl installs and runs the torch path. The .cu files hold the CUDA
kernels, bindings.cpp their Python bindings (g++ only); host_check.cpp is the CPU test harness of
the CUDA kernels' arithmetic and is part of neither extension. cpu_*.cpp are megarl._cpu's.
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


CPU_SOURCES = ("cpu_decode_attention.cpp", "cpu_wide_linear.cpp", "cpu_decode_layer.cpp", "cpu_sampling.cpp",
               "cpu_logprobs.cpp", "cpu_bindings.cpp")


def cpu_extension():
    """megarl._cpu (cpu_decode_attention.cpp: decode attention over the KV cache;
    cpu_wide_linear.cpp: the LM head's GEMM at decode sizes; cpu_decode_layer.cpp: a whole layer
    at a decode step; cpu_sampling.cpp: the decode step's
    draw over the vocabulary; cpu_logprobs.cpp: the log-prob/entropy row passes over fp32
    logits), or None without a C++ compiler.
    Optional: a failed compile leaves megarl on torch's SDPA and GEMMs."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return None
    from torch.utils.cpp_extension import CppExtension

    sources = [os.path.relpath(os.path.join(HERE, name), ROOT) for name in CPU_SOURCES]
    ext = CppExtension(name="megarl._cpu", sources=sources, include_dirs=[HERE],
                       # -fno-trapping-math: without it GCC leaves the AVX2 clones' loops with a
                       # comparison or a float->int conversion scalar (it may if-convert them only
                       # under AVX-512's masks); the results are the same, exceptions are not read
                       extra_compile_args=["-O3", "-fopenmp-simd", "-fno-trapping-math"])
    ext.optional = True  # setuptools' build_ext warns and goes on when an optional extension fails
    return ext


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
    exts = []
    for make in (cpu_extension, cuda_extension):
        try:
            ext = make()
        except Exception as exc:  # never fail the install: the torch path is always there
            print(f"megarl: not building {make.__name__} ({exc!r})", file=sys.stderr)
            ext = None
        if ext is not None:
            exts.append(ext)
    if not exts:
        return [], {}
    from torch.utils.cpp_extension import BuildExtension

    return exts, {"build_ext": BuildExtension}
