// Argument validation of head_merge and head_merge_backward, shared by the CPU, CUDA and
// emulated entries so that every backend rejects the same calls with the same words.
#pragma once

#include "../common/checks.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

namespace headwise {
namespace merge {

struct Shape {
  int64_t batch, heads, seq, dv, d;  // z [B, H, Q, Dv], weight_o [D, H*Dv]
  int64_t k() const { return heads * dv; }
  int64_t rows() const { return batch * seq; }
};

// Accumulation / gate dtype: fp32, fp64 for fp64 z (CPU gradcheck).
inline at::ScalarType acc_dtype(const at::Tensor& z) {
  return z.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

inline Shape check_merge_args(const char* op, const at::Tensor& z, const at::Tensor& weight_o,
                              const c10::optional<at::Tensor>& head_gate) {
  check_dim(op, z, "z", 4);
  check_float_dtype(op, z, "z");
  check_last_dim_contiguous(op, z, "z");
  Shape s{z.size(0), z.size(1), z.size(2), z.size(3), 0};
  TORCH_CHECK_VALUE(s.heads >= 1 && s.dv >= 1, "headwise.", op,
                    ": z must be [B, H, Q, Dv] with H >= 1 and Dv >= 1, got shape ", shape_str(z));
  check_dim(op, weight_o, "weight_o", 2);
  check_same_dtype(op, weight_o, "weight_o", z, "z");
  check_same_device(op, weight_o, "weight_o", z, "z");
  check_size(op, weight_o, "weight_o", 1, s.k(), "H*Dv of z");
  check_last_dim_contiguous(op, weight_o, "weight_o");
  s.d = weight_o.size(0);
  TORCH_CHECK_VALUE(s.d >= 1, "headwise.", op, ": weight_o must have at least one row (D_model), got shape ",
                    shape_str(weight_o));
  if (head_gate.has_value()) {
    const at::Tensor& g = *head_gate;
    TORCH_CHECK_VALUE((g.dim() == 1 && g.size(0) == s.heads) ||
                          (g.dim() == 2 && g.size(0) == s.batch && g.size(1) == s.heads),
                      "headwise.", op, ": head_gate must be [H] = [", s.heads, "] or [B, H] = [", s.batch,
                      ", ", s.heads, "], got shape ", shape_str(g));
    TORCH_CHECK_TYPE(g.scalar_type() == at::kFloat || g.scalar_type() == z.scalar_type(), "headwise.", op,
                     ": head_gate must be float32 or the dtype of z (", z.scalar_type(), "), got ",
                     g.scalar_type());
    check_same_device(op, g, "head_gate", z, "z");
  }
  return s;
}

inline void check_bias(const char* op, const at::Tensor& bias, const at::Tensor& z, const Shape& s) {
  check_dim(op, bias, "bias", 1);
  check_size(op, bias, "bias", 0, s.d, "D_model, dim 0 of weight_o");
  check_same_dtype(op, bias, "bias", z, "z");
  check_same_device(op, bias, "bias", z, "z");
}

inline void check_grad_out(const char* op, const at::Tensor& grad_out, const at::Tensor& z, const Shape& s) {
  check_dim(op, grad_out, "grad_out", 3);
  check_size(op, grad_out, "grad_out", 0, s.batch, "B of z");
  check_size(op, grad_out, "grad_out", 1, s.seq, "Q of z");
  check_size(op, grad_out, "grad_out", 2, s.d, "D_model of weight_o");
  check_same_dtype(op, grad_out, "grad_out", z, "z");
  check_same_device(op, grad_out, "grad_out", z, "z");
}

// A fresh tensor in z's layout: at::empty_like's preserve format, i.e. z's own strides
// when z is non-overlapping and dense (e.g. a transposed view of [B, Q, H, Dv] memory),
// else the suggested (contiguous) layout; the fake kernel in ops.py calls
// torch.empty_like, the same rule. The kernels need a stride-1 last dim.
inline at::Tensor empty_like_layout(const at::Tensor& z, const at::TensorOptions& options) {
  at::Tensor t = at::empty_like(z, options);
  if (t.size(-1) > 1 && t.stride(-1) != 1) t = at::empty(z.sizes(), options);
  return t;
}

}  // namespace merge
}  // namespace headwise
