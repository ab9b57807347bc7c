// megarl._cpu: attention of one new token per row over a KV cache, on a CPU.
//
// A decode step asks, for every (row, head), for softmax(q . K^T * scale) . V over the row's
// cached positions: two matrix-vector products on a [S, d] block of 10-100 KB. torch's SDPA on
// a CPU runs each block as separate small GEMM calls and reads the cache at 6-10 GB/s; here one
// pass per (row, KV head) reads each cached key and value once for all the query heads that
// share it (grouped-query attention), with fp32 accumulation, and the exponentials vectorise.
// The samples of one prompt may read its positions from one row (prefix_rows): the reads are
// bound by memory, and that row's block is in the L2 cache when the next rows of the group ask.
//
// Bound with pybind11 (cpu_bindings.cpp) as megarl._cpu.decode_attention (no autograd:
// generation only), as megarl._C is: a failed check becomes a Python RuntimeError inside this
// library.
#include "cpu_common.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using megarl_cpu::exp_nonpositive;

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// A row of d values into the cache ahead of its use.
template <typename T>
inline __attribute__((always_inline)) void prefetch_row(const T* row, int64_t d) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < d * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(p + b);
}

// One (row, KV head): r query heads [r, d] (fp32, contiguous) against S cached positions,
// one head at a time (its keys and values stay in L1/L2 for the next head of the group).
// D > 0 is d known at compile time (the loops over d unroll and the output stays in
// registers); D == 0 reads d at run time. scores: [S] workspace; out: [r, d] fp32. Masked
// positions (masked[s * mask_stride] true) are never read and get exactly zero weight; a row
// whose positions are all masked gets zeros, as torch's CPU SDPA gives.

//
// Positions below P are read from other rows' memory (k.pre, v.pre): the prompt a row shares with
// the other samples of its prompt, cached once per row but read from the first row of the group,
// so that the rows of a group find it in the L2 cache (the same values: the result is bitwise the
// same). P = 0: every position from the row's own memory.

template <typename T>
struct Rows {
  const T* own;  // this row's [S, d] block (stride s_stride over S)
  const T* pre;  // the block positions < P are read from (own when nothing is shared)
  inline __attribute__((always_inline)) const T* at(int64_t s, int64_t P, int64_t s_stride) const {
    return (s < P ? pre : own) + s * s_stride;
  }
};

template <int D, typename T>
inline __attribute__((always_inline)) void attend_block(const float* q, Rows<T> k, Rows<T> k_next, Rows<T> v,
                                                        int64_t P, int64_t s_stride,
                                                        const bool* masked, int64_t mask_stride, int64_t S,
                                                        int64_t d_runtime, int64_t r, float scale, float* scores,
                                                        float* out) {
  const int64_t d = D > 0 ? D : d_runtime;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < r; ++j) {
    const float* qj = q + j * d;
    float m = neg_inf;
    for (int64_t s = 0; s < S; ++s) {
      if (masked != nullptr && masked[s * mask_stride]) {
        scores[s] = neg_inf;
        continue;
      }
      const T* ks = k.at(s, P, s_stride);
      if (j == 0) prefetch_row(v.at(s, P, s_stride), d);  // read by the weighted sum below
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int64_t i = 0; i < d; ++i) acc += qj[i] * to_float(ks[i]);
      scores[s] = acc * scale;
      m = scores[s] > m ? scores[s] : m;
    }
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t s = 0; s < S; ++s) {
      float p = scores[s] == neg_inf ? 0.0f : exp_nonpositive(scores[s] - m);
      scores[s] = p;
      sum += p;
    }
    float* oj = out + j * d;
    if constexpr (D > 0) {
      float acc[D] = {};
      for (int64_t s = 0; s < S; ++s) {
        const T* vs = v.at(s, P, s_stride);
        if (k_next.own != nullptr && j == r - 1) prefetch_row(k_next.at(s, P, s_stride), d);  // the next block's keys
        if (masked != nullptr && masked[s * mask_stride]) continue;  // never read: 0 * NaN would be NaN
        const float p = scores[s];
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) acc[i] += p * to_float(vs[i]);
      }
      const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;  // every position masked: zeros, as SDPA
      for (int64_t i = 0; i < D; ++i) oj[i] = acc[i] * inv;
    } else {
      std::fill(oj, oj + d, 0.0f);
      for (int64_t s = 0; s < S; ++s) {
        if (masked != nullptr && masked[s * mask_stride]) continue;
        const T* vs = v.at(s, P, s_stride);
        const float p = scores[s];
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) oj[i] += p * to_float(vs[i]);
      }
      const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
      for (int64_t i = 0; i < d; ++i) oj[i] *= inv;
    }
  }
}

template <typename T>
inline __attribute__((always_inline)) void attend_any(const float* q, Rows<T> k, Rows<T> k_next, Rows<T> v, int64_t P,
                                                      int64_t s_stride, const bool* masked, int64_t mask_stride,
                                                      int64_t S, int64_t d, int64_t r, float scale, float* scores,
                                                      float* out) {
  switch (d) {
    case 64: return attend_block<64>(q, k, k_next, v, P, s_stride, masked, mask_stride, S, d, r, scale, scores, out);
    case 128: return attend_block<128>(q, k, k_next, v, P, s_stride, masked, mask_stride, S, d, r, scale, scores, out);
    default: return attend_block<0>(q, k, k_next, v, P, s_stride, masked, mask_stride, S, d, r, scale, scores, out);
  }
}

MEGARL_CLONES void attend_f32(const float* q, Rows<float> k, Rows<float> k_next, Rows<float> v, int64_t P,
                              int64_t s_stride, const bool* masked, int64_t mask_stride, int64_t S, int64_t d,
                              int64_t r, float scale, float* scores, float* out) {
  attend_any(q, k, k_next, v, P, s_stride, masked, mask_stride, S, d, r, scale, scores, out);
}

MEGARL_CLONES void attend_bf16(const float* q, Rows<c10::BFloat16> k, Rows<c10::BFloat16> k_next,
                               Rows<c10::BFloat16> v, int64_t P, int64_t s_stride,
                               const bool* masked, int64_t mask_stride, int64_t S, int64_t d, int64_t r, float scale,
                               float* scores, float* out) {
  attend_any(q, k, k_next, v, P, s_stride, masked, mask_stride, S, d, r, scale, scores, out);
}

template <typename T, typename F>
at::Tensor run(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
               const c10::optional<at::Tensor>& masked, double scale, const int64_t* prefix_rows, int64_t P,
               F attend) {
  const int64_t B = query.size(0), H = query.size(1), d = query.size(2);
  const int64_t g = key.size(1), S = key.size(2), r = H / g;
  at::Tensor out = at::empty({B, H, d}, query.options());
  const T* qp = query.data_ptr<T>();
  const T* kp = key.data_ptr<T>();
  const T* vp = value.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const bool* mp = masked.has_value() ? masked->data_ptr<bool>() : nullptr;
  const int64_t mb = masked.has_value() ? masked->stride(0) : 0, ms = masked.has_value() ? masked->stride(1) : 0;
  const int64_t qb = query.stride(0), qh = query.stride(1);
  const int64_t kb = key.stride(0), kg = key.stride(1), vb = value.stride(0), vg = value.stride(1);
  const int64_t s_stride = key.stride(2);
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * g, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(r * d), of(r * d), scores(S);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / g, h = idx % g;
      for (int64_t j = 0; j < r; ++j)
        for (int64_t i = 0; i < d; ++i) qf[j * d + i] = to_float(qp[b * qb + (h * r + j) * qh + i]);
      const int64_t nb = (idx + 1) / g, nh = (idx + 1) % g;
      const int64_t pb = prefix_rows == nullptr ? b : prefix_rows[b];  // the row positions < P are read from
      const Rows<T> k_row{kp + b * kb + h * kg, kp + pb * kb + h * kg};
      const Rows<T> v_row{vp + b * vb + h * vg, vp + pb * vb + h * vg};
      Rows<T> k_next{nullptr, nullptr};
      if (idx + 1 < end) {
        const int64_t npb = prefix_rows == nullptr ? nb : prefix_rows[nb];
        k_next = Rows<T>{kp + nb * kb + nh * kg, kp + npb * kb + nh * kg};
      }
      attend(qf.data(), k_row, k_next, v_row, P, s_stride,
             mp == nullptr ? nullptr : mp + b * mb, ms, S, d, r, sc, scores.data(), of.data());
      T* ob = op + (b * H + h * r) * d;
      for (int64_t i = 0; i < r * d; ++i) ob[i] = static_cast<T>(of[i]);
    }
  });
  return out;
}

}  // namespace

namespace megarl_cpu {

#define MEGARL_CHECK_DA(cond, what) MEGARL_CHECK(cond, "decode_attention", what)

// query [B, H, d]; key, value [B, g, S, d] (any strides but unit stride over d, equal strides
// for key and value over S); masked: None or bool [B, S], true = this position is not attended.
// prefix_rows: None or int64 [B] in [0, B): row b reads its positions < prefix_len from row
// prefix_rows[b], which must hold the same values there (a shared prompt).
// -> [B, H, d] in query's dtype. Head h reads KV head h / (H / g), as SDPA's enable_gqa does.
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const c10::optional<at::Tensor>& masked, double scale,
                            const c10::optional<at::Tensor>& prefix_rows, int64_t prefix_len) {
  MEGARL_CHECK_DA(query.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu(), "CPU tensors only");
  MEGARL_CHECK_DA(query.dim() == 3 && key.dim() == 4 && value.dim() == 4,
               "query [B, H, d], key/value [B, g, S, d] expected, got " + shape_of(query) + ", " + shape_of(key) +
                   ", " + shape_of(value));
  MEGARL_CHECK_DA(key.sizes() == value.sizes() && key.size(0) == query.size(0) && key.size(3) == query.size(2) &&
            key.size(1) > 0 && query.size(1) % key.size(1) == 0,
        "shapes query " + shape_of(query) + " key " + shape_of(key) + " value " + shape_of(value) +
            " do not fit (B, d equal; H a multiple of g)");
  MEGARL_CHECK_DA(query.stride(2) == 1 && key.stride(3) == 1 && value.stride(3) == 1 && key.stride(2) == value.stride(2),
        "unit stride over d and equal key/value strides over S required");
  MEGARL_CHECK_DA(query.scalar_type() == key.scalar_type() && key.scalar_type() == value.scalar_type(),
        "query, key and value must share a dtype");
  if (masked.has_value()) {
    MEGARL_CHECK_DA(masked->scalar_type() == at::kBool && masked->dim() == 2 && masked->size(0) == key.size(0) &&
              masked->size(1) == key.size(2),
          "masked must be bool [B, S]");
  }
  const int64_t* pr = nullptr;
  if (prefix_rows.has_value()) {
    const at::Tensor& rows = *prefix_rows;
    MEGARL_CHECK_DA(rows.device().is_cpu() && rows.scalar_type() == at::kLong && rows.dim() == 1 &&
                        rows.size(0) == key.size(0) && rows.is_contiguous(),
                    "prefix_rows must be a contiguous int64 CPU tensor [B], got " + shape_of(rows));
    pr = rows.data_ptr<int64_t>();
    for (int64_t b = 0; b < rows.size(0); ++b)
      MEGARL_CHECK_DA(pr[b] >= 0 && pr[b] < key.size(0), "prefix_rows[" + std::to_string(b) + "] = " +
                                                              std::to_string(pr[b]) + " is not a row of the cache");
  }
  MEGARL_CHECK_DA(prefix_len >= 0 && prefix_len <= key.size(2),
                  "prefix_len " + std::to_string(prefix_len) + " outside [0, " + std::to_string(key.size(2)) + "]");
  const int64_t P = pr == nullptr ? 0 : prefix_len;
  switch (query.scalar_type()) {
    case at::kFloat: return run<float>(query, key, value, masked, scale, pr, P, attend_f32);
    case at::kBFloat16: return run<c10::BFloat16>(query, key, value, masked, scale, pr, P, attend_bf16);
    default: fail(std::string("decode_attention: float32 or bfloat16 only, got ") + c10::toString(query.scalar_type()));
  }
}

}  // namespace megarl_cpu
