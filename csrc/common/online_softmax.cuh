// The exponentials of the MHAR forward's online softmax over depth (Milakov & Gimelshein),
// whose kernels keep the running max m and sum of exp(l_i - m) themselves.
#pragma once

#include "simt_portability.h"

#include <cmath>
#include <type_traits>

namespace hw {

// e^x as __expf forms it (2^(x log2 e) by the SFU) without its handling of results below
// 2^-126, which are flushed to 0: an FMUL and a MUFU.EX2 (PTX ex2.approx.ftz.f32) where
// __expf adds a compare and two predicated FMULs and expf's range reduction takes ~9.
// Error as __expf's (2 + floor(1.173 |x|) ulp, CUDA programming guide) for results of
// at least 2^-126. A softmax's weights below 2^-126 of its max are 0 in fp32 sums of
// terms near 1 anyway. The emulated build uses expf.
__device__ __forceinline__ float exp_ftz(float x) {
#if HW_SIM
  return expf(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
  return y;
#endif
}

// The softmax exponential of a kernel whose inputs are `Source`: expf (at most 2 ulp without
// fast math, the function torch's CUDA exp calls) for fp32 inputs, whose results are
// compared with fp32 math; exp_ftz for 16-bit inputs, whose fp32 sums it perturbs far below
// the 2^-8 / 2^-11 steps of their storage.
template <typename Source>
__device__ __forceinline__ float softmax_exp(float x) {
  if constexpr (std::is_same<Source, float>::value) {
    return expf(x);
  } else {
    return exp_ftz(x);
  }
}

}  // namespace hw
