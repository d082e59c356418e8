// fp32 octets (8 consecutive floats, 32 bytes) owned one per lane, loaded from global
// memory into a warp's registers with coalesced 16-byte accesses.
//
// Lane l owns floats [8l, 8l + 8) of a warp's 256-float span, as the vector layout of
// the MHAR forward holds its fp32 parameters (VEC = 8 elements a vector).
// Moved directly, each lane issues two 16-byte accesses at a 32-byte lane stride: each of
// the two warp requests spans 1024 bytes (32 sectors) and uses half of every sector.
// Here access h (0, 1) of lane l moves float4 number 32h + l of the span: 512 contiguous
// bytes, 16 sectors, all used. Lane l's octet is float4s 2l and 2l + 1, i.e. access
// (2l + s) / 32 = l / 16 of lane (2l + s) % 32 for half s, so two shuffles a word
// (one per access) and a select by l / 16 hand each lane its values (16 SHFL per octet).
//
// Lanes l >= `lanes` own no octet (lanes may be <= 0 or >= 32): their values load as
// zeros. Every lane of the warp must call (full-mask shuffles); span is 16-byte aligned.
#pragma once

#include "block_reduce.cuh"
#include "vec.cuh"

namespace hw {

__device__ __forceinline__ void warp_load_octets(const float* span, int lanes, float (&out)[8]) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  float got[2][4];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int j = 32 * h + lane;
    if ((j >> 1) < lanes) {
      load_as_float<4>(span + 4 * j, got[h]);
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) got[h][k] = 0.f;
    }
  }
  const bool upper = lane >= 16;
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const int src = (2 * lane + s) & 31;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float lo = __shfl_sync(kFullWarp, got[0][k], src);
      const float hi = __shfl_sync(kFullWarp, got[1][k], src);
      out[4 * s + k] = upper ? hi : lo;
    }
  }
}

}  // namespace hw
