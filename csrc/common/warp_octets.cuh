// fp32 octets (8 consecutive floats, 32 bytes) owned one per lane, moved between global
// memory and a warp's registers with coalesced 16-byte accesses.
//
// Lane l owns floats [8l, 8l + 8) of a warp's 256-float span, as the vector layout of
// the MHAR kernels holds its fp32 vectors (VEC = 8 elements a vector): float4s 2l (its
// half 0) and 2l + 1 (its half 1). Moved directly, each lane issues two 16-byte accesses
// at a 32-byte lane stride: each of the two warp requests spans 1024 bytes (32 sectors)
// and uses half of every sector.
// Here access h (0, 1) of lane l moves
//   float4 2l                of its own octet,         where h == l / 16 ("own"),
//   float4 2(l ^ 16) + 1     of lane l ^ 16's octet,   otherwise,
// so access 0 covers float4s 0..31 (the even ones by lanes 0-15, the odd ones by lanes
// 16-31) and access 1 float4s 32..63: 512 contiguous bytes a request, 16 sectors, all
// used. Lanes l and l ^ 16 then swap their halves 1 by one shuffle a word: 4 SHFL and 8
// selects an octet.
//
// Lanes l >= `lanes` own no octet (lanes may be <= 0 or >= 32): their values load as
// zeros, and none of their floats is stored. Every lane of the warp must call (full-mask
// shuffles); span is 16-byte aligned.
#pragma once

#include "block_reduce.cuh"
#include "vec.cuh"

namespace hw {

// Access h of this lane: whether it moves lane l ^ 16's half 1 (swapped = 1) or its own
// half 0, the lane owning that half, and its float offset in the span. Arithmetic, with
// no branch on the lane: one code path (and one store site) for every lane.
struct OctetAccess {
  int swapped, owner, offset;
  __device__ __forceinline__ OctetAccess(int h, int lane)
      : swapped(h ^ (lane >> 4)), owner(lane ^ (swapped << 4)), offset(8 * owner + 4 * swapped) {}
};

__device__ __forceinline__ void warp_load_octets(const float* span, int lanes, float (&out)[8]) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  float got[2][4];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const OctetAccess a(h, lane);
    if (a.owner < lanes) {
      load_as_float<4>(span + a.offset, got[h]);
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) got[h][k] = 0.f;
    }
  }
  const bool upper = lane >= 16;  // its own half 0 came by access 1, lane l ^ 16's half 1 by access 0
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    out[k] = upper ? got[1][k] : got[0][k];
    out[4 + k] = __shfl_xor_sync(kFullWarp, upper ? got[0][k] : got[1][k], 16);
  }
}

// The lane index (threadIdx.x % 32 in the 1-D blocks here), read where it is used: under
// nvcc an asm volatile read of %laneid, which the compiler does not merge with an earlier
// one. A store at a kernel's end (the MHAR backward's z partial) then forms its addresses
// there: with threadIdx.x, nvcc 13.0 reused the offsets of the kernel's first octet load
// and held them across the kernel (an 8-byte spill on sm_80, at the 128-register cap).
__device__ __forceinline__ int lane_at_use() {
#if !HW_SIM && defined(__CUDA_ARCH__)
  int lane;
  asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
  return lane;
#else
  return static_cast<int>(threadIdx.x & 31);
#endif
}

__device__ __forceinline__ void warp_store_octets(float* span, int lanes, const float (&in)[8]) {
  const int lane = lane_at_use();
  float other[4];  // lane l ^ 16's half 1
#pragma unroll
  for (int k = 0; k < 4; ++k) other[k] = __shfl_xor_sync(kFullWarp, in[4 + k], 16);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const OctetAccess a(h, lane);
    // A bitwise select (all ones: the lane's own half 0): with a conditional, g++ split
    // the store by lane half, which the emulator, grouping a request by call site as the
    // GPU by instruction, counted as two half-warp requests of 8 sectors' data each.
    const uint32_t own = static_cast<uint32_t>(a.swapped) - 1u;
    Pack<float, 4> v;
#pragma unroll
    for (int k = 0; k < 4; ++k)
      v.v[k] = __uint_as_float((__float_as_uint(in[k]) & own) | (__float_as_uint(other[k]) & ~own));
    if (a.owner < lanes) {
      check_pack_alignment<float, 4>(span + a.offset);
      store_pack<float, 4>(span + a.offset, v);
    }
  }
}

}  // namespace hw
