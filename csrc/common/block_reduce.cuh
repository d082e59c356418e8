// Warp and block sums for kernels whose block size is a multiple of 32.
// All sums run in a fixed order, so results are bitwise reproducible run to run.
#pragma once

#include "simt_portability.h"

namespace hw {

constexpr unsigned kFullWarp = 0xffffffffu;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullWarp, v, offset);
  return v;
}

// Levels of warp_sum_scatter<M> that halve the values a lane holds: M's factors of 2,
// at most 5 (one a shuffle offset).
constexpr int warp_scatter_levels(int m, int levels = 0) {
  return levels < 5 && m % 2 == 0 ? warp_scatter_levels(m / 2, levels + 1) : levels;
}

// The M warp sums of v[0, M) spread over the lanes (a reduce-scatter). Offsets 16, 8, ...,
// 1 in warp_sum's order, each sum formed by warp_sum's tree (the same bits, as fp32 adds
// commute): while a lane holds an even count of values, a level halves it (the lane with
// the offset's bit set keeps, and adds its partner's, the upper half; the other the
// lower); the remaining levels add every held value (butterfly). On return v[0, M >> L)
// (L = warp_scatter_levels(M)) holds sums [warp_scatter_first<M>(lane), + (M >> L)),
// the same in every lane of an aligned group of 32 >> L. Shuffles: M / 2 + M / 4 + ... +
// (5 - L) (M >> L) (M = 12: 18), against 5 M for M warp_sums (60), plus M selects a
// halving level.
template <int OFFSET, int HELD, int M>
__device__ __forceinline__ void warp_sum_scatter_from(float (&v)[M], int lane) {
  if constexpr (OFFSET > 0) {
    if constexpr (HELD % 2 == 0) {
      constexpr int kHalf = HELD / 2;
      const bool upper = (lane & OFFSET) != 0;
#pragma unroll
      for (int k = 0; k < kHalf; ++k) {
        const float send = upper ? v[k] : v[k + kHalf];
        const float keep = upper ? v[k + kHalf] : v[k];
        v[k] = keep + __shfl_xor_sync(kFullWarp, send, OFFSET);
      }
      warp_sum_scatter_from<OFFSET / 2, kHalf>(v, lane);
    } else {
#pragma unroll
      for (int k = 0; k < HELD; ++k) v[k] += __shfl_xor_sync(kFullWarp, v[k], OFFSET);
      warp_sum_scatter_from<OFFSET / 2, HELD>(v, lane);
    }
  }
}

template <int M>
__device__ __forceinline__ void warp_sum_scatter(float (&v)[M]) {
  warp_sum_scatter_from<16, M>(v, static_cast<int>(threadIdx.x & 31));
}

// The first of the sums a lane holds after warp_sum_scatter<M>.
template <int M>
__device__ __forceinline__ int warp_scatter_first(int lane) {
  int first = 0;
#pragma unroll
  for (int k = 0; k < warp_scatter_levels(M); ++k)
    if (lane & (16 >> k)) first += M >> (k + 1);
  return first;
}

// Whether the lane is the first of its group after warp_sum_scatter<M> (one lane per
// distinct set of sums: the one to store them).
template <int M>
__device__ __forceinline__ bool warp_scatter_leader(int lane) {
  return (lane & ((32 >> warp_scatter_levels(M)) - 1)) == 0;
}

// After warp_sum_scatter<M>(held): calls store(s, sum) for each sum s in [0, M) that this
// lane holds, if it is its group's leader (so each sum is stored by one lane of the warp).
template <int M, class Store>
__device__ __forceinline__ void store_scattered_sums(const float (&held)[M], Store&& store) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  if (warp_scatter_leader<M>(lane)) {
    const int first = warp_scatter_first<M>(lane);
#pragma unroll
    for (int k = 0; k < (M >> warp_scatter_levels(M)); ++k) store(first + k, held[k]);
  }
}

// Sum over aligned groups of `width` lanes (width a power of two <= 32); every lane of
// a group receives its group's sum. All 32 lanes must call it.
__device__ __forceinline__ float warp_segment_sum(float v, int width) {
  for (int offset = width >> 1; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullWarp, v, offset);
  return v;
}

// Block-wide sums with one __syncthreads per call. `scratch` holds 2 * 32 floats and
// is used as a double buffer: call k writes half k % 2, and a thread can only reach
// call k + 2's write after every thread has passed call k + 1's barrier, i.e. after
// every thread has read call k's half. Every thread of the block must make each call.
class BlockSum {
 public:
  __device__ explicit BlockSum(float* scratch) : scratch_(scratch) {}

  __device__ float operator()(float v) {
    float* buf = scratch_ + (calls_++ & 1) * 32;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) buf[warp] = v;
    __syncthreads();
    float total = 0.f;
    const int nwarps = blockDim.x >> 5;
    for (int w = 0; w < nwarps; ++w) total += buf[w];
    return total;
  }

 private:
  float* scratch_;
  unsigned calls_ = 0;
};

}  // namespace hw
