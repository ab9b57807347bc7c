// megarl._cpu.logprob_stats / logprob_grad: the row passes of ops/logprobs.py's torch path over
// one chunk of fp32 logits on a CPU (used by the fused output layer and the logits path alike).
//
// The torch path makes about seven passes over a [rows, V] chunk in the forward (max, subtract,
// exp, sum, clamp, multiply, sum) and five in the backward, 3.2 ns per logit on a 152k
// vocabulary: a tenth to a fifth of a training step's output layer next to its GEMMs. Here the
// forward reads each row twice (its max; then exp, sum and first moment together) and the
// backward reads and writes it once. Sums run in fp32 within blocks of kBlock logits and in
// fp64 across blocks; the exponential is exp_nonpositive (within ~2 ulp of expf), and exactly 0
// below -87 (a masked or padding column has zero probability and gets zero gradient).
#include "cpu_common.h"

#include <ATen/Parallel.h>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

namespace {

using megarl_cpu::exp_nonpositive;

constexpr int64_t kBlock = 1024;
constexpr float kLogTiny = -1.0e4f;  // ops/logprobs.py's _LOG_TINY

inline float mass(float x) { return x < -87.0f ? 0.0f : exp_nonpositive(x); }

// One row's (max, sum exp(z - max), sum (z - max) exp(z - max)) of z = x * inv_temp.
template <bool Moment>
inline __attribute__((always_inline)) void stats_row(const float* x, int64_t n, float inv_temp, float* m_out,
                                                     float* s_out, float* w_out) {
  float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
  for (int64_t j = 0; j < n; ++j) mx = x[j] > mx ? x[j] : mx;
  const float m = mx * inv_temp;  // as the torch path: amax, then times 1/temperature
  double s = 0.0, w = 0.0;
  for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
    const int64_t j1 = j0 + kBlock < n ? j0 + kBlock : n;
    float sb = 0.0f, wb = 0.0f;
#pragma omp simd reduction(+ : sb, wb)
    for (int64_t j = j0; j < j1; ++j) {
      const float z = x[j] * inv_temp - m;
      const float e = mass(z);
      sb += e;
      if constexpr (Moment) wb += (z > kLogTiny ? z : kLogTiny) * e;
    }
    s += static_cast<double>(sb);
    w += static_cast<double>(wb);
  }
  *m_out = m;
  *s_out = static_cast<float>(s);
  *w_out = Moment ? static_cast<float>(w) : std::numeric_limits<float>::quiet_NaN();
}

MEGARL_CLONES void stats_row_moment(const float* x, int64_t n, float inv_temp, float* m, float* s, float* w) {
  stats_row<true>(x, n, inv_temp, m, s, w);
}

MEGARL_CLONES void stats_row_plain(const float* x, int64_t n, float inv_temp, float* m, float* s, float* w) {
  stats_row<false>(x, n, inv_temp, m, s, w);
}

// One row of d loss / d x (out may be x): p_j (a + b max(log p_j, kLogTiny)) with log p_j = x_j inv_temp
// - lse (Entropy), or p_j a; the target column's c is added by the caller's loop.
template <bool Entropy>
inline __attribute__((always_inline)) void grad_row(const float* x, float* out, int64_t n, float inv_temp,
                                                    float lse, float a, float b) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {  // element j is read before it is written: out may alias x
    const float logp = x[j] * inv_temp - lse;
    const float p = mass(logp);
    if constexpr (Entropy) {
      out[j] = ((logp > kLogTiny ? logp : kLogTiny) * b + a) * p;
    } else {
      out[j] = p * a;
    }
  }
}

MEGARL_CLONES void grad_row_entropy(const float* x, float* out, int64_t n, float inv_temp, float lse, float a,
                                    float b) {
  grad_row<true>(x, out, n, inv_temp, lse, a, b);
}

MEGARL_CLONES void grad_row_plain(const float* x, float* out, int64_t n, float inv_temp, float lse, float a,
                                  float b) {
  grad_row<false>(x, out, n, inv_temp, lse, a, b);
}

void check_rows(const at::Tensor& x, const char* op) {
  MEGARL_CHECK(x.device().is_cpu(), op, "CPU tensors only");
  MEGARL_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1, op,
               "logits must be float32 [N, n] with unit stride over n, got " + megarl_cpu::shape_of(x) + " " +
                   std::string(c10::toString(x.scalar_type())));
}

void check_vec(const at::Tensor& v, int64_t N, at::ScalarType dtype, const char* op, const char* name) {
  MEGARL_CHECK(v.device().is_cpu() && v.scalar_type() == dtype && v.dim() == 1 && v.size(0) == N &&
                   v.is_contiguous(),
               op, std::string(name) + " must be a contiguous " + std::string(c10::toString(dtype)) + " [" +
                       std::to_string(N) + "], got " + megarl_cpu::shape_of(v) + " " +
                       std::string(c10::toString(v.scalar_type())));
}

void check_cols(const at::Tensor& cols, int64_t n, const char* op) {
  const int64_t* cp = cols.data_ptr<int64_t>();
  for (int64_t r = 0; r < cols.size(0); ++r)
    MEGARL_CHECK(cp[r] >= 0 && cp[r] < n, op,
                 "cols[" + std::to_string(r) + "] = " + std::to_string(cp[r]) + " is outside [0, " +
                     std::to_string(n) + ")");
}

}  // namespace

namespace megarl_cpu {

// x [N, n] fp32 logits (this shard's columns), cols [N] int64 target columns local to the shard
// (clamped), owned [N] bool (the shard holds the target) -> [4, N] fp32: m = max z, s = sum
// exp(z - m), w = sum (z - m) exp(z - m) (NaN without with_moment), zt = z_target (0 where not
// owned), z = x * inv_temp. ops/logprobs.py's _local_stats, in two passes a row.
at::Tensor logprob_stats(const at::Tensor& x, const at::Tensor& cols, const at::Tensor& owned, double inv_temp,
                         bool with_moment) {
  const char* op = "logprob_stats";
  check_rows(x, op);
  const int64_t N = x.size(0), n = x.size(1), ld = x.stride(0);
  check_vec(cols, N, at::kLong, op, "cols");
  check_vec(owned, N, at::kBool, op, "owned");
  MEGARL_CHECK(inv_temp > 0, op, "inv_temp must be > 0, got " + std::to_string(inv_temp));
  MEGARL_CHECK(n > 0 || N == 0, op, "logits need at least one column");
  at::Tensor out = at::empty({4, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int64_t* cp = cols.data_ptr<int64_t>();
  const bool* op_ = owned.data_ptr<bool>();
  float* mp = out.data_ptr<float>();
  float *sp = mp + N, *wp = mp + 2 * N, *zp = mp + 3 * N;
  check_cols(cols, n, op);
  const float it = static_cast<float>(inv_temp);
  const auto row = with_moment ? stats_row_moment : stats_row_plain;
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * ld;
      row(xr, n, it, mp + r, sp + r, wp + r);
      zp[r] = op_[r] ? xr[cp[r]] * it : 0.0f;  // z_target + m: the target's scaled logit
    }
  });
  return out;
}

// x [N, n] fp32 logits -> out [N, n] = d loss / d x (out may be x itself). Row r: p_j (a_r + b_r max(log p_j, -1e4)) (b
// given) or p_j a_r, log p_j = x_j inv_temp - lse_r, plus c_r at column cols_r; rows with keep_r
// false are zero. The torch path's _grad_torch with its per-row coefficients a, b, c computed by
// the caller.
void logprob_grad(const at::Tensor& x, at::Tensor& out, const at::Tensor& lse, const at::Tensor& a,
                  const c10::optional<at::Tensor>& b, const at::Tensor& cols, const at::Tensor& c,
                  const at::Tensor& keep, double inv_temp) {
  const char* op = "logprob_grad";
  check_rows(x, op);
  check_rows(out, op);
  const int64_t N = x.size(0), n = x.size(1), ld = x.stride(0), ldo = out.stride(0);
  MEGARL_CHECK(out.size(0) == N && out.size(1) == n, op,
               "out " + megarl_cpu::shape_of(out) + " must match x " + megarl_cpu::shape_of(x));
  check_vec(lse, N, at::kFloat, op, "lse");
  check_vec(a, N, at::kFloat, op, "a");
  if (b.has_value()) check_vec(*b, N, at::kFloat, op, "b");
  check_vec(cols, N, at::kLong, op, "cols");
  check_vec(c, N, at::kFloat, op, "c");
  check_vec(keep, N, at::kBool, op, "keep");
  const float* xp = x.data_ptr<float>();
  float* outp = out.data_ptr<float>();
  const float *lp = lse.data_ptr<float>(), *ap = a.data_ptr<float>(), *cp = c.data_ptr<float>();
  const float* bp = b.has_value() ? b->data_ptr<float>() : nullptr;
  const int64_t* colp = cols.data_ptr<int64_t>();
  const bool* kp = keep.data_ptr<bool>();
  check_cols(cols, n, op);
  const float it = static_cast<float>(inv_temp);
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* outr = outp + r * ldo;
      if (!kp[r]) {
        std::memset(outr, 0, sizeof(float) * n);
        continue;
      }
      if (bp != nullptr) {
        grad_row_entropy(xp + r * ld, outr, n, it, lp[r], ap[r], bp[r]);
      } else {
        grad_row_plain(xp + r * ld, outr, n, it, lp[r], ap[r], 0.0f);
      }
      outr[colp[r]] += cp[r];
    }
  });
}

}  // namespace megarl_cpu
