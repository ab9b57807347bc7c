// Shared by megarl._cpu's sources: argument checks that raise a Python RuntimeError.
//
// The kernels include ATen's tensor and op headers only, not <torch/extension.h> (torch's whole C++
// API and pybind11): that header alone takes ~55 s to compile per file, and only
// cpu_bindings.cpp binds (and it takes only torch's pybind11 casters). With it in all six files
// megarl._cpu took ~3.8 minutes to build on 2 cores; now ~1 minute.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace megarl_cpu {

inline std::string shape_of(const at::Tensor& t) {
  std::string out = "[";
  for (int64_t i = 0; i < t.dim(); ++i) out += (i ? ", " : "") + std::to_string(t.size(i));
  return out + "]";
}

// Every message is one std::string, built only on failure: TORCH_CHECK then formats nothing
// through iostreams here (its several-argument form streams them, which crashed where the
// compiler links libstdc++ statically: one GPU machine's /opt/gcc wrapper, 2026-11-27).
[[noreturn]] inline void fail(const std::string& what) {
  TORCH_CHECK(false, "megarl._cpu." + what);
  throw std::logic_error("unreachable");
}

// exp(x) for x <= 0 (a score minus its row's max), within ~2 ulp of expf; plain arithmetic so
// that the loop around it vectorises: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by its degree-7
// Taylor polynomial (relative error < 1e-8 there), times 2^n built in the exponent bits.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;  // exp(-87) ~ 1.6e-38: still a normal float
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  float n = (x * 1.44269504088896341f + shifter) - shifter;
  float r = x - n * 0.693145751953125f;  // ln2 in two parts: r stays exact
  r = r - n * 1.42860682030941723212e-6f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace megarl_cpu

// One clone per instruction set (AVX-512, AVX2 + FMA, baseline), picked once at load time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MEGARL_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define MEGARL_CLONES
#endif

// op: the function's name, what: the message (a std::string expression, evaluated on failure only).
#define MEGARL_CHECK(cond, op, what)             \
  do {                                           \
    if (!(cond)) megarl_cpu::fail(std::string(op) + ": " + (what)); \
  } while (0)
