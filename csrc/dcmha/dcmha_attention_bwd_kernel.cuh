// DCMHA fused attention backward: device code (SPEC section 5). Compiled by nvcc for the
// GPU and by the host compiler against the SIMT emulator.
//
// Notation per (t, s), all heads: L = scale q k^T, L' = compose_pre(L), P = exp(L' - M) / Z
// (the forward's row statistics), P' = compose_post(P), O = P' v. Given dO:
//   dP' = dO v^T,  dP = compose_post^T(dP'),  D[t] = sum_s P dP,
//   dL' = P (dP - D),  dL = compose_pre^T(dL'),  dq = scale dL k,  dk = scale dL^T q,
//   dv = P'^T dO; the weight grads of each compose slot as in dcmha_kernel.cuh.
// Kernels (no atomics; every sum has a fixed order):
//   dcmha_attention_bwd_query  block per (t, b), threads over the keys of the row's band:
//     pass A: D and the slot-2 (post, query) grads; pass B, in chunks of blockDim keys:
//     dL into smem, then each thread accumulates its own dq elements; slot-0 grads.
//     Per-thread weight-grad partials are reduced by hw::BlockSum.
//   dcmha_attention_bwd_key  block per (s, b), threads over the queries reading key s:
//     dv, dk (chunked through smem like dq) and the slot-1 / slot-3 (key) grads.
#pragma once

#include "../common/block_reduce.cuh"
#include "../common/simt_portability.h"
#include "dcmha_attention_kernel.cuh"

#include <cstdint>

namespace headwise {
namespace dcmha {

struct AttnBwdParams {
  AttnParams f;       // q, k, v, weights, geometry (f.out, f.stats unused)
  const float* stats; // [2, B, H, T]: the forward's M, then 1 / Z (0 where Z = 0; the launcher's)
  const void* dout;   // [B, H, T, dv]
  float* D;           // [B, H, T] written by the query kernel, read by the key kernel
  void* dq;           // [B, H, T, dh]
  void* dk;
  void* dv;
  float* dw1;         // [B, T, 4, R, H] fp32 (every element written)
  float* dw2;
  float* dg;          // [B, T, 4, H]
};

// Backward of compose_heads for one (t, s): dx (may be null) and the weight-grad partials
// acc (5H: [0,H) dG, [H,3H) dW1[r][n], [3H,5H) dW2[r][m]) of the query side (qacc) and
// of the key side (kacc); either may be null.
__device__ __forceinline__ void compose_heads_bwd(const float* x, const float* dy, float* dx, int H, int hg,
                                                  const float* qw1, const float* qw2, const float* qg,
                                                  const float* kw1, const float* kw2, const float* kg, float* qacc,
                                                  float* kacc) {
  for (int g0 = 0; g0 < H; g0 += hg) {
    float pq[kR] = {0.f, 0.f}, pk[kR] = {0.f, 0.f}, dpq[kR] = {0.f, 0.f}, dpk[kR] = {0.f, 0.f};
    for (int n = g0; n < g0 + hg; ++n)
      for (int r = 0; r < kR; ++r) {
        pq[r] += qw1[r * H + n] * x[n];
        pk[r] += kw1[r * H + n] * x[n];
        dpq[r] += qw2[r * H + n] * dy[n];
        dpk[r] += kw2[r * H + n] * dy[n];
      }
    for (int n = g0; n < g0 + hg; ++n) {
      if (dx != nullptr) {
        float d = dy[n] * (1.f + qg[n] + kg[n]);
        for (int r = 0; r < kR; ++r) d += qw1[r * H + n] * dpq[r] + kw1[r * H + n] * dpk[r];
        dx[n] = d;
      }
      if (qacc != nullptr) {
        qacc[n] += x[n] * dy[n];
        for (int r = 0; r < kR; ++r) {
          qacc[H + r * H + n] += x[n] * dpq[r];
          qacc[3 * H + r * H + n] += pq[r] * dy[n];
        }
      }
      if (kacc != nullptr) {
        kacc[n] += x[n] * dy[n];
        for (int r = 0; r < kR; ++r) {
          kacc[H + r * H + n] += x[n] * dpk[r];
          kacc[3 * H + r * H + n] += pk[r] * dy[n];
        }
      }
    }
  }
}

// Stores the 5H weight-grad values of slot c at position x (row t or column s).
__device__ __forceinline__ void store_slot_grads(const AttnBwdParams& p, int b, int x, int c, int i, float value) {
  const int H = p.f.H;
  const int64_t wo = ((static_cast<int64_t>(b) * p.f.T + x) * 4 + c) * kR * H;
  const int64_t go = ((static_cast<int64_t>(b) * p.f.T + x) * 4 + c) * H;
  if (i < H) p.dg[go + i] = value;
  else if (i < 3 * H) p.dw1[wo + i - H] = value;
  else p.dw2[wo + i - 3 * H] = value;
}

__device__ __forceinline__ void slot_weights(const AttnParams& f, int b, int x, int c, const float*& w1,
                                             const float*& w2, const float*& g) {
  const int64_t wo = ((static_cast<int64_t>(b) * f.T + x) * 4 + c) * kR * f.H;
  w1 = f.w1 + wo;
  w2 = f.w2 + wo;
  g = f.g + ((static_cast<int64_t>(b) * f.T + x) * 4 + c) * f.H;
}

// acc[n, e] += sum_{j < nrows} chunk[n][j] * rows[(row + n T + r0 + j) d + e] for the block's
// share of (n, e) in [H) x [d): a [H][blockDim] chunk of per-head coefficients times the
// matching rows of a head-major [H, T, d] operand (k for dq; dout for dv; q for dk).
template <typename T>
__device__ __forceinline__ void accumulate_chunk_rows(float* acc, const float* chunk, const T* rows, int64_t row,
                                                      int TT, int r0, int nrows, int H, int d) {
  const int tid = threadIdx.x, nthreads = blockDim.x;
  for (int i = tid; i < H * d; i += nthreads) {
    const int n = i / d, e = i % d;
    const T* r = rows + (row + static_cast<int64_t>(n) * TT + r0) * d + e;
    float a = acc[i];
    for (int j = 0; j < nrows; ++j) a += chunk[n * nthreads + j] * static_cast<float>(r[static_cast<int64_t>(j) * d]);
    acc[i] = a;
  }
}

// Floats of dynamic smem of either kernel: two head rows [H max(dh, dv)] x 2, weights
// 2 x 5H, statistics 3H, two chunk buffers [H blockDim], two accumulators [H dh], [H dv],
// BlockSum scratch 64.
__host__ __device__ inline int64_t attn_bwd_smem_floats(int H, int dh, int dv, int threads) {
  const int64_t w = dh > dv ? dh : dv;
  return 4 * static_cast<int64_t>(H) * w + 10 * H + 3 * H + 2 * static_cast<int64_t>(H) * threads +
         static_cast<int64_t>(H) * (dh + dv) + 64;
}

template <typename T>
__global__ void __launch_bounds__(kAttnThreads) dcmha_attention_bwd_query(const AttnBwdParams p) {
  const AttnParams& f = p.f;
  const int t = blockIdx.x, b = blockIdx.y, H = f.H, TT = f.T, dh = f.dh, dv = f.dv, hg = f.hg;
  const int tid = threadIdx.x, nthreads = blockDim.x;
  float* smem = reinterpret_cast<float*>(hw::dynamic_shared_memory());
  const int wmax = dh > dv ? dh : dv;
  float* qs = smem;                      // [H][dh] scaled q row t
  float* dos = qs + H * wmax;            // [H][dv] dO row t
  float* wq = dos + H * wmax + 2 * H * wmax;  // slot 0 then slot 2: w1 [RH], w2 [RH], g [H]
  float* stat = wq + 10 * H;             // M [H], 1/Z [H], D [H]
  float* chunk = stat + 3 * H;           // [H][nthreads]
  float* dqs = chunk + 2 * H * nthreads; // [H][dh]
  hw::BlockSum block_sum(dqs + H * (dh + dv));
  const int64_t row = static_cast<int64_t>(b) * H * TT;
  const T* q = static_cast<const T*>(f.q);
  const T* k = static_cast<const T*>(f.k);
  const T* v = static_cast<const T*>(f.v);
  const T* dout = static_cast<const T*>(p.dout);
  for (int i = tid; i < H * dh; i += nthreads) {
    const int n = i / dh, e = i % dh;
    qs[i] = static_cast<float>(q[(row + static_cast<int64_t>(n) * TT + t) * dh + e]) * f.scale;
    dqs[i] = 0.f;
  }
  for (int i = tid; i < H * dv; i += nthreads) {
    const int n = i / dv, e = i % dv;
    dos[i] = static_cast<float>(dout[(row + static_cast<int64_t>(n) * TT + t) * dv + e]);
  }
  for (int side = 0; side < 2; ++side) {
    const float *w1, *w2, *g;
    slot_weights(f, b, t, 2 * side, w1, w2, g);
    float* dst = wq + side * 5 * H;
    for (int i = tid; i < kR * H; i += nthreads) {
      dst[i] = w1[i];
      dst[kR * H + i] = w2[i];
    }
    for (int i = tid; i < H; i += nthreads) dst[2 * kR * H + i] = g[i];
  }
  for (int n = tid; n < H; n += nthreads) {
    const int64_t so = (static_cast<int64_t>(b) * H + n) * TT + t;
    stat[n] = p.stats[so];
    stat[H + n] = p.stats[static_cast<int64_t>(f.B) * H * TT + so];
  }
  __syncthreads();
  const float* pre = wq;
  const float* post = wq + 5 * H;
  const int s_end = f.causal ? t + 1 : TT;
  const int s_begin = f.window > 0 ? (t - f.window + 1 > 0 ? t - f.window + 1 : 0) : 0;

  // Everything up to dP for key s: x = L, pr = P, dpp = dP', dp = dP; post query grads
  // into acc when given.
  auto to_dP = [&](int s, float* x, float* pr, float* dpp, float* dp, float* acc) {
    float y[kMaxHeads];
    for (int n = 0; n < H; ++n) {
      const T* kr = k + (row + static_cast<int64_t>(n) * TT + s) * dh;
      const T* vr = v + (row + static_cast<int64_t>(n) * TT + s) * dv;
      const float* qr = qs + n * dh;
      const float* dr = dos + n * dv;
      float a = 0.f, c = 0.f;
      for (int e = 0; e < dh; ++e) a += qr[e] * static_cast<float>(kr[e]);
      for (int e = 0; e < dv; ++e) c += dr[e] * static_cast<float>(vr[e]);
      x[n] = a;
      dpp[n] = c;
    }
    const float *kw1, *kw2, *kg;
    slot_weights(f, b, s, 1, kw1, kw2, kg);
    compose_heads(x, y, H, hg, pre, pre + kR * H, pre + 2 * kR * H, kw1, kw2, kg);
    for (int n = 0; n < H; ++n) pr[n] = expf(y[n] - stat[n]) * stat[H + n];
    slot_weights(f, b, s, 3, kw1, kw2, kg);
    compose_heads_bwd(pr, dpp, dp, H, hg, post, post + kR * H, post + 2 * kR * H, kw1, kw2, kg, acc, nullptr);
  };

  float acc[5 * kMaxHeads];
  // Pass A: D and the slot-2 grads.
  float dsum[kMaxHeads];
  for (int i = 0; i < 5 * H; ++i) acc[i] = 0.f;
  for (int n = 0; n < H; ++n) dsum[n] = 0.f;
  for (int s = s_begin + tid; s < s_end; s += nthreads) {
    float x[kMaxHeads], pr[kMaxHeads], dpp[kMaxHeads], dp[kMaxHeads];
    to_dP(s, x, pr, dpp, dp, acc);
    for (int n = 0; n < H; ++n) dsum[n] += pr[n] * dp[n];
  }
  for (int n = 0; n < H; ++n) {
    const float total = block_sum(dsum[n]);
    if (tid == 0) {
      stat[2 * H + n] = total;
      p.D[(static_cast<int64_t>(b) * H + n) * TT + t] = total;
    }
  }
  for (int i = 0; i < 5 * H; ++i) {
    const float total = block_sum(acc[i]);
    if (tid == 0) store_slot_grads(p, b, t, 2, i, total);
  }
  __syncthreads();  // stat[2H..] visible
  // Pass B: dq and the slot-0 grads.
  for (int i = 0; i < 5 * H; ++i) acc[i] = 0.f;
  for (int s0 = s_begin; s0 < s_end; s0 += nthreads) {
    const int s = s0 + tid;
    if (s < s_end) {
      float x[kMaxHeads], pr[kMaxHeads], dpp[kMaxHeads], dp[kMaxHeads], dl[kMaxHeads];
      to_dP(s, x, pr, dpp, dp, nullptr);
      for (int n = 0; n < H; ++n) dp[n] = pr[n] * (dp[n] - stat[2 * H + n]);
      const float *kw1, *kw2, *kg;
      slot_weights(f, b, s, 1, kw1, kw2, kg);
      compose_heads_bwd(x, dp, dl, H, hg, pre, pre + kR * H, pre + 2 * kR * H, kw1, kw2, kg, acc, nullptr);
      for (int n = 0; n < H; ++n) chunk[n * nthreads + tid] = dl[n] * f.scale;
    } else {
      for (int n = 0; n < H; ++n) chunk[n * nthreads + tid] = 0.f;
    }
    __syncthreads();
    const int nk = s_end - s0 < nthreads ? s_end - s0 : nthreads;
    accumulate_chunk_rows(dqs, chunk, k, row, TT, s0, nk, H, dh);
    __syncthreads();
  }
  for (int i = 0; i < 5 * H; ++i) {
    const float total = block_sum(acc[i]);
    if (tid == 0) store_slot_grads(p, b, t, 0, i, total);
  }
  T* dq = static_cast<T*>(p.dq);
  for (int i = tid; i < H * dh; i += nthreads) {
    const int n = i / dh, e = i % dh;
    dq[(row + static_cast<int64_t>(n) * TT + t) * dh + e] = static_cast<T>(dqs[i]);
  }
}

// Bounds (threads, 1 CTA): at the default ptxas held the fp32 kernel to 64 registers on sm_90
// and spilled 24 bytes; with them it takes 123-149 (sm_80 to sm_100) and spills nothing. The
// trade: at most 3-4 CTAs per SM where 64 registers allowed 8; its shared memory
// (attn_bwd_smem_floats: 130 KiB at H = 32, dh = dv = 128) allows 1 there anyway.
template <typename T>
__global__ void __launch_bounds__(kAttnThreads, 1) dcmha_attention_bwd_key(const AttnBwdParams p) {
  const AttnParams& f = p.f;
  const int s = blockIdx.x, b = blockIdx.y, H = f.H, TT = f.T, dh = f.dh, dv = f.dv, hg = f.hg;
  const int tid = threadIdx.x, nthreads = blockDim.x;
  float* smem = reinterpret_cast<float*>(hw::dynamic_shared_memory());
  const int wmax = dh > dv ? dh : dv;
  float* ks = smem;                     // [H][dh] k row s (unscaled)
  float* vs = ks + H * wmax;            // [H][dv] v row s
  float* wk = vs + H * wmax + 2 * H * wmax;  // key weights of slot 1 then slot 3
  float* chunk_p = wk + 10 * H + 3 * H; // [H][nthreads] P'
  float* chunk_l = chunk_p + H * nthreads;  // [H][nthreads] scale dL
  float* dks = chunk_l + H * nthreads;  // [H][dh]
  float* dvs = dks + H * dh;            // [H][dv]
  hw::BlockSum block_sum(dvs + H * dv);
  const int64_t row = static_cast<int64_t>(b) * H * TT;
  const T* q = static_cast<const T*>(f.q);
  const T* k = static_cast<const T*>(f.k);
  const T* v = static_cast<const T*>(f.v);
  const T* dout = static_cast<const T*>(p.dout);
  for (int i = tid; i < H * dh; i += nthreads) {
    const int n = i / dh, e = i % dh;
    ks[i] = static_cast<float>(k[(row + static_cast<int64_t>(n) * TT + s) * dh + e]);
    dks[i] = 0.f;
  }
  for (int i = tid; i < H * dv; i += nthreads) {
    const int n = i / dv, e = i % dv;
    vs[i] = static_cast<float>(v[(row + static_cast<int64_t>(n) * TT + s) * dv + e]);
    dvs[i] = 0.f;
  }
  for (int side = 0; side < 2; ++side) {
    const float *w1, *w2, *g;
    slot_weights(f, b, s, 2 * side + 1, w1, w2, g);
    float* dst = wk + side * 5 * H;
    for (int i = tid; i < kR * H; i += nthreads) {
      dst[i] = w1[i];
      dst[kR * H + i] = w2[i];
    }
    for (int i = tid; i < H; i += nthreads) dst[2 * kR * H + i] = g[i];
  }
  __syncthreads();
  const float* kpre = wk;
  const float* kpost = wk + 5 * H;
  // Queries t that read key s: causal t >= s; window s > t - W, i.e. t < s + W.
  const int t_begin = f.causal ? s : 0;
  const int t_end = f.window > 0 ? (s + f.window < TT ? s + f.window : TT) : TT;

  float acc_pre[5 * kMaxHeads], acc_post[5 * kMaxHeads];
  for (int i = 0; i < 5 * H; ++i) {
    acc_pre[i] = 0.f;
    acc_post[i] = 0.f;
  }
  for (int t0 = t_begin; t0 < t_end; t0 += nthreads) {
    const int t = t0 + tid;
    if (t < t_end) {
      float x[kMaxHeads], y[kMaxHeads], pr[kMaxHeads], dpp[kMaxHeads], dp[kMaxHeads];
      for (int n = 0; n < H; ++n) {
        const T* qr = q + (row + static_cast<int64_t>(n) * TT + t) * dh;
        const T* dr = dout + (row + static_cast<int64_t>(n) * TT + t) * dv;
        const float* kr = ks + n * dh;
        const float* vr = vs + n * dv;
        float a = 0.f, c = 0.f;
        for (int e = 0; e < dh; ++e) a += (static_cast<float>(qr[e]) * f.scale) * kr[e];
        for (int e = 0; e < dv; ++e) c += static_cast<float>(dr[e]) * vr[e];
        x[n] = a;
        dpp[n] = c;
      }
      const float *qw1, *qw2, *qg;
      slot_weights(f, b, t, 0, qw1, qw2, qg);
      compose_heads(x, y, H, hg, qw1, qw2, qg, kpre, kpre + kR * H, kpre + 2 * kR * H);
      for (int n = 0; n < H; ++n) {
        const int64_t so = (static_cast<int64_t>(b) * H + n) * TT + t;
        pr[n] = expf(y[n] - p.stats[so]) * p.stats[static_cast<int64_t>(f.B) * H * TT + so];
      }
      slot_weights(f, b, t, 2, qw1, qw2, qg);
      compose_heads_bwd(pr, dpp, dp, H, hg, qw1, qw2, qg, kpost, kpost + kR * H, kpost + 2 * kR * H, nullptr,
                        acc_post);
      compose_heads(pr, y, H, hg, qw1, qw2, qg, kpost, kpost + kR * H, kpost + 2 * kR * H);  // P'
      for (int n = 0; n < H; ++n) {
        chunk_p[n * nthreads + tid] = y[n];
        dp[n] = pr[n] * (dp[n] - p.D[(static_cast<int64_t>(b) * H + n) * TT + t]);
      }
      slot_weights(f, b, t, 0, qw1, qw2, qg);
      float dl[kMaxHeads];
      compose_heads_bwd(x, dp, dl, H, hg, qw1, qw2, qg, kpre, kpre + kR * H, kpre + 2 * kR * H, nullptr, acc_pre);
      for (int n = 0; n < H; ++n) chunk_l[n * nthreads + tid] = dl[n] * f.scale;
    } else {
      for (int n = 0; n < H; ++n) {
        chunk_p[n * nthreads + tid] = 0.f;
        chunk_l[n * nthreads + tid] = 0.f;
      }
    }
    __syncthreads();
    const int nq = t_end - t0 < nthreads ? t_end - t0 : nthreads;
    accumulate_chunk_rows(dvs, chunk_p, dout, row, TT, t0, nq, H, dv);
    accumulate_chunk_rows(dks, chunk_l, q, row, TT, t0, nq, H, dh);
    __syncthreads();
  }
  for (int i = 0; i < 5 * H; ++i) {
    const float tp = block_sum(acc_pre[i]);
    const float tq = block_sum(acc_post[i]);
    if (tid == 0) {
      store_slot_grads(p, b, s, 1, i, tp);
      store_slot_grads(p, b, s, 3, i, tq);
    }
  }
  T* dk = static_cast<T*>(p.dk);
  T* dvo = static_cast<T*>(p.dv);
  for (int i = tid; i < H * dh; i += nthreads) {
    const int n = i / dh, e = i % dh;
    dk[(row + static_cast<int64_t>(n) * TT + s) * dh + e] = static_cast<T>(dks[i]);
  }
  for (int i = tid; i < H * dv; i += nthreads) {
    const int n = i / dv, e = i % dv;
    dvo[(row + static_cast<int64_t>(n) * TT + s) * dv + e] = static_cast<T>(dvs[i]);
  }
}

}  // namespace dcmha
}  // namespace headwise
