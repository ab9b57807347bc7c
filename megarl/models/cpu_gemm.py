"""GEMMs on a CPU: which library runs fp32 no-grad linears, megarl._cpu's kernel for the LM head
(on an AMD CPU the layers' too) at a decode step's rows; bf16/fp16 GEMMs optionally through fp32
sgemm, rounded once (train.cpu_half_gemm).

fp32 linears without autograd (generation, scoring). MKL's sgemm (what `torch.matmul` runs) and
oneDNN's fp32 inner product (`torch.ops.mkldnn._linear_pointwise`, in every x86 torch build)
compute the same product up to summation order, and which is faster depends on the CPU
(docs/benchmarks.md, `bench/bench_decode_layout.py`, `bench/bench_gemm_floor.py`). On an AMD
EPYC (Zen 4), oneDNN reading the [in, out] memory the rollout gives the weights
(models/decode_layout.py) took 0.7-1.0x of MKL's time from 2 to 64 rows (the 32k-word LM head
at 64 rows: 22 against 32 ms; at 1 row MKL's matrix-vector product wins), and 0.8-1.0x at
scoring sizes (thousands of rows, the stored [out, in] memory). On an Intel Xeon with AMX it is
the other way round: MKL on the [in, out] memory took 0.25-0.8x of oneDNN's time at 2-64 rows
and 0.9-1.0x at 1,280. So `cpu_linears(chunks)` routes the local GEMM of every megatron-core
linear through oneDNN for a block only where `onednn_pays()` (an AMD CPU with AVX-512; on
an AMD EPYC without it, Zen 3, oneDNN was 1.02-1.05x slower), where it has >= 2
rows, fp32 CPU operands, no autograd and no sequence-parallel gather; everything else takes
megatron-core's own path (MKL). Training keeps megatron's autograd function (its backward,
gradient accumulation fusion and main_grad).

The LM head at few rows is a different GEMM: a wide weight (>= OUT_MAJOR_MIN_OUT outputs, a
vocabulary shard) read whole for a handful of rows, bound by memory. From 1 to 32 rows, where
the CPU has AVX-512 and megarl._cpu is built (from 2 rows where it has AVX2 + FMA only: the
kernel's AVX2 form, WIDE_KERNEL_ROWS_AVX2), it runs megarl's own kernel on the [out, in]
tensor generation kept (`out_major`, from models/decode_layout.py; csrc/cpu_wide_linear.cpp:
the weight streamed once with a prefetch ahead), on any vendor; that tensor is moved to huge
pages on first use (runtime/huge_pages.py; docs/benchmarks.md). At the 152k x 256 head it took
0.6-0.9x of the best library's time at 3-32 rows on the EPYC and on the Xeon; at 2 rows 1.1x of
MKL's `(W @ x.T).T` on the EPYC but 0.44x on the Xeon, where that MKL path is as slow as at 16
rows. Since its 1-4-row path reads the weight's rows in turn (2026-11-29), on the EPYC it runs
at 1-4 rows in 0.63-0.79x of its former time, 1.0-1.15x of a plain read of the weight, and at
1 row in 0.9x of MKL's matrix-vector product on the [in, out] memory, which 1 row ran before
(on the Xeon neither was measured). So the head's GEMM gives every row the same bits at 1-32
live rows. Where the kernel is missing and oneDNN is routed, the wide weight's GEMM at 2-4 rows
runs MKL's `(W @ x.T).T` on the [out, in] tensor (0.5-0.85x of oneDNN's time on the EPYC; 1.3x
on the Xeon, which does not route).

The layers' linears at a decode step's rows run the same kernel on their [out, in] tensors where
`layer_kernel_pays()` (an AMD CPU with AVX-512 or AVX2 + FMA): at 1-64 rows (LAYER_KERNEL_ROWS),
above that oneDNN where it is routed, else MKL. A decode
step reads the LM head's weight between two layers' GEMMs, so each layer's weights come back from
memory, not from cache; the kernel streams them with its prefetch. On the EPYC, with the head read
in between as in generation, the four linears of a hidden-256 layer took 0.31-0.61x of oneDNN's
time at 1-32 rows, of a hidden-512 layer 0.43-0.88x at 1-64 rows; the realistic workload's generate
phase 0.83-0.94x, the default shape's 0.93-0.96x; on a Zen 3 (the kernel's AVX2 form, against
MKL) the realistic rollout 0.85-0.87x, the default shape's 0.83-0.91x (docs/benchmarks.md). Not
measured on an Intel CPU, where the layers keep MKL.

A half-precision GEMM on a CPU multiplies half inputs, accumulates in fp32 and rounds the result
to half once. The product of two bf16 (or fp16) numbers is exact in fp32 (8 + 8 or 11 + 11
significand bits < 24), so upcasting both operands, running the fp32 GEMM and rounding its result
to half computes the same thing: the results differ only where the two kernels sum in a different
order. Which of the two is faster is a property of the CPU, not of its flags: on an Intel Xeon
with AVX-512 BF16 but no AMX, torch's half GEMMs (oneDNN) ran at 0.55x of fp32 sgemm; on an AMD
EPYC (Zen 4, also AVX-512 BF16) at 2-2.5x (docs/benchmarks.md; `bench/bench_gemm_floor.py`
measures a machine). So torch's half kernels stay the default ("native") and "fp32" is the
setting for CPUs where the benchmark shows them slower.

`half_gemms_in_fp32(chunks, enabled)` is a dispatch mode for a forward (and the backward run
inside it): every `mm` / `addmm` / `bmm` whose tensor operands are all bf16 or all fp16 CPU
tensors runs in fp32 and returns half. Operands that are views of the chunks' parameters (the
weights) are converted once per block and kept in [rows, cols] contiguous memory as the GEMM
reads them (at decode-step sizes that is also the faster layout for MKL; see
models/decode_layout.py); everything else (the activations) is converted per call. The cost is
one fp32 copy of each weight layout used while the block runs.
"""
from __future__ import annotations

import bisect
import contextlib
import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megarl.models import cpu_kernels
from megarl.runtime import huge_pages

HALF = (torch.bfloat16, torch.float16)
SETTINGS = ("native", "fp32")  # train.cpu_half_gemm


def fp32_for_half(setting: str, device: torch.device) -> bool:
    """Whether half GEMMs on `device` run through fp32 under `setting` (train.cpu_half_gemm):
    only on a CPU, and only when asked ("fp32")."""
    if setting not in SETTINGS:
        raise ValueError(f"train.cpu_half_gemm must be one of {', '.join(SETTINGS)}, got {setting!r}")
    return setting == "fp32" and torch.device(device).type == "cpu"


class HalfGemmsInFp32(TorchDispatchMode):
    """See the module docstring. params: the tensors whose fp32 copies may be kept for the block."""

    def __init__(self, params=()):
        super().__init__()
        spans = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size())
                       for p in params if p.dtype in HALF and p.device.type == "cpu" and p.numel())
        self._starts = [s for s, _ in spans]
        self._ends = [e for _, e in spans]
        self._fp32: dict = {}  # (data_ptr, shape, strides, version) -> fp32 contiguous copy
        self.gemms = self.attentions = 0  # calls run in fp32 (tests read them)

    def _is_param_view(self, t: torch.Tensor) -> bool:
        i = bisect.bisect_right(self._starts, t.data_ptr()) - 1
        return i >= 0 and t.data_ptr() < self._ends[i]

    def fp32_operand(self, t: torch.Tensor) -> torch.Tensor:
        """t in fp32: a weight's copy is made once per block, anything else's per call."""
        if not self._is_param_view(t):
            return t.float()
        key = (t.data_ptr(), tuple(t.shape), t.stride(), t._version)
        up = self._fp32.get(key)
        if up is None:
            up = self._fp32[key] = t.float().contiguous()
        return up

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            out = handler(self, func, args, kwargs)
            if out is not NotImplemented:
                return out
        return func(*args, **kwargs)


def _half_dtype(tensors):
    """The half dtype all of `tensors` share on the CPU, else None."""
    dtype = tensors[0].dtype
    ok = dtype in HALF and all(t.dtype == dtype and t.device.type == "cpu" for t in tensors)
    return dtype if ok else None


def _gemm(mode, func, args, kwargs):
    """mm, mm.out, addmm, bmm with every tensor operand in one half dtype: fp32, rounded once."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    dtype = _half_dtype(tensors)
    if dtype is None:
        return NotImplemented
    mode.gemms += 1
    if func is torch.ops.aten.mm.default:
        return torch.mm(mode.fp32_operand(args[0]), mode.fp32_operand(args[1])).to(dtype)
    if func is torch.ops.aten.mm.out:
        return kwargs["out"].copy_(torch.mm(mode.fp32_operand(args[0]), mode.fp32_operand(args[1])))
    if func is torch.ops.aten.addmm.default:
        return torch.addmm(args[0].float(), mode.fp32_operand(args[1]), mode.fp32_operand(args[2]), **kwargs).to(dtype)
    return torch.bmm(args[0].float(), args[1].float()).to(dtype)


def _attention(mode, func, args, kwargs):
    """CPU flash attention forward / backward over more than one query (training, scoring,
    prefill): its half kernels run their GEMMs in half (2.9x slower than fp32 in training's
    forward + backward at [8, 8, 160, 64], docs/benchmarks.md). One decode query is memory-bound,
    reading the KV cache, where half's smaller reads win: left native."""
    q = args[1] if func is _SDPA_BWD else args[0]
    if q.dim() < 2 or q.shape[-2] <= 1 or _half_dtype([q]) is None:
        return NotImplemented
    dtype = q.dtype
    up = [a.float() if isinstance(a, torch.Tensor) and a.dtype == dtype else a for a in args]
    kw = {k: v.float() if isinstance(v, torch.Tensor) and v.dtype == dtype else v for k, v in kwargs.items()}
    mode.attentions += 1
    if func is _SDPA_BWD:
        return tuple(g.to(dtype) if g is not None else None for g in func(*up, **kw))
    out, lse = func(*up, **kw)
    return out.to(dtype), lse  # logsumexp is fp32 either way


_SDPA_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_SDPA_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_HANDLERS = {torch.ops.aten.mm.default: _gemm, torch.ops.aten.mm.out: _gemm, torch.ops.aten.addmm.default: _gemm,
             torch.ops.aten.bmm.default: _gemm, _SDPA_FWD: _attention, _SDPA_BWD: _attention}


def half_gemms_in_fp32(chunks, enabled: bool):
    """The mode over `chunks`' parameters when enabled and some are half on the CPU, else a no-op
    context. For one forward (with its backward) or one generation: the kept fp32 copies are
    dropped on exit, so weights may change between blocks."""
    if not enabled:
        return contextlib.nullcontext()
    params = [p for c in chunks for p in c.parameters() if p.dtype in HALF and p.device.type == "cpu"]
    return HalfGemmsInFp32(params) if params else contextlib.nullcontext()


# ---------------------------------------------------------------- fp32 no-grad linears: oneDNN, the head's kernel

ONEDNN_MIN_ROWS = 2  # below this MKL's matrix-vector product is faster than oneDNN (module docstring)
OUT_MAJOR_MAX_ROWS = 4  # without the kernel, up to this many rows a wide weight's GEMM reads its [out, in] memory
OUT_MAJOR_MIN_OUT = 16384  # "wide": an LM head (a vocabulary shard), not a layer's linear
WIDE_KERNEL_ROWS = (1, 32)  # megarl._cpu.wide_linear's rows on the wide weights (module docstring)
# ... on a CPU without AVX-512 (its AVX2 form): at 1 row MKL's matrix-vector product on the [in, out]
# memory took 7.1 ms at 152k x 256 on an AMD Zen 3 against the kernel's 10.8 (2-4 rows: 11.5-13.5
# against MKL's 14.6-22.4), so 1 row stays with MKL there
WIDE_KERNEL_ROWS_AVX2 = (2, 32)
LAYER_KERNEL_ROWS = (1, 64)  # and on the other weights of out_major, with layer_kernel (layer_kernel_pays)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.cache
def _cpuinfo(cpuinfo: str = "/proc/cpuinfo") -> tuple[str | None, frozenset]:
    """(`vendor_id` (AuthenticAMD, GenuineIntel), the first `flags` line's flags) of
    /proc/cpuinfo; None and no flags where a line is missing (another architecture) or the file
    unreadable."""
    vendor, flags = None, frozenset()
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("vendor_id") and vendor is None:
                    vendor = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return vendor, flags


def onednn_pays(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether no-grad fp32 linears should leave MKL for oneDNN on this machine: on an AMD CPU
    with AVX-512.

    Measured per linear, fp32, 1 thread (docs/benchmarks.md): on an AMD EPYC (Zen 4, AVX-512)
    oneDNN took 0.7-1.0x of MKL's time at decode sizes (2-64 rows) and 0.8-1.0x at scoring sizes;
    on an AMD EPYC without AVX-512 (Zen 3) the default shape's rollout took 1.02-1.05x of MKL's
    time with oneDNN and its scoring the same; on an Intel Xeon with AMX, MKL on the weights' [in,
    out] memory took 0.25-0.8x of oneDNN's time at 2-64 rows (oneDNN's per-call cost dominates at
    few rows) and 0.9-1.0x at 1,280 rows. MKL is Intel's library, so elsewhere (Intel, AMD
    without AVX-512, other architectures, an unreadable `cpuinfo`) torch's own path stays."""
    vendor, flags = _cpuinfo(cpuinfo)
    return vendor == "AuthenticAMD" and "avx512f" in flags and onednn_available()


def layer_kernel_pays(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether, while generating, the layers' linears (not only the wide LM head) run
    megarl._cpu's kernel at LAYER_KERNEL_ROWS rows on their [out, in] tensors (and a decode step's
    layers each run as one `decode_layer` call): on an AMD CPU with AVX-512 or with AVX2 + FMA.

    On an AMD EPYC Zen 4, 1 thread, with the LM head's weight read between calls as a decode step
    reads it: 0.31-0.61x of oneDNN's time at 1-32 rows for a hidden-256 layer's four linears,
    0.43-0.88x at 1-64 rows at hidden 512. On a Zen 3 (AVX2 only) the realistic rollout took
    0.85-0.87x of its CPU time with them, the default-shape rollout 0.83-0.91x
    (docs/benchmarks.md). Not measured on an Intel CPU, where the layers keep MKL on their
    [in, out] memory."""
    vendor, flags = _cpuinfo(cpuinfo)
    return vendor == "AuthenticAMD" and ("avx512f" in flags or {"avx2", "fma"} <= flags)


def plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """megatron-core's no-grad linear (LinearWithGradAccumulationAndAsyncCommunication.forward
    without sequence parallelism): the same two ops, without the autograd Function around them."""
    out = torch.matmul(x, weight.t())
    return out + bias if bias is not None else out


def _cpu_forward_impl(megatron_impl, out_major=None, onednn: bool = True, layer_kernel: bool = False):
    """A linear's `_forward_impl` (megatron-core calls it with keywords: input, weight, bias,
    sequence_parallel, and the backward's settings) that runs a wide weight's GEMM at 1-32 rows
    through megarl._cpu's kernel (out_major: {id(weight): the same values in [out, in] memory}),
    with `layer_kernel` every other weight's in out_major at 1-64 rows too, with `onednn` every
    other local GEMM of 2+ rows through oneDNN (a wide weight's at 2-4 rows through MKL on its
    [out, in] memory where the kernel is missing), and megatron's own implementation everywhere
    else (module docstring). `plain=True` (models/decode_step.py, no autograd, no sequence
    parallelism) runs megatron's maths there without its autograd Function."""
    kernel = cpu_kernels.wide_linear() if out_major else None  # megarl._cpu.wide_linear, or None
    wide_rows = WIDE_KERNEL_ROWS if "avx512f" in _cpuinfo()[1] else WIDE_KERNEL_ROWS_AVX2

    def megatron(input, weight, bias, sequence_parallel, plain, kwargs):
        if plain:
            return plain_linear(input, weight, bias)
        return megatron_impl(input=input, weight=weight, bias=bias, sequence_parallel=sequence_parallel, **kwargs)

    def forward_impl(input, weight, bias=None, sequence_parallel=False, plain=False, **kwargs):
        rows = input.numel() // max(input.shape[-1], 1)
        if (sequence_parallel or torch.is_grad_enabled() or rows < 1
                or input.device.type != "cpu" or input.dtype != torch.float32 or weight.dtype != torch.float32):
            return megatron(input, weight, bias, sequence_parallel, plain, kwargs)
        stored = out_major.get(id(weight)) if out_major else None  # [out, in] memory, or None
        wide = stored is not None and weight.shape[0] >= OUT_MAJOR_MIN_OUT
        lo, hi = wide_rows if wide else LAYER_KERNEL_ROWS
        use_kernel = (kernel is not None and (wide or (layer_kernel and stored is not None)) and lo <= rows <= hi
                      and stored.is_contiguous())
        if not use_kernel and (rows < ONEDNN_MIN_ROWS or not onednn):
            return megatron(input, weight, bias, sequence_parallel, plain, kwargs)
        x = input.reshape(rows, input.shape[-1]).contiguous()  # [rows, in]
        if use_kernel:
            out = kernel(x, stored)  # [rows, out]: megarl's kernel streams the [out, in] memory once
        elif wide and rows <= OUT_MAJOR_MAX_ROWS:  # MKL streams the [out, in] memory once
            out = torch.mm(stored, x.t()).t().contiguous()  # [rows, out]
        else:
            out = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")  # [rows, out]
            bias = None  # added by oneDNN
        if bias is not None:
            out += bias
        return out.view(*input.shape[:-1], out.shape[-1])

    return forward_impl


@contextlib.contextmanager
def cpu_linears(chunks, onednn: bool | None = None, out_major=None, layer_kernel: bool | None = None):
    """Inside the block, when the chunks are on a CPU, every megatron-core linear with an fp32
    weight runs its no-grad GEMMs as `_cpu_forward_impl` says: `onednn` (default: where
    `onednn_pays()`) routes them through oneDNN from ONEDNN_MIN_ROWS rows, and `out_major`'s
    wide weights (the LM head, from models/decode_layout.py) run megarl._cpu's kernel at
    WIDE_KERNEL_ROWS rows, with `layer_kernel` (default: where `layer_kernel_pays()`) its other
    weights too (module docstring). On exit (exception included) each gets megatron's
    implementation back. Yields the number of linears routed (0: nothing to change; without
    oneDNN and the layers' kernel only the wide or tied weights are routed)."""
    routed = []
    try:
        on_cpu = all(p.device.type == "cpu" for c in chunks for p in c.parameters())
        onednn = onednn_pays() if onednn is None else onednn and onednn_available()
        has_kernel = bool(out_major) and cpu_kernels.wide_linear() is not None
        layer_kernel = has_kernel and (layer_kernel_pays() if layer_kernel is None else bool(layer_kernel))
        if on_cpu and (onednn or has_kernel):
            from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

            linears = (ColumnParallelLinear, RowParallelLinear)
            for chunk in chunks:
                for module in chunk.modules():
                    w = getattr(module, "weight", None)
                    # weight None: a tied LM head, handed the embedding's weight per call. Without
                    # oneDNN and the layers' kernel only a wide (or tied) weight can take the
                    # kernel: the layers keep megatron's path without a wrapper call in between.
                    if (isinstance(module, linears) and "_forward_impl" not in vars(module)
                            and (w is None or (w.dtype == torch.float32
                                               and (onednn or layer_kernel or w.shape[0] >= OUT_MAJOR_MIN_OUT)))):
                        module._forward_impl = _cpu_forward_impl(module._forward_impl, out_major, onednn, layer_kernel)
                        routed.append(module)
            if has_kernel:
                for t in out_major.values():  # the kernel streams the wide ones whole every decode step
                    if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[0] >= OUT_MAJOR_MIN_OUT:
                        huge_pages.collapse(t)  # at once only the first time (runtime/huge_pages.py)
        yield len(routed)
    finally:
        for module in routed:
            del module._forward_impl
