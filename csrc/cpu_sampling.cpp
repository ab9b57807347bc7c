// megarl._cpu.sample_rows: one token per row drawn from softmax(logits / temperature) by inverse
// CDF in id order, with its log-prob, on a CPU (rollout/sampling.py's draw, in two passes).
//
// The torch path runs about seven passes over the [rows, V] logits of a decode step (max, min,
// subtract, exp, block sums, then a gather and a cumulative sum in one block): 1-2.4 ns per
// logit, 2.5 ms a step for 16 rows at V = 152k. Here each row is read twice, with nothing
// written: its max, then exp(z - max) summed per block of `block` ids (fp32 within a block, fp64
// across blocks); the block the row's uniform falls in is found on those sums, and that block
// alone is summed again id by id in fp64 to find the token. The same draw as the torch path up
// to the rounding of the exponentials and of the fp32 block sums (their order).
#include "cpu_common.h"

#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

namespace {

using megarl_cpu::exp_nonpositive;

// z / temperature as the torch path computes it (an fp32 division); temperature 1: z itself.
template <bool Divide>
inline float scaled(float z, float temperature) {
  if constexpr (Divide) return z / temperature;
  return z;
}

// exp(x - m) for x <= m, exactly 0 for x = -inf (a filtered id keeps zero mass).
inline float mass(float x, float m) {
  return x == -std::numeric_limits<float>::infinity() ? 0.0f : exp_nonpositive(x - m);
}

// One row: id and log p(id). cdf: [nb] workspace.
template <bool Divide>
inline __attribute__((always_inline)) void sample_row(const float* z, int64_t V, int64_t block, float temperature,
                                                      double u, double* cdf, int64_t* id_out, float* lp_out) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < V; ++j) {
    const float x = scaled<Divide>(z[j], temperature);
    m = x > m ? x : m;
  }
  const int64_t nb = (V + block - 1) / block;
  double total = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t j1 = b + 1 < nb ? (b + 1) * block : V;
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t j = b * block; j < j1; ++j) acc += mass(scaled<Divide>(z[j], temperature), m);
    total += static_cast<double>(acc);
    cdf[b] = total;
  }
  const double target = u * total;  // < total: u <= 1 - 2^-40
  int64_t b = 0;
  while (b < nb - 1 && !(cdf[b] > target)) ++b;  // the first block whose cumulative sum exceeds it
  const double before = b > 0 ? cdf[b - 1] : 0.0;
  const int64_t j0 = b * block, j1 = b + 1 < nb ? (b + 1) * block : V;
  // Within the block: the first id whose fp64 cumulative sum exceeds target - before, kept below
  // the block's own last sum (the block sum above rounds in fp32), so the id has positive mass.
  double last = 0.0;
  for (int64_t j = j0; j < j1; ++j) last += static_cast<double>(mass(scaled<Divide>(z[j], temperature), m));
  const double local = std::min(target - before, std::nextafter(last, 0.0));
  double c = 0.0;
  int64_t id = j1 - 1;
  for (int64_t j = j0; j < j1; ++j) {
    c += static_cast<double>(mass(scaled<Divide>(z[j], temperature), m));
    if (c > local) {
      id = j;
      break;
    }
  }
  *id_out = id;
  *lp_out = (scaled<Divide>(z[id], temperature) - m) - static_cast<float>(std::log(total));
}

MEGARL_CLONES void sample_row_scaled(const float* z, int64_t V, int64_t block, float temperature, double u,
                                    double* cdf, int64_t* id_out, float* lp_out) {
  sample_row<true>(z, V, block, temperature, u, cdf, id_out, lp_out);
}

MEGARL_CLONES void sample_row_plain(const float* z, int64_t V, int64_t block, float temperature, double u,
                                   double* cdf, int64_t* id_out, float* lp_out) {
  sample_row<false>(z, V, block, temperature, u, cdf, id_out, lp_out);
}

}  // namespace

namespace megarl_cpu {

#define MEGARL_CHECK_SR(cond, what) MEGARL_CHECK(cond, "sample_rows", what)

// logits [N, V] fp32 on the CPU (unit stride over V; any row stride), uniforms [N] fp64 in
// [0, 1), temperature > 0, block: ids per block of the two-level search -> (ids [N] int64,
// logprobs [N] fp32).
std::tuple<at::Tensor, at::Tensor> sample_rows(const at::Tensor& logits, const at::Tensor& uniforms,
                                               double temperature, int64_t block) {
  MEGARL_CHECK_SR(logits.device().is_cpu() && uniforms.device().is_cpu(), "CPU tensors only");
  MEGARL_CHECK_SR(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.size(1) > 0 &&
                      logits.stride(1) == 1,
                  "logits must be float32 [N, V] with unit stride over V, got " + shape_of(logits) + " " +
                      std::string(c10::toString(logits.scalar_type())));
  MEGARL_CHECK_SR(uniforms.scalar_type() == at::kDouble && uniforms.dim() == 1 &&
                      uniforms.size(0) == logits.size(0) && uniforms.is_contiguous(),
                  "uniforms must be a contiguous float64 [N], got " + shape_of(uniforms));
  MEGARL_CHECK_SR(temperature > 0, "temperature must be > 0, got " + std::to_string(temperature));
  MEGARL_CHECK_SR(block > 0, "block must be > 0, got " + std::to_string(block));
  const int64_t N = logits.size(0), V = logits.size(1), ld = logits.stride(0);
  at::Tensor ids = at::empty({N}, logits.options().dtype(at::kLong));
  at::Tensor lps = at::empty({N}, logits.options());
  const float* zp = logits.data_ptr<float>();
  const double* up = uniforms.data_ptr<double>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* lp = lps.data_ptr<float>();
  const float t = static_cast<float>(temperature);
  const auto row = temperature != 1.0 ? sample_row_scaled : sample_row_plain;
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> cdf((V + block - 1) / block);
    for (int64_t r = begin; r < end; ++r) row(zp + r * ld, V, block, t, up[r], cdf.data(), ip + r, lp + r);
  });
  return {ids, lps};
}

}  // namespace megarl_cpu
