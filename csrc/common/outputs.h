// Output allocation. With HEADWISE_POISON_OUTPUTS=1 in the environment (the test suite
// sets it) every output is filled with NaN before the kernel runs, so an element a
// kernel forgets to write shows up as NaN instead of as stale memory that happens to
// hold the right value.
#pragma once

#include "env_settings.h"

#include <ATen/ATen.h>

#include <limits>

namespace headwise {

inline bool poison_outputs() {
  static const bool enabled = hw::env_switch("HEADWISE_POISON_OUTPUTS", false);
  return enabled;
}

inline at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor t = at::empty(sizes, options);
  if (poison_outputs()) t.fill_(std::numeric_limits<double>::quiet_NaN());
  return t;
}

}  // namespace headwise
