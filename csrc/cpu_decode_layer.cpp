// megarl._cpu: one transformer layer at a decode step (one new token per row over the KV cache),
// fp32, in one call.
//
// A decode step of a model with a small hidden size on a CPU spends as much time between its
// GEMMs as in them: about 70 torch operations per layer (RMSNorm, the QKV split, RoPE, the cache
// write, SwiGLU, the residual adds), each a few microseconds of dispatch for a few KB of data
// (docs/benchmarks.md: ~0.27 ms per layer and decode step with the work itself near zero). Here
// the layer is one call: the elementwise work in plain loops, the four GEMMs through wide_linear
// (the weights' [out, in] memory streamed once, cpu_wide_linear.cpp) and the attention through
// decode_attention (cpu_decode_attention.cpp). The maths is megatron-core's TransformerLayer with
// megarl's attention (pre-RMSNorm, fused QKV, optional q/k RMSNorm, non-interleaved RoPE, SwiGLU,
// no dropout), the same as models/decode_step.py's `_layer` up to fp32 rounding: RMSNorm sums its
// squares in double, so results differ from torch's in the last bits (tests/test_decode_layer.py
// holds this to a float64 layer, tests/test_decode_step.py to the model's own logits).
//
// Bound with pybind11 (cpu_bindings.cpp) as megarl._cpu.decode_layer; the caller
// (models/decode_step.py) checks what the model is and passes only what this runs.
#include "cpu_common.h"
#include "cpu_ops.h"

#include <cmath>
#include <cstdint>
#include <string>

namespace {

using megarl_cpu::shape_of;

// y[i] = x[i] / sqrt(mean(x^2) + eps) * w[i] over n values (torch.nn.RMSNorm); y may be x.
inline void rms_norm(const float* x, const float* w, float eps, int64_t n, float* y) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(x[i]) * x[i];
  const float inv = static_cast<float>(1.0 / std::sqrt(sum / static_cast<double>(n) + eps));
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * inv * w[i];
}

// Non-interleaved RoPE of one head in place: x = (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
inline void rope(float* x, const float* cos, const float* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[half + i];
    x[i] = x1 * cos[i] - x2 * sin[i];
    x[half + i] = x2 * cos[i] + x1 * sin[i];
  }
}

void add_bias(at::Tensor& y, const c10::optional<at::Tensor>& bias) {
  if (!bias.has_value()) return;
  float* yp = y.data_ptr<float>();
  const float* bp = bias->data_ptr<float>();
  const int64_t rows = y.size(0), n = y.size(1);
  for (int64_t a = 0; a < rows; ++a)
    for (int64_t i = 0; i < n; ++i) yp[a * n + i] += bp[i];
}

#define MEGARL_CHECK_DL(cond, what) MEGARL_CHECK(cond, "decode_layer", what)

void check_f32(const at::Tensor& t, const char* name) {
  MEGARL_CHECK_DL(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(),
                  std::string(name) + " must be a contiguous float32 CPU tensor, got " +
                      c10::toString(t.scalar_type()) + " " + shape_of(t));
}

void check_vector(const c10::optional<at::Tensor>& t, int64_t n, const char* name) {
  if (!t.has_value()) return;
  check_f32(*t, name);
  MEGARL_CHECK_DL(t->dim() == 1 && t->size(0) == n,
                  std::string(name) + " must be [" + std::to_string(n) + "], got " + shape_of(*t));
}

void check_weight(const at::Tensor& w, int64_t out, int64_t in, const char* name) {
  check_f32(w, name);
  MEGARL_CHECK_DL(w.dim() == 2 && w.size(0) == out && w.size(1) == in,
                  std::string(name) + " must be [" + std::to_string(out) + ", " + std::to_string(in) + "], got " +
                      shape_of(w));
}

}  // namespace

namespace megarl_cpu {

// h [A, H]: the rows' hidden states. norm1 / norm2: the RMSNorm weights [H] before attention and
// MLP. w_qkv [g * (n / g + 2) * d, H] ([out, in] memory, megatron's fused QKV: per KV group its
// n / g query heads, then its key, then its value), b_qkv None or its bias. q_norm / k_norm: None
// or RMSNorm weights [d] per head. cos, sin [d / 2]: RoPE at this step's position (every row is
// at the same cache offset `start`). k_cache, v_cache [A, g, S, d] (unit stride over d, equal
// strides): this step's key (after RoPE) and value are written at position `start`, then
// attention reads positions [0, start] with `masked` (None or bool [A, start + 1], true = not
// attended), `prefix_rows` / `prefix_len` as decode_attention's. w_proj [H, n * d], w_fc1 [2 F, H]
// (gate rows, then up rows), b_fc1 None or [2 F], w_fc2 [H, F]. -> the layer's output [A, H].
at::Tensor decode_layer(const at::Tensor& h, const at::Tensor& norm1, double eps1, const at::Tensor& w_qkv,
                        const c10::optional<at::Tensor>& b_qkv, int64_t groups, int64_t heads, int64_t head_dim,
                        const c10::optional<at::Tensor>& q_norm, double q_eps, const c10::optional<at::Tensor>& k_norm,
                        double k_eps, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, int64_t start, const c10::optional<at::Tensor>& masked,
                        double scale, const c10::optional<at::Tensor>& prefix_rows, int64_t prefix_len,
                        const at::Tensor& w_proj, const at::Tensor& norm2, double eps2, const at::Tensor& w_fc1,
                        const c10::optional<at::Tensor>& b_fc1, const at::Tensor& w_fc2, double glu_offset) {
  check_f32(h, "h");
  MEGARL_CHECK_DL(h.dim() == 2 && h.size(0) > 0 && h.size(1) > 0, "h must be [A, H], got " + shape_of(h));
  const int64_t A = h.size(0), H = h.size(1), g = groups, n = heads, d = head_dim;
  MEGARL_CHECK_DL(g > 0 && n > 0 && n % g == 0 && d > 0 && d % 2 == 0,
                  "heads " + std::to_string(n) + " must be a multiple of groups " + std::to_string(g) +
                      " and head_dim " + std::to_string(d) + " even");
  const int64_t r = n / g, qkv_width = g * (r + 2) * d;
  check_vector(norm1, H, "norm1");
  check_vector(norm2, H, "norm2");
  check_weight(w_qkv, qkv_width, H, "w_qkv");
  check_vector(b_qkv, qkv_width, "b_qkv");
  check_vector(q_norm, d, "q_norm");
  check_vector(k_norm, d, "k_norm");
  check_vector(cos, d / 2, "cos");
  check_vector(sin, d / 2, "sin");
  check_weight(w_proj, H, n * d, "w_proj");
  MEGARL_CHECK_DL(w_fc1.dim() == 2 && w_fc1.size(0) % 2 == 0, "w_fc1 must be [2 F, H], got " + shape_of(w_fc1));
  const int64_t F = w_fc1.size(0) / 2;
  check_weight(w_fc1, 2 * F, H, "w_fc1");
  check_vector(b_fc1, 2 * F, "b_fc1");
  check_weight(w_fc2, H, F, "w_fc2");
  for (const at::Tensor* c : {&k_cache, &v_cache}) {
    MEGARL_CHECK_DL(c->device().is_cpu() && c->scalar_type() == at::kFloat && c->dim() == 4 && c->size(0) == A &&
                        c->size(1) == g && c->size(3) == d && c->stride(3) == 1,
                    "k_cache / v_cache must be float32 [A, g, S, d] with unit stride over d, got " + shape_of(*c));
  }
  MEGARL_CHECK_DL(k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides(),
                  "k_cache and v_cache must share shape and strides");
  MEGARL_CHECK_DL(start >= 0 && start < k_cache.size(2),
                  "start " + std::to_string(start) + " outside the cache's " + std::to_string(k_cache.size(2)) +
                      " positions");

  // attention: RMSNorm, the fused QKV GEMM, q/k norms, RoPE, the cache write
  at::Tensor x = at::empty({A, H}, h.options());
  const float* hp = h.data_ptr<float>();
  float* xp = x.data_ptr<float>();
  const float eps_1 = static_cast<float>(eps1), eps_2 = static_cast<float>(eps2);
  for (int64_t a = 0; a < A; ++a) rms_norm(hp + a * H, norm1.data_ptr<float>(), eps_1, H, xp + a * H);
  at::Tensor qkv = wide_linear(x, w_qkv);  // [A, g * (r + 2) * d]
  add_bias(qkv, b_qkv);
  at::Tensor query = at::empty({A, n, d}, h.options());
  float* qp = query.data_ptr<float>();
  const float* qkvp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const float* qn = q_norm.has_value() ? q_norm->data_ptr<float>() : nullptr;
  const float* kn = k_norm.has_value() ? k_norm->data_ptr<float>() : nullptr;
  const float qe = static_cast<float>(q_eps), ke = static_cast<float>(k_eps);
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const int64_t cb = k_cache.stride(0), cg = k_cache.stride(1), cs = k_cache.stride(2);
  for (int64_t a = 0; a < A; ++a) {
    for (int64_t j = 0; j < g; ++j) {
      const float* group = qkvp + a * qkv_width + j * (r + 2) * d;
      for (int64_t i = 0; i < r; ++i) {
        float* q = qp + (a * n + j * r + i) * d;
        const float* src = group + i * d;
        if (qn != nullptr) {
          rms_norm(src, qn, qe, d, q);
        } else {
          for (int64_t e = 0; e < d; ++e) q[e] = src[e];
        }
        rope(q, cp, sp, d / 2);
      }
      float* k = kc + a * cb + j * cg + start * cs;
      float* v = vc + a * cb + j * cg + start * cs;
      const float* ksrc = group + r * d;
      const float* vsrc = group + (r + 1) * d;
      if (kn != nullptr) {
        rms_norm(ksrc, kn, ke, d, k);
      } else {
        for (int64_t e = 0; e < d; ++e) k[e] = ksrc[e];
      }
      rope(k, cp, sp, d / 2);
      for (int64_t e = 0; e < d; ++e) v[e] = vsrc[e];
    }
  }
  const at::Tensor keys = k_cache.narrow(2, 0, start + 1), values = v_cache.narrow(2, 0, start + 1);
  at::Tensor context = decode_attention(query, keys, values, masked, scale, prefix_rows, prefix_len);  // [A, n, d]
  at::Tensor h1 = wide_linear(context.view({A, n * d}), w_proj);  // [A, H]
  float* h1p = h1.data_ptr<float>();
  for (int64_t i = 0; i < A * H; ++i) h1p[i] += hp[i];  // the residual

  // MLP: RMSNorm, SwiGLU, the residual
  for (int64_t a = 0; a < A; ++a) rms_norm(h1p + a * H, norm2.data_ptr<float>(), eps_2, H, xp + a * H);
  at::Tensor y = wide_linear(x, w_fc1);  // [A, 2 F]
  add_bias(y, b_fc1);
  at::Tensor act = at::empty({A, F}, h.options());
  const float* yp = y.data_ptr<float>();
  float* ap = act.data_ptr<float>();
  const float offset = static_cast<float>(glu_offset);
  for (int64_t a = 0; a < A; ++a) {
    const float* gate = yp + a * 2 * F;
    const float* up = gate + F;
    float* o = ap + a * F;
    for (int64_t i = 0; i < F; ++i) o[i] = gate[i] / (1.0f + std::exp(-gate[i])) * (up[i] + offset);
  }
  at::Tensor out = wide_linear(act, w_fc2);  // [A, H]
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < A * H; ++i) op[i] += h1p[i];
  return out;
}

}  // namespace megarl_cpu
