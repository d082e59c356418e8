// Entry points of the MHAR ops, one pair per backend; registered in csrc/register_*.
// Schemas (csrc/schemas.h):
//   mhar_route(sources, query, norm_weight, num_heads, num_sources, eps, residual, gate)
//       -> (out [B, T, d] in the sources' dtype, weights [N, B, T, H])
//       out = residual + gate * mix (each optional; gate has one element)
//   mhar_route_backward(grad_out, sources, query, norm_weight, weights, gate, num_heads,
//       num_sources, eps) -> (grad_sources [N_max, B, T, d], grad_query, grad_norm_weight,
//       grad_gate = <grad_out, mix>: gate's shape and dtype, 0-dim in the weights' dtype
//       when gate is None)
//   mhar_route_backward_into(grad_out, sources, query, norm_weight, weights, grad_sources!,
//       num_heads, num_sources, eps, accumulate) -> (grad_query, grad_norm_weight)
//       stores (or with accumulate adds) the source gradients into rows [0, N) of the
//       fp32 buffer grad_sources (fp64 for fp64 sources on the CPU): DepthBuffer's backward
// weights are float32 (float64 for float64 sources on the CPU backend).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <tuple>

namespace headwise {
namespace mhar {

#define HW_MHAR_DECLARE(suffix)                                                              \
  std::tuple<at::Tensor, at::Tensor> route_##suffix(                                         \
      const at::Tensor& sources, const at::Tensor& query, const at::Tensor& norm_weight,     \
      int64_t num_heads, int64_t num_sources, double eps,                                    \
      const c10::optional<at::Tensor>& residual, const c10::optional<at::Tensor>& gate);     \
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> route_backward_##suffix(        \
      const at::Tensor& grad_out, const at::Tensor& sources, const at::Tensor& query,        \
      const at::Tensor& norm_weight, const at::Tensor& weights,                              \
      const c10::optional<at::Tensor>& gate, int64_t num_heads, int64_t num_sources,         \
      double eps);                                                                           \
  std::tuple<at::Tensor, at::Tensor> route_backward_into_##suffix(                           \
      const at::Tensor& grad_out, const at::Tensor& sources, const at::Tensor& query,        \
      const at::Tensor& norm_weight, const at::Tensor& weights, at::Tensor& grad_sources,    \
      int64_t num_heads, int64_t num_sources, double eps, bool accumulate);

HW_MHAR_DECLARE(cpu)
HW_MHAR_DECLARE(cuda)
HW_MHAR_DECLARE(sim)

#undef HW_MHAR_DECLARE

}  // namespace mhar
}  // namespace headwise
