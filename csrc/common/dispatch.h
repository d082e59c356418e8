// Storage-dtype dispatch for kernels that accumulate in fp32: calls f(T{}) with T one of
// float, c10::BFloat16, c10::Half, and rejects anything else naming the argument.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

namespace headwise {

template <typename F>
void dispatch_storage_dtype(at::ScalarType dtype, const char* op, const char* arg, F&& f) {
  switch (dtype) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default:
      TORCH_CHECK_TYPE(false, "headwise.", op, ": ", arg,
                       " must be float32, bfloat16 or float16 on this backend, got ", dtype);
  }
}

}  // namespace headwise
