// The compose entry compose (dcmha_ops.h) of the CUDA and emulated backends
// (dcmha_launch.h): dcmha_compose_fwd (dcmha_kernel.cuh), or the forward by library
// products (dcmha_compose_library.h) where its block does not fit the device: fp32 with
// many head groups on the 99 KiB parts (H = 32 in groups of one head needs 116.5 KiB).
#pragma once

#include "dcmha_compose_library.h"
#include "dcmha_launch.h"

namespace headwise {
namespace dcmha {

at::Tensor HW_DCMHA_ENTRY(compose)(const at::Tensor& a, const at::Tensor& w1, const at::Tensor& w2,
                                   const at::Tensor& g, int64_t slot, int64_t head_groups) {
  HW_OP_RANGE("headwise::dcmha_compose");
  const Shape s = check_compose_args(a, w1, w2, g, slot, head_groups);
  check_backend(a, "a", s.heads, "compose", "dcmha_compose");
  const at::OptionalDeviceGuard device_guard(a.device());
  const at::Tensor x = a.contiguous();
  const at::Tensor w1f = w1.to(at::kFloat).contiguous(), w2f = w2.to(at::kFloat).contiguous(),
                   gf = g.to(at::kFloat).contiguous();
  at::Tensor out = new_output(x.sizes(), x.options());
  if (x.numel() == 0) return out;
  ComposeParams p = make_params(s, w1f, w2f, gf, slot);
  p.a = x.data_ptr();
  p.out = out.data_ptr();
  const int64_t elem = x.element_size(), groups = s.head_groups;
  p.vec16 = (s.seq * elem) % 16 == 0 && aligned16_ptr(x.data_ptr()) && aligned16_ptr(out.data_ptr());
  const int64_t group_scratch = groups > 1 ? groups * 4 * kComposeColumns * 4 : 0;
  const int64_t smem =
      fit_rows([&](int rows) { return compose_layout(p, elem, 1, rows, kComposeStages, 0, column_block_bytes(2 * s.heads), 0,
                                                       group_scratch);
      });
  const unsigned tiles = static_cast<unsigned>((s.seq + kComposeColumns - 1) / kComposeColumns);
  const unsigned chunks = static_cast<unsigned>((s.seq + kComposeRows - 1) / kComposeRows);
  dispatch_storage_dtype(a.scalar_type(), "dcmha_compose", "a", [&](auto tag) {
    using T = decltype(tag);
    auto kernel = &dcmha_compose_fwd<T>;
    if (!block_fits(kernel, smem)) {
      compose_forward_by_library(x, w1f, w2f, gf, p.cq, p.ck, groups, out);
      return;
    }
    hw::allow_dynamic_smem("dcmha_compose", kernel, static_cast<size_t>(smem));
    HW_LAUNCH("dcmha_compose_fwd", kernel, dim3(tiles, chunks, static_cast<unsigned>(s.batch)),
              dim3(kComposeThreads), static_cast<size_t>(smem), p);
  });
  return out;
}

}  // namespace dcmha
}  // namespace headwise
