// Argument checks shared by every op entry. Each failure names the argument, the
// expectation and what was received, so a user can fix the call without a debugger.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <string>

namespace headwise {

inline std::string shape_str(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) {
    if (i) s += ", ";
    s += std::to_string(t.size(i));
  }
  return s + "]";
}

// `op`: the op's public name; `arg`: the argument's name as the user wrote it.
inline void check_dim(const char* op, const at::Tensor& t, const char* arg, int64_t dim) {
  TORCH_CHECK_VALUE(t.dim() == dim, "headwise.", op, ": ", arg, " must be ", dim,
                    "-D, got shape ", shape_str(t));
}

inline void check_size(const char* op, const at::Tensor& t, const char* arg, int64_t dim,
                       int64_t expected, const char* what) {
  TORCH_CHECK_VALUE(t.size(dim) == expected, "headwise.", op, ": ", arg, " dim ", dim,
                    " must equal ", what, " (", expected, "), got shape ", shape_str(t));
}

inline void check_float_dtype(const char* op, const at::Tensor& t, const char* arg) {
  const auto dt = t.scalar_type();
  TORCH_CHECK_TYPE(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf || dt == at::kDouble,
                   "headwise.", op, ": ", arg,
                   " must be float32, bfloat16, float16 or float64, got ", dt);
}

inline void check_same_dtype(const char* op, const at::Tensor& t, const char* arg,
                             const at::Tensor& ref, const char* ref_arg) {
  TORCH_CHECK_TYPE(t.scalar_type() == ref.scalar_type(), "headwise.", op, ": ", arg,
                   " must have the dtype of ", ref_arg, " (", ref.scalar_type(), "), got ",
                   t.scalar_type());
}

inline void check_same_device(const char* op, const at::Tensor& t, const char* arg,
                              const at::Tensor& ref, const char* ref_arg) {
  TORCH_CHECK(t.device() == ref.device(), "headwise.", op, ": ", arg, " is on ", t.device(),
              " but ", ref_arg, " is on ", ref.device(), "; all tensors must share one device");
}

inline void check_last_dim_contiguous(const char* op, const at::Tensor& t, const char* arg) {
  TORCH_CHECK_VALUE(t.size(-1) <= 1 || t.stride(-1) == 1, "headwise.", op, ": ", arg,
                    " must have a stride-1 last dim, got strides ", t.strides());
}

}  // namespace headwise
