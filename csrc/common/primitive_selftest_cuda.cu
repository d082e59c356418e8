// The lane-by-lane primitive self-tests (csrc/common/simt/primitive_selftest.cuh) built by
// nvcc: torch.ops.headwise_simtest.{mma_lanes, ldmatrix_lanes, cp_async_roundtrip,
// cp_async_ldmatrix, cluster_exchange, warp_octets} on CUDA
// tensors, which check the emulator's fragment maps against the hardware
// (tests/simt/test_primitives.py; the schemas are defined by the emulated library).
#include "simt/primitive_selftest.cuh"

#include <torch/library.h>

TORCH_LIBRARY_IMPL(headwise_simtest, CUDA, m) {
  m.impl("mma_lanes", &headwise::primtest::mma_lanes_cuda);
  m.impl("ldmatrix_lanes", &headwise::primtest::ldmatrix_lanes_cuda);
  m.impl("cp_async_roundtrip", &headwise::primtest::cp_async_roundtrip_cuda);
  m.impl("cp_async_ldmatrix", &headwise::primtest::cp_async_ldmatrix_cuda);
  m.impl("cluster_exchange", &headwise::primtest::cluster_exchange_cuda);
  m.impl("warp_octets", &headwise::primtest::warp_octets_cuda);
}
