// Host side of the MHAR kernels: checks, layout plan, launches, and the backend entries
// of mhar_ops.h. Compiled once as the CUDA backend (mhar_cuda.cu, nvcc: route_cuda)
// and once as the emulated backend (mhar_sim.cpp, host compiler against the SIMT
// emulator: route_sim), so both run exactly the same launch logic.
#pragma once

#include "../common/backend_device.h"
#include "../common/dispatch.h"
#include "../common/op_range.h"
#include "../common/outputs.h"
#include "mhar_args.h"
#include "mhar_bwd_staged_kernel.cuh"
#include "mhar_fwd_staged_kernel.cuh"
#include "mhar_kernel.cuh"
#include "mhar_ops.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
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
// (2 CTAs an SM on an A100 as on an H100). The variable env_name = 0 keeps the other
// kernel (HEADWISE_MHAR_FWD_STAGED: the streaming forward, HEADWISE_MHAR_BWD_STAGED:
// mhar_route_bwd_kernel; the tests run both, the device check times both).
static_assert(kStagedItems == kItemsVec8, "the staged kernels run the vector layout's threads");
inline bool staged_fits(const Shape& s, const Plan& plan, const char* env_name, int64_t smem_bytes) {
  if (plan.vec != 8 || !staged_heads(s.head_dim / 8)) return false;
  if (const char* env = std::getenv(env_name); env != nullptr && std::strcmp(env, "0") == 0) return false;
  const int64_t limit = std::min<int64_t>(kStagedSmemBudget, static_cast<int64_t>(hw::max_dynamic_smem_optin()) / 2 - 1024);
  return smem_bytes <= limit;
}

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

std::tuple<at::Tensor, at::Tensor> HW_MHAR_ENTRY(route)(const at::Tensor& sources,
                                                        const at::Tensor& query,
                                                        const at::Tensor& norm_weight,
                                                        int64_t num_heads, int64_t num_sources,
                                                        double eps,
                                                        const c10::optional<at::Tensor>& residual,
                                                        const c10::optional<at::Tensor>& gate) {
  HW_OP_RANGE("headwise::mhar_route");
  const Shape s = check_route_args(sources, query, norm_weight, num_heads, num_sources, eps);
  check_backend(sources, s, "mhar_route");
  if (residual.has_value()) check_residual(*residual, sources, s);
  if (gate.has_value()) check_gate("mhar_route", *gate, sources);
  const at::OptionalDeviceGuard device_guard(sources.device());

  const at::Tensor q = query.to(at::kFloat).contiguous();
  const at::Tensor g = norm_weight.to(at::kFloat).contiguous();
  const at::Tensor gate32 = gate_as_float(gate);
  at::Tensor out = new_output({s.batch, s.seq, s.d}, sources.options());
  at::Tensor weights =
      new_output({s.num_sources, s.batch, s.seq, s.heads}, sources.options().dtype(at::kFloat));
  if (s.positions() == 0) return {out, weights};

  bool vec8 = s.head_dim % 8 == 0 && aligned_for_vec8(sources) && aligned_for_vec8(q) &&
              aligned_for_vec8(g);
  if (residual.has_value()) vec8 = vec8 && aligned_for_vec8(*residual);
  const Plan plan = make_plan(s, vec8);

  FwdParams p{};
  p.route = make_routing(sources, q, g, s, eps);
  p.residual = residual.has_value() ? residual->data_ptr() : nullptr;
  p.res_stride_b = residual.has_value() ? residual->stride(0) : 0;
  p.res_stride_t = residual.has_value() ? residual->stride(1) : 0;
  p.gate = gate32.defined() ? gate32.data_ptr<float>() : nullptr;
  p.out = out.data_ptr();
  p.weights = weights.data_ptr<float>();

  const dim3 grid(static_cast<unsigned>(std::min(s.positions(), kFwdMaxBlocks)));
  dispatch_storage_dtype(sources.scalar_type(), "mhar_route", "sources", [&](auto tag) {
    using T = decltype(tag);
    if constexpr (sizeof(T) == 2) {
      const int64_t staged_bytes = fwd_staged_smem_bytes(s.num_sources, s.heads, plan.threads);
      if (staged_fits(s, plan, "HEADWISE_MHAR_FWD_STAGED", staged_bytes)) {
        auto kernel = s.head_dim / 8 == 64 ? &mhar_route_fwd_staged_kernel<T, true>
                                            : &mhar_route_fwd_staged_kernel<T, false>;
        hw::allow_dynamic_smem("mhar_route", kernel, static_cast<size_t>(staged_bytes));
        HW_LAUNCH("mhar_route_fwd_staged", kernel, grid, dim3(plan.threads), static_cast<size_t>(staged_bytes), p);
        return;
      }
    }
    dispatch_plan<T>(plan, [&](auto cfg) {
      using C = decltype(cfg);
      auto kernel = &mhar_route_fwd_kernel<T, C::vec, C::items, C::rows, C::prefetch, C::mode>;
      const size_t smem_bytes =
          static_cast<size_t>(fwd_smem_floats(plan.mode, plan.nvec, C::rows, s.num_sources, s.heads, C::vec,
                                              C::items, plan.threads)) *
          sizeof(float);
      hw::allow_dynamic_smem("mhar_route", kernel, smem_bytes);
      HW_LAUNCH("mhar_route_fwd", kernel, grid, dim3(plan.threads), smem_bytes, p);
    });
  });
  return {out, weights};
}

namespace {

// The backward into grad_sources, a contiguous [N_max, B, T, d] tensor of dtype G (the
// sources' dtype, or fp32 for a DepthBuffer's shared accumulator): rows [0, N) are stored,
// or added to with `accumulate`. Returns (grad_query, grad_norm_weight, grad_gate as a
// 0-dim fp32 tensor).
template <bool kIntoFloat>
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_into(
    const at::Tensor& grad_out, const at::Tensor& sources, const at::Tensor& query,
    const at::Tensor& norm_weight, const at::Tensor& weights, const at::Tensor& gate32, const Shape& s,
    double eps, at::Tensor& grad_sources, bool accumulate) {
  const at::Tensor dout = grad_out.contiguous();
  const at::Tensor w = weights.contiguous();
  const at::Tensor q = query.to(at::kFloat).contiguous();
  const at::Tensor g = norm_weight.to(at::kFloat).contiguous();
  at::Tensor grad_query = at::zeros({s.d}, sources.options().dtype(at::kFloat));
  at::Tensor grad_norm = at::zeros({s.d}, sources.options().dtype(at::kFloat));
  at::Tensor grad_gate = at::zeros({}, sources.options().dtype(at::kFloat));
  if (s.positions() > 0) {
    const bool vec8 = s.head_dim % 8 == 0 && aligned_for_vec8(sources) && aligned_for_vec8(q) &&
                      aligned_for_vec8(g) && aligned_for_vec8(dout) && aligned_for_vec8(grad_sources);
    const Plan plan = make_plan(s, vec8);
    const int64_t segments = bwd_segments(s.positions());
    at::Tensor z_partial = new_output({segments, s.d}, sources.options().dtype(at::kFloat));
    at::Tensor gate_partial = new_output({segments}, sources.options().dtype(at::kFloat));

    BwdParams p{};
    p.route = make_routing(sources, q, g, s, eps);
    p.grad_out = dout.data_ptr();
    p.weights = w.data_ptr<float>();
    p.grad_sources = grad_sources.data_ptr();
    p.accumulate = accumulate;
    p.gate = gate32.defined() ? gate32.data_ptr<float>() : nullptr;
    p.z_partial = z_partial.data_ptr<float>();
    p.gate_partial = gate_partial.data_ptr<float>();

    dispatch_storage_dtype(sources.scalar_type(), "mhar_route_backward", "sources", [&](auto tag) {
      using T = decltype(tag);
      using G = std::conditional_t<kIntoFloat, float, T>;
      const dim3 grid(static_cast<unsigned>(std::min(segments, kBwdMaxBlocks)));
      if constexpr (sizeof(T) == 2) {
        const bool warp_heads = s.head_dim / 8 == 64;
        const int64_t record = warp_heads ? bwd_record_floats<T, true>() : bwd_record_floats<T, false>();
        const int64_t staged_bytes = bwd_staged_smem_bytes(s.num_sources, s.heads, record, plan.threads);
        if (staged_fits(s, plan, "HEADWISE_MHAR_BWD_STAGED", staged_bytes)) {
          auto kernel = warp_heads ? &mhar_route_bwd_staged_kernel<T, G, true> : &mhar_route_bwd_staged_kernel<T, G, false>;
          if constexpr (HW_SIM && std::is_same<T, c10::BFloat16>::value) {
            if (warp_heads && sim_simt_products()) kernel = &mhar_route_bwd_staged_kernel<T, G, true, true>;
          }
          hw::allow_dynamic_smem("mhar_route_backward", kernel, static_cast<size_t>(staged_bytes));
          HW_LAUNCH("mhar_route_bwd_staged", kernel, grid, dim3(plan.threads), static_cast<size_t>(staged_bytes), p);
          return;
        }
      }
      dispatch_plan<T>(plan, [&](auto cfg) {
        using C = decltype(cfg);
        auto kernel = &mhar_route_bwd_kernel<T, G, C::vec, C::items, C::rows, C::prefetch, C::mode>;
        const size_t base_bytes =
            static_cast<size_t>(bwd_smem_floats(plan.mode, C::vec, plan.nvec, C::rows, s.num_sources, s.heads,
                                                param_slice_floats(C::vec == 1, C::items, plan.threads, C::vec))) *
            sizeof(float);
        const size_t rows_bytes = static_cast<size_t>(s.num_sources) * C::items * plan.threads *
                                  sizeof(hw::Pack<T, C::vec>);
        p.stage_rows = base_bytes + rows_bytes <= static_cast<size_t>(kStageRowsBudget);
        const size_t smem_bytes = base_bytes + (p.stage_rows ? rows_bytes : 0);
        hw::allow_dynamic_smem("mhar_route_backward", kernel, smem_bytes);
        HW_LAUNCH("mhar_route_bwd", kernel, grid, dim3(plan.threads), smem_bytes, p);
      });
    });
    auto reduce = &mhar_param_grad_reduce_kernel;
    HW_LAUNCH("mhar_param_grad_reduce", reduce, dim3(static_cast<unsigned>((s.d + kReduceColumns - 1) / kReduceColumns)),
              dim3(kReduceColumns * kReduceLanes), 0,
              z_partial.data_ptr<float>(), gate_partial.data_ptr<float>(), segments, s.d, q.data_ptr<float>(),
              g.data_ptr<float>(), grad_query.data_ptr<float>(), grad_norm.data_ptr<float>(),
              grad_gate.data_ptr<float>());
  }
  return {grad_query.to(query.scalar_type()), grad_norm.to(norm_weight.scalar_type()), grad_gate};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> HW_MHAR_ENTRY(route_backward)(
    const at::Tensor& grad_out, const at::Tensor& sources, const at::Tensor& query,
    const at::Tensor& norm_weight, const at::Tensor& weights, const c10::optional<at::Tensor>& gate,
    int64_t num_heads, int64_t num_sources, double eps) {
  HW_OP_RANGE("headwise::mhar_route_backward");
  const Shape s = check_route_args(sources, query, norm_weight, num_heads, num_sources, eps);
  check_backend(sources, s, "mhar_route_backward");
  check_backward_args(grad_out, sources, weights, s);
  if (gate.has_value()) check_gate("mhar_route_backward", *gate, sources);
  const at::OptionalDeviceGuard device_guard(sources.device());
  at::Tensor grad_sources = new_output(sources.sizes(), sources.options());
  if (s.num_sources < s.max_sources) grad_sources.narrow(0, s.num_sources, s.max_sources - s.num_sources).zero_();
  auto [grad_query, grad_norm, grad_gate] = backward_into<false>(
      grad_out, sources, query, norm_weight, weights, gate_as_float(gate), s, eps, grad_sources, false);
  if (gate.has_value()) grad_gate = grad_gate.to(gate->scalar_type()).reshape(gate->sizes());
  return {grad_sources, grad_query, grad_norm, grad_gate};
}

std::tuple<at::Tensor, at::Tensor> HW_MHAR_ENTRY(route_backward_into)(
    const at::Tensor& grad_out, const at::Tensor& sources, const at::Tensor& query,
    const at::Tensor& norm_weight, const at::Tensor& weights, at::Tensor& grad_sources,
    int64_t num_heads, int64_t num_sources, double eps, bool accumulate) {
  HW_OP_RANGE("headwise::mhar_route_backward_into");
  const Shape s = check_route_args(sources, query, norm_weight, num_heads, num_sources, eps);
  check_backend(sources, s, "mhar_route_backward_into");
  check_backward_args(grad_out, sources, weights, s);
  check_grad_buffer(grad_sources, sources, at::kFloat);
  const at::OptionalDeviceGuard device_guard(sources.device());
  const auto grads = backward_into<true>(grad_out, sources, query, norm_weight, weights, at::Tensor(), s, eps,
                                         grad_sources, accumulate);
  return {std::get<0>(grads), std::get<1>(grads)};
}

}  // namespace mhar
}  // namespace headwise
