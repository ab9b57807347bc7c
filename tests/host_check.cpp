// CPU harness for the kernels' shared arithmetic (megarl_ops.cuh), built with g++ by
// tests/test_csrc.py and called through ctypes. Each function replays what one CUDA block does:
// the same lane/chunk decomposition, the same butterfly merge order and the same scan, with the
// thread count a parameter so small inputs still cross every boundary (vector tails, empty
// lanes, several tiles). Only fp32 logits are replayed: half types differ only in the load.
#include <vector>

#include "megarl_ops.cuh"

using namespace megarl;

namespace {

// warp_merge/block_merge of logprobs.cu: xor butterfly within 32-lane warps, then across the
// warp leaders (padded with empty states).
LseState block_merge(std::vector<LseState> st) {
  auto butterfly = [](std::vector<LseState>& s) {
    for (size_t w = 0; w < s.size(); w += 32) {
      for (int off = 16; off > 0; off >>= 1) {
        std::vector<LseState> nxt(s.begin() + w, s.begin() + w + 32);
        for (int l = 0; l < 32; ++l) nxt[l] = lse_merge(s[w + l], s[w + (l ^ off)]);
        std::copy(nxt.begin(), nxt.end(), s.begin() + w);
      }
    }
  };
  while (st.size() % 32) st.push_back(lse_empty());
  butterfly(st);
  std::vector<LseState> leaders(32, lse_empty());
  for (size_t w = 0; w < st.size(); w += 32) leaders[w / 32] = st[w];
  butterfly(leaders);
  return leaders[0];
}

template <int VEC>
void forward_rows(const float* x, int64_t rows, int64_t n, int64_t ld, const int64_t* targets,
                  int64_t vocab_start, int64_t global_vocab, int64_t ignore_index, float c2,
                  bool finalize, int nlanes, float* o0, float* o1, float* o2, float* o3) {
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t t = targets[row];
    if (t == ignore_index) {
      store_ignored_row(finalize, row, o0, o1, o2, o3);
      continue;
    }
    const float* xr = x + row * ld;
    std::vector<LseState> lanes(nlanes);
    for (int l = 0; l < nlanes; ++l) lanes[l] = lse_lane_partial<VEC>(xr, n, l, nlanes, c2);
    const LseState st = block_merge(lanes);
    const int64_t tl = t - vocab_start;
    const bool owned = tl >= 0 && tl < n;
    const float yt = owned ? xr[tl] * c2 : 0.f;
    store_row(finalize, st, yt, t >= 0 && t < global_vocab, row, o0, o1, o2, o3);
  }
}

template <int VEC>
void backward_rows(const float* x, int64_t ldx, float* g, int64_t ldg, int64_t rows, int64_t n,
                   const int64_t* targets, int64_t vocab_start, int64_t ignore_index, float c2,
                   float inv_temp, const float* lse, const float* ent, const float* g_lp,
                   const float* g_ent, int nlanes) {
  for (int64_t row = 0; row < rows; ++row) {
    float* gr = g + row * ldg;
    const int64_t t = targets[row];
    if (t == ignore_index) {
      for (int l = 0; l < nlanes; ++l) zero_lane(gr, n, l, nlanes);
      continue;
    }
    const GradCoef c = grad_coef(lse[row], ent[row], g_lp ? g_lp[row] : 0.f,
                                 g_ent ? g_ent[row] : 0.f, inv_temp);
    int64_t tl = t - vocab_start;
    if (tl < 0 || tl >= n) tl = -1;
    for (int l = 0; l < nlanes; ++l) grad_lane<VEC>(x + row * ldx, gr, n, l, nlanes, c2, c, tl);
  }
}

// gae_kernel of gae.cu for one sequence with `threads` threads of `per` tokens.
template <typename S>
void gae_sequence(const S* r, const S* v, const uint8_t* m, int64_t len, S gamma, S gl,
                  int threads, int per, S* adv, S* ret) {
  const int tile = threads * per;
  std::vector<S> sr(tile), sv(tile), lr(per), lv(per);
  std::vector<uint8_t> sm(tile), lm(per);
  std::vector<GaeMap<S>> smap(threads), nxt(threads);
  GaeState<S> carry{S(0), S(0)};
  for (int64_t tile_end = len; tile_end > 0; tile_end -= tile) {
    const int64_t tile_start = tile_end > tile ? tile_end - tile : 0;
    const int nt = static_cast<int>(tile_end - tile_start);
    for (int i = 0; i < nt; ++i) {
      sr[i] = r[tile_start + i];
      sv[i] = v[tile_start + i];
      sm[i] = m ? m[tile_start + i] : uint8_t(1);
    }
    for (int tid = 0; tid < threads; ++tid) {
      const int c0 = tid * per;
      for (int k = 0; k < per; ++k) {
        const bool in = c0 + k < nt;
        lr[k] = in ? sr[c0 + k] : S(0);
        lv[k] = in ? sv[c0 + k] : S(0);
        lm[k] = in ? sm[c0 + k] : uint8_t(0);
      }
      smap[tid] = gae_chunk_summary<S>(lr.data(), lv.data(), lm.data(), per, gamma, gl);
    }
    for (int off = 1; off < threads; off <<= 1) {  // Hillis-Steele, as in the kernel
      for (int tid = 0; tid < threads; ++tid) {
        nxt[tid] = tid + off < threads ? gae_compose(smap[tid], smap[tid + off]) : smap[tid];
      }
      smap.swap(nxt);
    }
    for (int tid = 0; tid < threads; ++tid) {
      const int c0 = tid * per;
      const GaeState<S> mine = tid + 1 < threads ? gae_apply(smap[tid + 1], carry) : carry;
      for (int k = 0; k < per; ++k) {
        const bool in = c0 + k < nt;
        lr[k] = in ? sr[c0 + k] : S(0);
        lv[k] = in ? sv[c0 + k] : S(0);
        lm[k] = in ? sm[c0 + k] : uint8_t(0);
      }
      gae_chunk_scan<S>(lr.data(), lv.data(), lm.data(), per, gamma, gl, mine, lr.data(),
                        lv.data());
      for (int k = 0; k < per && c0 + k < nt; ++k) {
        adv[tile_start + c0 + k] = lr[k];
        ret[tile_start + c0 + k] = lv[k];
      }
    }
    carry = gae_apply(smap[0], carry);
  }
}

template <typename S>
void gae_all(const S* r, const S* v, const uint8_t* m, int64_t rows, int64_t T,
             const int64_t* offsets, double gamma, double lam, int threads, int per, S* adv,
             S* ret) {
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t start = offsets ? offsets[row] : row * T;
    const int64_t len = offsets ? offsets[row + 1] - start : T;
    gae_sequence<S>(r + start, v + start, m ? m + start : nullptr, len, static_cast<S>(gamma),
                    static_cast<S>(gamma * lam), threads, per, adv + start, ret + start);
  }
}

// The launchers' rule: 16-byte vectors only when every row starts 16-byte aligned.
bool aligned16(const void* p, int64_t ld) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0 && (ld * 4) % 16 == 0;
}

}  // namespace

extern "C" {

// vec: 4 (the kernel's fp32 width, used when rows are 16-byte aligned, as on the GPU) or 1.
int megarl_host_logprobs_forward(const float* x, int64_t rows, int64_t n, int64_t ld,
                                 const int64_t* targets, int64_t vocab_start,
                                 int64_t global_vocab, int64_t ignore_index, float inv_temp,
                                 int finalize, int nlanes, int vec, float* o0, float* o1,
                                 float* o2, float* o3) {
  const float c2 = inv_temp * kLog2e;
  if (vec == 4 && aligned16(x, ld)) {
    forward_rows<4>(x, rows, n, ld, targets, vocab_start, global_vocab, ignore_index, c2,
                    finalize != 0, nlanes, o0, o1, o2, o3);
  } else if (vec == 1 || vec == 4) {
    forward_rows<1>(x, rows, n, ld, targets, vocab_start, global_vocab, ignore_index, c2,
                    finalize != 0, nlanes, o0, o1, o2, o3);
  } else {
    return 1;
  }
  return 0;
}

int megarl_host_logprobs_backward(const float* x, int64_t ldx, float* g, int64_t ldg, int64_t rows,
                                  int64_t n, const int64_t* targets, int64_t vocab_start,
                                  int64_t ignore_index, float inv_temp, const float* lse,
                                  const float* ent, const float* g_lp, const float* g_ent,
                                  int nlanes, int vec) {
  const float c2 = inv_temp * kLog2e;
  if (vec == 4 && aligned16(x, ldx) && aligned16(g, ldg)) {
    backward_rows<4>(x, ldx, g, ldg, rows, n, targets, vocab_start, ignore_index, c2, inv_temp,
                     lse, ent, g_lp, g_ent, nlanes);
  } else if (vec == 1 || vec == 4) {
    backward_rows<1>(x, ldx, g, ldg, rows, n, targets, vocab_start, ignore_index, c2, inv_temp,
                     lse, ent, g_lp, g_ent, nlanes);
  } else {
    return 1;
  }
  return 0;
}

int megarl_host_gae_f32(const float* r, const float* v, const uint8_t* m, int64_t rows, int64_t T,
                        const int64_t* offsets, double gamma, double lam, int threads, int per,
                        float* adv, float* ret) {
  gae_all<float>(r, v, m, rows, T, offsets, gamma, lam, threads, per, adv, ret);
  return 0;
}

int megarl_host_gae_f64(const double* r, const double* v, const uint8_t* m, int64_t rows,
                        int64_t T, const int64_t* offsets, double gamma, double lam, int threads,
                        int per, double* adv, double* ret) {
  gae_all<double>(r, v, m, rows, T, offsets, gamma, lam, threads, per, adv, ret);
  return 0;
}

}  // extern "C"
