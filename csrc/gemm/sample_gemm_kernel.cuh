// Sample tensor-core GEMM: C[M, N] = A[M, K] B[N, K]^T (both operands K-contiguous, as
// in y = x W^T), bf16 or f16 inputs (T = c10::BFloat16 / c10::Half), fp32 accumulation, C in the input dtype. It is the
// pattern headwise's tensor-core kernels follow: mma.sync m16n8k16 fed by ldmatrix from a
// swizzled shared-memory ring filled by a 3-stage cp.async pipeline
// (csrc/common/mma_primitives.cuh; the same source runs on the SIMT emulator).
//
// Design
//   CTA tile kBM x kBN x kBK = 128 x 128 x 32, 8 warps as 2 (M) x 4 (N), warp tile 64 x 32:
//   per 16-deep k step a warp issues 4 ldmatrix.x4 for A (4 m16 tiles), 2 ldmatrix.x4 for B
//   (4 n8 tiles) and 4 x 4 = 16 mma.sync; 64 fp32 accumulators per thread.
//   Shared memory: kStages ring slots of A [128 x 32] and B [128 x 32] bf16, rows of 64
//   bytes = four 16-byte chunks, chunk c of row r stored at chunk c ^ ((r >> 1) & 3)
//   (swizzle()): the 8 rows one ldmatrix phase reads (same logical chunk, rows r..r+7)
//   land in 8 different 4-bank groups, and a warp's 32 cp.async chunks (8 rows x 4 chunks)
//   too, so both are conflict-free without padding. 3 x 16 KiB = 48 KiB (no opt-in).
//   Pipeline: tiles 0..kStages-2 are in flight before the loop; iteration kt waits for
//   tile kt (cp.async.wait_group kStages-2), __syncthreads (the tile is visible to every
//   warp, and every warp is done with the slot of tile kt-1), issues tile kt+kStages-1 into
//   that slot, then runs the mma's of tile kt. One commit per iteration, empty groups
//   included, keeps the group count equal to the tile count.
//   Edges: rows of A / B past M / N and k chunks past K are cp.async zero-fills (src-size
//   0, the source clamped to the operand's first row); C stores are bounds-checked per
//   element. The 16-byte copies need K % 8 == 0 and 16-byte aligned operands; the launcher
//   pads K with zeros otherwise (sample_gemm_launch.h).
//
// Budget (the H200 figures are estimates, not measurements: ~990 TFLOP/s dense bf16
// tensor peak, of which mma.sync reaches roughly two thirds; 4.8 TB/s HBM)
//   FLOPs 2 M N K. Per CTA k-tile: 2 * 128 * 128 * 32 = 1.05 MFLOP for 16 KiB of global
//   loads -> 64 FLOP/byte of L2 traffic per CTA (A is re-read by the N/128 CTAs of a row,
//   B by the M/128 CTAs of a column; unique HBM bytes 2 (M K + N K) + 2 M N).
//   Shared memory per warp and 16-deep k step: 3 KiB read by ldmatrix for 16 mma
//   (65 kFLOP) -> 21 FLOP per shared byte; at 128 B/clk/SM that allows ~2.7 kFLOP/clk/SM,
//   above the ~2 kFLOP/clk/SM of dense bf16 mma.sync, so the mma pipe, not shared memory,
//   bounds the steady state at large shapes.
#pragma once

#include "../common/mma_primitives.cuh"
#include "../common/simt_portability.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

namespace headwise {
namespace gemm {

constexpr int kBM = 128, kBN = 128, kBK = 32;
constexpr int kStages = 3;
constexpr int kWarpsM = 2, kWarpsN = 4;
constexpr int kThreads = 32 * kWarpsM * kWarpsN;
constexpr int kWarpM = kBM / kWarpsM, kWarpN = kBN / kWarpsN;  // 64 x 32
constexpr int kMmaM = kWarpM / 16, kMmaN = kWarpN / 8;           // 4 x 4 mma tiles per warp
constexpr int kChunksPerRow = kBK / 8;                           // 16-byte chunks of 8 elements
constexpr int kTileElems = kBM * kBK;                            // one operand tile (kBM == kBN)
constexpr size_t kSmemBytes = static_cast<size_t>(kStages) * 2 * kTileElems * 2;
static_assert(kBM == kBN, "A and B tiles share one shape");
static_assert(kChunksPerRow == 4, "swizzle() is written for 64-byte rows");
static_assert((kBM * kChunksPerRow) % kThreads == 0, "every thread copies the same number of chunks");

// Element offset of (row, 8-element chunk) in a swizzled [kBM x kBK] tile.
__device__ __forceinline__ int swizzle(int row, int chunk) {
  return row * kBK + ((chunk ^ ((row >> 1) & 3)) * 8);
}

template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  if constexpr (std::is_same<T, c10::BFloat16>::value)
    hw::mma_m16n8k16_bf16(d, a, b, d);
  else
    hw::mma_m16n8k16_f16(d, a, b, d);
}

// Issues the copies of one operand tile: rows row0.. of a [rows x K] K-contiguous operand.
template <typename T>
__device__ __forceinline__ void load_tile(T* tile, const T* __restrict__ src, int rows, int K, int row0, int k0) {
#pragma unroll
  for (int i = 0; i < kBM * kChunksPerRow / kThreads; ++i) {
    const int id = threadIdx.x + i * kThreads;
    const int r = id / kChunksPerRow, c = id % kChunksPerRow;
    const int row = row0 + r, k = k0 + c * 8;
    const bool inside = row < rows && k < K;
    const T* g = inside ? src + static_cast<int64_t>(row) * K + k : src;
    hw::cp_async_cg16(tile + swizzle(r, c), g, inside ? 16 : 0);
  }
}

// K % 8 == 0, a and b 16-byte aligned (checked by the launcher).
template <typename T>
__global__ void __launch_bounds__(kThreads) sample_gemm_kernel(const T* __restrict__ a, const T* __restrict__ b,
                                                               T* __restrict__ c, int M, int N, int K) {
  T* smem = reinterpret_cast<T*>(hw::dynamic_shared_memory());
  auto a_tile = [&](int stage) { return smem + stage * 2 * kTileElems; };
  auto b_tile = [&](int stage) { return smem + stage * 2 * kTileElems + kTileElems; };
  const int m0 = blockIdx.y * kBM, n0 = blockIdx.x * kBN;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm = (warp % kWarpsM) * kWarpM, wn = (warp / kWarpsM) * kWarpN;
  const int k_tiles = (K + kBK - 1) / kBK;

  float acc[kMmaM][kMmaN][4];
#pragma unroll
  for (int i = 0; i < kMmaM; ++i)
#pragma unroll
    for (int j = 0; j < kMmaN; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

  auto issue = [&](int kt) {
    if (kt < k_tiles) {
      const int s = kt % kStages;
      load_tile(a_tile(s), a, M, K, m0, kt * kBK);
      load_tile(b_tile(s), b, N, K, n0, kt * kBK);
    }
    hw::cp_async_commit();
  };
#pragma unroll
  for (int kt = 0; kt < kStages - 1; ++kt) issue(kt);

  // ldmatrix.x4 row addresses of this lane. A (m16 x k16 per mma): matrix i = lane / 8
  // covers rows (i & 1) * 8.. and k chunk i >> 1, giving registers a0..a3 in mma order.
  // B ([n][k] rows, two n8 tiles x k16): matrix i covers n rows (i >> 1) * 8.. and k chunk
  // i & 1, giving b0, b1 of n tile 2j and b0, b1 of n tile 2j + 1.
  const int quad = lane / 8, row_in_quad = lane % 8;
  const int a_row = (quad & 1) * 8 + row_in_quad, a_chunk = quad >> 1;
  const int b_row = (quad >> 1) * 8 + row_in_quad, b_chunk = quad & 1;

  for (int kt = 0; kt < k_tiles; ++kt) {
    hw::cp_async_wait<kStages - 2>();
    __syncthreads();
    issue(kt + kStages - 1);
    const T* at = a_tile(kt % kStages);
    const T* bt = b_tile(kt % kStages);
#pragma unroll
    for (int ks = 0; ks < kBK / 16; ++ks) {
      uint32_t fa[kMmaM][4], fb[kMmaN][2];
#pragma unroll
      for (int i = 0; i < kMmaM; ++i) hw::ldmatrix<4>(fa[i], at + swizzle(wm + i * 16 + a_row, ks * 2 + a_chunk));
#pragma unroll
      for (int j = 0; j < kMmaN; j += 2) {
        uint32_t r[4];
        hw::ldmatrix<4>(r, bt + swizzle(wn + j * 8 + b_row, ks * 2 + b_chunk));
        fb[j][0] = r[0];
        fb[j][1] = r[1];
        fb[j + 1][0] = r[2];
        fb[j + 1][1] = r[3];
      }
#pragma unroll
      for (int i = 0; i < kMmaM; ++i)
#pragma unroll
        for (int j = 0; j < kMmaN; ++j) mma_16816<T>(acc[i][j], fa[i], fb[j]);
    }
  }
  hw::cp_async_wait<0>();  // only empty groups remain; leave no copy in flight at exit

  // Accumulator e of mma tile (i, j): row g + 8 (e >> 1), col 2t + (e & 1) of the tile.
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < kMmaM; ++i)
#pragma unroll
    for (int j = 0; j < kMmaN; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = m0 + wm + i * 16 + g + 8 * (e >> 1);
        const int col = n0 + wn + j * 8 + 2 * t + (e & 1);
        if (row < M && col < N) c[static_cast<int64_t>(row) * N + col] = static_cast<T>(acc[i][j][e]);
      }
}

}  // namespace gemm
}  // namespace headwise
