// The fused attention's backward entry attention_backward (dcmha_ops.h) of the CUDA and
// emulated backends (dcmha_launch.h): the tensor-core kernels
// (dcmha_attention_mma_bwd_kernel.cuh) where they take the call, else the SIMT kernels
// (dcmha_attention_bwd_kernel.cuh).
#pragma once

#include "dcmha_attention_bwd_kernel.cuh"
#include "dcmha_attention_mma_bwd_kernel.cuh"
#include "dcmha_launch.h"

namespace headwise {
namespace dcmha {

namespace {

// Whether the tensor-core backward takes this call: bf16 / fp16, or fp32 after a TF32
// forward (forward_takes_tensor_cores: the same truncated operands; it reads torch's TF32
// setting, which must be the forward's: the autograd wrapper raises where it changed), dh and
// dv padded to at most 128 (the dq / dk / dv accumulators of a warp's 16 rows), every kernel's shared
// memory within the device's opt-in limit with its streamed tiles in one buffer where two do
// not fit (two_where_it_fits: at dh = dv = 128, fp32's dL' sweep and key kernel on sm_80's 163 KiB,
// bf16's on the 99 KiB parts, where the rowsum also takes one head a CTA), grids within
// CUDA's limits.
inline bool mma_backward_fits(const AttnShape& s, const AttnParams& p, at::ScalarType dtype, int dh_pad, int dv_pad) {
  const size_t limit = hw::max_dynamic_smem_optin();
  const int elem = static_cast<int>(c10::elementSize(dtype));
  const int64_t need =
      std::max({mma_loop_smem_bytes(p.hg, dh_pad, elem), bwd_sweep_smem_bytes(true, dh_pad, dv_pad, elem, 1),
                bwd_sweep_smem_bytes(false, dh_pad, dv_pad, elem, 1),
                bwd_rows_smem_bytes(dh_pad, dv_pad, 1, elem),
                bwd_keys_smem_bytes(dh_pad, dv_pad, elem, 1), transpose_smem_bytes()});
  return (dtype != at::kFloat || forward_takes_tensor_cores(s, p, dtype, dh_pad, dv_pad)) && dh_pad <= 128 &&
         dv_pad <= 128 && static_cast<size_t>(need) <= limit &&
         static_cast<int64_t>(p.B) * (p.H / p.hg) <= 65535 && p.B <= 65535 && p.H <= 65535 &&
         (static_cast<int64_t>(p.T) + kTileRows - 1) / kTileRows * kRowsumKeySplits <= 65535;
}

// 1 / Z of the forward's row sums Z (0 where Z = 0: a row with no kept key), correctly
// rounded as the forward's: the backward kernels multiply by it where they would divide.
inline at::Tensor inverse_row_sums(const at::Tensor& z) { return at::where(z > 0, z.reciprocal(), 0.0); }

// The tensor-core backward (dcmha_attention_mma_bwd_kernel.cuh): the weights table with
// the row statistics, then per query chunk the seven launches. dq is written; dk, dv are
// summed in fp32 over the chunks, the last chunk reading a key tile writing them in q's
// dtype; the weight grads go through the grads table to dw1, dw2, dg (fp32, every element
// written).
inline void launch_mma_attention_backward(const AttnParams& p, const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& v, const at::Tensor& dout, const at::Tensor& stats,
                                          at::Tensor& dq, at::Tensor& dk, at::Tensor& dv, at::Tensor& dw1,
                                          at::Tensor& dw2, at::Tensor& dg, int dh_pad, int dv_pad) {
  const int64_t groups = p.H / p.hg;
  const int elem = static_cast<int>(q.element_size());
  const int64_t chunk = query_chunk_rows(p, kBwdPartWords, elem);
  const at::TensorOptions fopt = q.options().dtype(at::kFloat);
  at::Tensor wt = at::empty({p.B, p.H, kBwdWeightFields, p.T}, fopt);
  wt.select(2, kFieldM).copy_(stats[0]);
  wt.select(2, kFieldInvZ).copy_(inverse_row_sums(stats[1]));
  // Zeroed: the key-tile kernels' lanes read (t, s) of other tiles' bands too (then drop
  // the values), and no read may be of uninitialized memory (compute-sanitizer initcheck).
  at::Tensor partials = part_scratch(p, kBwdPartWords, chunk, elem, q.options(), true);
  // Stored by the first chunk that reads a key tile, so not zeroed (dcmha_attn_bwd_keys).
  at::Tensor dk32 = at::empty(k.sizes(), fopt), dv32 = at::empty(v.sizes(), fopt);
  at::Tensor gt = at::zeros({p.B, p.H, kWeightFields, p.T}, fopt);
  const int64_t rowsum_pitch = (std::min<int64_t>(chunk, p.T) + 31) / 32 * 32;
  at::Tensor rowsum_parts =
      at::empty({static_cast<int64_t>(p.B) * p.H, kRowsumKeySplits, kRowsumFields, rowsum_pitch}, fopt);
  MmaAttnBwdParams bp{};
  bp.m.f = p;
  bp.m.wt = wt.data_ptr<float>();
  bp.m.partials = static_cast<PartWord*>(partials.data_ptr());
  bp.m.chunk = static_cast<int>(chunk);
  bp.m.wfields = kBwdWeightFields;
  bp.m.pwords = kBwdPartWords;
  bp.m.dh_pad = dh_pad;
  bp.m.dv_pad = dv_pad;
  // dk, dv and their fp32 sums are fresh tensors, so aligned; listed so that vec16 does not rest on it.
  bp.m.vec16 = rows_vec16(p, elem, {q.data_ptr(), k.data_ptr(), v.data_ptr(), dout.data_ptr(), dq.data_ptr(),
                                    dk.data_ptr(), dv.data_ptr(), dk32.data_ptr(), dv32.data_ptr()});
  bp.wt = wt.data_ptr<float>();
  bp.dout = dout.data_ptr();
  bp.dq = dq.data_ptr();
  bp.dk = dk32.data_ptr<float>();
  bp.dv = dv32.data_ptr<float>();
  bp.dk_out = dk.data_ptr();
  bp.dv_out = dv.data_ptr();
  bp.gt = gt.data_ptr<float>();
  bp.rowsum_parts = rowsum_parts.data_ptr<float>();
  bp.rowsum_pitch = static_cast<int>(rowsum_pitch);
  const size_t wt_smem = static_cast<size_t>(transpose_smem_bytes());
  const size_t loop_smem = static_cast<size_t>(mma_loop_smem_bytes(p.hg, dh_pad, elem));
  const int post_stages =
      two_where_it_fits([&](int st) { return bwd_sweep_smem_bytes(false, dh_pad, dv_pad, elem, st); });
  const int pre_stages =
      two_where_it_fits([&](int st) { return bwd_sweep_smem_bytes(true, dh_pad, dv_pad, elem, st); });
  const size_t post_smem = static_cast<size_t>(bwd_sweep_smem_bytes(false, dh_pad, dv_pad, elem, post_stages));
  const size_t pre_smem = static_cast<size_t>(bwd_sweep_smem_bytes(true, dh_pad, dv_pad, elem, pre_stages));
  // Two heads a rowsum CTA where the group's size and the words allow (rowsum_heads) and
  // their Q, dO tiles fit the device (not at dh = dv = 128 on the 99 KiB parts), else one.
  const int rs_heads = rowsum_heads(p.hg, elem) == 2
                           ? two_where_it_fits([&](int h) { return bwd_rows_smem_bytes(dh_pad, dv_pad, h, elem); })
                           : 1;
  const size_t rowsum_smem = static_cast<size_t>(bwd_rows_smem_bytes(dh_pad, dv_pad, rs_heads, elem));
  const size_t rows_smem = static_cast<size_t>(bwd_rows_smem_bytes(dh_pad, dv_pad, 1, elem));
  const int key_stages =
      two_where_it_fits([&](int st) { return bwd_keys_smem_bytes(dh_pad, dv_pad, elem, st); });
  const size_t keys_smem = static_cast<size_t>(bwd_keys_smem_bytes(dh_pad, dv_pad, elem, key_stages));
  const unsigned bg = static_cast<unsigned>(p.B * groups), H = static_cast<unsigned>(p.H),
                 B = static_cast<unsigned>(p.B);
  dispatch_storage_dtype(q.scalar_type(), "dcmha_attention_backward", "q", [&](auto tag) {
    using T = decltype(tag);
    auto kw = &dcmha_attn_weights_t;
    auto kp = &dcmha_attn_sweep<T, true>;
    auto k_post = post_stages == 1 ? &dcmha_attn_bwd_sweep<T, false, 1> : &dcmha_attn_bwd_sweep<T, false>;
    auto k_pre = pre_stages == 1 ? &dcmha_attn_bwd_sweep<T, true, 1> : &dcmha_attn_bwd_sweep<T, true>;
    auto k_rowsum = &dcmha_attn_bwd_rows<T, false, 4, 1>;
    if constexpr (!std::is_same<T, float>::value) {  // fp32 takes one head a CTA (rowsum_heads)
      if (rs_heads == 2) k_rowsum = &dcmha_attn_bwd_rows<T, false, 4, 2>;
    }
    auto k_dq = dh_pad <= 32 ? &dcmha_attn_bwd_rows<T, true, 4, 1> : &dcmha_attn_bwd_rows<T, true, 16, 1>;
    // One buffer only where two do not fit, which at dh, dv <= 32 they always do.
    auto k_keys = key_stages == 1                    ? &dcmha_attn_bwd_keys<T, 8, 1>
                  : std::max(dh_pad, dv_pad) <= 32 ? &dcmha_attn_bwd_keys<T, 2>
                                                   : &dcmha_attn_bwd_keys<T, 8>;
    const char* op = "dcmha_attention_backward";
    hw::allow_dynamic_smem(op, kw, wt_smem);
    hw::allow_dynamic_smem(op, kp, loop_smem);
    hw::allow_dynamic_smem(op, k_post, post_smem);
    hw::allow_dynamic_smem(op, k_pre, pre_smem);
    hw::allow_dynamic_smem(op, k_rowsum, rowsum_smem);
    hw::allow_dynamic_smem(op, k_dq, rows_smem);
    hw::allow_dynamic_smem(op, k_keys, keys_smem);
    HW_LAUNCH("dcmha_attn_weights_t", kw, transpose_grid(p), dim3(kTransposeThreads), wt_smem, p,
              wt.data_ptr<float>(), kBwdWeightFields, weights_vec4(p));
    for (int64_t c0 = 0; c0 < p.T; c0 += chunk) {
      bp.m.chunk0 = static_cast<int>(c0);
      const unsigned tiles = query_tiles(p.T, c0, chunk);
      const unsigned splits = band_key_blocks(p, c0, chunk, kSweepSplitKeys, bp.m.split0);
      const unsigned key_tiles = band_key_blocks(p, c0, chunk, kTileRows, bp.key_tile0);
      // The row and key kernels' grids run heads fastest: the heads of a tile share its scratch.
      const dim3 sweep_grid(splits, tiles, bg), rows_grid(H, tiles, B), keys_grid(H, key_tiles, B);
      const dim3 rowsum_grid(H / rs_heads, tiles * kRowsumKeySplits, B),
          combine_grid(static_cast<unsigned>((tiles * kTileRows + kMmaThreads - 1) / kMmaThreads), H, B);
      HW_LAUNCH("dcmha_attn_partials", kp, sweep_grid, dim3(kMmaThreads), loop_smem, bp.m);
      HW_LAUNCH("dcmha_attn_bwd_dpost", k_post, sweep_grid, dim3(kMmaThreads), post_smem, bp);
      HW_LAUNCH("dcmha_attn_bwd_rowsum", k_rowsum, rowsum_grid, dim3(kMmaThreads), rowsum_smem, bp);
      HW_LAUNCH("dcmha_attn_bwd_rowsum_combine", dcmha_attn_bwd_rowsum_combine, combine_grid, dim3(kMmaThreads), 0,
                bp);
      HW_LAUNCH("dcmha_attn_bwd_dpre", k_pre, sweep_grid, dim3(kMmaThreads), pre_smem, bp);
      HW_LAUNCH("dcmha_attn_bwd_dq", k_dq, rows_grid, dim3(kMmaThreads), rows_smem, bp);
      HW_LAUNCH("dcmha_attn_bwd_dkv", k_keys, keys_grid, dim3(kKeyThreads), keys_smem, bp);
    }
  });
  hw::allow_dynamic_smem("dcmha_attention_backward", &dcmha_attn_grads_untranspose, wt_smem);
  HW_LAUNCH("dcmha_attn_grads_untranspose", dcmha_attn_grads_untranspose, transpose_grid(p),
            dim3(kTransposeThreads), wt_smem, p, static_cast<const float*>(gt.data_ptr<float>()),
            dw1.data_ptr<float>(), dw2.data_ptr<float>(), dg.data_ptr<float>(), p.T % 4 == 0 ? 1 : 0);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> HW_DCMHA_ENTRY(attention_backward)(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& w1,
    const at::Tensor& w2, const at::Tensor& g, const at::Tensor& stats, bool causal, int64_t window, double scale,
    int64_t head_groups) {
  HW_OP_RANGE("headwise::dcmha_attention_backward");
  const AttnShape s = check_attention_args(q, k, v, w1, w2, g, window, head_groups);
  check_backend(q, "q", s.heads, "attention", "dcmha_attention_backward");
  TORCH_CHECK_VALUE(grad_out.dim() == 4 && grad_out.size(0) == s.batch && grad_out.size(1) == s.heads &&
                        grad_out.size(2) == s.seq && grad_out.size(3) == s.v_dim,
                    "headwise.dcmha_attention_backward: grad_out must be [B, H, T, dv], got ", shape_str(grad_out));
  check_same_dtype("dcmha_attention_backward", grad_out, "grad_out", q, "q");
  TORCH_CHECK_VALUE(stats.dim() == 4 && stats.size(0) == 2 && stats.size(1) == s.batch && stats.size(2) == s.heads &&
                        stats.size(3) == s.seq && stats.scalar_type() == at::kFloat,
                    "headwise.dcmha_attention_backward: stats must be the [2, B, H, T] float32 statistics of the ",
                    "forward, got ", shape_str(stats), " ", stats.scalar_type());
  const size_t smem = static_cast<size_t>(attn_bwd_smem_floats(static_cast<int>(s.heads), static_cast<int>(s.head_dim),
                                                               static_cast<int>(s.v_dim), kAttnThreads)) *
                      sizeof(float);
  const at::OptionalDeviceGuard device_guard(q.device());
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), dout = grad_out.contiguous();
  const at::Tensor st = stats.contiguous();
  const at::Tensor w1f = w1.to(at::kFloat).contiguous(), w2f = w2.to(at::kFloat).contiguous(),
                   gf = g.to(at::kFloat).contiguous();
  at::Tensor dq = new_output(qc.sizes(), qc.options());
  at::Tensor dk = new_output(kc.sizes(), kc.options());
  at::Tensor dv = new_output(vc.sizes(), vc.options());
  at::Tensor dw1 = new_output(w1f.sizes(), w1f.options());  // every element written by the kernels
  at::Tensor dw2 = new_output(w2f.sizes(), w2f.options());
  at::Tensor dg = new_output(gf.sizes(), gf.options());
  const int dh_pad = pad16(s.head_dim), dv_pad = pad16(s.v_dim);
  AttnParams f = attention_params(s, qc, kc, vc, w1f, w2f, gf, causal, window, scale);
  f.stats = st.data_ptr<float>();
  if (s.batch * s.seq > 0 && mma_backward_fits(s, f, q.scalar_type(), dh_pad, dv_pad)) {
    // bf16 / fp16, and fp32 after a TF32 forward, on the tensor-core kernels; the key-slot
    // grads are sums over chunks.
    launch_mma_attention_backward(f, qc, kc, vc, dout, st, dq, dk, dv, dw1, dw2, dg, dh_pad, dv_pad);
  } else if (s.batch * s.seq > 0) {
    // After a TF32 forward whose backward does not fit the tensor-core kernels (fp32 tiles
    // at dh = 128 on sm_80), the SIMT kernels read q, k, v as its tensor cores did.
    at::Tensor q_tf32, k_tf32, v_tf32;
    if (q.scalar_type() == at::kFloat && forward_takes_tensor_cores(s, f, q.scalar_type(), dh_pad, dv_pad)) {
      q_tf32 = tf32_operand(qc);
      k_tf32 = tf32_operand(kc);
      v_tf32 = tf32_operand(vc);
      f = attention_params(s, q_tf32, k_tf32, v_tf32, w1f, w2f, gf, causal, window, scale);
      f.stats = st.data_ptr<float>();
    }
    at::Tensor D = new_output({s.batch, s.heads, s.seq}, w1f.options());  // rowsum(P dP) for the key kernel
    // (M, 1 / Z): both kernels form P = exp(L - M) (1 / Z) as the forward does, with no
    // division in their loops (the call to its slow path spilled the key kernel); the
    // reciprocal correctly rounded, as the forward's 1 / Z.
    const at::Tensor inv_stats = at::stack({st.select(0, 0), inverse_row_sums(st.select(0, 1))});
    AttnBwdParams p{};
    p.f = f;
    p.stats = inv_stats.data_ptr<float>();
    p.dout = dout.data_ptr();
    p.D = D.data_ptr<float>();
    p.dq = dq.data_ptr();
    p.dk = dk.data_ptr();
    p.dv = dv.data_ptr();
    p.dw1 = dw1.data_ptr<float>();
    p.dw2 = dw2.data_ptr<float>();
    p.dg = dg.data_ptr<float>();
    const dim3 grid(static_cast<unsigned>(s.seq), static_cast<unsigned>(s.batch));
    dispatch_storage_dtype(q.scalar_type(), "dcmha_attention_backward", "q", [&](auto tag) {
      using T = decltype(tag);
      auto kq = &dcmha_attention_bwd_query<T>;
      auto kk = &dcmha_attention_bwd_key<T>;
      hw::allow_dynamic_smem("dcmha_attention_backward", kq, smem);
      hw::allow_dynamic_smem("dcmha_attention_backward", kk, smem);
      HW_LAUNCH("dcmha_attention_bwd_query", kq, grid, dim3(kAttnThreads), smem, p);
      HW_LAUNCH("dcmha_attention_bwd_key", kk, grid, dim3(kAttnThreads), smem, p);
    });
  }
  return {dq, dk, dv, dw1.to(w1.scalar_type()), dw2.to(w2.scalar_type()), dg.to(g.scalar_type())};
}

}  // namespace dcmha
}  // namespace headwise
