// The SIMT portability layer: kernel device code includes this header and is then
// compiled twice, by nvcc for the GPU and by the host compiler against the SIMT
// emulator of simt/ (SPEC section 6). Kernels use CUDA built-ins directly; the few
// things that differ between the two builds are wrapped here:
//   HW_SIM                    1 in the emulated build, 0 under nvcc
//   hw::dynamic_shared_memory  the block's dynamic shared buffer (128-byte aligned)
//   hw::allow_dynamic_smem    opt a kernel in to more than 48 KiB of dynamic smem
//   HW_LAUNCH(name, kernel, grid, block, smem_bytes, args...)
//                             launch on the current stream and check the launch
#pragma once

#if defined(__CUDACC__)

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#define HW_SIM 0

namespace hw {
__device__ __forceinline__ unsigned char* dynamic_shared_memory() {
  extern __shared__ __align__(128) unsigned char hw_dynamic_shared[];
  return hw_dynamic_shared;
}

template <typename Kernel>
inline void allow_dynamic_smem(Kernel kernel, size_t bytes) {
  if (bytes > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(bytes)));
  }
}
}  // namespace hw

#define HW_LAUNCH(name, kernel, grid, block, smem_bytes, ...)                              \
  do {                                                                                     \
    kernel<<<(grid), (block), (smem_bytes), at::cuda::getCurrentCUDAStream()>>>(__VA_ARGS__); \
    C10_CUDA_KERNEL_LAUNCH_CHECK();                                                        \
  } while (0)

#else  // emulated build

#include "simt/simt.h"

#define HW_SIM 1

namespace hw {
inline unsigned char* dynamic_shared_memory() { return hw_sim::dynamic_shared_memory(); }
template <typename Kernel>
inline void allow_dynamic_smem(Kernel, size_t) {}  // the emulator checks the 227 KiB limit
}  // namespace hw

#define HW_LAUNCH(name, kernel, grid, block, smem_bytes, ...) \
  ::hw_sim::launch((name), (grid), (block), (smem_bytes), [&]() { kernel(__VA_ARGS__); })

#endif
