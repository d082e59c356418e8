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
// Budget (bf16, H = 32, one group): ~20 FLOP per (t, s, head) forward, ~50 backward,
// against 4 bytes (forward: a in, a' out) and 6 bytes (backward: a, dy in, da out) of
// [B, H, T, S] traffic: 5-8 FLOP/byte, memory-bound on every GPU (H200: 4.1 TB/s HBM
// against 67 TFLOP/s fp32). The weights are 160 floats per row t and per column s, i.e.
// per element 5 query + 5 key weight floats: read from registers and shared memory, never
// per element from global memory.
//
// Design, shared by the forward and the backward tile kernels: a CTA owns kComposeColumns
// = 128 columns s0 + threadIdx.x (one per thread) of one batch row b and a chunk of
// kComposeRows = 128 rows.
//   - The key-side weights of the thread's column are loaded once per CTA (16-byte
//     cp.async copies of the CTA's [128, 2H] / [128, H] weight blocks staged in shared
//     memory): into registers (forward: kw1, kw2, kg, 5 kMaxHeads floats) or into a
//     per-column shared array kwt (backward, whose registers hold the key-side gradient
//     sums of the column).
//   - The rows stream through a ring of shared-memory stages: per row, the [H, 128] tiles
//     of a (and dy) by 16-byte cp.async (element-wise fallback when S * elem is not a
//     multiple of 16 bytes or a tensor is misaligned), and the row's query weights by
//     4-byte cp.async into the interleaved layout qw[n] = {W1[0,n], W1[1,n], W2[0,n],
//     W2[1,n]} plus qk[n] = {W1[0,n], W1[1,n], G[n], 0} (backward; the forward fills only
//     G[n]), read as 16-byte broadcasts. The forward keeps two stages of 2 rows in
//     flight behind the one it computes (one __syncthreads per stage). The backward
//     (bf16/fp16 where its shared memory fits) takes 2 rows per step in two stages, the
//     next step loading while this one computes (one CTA per SM: ~156 KiB at H = 32); else
//     (fp32, smaller parts) 1 row per step in one stage, two CTAs per SM on sm_90 (~100
//     KiB at H = 32 bf16) overlapping each other's loads. Four __syncthreads per step.
//   - Per (t, s) the thread mixes the heads from shared memory (a[n] of its column:
//     consecutive lanes, consecutive words, conflict-free) and registers: pass 1 the group
//     projections, pass 2 the outputs, written in place into the tile, which the next step
//     stores with 16-byte coalesced stores. Head groups: the group totals of pass 1 go to
//     shared scratch [G][.][128] when G > 1 (registers when G = 1).
//   - The backward makes one pass over a and dy. Pass B reduces the query-side gradients
//     of each row over the CTA's 128 columns: a warp takes 8 heads x 4 column lanes, each
//     lane 4 columns per read (8-byte a and dy reads: the tile's head rows are padded by 16
//     bytes so that each half-warp's 16 lanes hit 32 banks; 16-byte group-total reads),
//     sums the columns in a fixed order and folds the 4 lanes by two xor shuffles; one [5H]
//     partial per (column tile, t). The key-side gradients of a column are summed over the
//     CTA's rows in registers; one [5H] partial per (row chunk, s). Row blocking: with 2
//     rows per step, passes 1 and 2 read a head's key-side weights (W1k, W2k pairs, Gk)
//     from shared memory once for both rows; each row's sums keep the one-row order
//     (bitwise the same results as 1 row per step).
//   - Shared-memory wavefronts of the backward per 32 (t, s, head) elements (bf16, G = 1),
//     1 row / 2 rows per step: tiles in (cp.async) 1 / 1, pass 1 (a, dy, qw quad, W1k and
//     W2k pairs) 7 / 5, pass B 2 / 2, pass 2 (a, dy, qk quad, W1k pair, Gk, da) 7 /
//     5.5, da out 0.5 / 0.5: ~18 / ~14.
//   - dcmha_compose_reduce_partials sums the partials of the column tiles (query side) and
//     of the row chunks (key side) in ascending order: deterministic, no atomics,
//     independent of the scheduling.
// Per-thread head arrays are kMaxHeads floats (H <= 32), indexed by unrolled loops only.
#pragma once

#include "../common/block_reduce.cuh"
#include "../common/mma_primitives.cuh"
#include "../common/simt_portability.h"
#include "../common/unroll.h"
#include "../common/vec.cuh"

#include <cstdint>

namespace headwise {
namespace dcmha {

constexpr int kMaxHeads = 32;
constexpr int kR = 2;
constexpr int kComposeThreads = 128;
constexpr int kComposeColumns = kComposeThreads;  // one column s per thread
constexpr int kComposeRows = 128;                 // rows t per CTA
constexpr int kComposeStages = 3;                 // forward ring depth
constexpr int kGradFields = 5;                    // dG [H], dW1 [R, H], dW2 [R, H] per row / column
constexpr int kMaxStepRows = 2;                   // rows per ring stage, at most

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
  float* partials;    // backward: [column tiles, B * T, 5H] query-side gradient partials
  float* key_partials;  // backward: [row chunks, B * T, 5H] key-side gradient partials
  int B, T, H, hg;    // hg = H / head_groups
  int cq, ck;
  int vec16;          // 1: the tiles move in 16-byte chunks (S * elem % 16 == 0, 16-byte aligned)
  int wvec16;         // 1: w1, w2, g are 16-byte aligned (their column blocks move in 16-byte chunks)
  int pitch;          // elements per head row of a staged tile: tile_pitch<T>() (host layout)
  int tile_bytes;     // H * pitch * elem
  int row_bytes;      // one row of a stage: its tiles, qw [H][4] and qk [H][4] floats
  int rows_per_step;  // rows per ring stage
  int stage_bytes;    // rows_per_step * row_bytes
  int scratch_offset; // bytes: after the ring (or the key weights); group totals
};

__device__ __forceinline__ int64_t w_off(const ComposeParams& p, int b, int t, int c) {
  return ((static_cast<int64_t>(b) * p.T + t) * 4 + c) * kR * p.H;
}
__device__ __forceinline__ int64_t g_off(const ComposeParams& p, int b, int t, int c) {
  return ((static_cast<int64_t>(b) * p.T + t) * 4 + c) * p.H;
}

// Elements per head row of a staged [H, 128] tile: 128 + 16 bytes of padding (16-byte
// aligned rows for cp.async; the pass-B lanes of 8 heads then start in 8 distinct bank
// groups). A constant, so that every head row's offset is an immediate.
template <typename T>
__device__ __forceinline__ constexpr int tile_pitch() {
  return kComposeColumns + 16 / static_cast<int>(sizeof(T));
}

// Bit n set where head n ends (starts) its group of hg heads.
__device__ __forceinline__ uint32_t group_end_mask(int H, int hg) {
  uint32_t m = 0;
  for (int n = hg - 1; n < H; n += hg) m |= 1u << n;
  return m;
}
__device__ __forceinline__ uint32_t group_start_mask(int H, int hg) {
  uint32_t m = 0;
  for (int n = 0; n < H; n += hg) m |= 1u << n;
  return m;
}

// Copies a [kComposeColumns, len] block of per-column weights (column s at src + s * stride,
// len contiguous floats, s in [s0, s0 + 128), zero beyond T) into smem rows of
// column_pitch(len) floats. With len % 4 == 0 (the columns are then 16-byte aligned):
// 16-byte cp.async, every copy of a thread issued before the wait, pitch len + 4 (the
// 16-byte column reads of a quarter-warp then hit distinct bank groups); else 4-byte loads,
// pitch len | 1 (odd: conflict-free column reads). Coalesced on the global side.
__device__ __forceinline__ int column_pitch(int len) { return len % 4 == 0 ? len + 4 : (len | 1); }
// (an unaligned block with len % 4 == 0 keeps the pitch len + 4: its reads are then 4-way
// conflicted, a fallback only)

template <int MaxLen>
__device__ __forceinline__ void stage_column_block(const float* src, int64_t stride, int len, int s0, int T,
                                                   bool aligned, float* dst) {
  const int pitch = column_pitch(len);
  if (len % 4 == 0 && aligned) {
    constexpr int kPerThread = kComposeColumns * MaxLen / 4 / kComposeThreads;
    const int quads = len / 4;
    HW_UNROLL
    for (int k = 0; k < kPerThread; ++k) {
      const int i = threadIdx.x + k * kComposeThreads;
      if (i < kComposeColumns * quads) {
        const int c = i / quads, j = (i - c * quads) * 4, s = s0 + c;
        const bool in = s < T;
        hw::cp_async_ca<16>(dst + c * pitch + j, in ? src + s * stride + j : src, in ? 16 : 0);
      }
    }
    hw::cp_async_wait_all();
  } else {
    for (int i = threadIdx.x; i < kComposeColumns * len; i += blockDim.x) {
      const int c = i / len, j = i - c * len, s = s0 + c;
      dst[c * pitch + j] = s < T ? src[s * stride + j] : 0.f;
    }
  }
}

// Element j of this thread's column of a block staged by stage_column_block.
__device__ __forceinline__ float column_value(const float* staged, int len, int j) {
  return staged[threadIdx.x * column_pitch(len) + j];
}

// Four consecutive floats of shared memory (16-byte aligned) in one 16-byte access.
struct Quad {
  float x, y, z, w;
};
__device__ __forceinline__ Quad load_quad(const float* p) {
  const hw::Pack<float, 4> v = hw::load_pack<float, 4>(p);
  return {v.v[0], v.v[1], v.v[2], v.v[3]};
}

__device__ __forceinline__ int odd_pitch(int len) { return len | 1; }

// The key-side weights of this thread's column (slot ck) into registers, staged through
// `stage` (at least 128 (2H + 4) floats of shared memory).
__device__ __forceinline__ void load_column_weights(const ComposeParams& p, int b, int s0, float* stage,
                                                    float (&kw1)[kR][kMaxHeads], float (&kw2)[kR][kMaxHeads],
                                                    float (&kg)[kMaxHeads]) {
  const int H = p.H;
  const int64_t wstride = 4 * kR * H;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const float* src = (k == 0 ? p.w1 : p.w2) + w_off(p, b, 0, p.ck);
    stage_column_block<kR * kMaxHeads>(src, wstride, kR * H, s0, p.T, p.wvec16, stage);
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kR; ++r)
#pragma unroll
      for (int n = 0; n < kMaxHeads; ++n) {
        const float v = n < H ? column_value(stage, kR * H, r * H + n) : 0.f;
        if (k == 0) kw1[r][n] = v;
        else kw2[r][n] = v;
      }
    __syncthreads();
  }
  stage_column_block<kMaxHeads>(p.g + g_off(p, b, 0, p.ck), 4 * H, H, s0, p.T, p.wvec16, stage);
  __syncthreads();
#pragma unroll
  for (int n = 0; n < kMaxHeads; ++n) kg[n] = n < H ? column_value(stage, H, n) : 0.f;
  __syncthreads();
}

// Row t's [H, 128] tile of `src` (columns s0 + [0, 128), zero beyond T) into `tile`
// (pitch elements per head row). Thread-exact: the thread that stores a chunk back in
// store_tile is the one that loads it here, so a stage may be refilled right after its
// store without another barrier.
template <typename T>
__device__ __forceinline__ void issue_tile(const ComposeParams& p, const void* base, int b, int t, int s0, T* tile) {
  const int S = p.T;
  const int64_t head_stride = static_cast<int64_t>(S) * S;
  const T* row = static_cast<const T*>(base) + static_cast<int64_t>(b) * p.H * head_stride +
                 static_cast<int64_t>(t) * S;
  if (p.vec16) {
    constexpr int kElems = 16 / static_cast<int>(sizeof(T));
    constexpr int kChunks = kComposeColumns / kElems;
    constexpr int kPerThread = kMaxHeads * kChunks / kComposeThreads;
    HW_UNROLL
    for (int k = 0; k < kPerThread; ++k) {
      const int i = threadIdx.x + k * kComposeThreads;
      if (i < p.H * kChunks) {
        const int n = i / kChunks, c = (i - n * kChunks) * kElems, s = s0 + c;
        const bool in = s < S;  // S is a multiple of kElems: a chunk is all in or all out
        hw::cp_async_cg16(tile + n * tile_pitch<T>() + c, in ? row + n * head_stride + s : row, in ? 16 : 0);
      }
    }
  } else {
    for (int i = threadIdx.x; i < p.H * kComposeColumns; i += blockDim.x) {
      const int n = i / kComposeColumns, c = i - n * kComposeColumns, s = s0 + c;
      tile[n * tile_pitch<T>() + c] = s < S ? row[n * head_stride + s] : T(0.f);
    }
  }
}

template <typename T>
__device__ __forceinline__ void store_tile(const ComposeParams& p, void* base, int b, int t, int s0, const T* tile) {
  const int S = p.T;
  const int64_t head_stride = static_cast<int64_t>(S) * S;
  T* row = static_cast<T*>(base) + static_cast<int64_t>(b) * p.H * head_stride + static_cast<int64_t>(t) * S;
  if (p.vec16) {
    constexpr int kElems = 16 / static_cast<int>(sizeof(T));
    constexpr int kChunks = kComposeColumns / kElems;
    constexpr int kPerThread = kMaxHeads * kChunks / kComposeThreads;
    HW_UNROLL
    for (int k = 0; k < kPerThread; ++k) {
      const int i = threadIdx.x + k * kComposeThreads;
      if (i < p.H * kChunks) {
        const int n = i / kChunks, c = (i - n * kChunks) * kElems, s = s0 + c;
        if (s < S)
          hw::store_pack<T, kElems>(row + n * head_stride + s, hw::load_pack<T, kElems>(tile + n * tile_pitch<T>() + c));
      }
    }
  } else {
    for (int i = threadIdx.x; i < p.H * kComposeColumns; i += blockDim.x) {
      const int n = i / kComposeColumns, c = i - n * kComposeColumns, s = s0 + c;
      if (s < S) row[n * head_stride + s] = tile[n * tile_pitch<T>() + c];
    }
  }
}

// Row t's query weights (slot cq) into qw [H][4] = {W1[0,n], W1[1,n], W2[0,n], W2[1,n]}
// and qk [H][4] = {W1[0,n], W1[1,n], G[n], 0} (with_w1; else only qk[n].z = G[n]: the
// forward), by 4-byte cp.async (coalesced on the global side). The backward's pass 2 reads
// qk[n] as one broadcast.
__device__ __forceinline__ void issue_query_weights(const ComposeParams& p, int b, int t, float* qw, float* qk,
                                                    bool with_w1) {
  const int H = p.H;
  const float* w1 = p.w1 + w_off(p, b, t, p.cq);
  const float* w2 = p.w2 + w_off(p, b, t, p.cq);
  const float* g = p.g + g_off(p, b, t, p.cq);
  const int count = with_w1 ? 8 * H : 5 * H;
  constexpr int kPerThread = (8 * kMaxHeads + kComposeThreads - 1) / kComposeThreads;
  HW_UNROLL
  for (int k = 0; k < kPerThread; ++k) {
    const int i = threadIdx.x + k * kComposeThreads;
    if (i >= count) {
      // beyond the row's weights
    } else if (i < 2 * H) {
      const int r = i / H, n = i - r * H;
      hw::cp_async_ca<4>(qw + 4 * n + r, w1 + i);
    } else if (i < 4 * H) {
      const int j = i - 2 * H, r = j / H, n = j - r * H;
      hw::cp_async_ca<4>(qw + 4 * n + 2 + r, w2 + j);
    } else if (i < 5 * H) {
      hw::cp_async_ca<4>(qk + 4 * (i - 4 * H) + 2, g + (i - 4 * H));
    } else if (i < 7 * H) {
      const int j = i - 5 * H, r = j / H, n = j - r * H;
      hw::cp_async_ca<4>(qk + 4 * n + r, w1 + j);
    } else {
      hw::cp_async_ca<4>(qk + 4 * (i - 7 * H) + 3, g, 0);  // zero fill
    }
  }
}

// One row of a stage: tiles (ntiles of them), qw, qk.
template <typename T>
struct StageRow {
  T* tile0;
  T* tile1;
  float* qw;   // [H][4]
  float* qk;   // [H][4]
};

template <typename T>
__device__ __forceinline__ StageRow<T> stage_row(const ComposeParams& p, unsigned char* stage, int j, int ntiles) {
  unsigned char* r = stage + j * p.row_bytes;
  StageRow<T> out;
  out.tile0 = reinterpret_cast<T*>(r);
  out.tile1 = reinterpret_cast<T*>(r + p.tile_bytes);
  out.qw = reinterpret_cast<float*>(r + ntiles * p.tile_bytes);
  out.qk = reinterpret_cast<float*>(r + ntiles * p.tile_bytes + 16 * p.H);
  return out;
}

// ---------------------------------------------------------------------------------------
// Forward.
// ---------------------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ void compose_row_fwd(const ComposeParams& p, T* xs, const float* qw, const float* qk,
                                                const float (&kw1)[kR][kMaxHeads], const float (&kw2)[kR][kMaxHeads],
                                                const float (&kg)[kMaxHeads], uint32_t ends, uint32_t starts,
                                                float* scratch) {
  const int H = p.H, c = threadIdx.x;
  constexpr int pitch = tile_pitch<T>();
  const bool grouped = p.hg < H;
  // Pass 1: per group, pq = W1q a and pk = W1k a; tot holds the current group's totals.
  float acc[4] = {0.f, 0.f, 0.f, 0.f}, tot[4] = {0.f, 0.f, 0.f, 0.f};
  int grp = 0;
#pragma unroll
  for (int n = 0; n < kMaxHeads; ++n) {
    if (n < H) {
      const float x = static_cast<float>(xs[n * pitch + c]);
      const Quad q = load_quad(qw + 4 * n);
      acc[0] += q.x * x;
      acc[1] += q.y * x;
      acc[2] += kw1[0][n] * x;
      acc[3] += kw1[1][n] * x;
      if ((ends >> n) & 1u) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          tot[k] = acc[k];
          if (grouped) scratch[(grp * 4 + k) * kComposeColumns + c] = acc[k];
          acc[k] = 0.f;
        }
        ++grp;
      }
    }
  }
  // Pass 2: y[m] = a[m] (1 + Gq + Gk) + sum_r W2q[r,m] pq[r] + W2k[r,m] pk[r], in place.
  grp = 0;
#pragma unroll
  for (int m = 0; m < kMaxHeads; ++m) {
    if (m < H) {
      if (grouped && ((starts >> m) & 1u)) {
#pragma unroll
        for (int k = 0; k < 4; ++k) tot[k] = scratch[(grp * 4 + k) * kComposeColumns + c];
        ++grp;
      }
      const float x = static_cast<float>(xs[m * pitch + c]);
      const Quad q = load_quad(qw + 4 * m);
      float y = x * (1.f + qk[4 * m + 2] + kg[m]);
      y += q.z * tot[0] + kw2[0][m] * tot[2];
      y += q.w * tot[1] + kw2[1][m] * tot[3];
      xs[m * pitch + c] = static_cast<T>(y);
    }
  }
}

template <typename T>
__device__ __forceinline__ void issue_step(const ComposeParams& p, int b, int t0, int t_end, int s0,
                                           unsigned char* stage, int ntiles, bool query_weights) {
  HW_UNROLL
  for (int j = 0; j < kMaxStepRows; ++j) {
    if (j >= p.rows_per_step || t0 + j >= t_end) break;
    const StageRow<T> r = stage_row<T>(p, stage, j, ntiles);
    issue_tile<T>(p, p.a, b, t0 + j, s0, r.tile0);
    if (ntiles > 1) issue_tile<T>(p, p.grad, b, t0 + j, s0, r.tile1);
    if (query_weights) issue_query_weights(p, b, t0 + j, r.qw, r.qk, ntiles > 1);
  }
}

template <typename T>
__device__ __forceinline__ void store_step(const ComposeParams& p, int b, int t0, int t_end, int s0,
                                           unsigned char* stage, int ntiles, int which) {
  for (int j = 0; j < p.rows_per_step && t0 + j < t_end; ++j) {
    const StageRow<T> r = stage_row<T>(p, stage, j, ntiles);
    store_tile<T>(p, p.out, b, t0 + j, s0, which == 0 ? r.tile0 : r.tile1);
  }
}

// grid (ceil(T / 128) column tiles, ceil(T / 128) row chunks, B), 128 threads.
template <typename T>
__global__ void __launch_bounds__(kComposeThreads) dcmha_compose_fwd(const ComposeParams p) {
  const int s0 = blockIdx.x * kComposeColumns, b = blockIdx.z;
  const int t_begin = blockIdx.y * kComposeRows, t_end = min(p.T, t_begin + kComposeRows);
  unsigned char* smem = hw::dynamic_shared_memory();
  float* scratch = reinterpret_cast<float*>(smem + p.scratch_offset);
  float kw1[kR][kMaxHeads], kw2[kR][kMaxHeads], kg[kMaxHeads];
  load_column_weights(p, b, s0, reinterpret_cast<float*>(smem), kw1, kw2, kg);
  const uint32_t ends = group_end_mask(p.H, p.hg), starts = group_start_mask(p.H, p.hg);
  const int step_rows = p.rows_per_step;
  const int steps = (t_end - t_begin + step_rows - 1) / step_rows;
  auto stage = [&](int i) { return smem + (i % kComposeStages) * p.stage_bytes; };
  for (int i = 0; i < kComposeStages - 1; ++i) {
    if (i < steps) issue_step<T>(p, b, t_begin + i * step_rows, t_end, s0, stage(i), 1, true);
    hw::cp_async_commit();
  }
  for (int i = 0; i < steps; ++i) {
    hw::cp_async_wait<kComposeStages - 2>();
    __syncthreads();  // step i landed; every thread finished step i - 1
    if (i > 0) store_step<T>(p, b, t_begin + (i - 1) * step_rows, t_end, s0, stage(i - 1), 1, 0);
    if (i + kComposeStages - 1 < steps)
      issue_step<T>(p, b, t_begin + (i + kComposeStages - 1) * step_rows, t_end, s0, stage(i + kComposeStages - 1), 1,
                    true);
    hw::cp_async_commit();
    const int t0 = t_begin + i * step_rows;
    for (int j = 0; j < step_rows && t0 + j < t_end; ++j) {
      const StageRow<T> r = stage_row<T>(p, stage(i), j, 1);
      compose_row_fwd<T>(p, r.tile0, r.qw, r.qk, kw1, kw2, kg, ends, starts, scratch);
    }
  }
  __syncthreads();
  if (steps > 0) store_step<T>(p, b, t_begin + (steps - 1) * step_rows, t_end, s0, stage(steps - 1), 1, 0);
}

// ---------------------------------------------------------------------------------------
// Backward, one pass over a and dy: da, the query-side and the key-side gradients.
// ---------------------------------------------------------------------------------------
// Query-side group totals of a (t, s) kept by pass 1 for pass B: [G][4][128] floats.
constexpr int kBwdGroupValues = 4;  // pq0, pq1, dpq0, dpq1

// Pass 1 of the kRows rows of a step, this thread's column: per row and group pq = W1q a,
// dpq = W2q dy into that row's grp_tot (read by pass B for every column and by pass 2), and
// dpk = W2k dy, pk = W1k a, returned in key_tot for the last group (the only one when
// G = 1; pass 2 recomputes them per group when G > 1, from shared memory). The key-side
// weights of head n are read once for the kRows rows (row blocking); each row's sums run
// in the order of a one-row step.
template <typename T, int kRows>
__device__ __forceinline__ void bwd_pass1(const ComposeParams& p, const StageRow<T> (&rows)[kRows], const float* kwt,
                                          uint32_t ends, float* grp_tot, int grp_stride,
                                          float (&key_tot)[kRows][4]) {
  const int H = p.H, c = threadIdx.x;
  constexpr int pitch = tile_pitch<T>();
  float acc[kRows][8];
#pragma unroll
  for (int j = 0; j < kRows; ++j)
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[j][k] = 0.f;
  int grp = 0;
#pragma unroll
  for (int n = 0; n < kMaxHeads; ++n) {
    if (n < H) {
      const hw::Pack<float, 2> kw1 = hw::load_pack<float, 2>(kwt + 2 * (n * kComposeColumns + c));
      const hw::Pack<float, 2> kw2 = hw::load_pack<float, 2>(kwt + 2 * ((H + n) * kComposeColumns + c));
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        const float x = static_cast<float>(rows[j].tile0[n * pitch + c]);
        const float dy = static_cast<float>(rows[j].tile1[n * pitch + c]);
        const Quad q = load_quad(rows[j].qw + 4 * n);
        acc[j][0] += q.x * x;
        acc[j][1] += q.y * x;
        acc[j][2] += q.z * dy;
        acc[j][3] += q.w * dy;
        acc[j][4] += kw2.v[0] * dy;
        acc[j][5] += kw2.v[1] * dy;
        acc[j][6] += kw1.v[0] * x;
        acc[j][7] += kw1.v[1] * x;
      }
      if ((ends >> n) & 1u) {
#pragma unroll
        for (int j = 0; j < kRows; ++j) {
#pragma unroll
          for (int k = 0; k < kBwdGroupValues; ++k)
            grp_tot[j * grp_stride + (grp * kBwdGroupValues + k) * kComposeColumns + c] = acc[j][k];
#pragma unroll
          for (int k = 0; k < 4; ++k) key_tot[j][k] = acc[j][4 + k];
#pragma unroll
          for (int k = 0; k < 8; ++k) acc[j][k] = 0.f;
        }
        ++grp;
      }
    }
  }
}

// The key-side gradient sums of this thread's column over the CTA's rows.
struct KeyGradSums {
  float g[kMaxHeads];
  float w1[kR][kMaxHeads];
  float w2[kR][kMaxHeads];
};

// Pass 2 of the kRows rows of a step, this thread's column: da[n] = dy[n] (1 + Gq + Gk) +
// sum_r W1q[r,n] dpq[r] + W1k[r,n] dpk[r], written in place over dy; and the key-side sums
// dGk += a dy, dW1k[r] += a dpk[r], dW2k[r] += pk[r] dy, row by row (the order of one-row
// steps: bitwise the same sums). W1k and Gk of head n are read once for the kRows rows.
// Rows j >= valid (the chunk's odd last row) are computed but add nothing to the sums (and
// store_step does not write them).
template <typename T, int kRows>
__device__ __forceinline__ void bwd_pass2(const ComposeParams& p, const StageRow<T> (&rows)[kRows], int valid,
                                          const float* kwt, const float* kgt, uint32_t starts, const float* grp_tot,
                                          int grp_stride, const float (&key_tot)[kRows][4], KeyGradSums& sums) {
  const int H = p.H, c = threadIdx.x, hg = p.hg;
  constexpr int pitch = tile_pitch<T>();
  const bool grouped = hg < H;
  float dpq0[kRows], dpq1[kRows], dpk0[kRows], dpk1[kRows], pk0[kRows], pk1[kRows];
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
    dpq0[j] = dpq1[j] = 0.f;
    dpk0[j] = key_tot[j][0];
    dpk1[j] = key_tot[j][1];
    pk0[j] = key_tot[j][2];
    pk1[j] = key_tot[j][3];
  }
  int grp = 0;
#pragma unroll
  for (int n = 0; n < kMaxHeads; ++n) {
    if (n < H) {
      if ((starts >> n) & 1u) {
#pragma unroll
        for (int j = 0; j < kRows; ++j) {
          const float* gt = grp_tot + j * grp_stride + grp * kBwdGroupValues * kComposeColumns + c;
          dpq0[j] = gt[2 * kComposeColumns];
          dpq1[j] = gt[3 * kComposeColumns];
        }
        ++grp;
        if (grouped) {  // this group's key-side totals, in pass 1's order
#pragma unroll
          for (int j = 0; j < kRows; ++j) dpk0[j] = dpk1[j] = pk0[j] = pk1[j] = 0.f;
          for (int m = n; m < n + hg; ++m) {
            const hw::Pack<float, 2> kw1 = hw::load_pack<float, 2>(kwt + 2 * (m * kComposeColumns + c));
            const hw::Pack<float, 2> kw2 = hw::load_pack<float, 2>(kwt + 2 * ((H + m) * kComposeColumns + c));
#pragma unroll
            for (int j = 0; j < kRows; ++j) {
              const float x = static_cast<float>(rows[j].tile0[m * pitch + c]);
              const float dy = static_cast<float>(rows[j].tile1[m * pitch + c]);
              dpk0[j] += kw2.v[0] * dy;
              dpk1[j] += kw2.v[1] * dy;
              pk0[j] += kw1.v[0] * x;
              pk1[j] += kw1.v[1] * x;
            }
          }
        }
      }
      const hw::Pack<float, 2> kw1 = hw::load_pack<float, 2>(kwt + 2 * (n * kComposeColumns + c));
      const float kg = kgt[n * kComposeColumns + c];
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        const float x = static_cast<float>(rows[j].tile0[n * pitch + c]);
        const float dy = static_cast<float>(rows[j].tile1[n * pitch + c]);
        const Quad q = load_quad(rows[j].qk + 4 * n);  // {W1q[0,n], W1q[1,n], Gq[n], 0}
        float d = dy * (1.f + q.z + kg);
        d += q.x * dpq0[j] + kw1.v[0] * dpk0[j];
        d += q.y * dpq1[j] + kw1.v[1] * dpk1[j];
        rows[j].tile1[n * pitch + c] = static_cast<T>(d);
        if (j < valid) {
          sums.g[n] += x * dy;
          sums.w1[0][n] += x * dpk0[j];
          sums.w1[1][n] += x * dpk1[j];
          sums.w2[0][n] += pk0[j] * dy;
          sums.w2[1][n] += pk1[j] * dy;
        }
      }
    }
  }
}

// Pass B of row t: the query-side gradient sums over the CTA's 128 columns. Warp w takes
// 8 heads, lane l head 8w + 2 (h % 4) + h / 4 with h = l / 4 (half-warp 0 the even heads,
// 1 the odd ones); the 4 lanes of a head take 4-column chunks q = l % 4, +4, +8, ..., in
// ascending order (4 a and 4 dy values in one 8-byte (16-byte fp32) read, the group totals
// in 16-byte reads), and are folded by xor shuffles (fixed order). Tile pitch 128 + 16
// bytes: head rows n start at bank 4n, so the 8-byte reads of each half-warp (heads 0, 2,
// 4, 6 or 1, 3, 5, 7 x 4 chunks) hit 32 distinct banks (fp32's 16-byte reads: 4 per bank
// per warp, the ideal; 2-way within a quarter-warp); the group totals' 4 chunks per head
// are 64 contiguous bytes, broadcast to the heads of a group (groups of hg < 8 heads: the
// warp's groups share banks, conflicted as before). Writes the CTA's [5H] partial of row t.
template <typename T>
__device__ __forceinline__ void bwd_passB(const ComposeParams& p, const T* xs, const T* dys, const float* grp_tot,
                                          int b, int t) {
  const int H = p.H, lane = threadIdx.x & 31, h = lane >> 2;
  constexpr int pitch = tile_pitch<T>();
  const int n = (threadIdx.x >> 5) * 8 + 2 * (h & 3) + (h >> 2), quarter = lane & 3;
  float dg = 0.f, dw1_0 = 0.f, dw1_1 = 0.f, dw2_0 = 0.f, dw2_1 = 0.f;
  if (n < H) {
    const float* gt = grp_tot + (n / p.hg) * kBwdGroupValues * kComposeColumns;
    const T* xr = xs + n * pitch;
    const T* dyr = dys + n * pitch;
    for (int chunk = quarter; chunk < kComposeColumns / 4; chunk += 4) {
      const int s = 4 * chunk;
      const hw::Pack<T, 4> xp = hw::load_pack<T, 4>(xr + s);
      const hw::Pack<T, 4> dp = hw::load_pack<T, 4>(dyr + s);
      const Quad pq0 = load_quad(gt + 0 * kComposeColumns + s);
      const Quad pq1 = load_quad(gt + 1 * kComposeColumns + s);
      const Quad dpq0 = load_quad(gt + 2 * kComposeColumns + s);
      const Quad dpq1 = load_quad(gt + 3 * kComposeColumns + s);
      const float x0 = static_cast<float>(xp.v[0]), x1 = static_cast<float>(xp.v[1]);
      const float x2 = static_cast<float>(xp.v[2]), x3 = static_cast<float>(xp.v[3]);
      const float d0 = static_cast<float>(dp.v[0]), d1 = static_cast<float>(dp.v[1]);
      const float d2 = static_cast<float>(dp.v[2]), d3 = static_cast<float>(dp.v[3]);
      dg += x0 * d0 + x1 * d1 + x2 * d2 + x3 * d3;
      dw1_0 += x0 * dpq0.x + x1 * dpq0.y + x2 * dpq0.z + x3 * dpq0.w;
      dw1_1 += x0 * dpq1.x + x1 * dpq1.y + x2 * dpq1.z + x3 * dpq1.w;
      dw2_0 += pq0.x * d0 + pq0.y * d1 + pq0.z * d2 + pq0.w * d3;
      dw2_1 += pq1.x * d0 + pq1.y * d1 + pq1.z * d2 + pq1.w * d3;
    }
  }
  float v[kGradFields] = {dg, dw1_0, dw1_1, dw2_0, dw2_1};
#pragma unroll
  for (int k = 0; k < kGradFields; ++k) {
    v[k] += __shfl_xor_sync(0xffffffffu, v[k], 1);
    v[k] += __shfl_xor_sync(0xffffffffu, v[k], 2);
  }
  if (n < H && quarter == 0) {
    float* out = p.partials + ((static_cast<int64_t>(blockIdx.x) * p.B + b) * p.T + t) * kGradFields * H;
    out[n] = v[0];
    out[H + n] = v[1];
    out[2 * H + n] = v[2];
    out[3 * H + n] = v[3];
    out[4 * H + n] = v[4];
  }
}

// grid (ceil(T / 128) column tiles, ceil(T / 128) row chunks, B), 128 threads; kRows rows
// per step (row blocking). Shared: kwt [2][H][128][2] floats = {W1k[0,n], W1k[1,n]} and
// {W2k[0,n], W2k[1,n]} of the CTA's columns (8 bytes per lane, consecutive lanes
// consecutive; pass 2 reads only the W1k plane), kgt [H][128] = Gk, the ring of stages
// (kRows rows each: a and dy tiles, query weights), group totals [kRows][G][4][128];
// registers: the column's key-side gradient sums (255 registers would spill with the
// column's Gk in registers too).
//   kRows = 1 (fp32, and where the two-row layout does not fit): one stage, loaded while
//     the SM's other CTA computes (two CTAs per SM at H = 32 bf16 on sm_90, ~100 KiB).
//   kRows = 2 (bf16/fp16 where it fits: 156 KiB at H = 32, one CTA per SM on sm_80 and
//     sm_90): two stages, the next step's rows load while this one's are computed.
// Per step: barrier, store the previous step's da, issue the next step (kRows = 2) or this
// one (kRows = 1), wait, barrier, pass 1 (all rows), barrier, pass B (row by row), barrier
// (pass B reads dy), pass 2 (all rows, da over dy).
// Writes p.partials [column tiles, B * T, 5H] (query side, one row per CTA and t) and
// p.key_partials [row chunks, B * T, 5H] (key side, one row per CTA and s).
template <typename T, int kRows>
__global__ void __launch_bounds__(kComposeThreads) dcmha_compose_bwd(const ComposeParams p) {
  const int s0 = blockIdx.x * kComposeColumns, b = blockIdx.z, c = threadIdx.x, H = p.H;
  const int t_begin = blockIdx.y * kComposeRows, t_end = min(p.T, t_begin + kComposeRows);
  unsigned char* smem = hw::dynamic_shared_memory();
  float* kwt = reinterpret_cast<float*>(smem);
  float* kgt = kwt + 4 * H * kComposeColumns;
  unsigned char* ring = smem + static_cast<int64_t>(H) * kComposeColumns * 20;
  float* grp_tot = reinterpret_cast<float*>(smem + p.scratch_offset);
  {
    // kwt and kgt by 4-byte cp.async straight from the coalesced runs of w1, w2 ([128, 2H])
    // and g ([128, H]), every copy issued before the wait.
    const int len = kR * H;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const float* src = (k == 0 ? p.w1 : p.w2) + w_off(p, b, 0, p.ck);
      HW_UNROLL
      for (int q = 0; q < kR * kMaxHeads; ++q) {
        const int i = threadIdx.x + q * kComposeThreads;
        if (i < kComposeColumns * len) {
          const int cc = i / len, j = i - cc * len, r = j / H, n = j - r * H, s = s0 + cc;
          const bool in = s < p.T;
          hw::cp_async_ca<4>(kwt + 2 * ((k * H + n) * kComposeColumns + cc) + r,
                             in ? src + static_cast<int64_t>(s) * 4 * len + j : src, in ? 4 : 0);
        }
      }
    }
    const float* g = p.g + g_off(p, b, 0, p.ck);
    HW_UNROLL
    for (int q = 0; q < kMaxHeads; ++q) {
      const int i = threadIdx.x + q * kComposeThreads;
      if (i < kComposeColumns * H) {
        const int cc = i / H, n = i - cc * H, s = s0 + cc;
        const bool in = s < p.T;
        hw::cp_async_ca<4>(kgt + n * kComposeColumns + cc, in ? g + static_cast<int64_t>(s) * 4 * H + n : g,
                           in ? 4 : 0);
      }
    }
    hw::cp_async_wait_all();
    __syncthreads();
  }
  const uint32_t ends = group_end_mask(H, p.hg), starts = group_start_mask(H, p.hg);
  KeyGradSums sums;
#pragma unroll
  for (int n = 0; n < kMaxHeads; ++n) {
    sums.g[n] = 0.f;
    sums.w1[0][n] = sums.w1[1][n] = sums.w2[0][n] = sums.w2[1][n] = 0.f;
  }
  constexpr int kStages = kRows;  // kRows = 2: double-buffered; kRows = 1: one stage
  const int grp_stride = (H / p.hg) * kBwdGroupValues * kComposeColumns;
  const int steps = (t_end - t_begin + kRows - 1) / kRows;
  auto stage = [&](int i) { return ring + (i % kStages) * p.stage_bytes; };
  if (kStages > 1 && steps > 0) {
    issue_step<T>(p, b, t_begin, t_end, s0, stage(0), 2, true);
    hw::cp_async_commit();
  }
  for (int i = 0; i < steps; ++i) {
    const int t0 = t_begin + i * kRows;
    __syncthreads();  // every thread finished step i - 1
    if (i > 0) store_step<T>(p, b, t0 - kRows, t_end, s0, stage(i - 1), 2, 1);
    // Thread-exact refills: after this thread's own stores of the stage.
    if (kStages == 1) {
      issue_step<T>(p, b, t0, t_end, s0, stage(i), 2, true);
      hw::cp_async_commit();
      hw::cp_async_wait<0>();
    } else {
      if (i + 1 < steps) issue_step<T>(p, b, t0 + kRows, t_end, s0, stage(i + 1), 2, true);
      hw::cp_async_commit();
      hw::cp_async_wait<kStages - 1>();
    }
    __syncthreads();  // step i landed
    StageRow<T> r[kRows];
#pragma unroll
    for (int j = 0; j < kRows; ++j) r[j] = stage_row<T>(p, stage(i), j, 2);
    const int valid = min(kRows, t_end - t0);
    float key_tot[kRows][4] = {};
    bwd_pass1<T, kRows>(p, r, kwt, ends, grp_tot, grp_stride, key_tot);
    __syncthreads();  // every column's group totals
    for (int j = 0; j < valid; ++j) bwd_passB<T>(p, r[j].tile0, r[j].tile1, grp_tot + j * grp_stride, b, t0 + j);
    __syncthreads();  // pass B read dy before pass 2 overwrites it with da
    bwd_pass2<T, kRows>(p, r, valid, kwt, kgt, starts, grp_tot, grp_stride, key_tot, sums);
  }
  __syncthreads();
  if (steps > 0) store_step<T>(p, b, t_begin + (steps - 1) * kRows, t_end, s0, stage(steps - 1), 2, 1);
  // The column sums, [128][5H | 1] through shared memory (kwt and the ring are dead once
  // every thread has stored its last da chunks), then coalesced rows of the key partial
  // [B * T, 5H] (the CTA's 128 columns are one contiguous run).
  __syncthreads();
  float* out_stage = reinterpret_cast<float*>(smem);
  const int len = kGradFields * H, opitch = odd_pitch(len);
#pragma unroll
  for (int n = 0; n < kMaxHeads; ++n) {
    if (n < H) {
      float* o = out_stage + c * opitch;
      o[n] = sums.g[n];
      o[H + n] = sums.w1[0][n];
      o[2 * H + n] = sums.w1[1][n];
      o[3 * H + n] = sums.w2[0][n];
      o[4 * H + n] = sums.w2[1][n];
    }
  }
  __syncthreads();
  const int cols = min(kComposeColumns, p.T - s0);
  float* dst = p.key_partials + ((static_cast<int64_t>(blockIdx.y) * p.B + b) * p.T + s0) * len;
  for (int i = threadIdx.x; i < cols * len; i += blockDim.x) {
    const int cc = i / len, j = i - cc * len;
    dst[i] = out_stage[cc * opitch + j];
  }
}

// grad of slot c [B, T, 4, ...] = sum over k < parts (ascending) of partials[k, b * T + t, :].
// One thread per (b * T + t, field element); grid ceil(B T 5H / 256), 256 threads.
constexpr int kReduceThreads = 256;
// Defined in dcmha_compose_reduce_kernel.cuh (one translation unit).
__global__ void __launch_bounds__(kReduceThreads) dcmha_compose_reduce_partials(const ComposeParams p,
                                                                                const float* partials, int parts,
                                                                                int c);

}  // namespace dcmha
}  // namespace headwise
