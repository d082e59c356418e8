// The forward entry route (mhar_ops.h) of the CUDA and emulated backends (mhar_launch.h):
// the staged kernel where it fits, else mhar_route_fwd_kernel.
#pragma once

#include "mhar_launch.h"

namespace headwise {
namespace mhar {

std::tuple<at::Tensor, at::Tensor> HW_MHAR_ENTRY(route)(const at::Tensor& sources,
                                                        const at::Tensor& query,
                                                        const at::Tensor& norm_weight,
                                                        int64_t num_heads, int64_t num_sources,
                                                        double eps,
                                                        const c10::optional<at::Tensor>& residual,
                                                        const c10::optional<at::Tensor>& gate) {
  HW_OP_RANGE("headwise::mhar_route");
  const Shape s = check_route_args(sources, query, norm_weight, num_heads, num_sources, eps);
  check_backend(sources, s, "mhar_route");
  if (residual.has_value()) check_residual(*residual, sources, s);
  if (gate.has_value()) check_gate("mhar_route", *gate, sources);
  const at::OptionalDeviceGuard device_guard(sources.device());

  const at::Tensor q = query.to(at::kFloat).contiguous();
  const at::Tensor g = norm_weight.to(at::kFloat).contiguous();
  const at::Tensor gate32 = gate_as_float(gate);
  at::Tensor out = new_output({s.batch, s.seq, s.d}, sources.options());
  at::Tensor weights =
      new_output({s.num_sources, s.batch, s.seq, s.heads}, sources.options().dtype(at::kFloat));
  if (s.positions() == 0) return {out, weights};

  bool vec8 = s.head_dim % 8 == 0 && aligned_for_vec8(sources) && aligned_for_vec8(q) &&
              aligned_for_vec8(g);
  if (residual.has_value()) vec8 = vec8 && aligned_for_vec8(*residual);
  const Plan plan = make_plan(s, vec8);
  const bool staged = staged_allowed("HEADWISE_MHAR_FWD_STAGED");

  FwdParams p{};
  p.route = make_routing(sources, q, g, s, eps);
  p.residual = residual.has_value() ? residual->data_ptr() : nullptr;
  p.res_stride_b = residual.has_value() ? residual->stride(0) : 0;
  p.res_stride_t = residual.has_value() ? residual->stride(1) : 0;
  p.gate = gate32.defined() ? gate32.data_ptr<float>() : nullptr;
  p.out = out.data_ptr();
  p.weights = weights.data_ptr<float>();

  const dim3 grid(static_cast<unsigned>(std::min(s.positions(), kFwdMaxBlocks)));
  dispatch_storage_dtype(sources.scalar_type(), "mhar_route", "sources", [&](auto tag) {
    using T = decltype(tag);
    if constexpr (sizeof(T) == 2) {
      const int64_t staged_bytes = fwd_staged_smem_bytes(s.num_sources, s.heads, plan.threads);
      if (staged_fits(s, plan, staged, staged_bytes)) {
        auto kernel = s.head_dim / 8 == 64 ? &mhar_route_fwd_staged_kernel<T, true>
                                            : &mhar_route_fwd_staged_kernel<T, false>;
        hw::allow_dynamic_smem("mhar_route", kernel, static_cast<size_t>(staged_bytes));
        HW_LAUNCH("mhar_route_fwd_staged", kernel, grid, dim3(plan.threads), static_cast<size_t>(staged_bytes), p);
        return;
      }
    }
    dispatch_plan<T>(plan, [&](auto cfg) {
      using C = decltype(cfg);
      auto kernel = &mhar_route_fwd_kernel<T, C::vec, C::items, C::rows, C::prefetch, C::mode>;
      const size_t smem_bytes =
          static_cast<size_t>(fwd_smem_floats(plan.mode, plan.nvec, C::rows, s.num_sources, s.heads, C::vec,
                                              C::items, plan.threads)) *
          sizeof(float);
      hw::allow_dynamic_smem("mhar_route", kernel, smem_bytes);
      HW_LAUNCH("mhar_route_fwd", kernel, grid, dim3(plan.threads), smem_bytes, p);
    });
  });
  return {out, weights};
}

}  // namespace mhar
}  // namespace headwise
