// Host-side entry points of the CUDA kernels, callable from plain C++ (bindings.cpp) without
// CUDA or ATen types. Pointers are device pointers; `stream` is a cudaStream_t. Every launcher
// returns a cudaError_t as int (0 = success); error_string() turns it into a message.
#pragma once

#include <stdint.h>

namespace megarl {

enum DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat64 = 3 };

// One pass over logits [rows, n] (row stride ld, unit column stride) of one vocabulary shard
// whose first global column is vocab_start. finalize=true (unsharded vocabulary): o0, o1, o2 =
// logprob, entropy, lse in nats and o3 is unused. finalize=false (tensor parallel): o0..o3 =
// local max, sum exp(z - max), sum exp(z - max)(z - max) and the target logit z_t (0 when another
// shard owns it), z = x / temperature, for the caller to reduce across ranks. Rows whose target
// is ignore_index are not read.
int logprobs_forward(int dtype, const void* logits, int64_t rows, int64_t n, int64_t ld,
                     const int64_t* targets, int64_t vocab_start, int64_t global_vocab,
                     int64_t ignore_index, float inv_temp, bool finalize, float* o0, float* o1,
                     float* o2, float* o3, void* stream);

// grad [rows, n] (row stride ldg) of g_lp . logprob + g_ent . entropy with respect to the logits,
// from one read of the logits and the per-row lse and entropy; g_lp / g_ent may be null (zero).
int logprobs_backward(int dtype, const void* logits, int64_t ldx, void* grad, int64_t ldg,
                      int64_t rows, int64_t n, const int64_t* targets, int64_t vocab_start,
                      int64_t ignore_index, float inv_temp, const float* lse, const float* entropy,
                      const float* g_lp, const float* g_ent, void* stream);

// GAE over `rows` sequences. offsets == null: rows x T contiguous; else sequence i is
// [offsets[i], offsets[i+1]) of flat arrays (T unused). mask may be null (all valid).
// dtype is kFloat32 or kFloat64 for rewards, values, adv and ret alike.
int gae_forward(int dtype, const void* rewards, const void* values, const uint8_t* mask,
                int64_t rows, int64_t T, const int64_t* offsets, double gamma, double lam,
                void* adv, void* ret, void* stream);

const char* error_string(int code);

}  // namespace megarl
