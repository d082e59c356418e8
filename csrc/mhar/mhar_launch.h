// Host side of the MHAR kernels shared by the backend entries of mhar_ops.h: the layout
// plan, the staged kernels' fit, the routing parameters and the backend check. Each entry
// is in a header of its own (mhar_route_launch.h, mhar_route_backward_launch.h,
// mhar_route_backward_into_launch.h; the backward's launches in mhar_bwd_launch.h), compiled
// once as the CUDA backend (<entry>_cuda.cu, nvcc: route_cuda) and once as the emulated
// backend (<entry>_sim.cpp, host compiler against the SIMT emulator: route_sim), so both
// run exactly the same launch logic. One translation unit an entry: the backward's kernel
// instantiations took most of one file's compile, which bounded a parallel build.
#pragma once

#include "../common/backend_device.h"
#include "../common/dispatch.h"
#include "../common/env_settings.h"
#include "../common/op_range.h"
#include "../common/outputs.h"
#include "mhar_args.h"
#include "mhar_fwd_staged_kernel.cuh"
#include "mhar_kernel.cuh"
#include "mhar_ops.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include <algorithm>
#include <tuple>

namespace headwise {
namespace mhar {
#define HW_MHAR_ENTRY(name) HW_BACKEND_ENTRY(name)
namespace {
using hw::kBackendDevice;
using hw::on_backend_device;

// Largest d of the device kernels: 8192 / VEC vectors over at most kMaxThreads threads.
constexpr int64_t kMaxDim = 8192;
// Grid caps: blocks loop over positions (forward) or segments (backward) beyond them.
// The forward's blocks load q and g once each; the backward's sums do not depend on its
// grid (per-segment partials).
constexpr int64_t kFwdMaxBlocks = 1024;
constexpr int64_t kBwdMaxBlocks = 1024;
// Vectors per thread (ITEMS) of the vectorized (8-element) and scalar layouts.
constexpr int kItemsVec8 = 2;
constexpr int kItemsScalar = 16;
// Shared memory the backward may use to keep a position's N rows between its passes
// (above it, pass 2 rereads them from global memory): 72 KiB at N = 9, d = 4096, bf16.
constexpr int64_t kStageRowsBudget = 100 * 1024;

// ROWS rows per stage and register prefetch of the next stage: 2 rows of 16-byte packs
// for 2-byte types, 1 for fp32 (the double buffer holds 2 x ROWS x ITEMS packs); the
// scalar layout (ITEMS = 16) loads one row at a time without prefetch.
template <typename T, int VEC, int ITEMS, HeadReduce MODE>
struct Config {
  using scalar_t = T;
  static constexpr int vec = VEC;
  static constexpr int items = ITEMS;
  static constexpr HeadReduce mode = MODE;
  static constexpr int rows = (VEC == 8 && sizeof(T) == 2) ? 2 : 1;
  static constexpr bool prefetch = VEC == 8;
};

struct Plan {
  int vec;
  int threads;
  HeadReduce mode;
  int64_t nvec;
};

inline bool aligned_for_vec8(const at::Tensor& t) {
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  for (int64_t i = 0; i + 1 < t.dim(); ++i)
    if (t.size(i) > 1 && t.stride(i) % 8 != 0) return false;
  return true;
}

inline Plan make_plan(const Shape& s, bool vec8) {
  Plan plan{};
  plan.vec = vec8 ? 8 : 1;
  const int64_t nvec = s.d / plan.vec;
  const int64_t kv = s.head_dim / plan.vec;
  plan.mode = (kv <= 32 && (kv & (kv - 1)) == 0) ? HeadReduce::kSegment
              : (kv % 32 == 0)                    ? HeadReduce::kWarps
                                                  : HeadReduce::kGeneric;
  // Every thread fills all ITEMS vector slots (registers are allocated for all of them),
  // in warps: threads = 32 * ceil(nvec / (32 * ITEMS)) <= kMaxThreads for d <= kMaxDim.
  const int64_t items = vec8 ? kItemsVec8 : kItemsScalar;
  plan.threads = static_cast<int>((nvec + 32 * items - 1) / (32 * items) * 32);
  plan.nvec = nvec;
  return plan;
}

// Calls f(Config<T, VEC, ITEMS, MODE>{}) for the plan.
template <typename T, typename F>
void dispatch_plan(const Plan& plan, F&& f) {
  if (plan.vec == 8) {
    switch (plan.mode) {
      case HeadReduce::kSegment: f(Config<T, 8, kItemsVec8, HeadReduce::kSegment>{}); break;
      case HeadReduce::kWarps: f(Config<T, 8, kItemsVec8, HeadReduce::kWarps>{}); break;
      case HeadReduce::kGeneric: f(Config<T, 8, kItemsVec8, HeadReduce::kGeneric>{}); break;
    }
  } else {
    switch (plan.mode) {
      case HeadReduce::kSegment: f(Config<T, 1, kItemsScalar, HeadReduce::kSegment>{}); break;
      case HeadReduce::kWarps: f(Config<T, 1, kItemsScalar, HeadReduce::kWarps>{}); break;
      case HeadReduce::kGeneric: f(Config<T, 1, kItemsScalar, HeadReduce::kGeneric>{}); break;
    }
  }
}

// Whether 16-bit sources take a staged kernel (mhar_fwd_staged_kernel.cuh,
// mhar_bwd_staged_kernel.cuh): the 16-byte path, heads within a warp, and the kernel's
// shared memory (smem_bytes) within kStagedSmemBudget and half the device's opt-in limit
// (2 CTAs an SM on an A100 as on an H100). `allowed`: the launcher's switch, read for every
// call (staged_allowed), whose 0 keeps the other kernel (the tests run both, the device
// check times both).
static_assert(kStagedItems == kItemsVec8, "the staged kernels run the vector layout's threads");
inline bool staged_fits(const Shape& s, const Plan& plan, bool allowed, int64_t smem_bytes) {
  if (!allowed || plan.vec != 8 || !staged_heads(s.head_dim / 8)) return false;
  const int64_t limit = std::min<int64_t>(kStagedSmemBudget, static_cast<int64_t>(hw::max_dynamic_smem_optin()) / 2 - 1024);
  return smem_bytes <= limit;
}

// The switch `setting` (HEADWISE_MHAR_FWD_STAGED: the streaming forward at 0,
// HEADWISE_MHAR_BWD_STAGED: mhar_route_bwd_kernel at 0), read before the dtype and shape
// decide, so that a bad value is refused by every call.
inline bool staged_allowed(const char* setting) { return hw::env_switch(setting, true); }

// Whether the emulated build's staged backward takes pass 2's SIMT products for bf16 heads
// of 64 vectors (HEADWISE_SIM_MHAR_BWD_SIMT_PRODUCTS=1: the form sm_80 compiles; the
// emulator otherwise runs sm_90's tensor-core form). The CUDA build ignores it.
inline bool sim_simt_products() { return hw::sim_flag("HEADWISE_SIM_MHAR_BWD_SIMT_PRODUCTS"); }

// q, g: the fp32 contiguous copies of query and norm_weight.
inline Routing make_routing(const at::Tensor& sources, const at::Tensor& q, const at::Tensor& g,
                            const Shape& s, double eps) {
  Routing r{};
  r.sources = sources.data_ptr();
  r.query = q.data_ptr<float>();
  r.norm_weight = g.data_ptr<float>();
  r.src_stride_n = sources.stride(0);
  r.src_stride_b = sources.stride(1);
  r.src_stride_t = sources.stride(2);
  r.seq = s.seq;
  r.positions = s.positions();
  r.d = s.d;
  r.heads = s.heads;
  r.head_dim = s.head_dim;
  r.num_sources = static_cast<int>(s.num_sources);
  r.eps = static_cast<float>(eps);
  return r;
}

// The gate as a 1-element fp32 tensor on its device (undefined when absent); no host sync.
inline at::Tensor gate_as_float(const c10::optional<at::Tensor>& gate) {
  return gate.has_value() ? gate->to(at::kFloat).reshape({1}).contiguous() : at::Tensor();
}

inline void check_backend(const at::Tensor& sources, const Shape& s, const char* op) {
  TORCH_CHECK(on_backend_device(sources), "headwise.", op, ": sources is on ", sources.device(),
              " but ", kBackendDevice);
  dispatch_storage_dtype(sources.scalar_type(), op, "sources", [](auto) {});
  TORCH_CHECK_VALUE(s.d <= kMaxDim, "headwise.", op, ": d = ", s.d,
                    " exceeds the largest d of the CUDA kernels (", kMaxDim, ")");
}

}  // namespace

}  // namespace mhar
}  // namespace headwise
