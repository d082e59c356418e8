// CPU kernels of the head merge (math: merge_ops.h). The merge is a GEMM whose K axis is
// the concatenation of the heads; the CPU kernel never builds that concatenation in
// memory. It runs over tiles of kRows query rows of one batch row, in parallel
// (at::parallel_for), and calls the CPU BLAS (at::native::cpublas::gemm: MKL/oneDNN)
// on strided views:
//   - z is read in place when it already is a row-major [Q, H*Dv] matrix per batch row
//     (a transposed view of [B, Q, H, Dv] memory: stride(H) == Dv) and in fp32/fp64;
//     otherwise each tile's open heads are gathered (and widened) into a small
//     cache-resident scratch tile [kRows, H*Dv].
//   - the K axis is split into runs of consecutive open heads with the same coefficient
//     alpha[b,h] = s[b] * g[b,h]; each run is one GEMM with alpha as the GEMM's scale,
//     so a closed head (g == 0) costs neither reads nor FLOPs, and binary gates with
//     rescale cost one GEMM per run of open heads.
//   - stats: z_norm from the tile's rows; out_norm through a triangular factor R_h
//     [r, Dv] of each head's block, R_h^T R_h = W_h^T W_h (r = min(D, Dv)), formed once
//     per call: ||z W_h^T|| = ||z R_h^T||, i.e. about Q*Dv*r extra multiply-adds per
//     head (r rounded up to whole vectors) instead of Q*Dv*D and no [B, Q, H, D] tensor
//     (projected_sum_sq: register blocks that skip R_h's zero triangle, nothing stored
//     but the row's sum of squares; the Gram matrices by gram_lower, their lower
//     triangles, in fp64 from fp32 weights, whose products are exact). A sum of squares, so no cancellation: a head whose
//     contribution is tiny relative to ||z|| ||W_h|| keeps its relative accuracy (the
//     fp32 Gram form z^T (W_h^T W_h) z would not). R_h is the Cholesky factor of the
//     Gram matrix formed in fp64 (fp32 weights; rounded to fp32 afterwards: as accurate
//     as a QR of W_h, at a fraction of its cost), or, for fp64 weights, for D < Dv and
//     for heads whose Gram matrix is numerically singular, the R of a fp64 QR of W_h.
//     Rows of z with a non-finite sum of squares and heads with a non-finite W_h take
//     the product z W_h^T itself (as the reference does).
// Backward: grad_z = alpha * grad_out @ W_h, one GEMM per run of needed heads: written
// by the GEMM straight into z's layout when z's heads are adjacent columns of rows
// (fp32/fp64, no gate gradient), else into a reused scratch chunk of rows and scattered
// into z's layout; with the gate's gradient,
// per tile of one batch row, c[b,h] = <Z_bh, grad_out_b @ W_h> from the tile (partials
// summed in tile order). grad_weight_o = grad_out^T Zs (Zs[(b,q), h] = alpha[b,h] Z[b,h,q],
// z in place or gathered chunk by chunk, chunks accumulated in order); grad_bias as column
// sums. Every reduction has a fixed order: results do not depend on the thread count.
#include "../common/cpu_convert.h"
#include "../common/cpu_simd.h"
#include "../common/op_range.h"
#include "../common/outputs.h"
#include "merge_args.h"
#include "merge_ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

namespace headwise {
namespace merge {
namespace {

// Row-major GEMM on strided views, C[m, n] = alpha A[m, k] B[k, n] + beta C (C is not
// read when beta is 0), with A(i, p) = a[i * as0 + p * as1], B(p, j) = b[p * bs0 + j * bs1]
// and C(i, j) = c[i * ldc + j]. Run by at::addmm_ on views of the buffers (no copies), so
// the CPU BLAS (MKL/oneDNN/OpenBLAS) does the work. (at::native::cpublas::gemm would be
// the direct call but is not exported by libtorch.) The operand orientations used below
// are those of an eager nn.Linear forward/backward, which the BLAS runs fastest.
template <typename A>
void gemm(int64_t m, int64_t n, int64_t k, A alpha, const A* a, int64_t as0, int64_t as1, const A* b, int64_t bs0,
          int64_t bs1, A beta, A* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  const auto opts = at::TensorOptions().dtype(c10::CppTypeToScalarType<A>::value).device(at::kCPU);
  at::Tensor ct = at::from_blob(c, {m, n}, {ldc, 1}, opts);
  if (k == 0) {
    if (beta == A(0)) {
      ct.zero_();
    } else {
      ct.mul_(beta);
    }
    return;
  }
  const at::Tensor at_ = at::from_blob(const_cast<A*>(a), {m, k}, {as0, as1}, opts);
  const at::Tensor bt = at::from_blob(const_cast<A*>(b), {k, n}, {bs0, bs1}, opts);
  ct.addmm_(at_, bt, beta, alpha);
}

constexpr int64_t kRows = 256;  // query rows per tile (large GEMMs: BLAS efficiency)
constexpr int64_t kChunkRows = 512;  // rows per chunk of the backward's gathered / scattered scratch

// sum_j x[j]^2 with eight independent partial sums (vectorizable), added in a fixed order.
template <typename A>
A sum_sq(const A* x, int64_t n) {
  A acc[8] = {};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int l = 0; l < 8; ++l) acc[l] += x[j + l] * x[j + l];
  for (; j < n; ++j) acc[0] += x[j] * x[j];
  A total = 0;
  for (int l = 0; l < 8; ++l) total += acc[l];
  return total;
}

// out[i] = ||z_i L||^2 for the `rows` rows z_i = z[i * ldz, + Dv) of one head, where
// L = lt [Dv, rp] (row-major, R_h^T) is lower-trapezoidal, L[j, c] = 0 for c > j, with
// zero columns padding r to rp, a whole number of vectors. Rows go R at a time and the
// product's columns in blocks of W vectors, the R x W sums in registers (AVX-512; the
// narrower clones spill some); a block of columns from c0 on reads L's rows j >= c0 only
// (the rows above are zero there), which saves a quarter of the FLOPs at Dv = r = 64. Each row's squares are added lane-wise
// block after block and then over lanes (cpu::hsum): a fixed order.
// FLOPs per row: 2 sum over blocks of (Dv - c0) * W * lanes; at Dv = 64 in fp32 that is
// 3072 multiply-adds, against 4096 for a dense z R^T and 32768 for z W_h^T at D = 512.
template <int R, int W, typename A>
HW_CPU_INLINE void projected_sum_sq_block(const A* z, int64_t ldz, const A* lt, int64_t Dv, int64_t rp, int64_t c0,
                                          cpu::vec_t<A> (&sq)[R]) {
  using V = cpu::vec_t<A>;
  constexpr int L = cpu::Simd<A>::lanes;
  V acc[R][W];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < W; ++v) acc[r][v] = cpu::vzero<A>();
  for (int64_t j = c0; j < Dv; ++j) {
    V lv[W];
    for (int v = 0; v < W; ++v) lv[v] = cpu::vload(lt + j * rp + c0 + v * L);
    for (int r = 0; r < R; ++r) {
      const A zj = z[r * ldz + j];
      for (int v = 0; v < W; ++v) acc[r][v] += zj * lv[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < W; ++v) sq[r] += acc[r][v] * acc[r][v];
}

template <int R, typename A>
HW_CPU_INLINE void projected_sum_sq_rows(const A* z, int64_t ldz, const A* lt, int64_t Dv, int64_t rp, A* out) {
  constexpr int L = cpu::Simd<A>::lanes;
  constexpr int W = 2;
  cpu::vec_t<A> sq[R];
  for (auto& v : sq) v = cpu::vzero<A>();
  int64_t c0 = 0;
  for (; c0 + W * L <= rp; c0 += W * L) projected_sum_sq_block<R, W>(z, ldz, lt, Dv, rp, c0, sq);
  if (c0 < rp) projected_sum_sq_block<R, 1>(z, ldz, lt, Dv, rp, c0, sq);  // rp - c0 == L
  for (int r = 0; r < R; ++r) out[r] = cpu::hsum<A>(sq[r]);
}

template <typename A>
HW_CPU_INLINE void projected_sum_sq(const A* z, int64_t ldz, int64_t rows, const A* lt, int64_t Dv, int64_t rp,
                                    A* out) {
  constexpr int R = 4;
  int64_t i = 0;
  for (; i + R <= rows; i += R) projected_sum_sq_rows<R>(z + i * ldz, ldz, lt, Dv, rp, out + i);
  for (; i < rows; ++i) projected_sum_sq_rows<1>(z + i * ldz, ldz, lt, Dv, rp, out + i);
}

HW_CPU_CLONES void projected_sum_sq_clone(const float* z, int64_t ldz, int64_t rows, const float* lt, int64_t Dv,
                                          int64_t rp, float* out) {
  projected_sum_sq(z, ldz, rows, lt, Dv, rp, out);
}
HW_CPU_CLONES void projected_sum_sq_clone(const double* z, int64_t ldz, int64_t rows, const double* lt, int64_t Dv,
                                          int64_t rp, double* out) {
  projected_sum_sq(z, ldz, rows, lt, Dv, rp, out);
}

// Per batch row: s[b] and alpha[b,h] = s[b] g[b,h] (g = 1 without a gate), and the
// derivative ds/dS of the rescale (0 where the clip is active or without rescale).
struct Coeffs {
  std::vector<double> g, alpha, s, dsds;
  bool all_one = true;  // alpha == 1 everywhere
};

Coeffs make_coeffs(const c10::optional<at::Tensor>& head_gate, bool rescale, const Shape& sh) {
  Coeffs c;
  const int64_t B = sh.batch, H = sh.heads;
  c.g.assign(B * H, 1.0);
  if (head_gate.has_value()) {
    const at::Tensor g = head_gate->to(at::kDouble).expand({B, H}).contiguous();
    const double* p = g.data_ptr<double>();
    std::copy(p, p + B * H, c.g.begin());
  }
  c.alpha.resize(B * H);
  c.s.assign(B, 1.0);
  c.dsds.assign(B, 0.0);
  for (int64_t b = 0; b < B; ++b) {
    if (rescale) {
      double sum = 0;
      for (int64_t h = 0; h < H; ++h) sum += c.g[b * H + h];
      const double Hd = static_cast<double>(H);
      if (sum > 1.0) {
        c.s[b] = Hd / sum;
        c.dsds[b] = -Hd / (sum * sum);
      } else {
        c.s[b] = Hd;  // min(H, H / sum): the clip, also for an all-closed row
      }
    }
    for (int64_t h = 0; h < H; ++h) {
      c.alpha[b * H + h] = c.s[b] * c.g[b * H + h];
      if (c.alpha[b * H + h] != 1.0) c.all_one = false;
    }
  }
  return c;
}

struct Run {
  int64_t h0, h1;  // heads [h0, h1)
  double alpha;
};

// Runs of consecutive heads with g != 0 (and, with split_alpha, equal alpha).
std::vector<Run> open_runs(const Coeffs& c, int64_t b, int64_t H, bool split_alpha, bool include_closed) {
  std::vector<Run> runs;
  for (int64_t h = 0; h < H; ++h) {
    const double a = c.alpha[b * H + h];
    if (!include_closed && c.g[b * H + h] == 0.0) continue;
    if (!runs.empty() && runs.back().h1 == h && (!split_alpha || runs.back().alpha == a)) {
      runs.back().h1 = h + 1;
    } else {
      runs.push_back({h, h + 1, a});
    }
  }
  return runs;
}

// G[a0 + i, b0 + c] = sum_k W[k, a0 + i] W[k, b0 + c] for i < RA, c < W vectors, where
// b0 + c <= a0 + i (the lower triangle): W [D, n] row-major fp64, k in order, the RA x W
// sums in registers (AVX-512; the narrower clones spill some).
template <int RA, int W>
HW_CPU_INLINE void gram_block(const double* w, int64_t D, int64_t n, int64_t a0, int64_t b0, double* g) {
  using V = cpu::vec_t<double>;
  constexpr int L = cpu::Simd<double>::lanes;
  V acc[RA][W];
  for (int i = 0; i < RA; ++i)
    for (int v = 0; v < W; ++v) acc[i][v] = cpu::vzero<double>();
  for (int64_t k = 0; k < D; ++k) {
    const double* row = w + k * n;
    V bv[W];
    for (int v = 0; v < W; ++v) bv[v] = cpu::vload(row + b0 + v * L);
    for (int i = 0; i < RA; ++i) {
      const double wa = row[a0 + i];
      for (int v = 0; v < W; ++v) acc[i][v] += wa * bv[v];
    }
  }
  for (int i = 0; i < RA; ++i) {
    double lanes[W * L];
    std::memcpy(lanes, acc[i], sizeof(lanes));
    for (int c = 0; c < W * L && b0 + c <= a0 + i; ++c) g[(a0 + i) * n + b0 + c] = lanes[c];
  }
}

// The lower triangle (and diagonal) of the Gram matrix G = W^T W [n, n] of one head,
// W [D, n] row-major fp64 (fp32 weights widened: every product exact, the sums over k in
// order); the entries above the diagonal are not written. Rows of G four at a time against
// blocks of 4 or 1 vectors of columns; the last n % lanes columns by scalar sums.
// FLOPs: about 2 D n^2 / 2 (the triangle, rounded up to whole blocks).
HW_CPU_CLONES void gram_lower(const double* w, int64_t D, int64_t n, double* g) {
  constexpr int L = cpu::Simd<double>::lanes;
  const int64_t nv = n / L * L;  // columns in whole vectors
  int64_t a0 = 0;
  for (; a0 + 4 <= n; a0 += 4) {
    int64_t b0 = 0;
    for (; b0 + 4 * L <= nv && b0 <= a0 + 3; b0 += 4 * L) gram_block<4, 4>(w, D, n, a0, b0, g);
    for (; b0 + L <= nv && b0 <= a0 + 3; b0 += L) gram_block<4, 1>(w, D, n, a0, b0, g);
  }
  for (; a0 < n; ++a0)
    for (int64_t b0 = 0; b0 + L <= nv && b0 <= a0; b0 += L) gram_block<1, 1>(w, D, n, a0, b0, g);
  for (int64_t b = nv; b < n; ++b)
    for (int64_t a = b; a < n; ++a) {
      double sum = 0;
      for (int64_t k = 0; k < D; ++k) sum += w[k * n + a] * w[k * n + b];
      g[a * n + b] = sum;
    }
}

// Lower Cholesky factor L (G = L L^T) of a symmetric [n, n] fp64 matrix, in place of its
// lower triangle (the upper triangle zeroed). False when a pivot is not clearly positive
// (G numerically singular: the caller falls back to QR).
bool cholesky_lower(double* g, int64_t n) {
  double max_diag = 0;
  for (int64_t k = 0; k < n; ++k) max_diag = std::max(max_diag, g[k * n + k]);
  const double tiny = 64 * std::numeric_limits<double>::epsilon() * max_diag;
  for (int64_t k = 0; k < n; ++k) {
    double d = g[k * n + k];
    for (int64_t j = 0; j < k; ++j) d -= g[k * n + j] * g[k * n + j];
    if (!(d > tiny)) return false;
    const double lkk = std::sqrt(d);
    g[k * n + k] = lkk;
    for (int64_t i = k + 1; i < n; ++i) {
      double v = g[i * n + k];
      for (int64_t j = 0; j < k; ++j) v -= g[i * n + j] * g[k * n + j];
      g[i * n + k] = v / lkk;
    }
    for (int64_t j = k + 1; j < n; ++j) g[k * n + j] = 0;
  }
  return true;
}

// R_h^T [H, Dv, r] in fp64 with R_h^T R_h = W_h^T W_h, W_h = weight_o[:, h*Dv:(h+1)*Dv]
// (see the file comment for the method), and per head whether W_h is finite (a head with
// a non-finite weight gets R_h = 0 here; its out_norm comes from the product itself).
std::pair<at::Tensor, std::vector<char>> norm_factors_t(const at::Tensor& wA, int64_t H) {
  const int64_t D = wA.size(0), Dv = wA.size(1) / H;
  at::Tensor wh = wA.unflatten(1, {H, Dv}).permute({1, 0, 2}).to(at::kDouble).contiguous();  // [H, D, Dv]
  std::vector<char> w_finite(H, 1);
  auto qr_rt = [&](const at::Tensor& w) { return std::get<1>(at::linalg_qr(w, "r")).transpose(-2, -1); };
  if (wA.scalar_type() == at::kDouble || D < Dv) {
    const at::Tensor finite = at::isfinite(wh).flatten(1).all(1);  // [H]
    for (int64_t h = 0; h < H; ++h) w_finite[h] = finite[h].item<bool>();
    if (std::find(w_finite.begin(), w_finite.end(), 0) != w_finite.end())
      wh = at::where(finite.view({H, 1, 1}), wh, at::zeros({}, wh.options()));
    return {qr_rt(wh).contiguous(), w_finite};
  }
  at::Tensor l = at::empty({H, Dv, Dv}, wh.options());  // Gram [H, Dv, Dv], fp64, then its factor
  std::vector<char> ok(H);
  const double* whp = wh.data_ptr<double>();
  double* lp = l.data_ptr<double>();
  at::parallel_for(0, H, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) {
      gram_lower(whp + h * D * Dv, D, Dv, lp + h * Dv * Dv);
      ok[h] = cholesky_lower(lp + h * Dv * Dv, Dv);
    }
  });
  // A non-finite W_h makes its Gram matrix non-finite, so Cholesky fails there too: the
  // finiteness check runs only for the (rare) failed heads.
  for (int64_t h = 0; h < H; ++h) {
    if (ok[h]) continue;
    if (!at::isfinite(wh[h]).all().item<bool>()) {
      w_finite[h] = 0;
      l[h].zero_();
    } else {
      l[h].copy_(qr_rt(wh[h]));
    }
  }
  return {l, w_finite};  // L = R^T
}

template <typename T, typename A>
void forward_impl(const at::Tensor& z, const at::Tensor& wA, const c10::optional<at::Tensor>& bias,
                  const Coeffs& co, const Shape& sh, at::Tensor& out, at::Tensor* z_norm, at::Tensor* out_norm) {
  const int64_t B = sh.batch, H = sh.heads, Q = sh.seq, Dv = sh.dv, D = sh.d, K = sh.k();
  const T* zp = z.data_ptr<T>();
  const int64_t sb = z.stride(0), shh = z.stride(1), sq = z.stride(2);
  const A* w = wA.data_ptr<A>();
  const int64_t ldw = wA.stride(0);
  const T* bp = bias.has_value() ? bias->data_ptr<T>() : nullptr;
  T* op = out.data_ptr<T>();
  const bool stats = z_norm != nullptr;
  // Direct: GEMMs read z in place (no gather): rows of H*Dv contiguous elements.
  const bool direct = std::is_same_v<T, A> && (H == 1 || shh == Dv) && (Q == 1 || sq >= K);
  const int64_t ld_direct = Q == 1 ? K : sq;

  // Per head, R_h^T [Dv, r] in A, stored [Dv, rp] with zero columns up to rp (a whole
  // number of vectors) and exact zeros above the diagonal, for out_norm = ||z R_h^T||.
  const int64_t r = std::min(D, Dv);
  constexpr int64_t kLanes = cpu::Simd<A>::lanes;
  const int64_t rp = (r + kLanes - 1) / kLanes * kLanes;
  std::vector<A> lt;
  std::vector<char> w_finite;
  if (stats) {
    at::Tensor rt;
    std::tie(rt, w_finite) = norm_factors_t(wA, H);
    rt = rt.to(c10::CppTypeToScalarType<A>::value).contiguous();
    const A* rtp = rt.data_ptr<A>();
    lt.assign(static_cast<size_t>(H * Dv * rp), A(0));
    for (int64_t h = 0; h < H; ++h)
      for (int64_t j = 0; j < Dv; ++j)
        for (int64_t c = 0; c <= std::min(j, r - 1); ++c) lt[(h * Dv + j) * rp + c] = rtp[(h * Dv + j) * r + c];
  }
  if (direct && !stats) {
    // No tiles: per run of open heads, one GEMM over every row of the batch rows that
    // share the run (all of them when the gate does not depend on b and the batch rows
    // are evenly spaced), so that the BLAS threads one large product.
    auto merge_rows = [&](int64_t b0, int64_t nb) {
      A* y = reinterpret_cast<A*>(op + b0 * Q * D);
      const int64_t rows = nb * Q;
      bool first = true;
      if (bp != nullptr) {
        at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
          for (int64_t r = r0; r < r1; ++r)
            for (int64_t n = 0; n < D; ++n) y[r * D + n] = static_cast<A>(bp[n]);
        });
        first = false;
      }
      for (const Run& run : open_runs(co, b0, H, /*split_alpha=*/true, false)) {
        gemm(rows, D, (run.h1 - run.h0) * Dv, static_cast<A>(run.alpha),
             reinterpret_cast<const A*>(zp + b0 * sb) + run.h0 * Dv, ld_direct, 1, w + run.h0 * Dv, 1, ldw,
             first ? A(0) : A(1), y, D);
        first = false;
      }
      if (first) std::fill(y, y + rows * D, A(0));
    };
    bool uniform = Q > 1 && sb == Q * sq;
    for (int64_t b = 1; uniform && b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        if (co.alpha[b * H + h] != co.alpha[h] || co.g[b * H + h] != co.g[h]) uniform = false;
    if (uniform || B == 1) {
      merge_rows(0, B);
    } else {
      for (int64_t b = 0; b < B; ++b) merge_rows(b, 1);
    }
    return;
  }
  float* zn = stats ? z_norm->data_ptr<float>() : nullptr;
  float* on = stats ? out_norm->data_ptr<float>() : nullptr;

  const int64_t qtiles = (Q + kRows - 1) / kRows;
  at::parallel_for(0, B * qtiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<A> zs(direct ? 0 : static_cast<size_t>(kRows * K));
    std::vector<A> ys(std::is_same_v<T, A> ? 0 : static_cast<size_t>(kRows * D));
    std::vector<A> osq(stats ? static_cast<size_t>(kRows) : 0);  // one head's ||z_i R_h^T||^2 [rows]
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / qtiles, q0 = (t % qtiles) * kRows, rows = std::min(kRows, Q - q0);
      const std::vector<Run> runs = open_runs(co, b, H, /*split_alpha=*/true, false);
      // The tile of z: element (r, h*Dv + j) at zt + r * ldz + h * Dv + j.
      const A* zt;
      int64_t ldz;
      if (direct) {
        zt = reinterpret_cast<const A*>(zp + b * sb + q0 * sq);
        ldz = ld_direct;
      } else {
        for (const Run& run : runs)
          for (int64_t h = run.h0; h < run.h1; ++h)
            for (int64_t r = 0; r < rows; ++r) {
              const T* src = zp + b * sb + h * shh + (q0 + r) * sq;
              A* dst = zs.data() + r * K + h * Dv;
              for (int64_t j = 0; j < Dv; ++j) dst[j] = static_cast<A>(src[j]);
            }
        zt = zs.data();
        ldz = K;
      }
      if (stats) {
        for (int64_t h = 0; h < H; ++h) {
          const int64_t base = (b * Q + q0) * H + h;
          if (co.g[b * H + h] == 0.0) {  // a closed head's Z is not read
            for (int64_t i = 0; i < rows; ++i) zn[base + i * H] = on[base + i * H] = 0.f;
            continue;
          }
          projected_sum_sq_clone(zt + h * Dv, ldz, rows, lt.data() + h * Dv * rp, Dv, rp, osq.data());
          for (int64_t i = 0; i < rows; ++i) {
            const A* zr = zt + i * ldz + h * Dv;
            const A zz = sum_sq(zr, Dv);
            zn[base + i * H] = static_cast<float>(std::sqrt(zz));
            A oo = osq[i];
            if (!std::isfinite(zz) || !w_finite[h]) {
              // A z row whose sum of squares is not finite, or a non-finite W_h: the product
              // with W_h itself, as the reference forms it (z R_h^T would meet R_h's zeros as
              // inf * 0 = NaN where z W_h^T is inf).
              oo = 0;
              for (int64_t n = 0; n < D; ++n) {
                A v = 0;
                for (int64_t j = 0; j < Dv; ++j) v += zr[j] * w[n * ldw + h * Dv + j];
                oo += v * v;
              }
            }
            on[base + i * H] = static_cast<float>(std::sqrt(oo));
          }
        }
      }
      // y tile [rows, D] = sum over runs alpha_run * Z_run @ W_run^T.
      A* y = std::is_same_v<T, A> ? reinterpret_cast<A*>(op + (b * Q + q0) * D) : ys.data();
      bool first = true;
      for (const Run& run : runs) {
        gemm(rows, D, (run.h1 - run.h0) * Dv, static_cast<A>(run.alpha), zt + run.h0 * Dv, ldz, 1, w + run.h0 * Dv, 1,
             ldw, first ? A(0) : A(1), y, D);
        first = false;
      }
      if (first) std::fill(y, y + rows * D, A(0));
      T* yo = op + (b * Q + q0) * D;
      for (int64_t r = 0; r < rows; ++r) {
        A* yr = y + r * D;
        if (bp != nullptr)
          for (int64_t n = 0; n < D; ++n) yr[n] += static_cast<A>(bp[n]);
        if constexpr (!std::is_same_v<T, A>)
          for (int64_t n = 0; n < D; ++n) yo[r * D + n] = cpu::to_storage<T, A>(yr[n]);
      }
    }
  });
}

template <typename T, typename A>
void backward_impl(const at::Tensor& dy, const at::Tensor& z, const at::Tensor& wA, const Coeffs& co,
                   const Shape& sh, at::Tensor& grad_z, at::Tensor& grad_w, at::Tensor* grad_b,
                   std::vector<double>* cgate) {
  const int64_t B = sh.batch, H = sh.heads, Q = sh.seq, Dv = sh.dv, D = sh.d, K = sh.k();
  const T* zp = z.data_ptr<T>();
  const int64_t sb = z.stride(0), shh = z.stride(1), sq = z.stride(2);
  const int64_t gsb = grad_z.stride(0), gsh = grad_z.stride(1), gsq = grad_z.stride(2);
  const A* w = wA.data_ptr<A>();
  const int64_t ldw = wA.stride(0);
  T* gz = grad_z.data_ptr<T>();
  // grad_out in the accumulation type (a widened copy for bf16/fp16).
  const at::Tensor dyA = dy.scalar_type() == wA.scalar_type() ? dy : dy.to(wA.scalar_type());
  const A* g = dyA.data_ptr<A>();
  const bool need_c = cgate != nullptr;
  const int64_t qtiles = (Q + kRows - 1) / kRows;
  std::vector<A> cpart(need_c ? static_cast<size_t>(B * qtiles * H) : 0, A(0));
  const int64_t rows_all = B * Q;
  // Runs of the heads open in some batch row of the flattened rows [f0, f0 + rows): the
  // GEMMs of a chunk skip heads closed in every batch row it covers.
  auto runs_for_rows = [&](int64_t f0, int64_t rows) {
    std::vector<Run> runs;
    const int64_t b0 = f0 / Q, b1 = (f0 + rows - 1) / Q;
    for (int64_t h = 0; h < H; ++h) {
      bool any_open = false;
      for (int64_t b = b0; b <= b1; ++b) any_open = any_open || co.g[b * H + h] != 0.0;
      if (!any_open) continue;
      if (!runs.empty() && runs.back().h1 == h) {
        runs.back().h1 = h + 1;
      } else {
        runs.push_back({h, h + 1, 1.0});
      }
    }
    return runs;
  };

  const bool direct_dz = std::is_same_v<T, A> && !need_c && (H == 1 || gsh == Dv) && Q > 1 && gsq >= K;
  if (direct_dz) {
    // grad_z written by the GEMMs in place: per run of open heads with one alpha,
    // grad_z[rows, run] = alpha * dy[rows, :] @ W_run over all rows of the batch rows that
    // share the run; closed heads' columns are zero-filled.
    auto dz_rows = [&](int64_t b0, int64_t nb) {
      const int64_t rows = nb * Q;
      A* gzb = reinterpret_cast<A*>(gz + b0 * gsb);
      for (const Run& run : open_runs(co, b0, H, /*split_alpha=*/true, false))
        gemm(rows, (run.h1 - run.h0) * Dv, D, static_cast<A>(run.alpha), g + b0 * Q * D, D, 1, w + run.h0 * Dv, ldw,
             1, A(0), gzb + run.h0 * Dv, gsq);
      for (int64_t h = 0; h < H; ++h) {
        if (co.g[b0 * H + h] != 0.0) continue;
        for (int64_t r = 0; r < rows; ++r) std::fill(gzb + r * gsq + h * Dv, gzb + r * gsq + (h + 1) * Dv, A(0));
      }
    };
    bool uniform = gsb == Q * gsq;
    for (int64_t b = 1; uniform && b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        if (co.alpha[b * H + h] != co.alpha[h] || co.g[b * H + h] != co.g[h]) uniform = false;
    if (uniform || B == 1) {
      dz_rows(0, B);
    } else {
      for (int64_t b = 0; b < B; ++b) dz_rows(b, 1);
    }
  }
  // Any other layout, without the gate's gradient: fixed-order chunks of kChunkRows rows
  // of the flattened [B*Q] axis; per chunk one BLAS GEMM per run (threaded by the BLAS)
  // P = grad_out[rows] @ W_run into an uninitialized, reused scratch, then scattered into
  // grad_z's layout scaled by alpha (zeros for closed heads) by parallel rows.
  const bool chunked_dz = !direct_dz && !need_c;
  if (chunked_dz) {
    const int64_t chunk = std::min(rows_all, kChunkRows);
    std::unique_ptr<A[]> pbuf(new A[static_cast<size_t>(chunk * K)]);
    for (int64_t f0 = 0; f0 < rows_all; f0 += chunk) {
      const int64_t rows = std::min(chunk, rows_all - f0);
      for (const Run& run : runs_for_rows(f0, rows))
        gemm(rows, (run.h1 - run.h0) * Dv, D, A(1), g + f0 * D, D, 1, w + run.h0 * Dv, ldw, 1, A(0),
             pbuf.get() + run.h0 * Dv, K);
      at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t b = (f0 + r) / Q, q = (f0 + r) % Q;
          for (int64_t h = 0; h < H; ++h) {
            T* dst = gz + b * gsb + h * gsh + q * gsq;
            if (co.g[b * H + h] == 0.0) {
              std::fill(dst, dst + Dv, T(0));
              continue;
            }
            const A alpha = static_cast<A>(co.alpha[b * H + h]);
            const A* pr = pbuf.get() + r * K + h * Dv;
            for (int64_t j = 0; j < Dv; ++j) dst[j] = cpu::to_storage<T, A>(alpha * pr[j]);
          }
        }
      });
    }
  }
  // With the gate's gradient: grad_z and the gate's <Z, P> partials per tile of rows of
  // one batch row (partials summed in tile order).
  if (!direct_dz && !chunked_dz) at::parallel_for(0, B * qtiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<A> p(static_cast<size_t>(kRows * K));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / qtiles, q0 = (t % qtiles) * kRows, rows = std::min(kRows, Q - q0);
      const A* gt = g + (b * Q + q0) * D;
      for (const Run& run : open_runs(co, b, H, false, need_c))
        gemm(rows, (run.h1 - run.h0) * Dv, D, A(1), gt, D, 1, w + run.h0 * Dv, ldw, 1, A(0), p.data() + run.h0 * Dv, K);
      for (int64_t h = 0; h < H; ++h) {
        const bool open = co.g[b * H + h] != 0.0;
        const A alpha = static_cast<A>(co.alpha[b * H + h]);
        A c = 0;
        for (int64_t r = 0; r < rows; ++r) {
          const A* pr = p.data() + r * K + h * Dv;
          T* dst = gz + b * gsb + h * gsh + (q0 + r) * gsq;
          if (need_c) {
            const T* zr = zp + b * sb + h * shh + (q0 + r) * sq;
            for (int64_t j = 0; j < Dv; ++j) c += static_cast<A>(zr[j]) * pr[j];
          }
          if (open) {
            for (int64_t j = 0; j < Dv; ++j) dst[j] = cpu::to_storage<T, A>(alpha * pr[j]);
          } else {
            for (int64_t j = 0; j < Dv; ++j) dst[j] = T(0);
          }
        }
        if (need_c) cpart[t * H + h] = c;
      }
    }
  });
  if (need_c) {
    cgate->assign(B * H, 0.0);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < qtiles; ++t)
        for (int64_t h = 0; h < H; ++h) (*cgate)[b * H + h] += static_cast<double>(cpart[(b * qtiles + t) * H + h]);
  }

  // grad_weight_o = grad_out^T [D, B*Q] @ Zs [B*Q, K] with Zs[(b, q), h] = alpha[b,h] Z[b,h,q]:
  // one GEMM per run of heads open in some batch row (the orientation of nn.Linear's weight
  // gradient); Zs is z itself when z is that matrix in place and alpha == 1, else gathered
  // chunk by chunk.
  A* gw = grad_w.data_ptr<A>();
  for (int64_t h = 0; h < H; ++h) {  // heads closed in every batch row: zero columns
    bool any_open = false;
    for (int64_t b = 0; b < B; ++b) any_open = any_open || co.g[b * H + h] != 0.0;
    if (!any_open)
      for (int64_t n = 0; n < D; ++n) std::fill(gw + n * K + h * Dv, gw + n * K + (h + 1) * Dv, A(0));
  }
  const bool direct_w = std::is_same_v<T, A> && co.all_one && (H == 1 || shh == Dv) && (B == 1 || sb == Q * sq) &&
                        (rows_all <= 1 || sq >= K) && (B == 1 || Q > 1);
  const int64_t chunk = std::min(rows_all, kChunkRows);
  if (direct_w) {
    // z in place (alpha == 1: every head open). The contraction over rows runs in
    // fixed-order chunks too: one GEMM over all B*Q rows lets the BLAS split that long
    // contraction across threads, which changed the bits with the thread count.
    const A* zs = reinterpret_cast<const A*>(zp);
    const int64_t ldzs = rows_all <= 1 ? K : sq;
    for (int64_t f0 = 0; f0 < rows_all; f0 += chunk)
      gemm(D, K, std::min(chunk, rows_all - f0), A(1), g + f0 * D, 1, D, zs + f0 * ldzs, ldzs, 1,
           f0 == 0 ? A(0) : A(1), gw, K);
  } else {
    // Chunks of at most kChunkRows rows of the flattened [B*Q] row axis, in a fixed
    // order: each is gathered (scaled by alpha, closed heads zero; uninitialized scratch,
    // reused) and accumulated into grad_weight_o by one GEMM per run, so that the
    // temporary stays a few MiB at any B*Q and results do not depend on the thread count.
    std::unique_ptr<A[]> zbuf(new A[static_cast<size_t>(chunk * K)]);
    // Every head's columns of grad_weight_o start at 0 (beta = 0 on a head's first
    // GEMM); a chunk accumulates only the heads open in its batch rows.
    std::vector<char> started(H, 0);
    for (int64_t f0 = 0; f0 < rows_all; f0 += chunk) {
      const int64_t rows = std::min(chunk, rows_all - f0);
      const std::vector<Run> runs = runs_for_rows(f0, rows);
      at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t b = (f0 + r) / Q, q = (f0 + r) % Q;
          for (const Run& run : runs)
            for (int64_t h = run.h0; h < run.h1; ++h) {
              A* dst = zbuf.get() + r * K + h * Dv;
              if (co.g[b * H + h] == 0.0) {
                std::fill(dst, dst + Dv, A(0));
                continue;
              }
              const A a = static_cast<A>(co.alpha[b * H + h]);
              const T* src = zp + b * sb + h * shh + q * sq;
              for (int64_t j = 0; j < Dv; ++j) dst[j] = a * static_cast<A>(src[j]);
            }
        }
      });
      for (const Run& run : runs) {
        // Split the run where some heads start and others accumulate.
        int64_t h0 = run.h0;
        while (h0 < run.h1) {
          int64_t h1 = h0 + 1;
          while (h1 < run.h1 && started[h1] == started[h0]) ++h1;
          gemm(D, (h1 - h0) * Dv, rows, A(1), g + f0 * D, 1, D, zbuf.get() + h0 * Dv, K, 1,
               started[h0] ? A(1) : A(0), gw + h0 * Dv, K);
          for (int64_t h = h0; h < h1; ++h) started[h] = 1;
          h0 = h1;
        }
      }
    }
  }

  if (grad_b != nullptr) {
    A* gb = grad_b->data_ptr<A>();
    const int64_t rows = B * Q;
    at::parallel_for(0, D, 256, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) gb[n] = 0;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t n = n0; n < n1; ++n) gb[n] += g[r * D + n];
    });
  }
}

template <typename F>
void dispatch_cpu(at::ScalarType dt, const char* op, F&& f) {
  switch (dt) {
    case at::kFloat: f(float{}, float{}); break;
    case at::kDouble: f(double{}, double{}); break;
    case at::kBFloat16: f(c10::BFloat16{}, float{}); break;
    case at::kHalf: f(c10::Half{}, float{}); break;
    default: TORCH_CHECK_TYPE(false, "headwise.", op, ": z must be float32, bfloat16, float16 or float64, got ", dt);
  }
}

void check_cpu(const at::Tensor& z, const char* op) {
  TORCH_CHECK(z.device().is_cpu(), "headwise.", op, ": z is on ", z.device(),
              " but the CPU backend takes CPU tensors");
}

// weight_o in the accumulation dtype with stride-1 rows (no copy for fp32/fp64).
at::Tensor weight_acc(const at::Tensor& weight_o) {
  const auto acc = weight_o.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor w = weight_o.to(acc);
  if (w.stride(1) != 1 || (w.size(0) > 1 && w.stride(0) < w.size(1))) w = w.contiguous();
  return w;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> head_merge_cpu(const at::Tensor& z, const at::Tensor& weight_o,
                                                              const c10::optional<at::Tensor>& bias,
                                                              const c10::optional<at::Tensor>& head_gate,
                                                              bool rescale, bool return_stats) {
  HW_OP_RANGE("headwise::head_merge");
  constexpr const char* op = "head_merge";
  const Shape s = check_merge_args(op, z, weight_o, head_gate);
  if (bias.has_value()) check_bias(op, *bias, z, s);
  check_cpu(z, op);
  at::Tensor out = new_output({s.batch, s.seq, s.d}, z.options());
  const auto f32 = z.options().dtype(at::kFloat);
  at::Tensor z_norm = return_stats ? new_output({s.batch, s.seq, s.heads}, f32) : at::empty({0}, f32);
  at::Tensor out_norm = return_stats ? new_output({s.batch, s.seq, s.heads}, f32) : at::empty({0}, f32);
  if (s.rows() == 0) return {out, z_norm, out_norm};
  const Coeffs co = make_coeffs(head_gate, rescale, s);
  const at::Tensor wA = weight_acc(weight_o);
  const c10::optional<at::Tensor> b = bias.has_value() ? c10::optional<at::Tensor>(bias->contiguous()) : c10::nullopt;
  dispatch_cpu(z.scalar_type(), op, [&](auto t, auto a) {
    using T = decltype(t);
    using A = decltype(a);
    forward_impl<T, A>(z, wA, b, co, s, out, return_stats ? &z_norm : nullptr, return_stats ? &out_norm : nullptr);
  });
  return {out, z_norm, out_norm};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> head_merge_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& z, const at::Tensor& weight_o,
    const c10::optional<at::Tensor>& head_gate, bool rescale, bool bias_grad, bool gate_grad) {
  HW_OP_RANGE("headwise::head_merge_backward");
  constexpr const char* op = "head_merge_backward";
  const Shape s = check_merge_args(op, z, weight_o, head_gate);
  check_grad_out(op, grad_out, z, s);
  check_cpu(z, op);
  const at::Tensor dy = grad_out.contiguous();
  const at::Tensor wA = weight_acc(weight_o);
  at::Tensor grad_z = empty_like_layout(z, z.options());
  if (poison_outputs()) grad_z.fill_(std::numeric_limits<double>::quiet_NaN());
  at::Tensor grad_wA = new_output({s.d, s.k()}, z.options().dtype(wA.scalar_type()));
  at::Tensor grad_bA = bias_grad ? new_output({s.d}, z.options().dtype(wA.scalar_type()))
                                 : at::empty({0}, z.options());
  const bool need_c = gate_grad && head_gate.has_value();
  const Coeffs co = make_coeffs(head_gate, rescale, s);
  std::vector<double> c;
  if (s.rows() == 0) {
    grad_wA.zero_();
    if (bias_grad) grad_bA.zero_();
    c.assign(s.batch * s.heads, 0.0);
  } else {
    dispatch_cpu(z.scalar_type(), op, [&](auto t, auto a) {
      using T = decltype(t);
      using A = decltype(a);
      backward_impl<T, A>(dy, z, wA, co, s, grad_z, grad_wA, bias_grad ? &grad_bA : nullptr, need_c ? &c : nullptr);
    });
  }
  at::Tensor grad_gate = at::empty({0}, z.options());
  if (need_c) {
    // dL/dg[b,h] = s[b] c[b,h] + ds/dS[b] sum_h' g[b,h'] c[b,h'].
    const int64_t B = s.batch, H = s.heads;
    at::Tensor gg = at::empty({B, H}, z.options().dtype(at::kDouble));
    double* p = gg.data_ptr<double>();
    for (int64_t b = 0; b < B; ++b) {
      double gc = 0;
      for (int64_t h = 0; h < H; ++h) gc += co.g[b * H + h] * c[b * H + h];
      // The rescale term only where it is active: 0 * (a NaN of another head) must not reach
      // this head's gradient.
      for (int64_t h = 0; h < H; ++h)
        p[b * H + h] = co.dsds[b] != 0.0 ? co.s[b] * c[b * H + h] + co.dsds[b] * gc : co.s[b] * c[b * H + h];
    }
    if (head_gate->dim() == 1) gg = gg.sum(0);
    grad_gate = gg.to(head_gate->scalar_type());
  }
  return {grad_z, grad_wA.to(weight_o.scalar_type()), bias_grad ? grad_bA.to(z.scalar_type()) : grad_bA, grad_gate};
}

}  // namespace merge
}  // namespace headwise
