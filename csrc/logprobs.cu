// Fused log-prob / entropy kernels over a vocabulary shard: one block per row.
// Forward: one pass over the logits (online max, sum of exp, first moment, target logit).
// Backward: one read of the logits and one write of the gradient. The arithmetic is in
// megarl_ops.cuh (shared with the CPU harness); this file only distributes it over threads.
#include <cuda_runtime.h>

#include "megarl_ops.cuh"
#include "megarl_ops.h"

namespace megarl {
namespace {

constexpr int kThreads = 256;
constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ LseState warp_merge(LseState st) {
  MEGARL_UNROLL
  for (int off = 16; off > 0; off >>= 1) {
    LseState o;
    o.m = __shfl_xor_sync(kFull, st.m, off);
    o.s = __shfl_xor_sync(kFull, st.s, off);
    o.w = __shfl_xor_sync(kFull, st.w, off);
    st = lse_merge(st, o);
  }
  return st;
}

// Butterfly within each warp, then across warp leaders in warp 0. Result valid in thread 0.
__device__ __forceinline__ LseState block_merge(LseState st) {
  __shared__ LseState partial[kThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  st = warp_merge(st);
  if (lane == 0) partial[warp] = st;
  __syncthreads();
  if (warp == 0) {
    st = lane < kThreads / 32 ? partial[lane] : lse_empty();
    st = warp_merge(st);
  }
  __syncthreads();  // `partial` is reused by the next row
  return st;
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads)
    logprobs_fwd_kernel(const T* __restrict__ x, int64_t rows, int64_t n, int64_t ld,
                        const int64_t* __restrict__ targets, int64_t vocab_start,
                        int64_t global_vocab, int64_t ignore_index, float c2, bool finalize,
                        float* __restrict__ o0, float* __restrict__ o1, float* __restrict__ o2,
                        float* __restrict__ o3) {
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t t = targets[row];
    if (t == ignore_index) {  // padding costs no bandwidth; neutral stats for the TP reduction
      if (threadIdx.x == 0) store_ignored_row(finalize, row, o0, o1, o2, o3);
      continue;
    }
    const T* xr = x + row * ld;
    LseState st = lse_lane_partial<VEC>(xr, n, threadIdx.x, kThreads, c2);
    st = block_merge(st);
    if (threadIdx.x == 0) {
      const int64_t tl = t - vocab_start;
      const bool owned = tl >= 0 && tl < n;
      const float yt = owned ? to_float(xr[tl]) * c2 : 0.f;
      store_row(finalize, st, yt, t >= 0 && t < global_vocab, row, o0, o1, o2, o3);
    }
  }
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads)
    logprobs_bwd_kernel(const T* __restrict__ x, int64_t ldx, T* __restrict__ g, int64_t ldg,
                        int64_t rows, int64_t n, const int64_t* __restrict__ targets,
                        int64_t vocab_start, int64_t ignore_index, float c2, float inv_temp,
                        const float* __restrict__ lse, const float* __restrict__ ent,
                        const float* __restrict__ g_lp, const float* __restrict__ g_ent) {
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    T* gr = g + row * ldg;
    const int64_t t = targets[row];
    if (t == ignore_index) {
      zero_lane(gr, n, threadIdx.x, kThreads);
      continue;
    }
    const GradCoef c = grad_coef(lse[row], ent[row], g_lp ? g_lp[row] : 0.f,
                                 g_ent ? g_ent[row] : 0.f, inv_temp);
    int64_t tl = t - vocab_start;
    if (tl < 0 || tl >= n) tl = -1;
    grad_lane<VEC>(x + row * ldx, gr, n, threadIdx.x, kThreads, c2, c, tl);
  }
}

inline bool aligned16(const void* p, int64_t ld, int64_t elem) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0 && (ld * elem) % 16 == 0;
}

inline unsigned grid_for(int64_t rows) {
  return static_cast<unsigned>(rows < (1 << 30) ? rows : (1 << 30));
}

template <typename T>
int launch_forward(const void* logits, int64_t rows, int64_t n, int64_t ld,
                   const int64_t* targets, int64_t vocab_start, int64_t global_vocab,
                   int64_t ignore_index, float inv_temp, bool finalize, float* o0, float* o1,
                   float* o2, float* o3, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const T* x = static_cast<const T*>(logits);
  const float c2 = inv_temp * kLog2e;
  if (rows == 0) return 0;
  if (aligned16(x, ld, sizeof(T))) {
    logprobs_fwd_kernel<T, kVec><<<grid_for(rows), kThreads, 0, stream>>>(
        x, rows, n, ld, targets, vocab_start, global_vocab, ignore_index, c2, finalize, o0, o1,
        o2, o3);
  } else {
    logprobs_fwd_kernel<T, 1><<<grid_for(rows), kThreads, 0, stream>>>(
        x, rows, n, ld, targets, vocab_start, global_vocab, ignore_index, c2, finalize, o0, o1,
        o2, o3);
  }
  return static_cast<int>(cudaGetLastError());
}

template <typename T>
int launch_backward(const void* logits, int64_t ldx, void* grad, int64_t ldg, int64_t rows,
                    int64_t n, const int64_t* targets, int64_t vocab_start, int64_t ignore_index,
                    float inv_temp, const float* lse, const float* ent, const float* g_lp,
                    const float* g_ent, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const T* x = static_cast<const T*>(logits);
  T* g = static_cast<T*>(grad);
  const float c2 = inv_temp * kLog2e;
  if (rows == 0) return 0;
  if (aligned16(x, ldx, sizeof(T)) && aligned16(g, ldg, sizeof(T))) {
    logprobs_bwd_kernel<T, kVec><<<grid_for(rows), kThreads, 0, stream>>>(
        x, ldx, g, ldg, rows, n, targets, vocab_start, ignore_index, c2, inv_temp, lse, ent, g_lp,
        g_ent);
  } else {
    logprobs_bwd_kernel<T, 1><<<grid_for(rows), kThreads, 0, stream>>>(
        x, ldx, g, ldg, rows, n, targets, vocab_start, ignore_index, c2, inv_temp, lse, ent, g_lp,
        g_ent);
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int logprobs_forward(int dtype, const void* logits, int64_t rows, int64_t n, int64_t ld,
                     const int64_t* targets, int64_t vocab_start, int64_t global_vocab,
                     int64_t ignore_index, float inv_temp, bool finalize, float* o0, float* o1,
                     float* o2, float* o3, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case kFloat32:
      return launch_forward<float>(logits, rows, n, ld, targets, vocab_start, global_vocab,
                                   ignore_index, inv_temp, finalize, o0, o1, o2, o3, s);
    case kFloat16:
      return launch_forward<__half>(logits, rows, n, ld, targets, vocab_start, global_vocab,
                                    ignore_index, inv_temp, finalize, o0, o1, o2, o3, s);
    case kBFloat16:
      return launch_forward<__nv_bfloat16>(logits, rows, n, ld, targets, vocab_start,
                                           global_vocab, ignore_index, inv_temp, finalize, o0,
                                           o1, o2, o3, s);
    default:
      return static_cast<int>(cudaErrorInvalidValue);
  }
}

int logprobs_backward(int dtype, const void* logits, int64_t ldx, void* grad, int64_t ldg,
                      int64_t rows, int64_t n, const int64_t* targets, int64_t vocab_start,
                      int64_t ignore_index, float inv_temp, const float* lse, const float* entropy,
                      const float* g_lp, const float* g_ent, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case kFloat32:
      return launch_backward<float>(logits, ldx, grad, ldg, rows, n, targets, vocab_start,
                                    ignore_index, inv_temp, lse, entropy, g_lp, g_ent, s);
    case kFloat16:
      return launch_backward<__half>(logits, ldx, grad, ldg, rows, n, targets, vocab_start,
                                     ignore_index, inv_temp, lse, entropy, g_lp, g_ent, s);
    case kBFloat16:
      return launch_backward<__nv_bfloat16>(logits, ldx, grad, ldg, rows, n, targets,
                                            vocab_start, ignore_index, inv_temp, lse, entropy,
                                            g_lp, g_ent, s);
    default:
      return static_cast<int>(cudaErrorInvalidValue);
  }
}

const char* error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // namespace megarl
