// CPU building blocks of DCMHA: compose of a tile [H][rows][cols] of per-(t, s) head
// vectors, forward and backward, all loops over the contiguous key axis j so that the
// compiler vectorizes them. Used by the materialized compose op (tiles read in place
// from a [B, H, T, S] tensor) and by the fused attention (tiles in scratch buffers).
//
// For row i (query t = t0 + i) and column j (key s = s0 + j), within each head group:
//   pq[r]  = sum_n W1[t,cq,r,n] X[n],   pk[r] = sum_n W1[s,ck,r,n] X[n]
//   Y[m]   = X[m] (1 + G[t,cq,m] + G[s,ck,m]) + sum_r W2[t,cq,r,m] pq[r] + W2[s,ck,r,m] pk[r]
// Backward, given dY:
//   dpq[r] = sum_m W2[t,cq,r,m] dY[m],  dpk[r] = sum_m W2[s,ck,r,m] dY[m]
//   dX[n]  = dY[n] (1 + Gq[n] + Gk[n]) + sum_r W1q[r,n] dpq[r] + W1k[r,n] dpk[r]
//   dGq[m] += X[m] dY[m];  dW2q[r,m] += pq[r] dY[m];  dW1q[r,n] += X[n] dpq[r]   (over s)
//   dGk, dW2k, dW1k likewise at s                                                (over t)
#pragma once

#include "../common/cpu_simd.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace headwise {
namespace dcmha {
namespace cpu {

constexpr int64_t R = 2;

// The weights of one batch row b for the slots (cq, ck). Query side: row-major
// w1 [T, 4, R, H] at the batch row. Key side: transposed copies w1t/w2t [4, R, H, T],
// gt [4, H, T] so that loops over s are contiguous.
template <typename A>
struct SlotWeights {
  const A* w1;  // [T, 4, R, H]
  const A* w2;
  const A* g;   // [T, 4, H]
  const A* w1t; // [4, R, H, T]
  const A* w2t;
  const A* gt;  // [4, H, T]
  int64_t T, H, groups;
  int cq, ck;
  const A* qw1(int64_t t) const { return w1 + (t * 4 + cq) * R * H; }
  const A* qw2(int64_t t) const { return w2 + (t * 4 + cq) * R * H; }
  const A* qg(int64_t t) const { return g + (t * 4 + cq) * H; }
  // key side, [r][n][s]: element (r, n, s) at kw1()[(r * H + n) * T + s]
  const A* kw1() const { return w1t + ck * R * H * T; }
  const A* kw2() const { return w2t + ck * R * H * T; }
  const A* kg() const { return gt + ck * H * T; }
};

// A tile view: element (n, i, j) at p[n * hs + i * rs + j].
template <typename T>
struct Tile {
  T* p;
  int64_t hs, rs;
  T* at(int64_t n, int64_t i) const { return p + n * hs + i * rs; }
};

// One composed row, j < nk: out[j] = x[j] (base + kg[j]) + a0 p[j] + a1 p[nk + j]
// + k0[j] q[j] + k1[j] q[nk + j] — the forward's output row of head m (x = X[m], base =
// 1 + G_q[m], kg = G_k[m], a = W2_q[:, m], p = the query-side rank projections, k = W2_k
// [:, m], q = the key-side ones) and, with the roles transposed, the backward's dX row
// (x = dY[n], a = W1_q[:, n], k = W1_k[:, n], p and q the projected gradients). out may
// alias x (each j is read before it is written).
template <typename A>
HW_CPU_INLINE void compose_row(const A* x, A base, const A* kg, A a0, A a1, const A* p, const A* k0, const A* k1,
                               const A* q, A* out, int64_t nk) {
  for (int64_t j = 0; j < nk; ++j)
    out[j] = x[j] * (base + kg[j]) + a0 * p[j] + a1 * p[nk + j] + k0[j] * q[j] + k1[j] * q[nk + j];
}

// Y = compose(X) over rows [0, nq) (t = t0 + i), cols [0, nk) (s = s0 + j). Y may alias X.
// scratch: 2 * R * nk elements.
template <typename A>
HW_CPU_INLINE void compose_fwd(const SlotWeights<A>& w, Tile<const A> X, Tile<A> Y, int64_t t0, int64_t nq, int64_t s0,
                 int64_t nk, A* scratch) {
  const int64_t H = w.H, T = w.T, hg = H / w.groups;
  A* pq = scratch;           // [R][nk]
  A* pk = scratch + R * nk;  // [R][nk]
  const A* kw1 = w.kw1() + s0;
  const A* kw2 = w.kw2() + s0;
  const A* kg = w.kg() + s0;
  for (int64_t i = 0; i < nq; ++i) {
    const A* qw1 = w.qw1(t0 + i);
    const A* qw2 = w.qw2(t0 + i);
    const A* qg = w.qg(t0 + i);
    for (int64_t g0 = 0; g0 < H; g0 += hg) {
      std::fill(pq, pq + 2 * R * nk, A(0));
      for (int64_t n = g0; n < g0 + hg; ++n) {
        const A* x = X.at(n, i);
        for (int64_t r = 0; r < R; ++r) {
          const A a = qw1[r * H + n];
          const A* kr = kw1 + (r * H + n) * T;
          A* pqr = pq + r * nk;
          A* pkr = pk + r * nk;
          for (int64_t j = 0; j < nk; ++j) {
            pqr[j] += a * x[j];
            pkr[j] += kr[j] * x[j];
          }
        }
      }
      for (int64_t m = g0; m < g0 + hg; ++m)
        compose_row(X.at(m, i), A(1) + qg[m], kg + m * T, qw2[m], qw2[H + m], pq, kw2 + m * T, kw2 + (H + m) * T,
                    pk, Y.at(m, i), nk);
    }
  }
}

// Backward of compose_fwd. dX (may be null; may alias dY: each head's weight sums read
// dY before its dX is written) receives the input gradient.
// Query-side weight grads are added to dq_w1/dq_w2 [nq rows of stride 4RH at slot cq]
// and dq_g (null: skipped); key-side grads to dk_w1/dk_w2 [R][H][ks] and dk_g [H][ks]
// at column j (ks: their row stride; null: skipped). scratch: 4 * R * nk elements.
template <typename A>
struct ComposeGrads {
  A* q_w1 = nullptr;  // row t: q_w1 + (t - t0) * q_stride + r * H + n
  A* q_w2 = nullptr;
  A* q_g = nullptr;   // row t: q_g + (t - t0) * q_gstride + m
  int64_t q_stride = 0, q_gstride = 0;
  A* k_w1 = nullptr;  // (r, n, j): k_w1[(r * H + n) * ks + j]
  A* k_w2 = nullptr;
  A* k_g = nullptr;   // (m, j): k_g[m * ks + j]
  int64_t ks = 0;
};

template <typename A>
HW_CPU_INLINE void compose_bwd(const SlotWeights<A>& w, Tile<const A> X, Tile<const A> dY, Tile<A> dX, int64_t t0, int64_t nq,
                 int64_t s0, int64_t nk, const ComposeGrads<A>& gr, A* scratch) {
  const int64_t H = w.H, T = w.T, hg = H / w.groups;
  A* pq = scratch;
  A* pk = scratch + R * nk;
  A* dpq = scratch + 2 * R * nk;
  A* dpk = scratch + 3 * R * nk;
  const A* kw1 = w.kw1() + s0;
  const A* kw2 = w.kw2() + s0;
  const A* kg = w.kg() + s0;
  const bool need_p = gr.q_w2 != nullptr || gr.k_w2 != nullptr;
  for (int64_t i = 0; i < nq; ++i) {
    const A* qw1 = w.qw1(t0 + i);
    const A* qw2 = w.qw2(t0 + i);
    const A* qg = w.qg(t0 + i);
    for (int64_t g0 = 0; g0 < H; g0 += hg) {
      std::fill(scratch, scratch + 4 * R * nk, A(0));
      for (int64_t n = g0; n < g0 + hg; ++n) {
        const A* x = X.at(n, i);
        const A* dy = dY.at(n, i);
        for (int64_t r = 0; r < R; ++r) {
          const A a1 = qw1[r * H + n], a2 = qw2[r * H + n];
          const A* k1 = kw1 + (r * H + n) * T;
          const A* k2 = kw2 + (r * H + n) * T;
          A* pqr = pq + r * nk;
          A* pkr = pk + r * nk;
          A* dpqr = dpq + r * nk;
          A* dpkr = dpk + r * nk;
          if (need_p) {
            for (int64_t j = 0; j < nk; ++j) {
              pqr[j] += a1 * x[j];
              pkr[j] += k1[j] * x[j];
            }
          }
          for (int64_t j = 0; j < nk; ++j) {
            dpqr[j] += a2 * dy[j];
            dpkr[j] += k2[j] * dy[j];
          }
        }
      }
      for (int64_t n = g0; n < g0 + hg; ++n) {
        const A* x = X.at(n, i);
        const A* dy = dY.at(n, i);
        if (gr.q_w1 != nullptr) {
          A* qrow1 = gr.q_w1 + i * gr.q_stride;
          A* qrow2 = gr.q_w2 + i * gr.q_stride;
          // Fixed-order vector sums over j (the order depends on nk alone).
          A sum[5];
          const A* dpq1 = dpq + nk;
          const A* pq1 = pq + nk;
          ::headwise::cpu::sums<5, A>(
              nk,
              [&](auto ld, auto (&t)[5]) {
                const auto xv = ld(x), dyv = ld(dy);
                t[0] = xv * dyv;
                t[1] = xv * ld(dpq);
                t[2] = xv * ld(dpq1);
                t[3] = ld(pq) * dyv;
                t[4] = ld(pq1) * dyv;
              },
              sum);
          gr.q_g[i * gr.q_gstride + n] += sum[0];
          qrow1[n] += sum[1];
          qrow1[H + n] += sum[2];
          qrow2[n] += sum[3];
          qrow2[H + n] += sum[4];
        }
        if (gr.k_w1 != nullptr) {
          A* kgn = gr.k_g + n * gr.ks;
          A* k10 = gr.k_w1 + n * gr.ks;
          A* k11 = gr.k_w1 + (H + n) * gr.ks;
          A* k20 = gr.k_w2 + n * gr.ks;
          A* k21 = gr.k_w2 + (H + n) * gr.ks;
          for (int64_t j = 0; j < nk; ++j) {
            kgn[j] += x[j] * dy[j];
            k10[j] += x[j] * dpk[j];
            k11[j] += x[j] * dpk[nk + j];
            k20[j] += pk[j] * dy[j];
            k21[j] += pk[nk + j] * dy[j];
          }
        }
        if (dX.p != nullptr)
          compose_row(dy, A(1) + qg[n], kg + n * T, qw1[n], qw1[H + n], dpq, kw1 + n * T, kw1 + (H + n) * T, dpk,
                      dX.at(n, i), nk);
      }
    }
  }
}

// out[j] = exp(x[j] - sub) for j < n, 0 where x[j] = -inf (a masked logit). x - sub <= 0
// (sub is the row max). float: a branch-free Cephes-style exp that vectorizes (about
// 2 ulp); double: std::exp (the gradcheck precision).
template <typename A>
HW_CPU_INLINE void exp_row(const A* x, A sub, A* out, int64_t n) {
  if constexpr (std::is_same_v<A, float>) {
    using V = ::headwise::cpu::vec_t<float>;
    using I = int32_t __attribute__((vector_size(64)));
    constexpr int L = ::headwise::cpu::Simd<float>::lanes;
    auto vexp = [sub](V xv) {
      const V d = xv - sub;
      V xc = d < -87.0f ? V{} - 87.0f : d;
      xc = xc > 88.0f ? V{} + 88.0f : xc;
      // Round to nearest by the 1.5 * 2^23 trick (exact: no fast-math in this build).
      const V k = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
      V r = xc - k * 0.693359375f;
      r = r - k * -2.12194440e-4f;
      V p = V{} + 1.9875691500E-4f;
      p = p * r + 1.3981999507E-3f;
      p = p * r + 8.3334519073E-3f;
      p = p * r + 4.1665795894E-2f;
      p = p * r + 1.6666665459E-1f;
      p = p * r + 5.0000001201E-1f;
      p = p * r * r + r + 1.0f;
      const I bits = (__builtin_convertvector(k, I) + 127) << 23;
      V scale;
      std::memcpy(&scale, &bits, sizeof(scale));
      const V y = p * scale;
      return d < -87.0f ? V{} : y;
    };
    int64_t j = 0;
    for (; j + L <= n; j += L) {
      const V y = vexp(::headwise::cpu::vload(x + j));
      std::memcpy(out + j, &y, sizeof(y));
    }
    if (j < n) {
      float tmp[L];
      for (int k = 0; k < L; ++k) tmp[k] = j + k < n ? x[j + k] : -std::numeric_limits<float>::infinity();
      const V y = vexp(::headwise::cpu::vload(tmp));
      std::memcpy(tmp, &y, sizeof(y));
      for (int k = 0; j + k < n; ++k) out[j + k] = tmp[k];
    }
  } else {
    for (int64_t j = 0; j < n; ++j) {
      const A d = x[j] - sub;
      out[j] = x[j] == -std::numeric_limits<A>::infinity() ? A(0) : std::exp(d);
    }
  }
}

// out[e] += sum_{j < n} c[j * cs] * rows[j * rs + e] for e < d, summed over j in order,
// with the output held in vector registers across j (blocks of 4 vectors).
template <typename A>
HW_CPU_INLINE void accumulate_rows(A* out, const A* c, int64_t cs, int64_t n, const A* rows, int64_t rs, int64_t d) {
  using V = ::headwise::cpu::vec_t<A>;
  constexpr int L = ::headwise::cpu::Simd<A>::lanes;
  constexpr int NV = 4;
  int64_t e = 0;
  for (; e + NV * L <= d; e += NV * L) {
    V acc[NV];
    for (int v = 0; v < NV; ++v) acc[v] = ::headwise::cpu::vload(out + e + v * L);
    for (int64_t j = 0; j < n; ++j) {
      const A cj = c[j * cs];
      const A* r = rows + j * rs + e;
      for (int v = 0; v < NV; ++v) acc[v] += cj * ::headwise::cpu::vload(r + v * L);
    }
    std::memcpy(out + e, acc, sizeof(acc));
  }
  for (; e + L <= d; e += L) {
    V acc = ::headwise::cpu::vload(out + e);
    for (int64_t j = 0; j < n; ++j) acc += c[j * cs] * ::headwise::cpu::vload(rows + j * rs + e);
    std::memcpy(out + e, &acc, sizeof(acc));
  }
  for (; e < d; ++e) {
    A acc = out[e];
    for (int64_t j = 0; j < n; ++j) acc += c[j * cs] * rows[j * rs + e];
    out[e] = acc;
  }
}

}  // namespace cpu
}  // namespace dcmha
}  // namespace headwise
