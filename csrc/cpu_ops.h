// megarl._cpu's entry points (csrc/cpu_*.cpp), declared once: cpu_bindings.cpp binds them, and
// cpu_decode_layer.cpp calls decode_attention and wide_linear.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <tuple>

namespace megarl_cpu {
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const c10::optional<at::Tensor>& masked, double scale,
                            const c10::optional<at::Tensor>& prefix_rows, int64_t prefix_len);
at::Tensor wide_linear(const at::Tensor& x, const at::Tensor& w);
std::tuple<at::Tensor, at::Tensor> sample_rows(const at::Tensor& logits, const at::Tensor& uniforms,
                                               double temperature, int64_t block);
bool wide_linear_supported();
at::Tensor decode_layer(const at::Tensor& h, const at::Tensor& norm1, double eps1, const at::Tensor& w_qkv,
                        const c10::optional<at::Tensor>& b_qkv, int64_t groups, int64_t heads, int64_t head_dim,
                        const c10::optional<at::Tensor>& q_norm, double q_eps, const c10::optional<at::Tensor>& k_norm,
                        double k_eps, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, int64_t start, const c10::optional<at::Tensor>& masked,
                        double scale, const c10::optional<at::Tensor>& prefix_rows, int64_t prefix_len,
                        const at::Tensor& w_proj, const at::Tensor& norm2, double eps2, const at::Tensor& w_fc1,
                        const c10::optional<at::Tensor>& b_fc1, const at::Tensor& w_fc2, double glu_offset);
at::Tensor logprob_stats(const at::Tensor& x, const at::Tensor& cols, const at::Tensor& owned, double inv_temp,
                         bool with_moment);
void logprob_grad(const at::Tensor& x, at::Tensor& out, const at::Tensor& lse, const at::Tensor& a,
                  const c10::optional<at::Tensor>& b, const at::Tensor& cols, const at::Tensor& c,
                  const at::Tensor& keep, double inv_temp);
}  // namespace megarl_cpu
