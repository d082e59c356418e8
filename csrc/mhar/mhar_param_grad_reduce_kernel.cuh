// Definition of mhar_param_grad_reduce_kernel, declared and described in mhar_kernel.cuh
// (the backward's second stage). Included by the route_backward entry's translation unit
// only (mhar_route_backward_launch.h): it takes no template argument, so every translation
// unit that defined it would define the same symbol.
#pragma once

#include "mhar_kernel.cuh"

namespace headwise {
namespace mhar {

__global__ void __launch_bounds__(kReduceColumns * kReduceLanes) mhar_param_grad_reduce_kernel(
    const float* __restrict__ z_partial, const float* __restrict__ gate_partial, int64_t rows, int64_t d,
    const float* __restrict__ query, const float* __restrict__ norm_weight, float* __restrict__ grad_query,
    float* __restrict__ grad_norm, float* __restrict__ grad_gate) {
  __shared__ float lane_sums[kReduceLanes][kReduceColumns];
  const int col = threadIdx.x % kReduceColumns;
  const int lane = threadIdx.x / kReduceColumns;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kReduceColumns + col;
  // kReduceUnroll independent running sums (rows lane + 8 (16 m + u) go to sum u), so
  // that a thread has 16 loads in flight; added in u order.
  float acc[kReduceUnroll];
  HW_UNROLL
  for (int u = 0; u < kReduceUnroll; ++u) acc[u] = 0.f;
  if (j < d) {
    int64_t r = lane;
    for (; r + (kReduceUnroll - 1) * kReduceLanes < rows; r += kReduceUnroll * kReduceLanes) {
      HW_UNROLL
      for (int u = 0; u < kReduceUnroll; ++u) acc[u] += z_partial[(r + u * kReduceLanes) * d + j];
    }
    HW_UNROLL
    for (int u = 0; u < kReduceUnroll - 1; ++u)
      if (r + u * kReduceLanes < rows) acc[u] += z_partial[(r + u * kReduceLanes) * d + j];
  }
  float s = 0.f;
  HW_UNROLL
  for (int u = 0; u < kReduceUnroll; ++u) s += acc[u];
  lane_sums[lane][col] = s;
  __syncthreads();
  if (lane == 0 && j < d) {
    float z = 0.f;
    for (int l = 0; l < kReduceLanes; ++l) z += lane_sums[l][col];
    grad_query[j] = norm_weight[j] * z;
    grad_norm[j] = query[j] * z;
  }
  if (blockIdx.x == 0) {
    float gsum = 0.f;
    for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) gsum += gate_partial[r];
    __syncthreads();  // every thread has read lane_sums above
    lane_sums[lane][col] = gsum;
    __syncthreads();
    if (threadIdx.x == 0) {
      float total = 0.f;
      for (int l = 0; l < kReduceLanes; ++l)
        for (int c = 0; c < kReduceColumns; ++c) total += lane_sums[l][c];
      *grad_gate = total;
    }
  }
}

}  // namespace mhar
}  // namespace headwise
