// CPU kernels of DCMHA (SPEC section 5): the materialized compose (forward and
// backward) and the fused two-pass attention (forward and backward). Math of the compose
// tiles: dcmha_cpu_tile.h. Everything accumulates in fp32 (fp64 for fp64 inputs); all
// reductions run in a fixed order that does not depend on the number of threads:
//  - query-side weight grads (indexed by t) are summed over s by the task owning row t,
//  - key-side weight grads and dk / dv (indexed by s) by a second parallel pass whose
//    task owns a block of keys and loops over the queries in order. No atomics.
#include "../common/op_range.h"
#include "../common/outputs.h"
#include "dcmha_args.h"
#include "dcmha_cpu_tile.h"
#include "dcmha_ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace headwise {
namespace dcmha {
namespace {

using cpu::ComposeGrads;
using cpu::SlotWeights;
using cpu::Tile;

inline at::ScalarType acc_dtype(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// The weights in the accumulation dtype, contiguous, plus the transposed key-side copies.
struct Weights {
  at::Tensor w1, w2, g, w1t, w2t, gt;
  Weights(const at::Tensor& w1_, const at::Tensor& w2_, const at::Tensor& g_, at::ScalarType acc) {
    w1 = w1_.to(acc).contiguous();
    w2 = w2_.to(acc).contiguous();
    g = g_.to(acc).contiguous();
    w1t = w1.permute({0, 2, 3, 4, 1}).contiguous();  // [B, 4, R, H, T]
    w2t = w2.permute({0, 2, 3, 4, 1}).contiguous();
    gt = g.permute({0, 2, 3, 1}).contiguous();       // [B, 4, H, T]
  }
  template <typename A>
  SlotWeights<A> at_batch(int64_t b, int64_t T, int64_t H, int64_t groups, int cq, int ck) const {
    SlotWeights<A> s;
    s.w1 = w1.data_ptr<A>() + b * T * kSlots * kRank * H;
    s.w2 = w2.data_ptr<A>() + b * T * kSlots * kRank * H;
    s.g = g.data_ptr<A>() + b * T * kSlots * H;
    s.w1t = w1t.data_ptr<A>() + b * T * kSlots * kRank * H;
    s.w2t = w2t.data_ptr<A>() + b * T * kSlots * kRank * H;
    s.gt = gt.data_ptr<A>() + b * T * kSlots * H;
    s.T = T;
    s.H = H;
    s.groups = groups;
    s.cq = cq;
    s.ck = ck;
    return s;
  }
};

template <typename F>
void dispatch_acc(at::ScalarType acc, F&& f) {
  if (acc == at::kDouble) f(double{});
  else f(float{});
}

constexpr int64_t kCols = 256;  // key columns per compose tile
constexpr int64_t kKeyBlock = 64;  // keys per task of the key-side backward pass

}  // namespace

// ---------------------------------------------------------------------------------------
// Fused attention. A task owns (b, query tile) in the forward and in the backward's
// query pass, and (b, key tile) in the backward's key pass; every tile holds all H heads.
// Scratch per task is O(H * (TQ * TK + TQ * dh + TK * dh)), independent of T.

namespace {

constexpr int64_t TQ = 32;  // query rows per tile
constexpr int64_t TK = 64;  // keys per tile

struct Geometry {
  int64_t B, H, T, dh, dv, groups;
  bool causal;
  int64_t window;  // 0: none
  double scale;
  int64_t qtiles() const { return (T + TQ - 1) / TQ; }
  int64_t ktiles() const { return (T + TK - 1) / TK; }
  // Key tiles [first, last) that hold a key some row of query tile [t0, t0 + nq) reads.
  std::pair<int64_t, int64_t> key_tiles(int64_t t0, int64_t nq) const {
    int64_t first = 0, last = ktiles();
    if (causal) last = std::min(last, (t0 + nq - 1) / TK + 1);
    if (window > 0) first = std::max<int64_t>(0, t0 - window + 1) / TK;
    return {first, std::max(first, last)};
  }
  // Query tiles [first, last) with a row that reads some key of key tile [s0, s0 + nk).
  std::pair<int64_t, int64_t> query_tiles(int64_t s0, int64_t nk) const {
    int64_t first = 0, last = qtiles();
    if (causal) first = s0 / TQ;
    if (window > 0) last = std::min(last, (s0 + nk - 1 + window - 1) / TQ + 1);
    return {first, std::max(first, last)};
  }
  bool keep(int64_t t, int64_t s) const {
    return (!causal || s <= t) && (window <= 0 || s > t - window);
  }
};

// out[i][j] = scale * <rows[i], colsT[:, j]> for i < nq, j < TK; colsT [d][TK] (zero padded).
// The TK accumulators of a row stay in vector registers.
template <typename A>
HW_CPU_INLINE void dot_tile(const A* rows, int64_t nq, int64_t d, const A* colsT, A scale, A* out) {
  using V = ::headwise::cpu::vec_t<A>;
  constexpr int L = ::headwise::cpu::Simd<A>::lanes;
  constexpr int NV = TK / L;
  for (int64_t i = 0; i < nq; ++i) {
    V acc[NV];
    for (int v = 0; v < NV; ++v) acc[v] = ::headwise::cpu::vzero<A>();
    const A* r = rows + i * d;
    for (int64_t e = 0; e < d; ++e) {
      const A x = r[e];
      const A* c = colsT + e * TK;
      for (int v = 0; v < NV; ++v) acc[v] += x * ::headwise::cpu::vload(c + v * L);
    }
    for (int v = 0; v < NV; ++v) acc[v] *= scale;
    std::memcpy(out + i * TK, acc, sizeof(acc));
  }
}

// The tile state shared by all three kernels: logits L (pre-compose, as computed),
// composed logits -> probabilities P, for rows [t0, t0 + nq) and keys [s0, s0 + nk).
template <typename A>
struct TileMath {
  const Geometry& geo;
  const A* q;  // [B, H, T, dh] contiguous, batch row applied
  const A* k;
  const A* v;
  SlotWeights<A> pre, post;
  A* scratch;  // 4 R TK
  // Keys and values of the batch row in key-tile layout [H][nt][d][TK] (zero padded), made
  // once per call: tile kt of head h at kT_all + (h * nt + kt) * dh * TK.
  const A* kT_all;
  const A* vT_all;
  int64_t nt;
  HW_CPU_INLINE const A* kT(int64_t kt) const { return kT_all + kt * geo.dh * TK; }
  HW_CPU_INLINE const A* vT(int64_t kt) const { return vT_all + kt * geo.dv * TK; }

  // L[h][i][:] for the tile (kT: [H][dh][TK] transposed keys of the tile).
  HW_CPU_INLINE void logits(const A* kT, int64_t t0, int64_t nq, A* L) const {  // kT = this->kT(kt)
    const int64_t H = geo.H, T = geo.T, dh = geo.dh;
    for (int64_t h = 0; h < H; ++h)
      dot_tile(q + (h * T + t0) * dh, nq, dh, kT + h * nt * dh * TK, static_cast<A>(geo.scale), L + h * TQ * TK);
  }
  // Lc = pre-compose(L) with masked (and padding) entries at -inf.
  HW_CPU_INLINE void compose_pre(const A* L, A* Lc, int64_t t0, int64_t nq, int64_t s0, int64_t nk) const {
    const int64_t H = geo.H;
    cpu::compose_fwd<A>(pre, Tile<const A>{L, TQ * TK, TK}, Tile<A>{Lc, TQ * TK, TK}, t0, nq, s0, nk, scratch);
    const A ninf = -std::numeric_limits<A>::infinity();
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t j = 0; j < TK; ++j)
        if (j >= nk || !geo.keep(t0 + i, s0 + j))
          for (int64_t h = 0; h < H; ++h) Lc[(h * TQ + i) * TK + j] = ninf;
  }
  // In place: P = exp(Lc - m) / l (0 where masked or l = 0); m, l: [H][T] of the batch row.
  HW_CPU_INLINE void normalize(A* P, const A* m, const A* l, int64_t t0, int64_t nq) const {
    for (int64_t h = 0; h < geo.H; ++h)
      for (int64_t i = 0; i < nq; ++i) {
        const A mi = m[h * geo.T + t0 + i], li = l[h * geo.T + t0 + i];
        A* p = P + (h * TQ + i) * TK;
        if (li == A(0)) {  // a fully masked row (a NaN l propagates)
          std::fill(p, p + TK, A(0));
          continue;
        }
        const A inv = A(1) / li;
        cpu::exp_row(p, mi, p, TK);
        for (int64_t j = 0; j < TK; ++j) p[j] *= inv;
      }
  }
};

template <typename A>
HW_CPU_INLINE void attention_fwd_task(const Geometry& geo, const TileMath<A>& tm, int64_t t0, A* out /*[H][T][dv] batch row*/,
                        A* m, A* l /*[H][T] batch row*/, A* buf) {
  const int64_t H = geo.H, T = geo.T, dv = geo.dv;
  const int64_t nq = std::min(TQ, T - t0);
  A* L = buf;                     // H TQ TK
  A* Lc = L + H * TQ * TK;        // H TQ TK
  A* O = Lc + H * TQ * TK;        // H TQ dv
  const A ninf = -std::numeric_limits<A>::infinity();
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < nq; ++i) {
      m[h * T + t0 + i] = ninf;
      l[h * T + t0 + i] = 0;
    }
  std::fill(O, O + H * TQ * dv, A(0));
  const auto [kt0, kt1] = geo.key_tiles(t0, nq);
  for (int pass = 0; pass < 2; ++pass) {
    for (int64_t kt = kt0; kt < kt1; ++kt) {
      const int64_t s0 = kt * TK, nk = std::min(TK, T - s0);
      tm.logits(tm.kT(kt), t0, nq, L);
      tm.compose_pre(L, Lc, t0, nq, s0, nk);
      if (pass == 0) {
        // Per-head running max and sum of the pre-composed, masked logits.
        for (int64_t h = 0; h < H; ++h)
          for (int64_t i = 0; i < nq; ++i) {
            const A* x = Lc + (h * TQ + i) * TK;
            // NaN-propagating max (std::max drops a NaN): a NaN logit must reach m and l,
            // not be skipped as if the row were masked.
            A mx = ninf;
            bool nan = false;
            for (int64_t j = 0; j < TK; ++j) {
              mx = std::max(mx, x[j]);
              nan |= x[j] != x[j];
            }
            if (nan) mx = std::numeric_limits<A>::quiet_NaN();
            if (mx == ninf) continue;
            A& mi = m[h * T + t0 + i];
            A& li = l[h * T + t0 + i];
            const A mn = nan ? mx : std::max(mi, mx);  // std::max keeps a NaN mi
            A e[TK];
            cpu::exp_row(x, mn, e, TK);
            A sum[1];
            ::headwise::cpu::sums<1, A>(TK, [&](auto ld, auto (&t)[1]) { t[0] = ld(static_cast<const A*>(e)); }, sum);
            li = li * std::exp(mi - mn) + sum[0];  // exp(-inf) = 0 on the first tile
            mi = mn;
          }
      } else {
        tm.normalize(Lc, m, l, t0, nq);
        cpu::compose_fwd<A>(tm.post, Tile<const A>{Lc, TQ * TK, TK}, Tile<A>{Lc, TQ * TK, TK}, t0, nq, s0, nk,
                            tm.scratch);
        for (int64_t h = 0; h < H; ++h)
          for (int64_t i = 0; i < nq; ++i)
            cpu::accumulate_rows(O + (h * TQ + i) * dv, Lc + (h * TQ + i) * TK, 1, nk, tm.v + (h * T + s0) * dv, dv,
                                 dv);
      }
    }
  }
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < nq; ++i)
      std::copy(O + (h * TQ + i) * dv, O + (h * TQ + i + 1) * dv, out + (h * T + t0 + i) * dv);
}

// x [B, H, T, d] -> [B, H, nt, d, TK]: the key tiles transposed, zero padded to nt * TK.
inline at::Tensor key_tiles(const at::Tensor& x) {
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), d = x.size(3);
  const int64_t nt = (T + TK - 1) / TK;
  return at::constant_pad_nd(x, {0, 0, 0, nt * TK - T}).view({B, H, nt, TK, d}).transpose(3, 4).contiguous();
}

inline Geometry make_geometry(const AttnShape& s, bool causal, int64_t window, double scale) {
  return Geometry{s.batch, s.heads, s.seq, s.head_dim, s.v_dim, s.head_groups, causal, window, scale};
}

}  // namespace

namespace {

// Scratch layout of a backward task.
template <typename A>
struct BwdBuffers {
  A *L, *P, *dPp, *dP, *acc_a, *acc_b;
  std::vector<A> storage;
  BwdBuffers(const Geometry& g) {
    const int64_t H = g.H, tile = H * TQ * TK;
    const int64_t acc = H * std::max(TQ, TK) * std::max(g.dh, g.dv);
    storage.resize(4 * tile + 2 * acc);
    L = storage.data();
    P = L + tile;
    dPp = P + tile;
    dP = dPp + tile;
    acc_a = dP + tile;
    acc_b = acc_a + acc;
  }
};

// Everything up to dP for one tile: L (raw logits), P (probabilities), dPp = dO v^T
// (grad of the post-composed probabilities), dP (grad of P; post-compose backward with
// the post weight grads in `post_grads`). kT/vT must hold the tile's keys and values.
template <typename A>
HW_CPU_INLINE void tile_to_dP(const Geometry& geo, const TileMath<A>& tm, const A* dout, const A* m, const A* l, int64_t t0,
                int64_t nq, int64_t s0, int64_t nk, BwdBuffers<A>& bb, const ComposeGrads<A>& post_grads) {
  tm.logits(tm.kT(s0 / TK), t0, nq, bb.L);
  tm.compose_pre(bb.L, bb.P, t0, nq, s0, nk);
  tm.normalize(bb.P, m, l, t0, nq);
  for (int64_t h = 0; h < geo.H; ++h)
    dot_tile(dout + (h * geo.T + t0) * geo.dv, nq, geo.dv, tm.vT(s0 / TK) + h * tm.nt * geo.dv * TK, A(1),
             bb.dPp + h * TQ * TK);
  cpu::compose_bwd<A>(tm.post, Tile<const A>{bb.P, TQ * TK, TK}, Tile<const A>{bb.dPp, TQ * TK, TK},
                      Tile<A>{bb.dP, TQ * TK, TK}, t0, nq, s0, nk, post_grads, tm.scratch);
}

// In place on dP: dL' = P (dP - D) (the softmax backward; 0 where P = 0).
template <typename A>
HW_CPU_INLINE void softmax_bwd(const Geometry& geo, const A* P, A* dP, const A* D, int64_t t0, int64_t nq) {
  for (int64_t h = 0; h < geo.H; ++h)
    for (int64_t i = 0; i < nq; ++i) {
      const A d = D[h * geo.T + t0 + i];
      const A* p = P + (h * TQ + i) * TK;
      A* x = dP + (h * TQ + i) * TK;
      for (int64_t j = 0; j < TK; ++j) x[j] = p[j] * (x[j] - d);
    }
}

// Query pass of the backward, task (b, query tile): D = rowsum(P dP), dq, and the
// query-side weight grads of slots 0 and 2 (rows t of dw1/dw2/dg), summed over the key
// tiles in order.
template <typename A>
HW_CPU_INLINE void attention_bwd_query_task(const Geometry& geo, const TileMath<A>& tm, const A* dout, const A* m, const A* l,
                              int64_t t0, A* dq, A* D, A* dw1, A* dw2, A* dg, BwdBuffers<A>& bb) {
  const int64_t H = geo.H, T = geo.T, dh = geo.dh, R = kRank;
  const int64_t nq = std::min(TQ, T - t0);
  A* dQ = bb.acc_a;  // [H][TQ][dh]
  std::fill(dQ, dQ + H * TQ * dh, A(0));
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < nq; ++i) D[h * T + t0 + i] = 0;
  auto qgrads = [&](int c) {
    ComposeGrads<A> gr;
    gr.q_w1 = dw1 + (t0 * kSlots + c) * R * H;
    gr.q_w2 = dw2 + (t0 * kSlots + c) * R * H;
    gr.q_g = dg + (t0 * kSlots + c) * H;
    gr.q_stride = kSlots * R * H;
    gr.q_gstride = kSlots * H;
    return gr;
  };
  const auto [kt0, kt1] = geo.key_tiles(t0, nq);
  for (int pass = 0; pass < 2; ++pass) {
    for (int64_t kt = kt0; kt < kt1; ++kt) {
      const int64_t s0 = kt * TK, nk = std::min(TK, T - s0);
      tile_to_dP(geo, tm, dout, m, l, t0, nq, s0, nk, bb, pass == 0 ? qgrads(2) : ComposeGrads<A>{});
      if (pass == 0) {
        for (int64_t h = 0; h < H; ++h)
          for (int64_t i = 0; i < nq; ++i) {
            const A* p = bb.P + (h * TQ + i) * TK;
            const A* x = bb.dP + (h * TQ + i) * TK;
            A sum[1];
            ::headwise::cpu::sums<1, A>(nk, [&](auto ld, auto (&t)[1]) { t[0] = ld(p) * ld(x); }, sum);
            D[h * T + t0 + i] += sum[0];
          }
        continue;
      }
      softmax_bwd(geo, bb.P, bb.dP, D, t0, nq);
      // dL = pre-compose backward of dL' (into dPp), with the slot-0 weight grads.
      cpu::compose_bwd<A>(tm.pre, Tile<const A>{bb.L, TQ * TK, TK}, Tile<const A>{bb.dP, TQ * TK, TK},
                          Tile<A>{bb.dPp, TQ * TK, TK}, t0, nq, s0, nk, qgrads(0), tm.scratch);
      const A scale = static_cast<A>(geo.scale);
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < nq; ++i) {
          A* x = bb.dPp + (h * TQ + i) * TK;
          for (int64_t j = 0; j < nk; ++j) x[j] *= scale;
          cpu::accumulate_rows(dQ + (h * TQ + i) * dh, x, 1, nk, tm.k + (h * T + s0) * dh, dh, dh);
        }
    }
  }
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < nq; ++i)
      std::copy(dQ + (h * TQ + i) * dh, dQ + (h * TQ + i + 1) * dh, dq + (h * T + t0 + i) * dh);
}

// Key pass of the backward, task (b, key tile): dk, dv and the key-side weight grads of
// slots 1 and 3 (kw1/kw2 [2][R][H][T], kg [2][H][T] of the batch row), summed over the
// query tiles in order.
template <typename A>
HW_CPU_INLINE void attention_bwd_key_task(const Geometry& geo, const TileMath<A>& tm, const A* dout, const A* m, const A* l,
                            const A* D, int64_t s0, A* dk, A* dv_out, A* kw1, A* kw2, A* kg, BwdBuffers<A>& bb) {
  const int64_t H = geo.H, T = geo.T, dh = geo.dh, dv = geo.dv, R = kRank;
  const int64_t nk = std::min(TK, T - s0);
  A* dK = bb.acc_a;  // [H][TK][dh]
  A* dV = bb.acc_b;  // [H][TK][dv]
  std::fill(dK, dK + H * TK * dh, A(0));
  std::fill(dV, dV + H * TK * dv, A(0));
  auto kgrads = [&](int side) {  // side 0: slot 1 (pre), 1: slot 3 (post)
    ComposeGrads<A> gr;
    gr.k_w1 = kw1 + side * R * H * T + s0;
    gr.k_w2 = kw2 + side * R * H * T + s0;
    gr.k_g = kg + side * H * T + s0;
    gr.ks = T;
    return gr;
  };
  const A scale = static_cast<A>(geo.scale);
  const auto [qt0, qt1] = geo.query_tiles(s0, nk);
  for (int64_t qt = qt0; qt < qt1; ++qt) {
    const int64_t t0 = qt * TQ, nq = std::min(TQ, T - t0);
    tile_to_dP(geo, tm, dout, m, l, t0, nq, s0, nk, bb, kgrads(1));
    // dv += P'^T dO with P' = post-compose(P) (into dPp, no longer needed).
    cpu::compose_fwd<A>(tm.post, Tile<const A>{bb.P, TQ * TK, TK}, Tile<A>{bb.dPp, TQ * TK, TK}, t0, nq, s0, nk,
                        tm.scratch);
    for (int64_t h = 0; h < H; ++h)
      for (int64_t j = 0; j < nk; ++j)
        cpu::accumulate_rows(dV + (h * TK + j) * dv, bb.dPp + h * TQ * TK + j, TK, nq, dout + (h * T + t0) * dv, dv,
                             dv);
    softmax_bwd(geo, bb.P, bb.dP, D, t0, nq);
    cpu::compose_bwd<A>(tm.pre, Tile<const A>{bb.L, TQ * TK, TK}, Tile<const A>{bb.dP, TQ * TK, TK},
                        Tile<A>{bb.dPp, TQ * TK, TK}, t0, nq, s0, nk, kgrads(0), tm.scratch);
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < nq; ++i)
        for (int64_t j = 0; j < nk; ++j) bb.dPp[(h * TQ + i) * TK + j] *= scale;
    for (int64_t h = 0; h < H; ++h)
      for (int64_t j = 0; j < nk; ++j)
        cpu::accumulate_rows(dK + (h * TK + j) * dh, bb.dPp + h * TQ * TK + j, TK, nq, tm.q + (h * T + t0) * dh, dh,
                             dh);
  }
  for (int64_t h = 0; h < H; ++h)
    for (int64_t j = 0; j < nk; ++j) {
      std::copy(dK + (h * TK + j) * dh, dK + (h * TK + j + 1) * dh, dk + (h * T + s0 + j) * dh);
      std::copy(dV + (h * TK + j) * dv, dV + (h * TK + j + 1) * dv, dv_out + (h * T + s0 + j) * dv);
    }
}


// The entries every parallel task calls, compiled for AVX-512, AVX2 and baseline x86-64
// with runtime selection; everything below them is force-inlined into each clone.
#define HW_DCMHA_CLONES(A)                                                                                        \
  HW_CPU_CLONES void compose_fwd_clone(const SlotWeights<A>& w, Tile<const A> X, Tile<A> Y, int64_t t0,             \
                                       int64_t nq, int64_t s0, int64_t nk, A* scratch) {                           \
    cpu::compose_fwd<A>(w, X, Y, t0, nq, s0, nk, scratch);                                                         \
  }                                                                                                                \
  HW_CPU_CLONES void compose_bwd_clone(const SlotWeights<A>& w, Tile<const A> X, Tile<const A> dY, Tile<A> dX,      \
                                       int64_t t0, int64_t nq, int64_t s0, int64_t nk, const ComposeGrads<A>& gr,   \
                                       A* scratch) {                                                               \
    cpu::compose_bwd<A>(w, X, dY, dX, t0, nq, s0, nk, gr, scratch);                                                \
  }                                                                                                                \
  HW_CPU_CLONES void fwd_task_clone(const Geometry& geo, const TileMath<A>& tm, int64_t t0, A* out, A* m, A* l,     \
                                    A* buf) {                                                                      \
    attention_fwd_task<A>(geo, tm, t0, out, m, l, buf);                                                            \
  }                                                                                                                \
  HW_CPU_CLONES void bwd_query_clone(const Geometry& geo, const TileMath<A>& tm, const A* dout, const A* m,         \
                                     const A* l, int64_t t0, A* dq, A* D, A* dw1, A* dw2, A* dg,                   \
                                     BwdBuffers<A>& bb) {                                                          \
    attention_bwd_query_task<A>(geo, tm, dout, m, l, t0, dq, D, dw1, dw2, dg, bb);                                 \
  }                                                                                                                \
  HW_CPU_CLONES void bwd_key_clone(const Geometry& geo, const TileMath<A>& tm, const A* dout, const A* m,           \
                                   const A* l, const A* D, int64_t s0, A* dk, A* dv_out, A* kw1, A* kw2, A* kg,    \
                                   BwdBuffers<A>& bb) {                                                            \
    attention_bwd_key_task<A>(geo, tm, dout, m, l, D, s0, dk, dv_out, kw1, kw2, kg, bb);                           \
  }

HW_DCMHA_CLONES(float)
HW_DCMHA_CLONES(double)
#undef HW_DCMHA_CLONES

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& w1,
    const at::Tensor& w2, const at::Tensor& g, const at::Tensor& stats, bool causal, int64_t window, double scale,
    int64_t head_groups) {
  HW_OP_RANGE("headwise::dcmha_attention_backward");
  const AttnShape s = check_attention_args(q, k, v, w1, w2, g, window, head_groups);
  const auto acc = acc_dtype(q);
  TORCH_CHECK_VALUE(grad_out.dim() == 4 && grad_out.size(0) == s.batch && grad_out.size(1) == s.heads &&
                        grad_out.size(2) == s.seq && grad_out.size(3) == s.v_dim,
                    "headwise.dcmha_attention_backward: grad_out must be [B, H, T, dv], got ", shape_str(grad_out));
  TORCH_CHECK_VALUE(stats.dim() == 4 && stats.size(0) == 2 && stats.size(1) == s.batch && stats.size(2) == s.heads &&
                        stats.size(3) == s.seq && stats.scalar_type() == acc,
                    "headwise.dcmha_attention_backward: stats must be the [2, B, H, T] ", acc,
                    " statistics of the forward, got ", shape_str(stats), " ", stats.scalar_type());
  const at::Tensor qa = q.to(acc).contiguous(), ka = k.to(acc).contiguous(), va = v.to(acc).contiguous();
  const at::Tensor dout = grad_out.to(acc).contiguous();
  const at::Tensor st = stats.contiguous();
  const Weights w(w1, w2, g, acc);
  const Geometry geo = make_geometry(s, causal, window, scale);
  const int64_t B = geo.B, H = geo.H, T = geo.T, R = kRank;
  at::Tensor dq = new_output(qa.sizes(), qa.options());
  at::Tensor dk = new_output(ka.sizes(), ka.options());
  at::Tensor dv = new_output(va.sizes(), va.options());
  at::Tensor dw1 = at::zeros({B, T, kSlots, R, H}, qa.options());
  at::Tensor dw2 = at::zeros({B, T, kSlots, R, H}, qa.options());
  at::Tensor dg = at::zeros({B, T, kSlots, H}, qa.options());
  at::Tensor kw1 = at::zeros({B, 2, R, H, T}, qa.options());  // slots 1, 3, transposed
  at::Tensor kw2 = at::zeros({B, 2, R, H, T}, qa.options());
  at::Tensor kg = at::zeros({B, 2, H, T}, qa.options());
  at::Tensor D = new_output({B, H, T}, qa.options());
  const at::Tensor kt_all = key_tiles(ka), vt_all = key_tiles(va);
  if (B * T > 0) {
    dispatch_acc(acc, [&](auto tag) {
      using A = decltype(tag);
      auto tile_math = [&](int64_t b, A* scratch) {
        const int64_t nt = geo.ktiles();
        return TileMath<A>{geo, qa.data_ptr<A>() + b * H * T * geo.dh, ka.data_ptr<A>() + b * H * T * geo.dh,
                           va.data_ptr<A>() + b * H * T * geo.dv, w.at_batch<A>(b, T, H, geo.groups, 0, 1),
                           w.at_batch<A>(b, T, H, geo.groups, 2, 3), scratch,
                           kt_all.data_ptr<A>() + b * H * nt * geo.dh * TK,
                           vt_all.data_ptr<A>() + b * H * nt * geo.dv * TK, nt};
      };
      const A* m = st.data_ptr<A>();
      const A* l = m + B * H * T;
      const int64_t nqt = geo.qtiles(), nkt = geo.ktiles();
      at::parallel_for(0, B * nqt, 1, [&](int64_t begin, int64_t end) {
        BwdBuffers<A> bb(geo);
        std::vector<A> scratch(4 * R * TK);
        for (int64_t task = begin; task < end; ++task) {
          const int64_t b = task / nqt, t0 = (task % nqt) * TQ;
          bwd_query_clone(geo, tile_math(b, scratch.data()), dout.data_ptr<A>() + b * H * T * geo.dv,
                                      m + b * H * T, l + b * H * T, t0, dq.data_ptr<A>() + b * H * T * geo.dh,
                                      D.data_ptr<A>() + b * H * T, dw1.data_ptr<A>() + b * T * kSlots * R * H,
                                      dw2.data_ptr<A>() + b * T * kSlots * R * H,
                                      dg.data_ptr<A>() + b * T * kSlots * H, bb);
        }
      });
      at::parallel_for(0, B * nkt, 1, [&](int64_t begin, int64_t end) {
        BwdBuffers<A> bb(geo);
        std::vector<A> scratch(4 * R * TK);
        for (int64_t task = begin; task < end; ++task) {
          const int64_t b = task / nkt, s0 = (task % nkt) * TK;
          bwd_key_clone(geo, tile_math(b, scratch.data()), dout.data_ptr<A>() + b * H * T * geo.dv,
                                    m + b * H * T, l + b * H * T, D.data_ptr<A>() + b * H * T, s0,
                                    dk.data_ptr<A>() + b * H * T * geo.dh, dv.data_ptr<A>() + b * H * T * geo.dv,
                                    kw1.data_ptr<A>() + b * 2 * R * H * T, kw2.data_ptr<A>() + b * 2 * R * H * T,
                                    kg.data_ptr<A>() + b * 2 * H * T, bb);
        }
      });
    });
    for (int side = 0; side < 2; ++side) {
      dw1.select(2, 2 * side + 1).copy_(kw1.select(1, side).permute({0, 3, 1, 2}));
      dw2.select(2, 2 * side + 1).copy_(kw2.select(1, side).permute({0, 3, 1, 2}));
      dg.select(2, 2 * side + 1).copy_(kg.select(1, side).permute({0, 2, 1}));
    }
  } else {
    dq.zero_();
    dk.zero_();
    dv.zero_();
  }
  const auto dt = q.scalar_type();
  return {dq.to(dt), dk.to(dt), dv.to(dt), dw1.to(w1.scalar_type()), dw2.to(w2.scalar_type()), dg.to(g.scalar_type())};
}


at::Tensor compose_cpu(const at::Tensor& a, const at::Tensor& w1, const at::Tensor& w2, const at::Tensor& g,
                       int64_t slot, int64_t head_groups) {
  HW_OP_RANGE("headwise::dcmha_compose");
  const Shape s = check_compose_args(a, w1, w2, g, slot, head_groups);
  TORCH_CHECK(a.device().is_cpu(), "headwise.dcmha_compose: a is on ", a.device(), " but the CPU backend takes CPU tensors");
  const auto acc = acc_dtype(a);
  const at::Tensor x = a.to(acc).contiguous();
  const Weights w(w1, w2, g, acc);
  at::Tensor out = new_output(x.sizes(), x.options());
  const int64_t B = s.batch, H = s.heads, T = s.seq;
  if (x.numel() == 0) return out.to(a.scalar_type());
  dispatch_acc(acc, [&](auto tag) {
    using A = decltype(tag);
    const A* xp = x.data_ptr<A>();
    A* op = out.data_ptr<A>();
    at::parallel_for(0, B * T, 1, [&](int64_t begin, int64_t end) {
      std::vector<A> scratch(2 * cpu::R * kCols);
      for (int64_t row = begin; row < end; ++row) {
        const int64_t b = row / T, t = row % T;
        const auto sw = w.at_batch<A>(b, T, H, s.head_groups, 2 * slot, 2 * slot + 1);
        const int64_t base = b * H * T * T + t * T;
        for (int64_t s0 = 0; s0 < T; s0 += kCols) {
          const int64_t nk = std::min(kCols, T - s0);
          compose_fwd_clone(sw, Tile<const A>{xp + base + s0, T * T, T}, Tile<A>{op + base + s0, T * T, T}, t, 1,
                              s0, nk, scratch.data());
        }
      }
    });
  });
  return out.to(a.scalar_type());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> compose_backward_cpu(
    const at::Tensor& grad, const at::Tensor& a, const at::Tensor& w1, const at::Tensor& w2, const at::Tensor& g,
    int64_t slot, int64_t head_groups) {
  HW_OP_RANGE("headwise::dcmha_compose_backward");
  const Shape s = check_compose_args(a, w1, w2, g, slot, head_groups);
  TORCH_CHECK_VALUE(grad.sizes() == a.sizes(), "headwise.dcmha_compose_backward: grad must have the shape of a ",
                    shape_str(a), ", got ", shape_str(grad));
  const auto acc = acc_dtype(a);
  const at::Tensor x = a.to(acc).contiguous();
  const at::Tensor dy = grad.to(acc).contiguous();
  const Weights w(w1, w2, g, acc);
  const int64_t B = s.batch, H = s.heads, T = s.seq, R = kRank;
  at::Tensor dx = new_output(x.sizes(), x.options());
  at::Tensor dw1 = at::zeros({B, T, kSlots, R, H}, x.options());
  at::Tensor dw2 = at::zeros({B, T, kSlots, R, H}, x.options());
  at::Tensor dg = at::zeros({B, T, kSlots, H}, x.options());
  // Key-side grads, transposed [B, R, H, T] / [B, H, T]; added into slot ck at the end.
  at::Tensor kw1 = at::zeros({B, R, H, T}, x.options());
  at::Tensor kw2 = at::zeros({B, R, H, T}, x.options());
  at::Tensor kg = at::zeros({B, H, T}, x.options());
  const int cq = static_cast<int>(2 * slot), ck = cq + 1;
  if (x.numel() > 0) {
    dispatch_acc(acc, [&](auto tag) {
      using A = decltype(tag);
      const A* xp = x.data_ptr<A>();
      const A* dyp = dy.data_ptr<A>();
      A* dxp = dx.data_ptr<A>();
      // Pass 1, per query row t: grad_a and the query-side weight grads (sum over s).
      at::parallel_for(0, B * T, 1, [&](int64_t begin, int64_t end) {
        std::vector<A> scratch(4 * R * kCols);
        for (int64_t row = begin; row < end; ++row) {
          const int64_t b = row / T, t = row % T;
          const auto sw = w.at_batch<A>(b, T, H, s.head_groups, cq, ck);
          const int64_t base = b * H * T * T + t * T;
          ComposeGrads<A> gr;
          gr.q_w1 = dw1.data_ptr<A>() + ((b * T + t) * kSlots + cq) * R * H;
          gr.q_w2 = dw2.data_ptr<A>() + ((b * T + t) * kSlots + cq) * R * H;
          gr.q_g = dg.data_ptr<A>() + ((b * T + t) * kSlots + cq) * H;
          for (int64_t s0 = 0; s0 < T; s0 += kCols) {
            const int64_t nk = std::min(kCols, T - s0);
            compose_bwd_clone(sw, Tile<const A>{xp + base + s0, T * T, T}, Tile<const A>{dyp + base + s0, T * T, T},
                                Tile<A>{dxp + base + s0, T * T, T}, t, 1, s0, nk, gr, scratch.data());
          }
        }
      });
      // Pass 2, per block of keys: the key-side weight grads, summed over t in order.
      const int64_t nblocks = (T + kKeyBlock - 1) / kKeyBlock;
      at::parallel_for(0, B * nblocks, 1, [&](int64_t begin, int64_t end) {
        std::vector<A> scratch(4 * R * kKeyBlock);
        for (int64_t task = begin; task < end; ++task) {
          const int64_t b = task / nblocks, s0 = (task % nblocks) * kKeyBlock;
          const int64_t nk = std::min(kKeyBlock, T - s0);
          const auto sw = w.at_batch<A>(b, T, H, s.head_groups, cq, ck);
          ComposeGrads<A> gr;
          gr.k_w1 = kw1.data_ptr<A>() + b * R * H * T + s0;
          gr.k_w2 = kw2.data_ptr<A>() + b * R * H * T + s0;
          gr.k_g = kg.data_ptr<A>() + b * H * T + s0;
          gr.ks = T;
          for (int64_t t = 0; t < T; ++t) {
            const int64_t base = b * H * T * T + t * T + s0;
            compose_bwd_clone(sw, Tile<const A>{xp + base, T * T, T}, Tile<const A>{dyp + base, T * T, T},
                                Tile<A>{nullptr, 0, 0}, t, 1, s0, nk, gr, scratch.data());
          }
        }
      });
    });
    dw1.select(2, ck).copy_(kw1.permute({0, 3, 1, 2}));
    dw2.select(2, ck).copy_(kw2.permute({0, 3, 1, 2}));
    dg.select(2, ck).copy_(kg.permute({0, 2, 1}));
  }
  return {dx.to(a.scalar_type()), dw1.to(w1.scalar_type()), dw2.to(w2.scalar_type()), dg.to(g.scalar_type())};
}


std::tuple<at::Tensor, at::Tensor> attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 const at::Tensor& w1, const at::Tensor& w2, const at::Tensor& g,
                                                 bool causal, int64_t window, double scale, int64_t head_groups) {
  HW_OP_RANGE("headwise::dcmha_attention");
  const AttnShape s = check_attention_args(q, k, v, w1, w2, g, window, head_groups);
  TORCH_CHECK(q.device().is_cpu(), "headwise.dcmha_attention: q is on ", q.device(),
              " but the CPU backend takes CPU tensors");
  const auto acc = acc_dtype(q);
  const at::Tensor qa = q.to(acc).contiguous(), ka = k.to(acc).contiguous(), va = v.to(acc).contiguous();
  const Weights w(w1, w2, g, acc);
  const Geometry geo = make_geometry(s, causal, window, scale);
  at::Tensor out = new_output({s.batch, s.heads, s.seq, s.v_dim}, qa.options());
  at::Tensor stats = new_output({2, s.batch, s.heads, s.seq}, qa.options());
  const at::Tensor kt_all = key_tiles(ka);
  const int64_t B = geo.B, H = geo.H, T = geo.T;
  if (B * T > 0) {
    dispatch_acc(acc, [&](auto tag) {
      using A = decltype(tag);
      const int64_t nqt = geo.qtiles();
      at::parallel_for(0, B * nqt, 1, [&](int64_t begin, int64_t end) {
        std::vector<A> buf(2 * H * TQ * TK + H * TQ * geo.dv);
        std::vector<A> scratch(4 * cpu::R * TK);
        for (int64_t task = begin; task < end; ++task) {
          const int64_t b = task / nqt, t0 = (task % nqt) * TQ;
          const int64_t nt = geo.ktiles();
          TileMath<A> tm{geo, qa.data_ptr<A>() + b * H * T * geo.dh, ka.data_ptr<A>() + b * H * T * geo.dh,
                         va.data_ptr<A>() + b * H * T * geo.dv, w.at_batch<A>(b, T, H, geo.groups, 0, 1),
                         w.at_batch<A>(b, T, H, geo.groups, 2, 3), scratch.data(),
                         kt_all.data_ptr<A>() + b * H * nt * geo.dh * TK, nullptr, nt};
          fwd_task_clone(geo, tm, t0, out.data_ptr<A>() + b * H * T * geo.dv,
                                stats.data_ptr<A>() + b * H * T, stats.data_ptr<A>() + (B + b) * H * T, buf.data());
        }
      });
    });
  }
  return {out.to(q.scalar_type()), stats};
}


}  // namespace dcmha
}  // namespace headwise
