// Head merge on tensor cores (SPEC section 3): the forward (bf16/f16, fp32 as TF32) and
// the backward's grad_z and grad_weight_o GEMMs (bf16/f16); device code shared by nvcc
// and the SIMT emulator. The host (merge_launch.h, fwd_path) sends plain ungated calls
// without stats to cuBLAS instead on the GPU. Notation as in merge_kernel.cuh:
//   y[b, q, :] = bias + sum_h alpha[b,h] Z[b,h,q,:] @ W_h^T,   W_h = weight_o[:, h*Dv:(h+1)*Dv]
// with z [B, H, Q, Dv] read in place (any strides, stride-1 last dim), weight_o [D, H*Dv]
// (stride-1 rows, row stride ldw), out [B, Q, D] contiguous.
//
// Design
//   One CTA computes a kBM x kBN = 128 x 128 tile of y for one batch row b: rows q0.. of
//   Z[b, :, :, :] against rows n0.. of weight_o. Its K loop runs over the open heads of
//   row b (gate != 0; a closed head is never read and costs no MMA) and, per head, over
//   ceil(Dv / kBK) slices of kBK elements of Dv (kBK = 64 bytes: 32 bf16/f16 or 16 fp32);
//   Dv past its end is zero-filled by the copies, so odd Dv needs no padding in memory.
//   The A tile of a slice is Z[b, h, q0 + r, k..k+kBK) (row stride z.stride(2)) and the B
//   tile weight_o[n0 + n, h*Dv + k..) (row stride ldw): both are K-contiguous rows, read
//   in place by cp.async (the gather is the load), 16-byte copies when every address is
//   16-byte aligned, else 4-byte copies, else (2-byte types at odd element offsets)
//   plain 2-byte loads and shared stores (CopyBytes, chosen by the host).
//   4 warps as 2 (M) x 2 (N), warp tile 64 x 64, mma.sync m16n8k16 bf16/f16 (or m16n8k8
//   tf32 for fp32 inputs when torch allows TF32 matmuls), fp32 accumulators; operands
//   come by ldmatrix.x4 from a swizzled 3-stage shared ring (the layout and pipeline of
//   csrc/gemm/sample_gemm_kernel.cuh: 64-byte rows, chunk c of row r at c ^ ((r >> 1) & 3),
//   conflict-free for both the copies and ldmatrix; 48 KiB).
//   alpha: the accumulators hold sum_h (alpha_h / alpha_cur) P_h while head `cur` is
//   accumulated: at a change of alpha between open heads they are multiplied by
//   alpha_prev / alpha_new, and by the last alpha in the epilogue (no second accumulator
//   set, so no extra registers). The open heads are visited in ascending |gate| order
//   (rank_open_heads builds that order once per CTA into shared memory, H ints after the
//   operand ring), so that factor is at most max s / min s <= H in magnitude for gates in
//   [0, 1]: no gate range (say 1 and 1e-39) overflows the accumulators. Binary gates and
//   no gate are one alpha: a single multiply in the epilogue. The bias is added in the
//   epilogue.
//   Epilogue staging (store_tile_staged, shared by the forward and both backward GEMMs):
//   the accumulator fragments (2 adjacent elements per lane, 8 rows per request) go to a
//   [64][kBN + 8] tile in the idle operand ring, one warp row at a time, and leave as
//   16-byte row chunks (a warp stores 512 contiguous bytes) when the output rows are
//   16-byte aligned, else as element stores on consecutive columns. It costs no extra
//   shared memory (17 KiB of the 48 KiB ring for 16-bit T, 34 KiB for fp32) and two
//   __syncthreads per warp row. The grad_z kernel's gate term c = <Z, P> goes through the
//   ring the same way just before (tile_dot_staged: P in fp32, 37 KiB, Z read in 16-byte
//   row chunks).
//
// Budget at the target shape B*Q = 16384, H = 32, Dv = 128, D = 4096, bf16 (ESTIMATES,
// the H200 model of python/headwise/bench/sim_profile.py; nothing measured on a GPU)
//   FLOPs 2 B Q H Dv D = 550 GFLOP; unique bytes 2 (B Q H Dv + D H Dv + B Q D) = 302 MB.
//   Per CTA and k slice: 2 * 128 * 128 * 32 = 1.05 MFLOP for 16 KiB of L2 reads, i.e. 64
//   FLOP per L2 byte; 4096 CTAs; mma-bound (~0.85 ms at 65% of the bf16 dense peak).
//   Shared memory: per warp and 16-deep step 8 ldmatrix.x4 (4 of A, 4 of B) feed 32 mma,
//   1 wavefront per mma, plus the slice's copies (0.5 per mma). The 64 x 64 warp tile
//   is what keeps this under the mma rate: with 8 warps of 64 x 32 (the sample GEMM's
//   layout) it was 1.5 + 0.5 per mma, the bound of the estimate (python -m headwise.bench
//   --sim-profile merge). Registers: 128 accumulators a thread, ~240 in all (255 cap,
//   2 CTAs of 128 threads per SM: 8 warps, each with 32 independent mma per step).
//   Issue: a steady K iteration (one slice: 64 HMMA, 16 LDSM, 8 LDGSTS per warp) is ~130
//   instructions on sm_90 (python -m headwise.bench.sass), ~2 per HMMA (the sample GEMM:
//   3.9): the copy sources and ldmatrix addresses are carried from slice to slice
//   (PlainSliceCopy, StageAddresses) and the ring is addressed as 32-bit shared addresses
//   (hw::SmemAddr), so the loop recomputes no address from threadIdx or the parameters.
#pragma once

#include "../common/mma_primitives.cuh"
#include "../common/simt_portability.h"
#include "../common/vec.cuh"
#include "merge_kernel.cuh"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

namespace headwise {
namespace merge {
namespace tc {

constexpr int kBM = 128, kBN = 128;
constexpr int kChunks = 4;        // 16-byte chunks per shared row (64-byte rows)
constexpr int kRowBytes = 16 * kChunks;
constexpr int kStages = 3;
constexpr int kWarpsM = 2, kWarpsN = 2;
constexpr int kThreads = 32 * kWarpsM * kWarpsN;
constexpr int kWarpM = kBM / kWarpsM, kWarpN = kBN / kWarpsN;  // 64 x 64
constexpr int kMmaM = kWarpM / 16, kMmaN = kWarpN / 8;           // 4 x 8 mma tiles per warp
constexpr int kTileBytes = kBM * kRowBytes;                      // one operand slice, 8 KiB
constexpr size_t kSmemBytes = static_cast<size_t>(kStages) * 2 * kTileBytes;  // 48 KiB
static_assert(kBM == kBN, "A and B slices share one shape");
static_assert((kBM * kChunks) % kThreads == 0, "every thread copies the same number of chunks");
// A plain slice's copies: thread tid copies chunk tid % kChunks of rows tid / kChunks + i *
// kPlainRowStep, i < kPlainRows.
constexpr int kPlainRowStep = kThreads / kChunks;
constexpr int kPlainRows = kBM / kPlainRowStep;
static_assert(kPlainRows * kPlainRowStep == kBM && kPlainRowStep % 8 == 0, "whole rows a thread, one swizzle phase");

// Elements of T per 16-byte chunk and per kBK slice.
template <typename T>
constexpr int kChunkElems = 16 / static_cast<int>(sizeof(T));
template <typename T>
constexpr int kBK = kChunks * kChunkElems<T>;

// Byte offset of (row, 16-byte chunk) in a swizzled [kBM x 64 B] slice.
__device__ __forceinline__ int swizzle(int row, int chunk) { return row * kRowBytes + ((chunk ^ ((row >> 1) & 3)) * 16); }

// The ring stage after `stage`.
__host__ __device__ constexpr int next_stage(int stage) { return stage == kStages - 1 ? 0 : stage + 1; }

// A lane's N ldmatrix addresses in the ring stage being computed (A slices at stage * 2 *
// kTileBytes, B slices kTileBytes on), carried from slice to slice: next() moves them one
// stage on, back to stage 0 after the last. Carried values are what ptxas keeps in
// registers; addresses it can recompute from threadIdx it recomputed every slice when
// registers were scarce (~30 instructions; python -m headwise.bench.sass counts them).
template <int N>
struct StageAddresses {
  hw::SmemAddr at[N];
  int stage;
  // at[n] = stage 0's address plus offset[n] (offsets from the ring's start).
  __device__ __forceinline__ StageAddresses(hw::SmemAddr ring, const int (&offset)[N]) : stage(0) {
#pragma unroll
    for (int n = 0; n < N; ++n) at[n] = ring + offset[n];
  }
  __device__ __forceinline__ void next() {
    const int step = stage == kStages - 1 ? -(kStages - 1) * 2 * kTileBytes : 2 * kTileBytes;
    stage = next_stage(stage);
#pragma unroll
    for (int n = 0; n < N; ++n) at[n] = at[n] + step;
  }
};

// Ring stage `stage`'s A slice and its B slice, kTileBytes on, in the operand ring at `ring`.
__device__ __forceinline__ hw::SmemAddr a_slice(hw::SmemAddr ring, int stage) { return ring + stage * 2 * kTileBytes; }
__device__ __forceinline__ hw::SmemAddr b_slice(hw::SmemAddr ring, int stage) {
  return ring + (stage * 2 * kTileBytes + kTileBytes);
}

// One 16-deep step of the warp's 64 x 64 tile: acc[i][j] += A tile i (m16) x B tile j (n8),
// kMmaM x kMmaN mma.sync from the fragments fa, fb.
template <typename T>
__device__ __forceinline__ void mma_warp_tile(float (&acc)[kMmaM][kMmaN][4], const uint32_t (&fa)[kMmaM][4],
                                              const uint32_t (&fb)[kMmaN][2]) {
#pragma unroll
  for (int i = 0; i < kMmaM; ++i)
#pragma unroll
    for (int j = 0; j < kMmaN; ++j) hw::mma_step<T>(acc[i][j], fa[i], fb[j]);
}

// Copies the first `valid` (0..kChunkElems) elements of a 16-byte chunk at src into the
// shared chunk dst and zero-fills the rest. `fallback` is a readable address used as the
// source of copies that read nothing. CopyBytes: 16, 4, or 2 (plain loads, 2-byte types).
template <typename T, int CopyBytes>
__device__ __forceinline__ void copy_chunk(hw::SmemAddr dst, const T* src, int valid, const T* fallback) {
  constexpr int E = kChunkElems<T>;
  if constexpr (CopyBytes == 16) {
    hw::cp_async_cg16(dst, valid > 0 ? src : fallback, valid * static_cast<int>(sizeof(T)));
  } else if constexpr (CopyBytes == 4) {
    constexpr int per = 4 / static_cast<int>(sizeof(T));
#pragma unroll
    for (int i = 0; i < 16 / 4; ++i) {
      int v = valid - i * per;
      v = v < 0 ? 0 : (v > per ? per : v);
      hw::cp_async_ca<4>(dst + 4 * i, v > 0 ? src + i * per : fallback, v * static_cast<int>(sizeof(T)));
    }
  } else {
    static_assert(CopyBytes == 2 && sizeof(T) == 2, "2-byte copies are for 2-byte types");
    T* d = static_cast<T*>(dst.pointer());
#pragma unroll
    for (int i = 0; i < E; ++i) d[i] = i < valid ? src[i] : T(0.f);
  }
}

// A thread's copy sources of the next slice: Rows rows RowStep apart (row stride ld) from
// base (the thread's first row and column of src), plus the slice's offset. They are
// carried from slice to slice: advance() moves them by a slice (a 64-bit add each), seek()
// sets them at an offset from base (a head change). Carried values are what ptxas cannot
// rematerialize: values it can recompute from the parameters and threadIdx it recomputes
// every slice when registers are scarce (python -m headwise.bench.sass counts the SASS;
// the K loops are issue-bound otherwise).
template <typename T, int Rows, int RowStep>
struct SliceSources {
  const T* base;
  int64_t ld;
  const T* cur[Rows];

  __device__ __forceinline__ SliceSources(const T* src, int64_t ld_, int row, int col)
      : base(src + row * ld_ + col), ld(ld_) {
    seek(0);
  }
  __device__ __forceinline__ void seek(int64_t offset_bytes) {
#pragma unroll
    for (int i = 0; i < Rows; ++i) cur[i] = hw::byte_offset(base + i * RowStep * ld, offset_bytes);
  }
  __device__ __forceinline__ void advance(int64_t bytes) {
#pragma unroll
    for (int i = 0; i < Rows; ++i) cur[i] = hw::byte_offset(cur[i], bytes);
  }
};

// One thread's share of the copies of a plain slice (rows r < kBM of kChunks 16-byte
// chunks, element (r, k) at src[r * ld + k]): chunk c = tid % kChunks of rows r = tid /
// kChunks + i * kPlainRowStep, i < kPlainRows (rows kPlainRowStep = 32 apart have the same
// swizzle phase (r >> 1) & 3, so their chunks are kPlainRowStep rows apart in shared
// memory). What does not depend on the slice (the swizzled shared offset, the row bounds)
// is formed once per kernel; the sources are SliceSources (the thread's chunk c of row r
// of the next slice at cur[0]). full(): a whole slice with 16-byte copies (every row in
// range and k_left >= kBK; the caller decides, uniformly over the CTA) by plain cp.async
// without bounds or zero fill. operator(): any slice, bounded and zero-filled.
template <typename T, int CopyBytes>
struct PlainSliceCopy : SliceSources<T, kPlainRows, kPlainRowStep> {
  using SliceSources<T, kPlainRows, kPlainRowStep>::cur;
  int smem;         // swizzle(r, c)
  int c_elems;      // c * E
  int64_t rows_left;  // rows_valid - r
  bool all_rows;    // every row of the slice below rows_valid (the same for the whole CTA)

  // r = tid / kChunks, c = tid % kChunks; the sources start at src + r * ld + c * E.
  __device__ __forceinline__ PlainSliceCopy(const T* src, int64_t ld, int64_t rows_valid)
      : SliceSources<T, kPlainRows, kPlainRowStep>(src, ld, static_cast<int>(threadIdx.x) / kChunks,
                                                   static_cast<int>(threadIdx.x) % kChunks * kChunkElems<T>) {
    const int r = static_cast<int>(threadIdx.x) / kChunks, c = static_cast<int>(threadIdx.x) % kChunks;
    c_elems = c * kChunkElems<T>;
    smem = swizzle(r, c);
    rows_left = rows_valid - r;
    all_rows = rows_valid >= kBM;
  }
  // Whether full() may copy a slice with k_left elements of k left (uniform over the CTA).
  __device__ __forceinline__ bool whole(int k_left) const { return CopyBytes == 16 && all_rows && k_left >= kBK<T>; }
  __device__ __forceinline__ void full(hw::SmemAddr tile) const {
#pragma unroll
    for (int i = 0; i < kPlainRows; ++i) hw::cp_async_cg16_full(tile + (smem + i * kPlainRowStep * kRowBytes), cur[i]);
  }
  // The next slice with k_left elements of k left in it (the rest zero-filled); fallback: a
  // readable address.
  __device__ __forceinline__ void operator()(hw::SmemAddr tile, int k_left, const T* fallback) const {
    constexpr int E = kChunkElems<T>;
    if (whole(k_left)) return full(tile);
    const int left = k_left - c_elems;
    const int valid = left <= 0 ? 0 : (left >= E ? E : left);
#pragma unroll
    for (int i = 0; i < kPlainRows; ++i)
      copy_chunk<T, CopyBytes>(tile + (smem + i * kPlainRowStep * kRowBytes), cur[i],
                               i * kPlainRowStep < rows_left ? valid : 0, fallback);
  }
};

struct TcFwdParams {
  const void* z;
  int64_t z_sb, z_sh, z_sq;
  const void* w;
  int64_t ldw;
  const void* bias;  // [D] or nullptr
  Gate gate;
  void* out;         // [B, Q, D] contiguous
  int64_t batch, heads, seq, dv, d;
  int64_t q_tiles, n_tiles;
  // The statistics launch only (Stats = true; see head_merge_fwd_tc_kernel): head
  // hs = blockIdx.y of the merge advances z by stats_z_sh and w by stats_w_sh; the real
  // merge's gate (a closed (b, hs) reads nothing and writes zeros) and head count; outputs
  // zsq [B, Q, H] (sum_k Z[b,hs,q,k]^2, by the n tile 0 CTAs) and osq_part
  // [n_tiles, B, Q, H] (per column tile, the row's sum of squares of the product).
  int64_t stats_z_sh, stats_w_sh, stats_heads;
  Gate stats_gate;
  const float* stats_scale2;  // [H]: the product's sums of squares are multiplied by it
  float* zsq;
  float* osq_part;
};

// Every accumulator fragment element of the warp tile: acc = 0, or acc *= factor.
__device__ __forceinline__ void zero_accumulators(float (&acc)[kMmaM][kMmaN][4]) {
#pragma unroll
  for (int i = 0; i < kMmaM; ++i)
#pragma unroll
    for (int j = 0; j < kMmaN; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;
}
__device__ __forceinline__ void scale_accumulators(float (&acc)[kMmaM][kMmaN][4], float factor) {
#pragma unroll
  for (int i = 0; i < kMmaM; ++i)
#pragma unroll
    for (int j = 0; j < kMmaN; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] *= factor;
}

// The accumulators hold sum_k (alpha_k / alpha_cur) P_k; before adding products of a head
// (or batch row) with alpha `alpha` they move to units of it: acc *= alpha_cur / alpha (the
// first one, while acc is still 0, only sets alpha_cur: 1 / alpha may overflow).
__device__ __forceinline__ void switch_alpha(float (&acc)[kMmaM][kMmaN][4], float& alpha_cur, float alpha,
                                             bool first) {
  if (first) {
    alpha_cur = alpha;
  } else if (alpha != alpha_cur) {
    scale_accumulators(acc, alpha_cur / alpha);
    alpha_cur = alpha;
  }
}

// The open entries (gate != 0) of a gate row (or column) in ascending (|g|, index) order,
// the order in which the tensor-core kernels accumulate heads (or batch rows) so that the
// alpha rescale factor alpha_prev / alpha_next stays <= max s / min s in magnitude. A NaN
// gate sorts last (its NaN reaches the output); without gates it is index order.
__device__ __forceinline__ float ascending_gate_key(float g) { return g != g ? INFINITY : fabsf(g); }

// The rank of open entry i (key ki = ascending_gate_key(gate_of(i))) in that order: the
// number of open entries before it. gate_of(j) reads entry j of n; O(n).
template <typename GateOf>
__device__ __forceinline__ int64_t open_rank(const GateOf& gate_of, int64_t n, int64_t i, float ki) {
  int64_t rank = 0;
  for (int64_t j = 0; j < n; ++j) {
    const float gj = gate_of(j);
    if (gj == 0.f) continue;
    const float kj = ascending_gate_key(gj);
    rank += kj < ki || (kj == ki && j < i);
  }
  return rank;
}

// The order for all n entries at once, by the whole CTA: order[rank] = i for each open
// entry i (O(n) per entry, n / blockDim.x entries per thread). Returns the number of open
// entries; the caller synchronizes before reading order.
template <typename GateOf>
__device__ __forceinline__ int64_t rank_open_heads(const GateOf& gate_of, int64_t n, int* order) {
  int64_t open = 0;
  for (int64_t j = 0; j < n; ++j) open += gate_of(j) != 0.f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float gi = gate_of(i);
    if (gi != 0.f) order[open_rank(gate_of, n, i, ascending_gate_key(gi))] = static_cast<int>(i);
  }
  return open;
}

// The turns of a staged epilogue (store_tile_staged, tile_dot_staged). The two warp rows
// (kWarpsM = 2, kWarpM = 64 rows each) take turns staging their accumulators in a 64-row
// tile of the idle ring, which all threads then drain. Turn `part`: a barrier (the ring,
// or the previous turn's tile, is no longer read); the warps of warp row `part` call
// put(r, c, v0, v1) for each pair of accumulators e = 2 half, 2 half + 1 of their mma
// tiles (i, j): v0, v1 = value(i, j, e) (fp32) at tile row r = 16 i + g + 8 half, columns
// c, c + 1 with c = wn + 8 j + 2 t (g = lane / 4, t = lane % 4); a barrier; then every
// thread calls drain(part).
template <typename Value, typename Put, typename Drain>
__device__ __forceinline__ void staged_turns(const Value& value, int wm, int wn, int lane, const Put& put,
                                             const Drain& drain) {
  static_assert(std::is_same<decltype(value(0, 0, 0)), float>::value, "put takes the fp32 values as they are");
  const int g = lane >> 2, t = lane & 3;
#pragma unroll 1
  for (int part = 0; part < kWarpsM; ++part) {
    __syncthreads();
    if (wm == part * kWarpM) {
#pragma unroll
      for (int i = 0; i < kMmaM; ++i)
#pragma unroll
        for (int half = 0; half < 2; ++half)
#pragma unroll
          for (int j = 0; j < kMmaN; ++j)
            put(i * 16 + g + 8 * half, wn + j * 8 + 2 * t, value(i, j, 2 * half), value(i, j, 2 * half + 1));
    }
    __syncthreads();
    drain(part);
  }
}

// The epilogue of every tensor-core GEMM here: out[r * ld + c] = T(value(i, j, e)) for the
// CTA's kBM x kBN tile (rows r < rows, columns c < cols), written through shared memory so
// that each row of the tile leaves in 16-byte stores (a warp writes 512 contiguous bytes of
// a 128-element row) instead of the accumulator fragments' 2-element pieces. value(i, j, e)
// is the fp32 result of accumulator e of mma tile (i, j) of this warp (warp tile origin
// wm, wn): row g + 8 (e >> 1), column 2t + (e & 1) of the mma tile (g = lane / 4, t = lane % 4).
// The two warp rows (kWarpsM = 2, 64 rows each) take turns: warp row `part` puts its
// values (rounded to T) into a [64][kBN + 8] staging tile at smem, the idle operand ring
// (17 KiB for 16-bit T, 34 KiB for fp32, inside kSmemBytes; the 8-element pad keeps the
// fragment writes conflict-free), then all threads copy those rows out: 16-byte stores
// when out and the row stride ld are 16-byte aligned (the chunk past cols, if any, by
// elements), else element stores with consecutive threads on consecutive columns. The
// caller must be done with the ring (no cp.async in flight); starts with __syncthreads.
template <typename T, typename Value>
__device__ __forceinline__ void store_tile_staged(unsigned char* smem, const Value& value, T* out, int64_t ld,
                                                  int64_t rows, int64_t cols, int wm, int wn, int lane) {
  constexpr int E = kChunkElems<T>;
  constexpr int kLdo = kBN + 8;            // staging row, elements
  constexpr int kOutChunks = kBN / E;      // 16-byte chunks per tile row
  static_assert(static_cast<size_t>(kWarpM) * kLdo * sizeof(T) <= kSmemBytes, "a warp row's tile fits the ring");
  const bool vec_out = (ld * static_cast<int64_t>(sizeof(T))) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  T* stage_tile = reinterpret_cast<T*>(smem);
  const auto put = [&](int r, int c, float v0, float v1) {
    struct alignas(2 * sizeof(T)) Pair {
      T x, y;
    };
    *reinterpret_cast<Pair*>(stage_tile + r * kLdo + c) = Pair{static_cast<T>(v0), static_cast<T>(v1)};
  };
  const auto drain = [&](int part) {
    const int64_t part_rows = rows - part * kWarpM;
    T* part_out = out + static_cast<int64_t>(part) * kWarpM * ld;
    if (vec_out) {
      for (int id = threadIdx.x; id < kWarpM * kOutChunks; id += kThreads) {
        const int r = id / kOutChunks, c0 = (id % kOutChunks) * E;
        if (r >= part_rows || c0 >= cols) continue;
        const T* src = stage_tile + r * kLdo + c0;
        T* dst = part_out + r * ld + c0;
        if (c0 + E <= cols) {
          hw::store_pack<T, E>(dst, hw::load_pack<T, E>(src));
        } else {
          for (int e = 0; c0 + e < cols; ++e) dst[e] = src[e];
        }
      }
    } else {
      for (int id = threadIdx.x; id < kWarpM * kBN; id += kThreads) {
        const int r = id / kBN, c = id % kBN;
        if (r < part_rows && c < cols) part_out[r * ld + c] = stage_tile[r * kLdo + c];
      }
    }
  };
  staged_turns(value, wm, wn, lane, put, drain);
}

// The gate's gradient term of a backward tile: sum over rows r < rows, columns c < cols of
// z[r * ld + c] * P(r, c), P(r, c) = acc fragment element e of mma tile (i, j) of the warp
// (the layout of store_tile_staged), in fp32; returns this thread's share (the caller sums
// the shares over the CTA in a fixed order). Z is read in rows, not at the fragments'
// positions (2 elements per lane, 8 rows per request: 4x the ideal sectors): the warp rows
// take turns putting P (fp32, unrounded) into a [64][kLdp] float tile in the idle ring
// (37 KiB of kSmemBytes), then all threads read Z in 16-byte row chunks (a warp reads 2
// rows of 256 contiguous bytes) when z and the row stride ld are 16-byte aligned (the chunk
// past cols, if any, by elements), else elements on consecutive columns, each multiplied
// by P from shared memory. Per thread the products are added in a fixed order (its chunks
// or elements in ascending id, a chunk's elements in column order): the sum is bitwise
// repeatable. The caller must be done with the ring (no cp.async in flight); starts with
// __syncthreads and leaves the tile in the ring (its next user synchronizes first).
//   Staging row layout (conflict-free for every access here): the 4-column groups of P
//   alternate between two 64-float halves, the second at word kHalf1 = 80 (16 banks on):
//   column c at word ((c >> 2) & 1) * 80 + (c >> 3) * 4 + (c & 3), so that a 16-byte Z
//   chunk (8 columns) meets two 16-byte pieces of P, at 4k and 80 + 4k, read by
//   consecutive lanes from consecutive words (4 wavefronts a warp, the ideal). The row
//   stride kLdp = 148 is 20 banks mod 32, which, with the halves 16 banks apart, spreads
//   the fragments' 8-byte writes (8 rows x 4 lanes) over the banks at 2 wavefronts.
template <typename T>
__device__ __forceinline__ float tile_dot_staged(unsigned char* smem, const float (&acc)[kMmaM][kMmaN][4],
                                                 const T* z, int64_t ld, int64_t rows, int64_t cols, int wm,
                                                 int wn, int lane) {
  constexpr int E = kChunkElems<T>;
  constexpr int kHalf1 = 80;           // word of the second half of a staging row
  constexpr int kLdp = kHalf1 + 68;    // staging row, floats (148: 20 banks mod 32)
  constexpr int kZChunks = kBN / E;    // 16-byte chunks of Z per tile row
  static_assert(static_cast<size_t>(kWarpM) * kLdp * sizeof(float) <= kSmemBytes, "a warp row's P fits the ring");
  static_assert(E == 8 && kBN == 128, "a 16-byte chunk of Z (16-bit T) meets two 16-byte pieces of P");
  const auto word = [](int col) { return ((col >> 2) & 1) * kHalf1 + (col >> 3) * 4 + (col & 3); };
  const bool vec_z = (ld * static_cast<int64_t>(sizeof(T))) % 16 == 0 && reinterpret_cast<uintptr_t>(z) % 16 == 0;
  float* stage = reinterpret_cast<float*>(smem);
  float c = 0.f;
  const auto put = [&](int r, int col, float v0, float v1) {
    hw::Pack<float, 2> pair;
    pair.v[0] = v0;
    pair.v[1] = v1;
    hw::store_pack<float, 2>(stage + r * kLdp + word(col), pair);
  };
  const auto drain = [&](int part) {
    const int64_t part_rows = rows - part * kWarpM;
    const T* part_z = z + static_cast<int64_t>(part) * kWarpM * ld;
    if (vec_z) {
#pragma unroll 1  // rolled: unrolled, the four chunks' loads (48 registers) on top of acc cost occupancy
      for (int id = threadIdx.x; id < kWarpM * kZChunks; id += kThreads) {
        const int r = id / kZChunks, k = id % kZChunks, c0 = k * E;
        if (r >= part_rows || c0 >= cols) continue;
        const hw::Pack<float, 4> lo = hw::load_pack<float, 4>(stage + r * kLdp + 4 * k);
        const hw::Pack<float, 4> hi = hw::load_pack<float, 4>(stage + r * kLdp + kHalf1 + 4 * k);
        const T* src = part_z + r * ld + c0;
        if (c0 + E <= cols) {
          const hw::Pack<T, E> x = hw::load_pack<T, E>(src);
#pragma unroll
          for (int e = 0; e < 4; ++e) c = fmaf(static_cast<float>(x.v[e]), lo.v[e], c);
#pragma unroll
          for (int e = 0; e < 4; ++e) c = fmaf(static_cast<float>(x.v[4 + e]), hi.v[e], c);
        } else {
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (c0 + e < cols) c = fmaf(static_cast<float>(src[e]), lo.v[e], c);
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (c0 + 4 + e < cols) c = fmaf(static_cast<float>(src[4 + e]), hi.v[e], c);
        }
      }
    } else {
#pragma unroll 1
      for (int id = threadIdx.x; id < kWarpM * kBN; id += kThreads) {
        const int r = id / kBN, col = id % kBN;
        if (r < part_rows && col < cols)
          c = fmaf(static_cast<float>(part_z[r * ld + col]), stage[r * kLdp + word(col)], c);
      }
    }
  };
  staged_turns([&](int i, int j, int e) { return acc[i][j][e]; }, wm, wn, lane, put, drain);
  return c;
}

// Dynamic shared memory of the forward: the operand ring, then the head order (H ints).
inline size_t fwd_smem_bytes(int64_t heads) {
  return kSmemBytes + static_cast<size_t>((heads * static_cast<int64_t>(sizeof(int)) + 15) / 16 * 16);
}

// grid (B * ceil(Q / kBM) * ceil(D / kBN)), kThreads threads, fwd_smem_bytes(H) dynamic
// shared memory: blockIdx.x = (b * q_tiles + q tile) * n_tiles + n tile (the column tiles of
// one row tile are adjacent, so they share its Z slices in L2).
//
// Stats = true is the statistics pass of return_stats (merge_launch.h launch_stats_tc),
// the same GEMM on other operands: for each head hs (grid y) the product
// Z_hs [Q, Dv] @ L_hs [Dv, Dv] with L_hs L_hs^T = W_hs^T W_hs (so that
// ||Z_hs W_hs^T|| = ||Z_hs L_hs||: a sum of squares, no cancellation), L_hs^T split into
// two 16-bit parts hi + lo (L^T ~ hi + lo to ~2^-16 relative) that are the two
// "heads" of w = [hi | lo] ([Dv, 2 Dv], z_sh = 0: both read Z_hs, no gate). The
// epilogue keeps no product: it writes each row's sum of squares over the CTA's columns
// (osq_part), and the n tile 0 CTAs also the row's sum of squares of Z_hs, read from the
// A slices of the first pseudo-head already in shared memory (zsq).
// Budget at the target shape (ESTIMATE): 2 * B Q H Dv * 2 Dv = 34 GFLOP (6% of the
// merge's), Z read once more (134 MB), [B, Q, H] floats written.
// Two CTAs of kThreads per SM (up to 255 registers a thread; python -m headwise.bench.ptxas).
template <typename T, int CopyBytes, bool Stats = false>
__global__ void __launch_bounds__(kThreads, 2) head_merge_fwd_tc_kernel(TcFwdParams p) {
  constexpr int E = kChunkElems<T>;
  constexpr int BK = kBK<T>;
  unsigned char* smem = hw::dynamic_shared_memory();
  const hw::SmemAddr ring(smem);
  const int64_t tile = blockIdx.x;
  const int64_t tile_n = tile % p.n_tiles;
  const int64_t tile_q = (tile / p.n_tiles) % p.q_tiles;
  const int64_t b = tile / (p.n_tiles * p.q_tiles);
  const int64_t n0 = tile_n * kBN, q0 = tile_q * kBM;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = (warp % kWarpsM) * kWarpM, wn = (warp / kWarpsM) * kWarpN;
  const int64_t rows_a = p.seq - q0 < kBM ? p.seq - q0 : kBM;
  const int64_t hs = Stats ? static_cast<int64_t>(blockIdx.y) : 0;
  // Stats: [B, Q, H] index of this CTA's row 0, and [B, Q, H] elements per column tile.
  const int64_t stat0 = (b * p.seq + q0) * p.stats_heads + hs, stat_tile = p.batch * p.seq * p.stats_heads;
  if constexpr (Stats) {
    if (p.stats_gate.at(b, hs) == 0.f) {  // a closed head: nothing read, both norms 0
      for (int64_t r = threadIdx.x; r < rows_a; r += kThreads) {
        if (tile_n == 0) p.zsq[stat0 + r * p.stats_heads] = 0.f;
        p.osq_part[tile_n * stat_tile + stat0 + r * p.stats_heads] = 0.f;
      }
      return;
    }
  }
  const T* z = static_cast<const T*>(p.z) + b * p.z_sb + q0 * p.z_sq + hs * p.stats_z_sh;
  const T* w = static_cast<const T*>(p.w) + n0 * p.ldw + hs * p.stats_w_sh;
  const int64_t rows_b = p.d - n0 < kBN ? p.d - n0 : kBN;
  const int slices = static_cast<int>((p.dv + BK - 1) / BK);  // k slices per head

  // The open heads of row b in ascending |gate| order, once per CTA.
  int* order = reinterpret_cast<int*>(smem + kSmemBytes);
  const int open = static_cast<int>(rank_open_heads([&](int64_t h) { return p.gate.at(b, h); }, p.heads, order));
  const int k_tiles = open * slices;
  const float s = p.gate.scale(b);
  __syncthreads();

  // The copy cursor: rank and slice of the next slice to issue, its byte offsets in z and
  // w (moved by a slice's bytes, set from the head order at a head change: no 64-bit
  // product per slice), and its ring stage. whole: every slice of the CTA is a whole one
  // (all rows in range, Dv a multiple of BK, 16-byte copies), one test per slice.
  PlainSliceCopy<T, CopyBytes> copy_a(z, p.z_sq, rows_a), copy_b(w, p.ldw, rows_b);
  const int dv = static_cast<int>(p.dv);
  const bool whole = copy_a.whole(BK) && copy_b.whole(BK) && dv % BK == 0;
  constexpr int64_t kSize = sizeof(T);
  int issue_rank = 0, issue_slice = 0, issue_stage = 0;
  auto seek_head = [&](int64_t h) {
    copy_a.seek(h * p.z_sh * kSize);
    copy_b.seek(h * p.dv * kSize);
  };
  if (open > 0) seek_head(order[0]);
  auto issue = [&](int kt) {
    if (kt < k_tiles) {
      if (whole) {
        copy_a.full(a_slice(ring, issue_stage));
        copy_b.full(b_slice(ring, issue_stage));
      } else {
        const int k_left = dv - issue_slice * BK;
        copy_a(a_slice(ring, issue_stage), k_left, z);
        copy_b(b_slice(ring, issue_stage), k_left, w);
      }
      if (++issue_slice == slices) {
        issue_slice = 0;
        if (++issue_rank < open) seek_head(order[issue_rank]);
      } else {
        copy_a.advance(BK * kSize);
        copy_b.advance(BK * kSize);
      }
      issue_stage = next_stage(issue_stage);
    }
    hw::cp_async_commit();
  };

  float acc[kMmaM][kMmaN][4];
  zero_accumulators(acc);

#pragma unroll
  for (int kt = 0; kt < kStages - 1; ++kt) issue(kt);

  // ldmatrix.x4 row addresses of this lane (as in the sample GEMM). A (m16 x 32 bytes of
  // k): matrix i = lane / 8 covers rows (i & 1) * 8.. and chunk i >> 1, giving a0..a3 in
  // mma order for both the k16 16-bit and the k8 tf32 fragments. B ([n][k] rows, two n8
  // tiles): matrix i covers n rows (i >> 1) * 8.. and chunk i & 1, giving b0, b1 of n
  // tile 2j and of n tile 2j + 1.
  // The lane's ldmatrix addresses, per 16-deep step ks: A's at ld.at[ks], B's at
  // ld.at[2 + ks] (StageAddresses). Rows i * 16 and j * 8 further keep the swizzle phase
  // ((row >> 1) & 3), so mma tile i of A is i * 16 rows on and n tile j of B j * 8 rows
  // on: immediates of the ldmatrix.
  static_assert(kChunks / 2 == 2, "two 16-deep steps a slice");
  const int quad = lane / 8, row_in_quad = lane % 8;
  const int a_row = (quad & 1) * 8 + row_in_quad, a_chunk = quad >> 1;
  const int b_row = (quad >> 1) * 8 + row_in_quad, b_chunk = quad & 1;
  StageAddresses<4> ld(ring, {swizzle(wm + a_row, a_chunk), swizzle(wm + a_row, 2 + a_chunk),
                              kTileBytes + swizzle(wn + b_row, b_chunk), kTileBytes + swizzle(wn + b_row, 2 + b_chunk)});

  // The compute cursor: alpha of the head being accumulated (acc holds the sum scaled
  // by 1 / alpha_cur).
  int comp_rank = -1, comp_slice = slices - 1;
  float alpha_cur = 1.f;
  // Stats: row zrow = threadIdx.x's sum of squares of Z (its kChunks chunks).
  static_assert(!Stats || kThreads == kBM, "a thread per row");
  const int zrow = threadIdx.x;
  float zss = 0.f;
  for (int kt = 0; kt < k_tiles; ++kt) {
    if (++comp_slice == slices) {  // the next open head
      comp_slice = 0;
      switch_alpha(acc, alpha_cur, s * p.gate.at(b, order[++comp_rank]), kt == 0);
    }
    hw::cp_async_wait<kStages - 2>();
    __syncthreads();
    issue(kt + kStages - 1);
    if constexpr (Stats) {
      if (tile_n == 0 && kt < slices) {  // the first pseudo-head's slices are Z_hs itself
#pragma unroll 1  // rolled: unrolled, the 2-byte-copy variant spills 8 bytes on sm_80
        for (int c = 0; c < kChunks; ++c) {
          const T* chunk = static_cast<const T*>((a_slice(ring, ld.stage) + swizzle(zrow, c)).pointer());
          const hw::Pack<T, E> x = hw::load_pack<T, E>(chunk);
#pragma unroll
          for (int e = 0; e < E; ++e) {
            const float v = static_cast<float>(x.v[e]);
            zss = fmaf(v, v, zss);
          }
        }
      }
    }
#pragma unroll
    for (int ks = 0; ks < kChunks / 2; ++ks) {
      uint32_t fa[kMmaM][4], fb[kMmaN][2];
#pragma unroll
      for (int i = 0; i < kMmaM; ++i) hw::ldmatrix<4>(fa[i], ld.at[ks] + i * 16 * kRowBytes);
#pragma unroll
      for (int j = 0; j < kMmaN; j += 2) {
        uint32_t r[4];
        hw::ldmatrix<4>(r, ld.at[2 + ks] + j * 8 * kRowBytes);
        fb[j][0] = r[0];
        fb[j][1] = r[1];
        fb[j + 1][0] = r[2];
        fb[j + 1][1] = r[3];
      }
      mma_warp_tile<T>(acc, fa, fb);
    }
    ld.next();
  }
  hw::cp_async_wait<0>();  // only empty groups remain; leave no copy in flight at exit

  const int g = lane >> 2, t = lane & 3;
  if constexpr (Stats) {
    // Row sums of squares of acc (alpha is 1: no gate): over the thread's columns, its quad
    // (the 4 lanes of a row), then the kWarpsN warps of the row in a fixed order, through
    // the (now idle) operand ring.
    __syncthreads();
    float* red = reinterpret_cast<float*>(smem);  // [kWarpsN][kBM]
#pragma unroll
    for (int i = 0; i < kMmaM; ++i)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float ss = 0.f;
#pragma unroll
        for (int j = 0; j < kMmaN; ++j)
          ss += acc[i][j][2 * half] * acc[i][j][2 * half] + acc[i][j][2 * half + 1] * acc[i][j][2 * half + 1];
        ss += __shfl_xor_sync(0xffffffffu, ss, 1);
        ss += __shfl_xor_sync(0xffffffffu, ss, 2);
        if (t == 0) red[(warp / kWarpsM) * kBM + wm + i * 16 + g + 8 * half] = ss;
      }
    __syncthreads();
    const float scale2 = p.stats_scale2[hs];
    for (int r = threadIdx.x; r < rows_a; r += kThreads) {
      float ss = 0.f;
#pragma unroll
      for (int wn_i = 0; wn_i < kWarpsN; ++wn_i) ss += red[wn_i * kBM + r];
      p.osq_part[tile_n * stat_tile + stat0 + r * p.stats_heads] = ss * scale2;
    }
    if (tile_n == 0 && zrow < rows_a) p.zsq[stat0 + zrow * p.stats_heads] = zss;
    return;
  }

  // Epilogue: y = alpha_cur * acc + bias, staged through the idle ring (store_tile_staged).
  const T* bias = static_cast<const T*>(p.bias);
  float bias_v[kMmaN][2];
#pragma unroll
  for (int j = 0; j < kMmaN; ++j) {
    const int col = wn + j * 8 + 2 * t;
    bias_v[j][0] = bias != nullptr && col < rows_b ? static_cast<float>(bias[n0 + col]) : 0.f;
    bias_v[j][1] = bias != nullptr && col + 1 < rows_b ? static_cast<float>(bias[n0 + col + 1]) : 0.f;
  }
  store_tile_staged<T>(
      smem, [&](int i, int j, int e) { return fmaf(alpha_cur, acc[i][j][e], bias_v[j][e & 1]); },
      static_cast<T*>(p.out) + (b * p.seq + q0) * p.d + n0, p.d, rows_a, rows_b, wm, wn, lane);
}

// ---------------------------------------------------------------------------------------
// Backward on tensor cores (bf16/f16; fp32 keeps the SIMT kernels of merge_kernel.cuh).
//   dZ[b,h] = alpha[b,h] P[b,h],  P[b,h] = dy_b @ W_h  [Q, Dv],  c[b,h] = <Z[b,h], P[b,h]>
//   dW_h    = sum_b alpha[b,h] dy_b^T Z[b,h]  [D, Dv]
// Both use the forward's CTA shape (128 x 128 tile, 4 warps of 64 x 64, 3-stage cp.async
// ring, 16 KiB per stage) and its staged epilogue (store_tile_staged: dZ in z's layout
// and dW leave in 16-byte row stores where their rows are 16-byte aligned). The gate's
// gradient term c (a partial per grad_z CTA) reads Z in 16-byte row chunks against P
// staged in fp32 in the idle ring first (tile_dot_staged; element loads on consecutive
// columns when Z's rows are not 16-byte aligned), not at the fragments' positions. An
// operand whose k axis is its rows in memory (W_h for dZ: [k = n of D][Dv]; dy^T and Z
// for dW: [k = q][*]) is staged as kTransK = 32 k-rows of 128 elements (256-byte rows, 16-byte
// chunk c of row r at c ^ (r & 7): the 8 rows one ldmatrix.trans phase reads land in 8
// bank groups, conflict-free) and read by ldmatrix.x4.trans, which hands out the k-pairs
// the mma fragments need.
// Budget at the target shape (ESTIMATES, as for the forward): each GEMM is 2 B Q H Dv D =
// 550 GFLOP; per CTA and 32-deep slice 1.05 MFLOP for 16 KiB of L2 reads (64 FLOP/byte).
// grad_z: B*H*ceil(Q/128)*ceil(Dv/128) = 4096 CTAs over K = D; grad_weight_o:
// H*ceil(D/128)*ceil(Dv/128) = 1024 CTAs over K = B*Q (7.8 per SM: no split needed there;
// a CTA's reduction order is fixed, so the result is bitwise repeatable).
// ---------------------------------------------------------------------------------------
constexpr int kTransK = 32;                 // k rows of a transposed slice
constexpr int kTransRowBytes = kBN * 2;     // 128 16-bit elements
static_assert(kTransK * kTransRowBytes == kTileBytes, "a transposed slice has the size of a plain one");
// A transposed slice's copies: thread tid copies chunk tid % kTransRowChunks of k rows tid /
// kTransRowChunks + i * kTransRowStep, i < kTransRows.
constexpr int kTransRowChunks = kTransRowBytes / 16;
constexpr int kTransRowStep = kThreads / kTransRowChunks;
constexpr int kTransRows = kTransK / kTransRowStep;
static_assert(kTransRows * kTransRowStep == kTransK && kTransRowStep % 8 == 0,
              "whole k rows a thread, one swizzle phase");

__device__ __forceinline__ int swizzle_t(int row, int chunk) { return row * kTransRowBytes + ((chunk ^ (row & 7)) * 16); }

// One thread's share of the copies of a transposed slice (kTransK rows of k, 16 chunks of
// 8 elements of n each: element (k, n) at src[k * ld + n], columns n < n_cols): chunk c =
// tid % 16 of k rows r = tid / 16 + i * kTransRowStep, i < kTransRows. As PlainSliceCopy:
// the per-kernel part formed once, the sources carried from slice to slice (SliceSources:
// the thread's chunk c of k row r of the next slice at cur[0]). Rows kTransRowStep = 8
// apart have the same swizzle phase (r & 7).
template <typename T, int CopyBytes>
struct TransSliceCopy : SliceSources<T, kTransRows, kTransRowStep> {
  using SliceSources<T, kTransRows, kTransRowStep>::cur;
  int smem;         // swizzle_t(r, c)
  int r;
  int valid_n;      // elements of chunk c below n_cols (0..8)
  bool all_cols;    // every column of the slice below n_cols (the same for the whole CTA)

  // r = tid / 16, c = tid % 16; the sources start at src + r * ld + c * 8.
  __device__ __forceinline__ TransSliceCopy(const T* src, int64_t ld, int64_t n_cols)
      : SliceSources<T, kTransRows, kTransRowStep>(src, ld, static_cast<int>(threadIdx.x) / kTransRowChunks,
                                                   static_cast<int>(threadIdx.x) % kTransRowChunks * 8) {
    r = static_cast<int>(threadIdx.x) / kTransRowChunks;
    const int c = static_cast<int>(threadIdx.x) % kTransRowChunks;
    smem = swizzle_t(r, c);
    const int64_t left = n_cols - c * 8;
    valid_n = left <= 0 ? 0 : (left >= 8 ? 8 : static_cast<int>(left));
    all_cols = n_cols >= kTransRowChunks * 8;
  }
  // Whether full() may copy a slice with k_rows rows of k left (uniform over the CTA).
  __device__ __forceinline__ bool whole(int k_rows) const { return CopyBytes == 16 && all_cols && k_rows >= kTransK; }
  __device__ __forceinline__ void full(hw::SmemAddr tile) const {
#pragma unroll
    for (int i = 0; i < kTransRows; ++i)
      hw::cp_async_cg16_full(tile + (smem + i * kTransRowStep * kTransRowBytes), cur[i]);
  }
  // The next slice with k_rows rows of k left in it (the rest zero-filled); fallback: a
  // readable address.
  __device__ __forceinline__ void operator()(hw::SmemAddr tile, int k_rows, const T* fallback) const {
    if (whole(k_rows)) return full(tile);
#pragma unroll
    for (int i = 0; i < kTransRows; ++i)
      copy_chunk<T, CopyBytes>(tile + (smem + i * kTransRowStep * kTransRowBytes), cur[i],
                               r + i * kTransRowStep < k_rows ? valid_n : 0, fallback);
  }
};

// ldmatrix.x4.trans of a transposed slice, 16 k rows from k_row (a multiple of 16: k rows 16
// further keep the swizzle phase, so the same lane offset serves every k step at + k_row *
// kTransRowBytes):
//   B fragments of n tiles j, j + 1 (16 columns from n_col): lane offset b_trans_lane(n_col),
//   matrices (k 0-7 | k 8-15) x (n 0-7 | n 8-15) give b0 = {r0, r1}, b1 = {r2, r3};
//   A fragment (16 m rows from m_row; stored [k][m]): lane offset a_trans_lane(m_row), a0 (m
//   0-7, k 0-7), a1 (m 8-15, k 0-7), a2 (m 0-7, k 8-15), a3 (m 8-15, k 8-15).
__device__ __forceinline__ int b_trans_lane(int n_col, int lane) {
  const int quad = lane / 8;
  return swizzle_t((quad & 1) * 8 + lane % 8, n_col / 8 + (quad >> 1));
}
__device__ __forceinline__ int a_trans_lane(int m_row, int lane) {
  const int quad = lane / 8;
  return swizzle_t((quad >> 1) * 8 + lane % 8, m_row / 8 + (quad & 1));
}
__device__ __forceinline__ void ldmatrix_b_trans(uint32_t (&b0)[2], uint32_t (&b1)[2], hw::SmemAddr lane_address) {
  uint32_t r[4];
  hw::ldmatrix<4, true>(r, lane_address);
  b0[0] = r[0];
  b0[1] = r[1];
  b1[0] = r[2];
  b1[1] = r[3];
}

// The SIMT backward's parameters (merge_kernel.cuh; here c_part is [B, H, q_tiles *
// dv_tiles] of this file's tiles) and this file's tile counts.
struct TcBwdParams : BwdParams {
  int64_t q_tiles, dv_tiles, d_tiles;
  // grad_weight_o's open batch rows of each head in ascending |gate| order, [H, B] (row h:
  // its open rows first; head_merge_row_sort_kernel) for a [B, H] gate; nullptr when
  // every row of a head has the head's gate ([H] gate or none): index order.
  const int* row_order;
};

// grad_weight_o's batch-row order for a [B, H] gate: row_order[h * B + i] = the i-th open
// row b of head h in open_rank's order, (ascending_gate_key, b) ascending. A row's sort key
// packs both into one integer, row_sort_key = key bits << 32 | b (a non-negative float's
// bits order as the float does; +inf, a NaN gate's key, is the largest); a closed row's is
// kClosedRowKey, after every open one. Two kernels, O(B log^2 C + B ceil(B / C) log C)
// work a head for C-row chunks (where open_rank over the column would be O(B^2)):
//   head_merge_row_sort_kernel: grid (ceil(B / chunk), H), kSortThreads threads. The CTA
//     sorts its chunk of the head's keys in shared memory (a bitonic network over the
//     chunk's length rounded up to a power of two, padded with kClosedRowKey; one barrier
//     a step). A single chunk (B <= chunk) is the whole order: the CTA writes row_order.
//     Otherwise it writes the sorted chunk (padding included) to sorted_keys [H, chunks,
//     chunk].
//   head_merge_row_rank_kernel (B > chunk only): grid (ceil(B / kThreads), H), a thread per
//     (b, h): b's rank is the number of keys below its key in every sorted chunk (a binary
//     search each: chunks * (log2(chunk) + 1) reads), and row_order[h * B + rank] = b.
// chunk is kSortChunk (32 KiB of keys, under every part's 48 KiB static limit) or a smaller
// power of two (HEADWISE_MERGE_ROW_SORT_CHUNK, for the tests of the two-kernel path).
// Budget at B = 16384, H = 32 (ESTIMATE from the emulator's counts, bench/RESULTS.md): 128
// sort CTAs of 78 steps, 20,480 shared wavefronts each, ~10 us; 524,288 rank threads of
// 4 x 12 dependent 8-byte reads (divergent after the first steps: 547,050 L2 sectors a
// head), ~56 us at most; where the column scan (open_rank a thread) was 8.6 G compares,
// ~2-3 ms.
constexpr int kSortThreads = 512;
constexpr int kSortChunk = 4096;
constexpr uint64_t kClosedRowKey = ~uint64_t{0};

__device__ __forceinline__ uint64_t row_sort_key(float g, int64_t b) {
  if (g == 0.f) return kClosedRowKey;
  return static_cast<uint64_t>(__float_as_uint(ascending_gate_key(g))) << 32 | static_cast<uint32_t>(b);
}

// Key i's 8-byte slot in the sort's shared array: i with its low 4 bits (its bank pair)
// XORed by F(bits 4-5 of i), F(0..3) = 0000, 1101, 0110, 1011. A warp's compare-exchange
// step j = 2^m < 16 reads 32 keys i with bit m = 0 from 64 aligned keys, 8 from each run of
// 16: unswizzled, the 8 bank pairs with bit m = 0, each 4 times (4 wavefronts where 256
// bytes need 2); F sets bit m in two of the four runs, so each bank pair is read twice.
// Steps j >= 16 and the fills read whole runs of 16 keys.
__device__ __forceinline__ int sort_slot(int i) { return i ^ ((0xB6D0 >> (((i >> 4) & 3) * 4)) & 0xF); }

__global__ void __launch_bounds__(kSortThreads) head_merge_row_sort_kernel(const Gate gate, int64_t batch, int chunk,
                                                                           uint64_t* sorted_keys, int* row_order) {
  __shared__ uint64_t keys[kSortChunk];
  const int64_t h = blockIdx.y;
  const int64_t b0 = static_cast<int64_t>(blockIdx.x) * chunk;
  const int rows = static_cast<int>(batch - b0 < chunk ? batch - b0 : chunk);
  // The network's length: rows rounded up to a power of two (a whole chunk when there are
  // several, so that every sorted chunk in sorted_keys has the same length).
  int n = 1;
  while (n < rows) n <<= 1;
  if (sorted_keys) n = chunk;
  for (int i = threadIdx.x; i < n; i += kSortThreads)
    keys[sort_slot(i)] = i < rows ? row_sort_key(gate.at(b0 + i, h), b0 + i) : kClosedRowKey;
  __syncthreads();
  // Bitonic sort: merge sizes k = 2, 4, .., n; within each, compare-exchange partners j
  // apart (j = k / 2, .., 1); pair t's low element is t with a 0 bit inserted at log2(j),
  // and it ends ascending when bit k of it is 0.
  for (int k = 2; k <= n; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int t = threadIdx.x; t < n / 2; t += kSortThreads) {
        const int lo = 2 * t - (t & (j - 1)), lo_slot = sort_slot(lo), hi_slot = sort_slot(lo + j);
        const uint64_t a = keys[lo_slot], c = keys[hi_slot];
        if ((a > c) == ((lo & k) == 0)) {
          keys[lo_slot] = c;
          keys[hi_slot] = a;
        }
      }
      __syncthreads();
    }
  }
  if (sorted_keys) {
    uint64_t* out = sorted_keys + (h * gridDim.x + blockIdx.x) * static_cast<int64_t>(chunk);
    for (int i = threadIdx.x; i < n; i += kSortThreads) out[i] = keys[sort_slot(i)];
  } else {
    for (int i = threadIdx.x; i < rows; i += kSortThreads) {
      const uint64_t key = keys[sort_slot(i)];
      if (key != kClosedRowKey) row_order[h * batch + i] = static_cast<int>(key & 0xffffffffu);
    }
  }
}

__global__ void __launch_bounds__(kThreads) head_merge_row_rank_kernel(const Gate gate, int64_t batch, int chunk,
                                                                       int chunks, const uint64_t* sorted_keys,
                                                                       int* row_order) {
  const int64_t h = blockIdx.y;
  const int64_t b = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (b >= batch) return;
  const uint64_t key = row_sort_key(gate.at(b, h), b);
  if (key == kClosedRowKey) return;
  int64_t rank = 0;
  for (int c = 0; c < chunks; ++c) {
    const uint64_t* sorted = sorted_keys + (h * chunks + c) * static_cast<int64_t>(chunk);
    int below = 0;  // keys of the chunk below `key` (all keys differ: b is in them)
    for (int step = chunk >> 1; step > 0; step >>= 1)
      if (sorted[below + step - 1] < key) below += step;
    rank += below + (sorted[below] < key);
  }
  row_order[h * batch + rank] = static_cast<int>(b);
}

// grad_z and c: grid (B * H * q_tiles * dv_tiles), kThreads threads, kSmemBytes:
// blockIdx.x = ((b * H + h) * q_tiles + q tile) * dv_tiles + Dv tile. K loop over D in
// 32-deep slices: A = dy_b rows (plain), B = W[k, h*Dv + n] (transposed slice).
// Two CTAs per SM (2 x 48 KiB of shared memory, up to 255 registers a thread).
template <typename T, int CopyBytes>
__global__ void __launch_bounds__(kThreads, 2) head_merge_bwd_dz_tc_kernel(TcBwdParams p) {
  unsigned char* smem = hw::dynamic_shared_memory();
  const hw::SmemAddr ring(smem);
  __shared__ float red[64];
  const int64_t tile = blockIdx.x;
  const int64_t tile_n = tile % p.dv_tiles;
  const int64_t tile_q = (tile / p.dv_tiles) % p.q_tiles;
  const int64_t bh = tile / (p.dv_tiles * p.q_tiles);
  const int64_t b = bh / p.heads, h = bh % p.heads;
  const int64_t n0 = tile_n * kBN, q0 = tile_q * kBM;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = (warp % kWarpsM) * kWarpM, wn = (warp / kWarpsM) * kWarpN;
  const int64_t rows = p.seq - q0 < kBM ? p.seq - q0 : kBM;
  const int64_t cols = p.dv - n0 < kBN ? p.dv - n0 : kBN;
  const T* dy = static_cast<const T*>(p.grad_out) + (b * p.seq + q0) * p.d;
  const T* w = static_cast<const T*>(p.w) + h * p.dv + n0;
  const float g = p.gate.at(b, h);
  const bool need_c = p.c_part != nullptr;
  // A closed head's P is only needed for the gate's gradient.
  const int d = static_cast<int>(p.d);
  const int k_tiles = (g != 0.f || need_c) ? (d + kTransK - 1) / kTransK : 0;

  PlainSliceCopy<T, CopyBytes> copy_a(dy, p.d, rows);
  TransSliceCopy<T, CopyBytes> copy_b(w, p.ldw, cols);
  const int64_t w_step = kTransK * p.ldw * static_cast<int64_t>(sizeof(T));  // bytes of W rows per slice
  int issue_stage = 0;
  auto issue = [&](int kt) {
    if (kt < k_tiles) {
      const int k0 = kt * kTransK;
      copy_a(a_slice(ring, issue_stage), d - k0, dy);
      copy_b(b_slice(ring, issue_stage), d - k0, w);
      copy_a.advance(kTransK * static_cast<int64_t>(sizeof(T)));
      copy_b.advance(w_step);
      issue_stage = next_stage(issue_stage);
    }
    hw::cp_async_commit();
  };
  float acc[kMmaM][kMmaN][4];
  zero_accumulators(acc);
#pragma unroll
  for (int kt = 0; kt < kStages - 1; ++kt) issue(kt);
  // The lane's ldmatrix addresses (StageAddresses): A (plain) per 16-deep step ks at
  // ld.at[ks], mma tile i 16 rows on; B (transposed) per n tile pair j / 2 at ld.at[2 + j / 2],
  // step ks 16 k rows on.
  static_assert(kTransK / 16 == 2 && kMmaN == 8, "two 16-deep steps and four B tile pairs");
  const int quad = lane / 8, row_in_quad = lane % 8;
  const int a_row = (quad & 1) * 8 + row_in_quad, a_chunk = quad >> 1;
  StageAddresses<6> ld(ring, {swizzle(wm + a_row, a_chunk), swizzle(wm + a_row, 2 + a_chunk),
                              kTileBytes + b_trans_lane(wn, lane), kTileBytes + b_trans_lane(wn + 16, lane),
                              kTileBytes + b_trans_lane(wn + 32, lane), kTileBytes + b_trans_lane(wn + 48, lane)});
  for (int kt = 0; kt < k_tiles; ++kt) {
    hw::cp_async_wait<kStages - 2>();
    __syncthreads();
    issue(kt + kStages - 1);
#pragma unroll
    for (int ks = 0; ks < kTransK / 16; ++ks) {
      uint32_t fa[kMmaM][4], fb[kMmaN][2];
#pragma unroll
      for (int i = 0; i < kMmaM; ++i) hw::ldmatrix<4>(fa[i], ld.at[ks] + i * 16 * kRowBytes);
#pragma unroll
      for (int j = 0; j < kMmaN; j += 2) ldmatrix_b_trans(fb[j], fb[j + 1], ld.at[2 + j / 2] + ks * 16 * kTransRowBytes);
      mma_warp_tile<T>(acc, fa, fb);
    }
    ld.next();
  }
  hw::cp_async_wait<0>();

  // Epilogue: c partial = sum of Z * P over the tile (Z read in rows against P staged in
  // the idle ring, tile_dot_staged), then dZ = alpha P in z's layout, staged through the
  // ring as well (store_tile_staged).
  const float alpha = p.gate.scale(b) * g;
  const float c = need_c ? tile_dot_staged<T>(smem, acc, static_cast<const T*>(p.z) + b * p.z_sb + h * p.z_sh +
                                                             q0 * p.z_sq + n0,
                                              p.z_sq, rows, cols, wm, wn, lane)
                         : 0.f;
  store_tile_staged<T>(
      smem, [&](int i, int j, int e) { return alpha * acc[i][j][e]; },
      static_cast<T*>(p.grad_z) + b * p.gz_sb + h * p.gz_sh + q0 * p.gz_sq + n0, p.gz_sq, rows, cols, wm, wn, lane);
  if (need_c) {
    hw::BlockSum block_sum(red);
    const float c_cta = block_sum(c);
    if (threadIdx.x == 0) p.c_part[bh * p.q_tiles * p.dv_tiles + tile_q * p.dv_tiles + tile_n] = c_cta;
  }
}

// grad_weight_o: grid (H * d_tiles * dv_tiles), kThreads threads, kSmemBytes:
// blockIdx.x = (h * d_tiles + D tile) * dv_tiles + Dv tile; the CTA owns its [128 x 128]
// tile of dW_h and runs the whole K = (b, q) reduction in order (no split, no atomics:
// bitwise repeatable), 32 query rows per slice, skipping closed (b, h). A = dy_b^T
// (transposed slice of dy rows), B = Z[b, h] (transposed slice of z rows). alpha[b,h]
// enters as in the forward: acc is rescaled when alpha changes between batch rows.
template <typename T, int CopyBytes>
__global__ void __launch_bounds__(kThreads, 2) head_merge_bwd_dw_tc_kernel(TcBwdParams p) {
  unsigned char* smem = hw::dynamic_shared_memory();
  const hw::SmemAddr ring(smem);
  const int64_t tile = blockIdx.x;
  const int64_t tile_n = tile % p.dv_tiles;
  const int64_t tile_m = (tile / p.dv_tiles) % p.d_tiles;
  const int64_t h = tile / (p.dv_tiles * p.d_tiles);
  const int64_t m0 = tile_m * kBM, n0 = tile_n * kBN;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = (warp % kWarpsM) * kWarpM, wn = (warp / kWarpsM) * kWarpN;
  const int64_t rows_m = p.d - m0 < kBM ? p.d - m0 : kBM;
  const int64_t cols = p.dv - n0 < kBN ? p.dv - n0 : kBN;
  const int seq = static_cast<int>(p.seq);
  const int q_slices = (seq + kTransK - 1) / kTransK;
  const T* dy = static_cast<const T*>(p.grad_out) + m0;
  const T* z = static_cast<const T*>(p.z) + h * p.z_sh + n0;

  // The open batch rows of head h, counted by the CTA: one __syncthreads_count per kThreads
  // rows, where each thread counting all B rows made B gate loads a thread (emulated, B = 512,
  // Q = 1: the CTA's global load requests 8,019 -> 5,987).
  int open = 0;
  for (int64_t b0 = 0; b0 < p.batch; b0 += kThreads) {
    const int64_t b = b0 + threadIdx.x;
    open += __syncthreads_count(b < p.batch && p.gate.at(b, h) != 0.f);
  }
  const int k_tiles = open * q_slices;
  // Open batch rows in ascending |gate| order (as the forward's heads): the i-th is
  // open_row(i). The issue cursor keeps the offsets of its slice in dy and z and moves
  // them by 32 rows a slice.
  const int* row_order = p.row_order ? p.row_order + h * p.batch : nullptr;
  const auto open_row = [&](int i) -> int64_t { return row_order ? row_order[i] : i; };
  TransSliceCopy<T, CopyBytes> copy_a(dy, p.d, rows_m), copy_b(z, p.z_sq, cols);
  constexpr int64_t kSize = sizeof(T);
  const int64_t dy_step = kTransK * p.d * kSize, z_step = kTransK * p.z_sq * kSize;  // bytes per slice
  auto seek_row = [&](int64_t bb) {
    copy_a.seek(bb * p.seq * p.d * kSize);
    copy_b.seek(bb * p.z_sb * kSize);
  };
  int issue_row = 0, issue_slice = 0, issue_stage = 0;  // issue_row: the open row's index i
  if (open > 0) seek_row(open_row(0));
  auto issue = [&](int kt) {
    if (kt < k_tiles) {
      const int q_left = seq - issue_slice * kTransK;
      copy_a(a_slice(ring, issue_stage), q_left, dy);
      copy_b(b_slice(ring, issue_stage), q_left, z);
      if (++issue_slice == q_slices) {
        issue_slice = 0;
        if (++issue_row < open) seek_row(open_row(issue_row));
      } else {
        copy_a.advance(dy_step);
        copy_b.advance(z_step);
      }
      issue_stage = next_stage(issue_stage);
    }
    hw::cp_async_commit();
  };
  float acc[kMmaM][kMmaN][4];
  zero_accumulators(acc);
#pragma unroll
  for (int kt = 0; kt < kStages - 1; ++kt) issue(kt);
  // The lane's ldmatrix addresses (StageAddresses; both operands transposed): A per mma
  // tile i at ld.at[i], B per n tile pair j / 2 at ld.at[kMmaM + j / 2], step ks 16 k rows on.
  static_assert(kMmaM == 4 && kMmaN == 8, "four A tiles and four B tile pairs");
  StageAddresses<8> ld(ring, {a_trans_lane(wm, lane), a_trans_lane(wm + 16, lane), a_trans_lane(wm + 32, lane),
                              a_trans_lane(wm + 48, lane), kTileBytes + b_trans_lane(wn, lane),
                              kTileBytes + b_trans_lane(wn + 16, lane), kTileBytes + b_trans_lane(wn + 32, lane),
                              kTileBytes + b_trans_lane(wn + 48, lane)});
  int comp_row = -1, comp_slice = q_slices - 1;
  float alpha_cur = 1.f;
  for (int kt = 0; kt < k_tiles; ++kt) {
    if (++comp_slice == q_slices) {
      comp_slice = 0;
      const int64_t comp_b = open_row(++comp_row);
      switch_alpha(acc, alpha_cur, p.gate.scale(comp_b) * p.gate.at(comp_b, h), kt == 0);
    }
    hw::cp_async_wait<kStages - 2>();
    __syncthreads();
    issue(kt + kStages - 1);
#pragma unroll
    for (int ks = 0; ks < kTransK / 16; ++ks) {
      uint32_t fa[kMmaM][4], fb[kMmaN][2];
#pragma unroll
      for (int i = 0; i < kMmaM; ++i) hw::ldmatrix<4, true>(fa[i], ld.at[i] + ks * 16 * kTransRowBytes);
#pragma unroll
      for (int j = 0; j < kMmaN; j += 2) ldmatrix_b_trans(fb[j], fb[j + 1], ld.at[kMmaM + j / 2] + ks * 16 * kTransRowBytes);
      mma_warp_tile<T>(acc, fa, fb);
    }
    ld.next();
  }
  hw::cp_async_wait<0>();

  // Epilogue: dW_h = alpha_cur * acc, staged through the idle ring (store_tile_staged).
  const int64_t k_all = p.heads * p.dv;  // rows of H*Dv elements, head offsets h*Dv
  store_tile_staged<T>(
      smem, [&](int i, int j, int e) { return alpha_cur * acc[i][j][e]; },
      static_cast<T*>(p.grad_w) + m0 * k_all + h * p.dv + n0, k_all, rows_m, cols, wm, wn, lane);
}

}  // namespace tc
}  // namespace merge
}  // namespace headwise
