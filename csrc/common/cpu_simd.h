// Portable SIMD for the CPU kernels: GCC/Clang vector extensions of 64 bytes (16 floats
// or 8 doubles). Each multi-versioned kernel clone lowers them to its own registers
// (one zmm on AVX-512, two ymm on AVX2, four xmm on baseline x86-64), so one source
// serves every instruction set. Reductions run in a fixed order.
#pragma once

#include "cpu_convert.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#define HW_CPU_INLINE inline __attribute__((always_inline))

// A kernel entry compiled for AVX-512 (x86-64-v4), AVX2 (x86-64-v3) and baseline x86-64,
// the clone chosen at load time (GCC target_clones); the HW_CPU_INLINE helpers it calls
// are compiled into each clone. Not under Clang or the sanitizers: one plain version.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__)
#define HW_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define HW_CPU_CLONES
#endif

namespace headwise {
namespace cpu {

template <typename A>
struct Simd;
template <>
struct Simd<float> {
  using type = float __attribute__((vector_size(64)));
  using bits = uint32_t __attribute__((vector_size(64)));
  static constexpr int lanes = 16;
};
template <>
struct Simd<double> {
  using type = double __attribute__((vector_size(64)));
  static constexpr int lanes = 8;
};

template <typename A>
using vec_t = typename Simd<A>::type;

template <typename A>
HW_CPU_INLINE vec_t<A> vload(const A* p) {
  vec_t<A> v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <typename A>
HW_CPU_INLINE vec_t<A> vzero() {
  return vec_t<A>{} * A(0);
}

// Sum of the lanes by a fixed halving tree: lanes[k] += lanes[k + w] for k < w, w = L/2, ...,
// 1. Where the compiler has __builtin_shufflevector (GCC 12, Clang) the halves are added as
// vectors in registers: the same additions in the same order, without the round trip
// through the stack whose narrow reloads of a wide store stall store forwarding. (The
// code the compiler makes around the sums may still differ: with GCC 12 the DCMHA CPU
// kernel's weight gradients moved by the last bit in 0.1-0.5% of their elements.)
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define HW_CPU_HSUM_SHUFFLE 1
#endif
#endif
template <typename A>
HW_CPU_INLINE A hsum(vec_t<A> v) {
#ifdef HW_CPU_HSUM_SHUFFLE
  if constexpr (std::is_same_v<A, float>) {
    using v8 = float __attribute__((vector_size(32)));
    using v4 = float __attribute__((vector_size(16)));
    const v8 s8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    const v4 s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) + __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
  } else {
    using v4 = double __attribute__((vector_size(32)));
    const v4 s4 = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
  }
#else
  constexpr int L = Simd<A>::lanes;
  A lanes[L];
  std::memcpy(lanes, &v, sizeof(v));
  for (int w = L / 2; w > 0; w /= 2)
    for (int k = 0; k < w; ++k) lanes[k] += lanes[k + w];
  return lanes[0];
#endif
}

// Lane-wise round of fp32 values to bf16 precision (nearest even; NaN kept).
HW_CPU_INLINE vec_t<float> round_bf16(vec_t<float> x) {
  using bits = Simd<float>::bits;
  bits u;
  std::memcpy(&u, &x, sizeof(u));
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  vec_t<float> r;
  std::memcpy(&r, &u, sizeof(r));
  return x != x ? x : r;
}

// round_to<T> (cpu_convert.h) for a vector of fp32 lanes.
template <typename T>
HW_CPU_INLINE vec_t<float> round_to(vec_t<float> x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return round_bf16(x);
  } else {
    float lanes[Simd<float>::lanes];
    std::memcpy(lanes, &x, sizeof(x));
    for (float& v : lanes) v = round_to<T>(v);
    std::memcpy(&x, lanes, sizeof(x));
    return x;
  }
}

// Fixed-order sums over j < n of the M terms that term(ld, t) writes to t[0..M), where
// ld(p) loads p[j] (a scalar) or p[j, j + lanes) (a vector): vector lanes over blocks of
// 128 elements, lanes reduced by a halving tree, blocks combined pairwise. The order
// depends on n alone, and the rounding error grows with log(n), not n.
template <int M, typename A, typename Term>
HW_CPU_INLINE void sums(int64_t n, const Term& term, A (&out)[M]) {
  constexpr int L = Simd<A>::lanes;
  constexpr int64_t kBlock = 128;
  constexpr int kMaxBlocks = 64;
  A blocks[kMaxBlocks][M];
  int count = 0;
  for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
    const int64_t j1 = j0 + kBlock < n ? j0 + kBlock : n;
    vec_t<A> part[M];
    A tail[M];
    for (int m = 0; m < M; ++m) {
      part[m] = vzero<A>();
      tail[m] = A(0);
    }
    int64_t j = j0;
    for (; j + L <= j1; j += L) {
      vec_t<A> t[M];
      term([j](const A* p) { return vload(p + j); }, t);
      for (int m = 0; m < M; ++m) part[m] += t[m];
    }
    for (; j < j1; ++j) {
      A t[M];
      term([j](const A* p) { return p[j]; }, t);
      for (int m = 0; m < M; ++m) tail[m] += t[m];
    }
    if (count == kMaxBlocks) {  // rows wider than 8192: fold pairs to keep the buffer bounded
      for (int k = 0; k < kMaxBlocks / 2; ++k)
        for (int m = 0; m < M; ++m) blocks[k][m] = blocks[2 * k][m] + blocks[2 * k + 1][m];
      count = kMaxBlocks / 2;
    }
    for (int m = 0; m < M; ++m) blocks[count][m] = hsum<A>(part[m]) + tail[m];
    ++count;
  }
  while (count > 1) {
    const int half = count / 2;
    for (int k = 0; k < half; ++k)
      for (int m = 0; m < M; ++m) blocks[k][m] = blocks[2 * k][m] + blocks[2 * k + 1][m];
    if (count % 2)
      for (int m = 0; m < M; ++m) blocks[half][m] = blocks[count - 1][m];
    count = half + count % 2;
  }
  for (int m = 0; m < M; ++m) out[m] = count ? blocks[0][m] : A(0);
}

}  // namespace cpu
}  // namespace headwise
