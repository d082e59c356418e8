// The backward's launches, shared by the entries route_backward and route_backward_into
// (mhar_route_backward_launch.h, mhar_route_backward_into_launch.h): the staged kernel
// where it fits, else mhar_route_bwd_kernel, then mhar_param_grad_reduce_kernel.
#pragma once

#include "mhar_bwd_staged_kernel.cuh"
#include "mhar_launch.h"

namespace headwise {
namespace mhar {

namespace {

// The backward into grad_sources, a contiguous [N_max, B, T, d] tensor of dtype G (the
// sources' dtype, or fp32 for a DepthBuffer's shared accumulator): rows [0, N) are stored,
// or added to with `accumulate`. Returns (grad_query, grad_norm_weight, grad_gate as a
// 0-dim fp32 tensor).
template <bool kIntoFloat>
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_into(
    const at::Tensor& grad_out, const at::Tensor& sources, const at::Tensor& query,
    const at::Tensor& norm_weight, const at::Tensor& weights, const at::Tensor& gate32, const Shape& s,
    double eps, at::Tensor& grad_sources, bool accumulate) {
  const at::Tensor dout = grad_out.contiguous();
  const at::Tensor w = weights.contiguous();
  const at::Tensor q = query.to(at::kFloat).contiguous();
  const at::Tensor g = norm_weight.to(at::kFloat).contiguous();
  at::Tensor grad_query = at::zeros({s.d}, sources.options().dtype(at::kFloat));
  at::Tensor grad_norm = at::zeros({s.d}, sources.options().dtype(at::kFloat));
  at::Tensor grad_gate = at::zeros({}, sources.options().dtype(at::kFloat));
  if (s.positions() > 0) {
    const bool vec8 = s.head_dim % 8 == 0 && aligned_for_vec8(sources) && aligned_for_vec8(q) &&
                      aligned_for_vec8(g) && aligned_for_vec8(dout) && aligned_for_vec8(grad_sources);
    const Plan plan = make_plan(s, vec8);
    const bool staged = staged_allowed("HEADWISE_MHAR_BWD_STAGED");
    [[maybe_unused]] const bool simt_products = sim_simt_products();  // the emulated build only
    const int64_t segments = bwd_segments(s.positions());
    at::Tensor z_partial = new_output({segments, s.d}, sources.options().dtype(at::kFloat));
    at::Tensor gate_partial = new_output({segments}, sources.options().dtype(at::kFloat));

    BwdParams p{};
    p.route = make_routing(sources, q, g, s, eps);
    p.grad_out = dout.data_ptr();
    p.weights = w.data_ptr<float>();
    p.grad_sources = grad_sources.data_ptr();
    p.accumulate = accumulate;
    p.gate = gate32.defined() ? gate32.data_ptr<float>() : nullptr;
    p.z_partial = z_partial.data_ptr<float>();
    p.gate_partial = gate_partial.data_ptr<float>();

    dispatch_storage_dtype(sources.scalar_type(), "mhar_route_backward", "sources", [&](auto tag) {
      using T = decltype(tag);
      using G = std::conditional_t<kIntoFloat, float, T>;
      const dim3 grid(static_cast<unsigned>(std::min(segments, kBwdMaxBlocks)));
      if constexpr (sizeof(T) == 2) {
        const bool warp_heads = s.head_dim / 8 == 64;
        const int64_t record = warp_heads ? bwd_record_floats<T, true>() : bwd_record_floats<T, false>();
        const int64_t staged_bytes = bwd_staged_smem_bytes(s.num_sources, s.heads, record, plan.threads);
        if (staged_fits(s, plan, staged, staged_bytes)) {
          auto kernel = warp_heads ? &mhar_route_bwd_staged_kernel<T, G, true> : &mhar_route_bwd_staged_kernel<T, G, false>;
          if constexpr (HW_SIM && std::is_same<T, c10::BFloat16>::value) {
            if (warp_heads && simt_products) kernel = &mhar_route_bwd_staged_kernel<T, G, true, true>;
          }
          hw::allow_dynamic_smem("mhar_route_backward", kernel, static_cast<size_t>(staged_bytes));
          HW_LAUNCH("mhar_route_bwd_staged", kernel, grid, dim3(plan.threads), static_cast<size_t>(staged_bytes), p);
          return;
        }
      }
      dispatch_plan<T>(plan, [&](auto cfg) {
        using C = decltype(cfg);
        auto kernel = &mhar_route_bwd_kernel<T, G, C::vec, C::items, C::rows, C::prefetch, C::mode>;
        const size_t base_bytes =
            static_cast<size_t>(bwd_smem_floats(plan.mode, C::vec, plan.nvec, C::rows, s.num_sources, s.heads,
                                                param_slice_floats(C::vec == 1, C::items, plan.threads, C::vec))) *
            sizeof(float);
        const size_t rows_bytes = static_cast<size_t>(s.num_sources) * C::items * plan.threads *
                                  sizeof(hw::Pack<T, C::vec>);
        p.stage_rows = base_bytes + rows_bytes <= static_cast<size_t>(kStageRowsBudget);
        const size_t smem_bytes = base_bytes + (p.stage_rows ? rows_bytes : 0);
        hw::allow_dynamic_smem("mhar_route_backward", kernel, smem_bytes);
        HW_LAUNCH("mhar_route_bwd", kernel, grid, dim3(plan.threads), smem_bytes, p);
      });
    });
    auto reduce = &mhar_param_grad_reduce_kernel;
    HW_LAUNCH("mhar_param_grad_reduce", reduce, dim3(static_cast<unsigned>((s.d + kReduceColumns - 1) / kReduceColumns)),
              dim3(kReduceColumns * kReduceLanes), 0,
              z_partial.data_ptr<float>(), gate_partial.data_ptr<float>(), segments, s.d, q.data_ptr<float>(),
              g.data_ptr<float>(), grad_query.data_ptr<float>(), grad_norm.data_ptr<float>(),
              grad_gate.data_ptr<float>());
  }
  return {grad_query.to(query.scalar_type()), grad_norm.to(norm_weight.scalar_type()), grad_gate};
}

}  // namespace

}  // namespace mhar
}  // namespace headwise
