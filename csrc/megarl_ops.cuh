// Per-row and per-chunk arithmetic of megarl's fused ops (issue 3).
//
// Everything here is __host__ __device__: nvcc compiles it into the CUDA kernels (logprobs.cu,
// gae.cu) and g++ compiles the very same functions into the CPU harness that
// tests/test_csrc.py drives through tests/host_check.cpp, so the maths the GPU runs is exercised on machines without a GPU.
// Only the block-level plumbing (shuffles, shared memory, __syncthreads) lives in the .cu files.
#pragma once

#include <math.h>
#include <stdint.h>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define MEGARL_HD __host__ __device__ __forceinline__
#define MEGARL_UNROLL _Pragma("unroll")
#else
#define MEGARL_HD inline
#define MEGARL_UNROLL
#endif

namespace megarl {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ---------------------------------------------------------------------------------------------
// Element conversion and vector loads. Device half types get explicit intrinsics; everything
// else (float, double) converts with a cast. The Pack load is one 16-byte transaction on the GPU
// when VEC * sizeof(T) == 16 and the pointer is 16-byte aligned (the launchers check this).
// ---------------------------------------------------------------------------------------------
template <typename T>
MEGARL_HD float to_float(T v) { return static_cast<float>(v); }
template <typename T>
MEGARL_HD T from_float(float v) { return static_cast<T>(v); }
#if defined(__CUDACC__)
MEGARL_HD float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
MEGARL_HD float to_float(__half v) { return __half2float(v); }
template <>
MEGARL_HD __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
MEGARL_HD __half from_float<__half>(float v) { return __float2half_rn(v); }
#endif

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

template <int VEC, typename T>
MEGARL_HD void load_vec(const T* p, float* out) {
  const Pack<T, VEC> pk = *reinterpret_cast<const Pack<T, VEC>*>(p);
  MEGARL_UNROLL
  for (int i = 0; i < VEC; ++i) out[i] = to_float(pk.v[i]);
}

template <int VEC, typename T>
MEGARL_HD void store_vec(T* p, const float* in) {
  Pack<T, VEC> pk;
  MEGARL_UNROLL
  for (int i = 0; i < VEC; ++i) pk.v[i] = from_float<T>(in[i]);
  *reinterpret_cast<Pack<T, VEC>*>(p) = pk;
}

// ---------------------------------------------------------------------------------------------
// Online log-sum-exp with the first moment, in base 2 (exp2 is one SFU instruction on the GPU).
// For one row with scaled logits y_j = x_j * log2(e) / temperature:
//   m = max_j y_j,   s = sum_j 2^(y_j - m),   w = sum_j 2^(y_j - m) (y_j - m)
// Then, in nats, lse = (m + log2 s) ln2 and entropy = (log2 s - w / s) ln2. Keeping w relative
// to the running max keeps the entropy free of the cancellation that sum p*x would suffer.
// The empty state is (-inf, 0, 0); -inf logits (masked vocabulary) contribute nothing.
// ---------------------------------------------------------------------------------------------
struct LseState {
  float m, s, w;
};

MEGARL_HD LseState lse_empty() { return LseState{-INFINITY, 0.f, 0.f}; }

// Fold n base-2 values into st with at most one rescale (max of the batch first).
MEGARL_HD void lse_push(LseState& st, const float* y, int n) {
  float mx = st.m;
  for (int i = 0; i < n; ++i) mx = fmaxf(mx, y[i]);
  if (mx == -INFINITY) return;  // everything so far is -inf
  if (mx > st.m) {
    const float d = st.m - mx;  // <= 0; -inf when st is empty
    const float r = exp2f(d);   // 0 when st is empty
    st.w = st.s > 0.f ? r * (st.w + d * st.s) : 0.f;
    st.s *= r;
    st.m = mx;
  }
  for (int i = 0; i < n; ++i) {
    const float d = y[i] - mx;
    const float e = exp2f(d);
    st.s += e;
    st.w += e > 0.f ? e * d : 0.f;  // e == 0 for -inf logits, whose d is -inf
  }
}

// Combine two partial states (associative and commutative up to rounding).
MEGARL_HD LseState lse_merge(const LseState& a, const LseState& b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return a;
  const float da = a.m - m, db = b.m - m;
  const float ra = exp2f(da), rb = exp2f(db);
  LseState o;
  o.m = m;
  o.s = ra * a.s + rb * b.s;
  o.w = (a.s > 0.f ? ra * (a.w + da * a.s) : 0.f) + (b.s > 0.f ? rb * (b.w + db * b.s) : 0.f);
  return o;
}

// The part of one row that lane `lane` of `nlanes` owns: VEC-wide groups strided by nlanes,
// two groups per iteration for memory-level parallelism, then the scalar tail (n % VEC).
// c2 = log2(e) / temperature.
template <int VEC, typename T>
MEGARL_HD LseState lse_lane_partial(const T* row, int64_t n, int lane, int nlanes, float c2) {
  LseState st = lse_empty();
  const int64_t nvec = n / VEC;
  int64_t v = lane;
  for (; v + nlanes < nvec; v += 2 * (int64_t)nlanes) {
    float y[2 * VEC];
    load_vec<VEC>(row + v * VEC, y);
    load_vec<VEC>(row + (v + nlanes) * VEC, y + VEC);
    MEGARL_UNROLL
    for (int i = 0; i < 2 * VEC; ++i) y[i] *= c2;
    lse_push(st, y, 2 * VEC);
  }
  if (v < nvec) {
    float y[VEC];
    load_vec<VEC>(row + v * VEC, y);
    MEGARL_UNROLL
    for (int i = 0; i < VEC; ++i) y[i] *= c2;
    lse_push(st, y, VEC);
  }
  for (int64_t j = nvec * VEC + lane; j < n; j += nlanes) {
    const float y = to_float(row[j]) * c2;
    lse_push(st, &y, 1);
  }
  return st;
}

struct RowOut {
  float logprob, entropy, lse;  // nats
};

// Final per-row values from the merged state; yt is the base-2 target logit, valid says the
// target lies in the (global) vocabulary. An out-of-range target gives a NaN log-prob.
MEGARL_HD RowOut lse_finalize(const LseState& st, float yt, bool valid) {
  const float l2s = log2f(st.s);
  RowOut o;
  o.lse = (st.m + l2s) * kLn2;
  o.entropy = (l2s - st.w / st.s) * kLn2;
  o.logprob = valid ? ((yt - st.m) - l2s) * kLn2 : NAN;
  return o;
}

// The forward's per-row outputs. finalize: (logprob, entropy, lse) in nats. Otherwise the raw
// base-2 statistics (m, s, w, y_t) that the tensor-parallel reduction combines first.
MEGARL_HD void store_row(bool finalize, const LseState& st, float yt, bool valid, int64_t row,
                         float* o0, float* o1, float* o2, float* o3) {
  if (finalize) {
    const RowOut o = lse_finalize(st, yt, valid);
    o0[row] = o.logprob;
    o1[row] = o.entropy;
    o2[row] = o.lse;
  } else {
    o0[row] = st.m * kLn2;
    o1[row] = st.s;
    o2[row] = st.w * kLn2;
    o3[row] = yt * kLn2;
  }
}

// An ignore_index row: zeros, or neutral statistics (s = 1) for the tensor-parallel reduction.
MEGARL_HD void store_ignored_row(bool finalize, int64_t row, float* o0, float* o1, float* o2, float* o3) {
  o0[row] = 0.f;
  o1[row] = finalize ? 0.f : 1.f;
  o2[row] = 0.f;
  if (!finalize) o3[row] = 0.f;
}

// ---------------------------------------------------------------------------------------------
// Backward. With z = x / T, p = softmax(z), lp = z_t - lse and H = -sum p log p:
//   dL/dz_j = g_lp (1[j=t] - p_j) + g_ent p_j (sum_k p_k z_k - z_j)
//           = p_j (-g_lp - g_ent H - g_ent ln2 d_j) + g_lp 1[j=t],   d_j = log2 p_j = y_j - lse2
// so dL/dx_j = 2^d_j (A + B d_j) [+ C at the target] with the per-row constants below.
// ---------------------------------------------------------------------------------------------
struct GradCoef {
  float lse2, A, B, C;
};

MEGARL_HD GradCoef grad_coef(float lse, float entropy, float g_lp, float g_ent, float inv_temp) {
  GradCoef c;
  c.lse2 = (float)((double)lse * 1.4426950408889634);
  c.A = -(g_lp + g_ent * entropy) * inv_temp;
  c.B = -g_ent * kLn2 * inv_temp;
  c.C = g_lp * inv_temp;
  return c;
}

MEGARL_HD float grad_elem(float y, const GradCoef& c) {
  const float d = y - c.lse2;
  const float p = exp2f(d);
  return p == 0.f ? 0.f : p * fmaf(c.B, d, c.A);  // -inf logits: 0, not 0 * inf
}

// Writes dL/dx for the columns lane `lane` of `nlanes` owns (same layout as lse_lane_partial).
// t_local is the target's column in this shard, or -1 when another rank owns it.
template <int VEC, typename T>
MEGARL_HD void grad_lane(const T* x, T* g, int64_t n, int lane, int nlanes, float c2,
                         const GradCoef& c, int64_t t_local) {
  const int64_t nvec = n / VEC;
  for (int64_t v = lane; v < nvec; v += nlanes) {
    float y[VEC];
    load_vec<VEC>(x + v * VEC, y);
    MEGARL_UNROLL
    for (int i = 0; i < VEC; ++i) {
      y[i] = grad_elem(y[i] * c2, c) + (v * VEC + i == t_local ? c.C : 0.f);
    }
    store_vec<VEC>(g + v * VEC, y);
  }
  for (int64_t j = nvec * VEC + lane; j < n; j += nlanes) {
    g[j] = from_float<T>(grad_elem(to_float(x[j]) * c2, c) + (j == t_local ? c.C : 0.f));
  }
}

template <typename T>
MEGARL_HD void zero_lane(T* g, int64_t n, int lane, int nlanes) {
  for (int64_t j = lane; j < n; j += nlanes) g[j] = from_float<T>(0.f);
}

// ---------------------------------------------------------------------------------------------
// GAE as a scan of affine maps. Walking a sequence backwards, the state is
//   (A, Vn) = (advantage of the next valid token, value of the next valid token), (0, 0) past
// the last valid token. A valid token t maps it to
//   A' = r_t + gamma Vn - v_t + gamma lam A,   Vn' = v_t
// and a masked token leaves it unchanged (masked tokens are invisible, so nothing leaks across
// the end of a response and holes in the mask are skipped). Each token is the affine map
//   [A'; Vn'] = [[a, b], [0, d]] [A; Vn] + [e; f]
// and maps compose associatively, so a chunk is summarised by one map and chunks are combined
// by a parallel scan; then each chunk replays its tokens from the carried-in state.
// ---------------------------------------------------------------------------------------------
template <typename S>
struct GaeMap {
  S a, b, d, e, f;
};
template <typename S>
struct GaeState {
  S adv, vnext;
};

template <typename S>
MEGARL_HD GaeMap<S> gae_identity() {
  return GaeMap<S>{S(1), S(0), S(1), S(0), S(0)};
}

// (P o Q)(s) = P(Q(s)): Q covers the later tokens, P the earlier ones.
template <typename S>
MEGARL_HD GaeMap<S> gae_compose(const GaeMap<S>& P, const GaeMap<S>& Q) {
  GaeMap<S> o;
  o.a = P.a * Q.a;
  o.b = P.a * Q.b + P.b * Q.d;
  o.d = P.d * Q.d;
  o.e = P.a * Q.e + P.b * Q.f + P.e;
  o.f = P.d * Q.f + P.f;
  return o;
}

template <typename S>
MEGARL_HD GaeState<S> gae_apply(const GaeMap<S>& P, const GaeState<S>& s) {
  return GaeState<S>{P.a * s.adv + P.b * s.vnext + P.e, P.d * s.vnext + P.f};
}

// Map of tokens [0, n) of a chunk (r, v, m point at its first token; m may be null: all valid).
template <typename S>
MEGARL_HD GaeMap<S> gae_chunk_summary(const S* r, const S* v, const uint8_t* m, int n, S gamma,
                                      S gl) {
  GaeMap<S> M = gae_identity<S>();
  MEGARL_UNROLL
  for (int i = n - 1; i >= 0; --i) {
    if (m != nullptr && !m[i]) continue;
    // M_i o M with M_i = {gl, gamma, 0, r - v, v}
    M.e = gl * M.e + gamma * M.f + (r[i] - v[i]);
    M.b = gl * M.b + gamma * M.d;
    M.a = gl * M.a;
    M.d = S(0);
    M.f = v[i];
  }
  return M;
}

// Replays tokens [0, n) backwards from `carry` (the state just after the chunk), writing the
// advantage and the return (advantage + value) of valid tokens and zeros elsewhere. Returns
// the state at the chunk start. adv/ret may alias r/v: each token is read before it is written.
template <typename S>
MEGARL_HD GaeState<S> gae_chunk_scan(const S* r, const S* v, const uint8_t* m, int n, S gamma,
                                     S gl, GaeState<S> carry, S* adv, S* ret) {
  MEGARL_UNROLL
  for (int i = n - 1; i >= 0; --i) {
    const S ri = r[i], vi = v[i];
    if (m != nullptr && !m[i]) {
      adv[i] = S(0);
      ret[i] = S(0);
      continue;
    }
    carry.adv = (ri + gamma * carry.vnext - vi) + gl * carry.adv;
    carry.vnext = vi;
    adv[i] = carry.adv;
    ret[i] = carry.adv + vi;
  }
  return carry;
}

}  // namespace megarl
