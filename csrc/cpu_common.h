// Shared by megarl._cpu's sources: argument checks that raise a Python RuntimeError.
#pragma once
#include <torch/extension.h>

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

}  // namespace megarl_cpu

// op: the function's name, what: the message (a std::string expression, evaluated on failure only).
#define MEGARL_CHECK(cond, op, what)             \
  do {                                           \
    if (!(cond)) megarl_cpu::fail(std::string(op) + ": " + (what)); \
  } while (0)
