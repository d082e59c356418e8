// Host side of the DCMHA kernels shared by the backend entries of dcmha_ops.h: checks,
// parameters, shared-memory layouts, query chunks and scratch. Each entry is in a header of
// its own (dcmha_compose_launch.h, dcmha_compose_backward_launch.h, dcmha_attention_launch.h,
// dcmha_attention_backward_launch.h), compiled once as the CUDA backend (<header>_cuda.cu,
// nvcc) and once as the emulated backend (<header>_sim.cpp, host compiler against the SIMT
// emulator), so both run the same launch logic; one translation unit an entry keeps each
// compile short (the attention backward's kernels took most of one file's compile).
#pragma once

#include "../common/backend_device.h"
#include "../common/dispatch.h"
#include "../common/env_settings.h"
#include "../common/op_range.h"
#include "../common/outputs.h"
#include "../common/tf32_policy.h"
#include "dcmha_args.h"
#include "dcmha_attention_kernel.cuh"
#include "dcmha_attention_mma_kernel.cuh"
#include "dcmha_kernel.cuh"
#include "dcmha_ops.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <tuple>
#include <type_traits>
#include <vector>

namespace headwise {
namespace dcmha {
#define HW_DCMHA_ENTRY(name) HW_BACKEND_ENTRY(name)
namespace {
using hw::kBackendDevice;
using hw::on_backend_device;

// The checks every DCMHA backend entry makes of its first operand `tensor`, named `name` (a for
// the compose entries, q for the attention entries): it lives on this backend's device, holds a
// storage dtype, and spans at most kMaxHeads heads. `kernel` names the family in the message.
inline void check_backend(const at::Tensor& tensor, const char* name, int64_t heads, const char* kernel,
                          const char* op) {
  TORCH_CHECK(on_backend_device(tensor), "headwise.", op, ": ", name, " is on ", tensor.device(), " but ",
              kBackendDevice);
  dispatch_storage_dtype(tensor.scalar_type(), op, name, [](auto) {});
  TORCH_CHECK_VALUE(heads <= kMaxHeads, "headwise.", op, ": H = ", heads, " exceeds the most heads of the CUDA ",
                    kernel, " kernel (", kMaxHeads, ")");
}

// The fields the compose and the attention parameters share: the fp32 weights w1, w2, g and
// B, T, H, hg = H / head_groups.
template <class Params>
inline void set_weights(Params& p, const at::Tensor& w1, const at::Tensor& w2, const at::Tensor& g, int64_t batch,
                        int64_t seq, int64_t heads, int64_t head_groups) {
  p.w1 = w1.data_ptr<float>();
  p.w2 = w2.data_ptr<float>();
  p.g = g.data_ptr<float>();
  p.B = static_cast<int>(batch);
  p.T = static_cast<int>(seq);
  p.H = static_cast<int>(heads);
  p.hg = static_cast<int>(heads / head_groups);
}

inline ComposeParams make_params(const Shape& s, const at::Tensor& w1, const at::Tensor& w2, const at::Tensor& g,
                                 int64_t slot) {
  ComposeParams p{};
  set_weights(p, w1, w2, g, s.batch, s.seq, s.heads, s.head_groups);
  p.cq = static_cast<int>(2 * slot);
  p.ck = p.cq + 1;
  p.wvec16 = reinterpret_cast<uintptr_t>(p.w1) % 16 == 0 && reinterpret_cast<uintptr_t>(p.w2) % 16 == 0 &&
             reinterpret_cast<uintptr_t>(p.g) % 16 == 0;
  return p;
}

inline int64_t round16(int64_t bytes) { return (bytes + 15) / 16 * 16; }

inline int64_t column_block_bytes(int64_t len) {  // stage_column_block's [128, column_pitch(len)] floats
  return static_cast<int64_t>(kComposeColumns) * (len % 4 == 0 ? len + 4 : len | 1) * 4;
}

// Shared-memory layout of the tile kernels (dcmha_kernel.cuh): `lead` bytes first (the
// key-side kernel's weights), then a ring of `stages` stages of `rows` rows, each row
// `ntiles` [H, pitch] tiles + qw [H][4] + qk [H][4] floats, at least `staging` bytes (the
// column weight blocks staged there at the start); then `scratch_per_row * rows + scratch`
// bytes of group totals. Fills p's layout fields and returns the dynamic shared bytes.
inline int64_t compose_layout(ComposeParams& p, int64_t elem, int ntiles, int rows, int stages, int64_t lead,
                              int64_t staging, int64_t scratch_per_row, int64_t scratch) {
  const int64_t H = p.H;
  p.pitch = static_cast<int>(kComposeColumns + 16 / elem);
  p.tile_bytes = static_cast<int>(H * p.pitch * elem);
  p.row_bytes = static_cast<int>(ntiles * p.tile_bytes + 32 * H);  // + qw, qk [H][4] floats
  p.rows_per_step = rows;
  p.stage_bytes = rows * p.row_bytes;
  const int64_t ring = std::max<int64_t>(static_cast<int64_t>(stages) * p.stage_bytes, staging);
  p.scratch_offset = static_cast<int>(lead + ring);
  return lead + ring + round16(scratch_per_row * rows + scratch);
}

// 2 where the shared memory layout(2) fits the device's opt-in limit, else 1: rows a stage of
// the compose kernels, buffers of the attention backward's streamed tiles, heads a rowsum CTA.
inline int two_where_it_fits(const std::function<int64_t(int)>& layout) {
  return layout(2) <= static_cast<int64_t>(hw::max_dynamic_smem_optin()) ? 2 : 1;
}

// Whether `kernel` launches with `bytes` of dynamic shared memory on this device: with its
// static arrays, within the opt-in limit (where it does not, the compose runs by library
// products, dcmha_compose_library.h).
template <typename Kernel>
inline bool block_fits(Kernel kernel, int64_t bytes) {
  return static_cast<size_t>(bytes) + hw::static_smem_bytes(kernel) <= hw::max_dynamic_smem_optin();
}

// The forward's / bwd_query's layout; rows per stage 2 where it fits the device, else 1.
inline int64_t fit_rows(const std::function<int64_t(int)>& layout) { return layout(two_where_it_fits(layout)); }

inline bool aligned16_ptr(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// A window of at least T keeps every pair a window can keep (s > t - W for all t, s < T),
// causal or not: 0 (none) there, so the kernels' int arithmetic (s + W, t - W) cannot overflow.
inline int64_t effective_window(int64_t window, int64_t T) { return window >= T ? 0 : window; }

// The attention kernels' parameters of one call (contiguous q, k, v; fp32 weights), out
// and stats left null: the forward entry and both backward paths start from these.
inline AttnParams attention_params(const AttnShape& s, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& w1, const at::Tensor& w2, const at::Tensor& g, bool causal,
                                   int64_t window, double scale) {
  AttnParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  set_weights(p, w1, w2, g, s.batch, s.seq, s.heads, s.head_groups);
  p.dh = static_cast<int>(s.head_dim);
  p.dv = static_cast<int>(s.v_dim);
  p.causal = causal ? 1 : 0;
  p.window = static_cast<int>(effective_window(window, s.seq));
  p.scale = static_cast<float>(scale);
  return p;
}

// A head dim padded to the mma k of 16.
inline int pad16(int64_t d) { return static_cast<int>((d + 15) / 16 * 16); }

}  // namespace

namespace {
inline bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Rows of a query chunk of a buffer of row_bytes per query row: a multiple of 64 keeping it
// under kScratchBytes (HEADWISE_DCMHA_SCRATCH_BYTES overrides it, for tests of the chunk
// loops), at least 64, at most T rounded up to 64. The backward relies on the multiple: its
// key kernel's 32-row query tiles then lie within one chunk, so the weights table's D rows
// they read were written by this chunk's combine or lie past T (zero-filled copies). The
// table is not zeroed, and 0 * a stale NaN would reach the slot gradients.
inline int64_t chunk_rows_under_cap(int64_t T, int64_t row_bytes) {
  const int64_t tiles = (T + kTileRows - 1) / kTileRows;
  const int64_t cap = hw::env_int("HEADWISE_DCMHA_SCRATCH_BYTES", kScratchBytes, 1);
  return std::min(tiles, std::max<int64_t>(1, cap / (row_bytes * kTileRows))) * kTileRows;
}

// Rows of a query chunk of the tensor-core kernels' scratch, B G words chunk T words of
// PartWordOf<T> for inputs of elem bytes.
inline int64_t query_chunk_rows(const AttnParams& p, int64_t words, int elem) {
  return chunk_rows_under_cap(p.T, static_cast<int64_t>(p.B) * (p.H / p.hg) * words * p.T * part_word_bytes(elem));
}

// The tensor-core kernels' scratch [B G, words, chunk, T] of PartWordOf<T> (as int32 / int64
// for inputs of elem bytes), zero-filled where asked.
inline at::Tensor part_scratch(const AttnParams& p, int64_t words, int64_t chunk, int elem,
                               const at::TensorOptions& opt, bool zeroed) {
  const at::TensorOptions o = opt.dtype(part_word_bytes(elem) == 8 ? at::kLong : at::kInt);
  const std::vector<int64_t> shape{static_cast<int64_t>(p.B) * (p.H / p.hg), words, chunk, p.T};
  return zeroed ? at::zeros(shape, o) : at::empty(shape, o);
}

// Whether the row tiles move in 16-byte chunks (AttnParams vec16): dh and dv multiples of a
// chunk's elements and every one of `rows` (q, k, v and the row-shaped outputs or gradients)
// 16-byte aligned.
inline int rows_vec16(const AttnParams& p, int elem, std::initializer_list<const void*> rows) {
  const int chunk_elems = 16 / elem;
  return p.dh % chunk_elems == 0 && p.dv % chunk_elems == 0 &&
         std::all_of(rows.begin(), rows.end(), [](const void* ptr) { return aligned16(ptr); });
}

// Whether the forward takes the tensor-core kernels (dcmha_attention_mma_kernel.cuh): bf16 /
// fp16, and fp32 where torch lets its own float32 matmuls use TF32 (as the head merge
// decides, merge_launch.h), with dv <= 128, where their shared memory
// fits the device (the sweeps' row statistics grow with hg, 0.5 KiB a head; fp32 tiles are
// twice the bytes) and their grids fit CUDA's limits (B * groups on z). fp32 at full
// precision, wider dv and the rest take the SIMT kernel. The backward asks it too: after a
// TF32 forward it reads q, k, v as the tensor cores did (tf32_operand).
inline bool forward_takes_tensor_cores(const AttnShape& s, const AttnParams& p, at::ScalarType dtype, int dh_pad,
                                       int dv_pad) {
  const size_t smem_limit = hw::max_dynamic_smem_optin();
  const int elem = static_cast<int>(c10::elementSize(dtype));
  return (dtype != at::kFloat || hw::cuda_matmul_allows_tf32()) && dv_pad <= 128 &&
         static_cast<size_t>(mma_loop_smem_bytes(p.hg, dh_pad, elem)) <= smem_limit &&
         static_cast<size_t>(mma_out_smem_bytes(dh_pad, dv_pad, elem)) <= smem_limit &&
         s.batch * s.head_groups <= 65535 && s.batch <= 65535 && s.heads <= 65535 &&
         (s.seq + kTileRows - 1) / kTileRows <= 65535;
}

// x (fp32, contiguous) with the low 13 mantissa bits of every element cleared: the operand
// as a TF32 tensor core reads it. The fp32 backward after a TF32 forward forms its scores
// from these, so its logits are the forward's (their products are exact in fp32, only the
// accumulation order differs) and P is normalized by the forward's statistics; from the
// full-precision inputs the logits would differ by TF32's rounding and P by up to a few
// percent (the gradients' error was 3-5e-2 in the emulated tests).
// A NaN whose payload lies in those bits alone stays a NaN (cleared, it would read as an inf).
inline at::Tensor tf32_operand(const at::Tensor& x) {
  return at::where(x.isnan(), x, x.view(at::kInt).bitwise_and(static_cast<int64_t>(~0x1fff)).view(at::kFloat));
}

// The grid of the weights transposes (dcmha_attn_weights_t, dcmha_attn_grads_untranspose):
// (32 rows, b, 128 of the 20 H columns).
inline dim3 transpose_grid(const AttnParams& p) {
  return dim3(static_cast<unsigned>((p.T + kTransposeRows - 1) / kTransposeRows), static_cast<unsigned>(p.B),
              static_cast<unsigned>((kWeightFields * p.H + kTransposeCols - 1) / kTransposeCols));
}

// Whether dcmha_attn_weights_t reads the weights in 16-byte chunks: w1, w2, g 16-byte
// aligned (their rows are: 8 H, 8 H, 4 H floats).
inline int weights_vec4(const AttnParams& p) {
  return aligned16(p.w1) && aligned16(p.w2) && aligned16(p.g) ? 1 : 0;
}

// Query tiles of the chunk of rows [c0, c0 + rows) of a sequence of T rows.
inline unsigned query_tiles(int64_t T, int64_t c0, int64_t rows) {
  return static_cast<unsigned>((std::min<int64_t>(rows, T - c0) + kTileRows - 1) / kTileRows);
}

// The blocks of `keys` keys that hold the key band of the rows [c0, c0 + rows): a grid x
// over key blocks (the sweeps' splits, the key kernels' tiles), the first one in first (the
// CTAs of the blocks outside the band would have no work).
inline unsigned band_key_blocks(const AttnParams& p, int64_t c0, int64_t rows, int keys, int& first) {
  int lo, hi;
  key_band(static_cast<int>(c0), static_cast<int>(std::min<int64_t>(rows, p.T - c0)), p.T, p.causal, p.window, lo,
           hi);
  first = lo / keys;
  return static_cast<unsigned>((hi + keys - 1) / keys - first);
}

}  // namespace

}  // namespace dcmha
}  // namespace headwise
