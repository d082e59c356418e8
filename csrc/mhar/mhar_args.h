// Argument validation of mhar_route and mhar_route_backward, shared by the CPU, CUDA and
// emulated entries so that every backend rejects the same calls with the same words.
#pragma once

#include "../common/checks.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

namespace headwise {
namespace mhar {

struct Shape {
  int64_t max_sources, batch, seq, d, heads, head_dim, num_sources;
  int64_t positions() const { return batch * seq; }
};

// Routing weights are float32, or float64 for float64 sources (gradcheck precision).
inline at::ScalarType weights_dtype(const at::Tensor& sources) {
  return sources.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

inline Shape check_route_args(const at::Tensor& sources, const at::Tensor& query,
                              const at::Tensor& norm_weight, int64_t num_heads,
                              int64_t num_sources, double eps) {
  constexpr const char* op = "mhar_route";
  check_dim(op, sources, "sources", 4);
  check_float_dtype(op, sources, "sources");
  check_last_dim_contiguous(op, sources, "sources");
  Shape s{sources.size(0), sources.size(1), sources.size(2), sources.size(3), num_heads, 0,
          num_sources};
  TORCH_CHECK_VALUE(s.d > 0, "headwise.mhar_route: sources must have a non-empty last dim (d), got shape ",
                    shape_str(sources));
  TORCH_CHECK_VALUE(num_sources >= 1, "headwise.mhar_route: num_sources must be at least 1, got ",
                    num_sources, " (routing needs at least one source)");
  TORCH_CHECK_VALUE(num_sources <= s.max_sources, "headwise.mhar_route: num_sources (", num_sources,
                    ") exceeds the rows of sources (", s.max_sources, ")");
  TORCH_CHECK_VALUE(num_heads >= 1 && s.d % num_heads == 0,
                    "headwise.mhar_route: num_heads must be a positive divisor of d = ", s.d,
                    ", got ", num_heads);
  TORCH_CHECK_VALUE(eps > 0.0, "headwise.mhar_route: eps must be positive, got ", eps);
  s.head_dim = s.d / num_heads;
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{query, "query"},
                                {norm_weight, "norm_weight"}}) {
    check_dim(op, t, name, 1);
    check_size(op, t, name, 0, s.d, "d, the last dim of sources");
    check_same_device(op, t, name, sources, "sources");
    TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat || t.scalar_type() == sources.scalar_type(),
                     "headwise.mhar_route: ", name, " must be float32 or the dtype of sources (",
                     sources.scalar_type(), "), got ", t.scalar_type());
  }
  return s;
}

// t must be shaped and typed like the output: [B, T, d] in the sources' dtype and device.
inline void check_like_output(const char* op, const at::Tensor& t, const char* name,
                              const at::Tensor& sources, const Shape& s) {
  check_dim(op, t, name, 3);
  check_size(op, t, name, 0, s.batch, "B of sources");
  check_size(op, t, name, 1, s.seq, "T of sources");
  check_size(op, t, name, 2, s.d, "d of sources");
  check_same_dtype(op, t, name, sources, "sources");
  check_same_device(op, t, name, sources, "sources");
}

inline void check_residual(const at::Tensor& residual, const at::Tensor& sources, const Shape& s) {
  constexpr const char* op = "mhar_route";
  check_like_output(op, residual, "residual", sources, s);
  check_last_dim_contiguous(op, residual, "residual");
}

// The delta-mode gate: one element, float32 or the sources' dtype, on the sources' device.
inline void check_gate(const char* op, const at::Tensor& gate, const at::Tensor& sources) {
  TORCH_CHECK_VALUE(gate.numel() == 1, "headwise.", op, ": gate must have exactly one element, got shape ",
                    shape_str(gate));
  TORCH_CHECK_TYPE(gate.scalar_type() == at::kFloat || gate.scalar_type() == sources.scalar_type(),
                   "headwise.", op, ": gate must be float32 or the dtype of sources (", sources.scalar_type(),
                   "), got ", gate.scalar_type());
  check_same_device(op, gate, "gate", sources, "sources");
}

inline void check_backward_args(const at::Tensor& grad_out, const at::Tensor& sources,
                                const at::Tensor& weights, const Shape& s) {
  constexpr const char* op = "mhar_route_backward";
  check_like_output(op, grad_out, "grad_out", sources, s);
  check_dim(op, weights, "weights", 4);
  TORCH_CHECK_TYPE(weights.scalar_type() == weights_dtype(sources),
                   "headwise.mhar_route_backward: weights must be ", weights_dtype(sources),
                   " for ", sources.scalar_type(), " sources, got ", weights.scalar_type());
  check_size(op, weights, "weights", 0, s.num_sources, "num_sources");
  check_size(op, weights, "weights", 1, s.batch, "B of sources");
  check_size(op, weights, "weights", 2, s.seq, "T of sources");
  check_size(op, weights, "weights", 3, s.heads, "num_heads");
  check_same_device(op, weights, "weights", sources, "sources");
}

// The shared gradient buffer of mhar_route_backward_into: contiguous, shaped like the
// sources, of dtype `dtype` (fp32; fp64 for fp64 sources on the CPU backend).
inline void check_grad_buffer(const at::Tensor& grad_sources, const at::Tensor& sources, at::ScalarType dtype) {
  constexpr const char* op = "mhar_route_backward_into";
  TORCH_CHECK_VALUE(grad_sources.sizes() == sources.sizes(), "headwise.", op,
                    ": grad_sources must have the shape of sources ", shape_str(sources), ", got ",
                    shape_str(grad_sources));
  TORCH_CHECK_TYPE(grad_sources.scalar_type() == dtype, "headwise.", op, ": grad_sources must be ", dtype,
                   ", got ", grad_sources.scalar_type());
  check_same_device(op, grad_sources, "grad_sources", sources, "sources");
  TORCH_CHECK_VALUE(grad_sources.is_contiguous(), "headwise.", op, ": grad_sources must be contiguous");
}

}  // namespace mhar
}  // namespace headwise
