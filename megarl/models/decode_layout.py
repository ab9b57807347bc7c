"""CPU generation: every linear's weight read from [in, out] memory for the call.

megatron-core's linears compute `x @ W.t()` with W stored [out, in]: MKL's "NT" sgemm. A decode
step multiplies a few rows (1-64) by every weight, and there, on CPU in fp32, the same product
with W.t() stored contiguous ("NN") is 1.1-2x faster (docs/benchmarks.md: the 151,936 x 256 LM
head at 4-9 rows 1.5-1.9x, the 2816 x 512 fc1 at 16 rows 1.7x); at prefill and training sizes the
two are equal. The values are the same, so the model is the same; only the GEMM's summation order
differs (fp32 rounding). bf16 weights are not switched: there the stored layout was 3-10% faster
on the CPU we measured. On a GPU cuBLAS has no such dip and memory is scarce,
so nothing is switched there.

Cost: a second copy of the switched weights for the duration of the call (the [out, in] tensors
are kept to be put back untouched, views into megatron's parameter buffers included).
The GEMM library those linears use while generating is models/cpu_gemm.py's `cpu_linears`.
"""
from __future__ import annotations

import contextlib

import torch

from megarl.models.layout import unwrap


def _layout_modules():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    return (ColumnParallelLinear, RowParallelLinear), VocabParallelEmbedding


def switchable_weights(chunks) -> list[torch.nn.Parameter]:
    """The [out, in] weights that the decode GEMMs read: every megatron linear's, and the word
    embedding's where the LM head reads it (tied embeddings), fp32 on CPU only."""
    linears, embedding = _layout_modules()
    found, seen = [], set()
    for chunk in chunks:
        gpt = unwrap(chunk)
        head_reads_embedding = gpt.share_embeddings_and_output_weights and gpt.post_process
        for module in chunk.modules():
            w = getattr(module, "weight", None)
            if isinstance(module, embedding):
                if not head_reads_embedding:
                    continue
            elif not isinstance(module, linears):
                continue
            if (isinstance(w, torch.Tensor) and w.dim() == 2 and w.dtype == torch.float32 and w.device.type == "cpu"
                    and id(w) not in seen):
                seen.add(id(w))
                found.append(w)
    return found


@contextlib.contextmanager
def in_major_weights(chunks, enabled: bool = True):
    """Inside the block, each switchable weight holds the same values with [in, out] memory
    (`w.t()` contiguous); on exit (exception included) every weight gets its own tensor back.
    Yields {id(weight): its own [out, in] tensor} of the weights switched (kept anyway, to be put
    back; models/cpu_gemm.py reads the LM head's at 1-32 rows). For no-grad forwards only
    (generation)."""
    swapped = []
    try:
        if enabled:
            with torch.no_grad():
                for w in switchable_weights(chunks):
                    original = w.data
                    w.data = original.t().contiguous().t()  # [out, in] shape, [in, out] memory
                    swapped.append((w, original))
        yield {id(w): original for w, original in swapped}
    finally:
        for w, original in swapped:
            w.data = original
