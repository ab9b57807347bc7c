// megarl._cpu.wide_linear: x W^T for a few rows x [R, h] and a wide weight W [V, h] (an LM head
// at V = 32k-152k) stored [out, in], on a CPU with AVX-512 or with AVX2 + FMA. models/cpu_gemm.py also runs it on the
// layers' weights at decode rows on an AMD CPU, where a decode step's head read has evicted them.
//
// A decode step multiplies 1-24 rows by the whole head: 155 MB at 152k x 256 in fp32, read from
// memory every step. MKL's and oneDNN's GEMMs at these shapes read it at 8-16 GB/s (3-24 rows:
// 10-23 ms a step, docs/benchmarks.md). Here W is streamed once, 4 of its rows at a time, with
// a software prefetch into L2 64 rows ahead, spread over the FMAs; each block of 4 weight rows is
// multiplied by the rows of x 4 at a time, 16 accumulators of 16 lanes (independent FMA chains)
// summed across lanes once per block (at 1-4 rows of x the 4 weight rows are read in turn:
// block_rows_in_turn). Every row of x gets its sums in the same order whatever R is, so the same
// bits. fp32 throughout; the sums differ from MKL's only in their order. megarl moves W to huge
// pages before generation reads it (runtime/huge_pages.py).
#include "cpu_common.h"

#include <ATen/Parallel.h>

#include <cstdint>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)  // GCC's target pragmas below
#include <immintrin.h>
#define MEGARL_WIDE_LINEAR_AVX512 1
#endif

namespace {

#ifdef MEGARL_WIDE_LINEAR_AVX512
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,fma")

// The 4 sums of 4 accumulators, in order.
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // per 128 bits: a b a b
  __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
                              _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
  __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

// out[j, i] (row stride ldo) = x[j] . w[i] for RB rows of x and the 4 weight rows at w (each h
// long, contiguous). The last h % 16 columns go through masked loads (zeros beyond h).
template <int RB>
inline __attribute__((always_inline)) void block(const float* x, int64_t h, const float* w, float* out, int64_t ldo,
                                                 const char* pf, int64_t pf_lines) {
  __m512 acc[RB][4];
  for (int j = 0; j < RB; ++j)
    for (int i = 0; i < 4; ++i) acc[j][i] = _mm512_setzero_ps();
  const int64_t h16 = h & ~int64_t(15);
  auto step = [&](int64_t k, __mmask16 m) {
    const __m512 w0 = _mm512_maskz_loadu_ps(m, w + k), w1 = _mm512_maskz_loadu_ps(m, w + h + k),
                 w2 = _mm512_maskz_loadu_ps(m, w + 2 * h + k), w3 = _mm512_maskz_loadu_ps(m, w + 3 * h + k);
    for (int j = 0; j < RB; ++j) {
      const __m512 xj = _mm512_maskz_loadu_ps(m, x + j * h + k);
      acc[j][0] = _mm512_fmadd_ps(xj, w0, acc[j][0]);
      acc[j][1] = _mm512_fmadd_ps(xj, w1, acc[j][1]);
      acc[j][2] = _mm512_fmadd_ps(xj, w2, acc[j][2]);
      acc[j][3] = _mm512_fmadd_ps(xj, w3, acc[j][3]);
    }
  };
  // pf_lines cache lines at pf (this block's share of the prefetches, see rows_avx512), a few per
  // k step: ceil(pf_lines / (k steps + 1)) >= 1 each, the rest after the loop.
  const int64_t k_steps = h16 / 16;
  const int64_t per_step = (pf_lines + k_steps) / (k_steps + 1);
  int64_t issued = 0;
  auto prefetch = [&]() {
    for (int64_t q = 0; q < per_step && issued < pf_lines; ++q, ++issued) _mm_prefetch(pf + issued * 64, _MM_HINT_T1);
  };
#pragma GCC unroll 4
  for (int64_t k = 0; k < h16; k += 16) {
    step(k, __mmask16(0xFFFF));
    prefetch();
  }
  if (h16 < h) step(h16, __mmask16((1u << (h - h16)) - 1));
  while (issued < pf_lines) prefetch();
  for (int j = 0; j < RB; ++j) _mm_storeu_ps(out + j * ldo, sum4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]));
}

// block<RB> for RB <= 4 rows of x (one row block), with the same sums in the same order (every
// accumulator adds its products over k in turn, then sum4), but the 4 weight rows read one after
// the other instead of side by side: at 1-4 rows a decode step is bound by reading W, and one
// sequential stream is what the hardware prefetchers follow best. On an AMD EPYC (Zen 4) at
// 152k x 256: 4.6-5.5 ms against block<RB>'s 6.3-8.2 ms at 1-4 rows, a plain read of W taking
// 4.8 ms (bench/bench_gemm_floor.py --read-bound). From 5 rows on block<RB> runs: there the FMAs'
// latency chains bind (4 accumulators in flight here, 16 there; at 6 rows 7.9 ms here, 5.1 there).
template <int RB>
inline __attribute__((always_inline)) void block_rows_in_turn(const float* x, int64_t h, const float* w, float* out,
                                                              int64_t ldo, const char* pf, int64_t pf_lines) {
  __m512 acc[RB][4];
  for (int j = 0; j < RB; ++j)
    for (int i = 0; i < 4; ++i) acc[j][i] = _mm512_setzero_ps();
  const int64_t h16 = h & ~int64_t(15);
  // pf_lines cache lines at pf: a quarter while each weight row is read, a few per k step
  const int64_t per_row = (pf_lines + 3) / 4, k_steps = h16 / 16;
  const int64_t per_step = k_steps ? (per_row + k_steps - 1) / k_steps : 0;
  int64_t issued = 0;
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    const float* wi = w + i * h;
    int64_t mine = 0;
#pragma GCC unroll 4
    for (int64_t k = 0; k < h16; k += 16) {
      const __m512 wk = _mm512_loadu_ps(wi + k);
      for (int j = 0; j < RB; ++j) acc[j][i] = _mm512_fmadd_ps(_mm512_loadu_ps(x + j * h + k), wk, acc[j][i]);
      for (int64_t q = 0; q < per_step && mine < per_row && issued < pf_lines; ++q, ++mine, ++issued)
        _mm_prefetch(pf + issued * 64, _MM_HINT_T1);
    }
    if (h16 < h) {
      const __mmask16 m = __mmask16((1u << (h - h16)) - 1);
      const __m512 wk = _mm512_maskz_loadu_ps(m, wi + h16);
      for (int j = 0; j < RB; ++j)
        acc[j][i] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + j * h + h16), wk, acc[j][i]);
    }
  }
  for (; issued < pf_lines; ++issued) _mm_prefetch(pf + issued * 64, _MM_HINT_T1);
  for (int j = 0; j < RB; ++j) _mm_storeu_ps(out + j * ldo, sum4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]));
}

constexpr int64_t kPrefetchRows = 64;  // 64 weight rows ahead (64 KB at h = 256), into L2

// Weight rows [v0, v1) (v1 - v0 a multiple of 4) against all R rows of x.
void rows_avx512(const float* x, int64_t R, const float* w, int64_t V, int64_t h, float* out, int64_t v0,
                 int64_t v1) {
  const int64_t lines = (4 * h * static_cast<int64_t>(sizeof(float)) + 63) / 64;  // cache lines of 4 weight rows
  const int64_t row_blocks = (R + 3) / 4;
  std::vector<int64_t> first_line(row_blocks + 1);  // row block rb of x prefetches [first_line[rb], first_line[rb + 1])
  for (int64_t rb = 0; rb <= row_blocks; ++rb) first_line[rb] = lines * rb / row_blocks;
  for (int64_t v = v0; v < v1; v += 4) {
    const float* wv = w + v * h;
    // The lines of the 4 weight rows kPrefetchRows ahead, spread over this block's FMAs: each row
    // block of x takes its share, a few per k step. Issued all at once before the FMAs, at 8-32
    // rows of x the kernel took about the sum of its memory and compute times (docs/benchmarks.md,
    // 2026-11-29).
    const char* pf = v + kPrefetchRows + 4 <= V ? reinterpret_cast<const char*>(wv + kPrefetchRows * h) : nullptr;
    auto share = [&](int64_t rb) { return pf ? first_line[rb + 1] - first_line[rb] : 0; };
    auto from = [&](int64_t rb) { return pf ? pf + first_line[rb] * 64 : pf; };
    if (R <= 4) {  // bound by reading W: its rows in turn (block_rows_in_turn)
      switch (R) {
        case 4: block_rows_in_turn<4>(x, h, wv, out + v, V, from(0), share(0)); break;
        case 3: block_rows_in_turn<3>(x, h, wv, out + v, V, from(0), share(0)); break;
        case 2: block_rows_in_turn<2>(x, h, wv, out + v, V, from(0), share(0)); break;
        default: block_rows_in_turn<1>(x, h, wv, out + v, V, from(0), share(0)); break;
      }
      continue;
    }
    int64_t r = 0;
    for (; r + 4 <= R; r += 4) block<4>(x + r * h, h, wv, out + r * V + v, V, from(r / 4), share(r / 4));
    switch (R - r) {
      case 3: block<3>(x + r * h, h, wv, out + r * V + v, V, from(r / 4), share(r / 4)); break;
      case 2: block<2>(x + r * h, h, wv, out + r * V + v, V, from(r / 4), share(r / 4)); break;
      case 1: block<1>(x + r * h, h, wv, out + r * V + v, V, from(r / 4), share(r / 4)); break;
      default: break;
    }
  }
}

// The last V % 4 weight rows, one at a time.
void tail_avx512(const float* x, int64_t R, const float* w, int64_t V, int64_t h, float* out, int64_t v0) {
  const int64_t h16 = h & ~int64_t(15);
  for (int64_t v = v0; v < V; ++v)
    for (int64_t r = 0; r < R; ++r) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t k = 0; k < h16; k += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * h + k), _mm512_loadu_ps(w + v * h + k), acc);
      if (h16 < h) {
        const __mmask16 m = __mmask16((1u << (h - h16)) - 1);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + r * h + h16), _mm512_maskz_loadu_ps(m, w + v * h + h16), acc);
      }
      out[r * V + v] = _mm512_reduce_add_ps(acc);
    }
}
#pragma GCC pop_options

// The same kernel for a CPU with AVX2 + FMA but no AVX-512 (an AMD Zen 3): 8 lanes, 16 registers.
// Rows of x go 2 at a time beside the 4 weight rows (8 accumulators, 4 weight vectors, one x
// vector: 13 of the 16 registers; block<4>'s 16 accumulators would spill here), at every R: with
// 8 lanes the weight rows read in turn (block_rows_in_turn) leave one FMA chain per row in flight,
// and at 1 row on an AMD Zen 3 that took 9.6 ms at 152k x 256 against MKL's 6.4. Each (row, weight
// row) pair adds its products over k in order and sums its lanes with sum4_avx2, so every row of
// x gets the same bits at any R.
#pragma GCC push_options
#pragma GCC target("avx2,fma")

inline __m128 sum4_avx2(__m256 a, __m256 b, __m256 c, __m256 d) {
  __m256 ab = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));  // per 128 bits: a b a b
  __m256 cd = _mm256_add_ps(_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
  __m256 abcd = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(ab), _mm256_castps_pd(cd))),
                              _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(ab), _mm256_castps_pd(cd))));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// Lanes [0, n) set, n in [0, 8]: the mask of the last h % 8 columns' loads (zeros beyond h).
inline __m256i tail_mask_avx2(int64_t n) {
  alignas(32) static const int32_t ones_then_zeros[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ones_then_zeros + 8 - n));
}

template <int RB>
inline __attribute__((always_inline)) void block_avx2(const float* x, int64_t h, const float* w, float* out,
                                                      int64_t ldo, const char* pf, int64_t pf_lines) {
  __m256 acc[RB][4];
  for (int j = 0; j < RB; ++j)
    for (int i = 0; i < 4; ++i) acc[j][i] = _mm256_setzero_ps();
  const int64_t h8 = h & ~int64_t(7);
  const int64_t k_steps = h8 / 8;
  const int64_t per_step = (pf_lines + k_steps) / (k_steps + 1);
  int64_t issued = 0;
#pragma GCC unroll 2
  for (int64_t k = 0; k < h8; k += 8) {
    const __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + h + k), w2 = _mm256_loadu_ps(w + 2 * h + k),
                 w3 = _mm256_loadu_ps(w + 3 * h + k);
    for (int j = 0; j < RB; ++j) {
      const __m256 xj = _mm256_loadu_ps(x + j * h + k);
      acc[j][0] = _mm256_fmadd_ps(xj, w0, acc[j][0]);
      acc[j][1] = _mm256_fmadd_ps(xj, w1, acc[j][1]);
      acc[j][2] = _mm256_fmadd_ps(xj, w2, acc[j][2]);
      acc[j][3] = _mm256_fmadd_ps(xj, w3, acc[j][3]);
    }
    for (int64_t q = 0; q < per_step && issued < pf_lines; ++q, ++issued) _mm_prefetch(pf + issued * 64, _MM_HINT_T1);
  }
  if (h8 < h) {
    const __m256i m = tail_mask_avx2(h - h8);
    const __m256 w0 = _mm256_maskload_ps(w + h8, m), w1 = _mm256_maskload_ps(w + h + h8, m),
                 w2 = _mm256_maskload_ps(w + 2 * h + h8, m), w3 = _mm256_maskload_ps(w + 3 * h + h8, m);
    for (int j = 0; j < RB; ++j) {
      const __m256 xj = _mm256_maskload_ps(x + j * h + h8, m);
      acc[j][0] = _mm256_fmadd_ps(xj, w0, acc[j][0]);
      acc[j][1] = _mm256_fmadd_ps(xj, w1, acc[j][1]);
      acc[j][2] = _mm256_fmadd_ps(xj, w2, acc[j][2]);
      acc[j][3] = _mm256_fmadd_ps(xj, w3, acc[j][3]);
    }
  }
  for (; issued < pf_lines; ++issued) _mm_prefetch(pf + issued * 64, _MM_HINT_T1);
  for (int j = 0; j < RB; ++j) _mm_storeu_ps(out + j * ldo, sum4_avx2(acc[j][0], acc[j][1], acc[j][2], acc[j][3]));
}

// Weight rows [v0, v1) against all R rows of x. At 1-4 rows, bound by reading W, the blocks go
// in kStreamsAvx2 interleaved streams (block i of each quarter of the range in turn, prefetching
// kPrefetchRowsStreams rows ahead): in a standalone copy on an AMD Zen 3, one sequential read of W
// took 9.5-10 ms at 152k x 256 (~16 GB/s; a plain AVX2 read 17 GB/s), four reads at once 6.7-8.2
// ms (plain: 29 GB/s); inside megarl._cpu the gain was within that machine's noise
// (docs/benchmarks.md, 2026-12-03). The order of the blocks changes no sum. Above 4 rows, where the FMAs take as long as the
// read, one stream (four were ~8% slower at 8 rows).
constexpr int64_t kStreamsAvx2 = 4;
constexpr int64_t kPrefetchRowsStreams = 16;

void rows_avx2(const float* x, int64_t R, const float* w, int64_t V, int64_t h, float* out, int64_t v0, int64_t v1) {
  const int64_t lines = (4 * h * static_cast<int64_t>(sizeof(float)) + 63) / 64;
  const int64_t row_blocks = (R + 1) / 2;
  std::vector<int64_t> first_line(row_blocks + 1);
  for (int64_t rb = 0; rb <= row_blocks; ++rb) first_line[rb] = lines * rb / row_blocks;
  const int64_t streams = R <= 4 ? kStreamsAvx2 : 1, ahead = R <= 4 ? kPrefetchRowsStreams : kPrefetchRows;
  const int64_t blocks = (v1 - v0) / 4, per_stream = (blocks + streams - 1) / streams;
  for (int64_t i = 0; i < per_stream; ++i)
    for (int64_t s = 0; s < streams; ++s) {
      const int64_t b = s * per_stream + i;
      if (b >= blocks) break;  // only the last stream runs short
      const int64_t v = v0 + 4 * b;
      const float* wv = w + v * h;
      const char* pf = v + ahead + 4 <= V ? reinterpret_cast<const char*>(wv + ahead * h) : nullptr;
      int64_t r = 0;
      for (; r + 2 <= R; r += 2) {
        const int64_t rb = r / 2;
        block_avx2<2>(x + r * h, h, wv, out + r * V + v, V, pf ? pf + first_line[rb] * 64 : pf,
                      pf ? first_line[rb + 1] - first_line[rb] : 0);
      }
      if (r < R) {
        const int64_t rb = r / 2;
        block_avx2<1>(x + r * h, h, wv, out + r * V + v, V, pf ? pf + first_line[rb] * 64 : pf,
                      pf ? first_line[rb + 1] - first_line[rb] : 0);
      }
    }
}

void tail_avx2(const float* x, int64_t R, const float* w, int64_t V, int64_t h, float* out, int64_t v0) {
  const int64_t h8 = h & ~int64_t(7);
  for (int64_t v = v0; v < V; ++v)
    for (int64_t r = 0; r < R; ++r) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t k = 0; k < h8; k += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * h + k), _mm256_loadu_ps(w + v * h + k), acc);
      if (h8 < h) {
        const __m256i m = tail_mask_avx2(h - h8);
        acc = _mm256_fmadd_ps(_mm256_maskload_ps(x + r * h + h8, m), _mm256_maskload_ps(w + v * h + h8, m), acc);
      }
      const __m128 s = sum4_avx2(acc, _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps());
      out[r * V + v] = _mm_cvtss_f32(s);
    }
}
#pragma GCC pop_options
#endif

}  // namespace

namespace megarl_cpu {

namespace {
bool has_avx512() {
#ifdef MEGARL_WIDE_LINEAR_AVX512
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

bool has_avx2() {
#ifdef MEGARL_WIDE_LINEAR_AVX512
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}
}  // namespace

bool wide_linear_supported() { return has_avx512() || has_avx2(); }

#define MEGARL_CHECK_WL(cond, what) MEGARL_CHECK(cond, "wide_linear", what)

// x [R, h], w [V, h]: contiguous fp32 CPU tensors. -> x w^T [R, V] fp32.
at::Tensor wide_linear(const at::Tensor& x, const at::Tensor& w) {
  MEGARL_CHECK_WL(wide_linear_supported(), "needs a CPU with AVX-512 or AVX2 + FMA (wide_linear_supported() is false here)");
  MEGARL_CHECK_WL(x.device().is_cpu() && w.device().is_cpu(), "CPU tensors only");
  MEGARL_CHECK_WL(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
                  std::string("float32 only, got ") + c10::toString(x.scalar_type()) + " and " +
                      c10::toString(w.scalar_type()));
  MEGARL_CHECK_WL(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && x.size(1) > 0,
                  "x [R, h] and w [V, h] expected, got " + shape_of(x) + " and " + shape_of(w));
  MEGARL_CHECK_WL(x.is_contiguous() && w.is_contiguous(), "x and w must be contiguous");
  const int64_t R = x.size(0), h = x.size(1), V = w.size(0);
  at::Tensor out = at::empty({R, V}, x.options());
#ifdef MEGARL_WIDE_LINEAR_AVX512
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t blocks = V / 4;
  if (R > 0) {
    const bool avx512 = has_avx512();
    at::parallel_for(0, blocks, 1024, [&](int64_t begin, int64_t end) {
      if (avx512) {
        rows_avx512(xp, R, wp, V, h, op, begin * 4, end * 4);
      } else {
        rows_avx2(xp, R, wp, V, h, op, begin * 4, end * 4);
      }
    });
    if (avx512) {
      tail_avx512(xp, R, wp, V, h, op, blocks * 4);
    } else {
      tail_avx2(xp, R, wp, V, h, op, blocks * 4);
    }
  }
#endif
  return out;
}

}  // namespace megarl_cpu
