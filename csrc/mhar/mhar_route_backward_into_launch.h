// The backward entry route_backward_into (mhar_ops.h) of the CUDA and emulated backends
// (mhar_launch.h): grad_sources stored into, or added to, a DepthBuffer's fp32 rows.
#pragma once

#include "mhar_bwd_launch.h"

namespace headwise {
namespace mhar {

std::tuple<at::Tensor, at::Tensor> HW_MHAR_ENTRY(route_backward_into)(
    const at::Tensor& grad_out, const at::Tensor& sources, const at::Tensor& query,
    const at::Tensor& norm_weight, const at::Tensor& weights, at::Tensor& grad_sources,
    int64_t num_heads, int64_t num_sources, double eps, bool accumulate) {
  HW_OP_RANGE("headwise::mhar_route_backward_into");
  const Shape s = check_route_args(sources, query, norm_weight, num_heads, num_sources, eps);
  check_backend(sources, s, "mhar_route_backward_into");
  check_backward_args(grad_out, sources, weights, s);
  check_grad_buffer(grad_sources, sources, at::kFloat);
  const at::OptionalDeviceGuard device_guard(sources.device());
  const auto grads = backward_into<true>(grad_out, sources, query, norm_weight, weights, at::Tensor(), s, eps,
                                         grad_sources, accumulate);
  return {std::get<0>(grads), std::get<1>(grads)};
}

}  // namespace mhar
}  // namespace headwise
