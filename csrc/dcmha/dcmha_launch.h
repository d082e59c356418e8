// Host side of the DCMHA compose and fused attention (forward) kernels: checks, launches, and the backend entries of
// dcmha_ops.h. Compiled once as the CUDA backend (dcmha_cuda.cu, nvcc) and once as the
// emulated backend (dcmha_sim.cpp, host compiler against the SIMT emulator).
#pragma once

#include "../common/backend_device.h"
#include "../common/dispatch.h"
#include "../common/op_range.h"
#include "../common/outputs.h"
#include "../common/tf32_policy.h"
#include "dcmha_args.h"
#include "dcmha_attention_bwd_kernel.cuh"
#include "dcmha_attention_kernel.cuh"
#include "dcmha_attention_mma_bwd_kernel.cuh"
#include "dcmha_attention_mma_kernel.cuh"
#include "dcmha_kernel.cuh"
#include "dcmha_ops.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
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

inline void check_backend(const at::Tensor& a, const Shape& s, const char* op) {
  TORCH_CHECK(on_backend_device(a), "headwise.", op, ": a is on ", a.device(), " but ", kBackendDevice);
  dispatch_storage_dtype(a.scalar_type(), op, "a", [](auto) {});
  TORCH_CHECK_VALUE(s.heads <= kMaxHeads, "headwise.", op, ": H = ", s.heads,
                    " exceeds the most heads of the CUDA compose kernel (", kMaxHeads, ")");
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
// loops), at least 64, at most T rounded up to 64.
inline int64_t chunk_rows_under_cap(int64_t T, int64_t row_bytes) {
  const int64_t tiles = (T + kTileRows - 1) / kTileRows;
  int64_t cap = kScratchBytes;
  if (const char* env = std::getenv("HEADWISE_DCMHA_SCRATCH_BYTES")) cap = std::max<int64_t>(1, std::atoll(env));
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

// The tensor-core forward (bf16 / fp16, and fp32 as TF32 with 64-bit scratch words): transposed weights, then per query chunk the
// statistics sweep (which stores a, b of the chunk in the scratch), its combine, the partials
// sweep (c, d: one sweep over the heads a key tile where it would take two) and the output.
// The chunk keeps the scratch (B G 4 words a (t, s)) and split_stats (B H 2 splits fp32 a
// row) under the cap: 1024 rows at B = 8, H = 32, T = 4096. The statistics CTAs take 64-key
// splits (2 key tiles), so that a chunk's launch has CTAs enough however causal its band:
// with 256-key splits 512-row chunks' launches spread ~1.43x their balanced time, with
// 64-key ones ~1.10x, and ~1.05x at 1024 rows (python -m headwise.bench.launch_balance).
// p holds the forward's pointers and shape.
inline void launch_mma_attention(const AttnParams& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& out, int dh_pad, int dv_pad) {
  const int64_t groups = p.H / p.hg;
  const int64_t splits = (p.T + kStatsSplitKeys - 1) / kStatsSplitKeys;
  const int elem = static_cast<int>(q.element_size());
  const int64_t chunk = std::min(query_chunk_rows(p, kFwdPartWords, elem),
                                 chunk_rows_under_cap(p.T, static_cast<int64_t>(p.B) * p.H * 2 * splits * 4));
  const at::TensorOptions fopt = q.options().dtype(at::kFloat);
  at::Tensor wt = at::empty({p.B, p.H, kWeightFields, p.T}, fopt);
  MmaAttnParams mp{};
  mp.f = p;
  mp.wt = wt.data_ptr<float>();
  mp.wfields = kWeightFields;
  mp.pwords = kFwdPartWords;
  mp.ab_saved = 1;
  mp.dh_pad = dh_pad;
  mp.dv_pad = dv_pad;
  mp.vec16 = rows_vec16(p, elem, {q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()});
  const size_t wt_smem = static_cast<size_t>(transpose_smem_bytes());
  const size_t loop_smem = static_cast<size_t>(mma_loop_smem_bytes(p.hg, dh_pad, elem));
  const size_t out_smem = static_cast<size_t>(mma_out_smem_bytes(dh_pad, dv_pad, elem));
  const unsigned bg = static_cast<unsigned>(p.B * groups);
  dispatch_storage_dtype(q.scalar_type(), "dcmha_attention", "q", [&](auto tag) {
    using T = decltype(tag);
    auto kw = &dcmha_attn_weights_t;
    auto ks = &dcmha_attn_sweep<T, false>;
    auto kp = &dcmha_attn_sweep<T, true>;
    auto kc = &dcmha_attn_stats_combine;
    auto ko = dv_pad <= 32 ? &dcmha_attn_output<T, 4> : &dcmha_attn_output<T, 16>;
    hw::allow_dynamic_smem("dcmha_attention", kw, wt_smem);
    hw::allow_dynamic_smem("dcmha_attention", ks, loop_smem);
    hw::allow_dynamic_smem("dcmha_attention", kp, loop_smem);
    hw::allow_dynamic_smem("dcmha_attention", ko, out_smem);
    HW_LAUNCH("dcmha_attn_weights_t", kw, transpose_grid(p), dim3(kTransposeThreads), wt_smem, p,
              wt.data_ptr<float>(), kWeightFields, weights_vec4(p));
    // split_stats [splits, 2, B H, chunk] is indexed by the absolute split: the combine reads
    // the splits of each row's band.
    at::Tensor split_stats = at::empty({splits, 2, static_cast<int64_t>(p.B) * p.H, chunk}, fopt);
    at::Tensor partials = part_scratch(p, kFwdPartWords, chunk, elem, q.options(), false);
    mp.split_stats = split_stats.data_ptr<float>();
    mp.partials = static_cast<PartWord*>(partials.data_ptr());
    mp.chunk = static_cast<int>(chunk);
    for (int64_t c0 = 0; c0 < p.T; c0 += chunk) {
      mp.chunk0 = static_cast<int>(c0);
      const unsigned chunk_tiles = query_tiles(p.T, c0, chunk);
      const unsigned stats_splits = band_key_blocks(p, c0, chunk, kStatsSplitKeys, mp.split0);
      HW_LAUNCH("dcmha_attn_stats", ks, dim3(stats_splits, chunk_tiles, bg), dim3(kMmaThreads), loop_smem, mp);
      HW_LAUNCH("dcmha_attn_stats_combine", kc,
                dim3(chunk_tiles, static_cast<unsigned>(p.H), static_cast<unsigned>(p.B)), dim3(kTileRows), 0, mp);
      const unsigned chunk_splits = band_key_blocks(p, c0, chunk, kSweepSplitKeys, mp.split0);
      HW_LAUNCH("dcmha_attn_partials", kp, dim3(chunk_splits, chunk_tiles, bg), dim3(kMmaThreads),
                loop_smem, mp);
      HW_LAUNCH("dcmha_attn_output", ko, dim3(static_cast<unsigned>(p.H), chunk_tiles, static_cast<unsigned>(p.B)),
                dim3(kMmaThreads), out_smem, mp);
    }
  });
}

// Whether the tensor-core backward takes this call: bf16 / fp16, or fp32 after a TF32
// forward (forward_takes_tensor_cores: the same truncated operands; it reads torch's TF32
// setting, which must be the forward's: the autograd wrapper raises where it changed), dh and
// dv padded to at most 128 (the dq / dk / dv accumulators of a warp's 16 rows), every kernel's shared
// memory within the device's opt-in limit with its streamed tiles in one buffer where two do
// not fit (two_where_it_fits: at dh = dv = 128, fp32's dL' sweep and key kernel on sm_80's 163 KiB,
// bf16's on the 99 KiB parts, where the rowsum also takes one head a CTA), grids within
// CUDA's limits.
inline bool mma_backward_fits(const AttnShape& s, const AttnParams& p, at::ScalarType dtype, int dh_pad, int dv_pad) {
  const size_t limit = hw::max_dynamic_smem_optin();
  const int elem = static_cast<int>(c10::elementSize(dtype));
  const int64_t need =
      std::max({mma_loop_smem_bytes(p.hg, dh_pad, elem), bwd_sweep_smem_bytes(true, dh_pad, dv_pad, elem, 1),
                bwd_sweep_smem_bytes(false, dh_pad, dv_pad, elem, 1),
                bwd_rows_smem_bytes(dh_pad, dv_pad, 1, elem),
                bwd_keys_smem_bytes(dh_pad, dv_pad, elem, 1), transpose_smem_bytes()});
  return (dtype != at::kFloat || forward_takes_tensor_cores(s, p, dtype, dh_pad, dv_pad)) && dh_pad <= 128 &&
         dv_pad <= 128 && static_cast<size_t>(need) <= limit &&
         static_cast<int64_t>(p.B) * (p.H / p.hg) <= 65535 && p.B <= 65535 && p.H <= 65535 &&
         (static_cast<int64_t>(p.T) + kTileRows - 1) / kTileRows * kRowsumKeySplits <= 65535;
}

// 1 / Z of the forward's row sums Z (0 where Z = 0: a row with no kept key), correctly
// rounded as the forward's: the backward kernels multiply by it where they would divide.
inline at::Tensor inverse_row_sums(const at::Tensor& z) { return at::where(z > 0, z.reciprocal(), 0.0); }

// The tensor-core backward (dcmha_attention_mma_bwd_kernel.cuh): the weights table with
// the row statistics, then per query chunk the seven launches. dq is written; dk, dv are
// summed in fp32 over the chunks, the last chunk reading a key tile writing them in q's
// dtype; the weight grads go through the grads table to dw1, dw2, dg (fp32, every element
// written).
inline void launch_mma_attention_backward(const AttnParams& p, const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& v, const at::Tensor& dout, const at::Tensor& stats,
                                          at::Tensor& dq, at::Tensor& dk, at::Tensor& dv, at::Tensor& dw1,
                                          at::Tensor& dw2, at::Tensor& dg, int dh_pad, int dv_pad) {
  const int64_t groups = p.H / p.hg;
  const int elem = static_cast<int>(q.element_size());
  const int64_t chunk = query_chunk_rows(p, kBwdPartWords, elem);
  const at::TensorOptions fopt = q.options().dtype(at::kFloat);
  at::Tensor wt = at::empty({p.B, p.H, kBwdWeightFields, p.T}, fopt);
  wt.select(2, kFieldM).copy_(stats[0]);
  wt.select(2, kFieldInvZ).copy_(inverse_row_sums(stats[1]));
  // Zeroed: the key-tile kernels' lanes read (t, s) of other tiles' bands too (then drop
  // the values), and no read may be of uninitialized memory (compute-sanitizer initcheck).
  at::Tensor partials = part_scratch(p, kBwdPartWords, chunk, elem, q.options(), true);
  // Stored by the first chunk that reads a key tile, so not zeroed (dcmha_attn_bwd_keys).
  at::Tensor dk32 = at::empty(k.sizes(), fopt), dv32 = at::empty(v.sizes(), fopt);
  at::Tensor gt = at::zeros({p.B, p.H, kWeightFields, p.T}, fopt);
  const int64_t rowsum_pitch = (std::min<int64_t>(chunk, p.T) + 31) / 32 * 32;
  at::Tensor rowsum_parts =
      at::empty({static_cast<int64_t>(p.B) * p.H, kRowsumKeySplits, kRowsumFields, rowsum_pitch}, fopt);
  MmaAttnBwdParams bp{};
  bp.m.f = p;
  bp.m.wt = wt.data_ptr<float>();
  bp.m.partials = static_cast<PartWord*>(partials.data_ptr());
  bp.m.chunk = static_cast<int>(chunk);
  bp.m.wfields = kBwdWeightFields;
  bp.m.pwords = kBwdPartWords;
  bp.m.dh_pad = dh_pad;
  bp.m.dv_pad = dv_pad;
  bp.m.vec16 = rows_vec16(p, elem, {q.data_ptr(), k.data_ptr(), v.data_ptr(), dout.data_ptr(), dq.data_ptr()});
  bp.wt = wt.data_ptr<float>();
  bp.dout = dout.data_ptr();
  bp.dq = dq.data_ptr();
  bp.dk = dk32.data_ptr<float>();
  bp.dv = dv32.data_ptr<float>();
  bp.dk_out = dk.data_ptr();
  bp.dv_out = dv.data_ptr();
  bp.gt = gt.data_ptr<float>();
  bp.rowsum_parts = rowsum_parts.data_ptr<float>();
  bp.rowsum_pitch = static_cast<int>(rowsum_pitch);
  const size_t wt_smem = static_cast<size_t>(transpose_smem_bytes());
  const size_t loop_smem = static_cast<size_t>(mma_loop_smem_bytes(p.hg, dh_pad, elem));
  const int post_stages =
      two_where_it_fits([&](int st) { return bwd_sweep_smem_bytes(false, dh_pad, dv_pad, elem, st); });
  const int pre_stages =
      two_where_it_fits([&](int st) { return bwd_sweep_smem_bytes(true, dh_pad, dv_pad, elem, st); });
  const size_t post_smem = static_cast<size_t>(bwd_sweep_smem_bytes(false, dh_pad, dv_pad, elem, post_stages));
  const size_t pre_smem = static_cast<size_t>(bwd_sweep_smem_bytes(true, dh_pad, dv_pad, elem, pre_stages));
  // Two heads a rowsum CTA where the group's size and the words allow (rowsum_heads) and
  // their Q, dO tiles fit the device (not at dh = dv = 128 on the 99 KiB parts), else one.
  const int rs_heads = rowsum_heads(p.hg, elem) == 2
                           ? two_where_it_fits([&](int h) { return bwd_rows_smem_bytes(dh_pad, dv_pad, h, elem); })
                           : 1;
  const size_t rowsum_smem = static_cast<size_t>(bwd_rows_smem_bytes(dh_pad, dv_pad, rs_heads, elem));
  const size_t rows_smem = static_cast<size_t>(bwd_rows_smem_bytes(dh_pad, dv_pad, 1, elem));
  const int key_stages =
      two_where_it_fits([&](int st) { return bwd_keys_smem_bytes(dh_pad, dv_pad, elem, st); });
  const size_t keys_smem = static_cast<size_t>(bwd_keys_smem_bytes(dh_pad, dv_pad, elem, key_stages));
  const unsigned bg = static_cast<unsigned>(p.B * groups), H = static_cast<unsigned>(p.H),
                 B = static_cast<unsigned>(p.B);
  dispatch_storage_dtype(q.scalar_type(), "dcmha_attention_backward", "q", [&](auto tag) {
    using T = decltype(tag);
    auto kw = &dcmha_attn_weights_t;
    auto kp = &dcmha_attn_sweep<T, true>;
    auto k_post = post_stages == 1 ? &dcmha_attn_bwd_sweep<T, false, 1> : &dcmha_attn_bwd_sweep<T, false>;
    auto k_pre = pre_stages == 1 ? &dcmha_attn_bwd_sweep<T, true, 1> : &dcmha_attn_bwd_sweep<T, true>;
    auto k_rowsum = &dcmha_attn_bwd_rows<T, false, 4, 1>;
    if constexpr (!std::is_same<T, float>::value) {  // fp32 takes one head a CTA (rowsum_heads)
      if (rs_heads == 2) k_rowsum = &dcmha_attn_bwd_rows<T, false, 4, 2>;
    }
    auto k_dq = dh_pad <= 32 ? &dcmha_attn_bwd_rows<T, true, 4, 1> : &dcmha_attn_bwd_rows<T, true, 16, 1>;
    // One buffer only where two do not fit, which at dh, dv <= 32 they always do.
    auto k_keys = key_stages == 1                    ? &dcmha_attn_bwd_keys<T, 8, 1>
                  : std::max(dh_pad, dv_pad) <= 32 ? &dcmha_attn_bwd_keys<T, 2>
                                                   : &dcmha_attn_bwd_keys<T, 8>;
    const char* op = "dcmha_attention_backward";
    hw::allow_dynamic_smem(op, kw, wt_smem);
    hw::allow_dynamic_smem(op, kp, loop_smem);
    hw::allow_dynamic_smem(op, k_post, post_smem);
    hw::allow_dynamic_smem(op, k_pre, pre_smem);
    hw::allow_dynamic_smem(op, k_rowsum, rowsum_smem);
    hw::allow_dynamic_smem(op, k_dq, rows_smem);
    hw::allow_dynamic_smem(op, k_keys, keys_smem);
    HW_LAUNCH("dcmha_attn_weights_t", kw, transpose_grid(p), dim3(kTransposeThreads), wt_smem, p,
              wt.data_ptr<float>(), kBwdWeightFields, weights_vec4(p));
    for (int64_t c0 = 0; c0 < p.T; c0 += chunk) {
      bp.m.chunk0 = static_cast<int>(c0);
      const unsigned tiles = query_tiles(p.T, c0, chunk);
      const unsigned splits = band_key_blocks(p, c0, chunk, kSweepSplitKeys, bp.m.split0);
      const unsigned key_tiles = band_key_blocks(p, c0, chunk, kTileRows, bp.key_tile0);
      // The row and key kernels' grids run heads fastest: the heads of a tile share its scratch.
      const dim3 sweep_grid(splits, tiles, bg), rows_grid(H, tiles, B), keys_grid(H, key_tiles, B);
      const dim3 rowsum_grid(H / rs_heads, tiles * kRowsumKeySplits, B),
          combine_grid(static_cast<unsigned>((tiles * kTileRows + kMmaThreads - 1) / kMmaThreads), H, B);
      HW_LAUNCH("dcmha_attn_partials", kp, sweep_grid, dim3(kMmaThreads), loop_smem, bp.m);
      HW_LAUNCH("dcmha_attn_bwd_dpost", k_post, sweep_grid, dim3(kMmaThreads), post_smem, bp);
      HW_LAUNCH("dcmha_attn_bwd_rowsum", k_rowsum, rowsum_grid, dim3(kMmaThreads), rowsum_smem, bp);
      HW_LAUNCH("dcmha_attn_bwd_rowsum_combine", dcmha_attn_bwd_rowsum_combine, combine_grid, dim3(kMmaThreads), 0,
                bp);
      HW_LAUNCH("dcmha_attn_bwd_dpre", k_pre, sweep_grid, dim3(kMmaThreads), pre_smem, bp);
      HW_LAUNCH("dcmha_attn_bwd_dq", k_dq, rows_grid, dim3(kMmaThreads), rows_smem, bp);
      HW_LAUNCH("dcmha_attn_bwd_dkv", k_keys, keys_grid, dim3(kKeyThreads), keys_smem, bp);
    }
  });
  hw::allow_dynamic_smem("dcmha_attention_backward", &dcmha_attn_grads_untranspose, wt_smem);
  HW_LAUNCH("dcmha_attn_grads_untranspose", dcmha_attn_grads_untranspose, transpose_grid(p),
            dim3(kTransposeThreads), wt_smem, p, static_cast<const float*>(gt.data_ptr<float>()),
            dw1.data_ptr<float>(), dw2.data_ptr<float>(), dg.data_ptr<float>(), p.T % 4 == 0 ? 1 : 0);
}
}  // namespace

at::Tensor HW_DCMHA_ENTRY(compose)(const at::Tensor& a, const at::Tensor& w1, const at::Tensor& w2,
                                   const at::Tensor& g, int64_t slot, int64_t head_groups) {
  HW_OP_RANGE("headwise::dcmha_compose");
  const Shape s = check_compose_args(a, w1, w2, g, slot, head_groups);
  check_backend(a, s, "dcmha_compose");
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
    hw::allow_dynamic_smem("dcmha_compose", kernel, static_cast<size_t>(smem));
    HW_LAUNCH("dcmha_compose_fwd", kernel, dim3(tiles, chunks, static_cast<unsigned>(s.batch)),
              dim3(kComposeThreads), static_cast<size_t>(smem), p);
  });
  return out;
}

// The compose backward by library products (einsum -> batched GEMMs, fp32), for devices
// whose shared memory cannot hold dcmha_compose_bwd's key-side block (H = 32 bf16 in one
// group needs ~100 KiB: over the 99 KiB of sm_86/89/120). With the grouped views
// A, dY [B, G, Hg, T, S], slot weights W1q, W2q [B, T, R, G, Hg] (query side, slot cq) and
// W1k, W2k [B, S, R, G, Hg] (key side, slot ck), pq = <A, W1q>_n, pk = <A, W1k>_n:
//   dq = <dY, W2q>_m, dk = <dY, W2k>_m                                  [B, G, R, T, S]
//   dA   = dY (1 + Gq + Gk) + dq W1q + dk W1k
//   dW2q = sum_s pq dY,  dW2k = sum_t pk dY,  dW1q = sum_s A dq,  dW1k = sum_t A dk
//   dGq  = sum_s dY A,   dGk  = sum_t dY A
// The [B, G, R, T, S] intermediates are 2R/H of a's size each. Deterministic (GEMMs and
// fixed-order reductions, no atomics), no host synchronization.
inline void compose_backward_by_library(const at::Tensor& x, const at::Tensor& dy, const at::Tensor& w1f,
                                        const at::Tensor& w2f, const at::Tensor& gf, int cq, int ck, int64_t groups,
                                        at::Tensor& da, at::Tensor& dw1, at::Tensor& dw2, at::Tensor& dg) {
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), S = x.size(3), R = w1f.size(3), hg = H / groups;
  const at::Tensor A = x.to(at::kFloat).view({B, groups, hg, T, S});
  const at::Tensor dY = dy.to(at::kFloat).view({B, groups, hg, T, S});
  auto side = [&](const at::Tensor& w, int c, int64_t n) { return w.select(2, c).narrow(1, 0, n).reshape({B, n, R, groups, hg}); };
  const at::Tensor w1q = side(w1f, cq, T), w2q = side(w2f, cq, T), w1k = side(w1f, ck, S), w2k = side(w2f, ck, S);
  const at::Tensor pq = at::einsum("bgnts,btrgn->bgrts", {A, w1q}), pk = at::einsum("bgnts,bsrgn->bgrts", {A, w1k});
  const at::Tensor dq = at::einsum("bgmts,btrgm->bgrts", {dY, w2q}), dk = at::einsum("bgmts,bsrgm->bgrts", {dY, w2k});
  const at::Tensor gq = gf.select(2, cq).narrow(1, 0, T).transpose(1, 2).reshape({B, groups, hg, T, 1});
  const at::Tensor gk = gf.select(2, ck).narrow(1, 0, S).transpose(1, 2).reshape({B, groups, hg, 1, S});
  const at::Tensor da32 = dY * (gq + gk + 1) + at::einsum("bgrts,btrgn->bgnts", {dq, w1q}) +
                          at::einsum("bgrts,bsrgn->bgnts", {dk, w1k});
  da.copy_(da32.view({B, H, T, S}));
  auto put = [&](at::Tensor& dst, int c, int64_t n, const at::Tensor& v) {
    at::Tensor slot_rows = dst.select(2, c).narrow(1, 0, n);
    slot_rows.copy_(v.reshape(slot_rows.sizes()));
  };
  put(dw2, cq, T, at::einsum("bgrts,bgmts->btrgm", {pq, dY}));
  put(dw2, ck, S, at::einsum("bgrts,bgmts->bsrgm", {pk, dY}));
  put(dw1, cq, T, at::einsum("bgnts,bgrts->btrgn", {A, dq}));
  put(dw1, ck, S, at::einsum("bgnts,bgrts->bsrgn", {A, dk}));
  const at::Tensor prod = (dY * A).view({B, H, T, S});
  put(dg, cq, T, prod.sum(3).transpose(1, 2));
  put(dg, ck, S, prod.sum(2).transpose(1, 2));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> HW_DCMHA_ENTRY(compose_backward)(
    const at::Tensor& grad, const at::Tensor& a, const at::Tensor& w1, const at::Tensor& w2, const at::Tensor& g,
    int64_t slot, int64_t head_groups) {
  HW_OP_RANGE("headwise::dcmha_compose_backward");
  const Shape s = check_compose_args(a, w1, w2, g, slot, head_groups);
  check_backend(a, s, "dcmha_compose_backward");
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
      const size_t limit = hw::max_dynamic_smem_optin();
      // HEADWISE_DCMHA_COMPOSE_BWD_ROWS=1 keeps the one-row kernel: the two-row kernel's
      // gain (estimated) comes at one CTA per SM instead of two, which only a GPU can judge
      // (bench/device_check.sh times both).
      const char* rows_env = std::getenv("HEADWISE_DCMHA_COMPOSE_BWD_ROWS");
      if constexpr (sizeof(T) == 2) {
        if (rows_env == nullptr || std::atoi(rows_env) != 1) {
          smem = bwd_layout(2);
          two_rows = static_cast<size_t>(smem) + hw::static_smem_bytes(&dcmha_compose_bwd<T, 2>) <= limit;
        }
      }
      if (!two_rows) {
        smem = bwd_layout(1);
        fits = static_cast<size_t>(smem) + hw::static_smem_bytes(&dcmha_compose_bwd<T, 1>) <= limit;
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

std::tuple<at::Tensor, at::Tensor> HW_DCMHA_ENTRY(attention)(const at::Tensor& q, const at::Tensor& k,
                                                            const at::Tensor& v, const at::Tensor& w1,
                                                            const at::Tensor& w2, const at::Tensor& g, bool causal,
                                                            int64_t window, double scale, int64_t head_groups) {
  HW_OP_RANGE("headwise::dcmha_attention");
  const AttnShape s = check_attention_args(q, k, v, w1, w2, g, window, head_groups);
  TORCH_CHECK(on_backend_device(q), "headwise.dcmha_attention: q is on ", q.device(), " but ", kBackendDevice);
  dispatch_storage_dtype(q.scalar_type(), "dcmha_attention", "q", [](auto) {});
  TORCH_CHECK_VALUE(s.heads <= kMaxHeads, "headwise.dcmha_attention: H = ", s.heads,
                    " exceeds the most heads of the CUDA attention kernel (", kMaxHeads, ")");
  const size_t smem = static_cast<size_t>(attn_smem_floats(static_cast<int>(s.heads), static_cast<int>(s.head_dim),
                                                           static_cast<int>(s.v_dim), kAttnThreads)) *
                      sizeof(float);
  const at::OptionalDeviceGuard device_guard(q.device());
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const at::Tensor w1f = w1.to(at::kFloat).contiguous(), w2f = w2.to(at::kFloat).contiguous(),
                   gf = g.to(at::kFloat).contiguous();
  at::Tensor out = new_output({s.batch, s.heads, s.seq, s.v_dim}, q.options());
  at::Tensor stats = new_output({2, s.batch, s.heads, s.seq}, q.options().dtype(at::kFloat));
  if (s.batch * s.seq == 0) return {out, stats};
  AttnParams p = attention_params(s, qc, kc, vc, w1f, w2f, gf, causal, window, scale);
  p.out = out.data_ptr();
  p.stats = stats.data_ptr<float>();
  const int dh_pad = pad16(s.head_dim), dv_pad = pad16(s.v_dim);
  if (!forward_takes_tensor_cores(s, p, q.scalar_type(), dh_pad, dv_pad)) {
    dispatch_storage_dtype(q.scalar_type(), "dcmha_attention", "q", [&](auto tag) {
      using T = decltype(tag);
      auto kernel = &dcmha_attention_fwd<T>;
      hw::allow_dynamic_smem("dcmha_attention", kernel, smem);
      HW_LAUNCH("dcmha_attention_fwd", kernel, dim3(static_cast<unsigned>(s.seq), static_cast<unsigned>(s.batch)),
                dim3(kAttnThreads), smem, p);
    });
    return {out, stats};
  }
  launch_mma_attention(p, qc, kc, vc, out, dh_pad, dv_pad);
  return {out, stats};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> HW_DCMHA_ENTRY(attention_backward)(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& w1,
    const at::Tensor& w2, const at::Tensor& g, const at::Tensor& stats, bool causal, int64_t window, double scale,
    int64_t head_groups) {
  HW_OP_RANGE("headwise::dcmha_attention_backward");
  const AttnShape s = check_attention_args(q, k, v, w1, w2, g, window, head_groups);
  TORCH_CHECK(on_backend_device(q), "headwise.dcmha_attention_backward: q is on ", q.device(), " but ", kBackendDevice);
  dispatch_storage_dtype(q.scalar_type(), "dcmha_attention_backward", "q", [](auto) {});
  TORCH_CHECK_VALUE(s.heads <= kMaxHeads, "headwise.dcmha_attention_backward: H = ", s.heads,
                    " exceeds the most heads of the CUDA attention kernel (", kMaxHeads, ")");
  TORCH_CHECK_VALUE(grad_out.dim() == 4 && grad_out.size(0) == s.batch && grad_out.size(1) == s.heads &&
                        grad_out.size(2) == s.seq && grad_out.size(3) == s.v_dim,
                    "headwise.dcmha_attention_backward: grad_out must be [B, H, T, dv], got ", shape_str(grad_out));
  check_same_dtype("dcmha_attention_backward", grad_out, "grad_out", q, "q");
  TORCH_CHECK_VALUE(stats.dim() == 4 && stats.size(0) == 2 && stats.size(1) == s.batch && stats.size(2) == s.heads &&
                        stats.size(3) == s.seq && stats.scalar_type() == at::kFloat,
                    "headwise.dcmha_attention_backward: stats must be the [2, B, H, T] float32 statistics of the ",
                    "forward, got ", shape_str(stats), " ", stats.scalar_type());
  const size_t smem = static_cast<size_t>(attn_bwd_smem_floats(static_cast<int>(s.heads), static_cast<int>(s.head_dim),
                                                               static_cast<int>(s.v_dim), kAttnThreads)) *
                      sizeof(float);
  const at::OptionalDeviceGuard device_guard(q.device());
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), dout = grad_out.contiguous();
  const at::Tensor st = stats.contiguous();
  const at::Tensor w1f = w1.to(at::kFloat).contiguous(), w2f = w2.to(at::kFloat).contiguous(),
                   gf = g.to(at::kFloat).contiguous();
  at::Tensor dq = new_output(qc.sizes(), qc.options());
  at::Tensor dk = new_output(kc.sizes(), kc.options());
  at::Tensor dv = new_output(vc.sizes(), vc.options());
  at::Tensor dw1 = new_output(w1f.sizes(), w1f.options());  // every element written by the kernels
  at::Tensor dw2 = new_output(w2f.sizes(), w2f.options());
  at::Tensor dg = new_output(gf.sizes(), gf.options());
  const int dh_pad = pad16(s.head_dim), dv_pad = pad16(s.v_dim);
  AttnParams f = attention_params(s, qc, kc, vc, w1f, w2f, gf, causal, window, scale);
  f.stats = st.data_ptr<float>();
  if (s.batch * s.seq > 0 && mma_backward_fits(s, f, q.scalar_type(), dh_pad, dv_pad)) {
    // bf16 / fp16, and fp32 after a TF32 forward, on the tensor-core kernels; the key-slot
    // grads are sums over chunks.
    launch_mma_attention_backward(f, qc, kc, vc, dout, st, dq, dk, dv, dw1, dw2, dg, dh_pad, dv_pad);
  } else if (s.batch * s.seq > 0) {
    // After a TF32 forward whose backward does not fit the tensor-core kernels (fp32 tiles
    // at dh = 128 on sm_80), the SIMT kernels read q, k, v as its tensor cores did.
    at::Tensor q_tf32, k_tf32, v_tf32;
    if (q.scalar_type() == at::kFloat && forward_takes_tensor_cores(s, f, q.scalar_type(), dh_pad, dv_pad)) {
      q_tf32 = tf32_operand(qc);
      k_tf32 = tf32_operand(kc);
      v_tf32 = tf32_operand(vc);
      f = attention_params(s, q_tf32, k_tf32, v_tf32, w1f, w2f, gf, causal, window, scale);
      f.stats = st.data_ptr<float>();
    }
    at::Tensor D = new_output({s.batch, s.heads, s.seq}, w1f.options());  // rowsum(P dP) for the key kernel
    // (M, 1 / Z): both kernels form P = exp(L - M) (1 / Z) as the forward does, with no
    // division in their loops (the call to its slow path spilled the key kernel); the
    // reciprocal correctly rounded, as the forward's 1 / Z.
    const at::Tensor inv_stats = at::stack({st.select(0, 0), inverse_row_sums(st.select(0, 1))});
    AttnBwdParams p{};
    p.f = f;
    p.stats = inv_stats.data_ptr<float>();
    p.dout = dout.data_ptr();
    p.D = D.data_ptr<float>();
    p.dq = dq.data_ptr();
    p.dk = dk.data_ptr();
    p.dv = dv.data_ptr();
    p.dw1 = dw1.data_ptr<float>();
    p.dw2 = dw2.data_ptr<float>();
    p.dg = dg.data_ptr<float>();
    const dim3 grid(static_cast<unsigned>(s.seq), static_cast<unsigned>(s.batch));
    dispatch_storage_dtype(q.scalar_type(), "dcmha_attention_backward", "q", [&](auto tag) {
      using T = decltype(tag);
      auto kq = &dcmha_attention_bwd_query<T>;
      auto kk = &dcmha_attention_bwd_key<T>;
      hw::allow_dynamic_smem("dcmha_attention_backward", kq, smem);
      hw::allow_dynamic_smem("dcmha_attention_backward", kk, smem);
      HW_LAUNCH("dcmha_attention_bwd_query", kq, grid, dim3(kAttnThreads), smem, p);
      HW_LAUNCH("dcmha_attention_bwd_key", kk, grid, dim3(kAttnThreads), smem, p);
    });
  }
  return {dq, dk, dv, dw1.to(w1.scalar_type()), dw2.to(w2.scalar_type()), dg.to(g.scalar_type())};
}

}  // namespace dcmha
}  // namespace headwise
