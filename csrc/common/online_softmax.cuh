// The running-max softmax update of online-softmax attention (Milakov & Gimelshein;
// Dao et al.): after folding logits l_1..l_n, m = max l_i and den = sum exp(l_i - m).
// A consumer keeping acc = sum exp(l_i - m) * v_i updates it as acc * alpha + p * v.
#pragma once

#include "simt_portability.h"

#include <cmath>

namespace hw {

struct OnlineSoftmax {
  float max = -INFINITY;
  float den = 0.f;

  __device__ __forceinline__ void fold(float logit, float& alpha, float& p) {
    const float new_max = fmaxf(max, logit);
    alpha = expf(max - new_max);  // exp(-inf) = 0 on the first fold
    p = expf(logit - new_max);
    den = den * alpha + p;
    max = new_max;
  }
};

}  // namespace hw
