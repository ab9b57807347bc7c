// GAE as a chunked scan: one block per sequence, kThreads threads each owning a contiguous
// chunk of kPer tokens of a tile of kThreads * kPer tokens (4096 fp32 / 2048 fp64). Per tile:
// coalesced load into shared memory, per-thread chunk maps, a Hillis-Steele suffix scan of the
// maps across threads, per-thread replay from the carried-in state, coalesced store. Tiles are
// walked from the end of the sequence with the state carried between them, so any length works.
// [512, 4096] fp32 launches 512 blocks x 256 threads: every thread of an H100 busy, not one
// thread per row. The arithmetic is in megarl_ops.cuh (shared with the CPU harness).
#include <cuda_runtime.h>

#include "megarl_ops.cuh"
#include "megarl_ops.h"

namespace megarl {
namespace {

constexpr int kThreads = 256;

// Skewed shared-memory index: a thread reads kPer consecutive tokens, so without the skew the
// threads of a warp would hit the same banks.
__device__ __forceinline__ int skew(int i) { return i + (i >> 5); }

template <typename S>
__global__ void __launch_bounds__(kThreads)
    gae_kernel(const S* __restrict__ r, const S* __restrict__ v, const uint8_t* __restrict__ m,
               int64_t rows, int64_t T, const int64_t* __restrict__ offsets, S gamma, S gl,
               S* __restrict__ adv, S* __restrict__ ret) {
  constexpr int kPer = 64 / sizeof(S);  // 16 fp32 / 8 fp64 tokens per thread
  constexpr int kTile = kThreads * kPer;
  constexpr int kSmem = kTile + kTile / 32;
  __shared__ S sr[kSmem];
  __shared__ S sv[kSmem];
  __shared__ uint8_t sm[kSmem];
  __shared__ GaeMap<S> smap[kThreads];
  const int tid = threadIdx.x;

  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t start = offsets ? offsets[row] : row * T;
    const int64_t len = offsets ? offsets[row + 1] - start : T;
    GaeState<S> carry{S(0), S(0)};  // past the last valid token: no value, no advantage
    for (int64_t tile_end = len; tile_end > 0; tile_end -= kTile) {
      const int64_t tile_start = tile_end > kTile ? tile_end - kTile : 0;
      const int nt = static_cast<int>(tile_end - tile_start);
      const int64_t base = start + tile_start;
      for (int i = tid; i < nt; i += kThreads) {
        sr[skew(i)] = r[base + i];
        sv[skew(i)] = v[base + i];
        sm[skew(i)] = m ? m[base + i] : uint8_t(1);
      }
      __syncthreads();

      // This thread's chunk in registers; slots past the tile end are masked (identity).
      S lr[kPer], lv[kPer];
      uint8_t lm[kPer];
      const int c0 = tid * kPer;
      MEGARL_UNROLL
      for (int k = 0; k < kPer; ++k) {
        const bool in = c0 + k < nt;
        lr[k] = in ? sr[skew(c0 + k)] : S(0);
        lv[k] = in ? sv[skew(c0 + k)] : S(0);
        lm[k] = in ? sm[skew(c0 + k)] : uint8_t(0);
      }
      GaeMap<S> M = gae_chunk_summary<S>(lr, lv, lm, kPer, gamma, gl);

      // Inclusive suffix scan: smap[i] = map_i o map_{i+1} o ... o map_{last}.
      smap[tid] = M;
      __syncthreads();
      for (int off = 1; off < kThreads; off <<= 1) {
        const GaeMap<S> later = tid + off < kThreads ? smap[tid + off] : gae_identity<S>();
        __syncthreads();
        M = gae_compose(M, later);
        smap[tid] = M;
        __syncthreads();
      }
      const GaeState<S> mine = tid + 1 < kThreads ? gae_apply(smap[tid + 1], carry) : carry;
      const GaeState<S> next = gae_apply(smap[0], carry);
      gae_chunk_scan<S>(lr, lv, lm, kPer, gamma, gl, mine, lr, lv);
      MEGARL_UNROLL
      for (int k = 0; k < kPer; ++k) {
        if (c0 + k < nt) {
          sr[skew(c0 + k)] = lr[k];
          sv[skew(c0 + k)] = lv[k];
        }
      }
      __syncthreads();
      for (int i = tid; i < nt; i += kThreads) {
        adv[base + i] = sr[skew(i)];
        ret[base + i] = sv[skew(i)];
      }
      carry = next;
      __syncthreads();  // shared buffers are refilled by the next tile
    }
  }
}

template <typename S>
int launch_gae(const void* rewards, const void* values, const uint8_t* mask, int64_t rows,
               int64_t T, const int64_t* offsets, double gamma, double lam, void* adv, void* ret,
               cudaStream_t stream) {
  if (rows == 0) return 0;
  const unsigned grid = static_cast<unsigned>(rows < (1 << 30) ? rows : (1 << 30));
  gae_kernel<S><<<grid, kThreads, 0, stream>>>(
      static_cast<const S*>(rewards), static_cast<const S*>(values), mask, rows, T, offsets,
      static_cast<S>(gamma), static_cast<S>(gamma * lam), static_cast<S*>(adv),
      static_cast<S*>(ret));
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int gae_forward(int dtype, const void* rewards, const void* values, const uint8_t* mask,
                int64_t rows, int64_t T, const int64_t* offsets, double gamma, double lam,
                void* adv, void* ret, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case kFloat32:
      return launch_gae<float>(rewards, values, mask, rows, T, offsets, gamma, lam, adv, ret, s);
    case kFloat64:
      return launch_gae<double>(rewards, values, mask, rows, T, offsets, gamma, lam, adv, ret, s);
    default:
      return static_cast<int>(cudaErrorInvalidValue);
  }
}

}  // namespace megarl
