// The backward entry route_backward (mhar_ops.h) of the CUDA and emulated backends
// (mhar_launch.h): grad_sources as a new tensor of the sources' dtype.
#pragma once

#include "mhar_bwd_launch.h"
#include "mhar_param_grad_reduce_kernel.cuh"

namespace headwise {
namespace mhar {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> HW_MHAR_ENTRY(route_backward)(
    const at::Tensor& grad_out, const at::Tensor& sources, const at::Tensor& query,
    const at::Tensor& norm_weight, const at::Tensor& weights, const c10::optional<at::Tensor>& gate,
    int64_t num_heads, int64_t num_sources, double eps) {
  HW_OP_RANGE("headwise::mhar_route_backward");
  const Shape s = check_route_args(sources, query, norm_weight, num_heads, num_sources, eps);
  check_backend(sources, s, "mhar_route_backward");
  check_backward_args(grad_out, sources, weights, s);
  if (gate.has_value()) check_gate("mhar_route_backward", *gate, sources);
  const at::OptionalDeviceGuard device_guard(sources.device());
  at::Tensor grad_sources = new_output(sources.sizes(), sources.options());
  if (s.num_sources < s.max_sources) grad_sources.narrow(0, s.num_sources, s.max_sources - s.num_sources).zero_();
  auto [grad_query, grad_norm, grad_gate] = backward_into<false>(
      grad_out, sources, query, norm_weight, weights, gate_as_float(gate), s, eps, grad_sources, false);
  if (gate.has_value()) grad_gate = grad_gate.to(gate->scalar_type()).reshape(gate->sizes());
  return {grad_sources, grad_query, grad_norm, grad_gate};
}

}  // namespace mhar
}  // namespace headwise
