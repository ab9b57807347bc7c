// Python bindings of megarl._C: shape/dtype checks, output allocation, then the raw launchers
// of logprobs.cu / gae.cu. The caller (megarl/ops) sets the current device and passes the
// current stream as an integer, so this file needs no CUDA headers and compiles with g++ alone.
#include <torch/extension.h>

#include <vector>

#include "megarl_ops.h"

namespace {

int dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return megarl::kFloat32;
    case at::kHalf: return megarl::kFloat16;
    case at::kBFloat16: return megarl::kBFloat16;
    case at::kDouble: return megarl::kFloat64;
    default: TORCH_CHECK(false, "megarl._C: unsupported dtype ", t.scalar_type());
  }
  return -1;
}

void check(int err, const char* what) {
  TORCH_CHECK(err == 0, "megarl._C.", what, " failed: ", megarl::error_string(err));
}

void* as_stream(int64_t stream) { return reinterpret_cast<void*>(static_cast<intptr_t>(stream)); }

void check_rows(const at::Tensor& logits, const at::Tensor& targets) {
  TORCH_CHECK(logits.is_cuda() && logits.dim() == 2 && logits.stride(1) == 1,
              "logits must be a CUDA [rows, n] tensor with unit column stride");
  TORCH_CHECK(logits.size(1) > 0, "empty vocabulary shard");
  TORCH_CHECK(targets.is_cuda() && targets.scalar_type() == at::kLong && targets.dim() == 1 &&
                  targets.is_contiguous() && targets.size(0) == logits.size(0),
              "targets must be a contiguous int64 CUDA [rows] tensor");
}

void check_row_stat(const at::Tensor& t, int64_t rows, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                  t.dim() == 1 && t.size(0) == rows,
              name, " must be a contiguous fp32 CUDA [rows] tensor");
}

// Returns [logprob, entropy, lse] (finalize) or [max, sumexp, moment, target_logit].
std::vector<at::Tensor> logprobs_fwd(const at::Tensor& logits, const at::Tensor& targets,
                                     int64_t vocab_start, int64_t global_vocab,
                                     int64_t ignore_index, double inv_temp, bool finalize,
                                     int64_t stream) {
  check_rows(logits, targets);
  const int64_t rows = logits.size(0);
  std::vector<at::Tensor> out;
  for (int i = 0; i < (finalize ? 3 : 4); ++i) {
    out.push_back(at::empty({rows}, logits.options().dtype(at::kFloat)));
  }
  check(megarl::logprobs_forward(dtype_code(logits), logits.data_ptr(), rows, logits.size(1),
                                 logits.stride(0), targets.data_ptr<int64_t>(), vocab_start,
                                 global_vocab, ignore_index, static_cast<float>(inv_temp),
                                 finalize, out[0].data_ptr<float>(), out[1].data_ptr<float>(),
                                 out[2].data_ptr<float>(),
                                 finalize ? nullptr : out[3].data_ptr<float>(), as_stream(stream)),
        "logprobs_fwd");
  return out;
}

at::Tensor logprobs_bwd(const at::Tensor& logits, const at::Tensor& targets, const at::Tensor& lse,
                        const at::Tensor& entropy, const c10::optional<at::Tensor>& g_lp,
                        const c10::optional<at::Tensor>& g_ent, int64_t vocab_start,
                        int64_t ignore_index, double inv_temp, int64_t stream) {
  check_rows(logits, targets);
  const int64_t rows = logits.size(0);
  check_row_stat(lse, rows, "lse");
  check_row_stat(entropy, rows, "entropy");
  if (g_lp) check_row_stat(*g_lp, rows, "grad_logprob");
  if (g_ent) check_row_stat(*g_ent, rows, "grad_entropy");
  at::Tensor grad = at::empty({rows, logits.size(1)}, logits.options());
  check(megarl::logprobs_backward(
            dtype_code(logits), logits.data_ptr(), logits.stride(0), grad.data_ptr(),
            grad.stride(0), rows, logits.size(1), targets.data_ptr<int64_t>(), vocab_start,
            ignore_index, static_cast<float>(inv_temp), lse.data_ptr<float>(),
            entropy.data_ptr<float>(), g_lp ? g_lp->data_ptr<float>() : nullptr,
            g_ent ? g_ent->data_ptr<float>() : nullptr, as_stream(stream)),
        "logprobs_bwd");
  return grad;
}

// [B, T] (offsets absent) or packed [N] with offsets [S + 1] (int64). Returns (adv, ret).
std::vector<at::Tensor> gae(const at::Tensor& rewards, const at::Tensor& values,
                            const c10::optional<at::Tensor>& mask,
                            const c10::optional<at::Tensor>& offsets, double gamma, double lam,
                            int64_t stream) {
  TORCH_CHECK(rewards.is_cuda() && rewards.is_contiguous() && values.is_contiguous() &&
                  rewards.sizes() == values.sizes() &&
                  rewards.scalar_type() == values.scalar_type() &&
                  (rewards.scalar_type() == at::kFloat || rewards.scalar_type() == at::kDouble),
              "rewards/values must be contiguous fp32/fp64 CUDA tensors of one shape");
  if (mask) {
    TORCH_CHECK(mask->is_cuda() && mask->is_contiguous() && mask->scalar_type() == at::kBool &&
                    mask->sizes() == rewards.sizes(),
                "mask must be a contiguous bool CUDA tensor shaped like rewards");
  }
  int64_t rows = 0, T = 0;
  const int64_t* off = nullptr;
  if (offsets) {
    TORCH_CHECK(rewards.dim() == 1 && offsets->is_cuda() && offsets->is_contiguous() &&
                    offsets->scalar_type() == at::kLong && offsets->dim() == 1 &&
                    offsets->size(0) >= 1,
                "packed GAE takes 1-D rewards and int64 cu_seqlens [S + 1]");
    rows = offsets->size(0) - 1;
    off = offsets->data_ptr<int64_t>();
  } else {
    TORCH_CHECK(rewards.dim() == 2, "GAE takes [B, T] rewards");
    rows = rewards.size(0);
    T = rewards.size(1);
  }
  // Packed tokens outside every sequence stay zero.
  at::Tensor adv = offsets ? at::zeros_like(rewards) : at::empty_like(rewards);
  at::Tensor ret = offsets ? at::zeros_like(rewards) : at::empty_like(rewards);
  check(megarl::gae_forward(dtype_code(rewards), rewards.data_ptr(), values.data_ptr(),
                            mask ? reinterpret_cast<const uint8_t*>(mask->data_ptr()) : nullptr,
                            rows, T, off, gamma, lam, adv.data_ptr(), ret.data_ptr(),
                            as_stream(stream)),
        "gae");
  return {adv, ret};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megarl fused CUDA ops (log-probs/entropy, GAE); use megarl.ops, not this module";
  m.def("logprobs_fwd", &logprobs_fwd, "fused log-prob/entropy forward over a vocab shard");
  m.def("logprobs_bwd", &logprobs_bwd, "fused log-prob/entropy backward");
  m.def("gae", &gae, "GAE advantages and returns");
}
