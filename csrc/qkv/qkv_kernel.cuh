// Fused QKV projection: device code of the split epilogue and its backward (SPEC
// section 2). Compiled by nvcc for the GPU and by the host compiler against the SIMT
// emulator.
//
// Why a library GEMM plus one fused epilogue (and not a hand-written tensor-core GEMM
// carrying the split in its epilogue): the product x @ W^T is >95% of the FLOPs and
// cuBLAS(Lt) runs it near peak on sm_90 (wgmma, TMA, tuned tiles for every shape),
// which a hand-written GEMM would have to match before its fused epilogue could pay
// off; what eager code loses is not the GEMM but the 5-10 extra memory passes after it
// (split, transpose + contiguous, the norm's fp32 casts and reductions, rotate-half's
// cat, the scale). One epilogue kernel that reads each token's packed row once and
// writes every head straight into its head-major output removes all of them for one
// extra read + write of the packed product (B*S*N_total elements, a few percent of the
// GEMM's time at model widths). This choice was made without a GPU to measure on; the
// GPU benchmark (python -m headwise.bench qkv --device cuda) reports it against the
// bare GEMM (SPEC section 7's 1.1x target), and a GEMM with the epilogue fused in is
// the next step if that ratio is missed.
//
// Math per token m = (b, t) and head (role r, index i), packed row y = P[m, off .. off+w)
// (P = x W^T + bias from the library GEMM, rounded to T as F.linear rounds; w = head_dim,
// or v_head_dim for V):
//   y       = round_T(y * rsqrt(mean(y^2) + eps)) * g (q and k with norm weights g; the
//             product is rounded to T again when g is stored in T, as weight * h rounds)
//   y[:R]   = y[:R] * cos[b, t] + rotate(y[:R]) * sin[b, t]   (q and k with rope; R = the
//             tables' width <= w, the dims from R on pass through; rotate pairs (p, p + R/2)
//             for rotate-half, (2p, 2p + 1) for GPT-J interleaved, see RopeStyle in
//             qkv_args.h; the tables are [S, R] shared by the batch or [B, S, R] per row)
//   y      *= scale_q                                 (q)
//   out_r[b, i, t, :] = T(y)
// Backward, given the head-major gradient g:
//   g      *= scale_q; g = rope^T(g)   (pair (lo, hi): g[lo] c[lo] + g[hi] s[hi],
//                                        g[hi] c[hi] - g[lo] s[lo])
//   norm:  dg_w += g * round_T(y r); du = g * w; dy = r du - r^3 y <du, y> / w
//   G[m, off .. off+w) = T(dy)     (then dx = G W, dW = G^T x, db = sum G by GEMMs)
//
// Thread layout: a warp handles one (token, head) at a time. Lane l owns the element
// pairs (p, p + half) for p = l + 32 i < half, half = ceil(w / 2), so the rotate-half
// partners of a full-width rotate-half rope sit in one thread's registers; ITEMS =
// ceil(half / 32) <= 4, i.e. widths up to 256. The other rotary forms (partial, R < w;
// interleaved pairs) stage the warp's row in shared memory (one w-float row per warp,
// two __syncwarp per head), where each lane reads the partners of its elements; they are
// the STAGED_ROPE instantiations, so the other calls keep their registers and occupancy.
#pragma once

#include "../common/block_reduce.cuh"
#include "../common/simt_portability.h"
#include "../common/vec.cuh"

#include <cstdint>

namespace headwise {
namespace qkv {

constexpr int kWarpsPerBlock = 4;
constexpr int kMaxWidth = 256;
// Heads per call (hq + 2 hkv). The head offsets travel inside the kernel parameters
// (2 KiB, under the 4 KiB parameter limit), so a launch needs no host-to-device copy
// and no synchronization, and can be captured in a CUDA graph.
constexpr int kMaxHeads = 512;

struct Geometry {
  int32_t head_offsets[kMaxHeads];  // first packed row of each head (q, k, v heads)
  const float* q_norm;          // [d] or nullptr
  const float* k_norm;          // [d] or nullptr
  const float* cos;             // [S, rot] or [B, S, rot], or nullptr
  const float* sin;             // like cos
  float scale_q, eps;
  bool q_norm_rounds, k_norm_rounds;  // that norm weight is stored in T: round y * g to T
  bool interleaved;                   // rope pairs (2p, 2p + 1), else (p, p + rot / 2)
  int64_t tokens, seq, rows, hq, hkv, d, dv;
  int64_t rot, rope_batch_stride;     // rope width (even, <= d); 0 or S * rot
};

// The partner of element j < rot and the sign of its sine term in the forward
// (out[j] = y[j] c[j] + sign * y[partner] s[j]): -1 for the pair's low element.
__device__ __forceinline__ int64_t rope_partner(const Geometry& g, int64_t j, float& sign) {
  if (g.interleaved) {
    sign = (j & 1) ? 1.f : -1.f;
    return j ^ 1;
  }
  const int64_t rh = g.rot / 2;
  sign = j < rh ? -1.f : 1.f;
  return j < rh ? j + rh : j - rh;
}

// Rope through the warp's staging row `st` (kMaxWidth floats): the lane's elements
// (q, q + half) of a[] / c[] are rotated (forward) or rotated back (backward, the
// transpose: out[j] = v[j] c[j] - sign * v[partner] s[partner]) over the leading rot dims.
template <bool BACKWARD, int ITEMS>
__device__ __forceinline__ void rope_staged_apply(const Geometry& g, float* st, const float* cs, const float* sn,
                                                  int64_t width, int64_t half, float (&a)[ITEMS],
                                                  float (&c)[ITEMS]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int64_t q = lane + 32 * i;
    if (q < half) {
      st[q] = a[i];
      if (q + half < width) st[q + half] = c[i];
    }
  }
  __syncwarp();
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int64_t q = lane + 32 * i;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int64_t j = q + e * half;
      if (q < half && j < g.rot) {
        float sign;
        const int64_t k = rope_partner(g, j, sign);
        const float v = BACKWARD ? st[j] * cs[j] - sign * st[k] * sn[k] : st[j] * cs[j] + sign * st[k] * sn[j];
        if (e == 0) a[i] = v; else c[i] = v;
      }
    }
  }
  __syncwarp();
}

struct FwdParams {
  Geometry g;
  const void* packed;  // [tokens, rows] contiguous, storage dtype
  void* out[3];        // q [B, hq, S, d], k [B, hkv, S, d], v [B, hkv, S, dv] contiguous
};

struct BwdParams {
  Geometry g;
  const void* packed;   // [tokens, rows] or nullptr (needed with a norm)
  const void* grad[3];  // grad_q, grad_k, grad_v, head-major contiguous
  void* grad_packed;    // [tokens, rows]
  float* partial;       // [gridDim.x * kWarpsPerBlock, 2, d]: per-warp norm-weight sums
};

struct HeadInfo {
  int role;   // 0 q, 1 k, 2 v
  int64_t index, width, heads, offset;
  const float* norm;
};

__device__ __forceinline__ HeadInfo head_info(const Geometry& g, int64_t h) {
  HeadInfo hi;
  if (h < g.hq) {
    hi.role = 0; hi.index = h; hi.width = g.d; hi.heads = g.hq; hi.norm = g.q_norm;
  } else if (h < g.hq + g.hkv) {
    hi.role = 1; hi.index = h - g.hq; hi.width = g.d; hi.heads = g.hkv; hi.norm = g.k_norm;
  } else {
    hi.role = 2; hi.index = h - g.hq - g.hkv; hi.width = g.dv; hi.heads = g.hkv; hi.norm = nullptr;
  }
  hi.offset = g.head_offsets[h];
  return hi;
}

// Loads the lane's pairs of the packed row (zeros outside the head).
template <typename T, int ITEMS>
__device__ __forceinline__ void load_pairs(const T* row, const HeadInfo& hi, int64_t half,
                                           float (&a)[ITEMS], float (&c)[ITEMS]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int64_t p = lane + 32 * i;
    a[i] = 0.f;
    c[i] = 0.f;
    if (p < half) {
      a[i] = static_cast<float>(row[hi.offset + p]);
      if (p + half < hi.width) c[i] = static_cast<float>(row[hi.offset + p + half]);
    }
  }
}

template <int ITEMS>
__device__ __forceinline__ float rms_scale(const float (&a)[ITEMS], const float (&c)[ITEMS], int64_t width,
                                           float eps) {
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) ss += a[i] * a[i] + c[i] * c[i];
  ss = hw::warp_sum(ss);
  return rsqrtf(ss / static_cast<float>(width) + eps);
}

template <typename T, int ITEMS, bool STAGED_ROPE>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) qkv_epilogue_fwd_kernel(const FwdParams p) {
  const Geometry& g = p.g;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int64_t heads = g.hq + 2 * g.hkv;
  __shared__ float stage[kWarpsPerBlock][STAGED_ROPE ? kMaxWidth : 1];  // the warp's row (STAGED_ROPE)
  for (int64_t m = blockIdx.x; m < g.tokens; m += gridDim.x) {
    const int64_t b = m / g.seq;
    const int64_t t = m - b * g.seq;
    const T* row = static_cast<const T*>(p.packed) + m * g.rows;
    const int64_t rope_row = b * g.rope_batch_stride + t * g.rot;  // of token (b, t) in cos / sin
    for (int64_t h = warp; h < heads; h += kWarpsPerBlock) {
      const HeadInfo hi = head_info(g, h);
      const int64_t half = (hi.width + 1) / 2;
      float a[ITEMS], c[ITEMS];
      load_pairs<T, ITEMS>(row, hi, half, a, c);
      if (hi.norm != nullptr) {
        const float r = rms_scale(a, c, hi.width, g.eps);
        const bool rounds = hi.role == 0 ? g.q_norm_rounds : g.k_norm_rounds;
#pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
          const int64_t q = lane + 32 * i;
          if (q < half) {
            a[i] = hw::round_to<T>(a[i] * r) * hi.norm[q];
            if (rounds) a[i] = hw::round_to<T>(a[i]);
            if (q + half < hi.width) {
              c[i] = hw::round_to<T>(c[i] * r) * hi.norm[q + half];
              if (rounds) c[i] = hw::round_to<T>(c[i]);
            }
          }
        }
      }
      const float scale = hi.role == 0 ? g.scale_q : 1.f;
      T* dst = static_cast<T*>(p.out[hi.role]) + ((b * hi.heads + hi.index) * g.seq + t) * hi.width;
      const bool rotate = g.cos != nullptr && hi.role != 2;
      const bool staged = STAGED_ROPE && rotate;
      const float* cs = rotate ? g.cos + rope_row : nullptr;
      const float* sn = rotate ? g.sin + rope_row : nullptr;
      if (staged) rope_staged_apply<false, ITEMS>(g, stage[warp], cs, sn, hi.width, half, a, c);
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int64_t q = lane + 32 * i;
        if (q >= half) continue;
        float lo = a[i], hi_v = c[i];
        if (rotate && !staged) {  // full-width rotate-half: the partners are (q, q + half)
          lo = a[i] * cs[q] - c[i] * sn[q];
          hi_v = c[i] * cs[q + half] + a[i] * sn[q + half];
        }
        dst[q] = static_cast<T>(lo * scale);
        if (q + half < hi.width) dst[q + half] = static_cast<T>(hi_v * scale);
      }
    }
  }
}

// Persistent blocks over tokens (gridDim.x fixed by the host, independent of the
// device): each warp sums its norm-weight gradient contributions in registers over the
// (token, head) pairs it handles, in a fixed order, and stores them as one partial row;
// qkv_norm_grad_slices_kernel + qkv_norm_grad_reduce_kernel sum the partials in a fixed
// order. No atomics.
template <typename T, int ITEMS, bool STAGED_ROPE>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) qkv_epilogue_bwd_kernel(const BwdParams p) {
  const Geometry& g = p.g;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int64_t heads = g.hq + 2 * g.hkv;
  const int64_t half_d = (g.d + 1) / 2;
  float acc[2][ITEMS][2] = {};  // [q_norm / k_norm][item][pair element]
  __shared__ float stage[kWarpsPerBlock][STAGED_ROPE ? kMaxWidth : 1];  // the warp's row (STAGED_ROPE)
  for (int64_t m = blockIdx.x; m < g.tokens; m += gridDim.x) {
    const int64_t b = m / g.seq;
    const int64_t t = m - b * g.seq;
    const int64_t rope_row = b * g.rope_batch_stride + t * g.rot;  // of token (b, t) in cos / sin
    for (int64_t h = warp; h < heads; h += kWarpsPerBlock) {
      const HeadInfo hi = head_info(g, h);
      const int64_t half = (hi.width + 1) / 2;
      const T* src = static_cast<const T*>(p.grad[hi.role]) + ((b * hi.heads + hi.index) * g.seq + t) * hi.width;
      const float scale = hi.role == 0 ? g.scale_q : 1.f;
      const bool rotate = g.cos != nullptr && hi.role != 2;
      const bool staged = STAGED_ROPE && rotate;
      const float* cs = rotate ? g.cos + rope_row : nullptr;
      const float* sn = rotate ? g.sin + rope_row : nullptr;
      float ga[ITEMS], gc[ITEMS];
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int64_t q = lane + 32 * i;
        ga[i] = 0.f;
        gc[i] = 0.f;
        if (q < half) {
          ga[i] = static_cast<float>(src[q]) * scale;
          if (q + half < hi.width) gc[i] = static_cast<float>(src[q + half]) * scale;
          if (rotate && !staged) {  // full-width rotate-half: the partners are (q, q + half)
            const float lo = ga[i] * cs[q] + gc[i] * sn[q + half];
            gc[i] = gc[i] * cs[q + half] - ga[i] * sn[q];
            ga[i] = lo;
          }
        }
      }
      if (staged) rope_staged_apply<true, ITEMS>(g, stage[warp], cs, sn, hi.width, half, ga, gc);
      if (hi.norm != nullptr) {
        const T* row = static_cast<const T*>(p.packed) + m * g.rows;
        float ya[ITEMS], yc[ITEMS];
        load_pairs<T, ITEMS>(row, hi, half, ya, yc);
        const float r = rms_scale(ya, yc, hi.width, g.eps);
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
          const int64_t q = lane + 32 * i;
          if (q < half) {
            // (Both accumulators are updated with a select so they stay in registers.)
            const float da = ga[i] * hw::round_to<T>(ya[i] * r);
            acc[0][i][0] += hi.role == 0 ? da : 0.f;
            acc[1][i][0] += hi.role == 0 ? 0.f : da;
            ga[i] *= hi.norm[q];
            if (q + half < hi.width) {
              const float dc = gc[i] * hw::round_to<T>(yc[i] * r);
              acc[0][i][1] += hi.role == 0 ? dc : 0.f;
              acc[1][i][1] += hi.role == 0 ? 0.f : dc;
              gc[i] *= hi.norm[q + half];
            }
          }
          dot += ga[i] * ya[i] + gc[i] * yc[i];
        }
        dot = hw::warp_sum(dot);
        const float k = r * r * r * dot / static_cast<float>(hi.width);
#pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
          ga[i] = r * ga[i] - k * ya[i];
          gc[i] = r * gc[i] - k * yc[i];
        }
      }
      T* dst = static_cast<T*>(p.grad_packed) + m * g.rows + hi.offset;
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int64_t q = lane + 32 * i;
        if (q < half) {
          dst[q] = static_cast<T>(ga[i]);
          if (q + half < hi.width) dst[q + half] = static_cast<T>(gc[i]);
        }
      }
    }
  }
  // This warp's partial row: [2, d], element (p, p + half_d) pairs as in the loop.
  float* part = p.partial + (static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp) * 2 * g.d;
#pragma unroll
  for (int n = 0; n < 2; ++n) {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int64_t q = lane + 32 * i;
      if (q < half_d) {
        part[n * g.d + q] = acc[n][i][0];
        if (q + half_d < g.d) part[n * g.d + q + half_d] = acc[n][i][1];
      }
    }
  }
}

// The norm-weight gradient reduction, a fixed-order two-level tree over the backward's
// partial rows [count, cols] (cols = 2 d, count = 4 x the backward's fixed grid):
//   level 1 (qkv_norm_grad_slices_kernel): grid (ceil(cols / 32), kReduceSlices); block
//     (c, sl) sums rows [sl * per, (sl + 1) * per) (per = ceil(count / kReduceSlices)) of
//     its 32 columns: warp w takes rows w, w + kReduceWarps, ... in order (one 128-byte
//     coalesced row segment per warp load), then the kReduceWarps warp sums are added in
//     warp order through shared memory -> slices [kReduceSlices, cols];
//   level 2 (qkv_norm_grad_reduce_kernel): the kReduceSlices slice rows in order.
// The order depends only on count and these constants, never on the device: the same bits
// on every GPU, no atomics. Traffic: count * cols * 4 bytes read once (2 MiB at d = 128),
// spread over (cols / 32) * 64 CTAs instead of one.
constexpr int kReduceWarps = 8;
constexpr int kReduceSlices = 64;

__global__ void __launch_bounds__(kReduceWarps * 32)
    qkv_norm_grad_slices_kernel(const float* partial, int64_t count, int64_t cols, float* slices) {
  __shared__ float warp_sums[kReduceWarps][32];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * 32 + lane;
  const int64_t per = (count + kReduceSlices - 1) / kReduceSlices;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * per;
  const int64_t r1 = r0 + per < count ? r0 + per : count;
  float sum = 0.f;
  if (j < cols) {
#pragma unroll 4
    for (int64_t r = r0 + warp; r < r1; r += kReduceWarps) sum += partial[r * cols + j];
  }
  warp_sums[warp][lane] = sum;
  __syncthreads();
  if (warp == 0 && j < cols) {
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kReduceWarps; ++w) total += warp_sums[w][lane];
    slices[static_cast<int64_t>(blockIdx.y) * cols + j] = total;
  }
}

// out[j] = sum over the `count` partial rows of partial[., j], in row order (j < cols).
__global__ void qkv_norm_grad_reduce_kernel(const float* partial, int64_t count, int64_t cols, float* out) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= cols) return;
  float s = 0.f;
  for (int64_t i = 0; i < count; ++i) s += partial[i * cols + j];
  out[j] = s;
}

}  // namespace qkv
}  // namespace headwise
