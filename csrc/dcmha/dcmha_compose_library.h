// The compose forward and backward by library products (at::einsum -> batched GEMMs, fp32),
// for calls whose kernel block does not fit the device's shared memory: the forward's at
// fp32 with many head groups, the backward's key-side block at H ~ 32 (sm_86/89/120 have
// 99 KiB). Deterministic (GEMMs and fixed-order reductions, no atomics), no host
// synchronization. Included by dcmha_compose_launch.h and dcmha_compose_backward_launch.h.
#pragma once

#include <ATen/ATen.h>

namespace headwise {
namespace dcmha {

// The grouped views of one call: A [B, G, Hg, T, S] in fp32 and the slot weights W1q, W2q
// [B, T, R, G, Hg] (query side, slot cq), W1k, W2k [B, S, R, G, Hg] (key side, slot ck),
// Gq [B, G, Hg, T, 1], Gk [B, G, Hg, 1, S].
struct ComposeViews {
  int64_t B, H, T, S, R, groups, hg;
  at::Tensor A, w1q, w2q, w1k, w2k, gq, gk;

  ComposeViews(const at::Tensor& x, const at::Tensor& w1f, const at::Tensor& w2f, const at::Tensor& gf, int cq,
               int ck, int64_t groups_)
      : B(x.size(0)), H(x.size(1)), T(x.size(2)), S(x.size(3)), R(w1f.size(3)), groups(groups_), hg(H / groups_) {
    A = x.to(at::kFloat).view({B, groups, hg, T, S});
    w1q = side(w1f, cq, T);
    w2q = side(w2f, cq, T);
    w1k = side(w1f, ck, S);
    w2k = side(w2f, ck, S);
    gq = gf.select(2, cq).narrow(1, 0, T).transpose(1, 2).reshape({B, groups, hg, T, 1});
    gk = gf.select(2, ck).narrow(1, 0, S).transpose(1, 2).reshape({B, groups, hg, 1, S});
  }
  at::Tensor side(const at::Tensor& w, int c, int64_t n) const {
    return w.select(2, c).narrow(1, 0, n).reshape({B, n, R, groups, hg});
  }
  at::Tensor grouped(const at::Tensor& t) const { return t.to(at::kFloat).view({B, groups, hg, T, S}); }
  // The slot products pq = <A, W1q>_n and pk = <A, W1k>_n  [B, G, R, T, S].
  at::Tensor pq() const { return at::einsum("bgnts,btrgn->bgrts", {A, w1q}); }
  at::Tensor pk() const { return at::einsum("bgnts,bsrgn->bgrts", {A, w1k}); }
};

// The forward, with the slot products pq and pk (ComposeViews):
//   Y = A (1 + Gq + Gk) + pq W2q + pk W2k, rounded once to out's dtype.
inline void compose_forward_by_library(const at::Tensor& x, const at::Tensor& w1f, const at::Tensor& w2f,
                                       const at::Tensor& gf, int cq, int ck, int64_t groups, at::Tensor& out) {
  const ComposeViews v(x, w1f, w2f, gf, cq, ck, groups);
  const at::Tensor pq = v.pq(), pk = v.pk();
  const at::Tensor y = v.A * (v.gq + v.gk + 1) + at::einsum("bgrts,btrgm->bgmts", {pq, v.w2q}) +
                       at::einsum("bgrts,bsrgm->bgmts", {pk, v.w2k});
  out.copy_(y.view({v.B, v.H, v.T, v.S}));
}

// The backward, with also dq = <dY, W2q>_m, dk = <dY, W2k>_m  [B, G, R, T, S]:
//   dA   = dY (1 + Gq + Gk) + dq W1q + dk W1k
//   dW2q = sum_s pq dY,  dW2k = sum_t pk dY,  dW1q = sum_s A dq,  dW1k = sum_t A dk
//   dGq  = sum_s dY A,   dGk  = sum_t dY A
// Each [B, G, R, T, S] intermediate holds R / Hg times a's elements, in fp32: twice them at
// one head a group (the forward's case), 1/16 of them at H = 32 in one group.
inline void compose_backward_by_library(const at::Tensor& x, const at::Tensor& dy, const at::Tensor& w1f,
                                        const at::Tensor& w2f, const at::Tensor& gf, int cq, int ck, int64_t groups,
                                        at::Tensor& da, at::Tensor& dw1, at::Tensor& dw2, at::Tensor& dg) {
  const ComposeViews v(x, w1f, w2f, gf, cq, ck, groups);
  const at::Tensor dY = v.grouped(dy);
  const at::Tensor pq = v.pq(), pk = v.pk();
  const at::Tensor dq = at::einsum("bgmts,btrgm->bgrts", {dY, v.w2q});
  const at::Tensor dk = at::einsum("bgmts,bsrgm->bgrts", {dY, v.w2k});
  const at::Tensor da32 = dY * (v.gq + v.gk + 1) + at::einsum("bgrts,btrgn->bgnts", {dq, v.w1q}) +
                          at::einsum("bgrts,bsrgn->bgnts", {dk, v.w1k});
  da.copy_(da32.view({v.B, v.H, v.T, v.S}));
  auto put = [&](at::Tensor& dst, int c, int64_t n, const at::Tensor& t) {
    at::Tensor slot_rows = dst.select(2, c).narrow(1, 0, n);
    slot_rows.copy_(t.reshape(slot_rows.sizes()));
  };
  put(dw2, cq, v.T, at::einsum("bgrts,bgmts->btrgm", {pq, dY}));
  put(dw2, ck, v.S, at::einsum("bgrts,bgmts->bsrgm", {pk, dY}));
  put(dw1, cq, v.T, at::einsum("bgnts,bgrts->btrgn", {v.A, dq}));
  put(dw1, ck, v.S, at::einsum("bgnts,bgrts->bsrgn", {v.A, dk}));
  const at::Tensor prod = (dY * v.A).view({v.B, v.H, v.T, v.S});
  put(dg, cq, v.T, prod.sum(3).transpose(1, 2));
  put(dg, ck, v.S, prod.sum(2).transpose(1, 2));
}

}  // namespace dcmha
}  // namespace headwise
