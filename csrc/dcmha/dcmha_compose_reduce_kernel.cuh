// Definition of dcmha_compose_reduce_partials, declared and described in dcmha_kernel.cuh
// (the compose backward's second kernel). Included by the compose_backward entry's
// translation unit only (dcmha_compose_backward_launch.h): it takes no template argument, so
// every translation unit that defined it would define the same symbol.
#pragma once

#include "dcmha_kernel.cuh"

namespace headwise {
namespace dcmha {

__global__ void __launch_bounds__(kReduceThreads) dcmha_compose_reduce_partials(const ComposeParams p,
                                                                                const float* partials, int parts,
                                                                                int c) {
  const int H = p.H, len = kGradFields * H;
  const int64_t rows = static_cast<int64_t>(p.B) * p.T;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * len) return;
  const int64_t bt = i / len;
  const int j = static_cast<int>(i - bt * len);
  // Ascending k; 8 independent loads in flight per thread.
  constexpr int kBatch = 8;
  float sum = 0.f;
  for (int k0 = 0; k0 < parts; k0 += kBatch) {
    float v[kBatch];
    HW_UNROLL
    for (int j = 0; j < kBatch; ++j) v[j] = k0 + j < parts ? partials[(k0 + j) * rows * len + i] : 0.f;
    HW_UNROLL
    for (int j = 0; j < kBatch; ++j)
      if (k0 + j < parts) sum += v[j];
  }
  const int64_t wo = (bt * 4 + c) * kR * H, go = (bt * 4 + c) * H;
  if (j < H) p.dg[go + j] = sum;
  else if (j < 3 * H) p.dw1[wo + j - H] = sum;
  else p.dw2[wo + j - 3 * H] = sum;
}

}  // namespace dcmha
}  // namespace headwise
