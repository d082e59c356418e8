// DCMHA compose: device code of the forward and backward kernels (SPEC section 5).
// Compiled by nvcc for the GPU and by the host compiler against the SIMT emulator.
//
// a [B, H, T, T] (key-side weights are indexed by s, so S = T), weights in fp32:
// w1, w2 [B, T, 4, R, H], g [B, T, 4, H]. For (t, s), output head m in group grp(m):
//   pq[r] = sum_{n in grp} W1[t,cq,r,n] a[n],  pk[r] = sum_{n in grp} W1[s,ck,r,n] a[n]
//   y[m]  = a[m] (1 + G[t,cq,m] + G[s,ck,m]) + sum_r W2[t,cq,r,m] pq[r] + W2[s,ck,r,m] pk[r]
// Backward, given dy:
//   dpq[r] = sum_{m in grp} W2[t,cq,r,m] dy[m],  dpk likewise with W2[s,ck]
//   da[n]  = dy[n] (1 + Gq[n] + Gk[n]) + sum_r W1[t,cq,r,n] dpq[r] + W1[s,ck,r,n] dpk[r]
//   query-side grads (row t, summed over s):  dGq[m] = sum a[m] dy[m],
//     dW2q[r,m] = sum pq[r] dy[m],  dW1q[r,n] = sum a[n] dpq[r]
//   key-side grads (column s, summed over t): the same with pk, dpk.
//
// Kernels:
//   dcmha_compose_fwd  block per (t, b), threads over s; the row's query weights in smem.
//   dcmha_compose_bwd_query  block per (t, b), threads over s: da, and the query-side grads
//     as per-thread partials reduced by hw::BlockSum (fixed order: deterministic).
//   dcmha_compose_bwd_key  block per (64 columns, b), thread per column s looping over
//     t in order: the key-side grads, with no reduction across threads (deterministic).
// Per-thread head vectors are arrays of kMaxHeads floats (H <= 32).
#pragma once

#include "../common/block_reduce.cuh"
#include "../common/simt_portability.h"

#include <cstdint>

namespace headwise {
namespace dcmha {

constexpr int kMaxHeads = 32;
constexpr int kR = 2;
constexpr int kComposeThreads = 128;
constexpr int kKeyColumns = 64;

struct ComposeParams {
  const void* a;      // [B, H, T, T] contiguous, storage dtype
  const void* grad;   // backward: [B, H, T, T] contiguous
  void* out;          // forward: a'; backward: grad_a
  const float* w1;    // [B, T, 4, R, H]
  const float* w2;
  const float* g;     // [B, T, 4, H]
  float* dw1;         // backward: [B, T, 4, R, H] (slots cq and ck written)
  float* dw2;
  float* dg;
  int T, H, hg;       // hg = H / head_groups
  int cq, ck;
};

__device__ __forceinline__ int64_t w_off(const ComposeParams& p, int b, int t, int c) {
  return ((static_cast<int64_t>(b) * p.T + t) * 4 + c) * kR * p.H;
}
__device__ __forceinline__ int64_t g_off(const ComposeParams& p, int b, int t, int c) {
  return ((static_cast<int64_t>(b) * p.T + t) * 4 + c) * p.H;
}

// The query weights of row t: loaded into smem as w1q [R H], w2q [R H], gq [H] and
// returned as pointers into it.
struct QueryWeights {
  const float* w1;
  const float* w2;
  const float* g;
};

__device__ __forceinline__ QueryWeights load_query_weights(const ComposeParams& p, int b, int t, float* smem) {
  const float* w1 = p.w1 + w_off(p, b, t, p.cq);
  const float* w2 = p.w2 + w_off(p, b, t, p.cq);
  const float* g = p.g + g_off(p, b, t, p.cq);
  for (int i = threadIdx.x; i < kR * p.H; i += blockDim.x) {
    smem[i] = w1[i];
    smem[kR * p.H + i] = w2[i];
  }
  for (int i = threadIdx.x; i < p.H; i += blockDim.x) smem[2 * kR * p.H + i] = g[i];
  __syncthreads();
  return {smem, smem + kR * p.H, smem + 2 * kR * p.H};
}

template <typename T>
__global__ void __launch_bounds__(kComposeThreads) dcmha_compose_fwd(const ComposeParams p) {
  const int t = blockIdx.x, b = blockIdx.y, H = p.H, TT = p.T;
  float* smem = reinterpret_cast<float*>(hw::dynamic_shared_memory());
  const auto [qw1, qw2, qg] = load_query_weights(p, b, t, smem);
  const int64_t head_stride = static_cast<int64_t>(TT) * TT;
  const T* a = static_cast<const T*>(p.a) + static_cast<int64_t>(b) * H * head_stride + static_cast<int64_t>(t) * TT;
  T* out = static_cast<T*>(p.out) + static_cast<int64_t>(b) * H * head_stride + static_cast<int64_t>(t) * TT;
  for (int s = threadIdx.x; s < TT; s += blockDim.x) {
    const float* kw1 = p.w1 + w_off(p, b, s, p.ck);
    const float* kw2 = p.w2 + w_off(p, b, s, p.ck);
    const float* kg = p.g + g_off(p, b, s, p.ck);
    float x[kMaxHeads];
    for (int n = 0; n < H; ++n) x[n] = static_cast<float>(a[n * head_stride + s]);
    for (int g0 = 0; g0 < H; g0 += p.hg) {
      float pq[kR] = {0.f, 0.f}, pk[kR] = {0.f, 0.f};
      for (int n = g0; n < g0 + p.hg; ++n)
        for (int r = 0; r < kR; ++r) {
          pq[r] += qw1[r * H + n] * x[n];
          pk[r] += kw1[r * H + n] * x[n];
        }
      for (int m = g0; m < g0 + p.hg; ++m) {
        float y = x[m] * (1.f + qg[m] + kg[m]);
        for (int r = 0; r < kR; ++r) y += qw2[r * H + m] * pq[r] + kw2[r * H + m] * pk[r];
        out[m * head_stride + s] = static_cast<T>(y);
      }
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kComposeThreads) dcmha_compose_bwd_query(const ComposeParams p) {
  const int t = blockIdx.x, b = blockIdx.y, H = p.H, TT = p.T;
  float* smem = reinterpret_cast<float*>(hw::dynamic_shared_memory());
  const auto [qw1, qw2, qg] = load_query_weights(p, b, t, smem);
  hw::BlockSum block_sum(smem + 2 * kR * H + H);
  const int64_t head_stride = static_cast<int64_t>(TT) * TT;
  const int64_t base = static_cast<int64_t>(b) * H * head_stride + static_cast<int64_t>(t) * TT;
  const T* a = static_cast<const T*>(p.a) + base;
  const T* dy_p = static_cast<const T*>(p.grad) + base;
  T* da = static_cast<T*>(p.out) + base;
  // Per-thread partials: [0, H) dGq, [H, 3H) dW1q[r][n], [3H, 5H) dW2q[r][m].
  float part[5 * kMaxHeads];
  for (int i = 0; i < 5 * H; ++i) part[i] = 0.f;
  for (int s = threadIdx.x; s < TT; s += blockDim.x) {
    const float* kw1 = p.w1 + w_off(p, b, s, p.ck);
    const float* kw2 = p.w2 + w_off(p, b, s, p.ck);
    const float* kg = p.g + g_off(p, b, s, p.ck);
    float x[kMaxHeads], dy[kMaxHeads];
    for (int n = 0; n < H; ++n) {
      x[n] = static_cast<float>(a[n * head_stride + s]);
      dy[n] = static_cast<float>(dy_p[n * head_stride + s]);
    }
    for (int g0 = 0; g0 < H; g0 += p.hg) {
      float pq[kR] = {0.f, 0.f}, dpq[kR] = {0.f, 0.f}, dpk[kR] = {0.f, 0.f};
      for (int n = g0; n < g0 + p.hg; ++n)
        for (int r = 0; r < kR; ++r) {
          pq[r] += qw1[r * H + n] * x[n];
          dpq[r] += qw2[r * H + n] * dy[n];
          dpk[r] += kw2[r * H + n] * dy[n];
        }
      for (int n = g0; n < g0 + p.hg; ++n) {
        float d = dy[n] * (1.f + qg[n] + kg[n]);
        for (int r = 0; r < kR; ++r) {
          d += qw1[r * H + n] * dpq[r] + kw1[r * H + n] * dpk[r];
          part[H + r * H + n] += x[n] * dpq[r];
          part[3 * H + r * H + n] += pq[r] * dy[n];
        }
        part[n] += x[n] * dy[n];
        da[n * head_stride + s] = static_cast<T>(d);
      }
    }
  }
  float* dg = p.dg + g_off(p, b, t, p.cq);
  float* dw1 = p.dw1 + w_off(p, b, t, p.cq);
  float* dw2 = p.dw2 + w_off(p, b, t, p.cq);
  for (int i = 0; i < 5 * H; ++i) {
    const float total = block_sum(part[i]);
    if (threadIdx.x == 0) {
      if (i < H) dg[i] = total;
      else if (i < 3 * H) dw1[i - H] = total;
      else dw2[i - 3 * H] = total;
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kKeyColumns) dcmha_compose_bwd_key(const ComposeParams p) {
  const int s = blockIdx.x * kKeyColumns + threadIdx.x, b = blockIdx.y, H = p.H, TT = p.T;
  if (s >= TT) return;
  const float* kw1 = p.w1 + w_off(p, b, s, p.ck);
  const float* kw2 = p.w2 + w_off(p, b, s, p.ck);
  const int64_t head_stride = static_cast<int64_t>(TT) * TT;
  float part[5 * kMaxHeads];
  for (int i = 0; i < 5 * H; ++i) part[i] = 0.f;
  for (int t = 0; t < TT; ++t) {
    const int64_t base = static_cast<int64_t>(b) * H * head_stride + static_cast<int64_t>(t) * TT + s;
    const T* a = static_cast<const T*>(p.a) + base;
    const T* dy_p = static_cast<const T*>(p.grad) + base;
    float x[kMaxHeads], dy[kMaxHeads];
    for (int n = 0; n < H; ++n) {
      x[n] = static_cast<float>(a[n * head_stride]);
      dy[n] = static_cast<float>(dy_p[n * head_stride]);
    }
    for (int g0 = 0; g0 < H; g0 += p.hg) {
      float pk[kR] = {0.f, 0.f}, dpk[kR] = {0.f, 0.f};
      for (int n = g0; n < g0 + p.hg; ++n)
        for (int r = 0; r < kR; ++r) {
          pk[r] += kw1[r * H + n] * x[n];
          dpk[r] += kw2[r * H + n] * dy[n];
        }
      for (int n = g0; n < g0 + p.hg; ++n) {
        part[n] += x[n] * dy[n];
        for (int r = 0; r < kR; ++r) {
          part[H + r * H + n] += x[n] * dpk[r];
          part[3 * H + r * H + n] += pk[r] * dy[n];
        }
      }
    }
  }
  float* dg = p.dg + g_off(p, b, s, p.ck);
  float* dw1 = p.dw1 + w_off(p, b, s, p.ck);
  float* dw2 = p.dw2 + w_off(p, b, s, p.ck);
  for (int i = 0; i < H; ++i) dg[i] = part[i];
  for (int i = 0; i < 2 * H; ++i) {
    dw1[i] = part[H + i];
    dw2[i] = part[3 * H + i];
  }
}

}  // namespace dcmha
}  // namespace headwise
