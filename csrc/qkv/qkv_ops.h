// Entry points of the fused QKV projection, one pair per backend; registered in
// csrc/register_*. Schemas (csrc/schemas.h):
//   qkv_project(x, weight, bias?, head_offsets, num_q_heads, num_kv_heads, head_dim,
//       v_head_dim, q_norm?, k_norm?, norm_eps, rope_cos?, rope_sin?, scale_q, rope_style)
//       -> (q [B, Hq, S, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv], packed)
//   qkv_project_backward(grad_q, grad_k, grad_v, x, weight, bias?, packed, head_offsets, ...)
//       -> (grad_x, grad_weight, grad_bias, grad_q_norm, grad_k_norm)
// `packed` is the bias-free product x @ weight^T [B*S, N_total] when a norm is applied
// (the backward recomputes the norm statistic from it), else a 0-element tensor.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <tuple>

namespace headwise {
namespace qkv {

#define HW_QKV_DECLARE(suffix)                                                                       \
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> project_##suffix(                       \
      const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,          \
      at::IntArrayRef head_offsets, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,     \
      int64_t v_head_dim, const c10::optional<at::Tensor>& q_norm,                                   \
      const c10::optional<at::Tensor>& k_norm, double norm_eps,                                      \
      const c10::optional<at::Tensor>& rope_cos, const c10::optional<at::Tensor>& rope_sin,          \
      double scale_q, int64_t rope_style);                                                           \
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> project_backward_##suffix( \
      const at::Tensor& grad_q, const at::Tensor& grad_k, const at::Tensor& grad_v,                  \
      const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,          \
      const at::Tensor& packed, at::IntArrayRef head_offsets, int64_t num_q_heads,                   \
      int64_t num_kv_heads, int64_t head_dim, int64_t v_head_dim,                                    \
      const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm,              \
      double norm_eps, const c10::optional<at::Tensor>& rope_cos,                                    \
      const c10::optional<at::Tensor>& rope_sin, double scale_q, int64_t rope_style);

HW_QKV_DECLARE(cpu)
HW_QKV_DECLARE(cuda)
HW_QKV_DECLARE(sim)

#undef HW_QKV_DECLARE

}  // namespace qkv
}  // namespace headwise
