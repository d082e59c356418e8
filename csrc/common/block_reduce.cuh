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
