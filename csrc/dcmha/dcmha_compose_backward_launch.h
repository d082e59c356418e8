// The compose entry compose_backward (dcmha_ops.h) of the CUDA and emulated backends
// (dcmha_launch.h): dcmha_compose_bwd and dcmha_compose_reduce_partials (dcmha_kernel.cuh),
// or the backward by library products where the key-side block does not fit the device.
#pragma once

#include "dcmha_compose_library.h"
#include "dcmha_compose_reduce_kernel.cuh"
#include "dcmha_launch.h"

namespace headwise {
namespace dcmha {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> HW_DCMHA_ENTRY(compose_backward)(
    const at::Tensor& grad, const at::Tensor& a, const at::Tensor& w1, const at::Tensor& w2, const at::Tensor& g,
    int64_t slot, int64_t head_groups) {
  HW_OP_RANGE("headwise::dcmha_compose_backward");
  const Shape s = check_compose_args(a, w1, w2, g, slot, head_groups);
  check_backend(a, "a", s.heads, "compose", "dcmha_compose_backward");
  TORCH_CHECK_VALUE(grad.sizes() == a.sizes(), "headwise.dcmha_compose_backward: grad must have the shape of a ",
                    shape_str(a), ", got ", shape_str(grad));
  check_same_dtype("dcmha_compose_backward", grad, "grad", a, "a");
  const at::OptionalDeviceGuard device_guard(a.device());
  const at::Tensor x = a.contiguous(), dy = grad.contiguous();
  const at::Tensor w1f = w1.to(at::kFloat).contiguous(), w2f = w2.to(at::kFloat).contiguous(),
                   gf = g.to(at::kFloat).contiguous();
  at::Tensor da = new_output(x.sizes(), x.options());
  // Slots other than (cq, ck) get zero gradients; the kernels write every element of theirs.
  at::Tensor dw1 = at::zeros(w1f.sizes(), w1f.options());
  at::Tensor dw2 = at::zeros(w2f.sizes(), w2f.options());
  at::Tensor dg = at::zeros(gf.sizes(), gf.options());
  if (x.numel() > 0) {
    ComposeParams p = make_params(s, w1f, w2f, gf, slot);
    p.a = x.data_ptr();
    p.grad = dy.data_ptr();
    p.out = da.data_ptr();
    p.dw1 = dw1.data_ptr<float>();
    p.dw2 = dw2.data_ptr<float>();
    p.dg = dg.data_ptr<float>();
    const int64_t elem = x.element_size(), groups = s.head_groups, H = s.heads;
    p.vec16 = (s.seq * elem) % 16 == 0 && aligned16_ptr(x.data_ptr()) && aligned16_ptr(dy.data_ptr()) &&
              aligned16_ptr(da.data_ptr());
    const int64_t tiles = (s.seq + kComposeColumns - 1) / kComposeColumns;
    const int64_t chunks = (s.seq + kComposeRows - 1) / kComposeRows;
    const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(chunks), static_cast<unsigned>(s.batch));
    const int64_t len = kGradFields * H, rows = s.batch * s.seq;
    // Key weights [2][H][128][2] + Gk [H][128] floats, then for 2-byte types, where it fits,
    // two stages of two rows and [2][G][4][128] group totals (row blocking, dcmha_compose_bwd
    // <T, 2>: ~156 KiB at H = 32 bf16, one CTA per SM on sm_80 and sm_90); else one stage of
    // one row and [G][4][128] group totals (<T, 1>: ~100 KiB at H = 32 bf16, two CTAs per SM
    // on sm_90, one on sm_80). The [128][5H | 1] column sums reuse the whole buffer at the
    // end. Where neither fits the device's limit (the 99 KiB parts at H = 32),
    // compose_backward_by_library instead. Both kernels give bitwise the same results.
    const int64_t key_weights = H * kComposeColumns * 20;
    const int64_t group_totals = groups * kBwdGroupValues * kComposeColumns * 4;
    auto bwd_layout = [&](int rows) {
      return std::max<int64_t>(compose_layout(p, elem, 2, rows, rows, key_weights, 0, group_totals, 0),
                               static_cast<int64_t>(kComposeColumns) * (len | 1) * 4);
    };
    bool fits = true, two_rows = false;
    int64_t smem = 0;
    dispatch_storage_dtype(a.scalar_type(), "dcmha_compose_backward", "a", [&](auto tag) {
      using T = decltype(tag);
      // HEADWISE_DCMHA_COMPOSE_BWD_ROWS=1 keeps the one-row kernel: the two-row kernel's
      // gain (estimated) comes at one CTA per SM instead of two, which only a GPU can judge
      // (bench/device_check.sh times both).
      const int64_t rows_setting = hw::env_int("HEADWISE_DCMHA_COMPOSE_BWD_ROWS", 2, 1, 2);
      if constexpr (sizeof(T) == 2) {
        if (rows_setting == 2) {
          smem = bwd_layout(2);
          two_rows = block_fits(&dcmha_compose_bwd<T, 2>, smem);
        }
      }
      if (!two_rows) {
        smem = bwd_layout(1);
        fits = block_fits(&dcmha_compose_bwd<T, 1>, smem);
      }
    });
    if (!fits) {
      compose_backward_by_library(x, dy, w1f, w2f, gf, p.cq, p.ck, groups, da, dw1, dw2, dg);
      return {da, dw1.to(w1.scalar_type()), dw2.to(w2.scalar_type()), dg.to(g.scalar_type())};
    }
    // Gradient partials: per column tile (query side), per row chunk (key side).
    at::Tensor query_partials = at::empty({tiles, rows, len}, w1f.options());
    at::Tensor key_partials = at::empty({chunks, rows, len}, w1f.options());
    p.partials = query_partials.data_ptr<float>();
    p.key_partials = key_partials.data_ptr<float>();
    const unsigned reduce_blocks = static_cast<unsigned>((rows * len + kReduceThreads - 1) / kReduceThreads);
    dispatch_storage_dtype(a.scalar_type(), "dcmha_compose_backward", "a", [&](auto tag) {
      using T = decltype(tag);
      auto launch = [&](auto kernel) {
        hw::allow_dynamic_smem("dcmha_compose_backward", kernel, static_cast<size_t>(smem));
        HW_LAUNCH("dcmha_compose_bwd", kernel, grid, dim3(kComposeThreads), static_cast<size_t>(smem), p);
      };
      if constexpr (sizeof(T) == 2) {
        if (two_rows) {
          launch(&dcmha_compose_bwd<T, 2>);
          return;
        }
      }
      launch(&dcmha_compose_bwd<T, 1>);
    });
    HW_LAUNCH("dcmha_compose_reduce_partials", dcmha_compose_reduce_partials, dim3(reduce_blocks),
              dim3(kReduceThreads), 0, p, static_cast<const float*>(p.partials), static_cast<int>(tiles), p.cq);
    HW_LAUNCH("dcmha_compose_reduce_partials", dcmha_compose_reduce_partials, dim3(reduce_blocks),
              dim3(kReduceThreads), 0, p, static_cast<const float*>(p.key_partials), static_cast<int>(chunks), p.ck);
  } else {
    da.zero_();
  }
  return {da, dw1.to(w1.scalar_type()), dw2.to(w2.scalar_type()), dg.to(g.scalar_type())};
}

}  // namespace dcmha
}  // namespace headwise
