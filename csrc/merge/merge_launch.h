// Host side of the head-merge kernels: checks, launches, and the backend entries of
// merge_ops.h. Compiled once as the CUDA backend (merge_cuda.cu, nvcc: head_merge_cuda)
// and once as the emulated backend (merge_sim.cpp, host compiler against the SIMT
// emulator: head_merge_sim), so both run exactly the same launch logic.
#pragma once

#include "../common/backend_device.h"
#include "../common/dispatch.h"
#include "../common/op_range.h"
#include "../common/outputs.h"
#include "merge_args.h"
#include "merge_kernel.cuh"
#include "merge_ops.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include <algorithm>
#include <tuple>

namespace headwise {
namespace merge {
#define HW_MERGE_ENTRY(name) HW_BACKEND_ENTRY(name)
namespace {
using hw::kBackendDevice;
using hw::on_backend_device;

constexpr int64_t kMaxGridYZ = 65535;
constexpr int64_t kMaxGridX = 2147483647;

inline void check_backend(const at::Tensor& z, const Shape& s, const char* op) {
  TORCH_CHECK(on_backend_device(z), "headwise.", op, ": z is on ", z.device(), " but ", kBackendDevice);
  dispatch_storage_dtype(z.scalar_type(), op, "z", [](auto) {});
  // Grid x carries the batch times the output column tiles (forward: B * ceil(D/kBN);
  // grad_z: B * H * ceil(Dv/kBN); limit 2^31 - 1); y carries query or weight-row tiles,
  // z the heads (limit 65535 each).
  TORCH_CHECK_VALUE((s.seq + kBM - 1) / kBM <= kMaxGridYZ && (s.d + kBM - 1) / kBM <= kMaxGridYZ &&
                        s.heads <= kMaxGridYZ && s.batch * ((s.d + kBN - 1) / kBN) <= kMaxGridX &&
                        s.batch * s.heads * ((s.dv + kBN - 1) / kBN) <= kMaxGridX,
                    "headwise.", op, ": shape too large for the CUDA grid (Q/", kBM, ", D/", kBM,
                    " and H must be at most ", kMaxGridYZ, ", B*ceil(D/", kBN, ") and B*H*ceil(Dv/", kBN,
                    ") at most ", kMaxGridX, "), got z ", shape_str(z));
}

// The gate as fp32 on its device (undefined when absent) and its view for the kernels.
inline at::Tensor gate_as_float(const c10::optional<at::Tensor>& head_gate) {
  return head_gate.has_value() ? head_gate->to(at::kFloat).contiguous() : at::Tensor();
}

inline Gate make_gate(const at::Tensor& gate32, const Shape& s, bool rescale) {
  Gate g{};
  g.g = gate32.defined() ? gate32.data_ptr<float>() : nullptr;
  g.g_sb = gate32.defined() && gate32.dim() == 2 ? s.heads : 0;
  g.heads = s.heads;
  g.rescale = rescale;
  return g;
}

inline unsigned cdiv(int64_t a, int64_t b) { return static_cast<unsigned>((a + b - 1) / b); }

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> HW_MERGE_ENTRY(head_merge)(
    const at::Tensor& z, const at::Tensor& weight_o, const c10::optional<at::Tensor>& bias,
    const c10::optional<at::Tensor>& head_gate, bool rescale, bool return_stats) {
  HW_OP_RANGE("headwise::head_merge");
  constexpr const char* op = "head_merge";
  const Shape s = check_merge_args(op, z, weight_o, head_gate);
  if (bias.has_value()) check_bias(op, *bias, z, s);
  check_backend(z, s, op);
  const at::OptionalDeviceGuard device_guard(z.device());
  const auto f32 = z.options().dtype(at::kFloat);
  at::Tensor out = new_output({s.batch, s.seq, s.d}, z.options());
  at::Tensor z_norm = return_stats ? new_output({s.batch, s.seq, s.heads}, f32) : at::empty({0}, f32);
  at::Tensor out_norm = return_stats ? new_output({s.batch, s.seq, s.heads}, f32) : at::empty({0}, f32);
  if (s.rows() == 0) return {out, z_norm, out_norm};

  const at::Tensor gate32 = gate_as_float(head_gate);
  const at::Tensor w = weight_o;  // rows stride-1 (checked); row stride = ldw
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  const int64_t n_tiles = cdiv(s.d, kBN);
  at::Tensor part = return_stats ? new_output({n_tiles, s.batch, s.seq, s.heads}, f32) : at::Tensor();

  FwdParams p{};
  p.z = z.data_ptr();
  p.z_sb = z.stride(0);
  p.z_sh = z.stride(1);
  p.z_sq = z.stride(2);
  p.w = w.data_ptr();
  p.ldw = w.stride(0);
  p.bias = b.defined() ? b.data_ptr() : nullptr;
  p.gate = make_gate(gate32, s, rescale);
  p.out = out.data_ptr();
  p.znorm_sq = return_stats ? z_norm.data_ptr<float>() : nullptr;
  p.onorm_part = return_stats ? part.data_ptr<float>() : nullptr;
  p.batch = s.batch;
  p.heads = s.heads;
  p.seq = s.seq;
  p.dv = s.dv;
  p.d = s.d;
  const dim3 grid(static_cast<unsigned>(s.batch * n_tiles), cdiv(s.seq, kBM));
  dispatch_storage_dtype(z.scalar_type(), op, "z", [&](auto tag) {
    using T = decltype(tag);
    auto kernel = &head_merge_fwd_kernel<T>;
    HW_LAUNCH("head_merge_fwd", kernel, grid, dim3(kThreads), 0, p);
  });
  if (return_stats) {
    const int64_t count = s.rows() * s.heads;
    auto fin = &head_merge_stats_finalize_kernel;
    HW_LAUNCH("head_merge_stats_finalize", fin, dim3(cdiv(count, 256)), dim3(256), 0, z_norm.data_ptr<float>(),
              part.data_ptr<float>(), out_norm.data_ptr<float>(), count, n_tiles);
  }
  return {out, z_norm, out_norm};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> HW_MERGE_ENTRY(head_merge_backward)(
    const at::Tensor& grad_out, const at::Tensor& z, const at::Tensor& weight_o,
    const c10::optional<at::Tensor>& head_gate, bool rescale, bool bias_grad, bool gate_grad) {
  HW_OP_RANGE("headwise::head_merge_backward");
  constexpr const char* op = "head_merge_backward";
  const Shape s = check_merge_args(op, z, weight_o, head_gate);
  check_grad_out(op, grad_out, z, s);
  check_backend(z, s, op);
  const at::OptionalDeviceGuard device_guard(z.device());
  const at::Tensor dy = grad_out.contiguous();
  const at::Tensor gate32 = gate_as_float(head_gate);
  const bool need_c = gate_grad && head_gate.has_value();
  at::Tensor grad_z = empty_like_layout(z, z.options());
  if (poison_outputs()) grad_z.fill_(std::numeric_limits<double>::quiet_NaN());
  at::Tensor grad_w = new_output({s.d, s.k()}, z.options());
  at::Tensor grad_b = bias_grad ? new_output({s.d}, z.options()) : at::empty({0}, z.options());
  at::Tensor grad_gate = at::empty({0}, z.options());
  if (s.rows() == 0) {
    grad_w.zero_();
    if (bias_grad) grad_b.zero_();
    if (need_c) grad_gate = at::zeros(head_gate->sizes(), head_gate->options());
    return {grad_z, grad_w, grad_b, grad_gate};
  }
  const unsigned dv_tiles = cdiv(s.dv, kBN), q_tiles = cdiv(s.seq, kBM);
  at::Tensor c_part = need_c ? new_output({s.batch, s.heads, static_cast<int64_t>(q_tiles) * dv_tiles},
                                          z.options().dtype(at::kFloat))
                             : at::Tensor();
  BwdParams p{};
  p.grad_out = dy.data_ptr();
  p.z = z.data_ptr();
  p.z_sb = z.stride(0);
  p.z_sh = z.stride(1);
  p.z_sq = z.stride(2);
  p.w = weight_o.data_ptr();
  p.ldw = weight_o.stride(0);
  p.gate = make_gate(gate32, s, rescale);
  p.grad_z = grad_z.data_ptr();
  p.gz_sb = grad_z.stride(0);
  p.gz_sh = grad_z.stride(1);
  p.gz_sq = grad_z.stride(2);
  p.grad_w = grad_w.data_ptr();
  p.c_part = need_c ? c_part.data_ptr<float>() : nullptr;
  p.batch = s.batch;
  p.heads = s.heads;
  p.seq = s.seq;
  p.dv = s.dv;
  p.d = s.d;
  dispatch_storage_dtype(z.scalar_type(), op, "z", [&](auto tag) {
    using T = decltype(tag);
    auto dz = &head_merge_bwd_dz_kernel<T>;
    HW_LAUNCH("head_merge_bwd_dz", dz, dim3(static_cast<unsigned>(s.batch * s.heads * dv_tiles), q_tiles),
              dim3(kThreads), 0, p);
    auto dw = &head_merge_bwd_dw_kernel<T>;
    HW_LAUNCH("head_merge_bwd_dw", dw, dim3(dv_tiles, cdiv(s.d, kBM), static_cast<unsigned>(s.heads)),
              dim3(kThreads), 0, p);
    if (bias_grad) {
      auto db = &head_merge_bwd_bias_kernel<T>;
      HW_LAUNCH("head_merge_bwd_bias", db, dim3(cdiv(s.d, 256)), dim3(256), 0, static_cast<const T*>(dy.data_ptr()),
                static_cast<T*>(grad_b.data_ptr()), s.rows(), s.d);
    }
  });
  if (need_c) {
    at::Tensor gg = new_output(head_gate->sizes(), z.options().dtype(at::kFloat));
    auto kernel = &head_merge_gate_grad_kernel;
    HW_LAUNCH("head_merge_gate_grad", kernel, dim3(1), dim3(32), 0, p.gate, c_part.data_ptr<float>(),
              static_cast<int64_t>(q_tiles) * dv_tiles, s.batch, gg.data_ptr<float>(), head_gate->dim() == 2);
    grad_gate = gg.to(head_gate->scalar_type());
  }
  return {grad_z, grad_w, grad_b, grad_gate};
}

}  // namespace merge
}  // namespace headwise
