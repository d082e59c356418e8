// Entry points of the sample GEMM op, one per backend that has it; registered in
// csrc/register_sim.cpp (torch.ops.headwise_sim) and csrc/register_cuda.cu
// (torch.ops.headwise). Schema (csrc/schemas.h):
//   sample_gemm(a, b) -> c: a [M, K], b [N, K], bf16 or f16, same dtype and device;
//   c [M, N] = a b^T in their dtype, fp32 accumulation (csrc/gemm/sample_gemm_kernel.cuh).
#pragma once

#include <ATen/core/Tensor.h>

namespace headwise {
namespace gemm {

at::Tensor sample_gemm_cuda(const at::Tensor& a, const at::Tensor& b);
at::Tensor sample_gemm_sim(const at::Tensor& a, const at::Tensor& b);

}  // namespace gemm
}  // namespace headwise
