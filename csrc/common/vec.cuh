// Vector loads and stores of VEC consecutive elements, converted to/from fp32.
// A Pack is at most 16 bytes aligned (the widest single load on sm_90); wider packs
// (8 x fp32) compile to two 16-byte accesses. Callers guarantee the alignment.
#pragma once

#include "simt_portability.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace hw {

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC < 16 ? sizeof(T) * VEC : 16) Pack {
  T v[VEC];
};

// Rounds an fp32 value to the storage dtype T and back (identity for float).
template <typename T>
__device__ __forceinline__ float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

// The emulator checks what the GPU assumes: a misaligned vector access faults on the GPU
// (cudaErrorMisalignedAddress) but would pass silently on the CPU.
template <typename T, int VEC>
__device__ __forceinline__ void check_pack_alignment(const void* p) {
#if HW_SIM
  if (reinterpret_cast<uintptr_t>(p) % alignof(Pack<T, VEC>) != 0) __trap();
#else
  (void)p;
#endif
}

template <int VEC, typename T>
__device__ __forceinline__ void load_as_float(const T* __restrict__ src, float (&dst)[VEC]) {
  check_pack_alignment<T, VEC>(src);
  const Pack<T, VEC> pack = *reinterpret_cast<const Pack<T, VEC>*>(src);
#pragma unroll
  for (int k = 0; k < VEC; ++k) dst[k] = static_cast<float>(pack.v[k]);
}

template <int VEC, typename T>
__device__ __forceinline__ void store_from_float(T* __restrict__ dst, const float (&src)[VEC]) {
  check_pack_alignment<T, VEC>(dst);
  Pack<T, VEC> pack;
#pragma unroll
  for (int k = 0; k < VEC; ++k) pack.v[k] = static_cast<T>(src[k]);
  *reinterpret_cast<Pack<T, VEC>*>(dst) = pack;
}

}  // namespace hw
