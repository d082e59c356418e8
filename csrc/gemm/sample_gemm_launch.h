// Host side of the sample GEMM (sample_gemm_kernel.cuh): argument checks, K padding and
// the launch. Compiled once by nvcc (sample_gemm_cuda.cu: sample_gemm_cuda) and once by
// the host compiler against the SIMT emulator (sample_gemm_sim.cpp: sample_gemm_sim).
#pragma once

#include "../common/backend_device.h"
#include "../common/checks.h"
#include "../common/op_range.h"
#include "../common/outputs.h"
#include "gemm_ops.h"
#include "sample_gemm_kernel.cuh"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include <limits>

namespace headwise {
namespace gemm {

at::Tensor HW_BACKEND_ENTRY(sample_gemm)(const at::Tensor& a, const at::Tensor& b) {
  HW_OP_RANGE("headwise::sample_gemm");
  constexpr const char* op = "sample_gemm";
  check_dim(op, a, "a", 2);
  check_dim(op, b, "b", 2);
  TORCH_CHECK_TYPE(a.scalar_type() == at::kBFloat16 || a.scalar_type() == at::kHalf, "headwise.", op,
                   ": a must be bfloat16 or float16, got ", a.scalar_type());
  check_same_dtype(op, b, "b", a, "a");
  check_same_device(op, b, "b", a, "a");
  TORCH_CHECK(hw::on_backend_device(a), "headwise.", op, ": a is on ", a.device(), " but ", hw::kBackendDevice);
  check_size(op, b, "b", 1, a.size(1), "a.size(1), the shared K");
  const int64_t M = a.size(0), K = a.size(1), N = b.size(0);
  constexpr int64_t kMaxGridY = 65535, kMaxInt = std::numeric_limits<int>::max();
  TORCH_CHECK_VALUE((M + kBM - 1) / kBM <= kMaxGridY && N <= kMaxInt && K <= kMaxInt - 8 && M * K <= kMaxInt * 8LL,
                    "headwise.", op, ": shape too large (ceil(M/", kBM, ") at most ", kMaxGridY,
                    ", N and K below 2^31), got a ", shape_str(a), ", b ", shape_str(b));
  const at::OptionalDeviceGuard device_guard(a.device());
  at::Tensor c = new_output({M, N}, a.options());
  if (M == 0 || N == 0) return c;
  if (K == 0) return c.zero_();
  // The kernel's 16-byte cp.async copies need K % 8 == 0 and 16-byte aligned rows:
  // otherwise the operands are copied once into zero-padded [*, round_up(K, 8)] buffers.
  const int64_t k_padded = (K + 7) / 8 * 8;
  auto prepare = [&](const at::Tensor& t) {
    at::Tensor x = t.contiguous();
    if (k_padded == K && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0) return x;
    at::Tensor padded = at::zeros({t.size(0), k_padded}, t.options());
    padded.narrow(1, 0, K).copy_(t);
    return padded;
  };
  const at::Tensor ap = prepare(a), bp = prepare(b);
  const dim3 grid(static_cast<unsigned>((N + kBN - 1) / kBN), static_cast<unsigned>((M + kBM - 1) / kBM));
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    auto kernel = &sample_gemm_kernel<T>;
    hw::allow_dynamic_smem("sample_gemm", kernel, kSmemBytes);
    HW_LAUNCH("sample_gemm", kernel, grid, dim3(kThreads), kSmemBytes, static_cast<const T*>(ap.data_ptr()),
              static_cast<const T*>(bp.data_ptr()), static_cast<T*>(c.data_ptr()), static_cast<int>(M),
              static_cast<int>(N), static_cast<int>(k_padded));
  };
  if (a.scalar_type() == at::kBFloat16)
    launch(c10::BFloat16{});
  else
    launch(c10::Half{});
  return c;
}

}  // namespace gemm
}  // namespace headwise
