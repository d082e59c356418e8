// Every op schema of headwise, declared once. The op library registers them as
// torch.ops.headwise (registration.cpp); the emulated library registers the same
// schemas as torch.ops.headwise_sim (register_sim.cpp).
#pragma once

#include <torch/library.h>

namespace headwise {

inline void define_schemas(torch::Library& m) {
  const std::vector<at::Tag> tags{at::Tag::pt2_compliant_tag};
  m.def(
      "mhar_route(Tensor sources, Tensor query, Tensor norm_weight, int num_heads, "
      "int num_sources, float eps, Tensor? residual, Tensor? gate) -> (Tensor, Tensor)",
      tags);
  m.def(
      "mhar_route_backward(Tensor grad_out, Tensor sources, Tensor query, Tensor norm_weight, "
      "Tensor weights, Tensor? gate, int num_heads, int num_sources, float eps) "
      "-> (Tensor, Tensor, Tensor, Tensor)",
      tags);
  m.def(
      "mhar_route_backward_into(Tensor grad_out, Tensor sources, Tensor query, Tensor norm_weight, "
      "Tensor weights, Tensor(a!) grad_sources, int num_heads, int num_sources, float eps, "
      "bool accumulate) -> (Tensor, Tensor)",
      tags);
  // Head merge (SPEC section 3): out [B, Q, D]; z_norm, out_norm [B, Q, H] float32 when
  // return_stats, else empty [0].
  m.def(
      "head_merge(Tensor z, Tensor weight_o, Tensor? bias, Tensor? head_gate, bool rescale, "
      "bool return_stats) -> (Tensor, Tensor, Tensor)",
      tags);
  // -> (grad_z in z's strides, grad_weight_o, grad_bias [D] (empty [0] without bias_grad),
  //     grad_head_gate in head_gate's shape and dtype (empty [0] without gate_grad))
  m.def(
      "head_merge_backward(Tensor grad_out, Tensor z, Tensor weight_o, Tensor? head_gate, "
      "bool rescale, bool bias_grad, bool gate_grad) -> (Tensor, Tensor, Tensor, Tensor)",
      tags);
}

}  // namespace headwise
