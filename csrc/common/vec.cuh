// Vector loads and stores of VEC consecutive elements, converted to/from fp32.
// A Pack is at most 16 bytes aligned (the widest single load on sm_90); wider packs
// (8 x fp32) compile to two 16-byte accesses. Callers guarantee the alignment.
#pragma once

#include "simt_portability.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

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

// (a, b) rounded to the 16-bit T (round-to-nearest-even, as static_cast) and packed in one
// 32-bit word, a in the low half: the register of an mma.sync fragment. For bf16 on the GPU
// one cvt rounds both (cvt.rn.bf16x2.f32, sm_80+).
template <typename T>
__device__ __forceinline__ uint32_t pack_pair(float a, float b) {
  static_assert(sizeof(T) == 2, "two 16-bit values a word");
#if !HW_SIM && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800  // cvt.rn.bf16x2.f32: sm_80+
  if constexpr (std::is_same<T, c10::BFloat16>::value) {
    uint32_t p;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(p) : "f"(b), "f"(a));
    return p;
  }
#endif
  const T lo = static_cast<T>(a), hi = static_cast<T>(b);
  return static_cast<uint32_t>(lo.x) | (static_cast<uint32_t>(hi.x) << 16);
}

// (a, b) rounded to T and back, round-to-nearest-even as round_to<T> (static_cast) does.
// For bf16 on the GPU one cvt rounds both (pack_pair), and each comes back to fp32 as the
// high half of a word (one shift or mask, no cvt); fp16 and fp32 round one at a time (a
// paired fp16 cvt would still need a cvt back for each).
template <typename T>
__device__ __forceinline__ void round_pair_to(float& a, float& b) {
#if !HW_SIM && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800  // cvt.rn.bf16x2.f32: sm_80+
  if constexpr (std::is_same<T, c10::BFloat16>::value) {
    const uint32_t p = pack_pair<T>(a, b);
    a = __uint_as_float(p << 16);
    b = __uint_as_float(p & 0xffff0000u);
    return;
  }
#endif
  a = round_to<T>(a);
  b = round_to<T>(b);
}

// round_to<T> of each of VEC values, in pairs.
template <typename T, int VEC>
__device__ __forceinline__ void round_vec_to(float (&y)[VEC]) {
#pragma unroll
  for (int k = 0; k + 1 < VEC; k += 2) round_pair_to<T>(y[k], y[k + 1]);
  if (VEC % 2 == 1) y[VEC - 1] = round_to<T>(y[VEC - 1]);
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

// The fp32 values of a pack, taken from its 32-bit words. A bf16 is the high half of an
// fp32 word, so the two of a word convert with one shift and one mask (c10's conversion
// spends a byte permute and a shift on each); on the GPU each fp16 half of a word
// converts in place (cvt.f32.f16); fp32 and odd VEC per element.
template <typename T, int VEC>
__device__ __forceinline__ void unpack_to_float(const Pack<T, VEC>& pack, float (&out)[VEC]) {
  if constexpr (std::is_same<T, c10::BFloat16>::value && VEC % 2 == 0) {
    uint32_t w[VEC / 2];
    std::memcpy(w, &pack, sizeof(w));
#pragma unroll
    for (int m = 0; m < VEC / 2; ++m) {
      const uint32_t lo = w[m] << 16, hi = w[m] & 0xffff0000u;
      std::memcpy(&out[2 * m], &lo, 4);
      std::memcpy(&out[2 * m + 1], &hi, 4);
    }
  }
#if !HW_SIM && defined(__CUDA_ARCH__)
  else if constexpr (std::is_same<T, c10::Half>::value && VEC % 2 == 0) {
    uint32_t w[VEC / 2];
    std::memcpy(w, &pack, sizeof(w));
#pragma unroll
    for (int m = 0; m < VEC / 2; ++m)
      asm("{\n\t.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %2;\n\tcvt.f32.f16 %0, lo;\n\tcvt.f32.f16 %1, hi;\n\t}"
          : "=f"(out[2 * m]), "=f"(out[2 * m + 1])
          : "r"(w[m]));
  }
#endif
  else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) out[k] = static_cast<float>(pack.v[k]);
  }
}

// The pack at src when `pred`, else zeros. A pack of 16-bit elements moves as 32-bit
// words: loaded and zero-filled element by element, the compiler reassembles each
// register from halves (a byte permute per element) where a select of words needs none.
template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> load_pack_if(const T* src, bool pred) {
  Pack<T, VEC> out;
  if constexpr (sizeof(Pack<T, VEC>) % 4 == 0) {
    constexpr int kWords = static_cast<int>(sizeof(Pack<T, VEC>) / 4);
    static_assert(alignof(Pack<uint32_t, kWords>) == alignof(Pack<T, VEC>), "word pack alignment");
    Pack<uint32_t, kWords> w;
    if (pred) {
      check_pack_alignment<T, VEC>(src);
      w = load_pack<uint32_t, kWords>(reinterpret_cast<const uint32_t*>(src));
    } else {
#pragma unroll
      for (int m = 0; m < kWords; ++m) w.v[m] = 0u;
    }
    std::memcpy(&out, &w, sizeof(out));
  } else if (pred) {
    check_pack_alignment<T, VEC>(src);
    out = load_pack<T, VEC>(src);
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) out.v[k] = static_cast<T>(0.f);
  }
  return out;
}

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
