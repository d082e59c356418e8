// Known access patterns for the metrics of the profile library (simt_metrics.h), compiled
// only into headwise._sim_profile (instrumented like its kernels) and registered as
// torch.ops.headwise_sim_profile_test.*; tests/simt/test_sim_profile.py checks the counts.
//
// Ops (CPU tensors, float32 unless said):
//   copy(x [n], stride)                 out[i] = x[i * stride], one thread per output,
//                                       256 threads per block (stride 1: 4 sectors per
//                                       warp request; stride 32: 32 sectors, ideal 4)
//   copy_vec8(x [n] bf16)               out = x, each thread moving 8 elements (16 bytes)
//                                       with common/vec.cuh's pack load and store: 16
//                                       sectors per warp request, as LDG/STG.128 on the GPU
//   transpose(x [R*32, 32], padded, dynamic_smem)
//                                       each block transposes one 32 x 32 tile through a
//                                       shared tile of row pitch 32 (padded: 33) floats;
//                                       block (32, 32). The column read of the unpadded
//                                       tile is a 32-way bank conflict (32 wavefronts per
//                                       request), the padded one is conflict-free.
//                                       The tile is a static __shared__ array or, with
//                                       dynamic_smem, the dynamic shared buffer.
#include "../simt_portability.h"
#include "../vec.cuh"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>

namespace headwise {
namespace simprofiletest {
namespace {

constexpr int kTile = 32;
constexpr int kCopyThreads = 256;

__global__ void copy_kernel(const float* __restrict__ x, int64_t n, int64_t stride, float* __restrict__ out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = x[i * stride];
}

__global__ void copy_vec8_kernel(const c10::BFloat16* __restrict__ x, int64_t packs, c10::BFloat16* __restrict__ out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= packs) return;
  float v[8];
  hw::load_as_float<8>(x + 8 * i, v);
  hw::store_from_float<8>(out + 8 * i, v);
}

// Row pitch kPitch floats: 32 puts a tile column in one bank, 33 spreads it over all 32.
template <int kPitch, bool kDynamic>
__global__ void transpose_kernel(const float* __restrict__ x, float* __restrict__ out) {
  __shared__ float static_tile[kTile * kPitch];
  float* tile = kDynamic ? reinterpret_cast<float*>(hw::dynamic_shared_memory()) : static_tile;
  const int r = threadIdx.y, c = threadIdx.x;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kTile * kTile;
  tile[r * kPitch + c] = x[base + r * kTile + c];    // a warp writes one row: conflict-free
  __syncthreads();
  out[base + r * kTile + c] = tile[c * kPitch + r];  // a warp reads one column
}

at::Tensor copy(const at::Tensor& x, int64_t stride) {
  TORCH_CHECK(x.dim() == 1 && x.scalar_type() == at::kFloat && x.is_contiguous() && stride >= 1,
              "copy: x must be a contiguous 1-d float32 tensor and stride >= 1");
  const int64_t n = (x.numel() + stride - 1) / stride;
  at::Tensor out = at::empty({n}, x.options());
  if (n == 0) return out;
  HW_LAUNCH("metrics_copy", copy_kernel, dim3(static_cast<unsigned>((n + kCopyThreads - 1) / kCopyThreads)),
            dim3(kCopyThreads), 0, x.data_ptr<float>(), n, stride, out.data_ptr<float>());
  return out;
}

at::Tensor copy_vec8(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 1 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.numel() % 8 == 0,
              "copy_vec8: x must be a contiguous 1-d bfloat16 tensor of a multiple of 8 elements");
  at::Tensor out = at::empty_like(x);
  const int64_t packs = x.numel() / 8;
  if (packs == 0) return out;
  HW_LAUNCH("metrics_copy_vec8", copy_vec8_kernel, dim3(static_cast<unsigned>((packs + kCopyThreads - 1) / kCopyThreads)),
            dim3(kCopyThreads), 0, static_cast<const c10::BFloat16*>(x.data_ptr()), packs,
            static_cast<c10::BFloat16*>(out.data_ptr()));
  return out;
}

at::Tensor transpose(const at::Tensor& x, bool padded, bool dynamic_smem) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == kTile && x.size(0) % kTile == 0 && x.size(0) > 0 &&
                  x.scalar_type() == at::kFloat && x.is_contiguous(),
              "transpose: x must be a contiguous float32 [R*32, 32] tensor");
  at::Tensor out = at::empty_like(x);
  const dim3 grid(static_cast<unsigned>(x.size(0) / kTile)), block(kTile, kTile);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const size_t smem = dynamic_smem ? (padded ? kTile * (kTile + 1) : kTile * kTile) * sizeof(float) : 0;
  if (padded) {
    if (dynamic_smem)
      HW_LAUNCH("metrics_transpose_padded", (transpose_kernel<kTile + 1, true>), grid, block, smem, xp, op);
    else
      HW_LAUNCH("metrics_transpose_padded", (transpose_kernel<kTile + 1, false>), grid, block, smem, xp, op);
  } else {
    if (dynamic_smem)
      HW_LAUNCH("metrics_transpose", (transpose_kernel<kTile, true>), grid, block, smem, xp, op);
    else
      HW_LAUNCH("metrics_transpose", (transpose_kernel<kTile, false>), grid, block, smem, xp, op);
  }
  return out;
}

}  // namespace
}  // namespace simprofiletest
}  // namespace headwise

TORCH_LIBRARY(headwise_sim_profile_test, m) {
  m.def("copy(Tensor x, int stride=1) -> Tensor");
  m.def("copy_vec8(Tensor x) -> Tensor");
  m.def("transpose(Tensor x, bool padded, bool dynamic_smem) -> Tensor");
}

TORCH_LIBRARY_IMPL(headwise_sim_profile_test, CPU, m) {
  m.impl("copy", &headwise::simprofiletest::copy);
  m.impl("copy_vec8", &headwise::simprofiletest::copy_vec8);
  m.impl("transpose", &headwise::simprofiletest::transpose);
}
