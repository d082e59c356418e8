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
  // Fused QKV projection (SPEC section 2). head_offsets: first packed row of every head
  // (num_q_heads q heads, then num_kv_heads k heads, then num_kv_heads v heads), derived
  // by headwise.QKVLayout; either head count may be 0 (q_project / kv_project).
  // rope_cos/rope_sin: [S, R] or [B, S, R] (per batch row), R even <= head_dim (R < head_dim:
  // partial rotary of the leading R dims); rope_style 0 rotate-half, 1 GPT-J interleaved pairs.
  // Returns head-major q, k, v and `packed`, the GEMM product x W^T + bias [B*S, N_total]
  // kept for the backward when a norm is applied (a 0-element tensor otherwise).
  m.def(
      "qkv_project(Tensor x, Tensor weight, Tensor? bias, int[] head_offsets, int num_q_heads, "
      "int num_kv_heads, int head_dim, int v_head_dim, Tensor? q_norm, Tensor? k_norm, float norm_eps, "
      "Tensor? rope_cos, Tensor? rope_sin, float scale_q, int rope_style=0) -> (Tensor, Tensor, Tensor, Tensor)",
      tags);
  // -> (grad_x, grad_weight, grad_bias, grad_q_norm, grad_k_norm); a gradient whose input
  // is absent is a 0-element tensor.
  m.def(
      "qkv_project_backward(Tensor grad_q, Tensor grad_k, Tensor grad_v, Tensor x, Tensor weight, "
      "Tensor? bias, Tensor packed, int[] head_offsets, int num_q_heads, int num_kv_heads, int head_dim, "
      "int v_head_dim, Tensor? q_norm, Tensor? k_norm, float norm_eps, Tensor? rope_cos, Tensor? rope_sin, "
      "float scale_q, int rope_style=0) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
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
  // DCMHA (SPEC section 5). Weights: w1, w2 [B, T, 4, R=2, H], g [B, T, 4, H] in the
  // dtype of a / q. slot: 0 = pre (compose slots c = 0, 1), 1 = post (c = 2, 3).
  m.def("dcmha_compose(Tensor a, Tensor w1, Tensor w2, Tensor g, int slot, int head_groups) -> Tensor", tags);
  // -> (grad_a, grad_w1, grad_w2, grad_g); weight grads are zero in the slots not used.
  m.def(
      "dcmha_compose_backward(Tensor grad, Tensor a, Tensor w1, Tensor w2, Tensor g, int slot, "
      "int head_groups) -> (Tensor, Tensor, Tensor, Tensor)",
      tags);
  // Fused two-pass attention. window 0 = none. -> (out [B, H, T, dv], stats [2, B, H, T]:
  // per-head row max and sum of the pre-composed masked logits, fp32 (fp64 for fp64)).
  m.def(
      "dcmha_attention(Tensor q, Tensor k, Tensor v, Tensor w1, Tensor w2, Tensor g, bool causal, "
      "int window, float scale, int head_groups) -> (Tensor, Tensor)",
      tags);
  // -> (grad_q, grad_k, grad_v, grad_w1, grad_w2, grad_g)
  m.def(
      "dcmha_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor w1, Tensor w2, "
      "Tensor g, Tensor stats, bool causal, int window, float scale, int head_groups) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
      tags);
  // Sample tensor-core GEMM (csrc/gemm): c [M, N] = a [M, K] @ b [N, K]^T, bf16 / f16,
  // fp32 accumulation. CUDA and emulated backends only.
  m.def("sample_gemm(Tensor a, Tensor b) -> Tensor", tags);
}

}  // namespace headwise
