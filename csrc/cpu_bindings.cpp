// Python bindings of megarl._cpu (pybind11, as megarl._C's): a failed argument check raises a
// RuntimeError naming the op.
#include <torch/extension.h>

namespace megarl_cpu {
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const c10::optional<at::Tensor>& masked, double scale,
                            const c10::optional<at::Tensor>& prefix_rows, int64_t prefix_len);
at::Tensor wide_linear(const at::Tensor& x, const at::Tensor& w);
std::tuple<at::Tensor, at::Tensor> sample_rows(const at::Tensor& logits, const at::Tensor& uniforms,
                                               double temperature, int64_t block);
bool wide_linear_supported();
at::Tensor logprob_stats(const at::Tensor& x, const at::Tensor& cols, const at::Tensor& owned, double inv_temp,
                         bool with_moment);
void logprob_grad(const at::Tensor& x, at::Tensor& out, const at::Tensor& lse, const at::Tensor& a,
                  const c10::optional<at::Tensor>& b, const at::Tensor& cols, const at::Tensor& c,
                  const at::Tensor& keep, double inv_temp);
}  // namespace megarl_cpu

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
  m.def("wide_linear_supported", &megarl_cpu::wide_linear_supported,
        "whether this CPU runs wide_linear (AVX-512)");
}
