// Host side of the fused QKV projection on the CUDA backend: checks, the library GEMM
// (at::mm -> cuBLAS), the epilogue launches, and the backend entries of qkv_ops.h.
// Compiled once as the CUDA backend (qkv_cuda.cu, nvcc: project_cuda) and once as the
// emulated backend (qkv_sim.cpp, host compiler against the SIMT emulator: project_sim,
// where at::mm runs on the CPU), so both run exactly the same launch logic.
#pragma once

#include "../common/backend_device.h"
#include "../common/dispatch.h"
#include "../common/op_range.h"
#include "../common/outputs.h"
#include "qkv_args.h"
#include "qkv_kernel.cuh"
#include "qkv_ops.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include <algorithm>
#include <tuple>
#include <type_traits>

namespace headwise {
namespace qkv {
#define HW_QKV_ENTRY(name) HW_BACKEND_ENTRY(name)
namespace {
using hw::kBackendDevice;
using hw::on_backend_device;

// Forward grid cap (blocks loop over tokens beyond it), and the fixed persistent grids
// of the backward (so that the norm-weight reduction order does not depend on the
// device): 528 blocks of 128 threads on the 16-byte path (4 per SM on a 132-SM H200, all
// resident at the kernel's __launch_bounds__(128, 4); a part with fewer SMs runs them in
// waves, and nothing depends on residency), 512 of 4 warps on the scalar fallback.
constexpr int64_t kMaxGrid = (int64_t{1} << 31) - 1;
constexpr int64_t kBwdVecBlocks = 528;
constexpr int64_t kBwdScalarBlocks = 512;

// The widest head the call writes (v heads only when there are kv heads: q_project
// has none).
inline int64_t widest_head(const Shape& s) { return s.hkv > 0 ? std::max(s.d, s.dv) : s.d; }

// Calls f(std::integral_constant<int, ITEMS>{}) for the widest head of the call.
template <typename F>
void dispatch_items(const Shape& s, F&& f) {
  const int64_t half = (widest_head(s) + 1) / 2;
  if (half <= 32) {
    f(std::integral_constant<int, 1>{});
  } else if (half <= 64) {
    f(std::integral_constant<int, 2>{});
  } else {
    f(std::integral_constant<int, 4>{});
  }
}

// Calls f(std::bool_constant<STAGED_ROPE>{}): the epilogues' shared-memory staged rope
// (partial rotary or interleaved pairs; see qkv_kernel.cuh), or the register-only one.
template <typename F>
void dispatch_rope(const Shape& s, F&& f) {
  if (s.rope && (s.interleaved || s.rot != s.d)) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

inline void check_backend(const at::Tensor& x, const Shape& s, const char* op) {
  TORCH_CHECK(on_backend_device(x), "headwise.", op, ": x is on ", x.device(), " but ", kBackendDevice);
  dispatch_storage_dtype(x.scalar_type(), op, "x", [](auto) {});
  TORCH_CHECK_VALUE(widest_head(s) <= kMaxWidth, "headwise.", op, ": head widths up to ", kMaxWidth,
                    " are supported by the CUDA kernels, got head_dim ", s.d, ", v_head_dim ", s.dv);
  TORCH_CHECK_VALUE(s.heads() <= kMaxHeads, "headwise.", op, ": layout: at most ", kMaxHeads,
                    " heads (num_q_heads + 2 num_kv_heads) are supported by the CUDA kernels, got ", s.heads());
  TORCH_CHECK_VALUE(s.rows <= INT32_MAX, "headwise.", op, ": weight has ", s.rows,
                    " rows; the CUDA kernels take at most 2^31 - 1");
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// A small parameter as a contiguous fp32 tensor whose data is 16-byte aligned (the
// 16-byte path stages it with float4 loads; a view at an odd offset is copied).
inline at::Tensor small(const c10::optional<at::Tensor>& t) {
  if (!t.has_value()) return at::Tensor();
  at::Tensor f = t->to(at::kFloat).contiguous();
  return aligned16(f.data_ptr()) ? f : f.clone();
}

inline int64_t pow2_ceil(int64_t n) {
  int64_t p = 1;
  while (p < n) p <<= 1;
  return p;
}

// Lanes per head of the 16-byte path for this call, or 0 where the call takes the scalar
// fallback: every head whole 16-byte vectors at 16-byte aligned addresses (head widths,
// head offsets and N_total multiples of V = 16 / sizeof(T); `tensors` aligned) and at
// most 32 vectors per head. The choice does not depend on the rope (every form runs on
// both paths), so a call with and without rope sums its norm statistics in one order.
inline int vector_group_lanes(const Shape& s, at::IntArrayRef head_offsets, int64_t elem_size,
                              std::initializer_list<const void*> tensors) {
  const int64_t v = 16 / elem_size;
  if (s.d % v != 0 || (s.hkv > 0 && s.dv % v != 0) || s.rows % v != 0) return 0;
  for (const int64_t off : head_offsets)
    if (off % v != 0) return 0;
  if (widest_head(s) / v > 32) return 0;
  for (const void* p : tensors)
    if (!aligned16(p)) return 0;
  return static_cast<int>(pow2_ceil(widest_head(s) / v));
}

inline const float* ptr_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }

// The geometry; `keep` holds the fp32 copies of the small parameters alive until the
// launch.
inline Geometry make_geometry(const Shape& s, at::IntArrayRef head_offsets, const at::Tensor& x,
                              const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,
                              const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& sin,
                              double norm_eps, double scale_q, int group_lanes,
                              std::vector<at::Tensor>& keep) {
  keep = {small(q_norm), small(k_norm), small(cos), small(sin)};
  Geometry g{};
  for (size_t h = 0; h < head_offsets.size(); ++h) g.head_offsets[h] = static_cast<int32_t>(head_offsets[h]);
  g.q_norm = ptr_or_null(keep[0]);
  g.k_norm = ptr_or_null(keep[1]);
  g.cos = ptr_or_null(keep[2]);
  g.sin = ptr_or_null(keep[3]);
  g.interleaved = s.interleaved;
  g.rot = s.rot;
  g.rope_batch_stride = s.rope_batch_stride;
  g.q_norm_rounds = norm_rounds(x, q_norm);
  g.k_norm_rounds = norm_rounds(x, k_norm);
  g.scale_q = static_cast<float>(scale_q);
  g.eps = static_cast<float>(norm_eps);
  g.tokens = s.tokens();
  g.seq = s.seq;
  g.rows = s.rows;
  g.hq = s.hq;
  g.hkv = s.hkv;
  g.d = s.d;
  g.dv = s.dv;
  g.group_lanes = group_lanes;
  return g;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> HW_QKV_ENTRY(project)(
    const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
    at::IntArrayRef head_offsets, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, int64_t v_head_dim,
    const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm, double norm_eps,
    const c10::optional<at::Tensor>& rope_cos, const c10::optional<at::Tensor>& rope_sin, double scale_q,
    int64_t rope_style) {
  HW_OP_RANGE("headwise::qkv_project");
  constexpr const char* op = "qkv_project";
  const Shape s = check_project_args(op, x, weight, bias, head_offsets, num_q_heads, num_kv_heads, head_dim,
                                     v_head_dim, q_norm, k_norm, norm_eps, rope_cos, rope_sin, rope_style);
  check_backend(x, s, op);
  const at::OptionalDeviceGuard device_guard(x.device());
  auto [q, k, v] = new_head_outputs(s, x, new_output);
  const at::Tensor packed = packed_product(x, weight, bias, s);
  if (s.tokens() > 0) {
    std::vector<at::Tensor> keep;
    const int lanes = vector_group_lanes(s, head_offsets, x.element_size(),
                                         {packed.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr()});
    FwdParams p{};
    p.g = make_geometry(s, head_offsets, x, q_norm, k_norm, rope_cos, rope_sin, norm_eps, scale_q, lanes, keep);
    p.packed = packed.data_ptr();
    p.out[0] = q.data_ptr();
    p.out[1] = k.data_ptr();
    p.out[2] = v.data_ptr();
    const dim3 grid(static_cast<unsigned>(std::min(s.tokens(), kMaxGrid)));
    dispatch_storage_dtype(x.scalar_type(), op, "x", [&](auto tag) {
      using T = decltype(tag);
      if (lanes > 0) {
        auto kernel = &qkv_epilogue_fwd_kernel<T>;
        HW_LAUNCH("qkv_epilogue_fwd", kernel, grid, dim3(kVecThreads), 0, p);
        return;
      }
      dispatch_items(s, [&](auto items) {
        dispatch_rope(s, [&](auto staged) {
          auto kernel = &qkv_epilogue_fwd_scalar_kernel<T, decltype(items)::value, decltype(staged)::value>;
          HW_LAUNCH("qkv_epilogue_fwd_scalar", kernel, grid, dim3(kWarpsPerBlock * 32), 0, p);
        });
      });
    });
  }
  return {q, k, v, s.any_norm() ? packed : at::empty({0}, x.options())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> HW_QKV_ENTRY(project_backward)(
    const at::Tensor& grad_q, const at::Tensor& grad_k, const at::Tensor& grad_v, const at::Tensor& x,
    const at::Tensor& weight, const c10::optional<at::Tensor>& bias, const at::Tensor& packed,
    at::IntArrayRef head_offsets, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, int64_t v_head_dim,
    const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm, double norm_eps,
    const c10::optional<at::Tensor>& rope_cos, const c10::optional<at::Tensor>& rope_sin, double scale_q,
    int64_t rope_style) {
  HW_OP_RANGE("headwise::qkv_project_backward");
  constexpr const char* op = "qkv_project_backward";
  const Shape s = check_project_args(op, x, weight, bias, head_offsets, num_q_heads, num_kv_heads, head_dim,
                                     v_head_dim, q_norm, k_norm, norm_eps, rope_cos, rope_sin, rope_style);
  check_backend(x, s, op);
  check_backward_args(op, grad_q, grad_k, grad_v, x, packed, s);
  const at::OptionalDeviceGuard device_guard(x.device());
  const at::Tensor gq = contiguous_grad(grad_q), gk = contiguous_grad(grad_k), gv = contiguous_grad(grad_v);
  const at::Tensor pk = s.any_norm() ? packed.contiguous() : packed;
  at::Tensor G = new_output({s.tokens(), s.rows}, x.options());
  at::Tensor norm_sum = at::zeros({2, s.d}, x.options().dtype(at::kFloat));
  if (s.tokens() > 0) {
    const int lanes = vector_group_lanes(
        s, head_offsets, x.element_size(),
        {gq.data_ptr(), gk.data_ptr(), gv.data_ptr(), G.data_ptr(), s.any_norm() ? pk.data_ptr() : nullptr});
    const int64_t blocks = std::min(s.tokens(), lanes > 0 ? kBwdVecBlocks : kBwdScalarBlocks);
    // One partial row per block (16-byte path) or per warp (scalar fallback).
    const int64_t partial_rows = lanes > 0 ? blocks : blocks * kWarpsPerBlock;
    at::Tensor partial = new_output({partial_rows, 2, s.d}, x.options().dtype(at::kFloat));
    std::vector<at::Tensor> keep;
    BwdParams p{};
    p.g = make_geometry(s, head_offsets, x, q_norm, k_norm, rope_cos, rope_sin, norm_eps, scale_q, lanes, keep);
    p.packed = s.any_norm() ? pk.data_ptr() : nullptr;
    p.grad[0] = gq.data_ptr();
    p.grad[1] = gk.data_ptr();
    p.grad[2] = gv.data_ptr();
    p.grad_packed = G.data_ptr();
    p.partial = partial.data_ptr<float>();
    const dim3 grid(static_cast<unsigned>(blocks));
    dispatch_storage_dtype(x.scalar_type(), op, "x", [&](auto tag) {
      using T = decltype(tag);
      if (lanes > 0) {
        auto kernel = &qkv_epilogue_bwd_kernel<T>;
        HW_LAUNCH("qkv_epilogue_bwd", kernel, grid, dim3(kVecThreads), 0, p);
        return;
      }
      dispatch_items(s, [&](auto items) {
        dispatch_rope(s, [&](auto staged) {
          auto kernel = &qkv_epilogue_bwd_scalar_kernel<T, decltype(items)::value, decltype(staged)::value>;
          HW_LAUNCH("qkv_epilogue_bwd_scalar", kernel, grid, dim3(kWarpsPerBlock * 32), 0, p);
        });
      });
    });
    if (s.any_norm()) {
      // The fixed-order tree of qkv_kernel.cuh: partial -> slices -> norm_sum.
      const int64_t cols = 2 * s.d;
      const unsigned col_blocks = static_cast<unsigned>((cols + 31) / 32);
      at::Tensor slices = new_output({kReduceSlices, cols}, x.options().dtype(at::kFloat));
      auto reduce = &qkv_norm_grad_slices_kernel;
      HW_LAUNCH("qkv_norm_grad_slices", reduce, dim3(col_blocks, kReduceSlices), dim3(kReduceWarps * 32), 0,
                partial.data_ptr<float>(), partial_rows, cols, slices.data_ptr<float>());
      auto final_level = &qkv_norm_grad_final_kernel;
      HW_LAUNCH("qkv_norm_grad_final", final_level, dim3(col_blocks, 1), dim3(kReduceWarps * 32), 0,
                slices.data_ptr<float>(), int64_t{kReduceSlices}, cols, norm_sum.data_ptr<float>());
    }
  }
  auto [grad_x, grad_w, grad_b] = backward_gemms(G, x, weight, bias, s);
  at::Tensor grad_qn = q_norm.has_value() ? norm_sum[0].to(q_norm->scalar_type()) : at::empty({0}, x.options());
  at::Tensor grad_kn = k_norm.has_value() ? norm_sum[1].to(k_norm->scalar_type()) : at::empty({0}, x.options());
  return {grad_x, grad_w, grad_b, grad_qn, grad_kn};
}

}  // namespace qkv
}  // namespace headwise
