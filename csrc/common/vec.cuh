// Vector loads and stores of VEC consecutive elements, converted to/from fp32.
// A Pack is at most 16 bytes aligned (the widest single load on sm_90); wider packs
// (8 x fp32) compile to two 16-byte accesses. Callers guarantee the alignment.
#pragma once

#include "simt_portability.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

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

#if HW_SIM
// The emulator moves a pack as the GPU does: one access per 16 bytes (LDG/STG.128, .64,
// ...). A plain struct copy would be split by g++ into per-element accesses, which the
// profile library (simt/simt_metrics.h) would count as separate warp requests; a
// volatile access of a vector type of the chunk's size cannot be split or merged.
template <typename T, int VEC>
struct PackChunks {
  static constexpr int kBytes = static_cast<int>(sizeof(Pack<T, VEC>));
  static constexpr int kChunk = kBytes < 16 ? kBytes : 16;
  typedef unsigned char Chunk __attribute__((vector_size(kChunk), may_alias));
};

template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> load_pack(const T* src) {
  using C = PackChunks<T, VEC>;
  Pack<T, VEC> pack;
  for (int i = 0; i < C::kBytes / C::kChunk; ++i) {
    const typename C::Chunk chunk = reinterpret_cast<const volatile typename C::Chunk*>(src)[i];
    std::memcpy(reinterpret_cast<unsigned char*>(&pack) + i * C::kChunk, &chunk, C::kChunk);
  }
  return pack;
}

template <typename T, int VEC>
__device__ __forceinline__ void store_pack(T* dst, const Pack<T, VEC>& pack) {
  using C = PackChunks<T, VEC>;
  for (int i = 0; i < C::kBytes / C::kChunk; ++i) {
    typename C::Chunk chunk;
    std::memcpy(&chunk, reinterpret_cast<const unsigned char*>(&pack) + i * C::kChunk, C::kChunk);
    reinterpret_cast<volatile typename C::Chunk*>(dst)[i] = chunk;
  }
}
#else
template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> load_pack(const T* src) {
  return *reinterpret_cast<const Pack<T, VEC>*>(src);
}

template <typename T, int VEC>
__device__ __forceinline__ void store_pack(T* dst, const Pack<T, VEC>& pack) {
  *reinterpret_cast<Pack<T, VEC>*>(dst) = pack;
}
#endif

template <int VEC, typename T>
__device__ __forceinline__ void load_as_float(const T* __restrict__ src, float (&dst)[VEC]) {
  check_pack_alignment<T, VEC>(src);
  const Pack<T, VEC> pack = load_pack<T, VEC>(src);
#pragma unroll
  for (int k = 0; k < VEC; ++k) dst[k] = static_cast<float>(pack.v[k]);
}

template <int VEC, typename T>
__device__ __forceinline__ void store_from_float(T* __restrict__ dst, const float (&src)[VEC]) {
  check_pack_alignment<T, VEC>(dst);
  Pack<T, VEC> pack;
#pragma unroll
  for (int k = 0; k < VEC; ++k) pack.v[k] = static_cast<T>(src[k]);
  store_pack<T, VEC>(dst, pack);
}

}  // namespace hw
