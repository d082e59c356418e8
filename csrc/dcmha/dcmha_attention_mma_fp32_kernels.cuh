// Definitions of the tensor-core attention's two kernels that take no template argument
// (their inputs are the fp32 weights and statistics, whatever the attention's dtype),
// declared and described in dcmha_attention_mma_kernel.cuh: dcmha_attn_weights_t (the
// forward's and the backward's first kernel) and dcmha_attn_stats_combine. Included by
// the forward entry's translation unit only (dcmha_attention_launch.h), so that each is
// defined once per library; the backward's launches see the declaration.
#pragma once

#include "dcmha_attention_mma_kernel.cuh"

namespace headwise {
namespace dcmha {

__global__ void __launch_bounds__(kTransposeThreads) dcmha_attn_weights_t(const AttnParams p, float* wt, int wfields,
                                                                          int vec4) {
  const TransposeTile tile(p);
  const int b = tile.b, t0 = tile.t0, j0 = tile.j0, rows = tile.rows, cols = tile.cols, H = p.H, TT = p.T;
  float* s = reinterpret_cast<float*>(hw::dynamic_shared_memory());  // [kTransposeCols][kWeightsTPitch]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // The tile's 32 x 128 cells as 4 blocks of 8 rows x 8 blocks of 16 columns, a warp's block a step.
  constexpr int kColBlocks = kTransposeCols / 16;
  for (int blk = warp; blk < kTransposeRows / 8 * kColBlocks; blk += kTransposeThreads / 32) {
    const int r = (blk / kColBlocks) * 8 + lane % 8, c = (blk % kColBlocks) * 16 + (lane / 8) * 4;
    if (r >= rows || c >= cols) continue;
    const float* src = weights_row_column(p, static_cast<int64_t>(b) * TT + t0 + r, j0 + c);
    float x[4];
    if (vec4) {
      hw::load_as_float<4>(src, x);
    } else {
HW_UNROLL
      for (int k = 0; k < 4; ++k) x[k] = src[k];
    }
HW_UNROLL
    for (int k = 0; k < 4; ++k) s[(c + k) * kWeightsTPitch + r] = x[k];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < cols * kTransposeRows; i += blockDim.x) {
    const int c = i / kTransposeRows, r = i % kTransposeRows, j = j0 + c;
    if (r < rows)
      wt[((static_cast<int64_t>(b) * H + j % H) * wfields + j / H) * TT + t0 + r] = s[c * kWeightsTPitch + r];
  }
}

__global__ void __launch_bounds__(kTileRows) dcmha_attn_stats_combine(const MmaAttnParams mp) {
  const AttnParams& p = mp.f;
  const int TT = p.T;
  const int64_t bh = static_cast<int64_t>(blockIdx.z) * p.H + blockIdx.y;
  const int t = mp.chunk0 + blockIdx.x * kTileRows + threadIdx.x;
  if (t >= TT || t >= mp.chunk0 + mp.chunk) return;
  int lo, hi;
  key_band(t, 1, TT, p.causal, p.window, lo, hi);
  const int64_t plane = static_cast<int64_t>(p.B) * p.H * mp.chunk;
  const float* in = mp.split_stats + bh * mp.chunk + t - mp.chunk0;
  const int i_lo = lo / kStatsSplitKeys, i_hi = hi > lo ? (hi - 1) / kStatsSplitKeys + 1 : i_lo;
  float m = -INFINITY;
  for (int i = i_lo; i < i_hi; ++i) m = fmaxf(m, in[i * 2 * plane]);
  float z = 0.f;
  if (m != -INFINITY) {
    for (int i = i_lo; i < i_hi; ++i) {
      const float mi = in[i * 2 * plane];
      if (mi != -INFINITY) z += in[i * 2 * plane + plane] * expf(mi - m);
    }
  }
  const int64_t so = static_cast<int64_t>(bh) * TT + t;
  p.stats[so] = m;
  p.stats[static_cast<int64_t>(p.B) * p.H * TT + so] = z;
}

}  // namespace dcmha
}  // namespace headwise
