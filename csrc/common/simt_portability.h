// The SIMT portability layer: kernel device code includes this header and is then
// compiled twice, by nvcc for the GPU and by the host compiler against the SIMT
// emulator of simt/ (SPEC section 6). Kernels use CUDA built-ins directly; the few
// things that differ between the two builds are wrapped here:
//   HW_SIM                    1 in the emulated build, 0 under nvcc
//   hw::dynamic_shared_memory  the block's dynamic shared buffer (128-byte aligned)
//   hw::allow_dynamic_smem(op, kernel, bytes)
//                             opt a kernel in to the dynamic smem a launch needs beyond
//                             48 KiB, after checking it against the device's limit
//   HW_LAUNCH(name, kernel, grid, block, smem_bytes, args...)
//                             check the grid against CUDA's limits, launch on the current
//                             stream and check the launch
#pragma once

#include "env_settings.h"

#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdlib>
#include <cstdint>

#if defined(__CUDACC__)

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <utility>

#define HW_SIM 0

namespace hw {
__device__ __forceinline__ unsigned char* dynamic_shared_memory() {
  extern __shared__ __align__(128) unsigned char hw_dynamic_shared[];
  return hw_dynamic_shared;
}

// The most dynamic shared memory a block may opt in to on the current device
// (cudaDevAttrMaxSharedMemoryPerBlockOptin: 227 KiB on sm_90/sm_100, 163 KiB on sm_80,
// 99 KiB on sm_86/89/120).
inline size_t max_dynamic_smem_optin() {
  int device = 0, limit = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return static_cast<size_t>(limit);
}

// The emulated build's switches (sim_flag below) do not exist here.
inline bool sim_flag(const char*) { return false; }

// The kernel's static __shared__ bytes (cudaFuncGetAttributes), which count against the
// same per-block limit as the dynamic bytes.
template <typename Kernel>
inline size_t static_smem_bytes(Kernel kernel) {
  cudaFuncAttributes attr{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  return attr.sharedSizeBytes;
}

// The kernel's opt-in only ever grows, to the largest launch so far on each device: a
// smaller launch never lowers the limit a concurrent launch from another host thread
// relies on.
template <typename Kernel>
inline void set_dynamic_smem_optin(Kernel kernel, size_t bytes) {
  static std::mutex mu;
  static std::map<std::pair<int, const void*>, size_t> opted;
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> guard(mu);
  size_t& have = opted[{device, reinterpret_cast<const void*>(kernel)}];
  if (bytes <= have) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  have = bytes;
}
}  // namespace hw

#define HW_LAUNCH(name, kernel, grid, block, smem_bytes, ...)                              \
  do {                                                                                     \
    ::hw::check_grid((name), (grid));                                                      \
    kernel<<<(grid), (block), (smem_bytes), at::cuda::getCurrentCUDAStream()>>>(__VA_ARGS__); \
    C10_CUDA_KERNEL_LAUNCH_CHECK();                                                        \
  } while (0)

#else  // emulated build

#include "simt/simt.h"

#include <tuple>

#define HW_SIM 1

namespace hw {
inline unsigned char* dynamic_shared_memory() { return hw_sim::dynamic_shared_memory(); }
// The emulated device has the sm_90 limit (hw_sim::launch enforces it too).
// HEADWISE_SIM_SMEM_OPTIN (bytes) lowers it to model a smaller part in tests (sm_80: 166912,
// sm_86/89/120: 101376); hw_sim::launch still enforces sm_90's.
inline size_t max_dynamic_smem_optin() {
  constexpr int64_t kSm90OptIn = 227 * 1024;
  return static_cast<size_t>(env_int("HEADWISE_SIM_SMEM_OPTIN", kSm90OptIn, 48 * 1024, kSm90OptIn));
}
// Whether the switch `name` is 1: a switch that makes the emulated build take a path the
// CUDA build takes always or on other hardware (HEADWISE_SIM_LIBRARY_GEMM,
// HEADWISE_SIM_MHAR_BWD_SIMT_PRODUCTS), so that the tests run it on the CPU.
inline bool sim_flag(const char* name) { return env_switch(name, false); }
template <typename Kernel>
inline size_t static_smem_bytes(Kernel) { return 0; }  // the emulator keeps __shared__ arrays apart
template <typename Kernel>
inline void set_dynamic_smem_optin(Kernel, size_t) {}
}  // namespace hw

// The arguments are evaluated once, on the host, as a CUDA launch does; every thread then
// calls the kernel with copies of them. The body lambda captures only the argument tuple
// (and the kernel if it is a variable), so std::function keeps it in its own storage on the
// launching thread's stack rather than on the heap: the profile library (simt_metrics.h)
// then does not count the threads' reads of it as global memory traffic.
#define HW_LAUNCH(name, kernel, grid, block, smem_bytes, ...)                                  \
  do {                                                                                         \
    ::hw::check_grid((name), (grid));                                                          \
    const auto hw_launch_args = std::make_tuple(__VA_ARGS__);                                  \
    ::hw_sim::launch((name), (grid), (block), (smem_bytes),                                    \
                     [&]() { std::apply(kernel, hw_launch_args); });                           \
  } while (0)

#endif

namespace hw {
// CUDA's grid limits: x < 2^31, y and z <= 65535. Shapes that exceed them are refused
// with the kernel's name before the launch.
inline void check_grid(const char* kernel, const dim3& grid) {
  TORCH_CHECK_VALUE(grid.x <= 2147483647u && grid.y <= 65535u && grid.z <= 65535u, "headwise: kernel '", kernel,
                    "' needs a grid of (", grid.x, ", ", grid.y, ", ", grid.z,
                    ") blocks, beyond CUDA's limits (2147483647, 65535, 65535)");
}

// Before launching `kernel` with `bytes` of dynamic shared memory for op `op`: checks the
// need, static __shared__ arrays included, against the device's opt-in limit, then opts the
// kernel in when the block's total is over the 48 KiB every kernel gets without opting in
// (without it, a 48 KiB dynamic request beside any static array fails to launch).
template <typename Kernel>
inline void allow_dynamic_smem(const char* op, Kernel kernel, size_t bytes) {
  constexpr size_t kDefaultLimit = 48 * 1024;
  const size_t total = bytes + static_smem_bytes(kernel);
  if (total <= kDefaultLimit) return;
  const size_t limit = max_dynamic_smem_optin();
  TORCH_CHECK_VALUE(total <= limit, "headwise.", op, ": needs ", bytes, " bytes of dynamic shared memory per block",
                    total > bytes ? " (plus its static arrays)" : "", ", more than this device's limit of ", limit,
                    " bytes");
  set_dynamic_smem_optin(kernel, bytes);
}
}  // namespace hw
