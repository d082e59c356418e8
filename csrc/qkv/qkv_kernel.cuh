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
// Two kernel families, chosen per call by the host (qkv_launch.h, vector_path()):
//
// 16-byte path (qkv_epilogue_{fwd,bwd}_kernel): every head of the call is whole 16-byte
// vectors (head widths, head offsets and N_total multiples of V = 16 / sizeof(T): 8 for
// bf16/fp16, 4 for fp32) at 16-byte aligned addresses, at most 32 vectors wide. A head
// is owned by a group of G lanes (G = the widest head's vectors rounded up to a power of
// two, <= 32): lane p of the group holds elements [p V, p V + V) as one 16-byte load or
// store (a 128-wide bf16 head is 16 lanes x 8, so one warp request moves two heads, 512
// contiguous bytes each way, at the ideal 16 sectors). The norm statistics are xor-
// shuffle sums over the group (fixed order). Interleaved rope pairs sit in one vector;
// rotate-half partners, R/2 = P V elements apart, are one __shfl_sync from the lane P
// away (R/2 a multiple of V, every full-width rope), else read from the group's row
// staged in shared memory (partial rotary with R/2 not whole vectors). A 128-thread
// block takes tokens in turn; its kVecThreads / G groups split the token's heads, U heads
// per group per iteration (U = 4 forward, 2 backward), and every global load of an
// iteration (U packed / gradient vectors; at the token's first iteration also its rope
// table row and, once per block, the norm weights, both staged in shared memory) is
// issued before the iteration's first shuffle reduction. Bytes in flight per block and
// iteration (128-wide bf16 heads): 8 groups x U heads x 256 B = 8 KiB forward, 8 x 2 x
// 512 B = 8 KiB backward; __launch_bounds__(128, 4) keeps 4 blocks per SM resident
// (<= 128 registers), 32 KiB per SM against the ~25 KiB HBM needs.
//
// Scalar fallback (qkv_epilogue_{fwd,bwd}_scalar_kernel): misaligned views, widths that
// are not whole vectors, heads over 32 vectors (fp32 heads over 128). The path does not
// depend on the rope, so a call with and without it sums its norm statistics alike. A warp handles one (token, head) at a time. Lane
// l owns the element pairs (p, p + half) for p = l + 32 i < half, half = ceil(w / 2), so
// the rotate-half partners of a full-width rotate-half rope sit in one thread's
// registers; ITEMS = ceil(half / 32) <= 4, i.e. widths up to 256. The other rotary forms
// (partial, R < w; interleaved pairs) stage the warp's row in shared memory (one w-float
// row per warp, two __syncwarp per head), where each lane reads the partners of its
// elements; they are the STAGED_ROPE instantiations, so the other calls keep their
// registers and occupancy.
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
  int32_t group_lanes;                // 16-byte path: lanes per head (a power of two <= 32)
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
// (q, q + half) of a[] / c[] over the leading rot dims, each replaced by
// rotate(i, e, j, k, sign, y[j], y[k]) (element j, e = 0 for a[i] and 1 for c[i], k its
// partner, sign as in rope_partner): the forward's y[j] c[j] + sign y[k] s[j], or the
// backward's transpose v[j] c[j] - sign v[k] s[k].
template <int ITEMS, typename Rotate>
__device__ __forceinline__ void rope_staged(const Geometry& g, float* st, int64_t width, int64_t half,
                                            float (&a)[ITEMS], float (&c)[ITEMS], const Rotate& rotate) {
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
        const float v = rotate(i, e, j, k, sign, st[j], st[k]);
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
  float* partial;       // norm-weight sums [rows, 2, d]: one row per block (16-byte path)
                        // or per warp (scalar fallback)
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

// Loads the lane's pairs of a norm weight (ones outside the head), so that they are in
// flight before the norm's shuffle reduction.
template <int ITEMS>
__device__ __forceinline__ void load_norm_pairs(const float* norm, int64_t width, int64_t half,
                                                float (&wa)[ITEMS], float (&wc)[ITEMS]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int64_t p = lane + 32 * i;
    wa[i] = 1.f;
    wc[i] = 1.f;
    if (p < half) {
      wa[i] = norm[p];
      if (p + half < width) wc[i] = norm[p + half];
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
__global__ void __launch_bounds__(kWarpsPerBlock * 32) qkv_epilogue_fwd_scalar_kernel(const FwdParams p) {
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
      const bool rotate = g.cos != nullptr && hi.role != 2;
      // Every load of the head before the norm's reduction: the lane's table entries
      // (cos / sin at elements q: ca, sa; q + half: cc, sc; where they rotate), the
      // packed row, the norm weight.
      float ca[ITEMS] = {}, sa[ITEMS] = {}, cc[ITEMS] = {}, sc[ITEMS] = {};
      if (rotate) {
        const float* cs = g.cos + rope_row;
        const float* sn = g.sin + rope_row;
#pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
          const int64_t q = lane + 32 * i;
          if (q < half && q < g.rot) {
            ca[i] = cs[q];
            sa[i] = sn[q];
          }
          if (q < half && q + half < g.rot) {
            cc[i] = cs[q + half];
            sc[i] = sn[q + half];
          }
        }
      }
      float a[ITEMS], c[ITEMS];
      load_pairs<T, ITEMS>(row, hi, half, a, c);
      float wa[ITEMS] = {}, wc[ITEMS] = {};
      if (hi.norm != nullptr) load_norm_pairs(hi.norm, hi.width, half, wa, wc);
      if (hi.norm != nullptr) {
        const float r = rms_scale(a, c, hi.width, g.eps);
        const bool rounds = hi.role == 0 ? g.q_norm_rounds : g.k_norm_rounds;
#pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
          const int64_t q = lane + 32 * i;
          if (q < half) {
            a[i] = hw::round_to<T>(a[i] * r) * wa[i];
            if (rounds) a[i] = hw::round_to<T>(a[i]);
            if (q + half < hi.width) {
              c[i] = hw::round_to<T>(c[i] * r) * wc[i];
              if (rounds) c[i] = hw::round_to<T>(c[i]);
            }
          }
        }
      }
      const float scale = hi.role == 0 ? g.scale_q : 1.f;
      T* dst = static_cast<T*>(p.out[hi.role]) + ((b * hi.heads + hi.index) * g.seq + t) * hi.width;
      const bool staged = STAGED_ROPE && rotate;
      if (staged)  // the lane's table entries preloaded: (ca, sa) at q, (cc, sc) at q + half
        rope_staged<ITEMS>(g, stage[warp], hi.width, half, a, c,
                           [&](int i, int e, int64_t, int64_t, float sign, float yj, float yk) {
                             return yj * (e == 0 ? ca[i] : cc[i]) + sign * yk * (e == 0 ? sa[i] : sc[i]);
                           });
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int64_t q = lane + 32 * i;
        if (q >= half) continue;
        float lo = a[i], hi_v = c[i];
        if (rotate && !staged) {  // full-width rotate-half: the partners are (q, q + half)
          lo = a[i] * ca[i] - c[i] * sa[i];
          hi_v = c[i] * cc[i] + a[i] * sc[i];
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
// qkv_norm_grad_slices_kernel (twice) sums the partials in a fixed order. No atomics.
template <typename T, int ITEMS, bool STAGED_ROPE>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) qkv_epilogue_bwd_scalar_kernel(const BwdParams p) {
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
      // Every load of the head first: the packed row and the norm weight (with a norm),
      // then the gradient.
      float ya[ITEMS] = {}, yc[ITEMS] = {}, wa[ITEMS] = {}, wc[ITEMS] = {};
      if (hi.norm != nullptr) {
        load_pairs<T, ITEMS>(static_cast<const T*>(p.packed) + m * g.rows, hi, half, ya, yc);
        load_norm_pairs(hi.norm, hi.width, half, wa, wc);
      }
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
      if (staged)
        rope_staged<ITEMS>(g, stage[warp], hi.width, half, ga, gc,
                           [&](int, int, int64_t j, int64_t k, float sign, float yj, float yk) {
                             return yj * cs[j] - sign * yk * sn[k];
                           });
      if (hi.norm != nullptr) {
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
            ga[i] *= wa[i];
            if (q + half < hi.width) {
              const float dc = gc[i] * hw::round_to<T>(yc[i] * r);
              acc[0][i][1] += hi.role == 0 ? dc : 0.f;
              acc[1][i][1] += hi.role == 0 ? 0.f : dc;
              gc[i] *= wc[i];
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

// ---------------------------------------------------------------------------
// 16-byte path (see the top of this file for the layout and when it is taken).
// ---------------------------------------------------------------------------
constexpr int kVecThreads = 128;
constexpr int kFwdHeadsPerIter = 4;
constexpr int kBwdHeadsPerIter = 2;

template <typename T>
struct VecWidth {
  static constexpr int value = static_cast<int>(16 / sizeof(T));
};

// The lane's place: its group (one head at a time) and its vector in the head.
struct VecLane {
  int lanes;       // G, lanes per group
  int groups;      // kVecThreads / G
  int group;       // this thread's group in the block
  int pos;         // this lane's vector in the head
  int group_base;  // lane index of the group's first lane in the warp
};

__device__ __forceinline__ VecLane vec_lane(const Geometry& g) {
  VecLane v;
  v.lanes = g.group_lanes;
  v.groups = kVecThreads / v.lanes;
  v.group = static_cast<int>(threadIdx.x) / v.lanes;
  v.pos = static_cast<int>(threadIdx.x) & (v.lanes - 1);
  v.group_base = static_cast<int>(threadIdx.x & 31) & ~(v.lanes - 1);
  return v;
}

// Sums of N values over each aligned group of `lanes` lanes, in one xor butterfly (the
// N chains interleaved; the same fixed order on every lane). All 32 lanes call it.
template <int N>
__device__ __forceinline__ void group_sums(float (&v)[N], int lanes) {
  for (int offset = lanes >> 1; offset > 0; offset >>= 1) {
#pragma unroll
    for (int n = 0; n < N; ++n) v[n] += __shfl_xor_sync(hw::kFullWarp, v[n], offset);
  }
}

// Rows staged in shared memory (norm weights, cos, sin: kMaxWidth floats each) are stored
// so that a lane reads its V elements as V / 4 16-byte words, the group's lanes at
// consecutive 16-byte words (conflict-free, the ideal wavefronts): element e sits at
// staged_index(e); for V = 8 the two halves of the lanes' vectors are two planes of
// `plane` floats (rows of 2 plane >= the head's elements), for V = 4 the order is
// natural. Four elements 4j .. 4j + 3 stay contiguous.
template <int V>
__device__ __forceinline__ int staged_index(int e, int plane = kMaxWidth / 2) {
  static_assert(V == 4 || V == 8, "16-byte vectors of 4 or 8 elements");
  if (V == 8) return ((e >> 2) & 1) * plane + (e >> 3) * 4 + (e & 3);
  return e;
}

// The lane's V elements e0 .. e0 + V of a staged row.
template <int V>
__device__ __forceinline__ void load_staged(const float* row, int e0, float (&out)[V]) {
#pragma unroll
  for (int h = 0; h < V / 4; ++h) {
    const hw::Pack<float, 4> w = hw::load_pack<float, 4>(row + staged_index<V>(e0 + 4 * h));
#pragma unroll
    for (int j = 0; j < 4; ++j) out[4 * h + j] = w.v[j];
  }
}

// Stages the norm weights: norm_w[0] = q_norm, norm_w[1] = k_norm (d elements each,
// absent weights left unset), one 16-byte load per thread (d / 2 <= 128 float4s). The
// caller's next __syncthreads publishes them.
template <int V>
__device__ __forceinline__ void stage_norm_weights(const Geometry& g, float (*norm_w)[kMaxWidth]) {
  const int64_t n4 = g.d / 4;
  const int64_t i = threadIdx.x;
  const int role = i < n4 ? 0 : 1;
  const float* src = role == 0 ? g.q_norm : g.k_norm;
  const int64_t j = 4 * (i - role * n4);
  if (i < 2 * n4 && src != nullptr)
    hw::store_pack<float, 4>(&norm_w[role][staged_index<V>(j)], hw::load_pack<float, 4>(src + j));
}

// Stages token (b, t)'s rope row: tab[0] = cos, tab[1] = sin (rot elements each): one
// 16-byte load per thread (rot / 2 <= 128 float4s) where rot is a multiple of 4, else
// 4-byte loads (2 rot <= 512 floats, up to 4 per thread).
template <int V>
__device__ __forceinline__ void stage_rope_row(const Geometry& g, int64_t b, int64_t t, float (*tab)[kMaxWidth]) {
  const int64_t row = b * g.rope_batch_stride + t * g.rot;
  const int64_t i = threadIdx.x;
  if (g.rot % 4 == 0) {
    const int64_t n4 = g.rot / 4;
    const int which = i < n4 ? 0 : 1;
    const float* src = (which == 0 ? g.cos : g.sin) + row;
    const int64_t j = 4 * (i - which * n4);
    if (i < 2 * n4) hw::store_pack<float, 4>(&tab[which][staged_index<V>(j)], hw::load_pack<float, 4>(src + j));
  } else {
    for (int64_t k = i; k < 2 * g.rot; k += kVecThreads) {
      const int which = k < g.rot ? 0 : 1;
      const int64_t e = k - which * g.rot;
      tab[which][staged_index<V>(e)] = (which == 0 ? g.cos : g.sin)[row + e];
    }
  }
}

// Head h's width, 0 for h >= heads.
__device__ __forceinline__ int64_t vec_head_width(const Geometry& g, int64_t h, int64_t heads) {
  return h >= heads ? 0 : (h < g.hq + g.hkv ? g.d : g.dv);
}

// Head h's place, or an empty head (width 0) for h >= heads.
__device__ __forceinline__ HeadInfo vec_head(const Geometry& g, int64_t h, int64_t heads) {
  if (h < heads) return head_info(g, h);
  HeadInfo hi{};
  hi.role = 2;
  hi.width = 0;
  hi.heads = 1;
  hi.norm = nullptr;
  return hi;
}

// The rope of one vector (elements e = e0 + k, k < V, of a q/k head; those with e < rot
// turn) in place:
// forward  out[e] = y[e] c[e] + sign(e) y[partner] s[e],
// backward out[e] = y[e] c[e] - sign(e) (y s)[partner]    (the transpose),
// sign = -1 for a pair's low element. Interleaved partners are in the vector (e0 and rot
// even); rotate-half partner values come from the caller: other[k] = y[partner(e)]
// (forward) or (y s)[partner(e)] (backward), partner(e) = e +- rot / 2.
template <bool BACKWARD, int V>
__device__ __forceinline__ void vec_rope(bool interleaved, int e0, int rot, const float* ctab, const float* stab,
                                         float (&y)[V], const float (&other)[V]) {
  // The staged cos / sin rows (ctab, stab) are read 4 elements (16 bytes) at a time.
#pragma unroll
  for (int h = 0; h < V / 4; ++h) {
    const hw::Pack<float, 4> c = hw::load_pack<float, 4>(ctab + staged_index<V>(e0 + 4 * h));
    const hw::Pack<float, 4> s = hw::load_pack<float, 4>(stab + staged_index<V>(e0 + 4 * h));
    if (interleaved) {
#pragma unroll
      for (int j = 0; j < 4; j += 2) {
        const int k = 4 * h + j;
        if (e0 + k >= rot) continue;
        const float lo = y[k], hi = y[k + 1];
        if (BACKWARD) {
          y[k] = lo * c.v[j] + hi * s.v[j + 1];
          y[k + 1] = hi * c.v[j + 1] - lo * s.v[j];
        } else {
          y[k] = lo * c.v[j] - hi * s.v[j];
          y[k + 1] = hi * c.v[j + 1] + lo * s.v[j + 1];
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int k = 4 * h + j;
        if (e0 + k >= rot) continue;
        const float sign = 2 * (e0 + k) < rot ? -1.f : 1.f;
        y[k] = BACKWARD ? y[k] * c.v[j] - sign * other[k] : y[k] * c.v[j] + sign * other[k] * s.v[j];
      }
    }
  }
}

// Rotate-half partner values of the lane's vector `v` (see vec_rope): one __shfl_sync per
// element from the lane rot / (2 V) away where rot / 2 is whole vectors (`shuffle`),
// else through the group's row in shared memory (`row`, G V floats; two __syncwarp).
// Uniform over the warp: every lane calls it when the call has rotate-half rope.
template <int V>
__device__ __forceinline__ void rope_partners(bool shuffle, int partner_lane, float* row, int e0, int rot,
                                              const float (&v)[V], float (&other)[V]) {
  if (shuffle) {
#pragma unroll
    for (int k = 0; k < V; ++k) other[k] = __shfl_sync(hw::kFullWarp, v[k], partner_lane);
    return;
  }
  const int half = rot / 2;
#pragma unroll
  for (int k = 0; k < V; ++k) row[e0 + k] = v[k];
  __syncwarp();
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const int e = e0 + k;
    other[k] = e < rot ? row[e < half ? e + half : e - half] : 0.f;
  }
  __syncwarp();
}

// The per-thread constants of both 16-byte kernels: the lane's place (L, e0), the head
// loop (heads, per_iter, iters), and the rope form: half_rope (rotate-half, uniform, so
// every lane takes rope_partners), shuffle_rope (its partners one lane `partner` away),
// my_row (the group's shared-memory row otherwise).
#define VEC_ROPE_SETUP                                                                                      \
  const VecLane L = vec_lane(g);                                                                            \
  const int e0 = L.pos * V;                                                                                 \
  const int rot = static_cast<int>(g.rot);                                                                  \
  const int64_t heads = g.hq + 2 * g.hkv;                                                                   \
  const int64_t per_iter = static_cast<int64_t>(L.groups) * U;                                              \
  const int64_t iters = (heads + per_iter - 1) / per_iter;                                                  \
  const bool rope = g.cos != nullptr;                                                                       \
  const bool half_rope = rope && !g.interleaved;                                                            \
  const bool shuffle_rope = half_rope && (g.rot / 2) % V == 0;                                              \
  const int half_lanes = static_cast<int>(g.rot / 2 / V);                                                  \
  const int partner = L.group_base + (L.pos < half_lanes ? L.pos + half_lanes : L.pos - half_lanes);        \
  float* my_row = partner_rows + L.group * L.lanes * V;

// Forward, 16-byte path. Budget per token: reads N_total T (+ the rope row, 8 rot bytes,
// L2-resident for shared tables), writes N_total T; ~6 FLOPs per element. Design: a
// block per token in turn (grid = tokens); each group loads U heads' vectors (16 bytes
// per lane), then normalizes (one group xor-sum for U heads), rotates (interleaved in the
// lane, rotate-half one __shfl_sync away or through shared memory), scales and stores 16
// bytes per lane into the head-major output. One __syncthreads per token (the rope row
// double-buffered by token parity: token n + 1 writes the buffer token n - 1 read, which
// every thread finished before token n's barrier).
template <typename T>
__global__ void __launch_bounds__(kVecThreads, 4) qkv_epilogue_fwd_kernel(const FwdParams p) {
  constexpr int V = VecWidth<T>::value;
  constexpr int U = kFwdHeadsPerIter;
  const Geometry& g = p.g;
  __shared__ __align__(16) float norm_w[2][kMaxWidth];
  __shared__ __align__(16) float table[2][2][kMaxWidth];  // [token parity][cos, sin][rot]
  __shared__ float partner_rows[kVecThreads * V];         // rotate-half, rot / 2 not whole vectors
  VEC_ROPE_SETUP
  stage_norm_weights<V>(g, norm_w);
  int parity = 0;
  for (int64_t m = blockIdx.x; m < g.tokens; m += gridDim.x, parity ^= 1) {
    const int64_t b = m / g.seq;
    const int64_t t = m - b * g.seq;
    const T* row = static_cast<const T*>(p.packed) + m * g.rows;
    if (rope) stage_rope_row<V>(g, b, t, table[parity]);
    for (int64_t it = 0; it < iters; ++it) {
      // Registers: the U packed vectors stay in T until the reduction is done (converted
      // twice), the heads' places are re-read from the kernel parameters.
      hw::Pack<T, V> raw[U];
      int head[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        head[u] = static_cast<int>((it * U + u) * L.groups + L.group);
#pragma unroll
        for (int k = 0; k < V; ++k) raw[u].v[k] = T(0.f);
        if (e0 < vec_head_width(g, head[u], heads)) {
          const T* src = row + g.head_offsets[head[u]] + e0;
          hw::check_pack_alignment<T, V>(src);
          raw[u] = hw::load_pack<T, V>(src);
        }
      }
      if (it == 0) __syncthreads();  // the rope row (and at the first token the norm weights)
      float ss[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        ss[u] = 0.f;
#pragma unroll
        for (int k = 0; k < V; ++k) ss[u] += static_cast<float>(raw[u].v[k]) * static_cast<float>(raw[u].v[k]);
      }
      group_sums<U>(ss, L.lanes);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const HeadInfo hi = vec_head(g, head[u], heads);
        const bool active = e0 < hi.width;
        float y[V];
#pragma unroll
        for (int k = 0; k < V; ++k) y[k] = static_cast<float>(raw[u].v[k]);
        if (hi.norm != nullptr && active) {
          const float r = rsqrtf(ss[u] / static_cast<float>(hi.width) + g.eps);
          const bool rounds = hi.role == 0 ? g.q_norm_rounds : g.k_norm_rounds;
          float w[V];
          load_staged<V>(norm_w[hi.role], e0, w);
#pragma unroll
          for (int k = 0; k < V; ++k) {
            y[k] = hw::round_to<T>(y[k] * r) * w[k];
            if (rounds) y[k] = hw::round_to<T>(y[k]);
          }
        }
        float other[V] = {};
        if (half_rope) rope_partners<V>(shuffle_rope, partner, my_row, e0, rot, y, other);
        if (!active) continue;
        if (rope && hi.role != 2 && e0 < rot) vec_rope<false, V>(g.interleaved, e0, rot, table[parity][0], table[parity][1], y, other);
        const float scale = hi.role == 0 ? g.scale_q : 1.f;
#pragma unroll
        for (int k = 0; k < V; ++k) y[k] *= scale;
        T* dst = static_cast<T*>(p.out[hi.role]) + ((b * hi.heads + hi.index) * g.seq + t) * hi.width;
        hw::store_from_float<V>(dst + e0, y);
      }
    }
  }
}

// Backward, 16-byte path. Budget per token: reads N_total T of gradient and the q/k part
// of the packed row (with a norm), writes N_total T; ~12 FLOPs per element. Design: a
// fixed persistent grid (kBwdVecBlocks, independent of the device) over tokens; each
// group loads U heads' gradient and packed vectors together, then rotates back
// (interleaved in the lane; rotate-half shuffles y s of the partner), and reduces the
// two norm statistics of the U heads in one interleaved xor butterfly. The norm-weight
// gradient accumulates per lane in registers over the block's tokens in a fixed order;
// at the end the groups' sums are added in group order through shared memory into the
// block's partial row [2, d] (then qkv_norm_grad_slices_kernel, twice).
template <typename T>
__global__ void __launch_bounds__(kVecThreads, 4) qkv_epilogue_bwd_kernel(const BwdParams p) {
  constexpr int V = VecWidth<T>::value;
  constexpr int U = kBwdHeadsPerIter;
  const Geometry& g = p.g;
  __shared__ __align__(16) float norm_w[2][kMaxWidth];
  __shared__ __align__(16) float table[2][2][kMaxWidth];
  // The groups' norm-weight sums [groups][2][G V] in the staged order (plane G V / 2):
  // groups * G V = kVecThreads * V.
  __shared__ __align__(16) float group_acc[kVecThreads * 2 * VecWidth<T>::value];
  __shared__ float partner_rows[kVecThreads * V];  // rotate-half, rot / 2 not whole vectors
  VEC_ROPE_SETUP
  float acc[2][V] = {};  // [q_norm / k_norm][element e0 + k]
  stage_norm_weights<V>(g, norm_w);
  int parity = 0;
  for (int64_t m = blockIdx.x; m < g.tokens; m += gridDim.x, parity ^= 1) {
    const int64_t b = m / g.seq;
    const int64_t t = m - b * g.seq;
    // The packed row (read with a norm only; p.packed is null without one).
    const T* row = p.packed != nullptr ? static_cast<const T*>(p.packed) + m * g.rows : nullptr;
    if (rope) stage_rope_row<V>(g, b, t, table[parity]);
    for (int64_t it = 0; it < iters; ++it) {
      // Registers: the packed vectors stay in T (converted where used), the heads'
      // places are re-read from the kernel parameters.
      hw::Pack<T, V> graw[U], yraw[U];
      int head[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        head[u] = static_cast<int>((it * U + u) * L.groups + L.group);
#pragma unroll
        for (int k = 0; k < V; ++k) {
          graw[u].v[k] = T(0.f);
          yraw[u].v[k] = T(0.f);
        }
        if (e0 < vec_head_width(g, head[u], heads)) {
          const HeadInfo hi = head_info(g, head[u]);
          const T* src = static_cast<const T*>(p.grad[hi.role]) + ((b * hi.heads + hi.index) * g.seq + t) * hi.width + e0;
          hw::check_pack_alignment<T, V>(src);
          graw[u] = hw::load_pack<T, V>(src);
          if (hi.norm != nullptr) {
            hw::check_pack_alignment<T, V>(row + hi.offset + e0);
            yraw[u] = hw::load_pack<T, V>(row + hi.offset + e0);
          }
        }
      }
      if (it == 0) __syncthreads();  // the rope row (and at the first token the norm weights)
      float gr[U][V], stat[2 * U];  // stat: sum y^2 and <g w, y> per head
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const HeadInfo hi = vec_head(g, head[u], heads);
        const bool active = e0 < hi.width;
        const float scale = hi.role == 0 ? g.scale_q : 1.f;
        const bool rot_here = rope && hi.role != 2 && e0 < rot && active;
        float ys[V], sn[V] = {};
        if (rot_here) load_staged<V>(table[parity][1], e0, sn);
#pragma unroll
        for (int k = 0; k < V; ++k) {
          gr[u][k] = static_cast<float>(graw[u].v[k]) * scale;
          ys[k] = rot_here && e0 + k < rot ? gr[u][k] * sn[k] : 0.f;
        }
        float other[V] = {};
        if (half_rope) rope_partners<V>(shuffle_rope, partner, my_row, e0, rot, ys, other);
        if (rot_here) vec_rope<true, V>(g.interleaved, e0, rot, table[parity][0], table[parity][1], gr[u], other);
        const bool normed = hi.norm != nullptr && active;
        float w[V] = {};
        if (normed) load_staged<V>(norm_w[hi.role == 1 ? 1 : 0], e0, w);
        float ss = 0.f, dot = 0.f;
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const float y = static_cast<float>(yraw[u].v[k]);
          ss += y * y;
          dot += normed ? gr[u][k] * w[k] * y : 0.f;
        }
        stat[2 * u] = ss;
        stat[2 * u + 1] = dot;
      }
      group_sums<2 * U>(stat, L.lanes);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const HeadInfo hi = vec_head(g, head[u], heads);
        if (!(e0 < hi.width)) continue;
        if (hi.norm != nullptr) {
          const float width = static_cast<float>(hi.width);
          const float r = rsqrtf(stat[2 * u] / width + g.eps);
          const float kr = r * r * r * stat[2 * u + 1] / width;
          const bool is_q = hi.role == 0;
          float w[V];
          load_staged<V>(norm_w[is_q ? 0 : 1], e0, w);
#pragma unroll
          for (int k = 0; k < V; ++k) {
            // (Both accumulators are updated with a select so they stay in registers.)
            const float y = static_cast<float>(yraw[u].v[k]);
            const float da = gr[u][k] * hw::round_to<T>(y * r);
            acc[0][k] += is_q ? da : 0.f;
            acc[1][k] += is_q ? 0.f : da;
            gr[u][k] = r * (gr[u][k] * w[k]) - kr * y;
          }
        }
        hw::store_from_float<V>(static_cast<T*>(p.grad_packed) + m * g.rows + hi.offset + e0, gr[u]);
      }
    }
  }
  // The block's partial row [2, d]: the groups' sums added in group order.
  if (g.q_norm == nullptr && g.k_norm == nullptr) return;  // uniform
  const int row_len = L.lanes * V;
  const int plane = row_len / 2;
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    float* dst = group_acc + (L.group * 2 + n) * row_len;
#pragma unroll
    for (int h = 0; h < V / 4; ++h) {
      hw::Pack<float, 4> w;
#pragma unroll
      for (int j = 0; j < 4; ++j) w.v[j] = acc[n][4 * h + j];
      hw::store_pack<float, 4>(dst + staged_index<V>(e0 + 4 * h, plane), w);
    }
  }
  __syncthreads();
  float* part = p.partial + static_cast<int64_t>(blockIdx.x) * 2 * g.d;
  for (int64_t j = threadIdx.x; j < 2 * g.d; j += kVecThreads) {
    const int n = j < g.d ? 0 : 1;
    const int at = n * row_len + staged_index<V>(static_cast<int>(j - n * g.d), plane);
    float s = 0.f;
    for (int grp = 0; grp < L.groups; ++grp) s += group_acc[grp * 2 * row_len + at];
    part[j] = s;
  }
}

// ---------------------------------------------------------------------------
// The norm-weight gradient reduction: a fixed-order tree over the backward's partial
// rows [count, cols] (cols = 2 d; count = the backward's fixed grid: one row per block on
// the 16-byte path, per warp on the scalar fallback), two launches of one kernel:
//   level 1: grid (ceil(cols / 32), kReduceSlices); block (c, sl) sums rows
//     [sl * per, (sl + 1) * per) (per = ceil(count / kReduceSlices)) of its 32 columns:
//     warp w takes rows w, w + kReduceWarps, ... in order (one 128-byte coalesced row
//     segment per warp load), then the kReduceWarps warp sums are added in warp order
//     through shared memory -> slices [kReduceSlices, cols];
//   level 2: the same kernel on the slices with one slice (grid (ceil(cols / 32), 1)):
//     each of its ceil(cols / 32) CTAs sums 64 rows on 8 warps -> [cols].
// The order depends only on count and these constants, never on the device: the same
// bits on every GPU, no atomics. Traffic: count * cols * 4 bytes read once (0.5 MiB at
// d = 128 and 528 rows), spread over (cols / 32) * 64 CTAs, then 64 KiB over cols / 32.
// ---------------------------------------------------------------------------
constexpr int kReduceWarps = 8;
constexpr int kReduceSlices = 64;
constexpr int kReduceLoads = 8;

// Block (blockIdx.x, blockIdx.y) of either level: slice blockIdx.y of gridDim.y.
__device__ __forceinline__ void norm_grad_slice(const float* partial, int64_t count, int64_t cols, float* slices) {
  __shared__ float warp_sums[kReduceWarps][32];
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * 32 + lane;
  const int64_t per = (count + gridDim.y - 1) / gridDim.y;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * per;
  const int64_t r1 = r0 + per < count ? r0 + per : count;
  // The warp's rows r0 + warp + kReduceWarps i, kReduceLoads loads in flight at a time,
  // summed in row order.
  float sum = 0.f;
  if (j < cols) {
    for (int64_t r = r0 + warp; r < r1; r += kReduceLoads * kReduceWarps) {
      float v[kReduceLoads];
#pragma unroll
      for (int i = 0; i < kReduceLoads; ++i) {
        const int64_t ri = r + i * kReduceWarps;
        v[i] = ri < r1 ? partial[ri * cols + j] : 0.f;
      }
#pragma unroll
      for (int i = 0; i < kReduceLoads; ++i) sum += v[i];
    }
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

// Level 1: partial [count, cols] -> slices [kReduceSlices, cols].
__global__ void __launch_bounds__(kReduceWarps * 32)
    qkv_norm_grad_slices_kernel(const float* partial, int64_t count, int64_t cols, float* slices) {
  norm_grad_slice(partial, count, cols, slices);
}

// Level 2: slices [kReduceSlices, cols] -> out [cols] (gridDim.y = 1).
__global__ void __launch_bounds__(kReduceWarps * 32)
    qkv_norm_grad_final_kernel(const float* slices, int64_t count, int64_t cols, float* out) {
  norm_grad_slice(slices, count, cols, out);
}

}  // namespace qkv
}  // namespace headwise
