// Thread block clusters (sm_90) with one spelling for both builds of a kernel:
// cooperative_groups::this_cluster() and cudaLaunchKernelEx under nvcc, the SIMT
// emulator's co-resident cluster scheduler in the emulated build.
//
//   hw::cluster_ctarank()           %cluster_ctarank: x + y*cx + z*cx*cy of the CTA in its cluster
//   hw::cluster_num_ctas()          %cluster_nctarank: cx * cy * cz
//   hw::cluster_sync()              barrier.cluster.arrive + barrier.cluster.wait: every thread
//                                   of every CTA of the cluster arrives; shared-memory writes
//                                   before it are visible cluster-wide after it
//   hw::cluster_map_shared(p, r)    mapa: the address of shared variable p in the CTA of rank r
//                                   (distributed shared memory, read and written directly)
//   HW_LAUNCH_CLUSTER(name, kernel, grid, block, cluster, smem_bytes, args...)
//                                   launch with a cluster shape (grid a multiple of it, at
//                                   most 8 CTAs) on the current stream, checked
// The device functions need sm_90: compiled for an older arch they trap (so sm_80 builds).
// In the emulated build a cluster's CTAs run interleaved on one OS thread: their static
// __shared__ variables would alias, so cluster kernels keep shared data in the dynamic
// shared memory (hw::dynamic_shared_memory()), which is per CTA. A CTA must not exit while
// a peer may still access its shared memory (end with hw::cluster_sync()); the emulator
// keeps every CTA's buffer alive until the whole cluster is done and cannot flag that race.
#pragma once

#include "simt_portability.h"

#if !HW_SIM
#include <cooperative_groups.h>
#endif

namespace hw {

#if !HW_SIM && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define HW_CLUSTER_PTX 1
#else
#define HW_CLUSTER_PTX 0
#endif

__device__ __forceinline__ unsigned cluster_ctarank() {
#if HW_SIM
  return hw_sim::detail::cluster_ctarank();
#elif HW_CLUSTER_PTX
  return cooperative_groups::this_cluster().block_rank();
#else
  __trap();
  return 0;
#endif
}

__device__ __forceinline__ unsigned cluster_num_ctas() {
#if HW_SIM
  return hw_sim::detail::cluster_num_ctas();
#elif HW_CLUSTER_PTX
  return cooperative_groups::this_cluster().num_blocks();
#else
  __trap();
  return 0;
#endif
}

__device__ __forceinline__ void cluster_sync() {
#if HW_SIM
  hw_sim::detail::cluster_barrier();
#elif HW_CLUSTER_PTX
  cooperative_groups::this_cluster().sync();
#else
  __trap();
#endif
}

template <typename T>
__device__ __forceinline__ T* cluster_map_shared(T* p, unsigned rank) {
#if HW_SIM
  return static_cast<T*>(hw_sim::detail::cluster_map_shared(p, rank));
#elif HW_CLUSTER_PTX
  return cooperative_groups::this_cluster().map_shared_rank(p, rank);
#else
  (void)p;
  (void)rank;
  __trap();
  return nullptr;
#endif
}

}  // namespace hw

#if HW_SIM
#define HW_LAUNCH_CLUSTER(name, kernel, grid, block, cluster, smem_bytes, ...) \
  ::hw_sim::launch_cluster((name), (grid), (block), (cluster), (smem_bytes), [&]() { kernel(__VA_ARGS__); })
#else
#define HW_LAUNCH_CLUSTER(name, kernel, grid, block, cluster, smem_bytes, ...)  \
  do {                                                                          \
    cudaLaunchConfig_t hw_config = {};                                          \
    hw_config.gridDim = (grid);                                                 \
    hw_config.blockDim = (block);                                               \
    hw_config.dynamicSmemBytes = (smem_bytes);                                  \
    hw_config.stream = at::cuda::getCurrentCUDAStream();                        \
    cudaLaunchAttribute hw_attribute[1];                                        \
    hw_attribute[0].id = cudaLaunchAttributeClusterDimension;                   \
    const dim3 hw_cluster = (cluster);                                          \
    hw_attribute[0].val.clusterDim.x = hw_cluster.x;                            \
    hw_attribute[0].val.clusterDim.y = hw_cluster.y;                            \
    hw_attribute[0].val.clusterDim.z = hw_cluster.z;                            \
    hw_config.attrs = hw_attribute;                                             \
    hw_config.numAttrs = 1;                                                     \
    C10_CUDA_CHECK(cudaLaunchKernelEx(&hw_config, kernel, __VA_ARGS__));        \
  } while (0)
#endif
