// A scoped profiler range at each op entry, named `headwise::<op>`: an NVTX range
// (visible in nsys/ncu) in CUDA builds, and a torch.profiler record everywhere.
#pragma once

#include <ATen/record_function.h>

#if defined(HEADWISE_WITH_NVTX)
#include <nvtx3/nvToolsExt.h>
#endif

namespace headwise {

class OpRange {
 public:
  explicit OpRange(const char* name) {
#if defined(HEADWISE_WITH_NVTX)
    nvtxRangePushA(name);
#else
    (void)name;
#endif
  }
  ~OpRange() {
#if defined(HEADWISE_WITH_NVTX)
    nvtxRangePop();
#endif
  }
  OpRange(const OpRange&) = delete;
  OpRange& operator=(const OpRange&) = delete;
};

}  // namespace headwise

// `name` is a string literal such as "headwise::mhar_route".
#define HW_OP_RANGE(name)                      \
  ::headwise::OpRange hw_op_range_guard{name}; \
  RECORD_FUNCTION(name, std::vector<c10::IValue>())
