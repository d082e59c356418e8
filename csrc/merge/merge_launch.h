// Host side of the head-merge kernels: checks, launches, and the backend entries of
// merge_ops.h. Compiled once as the CUDA backend (merge_cuda.cu, nvcc: head_merge_cuda)
// and once as the emulated backend (merge_sim.cpp, host compiler against the SIMT
// emulator: head_merge_sim), so both run exactly the same launch logic.
#pragma once

#include "../common/backend_device.h"
#include "../common/dispatch.h"
#include "../common/env_settings.h"
#include "../common/op_range.h"
#include "../common/outputs.h"
#include "../common/tf32_policy.h"
#include "merge_args.h"
#include "merge_kernel.cuh"
#include "merge_ops.h"
#include "merge_tc_kernel.cuh"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <c10/core/DeviceGuard.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>

namespace headwise {
namespace merge {
#define HW_MERGE_ENTRY(name) HW_BACKEND_ENTRY(name)
namespace {
using hw::kBackendDevice;
using hw::on_backend_device;

constexpr int64_t kMaxGridYZ = 65535;
constexpr int64_t kMaxGridX = 2147483647;

inline void check_backend(const at::Tensor& z, const Shape& s, const char* op) {
  TORCH_CHECK(on_backend_device(z), "headwise.", op, ": z is on ", z.device(), " but ", kBackendDevice);
  dispatch_storage_dtype(z.scalar_type(), op, "z", [](auto) {});
  // Grid x carries the batch times the output column tiles (forward: B * ceil(D/kBN);
  // grad_z: B * H * ceil(Dv/kBN); limit 2^31 - 1); y carries query or weight-row tiles,
  // z the heads (limit 65535 each).
  TORCH_CHECK_VALUE((s.seq + kBM - 1) / kBM <= kMaxGridYZ && (s.d + kBM - 1) / kBM <= kMaxGridYZ &&
                        s.heads <= kMaxGridYZ && s.batch * ((s.d + kBN - 1) / kBN) <= kMaxGridX &&
                        s.batch * s.heads * ((s.dv + kBN - 1) / kBN) <= kMaxGridX &&
                        s.batch * ((s.seq + tc::kBM - 1) / tc::kBM) * ((s.d + tc::kBN - 1) / tc::kBN) <= kMaxGridX &&
                        s.batch * s.heads * ((s.seq + tc::kBM - 1) / tc::kBM) * ((s.dv + tc::kBN - 1) / tc::kBN) <=
                            kMaxGridX &&
                        s.batch * ((s.seq + tc::kTransK - 1) / tc::kTransK) <= kMaxGridX,  // grad_weight_o's int K loop
                    "headwise.", op, ": shape too large for the CUDA grid (Q/", kBM, ", D/", kBM,
                    " and H must be at most ", kMaxGridYZ, ", B*ceil(D/", kBN, "), B*H*ceil(Dv/", kBN,
                    "), B*ceil(Q/", tc::kBM, ")*ceil(D/", tc::kBN, "), B*H*ceil(Q/", tc::kBM, ")*ceil(Dv/", tc::kBN,
                    ") and B*ceil(Q/", tc::kTransK, ") at most ", kMaxGridX,
                    "), got z ", shape_str(z));
}

// The gate as fp32 on its device (undefined when absent) and its view for the kernels.
inline at::Tensor gate_as_float(const c10::optional<at::Tensor>& head_gate) {
  return head_gate.has_value() ? head_gate->to(at::kFloat).contiguous() : at::Tensor();
}

inline Gate make_gate(const at::Tensor& gate32, const Shape& s, bool rescale) {
  Gate g{};
  g.g = gate32.defined() ? gate32.data_ptr<float>() : nullptr;
  g.g_sb = gate32.defined() && gate32.dim() == 2 ? s.heads : 0;
  g.heads = s.heads;
  g.rescale = rescale;
  return g;
}

inline unsigned cdiv(int64_t a, int64_t b) { return static_cast<unsigned>((a + b - 1) / b); }

// The operands every merge kernel's parameter struct (FwdParams, BwdParams, tc::TcFwdParams)
// carries: Z's storage and strides [B, H, Q, Dv], the weight's (w, row stride ldw), the
// gate's view and the shape.
template <typename Params>
void set_operands(Params& p, const at::Tensor& z, const void* w, int64_t ldw, const Gate& gate, const Shape& s) {
  p.z = z.data_ptr();
  p.z_sb = z.stride(0);
  p.z_sh = z.stride(1);
  p.z_sq = z.stride(2);
  p.w = w;
  p.ldw = ldw;
  p.gate = gate;
  p.batch = s.batch;
  p.heads = s.heads;
  p.seq = s.seq;
  p.dv = s.dv;
  p.d = s.d;
}

// The widest copy (16, 4 or 2 bytes) that every row slice a tensor-core kernel reads
// allows: the base addresses and the byte strides (and offsets) it steps by, OR-ed
// together, must all be multiples of it.
inline int copy_bytes_for(std::initializer_list<uint64_t> addresses_and_strides) {
  uint64_t m = 0;
  for (uint64_t v : addresses_and_strides) m |= v;
  return m % 16 == 0 ? 16 : (m % 4 == 0 ? 4 : 2);
}

// The strides of z's dimensions that a kernel steps over (those of size 1 never are).
inline uint64_t z_stride_bits(const at::Tensor& z, const Shape& s) {
  const uint64_t es = static_cast<uint64_t>(z.element_size());
  uint64_t m = reinterpret_cast<uintptr_t>(z.data_ptr());
  if (s.batch > 1) m |= static_cast<uint64_t>(z.stride(0)) * es;
  if (s.heads > 1) m |= static_cast<uint64_t>(z.stride(1)) * es;
  if (s.seq > 1) m |= static_cast<uint64_t>(z.stride(2)) * es;
  return m;
}

inline int tc_copy_bytes(const at::Tensor& z, const at::Tensor& w, const Shape& s) {
  const uint64_t es = static_cast<uint64_t>(z.element_size());
  return copy_bytes_for({z_stride_bits(z, s), reinterpret_cast<uintptr_t>(w.data_ptr()),
                         s.heads > 1 ? static_cast<uint64_t>(s.dv) * es : 0,
                         s.d > 1 ? static_cast<uint64_t>(w.stride(0)) * es : 0});
}

// Calls pick(std::integral_constant<int, CopyBytes>) with the kernel instance for `bytes`
// (2-byte copies exist for 16-bit types only; fp32 elements are always 4-byte aligned).
template <typename T, typename Pick>
void with_copy_bytes(int bytes, Pick&& pick) {
  if (bytes == 16) {
    pick(std::integral_constant<int, 16>{});
  } else if constexpr (sizeof(T) == 2) {
    if (bytes == 4)
      pick(std::integral_constant<int, 4>{});
    else
      pick(std::integral_constant<int, 2>{});
  } else {
    pick(std::integral_constant<int, 4>{});
  }
}

// Launches head_merge_fwd_tc_kernel (merge_tc_kernel.cuh) for y = out [B, Q, D].
template <typename T>
void launch_fwd_tc(const at::Tensor& z, const at::Tensor& w, const at::Tensor& bias, const Gate& gate, const Shape& s,
                   at::Tensor& out) {
  tc::TcFwdParams p{};
  set_operands(p, z, w.data_ptr(), w.stride(0), gate, s);
  p.bias = bias.defined() ? bias.data_ptr() : nullptr;
  p.out = out.data_ptr();
  p.q_tiles = (s.seq + tc::kBM - 1) / tc::kBM;
  p.n_tiles = (s.d + tc::kBN - 1) / tc::kBN;
  const dim3 grid(static_cast<unsigned>(s.batch * p.q_tiles * p.n_tiles));
  const size_t smem = tc::fwd_smem_bytes(s.heads);
  auto launch = [&](auto kernel) {
    hw::allow_dynamic_smem("head_merge", kernel, smem);
    HW_LAUNCH("head_merge_fwd_tc", kernel, grid, dim3(tc::kThreads), smem, p);
  };
  with_copy_bytes<T>(tc_copy_bytes(z, w, s),
                     [&](auto bytes) { launch(&tc::head_merge_fwd_tc_kernel<T, decltype(bytes)::value>); });
}

// z_norm = sqrt(z_norm) in place and out_norm = sqrt(sum of the `tiles` partials of each
// (b, q, h)): the last step of both stats paths.
inline void finalize_stats(at::Tensor& z_norm, const at::Tensor& part, at::Tensor& out_norm, int64_t tiles) {
  const int64_t count = z_norm.numel();
  auto fin = &head_merge_stats_finalize_kernel;
  HW_LAUNCH("head_merge_stats_finalize", fin, dim3(cdiv(count, 256)), dim3(256), 0, z_norm.data_ptr<float>(),
            part.data_ptr<float>(), out_norm.data_ptr<float>(), count, tiles);
}

// Z as the [B*Q, H*Dv] matrix of the library-GEMM paths: a view when z is token-major (a
// transposed view of [B, Q, H, Dv] memory), else one gather (eager's concatenation).
inline at::Tensor token_major(const at::Tensor& z, const Shape& s) {
  return z.transpose(1, 2).reshape({s.rows(), s.k()});
}

// The operands of the statistics pass (head_merge_fwd_tc_kernel<T, _, true>): per head,
// w_h = [hi | lo] [Dv, 2 Dv] in T with hi + lo ~ L_h^T, L_h the lower Cholesky factor of
// W_h^T W_h + delta_h I (fp64 on z's device; delta_h = 2^-40 max diag, at least the
// smallest normal double, so that a rank-deficient or zero W_h factors too): then
// ||z L_h||^2 = ||z W_h^T||^2 + delta_h ||z||^2, a relative change below 1e-12 of the
// largest scale. Where the shifted matrix still fails (non-finite W_h gives NaN, as the
// product would), a 2^-20 shift is taken instead, chosen per head on the device:
// cholesky_ex reports failures in a tensor, so nothing synchronizes with the host.
// L_h^T is divided by c_h, the power of two nearest its largest magnitude, so that hi and
// lo keep their 11 (f16) / 8 (bf16) bits for any weight scale (a near-dead head's 1e-6
// entries are f16 subnormals); the pass multiplies its sums of squares by c_h^2, the
// second tensor returned ([H] fp32).
inline std::pair<at::Tensor, at::Tensor> stats_operands(const at::Tensor& weight_o, const Shape& s) {
  const int64_t H = s.heads, Dv = s.dv, D = s.d;
  const at::Tensor wh = weight_o.to(at::kDouble).contiguous().view({D, H, Dv}).permute({1, 0, 2});  // [H, D, Dv]
  const at::Tensor gram = at::bmm(wh.transpose(1, 2), wh);                                        // [H, Dv, Dv]
  const at::Tensor scale = gram.diagonal(0, 1, 2).amax(-1).clamp_min(std::numeric_limits<double>::min());
  const at::Tensor eye = at::eye(Dv, gram.options());
  auto factor = [&](double shift) {
    return at::linalg_cholesky_ex(gram + (scale * shift).view({H, 1, 1}) * eye, /*upper=*/false,
                                  /*check_errors=*/false);
  };
  const auto [l_tight, info] = factor(std::ldexp(1.0, -40));
  const at::Tensor l_loose = std::get<0>(factor(std::ldexp(1.0, -20)));
  at::Tensor lt = at::where((info == 0).view({H, 1, 1}), l_tight, l_loose).transpose(1, 2);  // L^T
  const at::Tensor c = at::exp2(at::round(at::log2(lt.abs().amax({1, 2}).clamp_min(1e-30))));  // [H]
  lt = lt / c.view({H, 1, 1});
  const at::Tensor hi = lt.to(weight_o.scalar_type());
  const at::Tensor lo = (lt - hi.to(at::kDouble)).to(weight_o.scalar_type());
  return {at::cat({hi, lo}, 2).contiguous(), (c * c).to(at::kFloat)};  // [H, Dv, 2 Dv], [H]
}

// return_stats on tensor cores (16-bit z): z_norm and out_norm [B, Q, H] from the
// statistics pass (head_merge_fwd_tc_kernel<T, _, true>) and the finalize kernel.
template <typename T>
void launch_stats_tc(const at::Tensor& z, const at::Tensor& weight_o, const Gate& gate, const Shape& s,
                     at::Tensor& z_norm, at::Tensor& out_norm) {
  TORCH_CHECK_VALUE(s.heads <= 65535, "headwise.head_merge: return_stats on tensor cores takes at most 65535 heads, "
                    "got H = ", s.heads);
  const std::pair<at::Tensor, at::Tensor> operands = stats_operands(weight_o, s);
  const at::Tensor& wcat = operands.first;
  const at::Tensor& scale2 = operands.second;
  tc::TcFwdParams p{};
  p.z = z.data_ptr();
  p.z_sb = z.stride(0);
  p.z_sh = 0;  // both pseudo-heads (hi, lo) read Z_hs
  p.z_sq = z.stride(2);
  p.w = wcat.data_ptr();
  p.ldw = 2 * s.dv;
  p.bias = nullptr;
  p.gate = Gate{nullptr, 0, 2, false};
  p.out = nullptr;
  p.batch = s.batch;
  p.heads = 2;
  p.seq = s.seq;
  p.dv = s.dv;
  p.d = s.dv;
  p.q_tiles = (s.seq + tc::kBM - 1) / tc::kBM;
  p.n_tiles = (s.dv + tc::kBN - 1) / tc::kBN;
  p.stats_z_sh = z.stride(1);
  p.stats_w_sh = s.dv * 2 * s.dv;
  p.stats_heads = s.heads;
  p.stats_gate = gate;
  p.stats_scale2 = scale2.data_ptr<float>();
  at::Tensor part = new_output({p.n_tiles, s.batch, s.seq, s.heads}, z_norm.options());
  p.zsq = z_norm.data_ptr<float>();
  p.osq_part = part.data_ptr<float>();
  const uint64_t es = static_cast<uint64_t>(z.element_size());
  const int bytes = copy_bytes_for({z_stride_bits(z, s), reinterpret_cast<uintptr_t>(wcat.data_ptr()),
                                    static_cast<uint64_t>(s.dv) * es, static_cast<uint64_t>(p.ldw) * es});
  const dim3 grid(static_cast<unsigned>(s.batch * p.q_tiles * p.n_tiles), static_cast<unsigned>(s.heads));
  const size_t smem = tc::fwd_smem_bytes(2);
  with_copy_bytes<T>(bytes, [&](auto width) {
    auto kernel = &tc::head_merge_fwd_tc_kernel<T, decltype(width)::value, true>;
    hw::allow_dynamic_smem("head_merge", kernel, smem);
    HW_LAUNCH("head_merge_stats_tc", kernel, grid, dim3(tc::kThreads), smem, p);
  });
  finalize_stats(z_norm, part, out_norm, p.n_tiles);
}

// The batch rows a CTA of tc::head_merge_row_sort_kernel sorts: tc::kSortChunk, or
// HEADWISE_MERGE_ROW_SORT_CHUNK (a power of two from 2 to kSortChunk), with which the tests
// run the sort-and-rank path at a small B.
inline int row_sort_chunk() {
  return static_cast<int>(hw::env_int("HEADWISE_MERGE_ROW_SORT_CHUNK", tc::kSortChunk, 2, tc::kSortChunk, true));
}

// Launches the tensor-core grad_z (+ c partials) and grad_weight_o kernels (16-bit types).
// `base`: the SIMT kernels' parameters, which the tensor-core ones extend by their tile
// counts (c_part sized for the tensor-core tiles).
template <typename T>
void launch_bwd_tc(const BwdParams& base, const at::Tensor& dy, const at::Tensor& z, const at::Tensor& w,
                   const Shape& s) {
  tc::TcBwdParams p{};
  static_cast<BwdParams&>(p) = base;
  p.q_tiles = (s.seq + tc::kBM - 1) / tc::kBM;
  p.dv_tiles = (s.dv + tc::kBN - 1) / tc::kBN;
  p.d_tiles = (s.d + tc::kBM - 1) / tc::kBM;
  const uint64_t es = sizeof(T);
  const uint64_t dy_bits = reinterpret_cast<uintptr_t>(dy.data_ptr()) | static_cast<uint64_t>(s.d) * es;
  const int dz_bytes = copy_bytes_for({dy_bits, reinterpret_cast<uintptr_t>(w.data_ptr()),
                                       s.heads > 1 ? static_cast<uint64_t>(s.dv) * es : 0,
                                       s.d > 1 ? static_cast<uint64_t>(w.stride(0)) * es : 0});
  const int dw_bytes = copy_bytes_for({dy_bits, z_stride_bits(z, s)});
  // A [B, H] gate: each head's open batch rows in ascending |gate| order, for grad_weight_o
  // (merge_tc_kernel.cuh, head_merge_row_sort_kernel).
  at::Tensor row_order, sorted_keys;
  if (p.gate.g != nullptr && p.gate.g_sb != 0 && s.batch > 1) {
    const int chunk = row_sort_chunk();
    const int64_t chunks = cdiv(s.batch, chunk);
    row_order = at::empty({s.heads, s.batch}, z.options().dtype(at::kInt));
    if (chunks > 1) sorted_keys = at::empty({s.heads, chunks, chunk}, z.options().dtype(at::kLong));
    uint64_t* keys = chunks > 1 ? reinterpret_cast<uint64_t*>(sorted_keys.data_ptr<int64_t>()) : nullptr;
    const unsigned heads = static_cast<unsigned>(s.heads);
    auto sort = &tc::head_merge_row_sort_kernel;
    HW_LAUNCH("head_merge_row_sort", sort, dim3(static_cast<unsigned>(chunks), heads), dim3(tc::kSortThreads), 0,
              p.gate, s.batch, chunk, keys, row_order.data_ptr<int>());
    if (chunks > 1) {
      auto rank = &tc::head_merge_row_rank_kernel;
      HW_LAUNCH("head_merge_row_rank", rank, dim3(cdiv(s.batch, tc::kThreads), heads), dim3(tc::kThreads), 0,
                p.gate, s.batch, chunk, static_cast<int>(chunks), static_cast<const uint64_t*>(keys),
                row_order.data_ptr<int>());
    }
    p.row_order = row_order.data_ptr<int>();
  }
  with_copy_bytes<T>(dz_bytes, [&](auto bytes) {
    auto kernel = &tc::head_merge_bwd_dz_tc_kernel<T, decltype(bytes)::value>;
    hw::allow_dynamic_smem("head_merge_backward", kernel, tc::kSmemBytes);
    HW_LAUNCH("head_merge_bwd_dz_tc", kernel, dim3(static_cast<unsigned>(s.batch * s.heads * p.q_tiles * p.dv_tiles)),
              dim3(tc::kThreads), tc::kSmemBytes, p);
  });
  with_copy_bytes<T>(dw_bytes, [&](auto bytes) {
    auto kernel = &tc::head_merge_bwd_dw_tc_kernel<T, decltype(bytes)::value>;
    hw::allow_dynamic_smem("head_merge_backward", kernel, tc::kSmemBytes);
    HW_LAUNCH("head_merge_bwd_dw_tc", kernel, dim3(static_cast<unsigned>(s.heads * p.d_tiles * p.dv_tiles)),
              dim3(tc::kThreads), tc::kSmemBytes, p);
  });
}

}  // namespace

// The forward's path, one rule for both builds (the emulated build has no library GEMM):
//   kLibraryGemm  (CUDA build) no gate and no stats: y = Z2 @ weight_o^T + bias by cuBLAS
//                 (at::addmm), Z2 = Z as [B*Q, H*Dv]. Token-major Z (a transposed view of
//                 [B, Q, H, Dv] memory) is that matrix already, read with no copy; other
//                 layouts are gathered into it first (one copy, eager's concatenation).
//                 The plain merge has no head to skip and no statistic, so the hand kernel
//                 could only match cuBLAS (which uses wgmma on sm_90, mma.sync cannot).
//   kTensorCore   bf16/f16, or fp32 without stats when torch lets matmuls use TF32
//                 (hw::cuda_matmul_allows_tf32: fp32_precision "tf32", allow_tf32, or a
//                 float32 matmul precision below "highest"): head_merge_fwd_tc_kernel
//                 (merge_tc_kernel.cuh).
//   kSimt         fp32 in full precision, and fp32 with stats: head_merge_fwd_kernel.
// bf16/f16 stats come from a second tensor-core pass beside either of the first two paths
// (launch_stats_tc), never from the SIMT kernel.
enum class FwdPath { kLibraryGemm, kTensorCore, kSimt };

// Whether the library-GEMM paths (forward kLibraryGemm, the ungated backward) are taken:
// always in the CUDA build; in the emulated build (which otherwise runs the hand kernels
// only) when HEADWISE_SIM_LIBRARY_GEMM=1, so that the tests check those paths' layouts
// and in-place writes on the CPU.
inline bool library_gemm_paths() { return !HW_SIM || hw::sim_flag("HEADWISE_SIM_LIBRARY_GEMM"); }

inline FwdPath fwd_path(bool library_gemm, at::ScalarType dtype, bool allow_tf32, bool gated, bool stats) {
  const bool half = dtype != at::kFloat;
  if (library_gemm && !gated && (!stats || half)) return FwdPath::kLibraryGemm;
  if (half || (!stats && allow_tf32)) return FwdPath::kTensorCore;
  return FwdPath::kSimt;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> HW_MERGE_ENTRY(head_merge)(
    const at::Tensor& z, const at::Tensor& weight_o, const c10::optional<at::Tensor>& bias,
    const c10::optional<at::Tensor>& head_gate, bool rescale, bool return_stats) {
  HW_OP_RANGE("headwise::head_merge");
  constexpr const char* op = "head_merge";
  const Shape s = check_merge_args(op, z, weight_o, head_gate);
  if (bias.has_value()) check_bias(op, *bias, z, s);
  check_backend(z, s, op);
  const at::OptionalDeviceGuard device_guard(z.device());
  const auto f32 = z.options().dtype(at::kFloat);
  at::Tensor out = new_output({s.batch, s.seq, s.d}, z.options());
  at::Tensor z_norm = return_stats ? new_output({s.batch, s.seq, s.heads}, f32) : at::empty({0}, f32);
  at::Tensor out_norm = return_stats ? new_output({s.batch, s.seq, s.heads}, f32) : at::empty({0}, f32);
  if (s.rows() == 0) return {out, z_norm, out_norm};

  const at::Tensor gate32 = gate_as_float(head_gate);
  const at::Tensor w = weight_o;  // rows stride-1 (checked); row stride = ldw
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  // torch's TF32 setting matters for fp32 only.
  const bool allow_tf32 = z.scalar_type() == at::kFloat && hw::cuda_matmul_allows_tf32();
  const FwdPath path = fwd_path(library_gemm_paths(), z.scalar_type(), allow_tf32, head_gate.has_value(), return_stats);
  if (path != FwdPath::kSimt) {
    if (path == FwdPath::kLibraryGemm) {
      const at::Tensor z2 = token_major(z, s);
      at::Tensor y = out.view({s.rows(), s.d});
      if (b.defined())
        at::addmm_out(y, b, z2, w.t());
      else
        at::mm_out(y, z2, w.t());
    }
    dispatch_storage_dtype(z.scalar_type(), op, "z", [&](auto tag) {
      using T = decltype(tag);
      if (path == FwdPath::kTensorCore) launch_fwd_tc<T>(z, w, b, make_gate(gate32, s, rescale), s, out);
      if constexpr (sizeof(T) == 2)
        if (return_stats) launch_stats_tc<T>(z, w, make_gate(gate32, s, false), s, z_norm, out_norm);
    });
    return {out, z_norm, out_norm};
  }
  const int64_t n_tiles = cdiv(s.d, kBN);
  at::Tensor part = return_stats ? new_output({n_tiles, s.batch, s.seq, s.heads}, f32) : at::Tensor();

  FwdParams p{};
  set_operands(p, z, w.data_ptr(), w.stride(0), make_gate(gate32, s, rescale), s);
  p.bias = b.defined() ? b.data_ptr() : nullptr;
  p.out = out.data_ptr();
  p.znorm_sq = return_stats ? z_norm.data_ptr<float>() : nullptr;
  p.onorm_part = return_stats ? part.data_ptr<float>() : nullptr;
  const dim3 grid(static_cast<unsigned>(s.batch * n_tiles), cdiv(s.seq, kBM));
  dispatch_storage_dtype(z.scalar_type(), op, "z", [&](auto tag) {
    using T = decltype(tag);
    auto kernel = &head_merge_fwd_kernel<T>;
    HW_LAUNCH("head_merge_fwd", kernel, grid, dim3(kThreads), 0, p);
  });
  if (return_stats) finalize_stats(z_norm, part, out_norm, n_tiles);
  return {out, z_norm, out_norm};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> HW_MERGE_ENTRY(head_merge_backward)(
    const at::Tensor& grad_out, const at::Tensor& z, const at::Tensor& weight_o,
    const c10::optional<at::Tensor>& head_gate, bool rescale, bool bias_grad, bool gate_grad) {
  HW_OP_RANGE("headwise::head_merge_backward");
  constexpr const char* op = "head_merge_backward";
  const Shape s = check_merge_args(op, z, weight_o, head_gate);
  check_grad_out(op, grad_out, z, s);
  check_backend(z, s, op);
  const at::OptionalDeviceGuard device_guard(z.device());
  const at::Tensor dy = grad_out.contiguous();
  const at::Tensor gate32 = gate_as_float(head_gate);
  const bool need_c = gate_grad && head_gate.has_value();
  at::Tensor grad_z = empty_like_layout(z, z.options());
  if (poison_outputs()) grad_z.fill_(std::numeric_limits<double>::quiet_NaN());
  at::Tensor grad_w = new_output({s.d, s.k()}, z.options());
  at::Tensor grad_b = bias_grad ? new_output({s.d}, z.options()) : at::empty({0}, z.options());
  at::Tensor grad_gate = at::empty({0}, z.options());
  if (s.rows() == 0) {
    grad_w.zero_();
    if (bias_grad) grad_b.zero_();
    if (need_c) grad_gate = at::zeros(head_gate->sizes(), head_gate->options());
    return {grad_z, grad_w, grad_b, grad_gate};
  }
  if (library_gemm_paths() && !head_gate.has_value()) {
    // Ungated, in the CUDA build: the plain merge's backward is two library GEMMs, which
    // cuBLAS runs faster than the hand kernels (on the H200 the tensor-core grad_z and
    // grad_weight_o took 4.6 ms where cuBLAS's two products take ~1.4 ms), and a sum:
    //   grad_z [B*Q, K] = dy [B*Q, D] @ weight_o, in z's layout: written in place when z is
    //                     token-major (its [B, Q, H, Dv] view is contiguous), else one copy;
    //   grad_w [D, K]   = dy^T @ Z2, Z2 = z as [B*Q, K] (a view when token-major, else the
    //                     forward's gather);
    //   grad_b [D]      = the column sums of dy (torch's fixed-order reduction).
    // cuBLAS is deterministic run to run on one GPU model; no atomics are involved.
    const at::Tensor dy2 = dy.view({s.rows(), s.d});
    at::Tensor gz_tokens = grad_z.transpose(1, 2);  // [B, Q, H, Dv] view of grad_z's memory
    if (gz_tokens.is_contiguous()) {
      at::Tensor gz2 = gz_tokens.view({s.rows(), s.k()});
      at::mm_out(gz2, dy2, weight_o);
    } else {
      gz_tokens.copy_(at::mm(dy2, weight_o).view({s.batch, s.seq, s.heads, s.dv}));
    }
    at::mm_out(grad_w, dy2.t(), token_major(z, s));
    if (bias_grad) at::sum_out(grad_b, dy2, {0});
    return {grad_z, grad_w, grad_b, grad_gate};
  }
  // bf16/f16: the tensor-core kernels (merge_tc_kernel.cuh); fp32: the SIMT kernels.
  const bool tensor_cores = z.scalar_type() != at::kFloat;
  const unsigned dv_tiles = cdiv(s.dv, kBN), q_tiles = cdiv(s.seq, kBM);
  const int64_t parts = tensor_cores ? static_cast<int64_t>(cdiv(s.seq, tc::kBM)) * cdiv(s.dv, tc::kBN)
                                     : static_cast<int64_t>(q_tiles) * dv_tiles;
  at::Tensor c_part = need_c ? new_output({s.batch, s.heads, parts}, z.options().dtype(at::kFloat)) : at::Tensor();
  BwdParams p{};
  set_operands(p, z, weight_o.data_ptr(), weight_o.stride(0), make_gate(gate32, s, rescale), s);
  p.grad_out = dy.data_ptr();
  p.grad_z = grad_z.data_ptr();
  p.gz_sb = grad_z.stride(0);
  p.gz_sh = grad_z.stride(1);
  p.gz_sq = grad_z.stride(2);
  p.grad_w = grad_w.data_ptr();
  p.c_part = need_c ? c_part.data_ptr<float>() : nullptr;
  dispatch_storage_dtype(z.scalar_type(), op, "z", [&](auto tag) {
    using T = decltype(tag);
    if constexpr (sizeof(T) == 2) launch_bwd_tc<T>(p, dy, z, weight_o, s);
    if (!tensor_cores) {
      auto dz = &head_merge_bwd_dz_kernel<T>;
      HW_LAUNCH("head_merge_bwd_dz", dz, dim3(static_cast<unsigned>(s.batch * s.heads * dv_tiles), q_tiles),
                dim3(kThreads), 0, p);
      auto dw = &head_merge_bwd_dw_kernel<T>;
      HW_LAUNCH("head_merge_bwd_dw", dw, dim3(dv_tiles, cdiv(s.d, kBM), static_cast<unsigned>(s.heads)),
                dim3(kThreads), 0, p);
    }
    if (bias_grad) {
      const int64_t chunks = cdiv(s.rows(), kBiasRows);
      at::Tensor part = new_output({chunks, s.d}, z.options().dtype(at::kFloat));
      // 16-byte loads when every row of dy starts 16-byte aligned (dy is contiguous).
      constexpr int E = 16 / static_cast<int>(sizeof(T));
      const bool vec = s.d % E == 0 && reinterpret_cast<uintptr_t>(dy.data_ptr()) % 16 == 0;
      const auto launch_partial = [&](auto width) {
        constexpr int V = decltype(width)::value;
        auto db = &head_merge_bwd_bias_partial_kernel<T, V>;
        HW_LAUNCH("head_merge_bwd_bias", db, dim3(static_cast<unsigned>(chunks), cdiv(s.d, 32 * V)), dim3(kThreads),
                  0, static_cast<const T*>(dy.data_ptr()), part.data_ptr<float>(), s.rows(), s.d);
      };
      if (vec) launch_partial(std::integral_constant<int, E>{});
      else launch_partial(std::integral_constant<int, 1>{});
      auto fin = &head_merge_bwd_bias_finalize_kernel<T>;
      HW_LAUNCH("head_merge_bwd_bias_finalize", fin, dim3(cdiv(s.d, 32)), dim3(kThreads), 0, part.data_ptr<float>(),
                static_cast<T*>(grad_b.data_ptr()), chunks, s.d);
    }
  });
  if (need_c) {
    at::Tensor gg = new_output({s.batch, s.heads}, z.options().dtype(at::kFloat));
    auto kernel = &head_merge_gate_grad_kernel;
    HW_LAUNCH("head_merge_gate_grad", kernel, dim3(static_cast<unsigned>(s.batch)), dim3(kThreads), 0, p.gate,
              c_part.data_ptr<float>(), parts, gg.data_ptr<float>());
    if (head_gate->dim() == 1) gg = gg.sum(0);  // torch's reduction: fixed order for a fixed shape
    grad_gate = gg.to(head_gate->scalar_type());
  }
  return {grad_z, grad_w, grad_b, grad_gate};
}

}  // namespace merge
}  // namespace headwise
