// Python bindings of megarl._cpu (pybind11, as megarl._C's): a failed argument check raises a
// RuntimeError naming the op. torch's pybind11 casters (Tensor, optional) without the rest of
// <torch/extension.h>, which would add ~30 s to this file's compile.
#include <torch/csrc/utils/pybind.h>

#include "cpu_ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &megarl_cpu::decode_attention,
        "softmax(q K^T * scale) V of one query token per row over a KV cache", pybind11::arg("query"),
        pybind11::arg("key"), pybind11::arg("value"), pybind11::arg("masked"), pybind11::arg("scale"),
        pybind11::arg("prefix_rows") = pybind11::none(), pybind11::arg("prefix_len") = 0);
  m.def("wide_linear", &megarl_cpu::wide_linear, "x w^T for a few rows x [R, h] and a wide weight w [V, h], fp32",
        pybind11::arg("x"), pybind11::arg("w"));
  m.def("sample_rows", &megarl_cpu::sample_rows,
        "one token per row by inverse CDF over softmax(logits / temperature), and its log-prob",
        pybind11::arg("logits"), pybind11::arg("uniforms"), pybind11::arg("temperature"), pybind11::arg("block"));
  m.def("logprob_stats", &megarl_cpu::logprob_stats,
        "per row of fp32 logits: max, sum of exp, first moment and the target's logit (times 1/temperature)",
        pybind11::arg("x"), pybind11::arg("cols"), pybind11::arg("owned"), pybind11::arg("inv_temp"),
        pybind11::arg("with_moment"));
  m.def("logprob_grad", &megarl_cpu::logprob_grad,
        "fp32 logits -> d loss / d logits (out may be x), from each row's lse and loss coefficients",
        pybind11::arg("x"), pybind11::arg("out"), pybind11::arg("lse"), pybind11::arg("a"), pybind11::arg("b"),
        pybind11::arg("cols"),
        pybind11::arg("c"), pybind11::arg("keep"), pybind11::arg("inv_temp"));
  m.def("decode_layer", &megarl_cpu::decode_layer,
        "one pre-norm transformer layer (fused QKV, RoPE, KV-cache attention, SwiGLU) at a decode step, fp32",
        pybind11::arg("h"), pybind11::arg("norm1"), pybind11::arg("eps1"), pybind11::arg("w_qkv"),
        pybind11::arg("b_qkv"), pybind11::arg("groups"), pybind11::arg("heads"), pybind11::arg("head_dim"),
        pybind11::arg("q_norm"), pybind11::arg("q_eps"), pybind11::arg("k_norm"), pybind11::arg("k_eps"),
        pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("k_cache"), pybind11::arg("v_cache"),
        pybind11::arg("start"), pybind11::arg("masked"), pybind11::arg("scale"), pybind11::arg("prefix_rows"),
        pybind11::arg("prefix_len"), pybind11::arg("w_proj"), pybind11::arg("norm2"), pybind11::arg("eps2"),
        pybind11::arg("w_fc1"), pybind11::arg("b_fc1"), pybind11::arg("w_fc2"), pybind11::arg("glu_offset"));
  m.def("wide_linear_supported", &megarl_cpu::wide_linear_supported,
        "whether this CPU runs wide_linear (AVX-512)");
}
