// DCMHA fused attention forward, SIMT kernel: device code (SPEC section 5). Compiled by nvcc
// for the GPU and by the host compiler against the SIMT emulator. The launcher takes it
// for fp32 inputs and for dv > 128; bf16 / fp16 run dcmha_attention_mma_kernel.cuh. Its
// row statistics [2, B, H, T] are the layout both forwards write and the backward reads.
//
// One block per (query row t, batch b) holds all H heads of the row. Keys outside the
// causal / window band are never visited. Pass 1: each thread takes keys s = tid,
// tid + blockDim, ...: logits L[n] = scale <q[n,t], k[n,s]> for every head, pre-compose
// (compose_heads), and a per-thread running max / sum per head; the per-thread states
// are combined in a fixed order (deterministic). Pass 2, in chunks of blockDim keys:
// recompute, normalize P = exp(L' - M) / Z, post-compose into smem P'[H][chunk], then
// every thread accumulates its own output elements O[m][e] += sum_j P'[m][j] v[m,j,e]
// over the chunk in order. No [T, S] tensor exists anywhere; the row statistics
// (M, Z per head) are written for the backward.
#pragma once

#include "../common/simt_portability.h"
#include "dcmha_kernel.cuh"

#include <cstdint>

namespace headwise {
namespace dcmha {

constexpr int kAttnThreads = 128;

struct AttnParams {
  const void* q;    // [B, H, T, dh] contiguous
  const void* k;
  const void* v;    // [B, H, T, dv]
  const float* w1;  // [B, T, 4, R, H] fp32
  const float* w2;
  const float* g;   // [B, T, 4, H]
  void* out;        // [B, H, T, dv]
  float* stats;     // [2, B, H, T]: row max, row sum
  int B, T, H, hg, dh, dv;
  int causal, window;  // window 0: none
  float scale;
};

// Floats of dynamic smem: q row [H dh], query weights of both slots 2 x [2 R H + H],
// chunk buffer [H blockDim], output [H dv], reduction buffer [H blockDim].
__host__ __device__ inline int64_t attn_smem_floats(int H, int dh, int dv, int threads) {
  return static_cast<int64_t>(H) * dh + 2 * (2 * kR * H + H) + 2 * static_cast<int64_t>(H) * threads +
         static_cast<int64_t>(H) * dv;
}

// x[H] -> y[H]: compose of one (t, s) head vector with the query weights (smem: w1q, w2q,
// gq) and key weights (global, row s) of a slot pair.
__device__ __forceinline__ void compose_heads(const float* x, float* y, int H, int hg, const float* qw1,
                                              const float* qw2, const float* qg, const float* kw1,
                                              const float* kw2, const float* kg) {
  for (int g0 = 0; g0 < H; g0 += hg) {
    float pq[kR] = {0.f, 0.f}, pk[kR] = {0.f, 0.f};
    for (int n = g0; n < g0 + hg; ++n)
      for (int r = 0; r < kR; ++r) {
        pq[r] += qw1[r * H + n] * x[n];
        pk[r] += kw1[r * H + n] * x[n];
      }
    for (int m = g0; m < g0 + hg; ++m) {
      float acc = x[m] * (1.f + qg[m] + kg[m]);
      for (int r = 0; r < kR; ++r) acc += qw2[r * H + m] * pq[r] + kw2[r * H + m] * pk[r];
      y[m] = acc;
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kAttnThreads) dcmha_attention_fwd(const AttnParams p) {
  const int t = blockIdx.x, b = blockIdx.y, H = p.H, TT = p.T, dh = p.dh, dv = p.dv;
  const int tid = threadIdx.x, nthreads = blockDim.x;
  float* smem = reinterpret_cast<float*>(hw::dynamic_shared_memory());
  float* qs = smem;                               // [H][dh], scaled
  float* wq = qs + H * dh;                        // pre: w1 [R H], w2 [R H], g [H]; then post
  float* chunk = wq + 2 * (2 * kR * H + H);       // [H][nthreads]
  float* red = chunk + H * nthreads;              // [H][nthreads]
  float* out_s = red + H * nthreads;              // [H][dv]
  const int64_t row = static_cast<int64_t>(b) * H * TT;  // head n, position x: (row + n * T + x)
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  for (int i = tid; i < H * dh; i += nthreads) {
    const int n = i / dh, e = i % dh;
    qs[i] = static_cast<float>(q[(row + static_cast<int64_t>(n) * TT + t) * dh + e]) * p.scale;
  }
  for (int side = 0; side < 2; ++side) {
    const int c = 2 * side;  // query slots 0 (pre) and 2 (post)
    const int64_t wo = ((static_cast<int64_t>(b) * TT + t) * 4 + c) * kR * H;
    const int64_t go = ((static_cast<int64_t>(b) * TT + t) * 4 + c) * H;
    float* dst = wq + side * (2 * kR * H + H);
    for (int i = tid; i < kR * H; i += nthreads) {
      dst[i] = p.w1[wo + i];
      dst[kR * H + i] = p.w2[wo + i];
    }
    for (int i = tid; i < H; i += nthreads) dst[2 * kR * H + i] = p.g[go + i];
  }
  for (int i = tid; i < H * dv; i += nthreads) out_s[i] = 0.f;
  __syncthreads();
  const float* pre = wq;
  const float* post = wq + (2 * kR * H + H);

  // The key band [s_begin, s_end) of row t.
  const int s_end = p.causal ? t + 1 : TT;
  const int s_begin = p.window > 0 ? (t - p.window + 1 > 0 ? t - p.window + 1 : 0) : 0;

  auto logits = [&](int s, float* x) {
    for (int n = 0; n < H; ++n) {
      const T* kr = k + (row + static_cast<int64_t>(n) * TT + s) * dh;
      const float* qr = qs + n * dh;
      float acc = 0.f;
      for (int e = 0; e < dh; ++e) acc += qr[e] * static_cast<float>(kr[e]);
      x[n] = acc;
    }
  };
  auto key_w = [&](int s, int c, const float*& w1, const float*& w2, const float*& g) {
    const int64_t wo = ((static_cast<int64_t>(b) * TT + s) * 4 + c) * kR * H;
    w1 = p.w1 + wo;
    w2 = p.w2 + wo;
    g = p.g + ((static_cast<int64_t>(b) * TT + s) * 4 + c) * H;
  };

  // Pass 1: per-thread running max and sum per head, then a fixed-order combine.
  float m_run[kMaxHeads], l_run[kMaxHeads];
  for (int n = 0; n < H; ++n) {
    m_run[n] = -INFINITY;
    l_run[n] = 0.f;
  }
  for (int s = s_begin + tid; s < s_end; s += nthreads) {
    float x[kMaxHeads], y[kMaxHeads];
    logits(s, x);
    const float *kw1, *kw2, *kg;
    key_w(s, 1, kw1, kw2, kg);
    compose_heads(x, y, H, p.hg, pre, pre + kR * H, pre + 2 * kR * H, kw1, kw2, kg);
    for (int n = 0; n < H; ++n) {
      const float mn = fmaxf(m_run[n], y[n]);
      l_run[n] = l_run[n] * expf(m_run[n] - mn) + expf(y[n] - mn);
      m_run[n] = mn;
    }
  }
  for (int n = 0; n < H; ++n) red[n * nthreads + tid] = m_run[n];
  __syncthreads();
  // Threads n < H combine head n over the threads in order: the max first, then the sum.
  if (tid < H) {
    float mx = -INFINITY;
    for (int j = 0; j < nthreads; ++j) mx = fmaxf(mx, red[tid * nthreads + j]);
    chunk[tid] = mx;  // borrowed: the row max of head tid
  }
  __syncthreads();
  float m_row[kMaxHeads];
  for (int n = 0; n < H; ++n) {
    m_row[n] = chunk[n];
    // exp(-inf - finite) = 0 for threads that saw no key; a fully masked row keeps 0.
    red[n * nthreads + tid] = m_run[n] == -INFINITY ? 0.f : l_run[n] * expf(m_run[n] - m_row[n]);
  }
  __syncthreads();
  if (tid < H) {
    float sum = 0.f;
    for (int j = 0; j < nthreads; ++j) sum += red[tid * nthreads + j];
    red[tid * nthreads] = sum;
  }
  __syncthreads();
  float inv_l[kMaxHeads];
  for (int n = 0; n < H; ++n) {
    const float l = red[n * nthreads];
    inv_l[n] = l > 0.f ? 1.f / l : 0.f;
  }
  if (tid < H) {
    const int64_t so = (static_cast<int64_t>(b) * H + tid) * TT + t;
    p.stats[so] = m_row[tid];
    p.stats[static_cast<int64_t>(p.B) * H * TT + so] = red[tid * nthreads];
  }
  __syncthreads();  // chunk and red are reused below

  // Pass 2: chunks of nthreads keys.
  for (int s0 = s_begin; s0 < s_end; s0 += nthreads) {
    const int s = s0 + tid;
    if (s < s_end) {
      float x[kMaxHeads], y[kMaxHeads];
      logits(s, x);
      const float *kw1, *kw2, *kg;
      key_w(s, 1, kw1, kw2, kg);
      compose_heads(x, y, H, p.hg, pre, pre + kR * H, pre + 2 * kR * H, kw1, kw2, kg);
      for (int n = 0; n < H; ++n) x[n] = expf(y[n] - m_row[n]) * inv_l[n];
      key_w(s, 3, kw1, kw2, kg);
      compose_heads(x, y, H, p.hg, post, post + kR * H, post + 2 * kR * H, kw1, kw2, kg);
      for (int n = 0; n < H; ++n) chunk[n * nthreads + tid] = y[n];
    } else {
      for (int n = 0; n < H; ++n) chunk[n * nthreads + tid] = 0.f;
    }
    __syncthreads();
    const int nk = s_end - s0 < nthreads ? s_end - s0 : nthreads;
    for (int i = tid; i < H * dv; i += nthreads) {
      const int m = i / dv, e = i % dv;
      const T* vr = v + (row + static_cast<int64_t>(m) * TT + s0) * dv + e;
      float acc = out_s[i];
      for (int j = 0; j < nk; ++j) acc += chunk[m * nthreads + j] * static_cast<float>(vr[static_cast<int64_t>(j) * dv]);
      out_s[i] = acc;
    }
    __syncthreads();
  }
  T* out = static_cast<T*>(p.out);
  for (int i = tid; i < H * dv; i += nthreads) {
    const int m = i / dv, e = i % dv;
    out[(row + static_cast<int64_t>(m) * TT + t) * dv + e] = static_cast<T>(out_s[i]);
  }
}

}  // namespace dcmha
}  // namespace headwise
