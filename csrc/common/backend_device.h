// The backend a launch header (csrc/<family>/*_launch.h) is compiled for: the CUDA op
// library (nvcc, *_cuda.cu) or the emulated library (host compiler against the SIMT
// emulator, *_sim.cpp). Entries are named HW_BACKEND_ENTRY(name) -> name_cuda / name_sim,
// and tensors are checked with hw::on_backend_device, whose refusal says
// hw::kBackendDevice.
#pragma once

#include "simt_portability.h"

#include <ATen/core/Tensor.h>

#if HW_SIM
#define HW_BACKEND_ENTRY(name) name##_sim
#else
#define HW_BACKEND_ENTRY(name) name##_cuda
#endif

namespace hw {
#if HW_SIM
inline constexpr const char* kBackendDevice =
    "the emulated CUDA backend (torch.ops.headwise_sim) takes CPU tensors";
inline bool on_backend_device(const at::Tensor& t) { return t.device().is_cpu(); }
#else
inline constexpr const char* kBackendDevice = "the CUDA backend takes CUDA tensors";
inline bool on_backend_device(const at::Tensor& t) { return t.is_cuda(); }
#endif
}  // namespace hw
