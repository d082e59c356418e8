// Entry points of the DCMHA ops (SPEC section 5), one set per backend; registered in
// csrc/register_*. Schemas (csrc/schemas.h):
//   dcmha_compose(a [B,H,T,T], w1 [B,T,4,R,H], w2 [B,T,4,R,H], g [B,T,4,H], slot, head_groups)
//       -> a' [B,H,T,T] in a's dtype; slot 0 = pre (c = 0, 1), 1 = post (c = 2, 3)
//   dcmha_compose_backward(grad, a, w1, w2, g, slot, head_groups)
//       -> (grad_a, grad_w1, grad_w2, grad_g): weight grads shaped like the weights, zero
//          in the two slots the op does not use
//   dcmha_attention(q, k, v [B,H,T,dh|dv], w1, w2, g, causal, window, scale, head_groups)
//       -> (out [B,H,T,dv], stats [2,B,H,T] fp32/fp64: per-head row max and sum of the
//          pre-composed masked logits); window 0 = none
//   dcmha_attention_backward(grad_out, q, k, v, w1, w2, g, stats, causal, window, scale,
//       head_groups) -> (grad_q, grad_k, grad_v, grad_w1, grad_w2, grad_g)
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace headwise {
namespace dcmha {

#define HW_DCMHA_DECLARE(suffix)                                                                   \
  at::Tensor compose_##suffix(const at::Tensor& a, const at::Tensor& w1, const at::Tensor& w2,     \
                              const at::Tensor& g, int64_t slot, int64_t head_groups);             \
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> compose_backward_##suffix(            \
      const at::Tensor& grad, const at::Tensor& a, const at::Tensor& w1, const at::Tensor& w2,     \
      const at::Tensor& g, int64_t slot, int64_t head_groups);                                     \
  std::tuple<at::Tensor, at::Tensor> attention_##suffix(                                           \
      const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& w1,         \
      const at::Tensor& w2, const at::Tensor& g, bool causal, int64_t window, double scale,        \
      int64_t head_groups);                                                                        \
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>               \
      attention_backward_##suffix(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, \
                                  const at::Tensor& v, const at::Tensor& w1, const at::Tensor& w2, \
                                  const at::Tensor& g, const at::Tensor& stats, bool causal,       \
                                  int64_t window, double scale, int64_t head_groups);

HW_DCMHA_DECLARE(cpu)
HW_DCMHA_DECLARE(cuda)
HW_DCMHA_DECLARE(sim)

#undef HW_DCMHA_DECLARE


}  // namespace dcmha
}  // namespace headwise
