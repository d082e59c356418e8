// Storage-dtype conversions for CPU kernels, written without branches so that loops
// over them vectorize. Results equal c10's conversions (round to nearest even; NaN
// stays NaN).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <bit>
#include <cstdint>

namespace headwise {
namespace cpu {

// The bits of bf16(f) in the high half of a float, rounded to nearest even.
inline uint32_t bf16_rounded_bits(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  return (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
}

// T(v) for a storage dtype T from an accumulator value v (float or double).
template <typename T, typename A>
inline T to_storage(A v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const float f = static_cast<float>(v);
    const uint16_t bits = f != f ? uint16_t{0x7fc0} : static_cast<uint16_t>(bf16_rounded_bits(f) >> 16);
    return c10::BFloat16(bits, c10::BFloat16::from_bits());
  } else {
    return static_cast<T>(v);
  }
}

// A(T(v)): v rounded to the storage dtype and widened back.
template <typename T, typename A>
inline A round_to(A v) {
  if constexpr (std::is_same_v<T, A>) {
    return v;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const float f = static_cast<float>(v);
    return f != f ? v : static_cast<A>(std::bit_cast<float>(bf16_rounded_bits(f)));
  } else {
    return static_cast<A>(static_cast<T>(v));
  }
}

}  // namespace cpu
}  // namespace headwise
