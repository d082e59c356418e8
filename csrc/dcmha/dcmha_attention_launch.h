// The fused attention's forward entry attention (dcmha_ops.h) of the CUDA and emulated
// backends (dcmha_launch.h): the tensor-core kernels (dcmha_attention_mma_kernel.cuh) where
// they take the call, else the SIMT kernel (dcmha_attention_kernel.cuh).
#pragma once

#include "dcmha_launch.h"
#include "dcmha_attention_mma_fp32_kernels.cuh"

namespace headwise {
namespace dcmha {

namespace {

// The tensor-core forward (bf16 / fp16, and fp32 as TF32 with 64-bit scratch words): transposed weights, then per query chunk the
// statistics sweep (which stores a, b of the chunk in the scratch), its combine, the partials
// sweep (c, d: one sweep over the heads a key tile where it would take two) and the output.
// The chunk keeps the scratch (B G 4 words a (t, s)) and split_stats (B H 2 splits fp32 a
// row) under the cap: 1024 rows at B = 8, H = 32, T = 4096. The statistics CTAs take 64-key
// splits (2 key tiles), so that a chunk's launch has CTAs enough however causal its band:
// with 256-key splits 512-row chunks' launches spread ~1.43x their balanced time, with
// 64-key ones ~1.10x, and ~1.05x at 1024 rows (python -m headwise.bench.launch_balance).
// p holds the forward's pointers and shape.
inline void launch_mma_attention(const AttnParams& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& out, int dh_pad, int dv_pad) {
  const int64_t groups = p.H / p.hg;
  const int64_t splits = (p.T + kStatsSplitKeys - 1) / kStatsSplitKeys;
  const int elem = static_cast<int>(q.element_size());
  const int64_t chunk = std::min(query_chunk_rows(p, kFwdPartWords, elem),
                                 chunk_rows_under_cap(p.T, static_cast<int64_t>(p.B) * p.H * 2 * splits * 4));
  const at::TensorOptions fopt = q.options().dtype(at::kFloat);
  at::Tensor wt = at::empty({p.B, p.H, kWeightFields, p.T}, fopt);
  MmaAttnParams mp{};
  mp.f = p;
  mp.wt = wt.data_ptr<float>();
  mp.wfields = kWeightFields;
  mp.pwords = kFwdPartWords;
  mp.ab_saved = 1;
  mp.dh_pad = dh_pad;
  mp.dv_pad = dv_pad;
  mp.vec16 = rows_vec16(p, elem, {q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()});
  const size_t wt_smem = static_cast<size_t>(transpose_smem_bytes());
  const size_t loop_smem = static_cast<size_t>(mma_loop_smem_bytes(p.hg, dh_pad, elem));
  const size_t out_smem = static_cast<size_t>(mma_out_smem_bytes(dh_pad, dv_pad, elem));
  const unsigned bg = static_cast<unsigned>(p.B * groups);
  dispatch_storage_dtype(q.scalar_type(), "dcmha_attention", "q", [&](auto tag) {
    using T = decltype(tag);
    auto kw = &dcmha_attn_weights_t;
    auto ks = &dcmha_attn_sweep<T, false>;
    auto kp = &dcmha_attn_sweep<T, true>;
    auto kc = &dcmha_attn_stats_combine;
    auto ko = dv_pad <= 32 ? &dcmha_attn_output<T, 4> : &dcmha_attn_output<T, 16>;
    hw::allow_dynamic_smem("dcmha_attention", kw, wt_smem);
    hw::allow_dynamic_smem("dcmha_attention", ks, loop_smem);
    hw::allow_dynamic_smem("dcmha_attention", kp, loop_smem);
    hw::allow_dynamic_smem("dcmha_attention", ko, out_smem);
    HW_LAUNCH("dcmha_attn_weights_t", kw, transpose_grid(p), dim3(kTransposeThreads), wt_smem, p,
              wt.data_ptr<float>(), kWeightFields, weights_vec4(p));
    // split_stats [splits, 2, B H, chunk] is indexed by the absolute split: the combine reads
    // the splits of each row's band.
    at::Tensor split_stats = at::empty({splits, 2, static_cast<int64_t>(p.B) * p.H, chunk}, fopt);
    at::Tensor partials = part_scratch(p, kFwdPartWords, chunk, elem, q.options(), false);
    mp.split_stats = split_stats.data_ptr<float>();
    mp.partials = static_cast<PartWord*>(partials.data_ptr());
    mp.chunk = static_cast<int>(chunk);
    for (int64_t c0 = 0; c0 < p.T; c0 += chunk) {
      mp.chunk0 = static_cast<int>(c0);
      const unsigned chunk_tiles = query_tiles(p.T, c0, chunk);
      const unsigned stats_splits = band_key_blocks(p, c0, chunk, kStatsSplitKeys, mp.split0);
      HW_LAUNCH("dcmha_attn_stats", ks, dim3(stats_splits, chunk_tiles, bg), dim3(kMmaThreads), loop_smem, mp);
      HW_LAUNCH("dcmha_attn_stats_combine", kc,
                dim3(chunk_tiles, static_cast<unsigned>(p.H), static_cast<unsigned>(p.B)), dim3(kTileRows), 0, mp);
      const unsigned chunk_splits = band_key_blocks(p, c0, chunk, kSweepSplitKeys, mp.split0);
      HW_LAUNCH("dcmha_attn_partials", kp, dim3(chunk_splits, chunk_tiles, bg), dim3(kMmaThreads),
                loop_smem, mp);
      HW_LAUNCH("dcmha_attn_output", ko, dim3(static_cast<unsigned>(p.H), chunk_tiles, static_cast<unsigned>(p.B)),
                dim3(kMmaThreads), out_smem, mp);
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> HW_DCMHA_ENTRY(attention)(const at::Tensor& q, const at::Tensor& k,
                                                            const at::Tensor& v, const at::Tensor& w1,
                                                            const at::Tensor& w2, const at::Tensor& g, bool causal,
                                                            int64_t window, double scale, int64_t head_groups) {
  HW_OP_RANGE("headwise::dcmha_attention");
  const AttnShape s = check_attention_args(q, k, v, w1, w2, g, window, head_groups);
  check_backend(q, "q", s.heads, "attention", "dcmha_attention");
  const size_t smem = static_cast<size_t>(attn_smem_floats(static_cast<int>(s.heads), static_cast<int>(s.head_dim),
                                                           static_cast<int>(s.v_dim), kAttnThreads)) *
                      sizeof(float);
  const at::OptionalDeviceGuard device_guard(q.device());
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const at::Tensor w1f = w1.to(at::kFloat).contiguous(), w2f = w2.to(at::kFloat).contiguous(),
                   gf = g.to(at::kFloat).contiguous();
  at::Tensor out = new_output({s.batch, s.heads, s.seq, s.v_dim}, q.options());
  at::Tensor stats = new_output({2, s.batch, s.heads, s.seq}, q.options().dtype(at::kFloat));
  if (s.batch * s.seq == 0) return {out, stats};
  AttnParams p = attention_params(s, qc, kc, vc, w1f, w2f, gf, causal, window, scale);
  p.out = out.data_ptr();
  p.stats = stats.data_ptr<float>();
  const int dh_pad = pad16(s.head_dim), dv_pad = pad16(s.v_dim);
  if (!forward_takes_tensor_cores(s, p, q.scalar_type(), dh_pad, dv_pad)) {
    dispatch_storage_dtype(q.scalar_type(), "dcmha_attention", "q", [&](auto tag) {
      using T = decltype(tag);
      auto kernel = &dcmha_attention_fwd<T>;
      hw::allow_dynamic_smem("dcmha_attention", kernel, smem);
      HW_LAUNCH("dcmha_attention_fwd", kernel, dim3(static_cast<unsigned>(s.seq), static_cast<unsigned>(s.batch)),
                dim3(kAttnThreads), smem, p);
    });
    return {out, stats};
  }
  launch_mma_attention(p, qc, kc, vc, out, dh_pad, dv_pad);
  return {out, stats};
}

}  // namespace dcmha
}  // namespace headwise
