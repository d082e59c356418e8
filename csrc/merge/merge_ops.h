// Entry points of the head-merge ops, one set per backend; registered in csrc/register_*.
// Schemas (csrc/schemas.h):
//   head_merge(z, weight_o, bias, head_gate, rescale, return_stats) -> (out, z_norm, out_norm)
//       z [B, H, Q, Dv] (any strides, stride-1 last dim, read in place), weight_o [D, H*Dv]
//       (stride-1 rows), bias [D]?, head_gate [H] or [B, H]? (float32 or z's dtype).
//       out [B, Q, D] = s[b] * sum_h g[b,h] Z[b,h] @ W_h^T + bias in z's dtype, with
//       s[b] = min(H, H / sum_h g[b,h]) when rescale (H when sum_h g <= 1), else 1.
//       A head with g[b,h] == 0 is skipped for batch row b (no reads of its Z, no FLOPs).
//       z_norm / out_norm [B, Q, H] float32 = ||Z[b,h,q]|| and ||Z[b,h,q] @ W_h^T||
//       (ungated: neither g nor s applied); 0 for a closed head. Empty [0] without stats.
//   head_merge_backward(grad_out, z, weight_o, head_gate, rescale, bias_grad, gate_grad)
//       -> (grad_z in z's layout, grad_weight_o, grad_bias or empty, grad_head_gate or empty)
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <tuple>

namespace headwise {
namespace merge {

#define HW_MERGE_DECLARE(suffix)                                                                \
  std::tuple<at::Tensor, at::Tensor, at::Tensor> head_merge_##suffix(                           \
      const at::Tensor& z, const at::Tensor& weight_o, const c10::optional<at::Tensor>& bias,   \
      const c10::optional<at::Tensor>& head_gate, bool rescale, bool return_stats);             \
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> head_merge_backward_##suffix(      \
      const at::Tensor& grad_out, const at::Tensor& z, const at::Tensor& weight_o,              \
      const c10::optional<at::Tensor>& head_gate, bool rescale, bool bias_grad, bool gate_grad);

HW_MERGE_DECLARE(cpu)
HW_MERGE_DECLARE(cuda)
HW_MERGE_DECLARE(sim)

#undef HW_MERGE_DECLARE

}  // namespace merge
}  // namespace headwise
