// MHAR depth routing: device code of the forward and backward kernels (SPEC section 4).
// Compiled by nvcc for the GPU and by the host compiler against the SIMT emulator.
//
// Notation, per position p = (b, t): sources s_n in R^d for n < N, query q and norm
// weight g in R^d (fp32), heads h < H of width K = d / H.
//   r_n      = rsqrt(mean_j s_n[j]^2 + eps)
//   u_n      = round_T(s_n * r_n)                   (storage-dtype rounding)
//   l[n,h]   = sum_{j in h} u_n[j] * g[j] * q[j]
//   w[n,h]   = softmax_n l[n,h]
//   mix[j]   = sum_n w[n,h(j)] s_n[j]
//   out[j]   = gate * mix[j] (+ residual[j])           (gate = 1 when absent)
// Backward, given dout:
//   a[n,h]   = <dout_h, s_n[h]>,   S_h = sum_n w[n,h] a[n,h]
//   dgate   += sum_h S_h           (= <dout, mix>, over positions)
//   dl[n,h]  = gate w[n,h] (a[n,h] - S_h)
//   b[n,h]   = sum_{j in h} q[j] g[j] s_n[j],   c_n = <du_n, s_n> = sum_h dl[n,h] b[n,h]
//   ds_n[j]  = gate w[n,h(j)] dout[j] + r_n dl[n,h(j)] q[j] g[j] - r_n^3 s_n[j] c_n / d
//   z[j]    += dl[n,h(j)] u_n[j]      (over n and positions; dq = g z, dg = q z)
// so every reduction of the backward over a row (a, b and the per-head sums of squares
// that give r_n) is taken in one pass over the rows, and the second pass has none.
//
// Traffic (bf16, d = 4096, H = 8, N = 9): the forward reads N rows and writes one per
// position (2 B per element, 6 FLOPs per source element) plus N * H fp32 weights; the
// backward reads N rows, dout and the weights and writes N gradient rows (12 FLOPs per
// source element). Both are HBM-bound by ~2 orders of magnitude over the FP32 ceiling,
// so the design is about bytes in flight and barriers:
//   - Thread layout: the row is cut into nvec = d / VEC vectors of VEC elements; thread
//     `tid` owns vectors v = tid + i * blockDim.x for i < ITEMS (v < nvec). VEC divides
//     K, so a vector lies in one head: h(v) = v / kv with kv = K / VEC vectors per head.
//     VEC = 8: 16-byte loads of bf16 (the aligned path), VEC = 1 the scalar fallback.
//   - Rows are processed ROWS at a time (a stage): the stage's loads are issued together,
//     and with PREFETCH the next stage's loads are issued before the current stage's
//     reductions (register double buffering), so 2 * ROWS rows per CTA are in flight.
//   - Forward, per stage: one block reduction of the ROWS sums of squares and one head
//     reduction of the ROWS x ITEMS logit partials (no barrier when a head is a lane
//     segment of a warp), then the online-softmax fold of the stage. The logits stay in
//     shared memory; each weight is written once at the end, coalesced. q * g is read
//     from a thread-private shared-memory slice once a stage (4 LDS.128), which leaves
//     its 16 registers to the rows in flight: the stages alternate two register sets
//     instead of copying the prefetched rows into one.
//   - Backward, per position: pass 1 reads each row once (staged into shared memory when
//     N rows fit, each thread keeping its own vectors, so no barrier guards them) and
//     head-reduces a, b and the sums of squares (heads of whole warps, the vector layout:
//     a stage's values are warp-summed together by a reduce-scatter, and the warp sums of
//     every row are kept and added per (n, h) after the pass, so one barrier a position,
//     not one a stage); the per-(n, h) scalars S_h, dl, c_n are formed by H + N threads
//     from shared memory; pass 2 rereads the rows from shared memory and emits the
//     gradients with no reduction, with the rows' source and the accumulation into
//     grad_sources as compile-time variants. The weights are loaded once per position,
//     coalesced, into shared memory. Pass 2 (vector layout) reads an item's coefficients
//     gate w, r dl, dl as one 16-byte record formed once per (n, h), and addresses its
//     packs from row pointers stepped a row each: ~34 instructions a row less than two
//     scalar loads, two products and per-item 64-bit address arithmetic (sm_90 SASS).
//   - Query / norm-weight / gate gradients: per-segment partials (kBwdSegment consecutive
//     positions, summed in position order by one CTA) and a second kernel that sums the
//     segments' partials column-parallel in a fixed tree: bitwise deterministic and
//     independent of the grid.
#pragma once

#include "../common/block_reduce.cuh"
#include "../common/online_softmax.cuh"
#include "../common/simt_portability.h"
#include "../common/unroll.h"
#include "../common/vec.cuh"
#include "../common/warp_octets.cuh"

#include <cmath>
#include <cstdint>
#include <type_traits>

namespace headwise {
namespace mhar {

// How the per-head sums of a row are formed from per-vector partials.
enum class HeadReduce : int {
  kSegment = 0,  // kv a power of two <= 32: a head is an aligned lane segment of a warp
  kWarps = 1,    // kv a multiple of 32: a head is whole warps; warp sums meet in smem
  kGeneric = 2,  // anything else: partials in smem, one warp per head
};

// Positions per partial of the query / norm-weight / gate gradients. A CTA handles whole
// segments, so the sums do not depend on the grid.
constexpr int kBwdSegment = 16;
// Most threads per CTA of both kernels (d <= 8192: 8192 / VEC vectors over ITEMS).
constexpr int kMaxThreads = 512;

// What both kernels read: the sources and the routing parameters, with the geometry.
struct Routing {
  const void* sources;       // [N_max, B, T, d], stride-1 last dim
  const float* query;        // [d]
  const float* norm_weight;  // [d]
  int64_t src_stride_n, src_stride_b, src_stride_t;
  int64_t seq, positions, d, heads, head_dim;  // positions = B * T
  int num_sources;
  float eps;
};

struct FwdParams {
  Routing route;
  const void* residual;      // [B, T, d] or nullptr
  int64_t res_stride_b, res_stride_t;
  const float* gate;         // [1] or nullptr (gate = 1)
  void* out;                 // [B, T, d] contiguous
  float* weights;            // [N, B, T, H] contiguous
};

struct BwdParams {
  Routing route;
  const void* grad_out;      // [B, T, d] contiguous
  const float* weights;      // [N, B, T, H] contiguous
  void* grad_sources;        // [N_max, B, T, d] contiguous; rows < N written here
  bool accumulate;           // add to grad_sources instead of storing
  bool stage_rows;           // the N rows of a position are kept in smem between passes
  const float* gate;         // [1] or nullptr (gate = 1)
  float* z_partial;          // [segments, d]: per-segment sums of dl[n,h(j)] u_n[j]
  float* gate_partial;       // [segments]: per-segment sums of S_h over heads and positions
};

// Quotient q and remainder r by a fixed divisor of the indices i, i + stride, ...
// (i = q divisor + r), stepped by adds and one compare: no integer division per index
// (two at construction). For the (b, t) of a block's positions (b < B and t < T fit
// in 32 bits).
class IndexSteps {
 public:
  __device__ IndexSteps(int i, int stride, int divisor)
      : q(i / divisor), r(i - q * divisor), step_q_(stride / divisor), step_r_(stride - step_q_ * divisor),
        divisor_(divisor) {}
  __device__ void next() {
    q += step_q_;
    r += step_r_;
    if (r >= divisor_) {
      r -= divisor_;
      ++q;
    }
  }
  int q, r;

 private:
  int step_q_, step_r_, divisor_;
};

__host__ __device__ inline int64_t bwd_segments(int64_t positions) {
  return (positions + kBwdSegment - 1) / kBwdSegment;
}

// Floats of one head-partial buffer of one value: the warp sums (kWarps) or the vector
// partials (kGeneric) of one row.
__host__ __device__ inline int64_t head_partial_floats(HeadReduce mode, int64_t nvec) {
  return mode == HeadReduce::kSegment ? 0 : (mode == HeadReduce::kWarps ? nvec / 32 : nvec);
}

// Floats of the double-buffered head-partial scratch of HeadSums<.., COUNT, MODE>.
__host__ __device__ inline int64_t head_sums_floats(HeadReduce mode, int64_t nvec, int count) {
  return 2 * head_partial_floats(mode, nvec) * (mode == HeadReduce::kWarps ? count : 1);
}

// Floats of one [d]-sized vector's thread-private slices (see ThreadVectors): a thread's
// ITEMS x VEC values and one pad word each.
__host__ __device__ inline int64_t slice_block_floats(int64_t items, int64_t threads, int64_t vec) {
  return threads * (items * vec + 1);
}

// Floats of one [d]-sized vector's VectorSlice block: a thread's ITEMS x VEC values and
// 4 pad words each.
__host__ __device__ inline int64_t vector_slice_floats(int64_t items, int64_t threads, int64_t vec) {
  return threads * (items * vec + 4);
}

// Floats of the slices of the scalar layout (three [d]-sized vectors per thread block: q,
// g and the accumulator, or q * g, dout and z).
__host__ __device__ inline int64_t param_slice_floats(bool in_smem, int64_t items, int64_t threads, int64_t vec) {
  return in_smem ? 3 * slice_block_floats(items, threads, vec) : 0;
}

// Floats of BlockSums' scratch: two halves of 32 words (a value's warp sums in a
// 32 / COUNT-word segment; kMaxThreads / 32 = 16 warps fill a segment at COUNT = 2).
constexpr int kBlockSumsFloats = 64;

// Forward dynamic smem (floats): BlockSums scratch (kBlockSumsFloats), HeadSums scratch,
// per position (two, by parity) the logits [N, H], the heads' max and 1 / denominator
// [H], then, 16-byte aligned, the parameter slices (fwd_param_floats).
__host__ __device__ inline int64_t fwd_pos_floats(int64_t n, int64_t heads) { return n * heads + 2 * heads; }
__host__ __device__ inline int64_t fwd_slices_offset(HeadReduce mode, int64_t nvec, int rows, int64_t n,
                                                     int64_t heads) {
  return (kBlockSumsFloats + head_sums_floats(mode, nvec, rows) + 2 * fwd_pos_floats(n, heads) + 3) / 4 * 4;
}

// Floats of the forward's parameter slices: the scalar layout's q * g, running max and
// accumulator (three slice blocks), or the vector layout's q * g (a VectorSlice block).
__host__ __device__ inline int64_t fwd_param_floats(int64_t vec, int64_t items, int64_t threads) {
  return vec == 1 ? 3 * slice_block_floats(items, threads, vec) : vector_slice_floats(items, threads, vec);
}
__host__ __device__ inline int64_t fwd_smem_floats(HeadReduce mode, int64_t nvec, int rows, int64_t n,
                                                   int64_t heads, int64_t vec, int64_t items, int64_t threads) {
  return fwd_slices_offset(mode, nvec, rows, n, heads) + fwd_param_floats(vec, items, threads);
}

// Whether the backward's pass 1 defers its head sums: with kWarps and the vector layout
// it keeps every warp sum of a position's rows and adds them per (n, h) once all rows are
// read (no barrier per stage); otherwise HeadSums reduces each stage.
__host__ __device__ constexpr bool bwd_defers_head_sums(HeadReduce mode, int vec) {
  return mode == HeadReduce::kWarps && vec > 1;
}

// Floats of the backward's head-reduction scratch: deferred, the warp sums [3][N][nvec /
// 32] (value a, b, ss; row; warp of the row); else HeadSums' (3 values per row of a stage).
__host__ __device__ inline int64_t bwd_head_scratch_floats(HeadReduce mode, int vec, int64_t nvec, int rows,
                                                           int64_t n) {
  return bwd_defers_head_sums(mode, vec) ? 3 * n * (nvec / 32) : head_sums_floats(mode, nvec, 3 * rows);
}

// Backward dynamic smem (floats): BlockSum scratch (64), the head-reduction scratch, the
// position block (bwd_pos_floats: w, a, b, sum of squares and dl [N, H], r_n and r_n^3
// c_n / d [N]; two by parity in the scalar layout, see bwd_pos_blocks), the parameter
// slices; then, 16-byte aligned, the vector layout's pass-2 coefficient records [N, H]
// (bwd_records_offset); then, with stage_rows, the staged rows (bytes, 16-aligned).
__host__ __device__ inline int64_t bwd_pos_floats(int64_t n, int64_t heads) { return 5 * n * heads + 2 * n; }
// Position blocks: the scalar layout's pass 2 reads w and dl, which the next position's
// first loop (w, before any barrier) may overwrite while slower threads still read them,
// so it alternates two blocks by parity. The vector layout's pass 2 reads only the records
// and r_n, r_n^3 c_n / d, which are written after the next position's pass-1 barrier,
// when every thread has left this position's pass 2: one block, and one set of records.
__host__ __device__ constexpr int bwd_pos_blocks(int vec) { return vec == 1 ? 2 : 1; }
// Floats of one pass-2 coefficient record: gate w, r dl, dl of an (n, h) and a pad word.
constexpr int kBwdRecordFloats = 4;
__host__ __device__ inline int64_t bwd_records_offset(HeadReduce mode, int vec, int64_t nvec, int rows, int64_t n,
                                                      int64_t heads, int64_t param_floats) {
  const int64_t f = 64 + bwd_head_scratch_floats(mode, vec, nvec, rows, n) +
                    bwd_pos_blocks(vec) * bwd_pos_floats(n, heads) + param_floats;
  return (f + 3) / 4 * 4;
}
__host__ __device__ inline int64_t bwd_smem_floats(HeadReduce mode, int vec, int64_t nvec, int rows, int64_t n,
                                                   int64_t heads, int64_t param_floats) {
  return bwd_records_offset(mode, vec, nvec, rows, n, heads, param_floats) +
         (vec == 1 ? 0 : kBwdRecordFloats * n * heads);
}

// The thread's ITEMS x VEC values of a [d]-sized fp32 vector: in registers, or (IN_SMEM,
// the scalar layout, whose 16 items per thread would not leave registers for the rest:
// the parameters and the accumulators live there) in a thread-private shared-memory
// slice of ITEMS * VEC + 1 words at tid * (ITEMS * VEC + 1): one base register and
// immediate offsets per vector (a [ITEMS][blockDim.x] layout needs an address register
// per item, which spilled), and the odd pitch keeps a warp's 32 accesses of one value in
// 32 banks. No barrier guards a thread's slice.
template <int ITEMS, int VEC, bool IN_SMEM>
struct ThreadVectors {
  static constexpr int kPitch = ITEMS * VEC + 1;
  float reg[IN_SMEM ? 1 : ITEMS][VEC];
  float* slice;

  // slice_block: the vector's slices for the whole block (slice_block_floats).
  __device__ explicit ThreadVectors(float* slice_block) : slice(slice_block + threadIdx.x * kPitch) {}
  __device__ float get(int i, int k) const { return IN_SMEM ? slice[i * VEC + k] : reg[IN_SMEM ? 0 : i][k]; }
  __device__ void set(int i, int k, float x) {
    if (IN_SMEM) slice[i * VEC + k] = x;
    else reg[IN_SMEM ? 0 : i][k] = x;
  }
  __device__ void load(int i, float (&x)[VEC]) const {
    HW_UNROLL
    for (int k = 0; k < VEC; ++k) x[k] = get(i, k);
  }
};

// The thread's ITEMS x VEC values of a [d]-sized fp32 vector in a thread-private
// shared-memory slice read a whole vector at a time (16-byte accesses; VEC a multiple of
// 4, ITEMS * VEC of 8): ITEMS * VEC words at tid * kPitch. The pitch, 4 mod 8 words, puts
// the 8 threads of a 16-byte access phase in 8 distinct 4-bank groups (no conflict), and
// each vector is an immediate offset from one base register. No barrier guards a
// thread's slice. The forward keeps q * g here, read once a stage: its 16 registers hold
// the second set of rows in flight instead.
template <int ITEMS, int VEC>
struct VectorSlice {
  static constexpr int kPitch = ITEMS * VEC + 4;
  float* slice;

  // slice_block: the vector's slices for the whole block (vector_slice_floats, 16-byte aligned).
  __device__ explicit VectorSlice(float* slice_block) : slice(slice_block + threadIdx.x * kPitch) {}
  __device__ void store(int i, const float (&x)[VEC]) const { hw::store_from_float<VEC>(slice + i * VEC, x); }
  __device__ void load(int i, float (&x)[VEC]) const { hw::load_as_float<VEC>(slice + i * VEC, x); }
};

// A thread's items, fixed for the kernel: item i is vector v = tid + i * blockDim.x of
// the row, present when v < nvec, in head v / kv; `first` marks a head's first vector.
// With CACHE (the default for ITEMS <= kCachedItems) the head index and flag are formed
// once, so no stage divides by kv; without it they are recomputed on use: the scalar
// layout (16 items; 64 more live registers would spill) and the backward (see there).
constexpr int kCachedItems = 4;
template <int ITEMS, bool CACHE = (ITEMS <= kCachedItems)>
class ThreadItems {
 public:
  static constexpr bool kCachedHeads = CACHE;
  __device__ ThreadItems(int nvec, int kv) : nvec_(nvec), kv_(kv) {
    HW_UNROLL
    for (int i = 0; i < kCached; ++i) {
      head_[i] = compute_offset(i) / kv;
      first_[i] = compute_valid(i) && compute_offset(i) % kv == 0;
    }
  }
  __device__ int offset(int i) const { return compute_offset(i); }
  __device__ bool valid(int i) const { return compute_valid(i); }
  __device__ int head(int i) const { return kCached ? head_[kCached ? i : 0] : compute_offset(i) / kv_; }
  __device__ bool first(int i) const {
    return kCached ? first_[kCached ? i : 0] : compute_valid(i) && compute_offset(i) % kv_ == 0;
  }

 private:
  static constexpr int kCached = CACHE ? ITEMS : 0;
  __device__ int compute_offset(int i) const { return static_cast<int>(threadIdx.x + i * blockDim.x); }
  __device__ bool compute_valid(int i) const { return compute_offset(i) < nvec_; }
  int nvec_, kv_;
  int head_[kCached > 0 ? kCached : 1];
  bool first_[kCached > 0 ? kCached : 1];
};

// Loads the thread's vectors of x (zeros for v >= nvec) as fp32.
template <int ITEMS, int VEC, bool IN_SMEM>
__device__ __forceinline__ void load_param(const float* x, int nvec, ThreadVectors<ITEMS, VEC, IN_SMEM>& out) {
  HW_UNROLL
  for (int i = 0; i < ITEMS; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
    float tmp[VEC];
    HW_UNROLL
    for (int k = 0; k < VEC; ++k) tmp[k] = 0.f;
    if (v < nvec) hw::load_as_float<VEC>(x + v * VEC, tmp);
    HW_UNROLL
    for (int k = 0; k < VEC; ++k) out.set(i, k, tmp[k]);
  }
}

// qg = q * g, each element's weight in the logits (forward) and the key path (backward):
// in registers, or (scalar layout) in the first slice block, with the second as scratch
// (free again once qg is formed).
template <int ITEMS, int VEC, bool IN_SMEM>
__device__ __forceinline__ ThreadVectors<ITEMS, VEC, IN_SMEM> load_qg(const Routing& route, int nvec, int nthreads,
                                                                     float* slices) {
  ThreadVectors<ITEMS, VEC, IN_SMEM> qg(slices);
  ThreadVectors<ITEMS, VEC, IN_SMEM> q(slices), g(slices + slice_block_floats(ITEMS, nthreads, VEC));
  load_param(route.query, nvec, q);
  load_param(route.norm_weight, nvec, g);
  HW_UNROLL
  for (int i = 0; i < ITEMS; ++i) {
    HW_UNROLL
    for (int k = 0; k < VEC; ++k) qg.set(i, k, q.get(i, k) * g.get(i, k));
  }
  return qg;
}

// q * g for the forward: the scalar layout's thread slices (load_qg), or the vector
// layout's VectorSlice at `slices`, whose 8-float vectors (32 bytes a lane) are read
// through the warp's coalesced 16-byte accesses (hw::warp_load_octets: 16 sectors a
// request where a lane's own two 16-byte loads take 32). The backward keeps load_qg's
// direct loads, once a block (and its direct z_partial stores, once a segment): with
// either through the shuffles, nvcc 13.0 scheduled its pass-1 stage loop ~45
// instructions longer (sm_90 SASS, 283 -> 326-331 a 2-row stage).
template <int ITEMS, int VEC>
__device__ __forceinline__ auto forward_qg(const Routing& route, int nvec, int nthreads, float* slices) {
  if constexpr (VEC == 1) {
    return load_qg<ITEMS, VEC, true>(route, nvec, nthreads, slices);
  } else {
    static_assert(VEC == 8, "the vector layout moves 8-element vectors");
    const VectorSlice<ITEMS, VEC> qg(slices);
    HW_UNROLL
    for (int i = 0; i < ITEMS; ++i) {
      const int v0 = static_cast<int>((threadIdx.x & ~31u) + i * blockDim.x);
      float q[VEC], g[VEC];
      hw::warp_load_octets(route.query + v0 * VEC, nvec - v0, q);
      hw::warp_load_octets(route.norm_weight + v0 * VEC, nvec - v0, g);
      HW_UNROLL
      for (int k = 0; k < VEC; ++k) q[k] *= g[k];
      qg.store(i, q);
    }
    return qg;
  }
}

// Issues the loads of rows [n0, n0 + ROWS) of a position (the thread's vectors; zeros
// for rows >= n_end and absent items). row: row n0 of the position, at the thread's first
// vector in the vector layout, whose loads are then row + a block-uniform offset each
// (r stride_n + i blockDim VEC); the scalar layout's forward spills with a per-thread
// pointer held (16 items), so there row is the row's start and each load adds the
// item's offset.
template <typename T, int VEC, int ITEMS, int ROWS, class Items>
__device__ __forceinline__ void load_stage(const T* row, int64_t stride_n, int n0, int n_end, const Items& items,
                                           hw::Pack<T, VEC> (&x)[ROWS][ITEMS]) {
  if constexpr (VEC > 1) {
    const int64_t item_stride = static_cast<int64_t>(blockDim.x) * VEC;
    HW_UNROLL
    for (int r = 0; r < ROWS; ++r) {
      HW_UNROLL
      for (int i = 0; i < ITEMS; ++i)
        x[r][i] = hw::load_pack_if<T, VEC>(row + (r * stride_n + i * item_stride), n0 + r < n_end && items.valid(i));
    }
  } else {
    HW_UNROLL
    for (int r = 0; r < ROWS; ++r, row += stride_n) {
      HW_UNROLL
      for (int i = 0; i < ITEMS; ++i)
        x[r][i] = hw::load_pack_if<T, VEC>(row + items.offset(i) * VEC, n0 + r < n_end && items.valid(i));
    }
  }
}

// Runs stage(cur, n0, half) for n0 = 0, ROWS, 2 ROWS, ... < n_end, cur holding the
// position's rows [n0, n0 + ROWS) and half = (n0 / ROWS) % 2 naming the scratch half of
// the stage's BlockSums call (consecutive stages alternate; the first stage of the next
// position follows a barrier). With PREFETCH (the vector layout) the next stage's loads
// are issued before each stage runs, into the other of two register sets: the loop is
// unrolled by two so that the sets alternate (no stage copies the prefetched rows), half
// is a constant of each copy, and the loads address from one row pointer stepped 2 ROWS
// rows an iteration (a 64-bit add, where forming (n0 + r) stride_n took a wide multiply
// per row). Without PREFETCH the next stage is loaded after the stage, into the same set.
template <bool PREFETCH, typename T, int VEC, int ITEMS, int ROWS, class Items, class Stage>
__device__ __forceinline__ void for_each_stage(const T* src, int64_t stride_n, int n_end, const Items& items,
                                               Stage&& stage) {
  hw::Pack<T, VEC> even[ROWS][ITEMS], odd[ROWS][ITEMS];
  if constexpr (PREFETCH) {
    static_assert(VEC > 1, "the vector layout prefetches");
    const int64_t stage_stride = ROWS * stride_n;
    const T* row = src + threadIdx.x * VEC;  // row n0, at the thread's first vector
    load_stage<T, VEC, ITEMS, ROWS>(row, stride_n, 0, n_end, items, even);
    for (int n0 = 0; n0 < n_end; n0 += 2 * ROWS, row += 2 * stage_stride) {
      load_stage<T, VEC, ITEMS, ROWS>(row + stage_stride, stride_n, n0 + ROWS, n_end, items, odd);
      stage(even, n0, 0);
      if (n0 + ROWS >= n_end) break;
      load_stage<T, VEC, ITEMS, ROWS>(row + 2 * stage_stride, stride_n, n0 + 2 * ROWS, n_end, items, even);
      stage(odd, n0 + ROWS, 1);
    }
  } else {
    (void)odd;
    const T* base = VEC > 1 ? src + threadIdx.x * VEC : src;  // see load_stage
    load_stage<T, VEC, ITEMS, ROWS>(base, stride_n, 0, n_end, items, even);
    for (int n0 = 0, half = 0; n0 < n_end; n0 += ROWS, half ^= 1) {
      stage(even, n0, half);
      if (n0 + ROWS < n_end)
        load_stage<T, VEC, ITEMS, ROWS>(base + (n0 + ROWS) * stride_n, stride_n, n0 + ROWS, n_end, items, even);
    }
  }
}

// Block-wide sums of COUNT values with one __syncthreads per call. The scratch
// (kBlockSumsFloats) has two halves and the caller names the call's half: consecutive
// calls must alternate halves or have a barrier between them (a thread reaches the next
// call's store only after every thread has passed this call's barrier, so the other
// half is free; this half may still be being read).
template <int COUNT>
class BlockSums {
  // Each value's warp sums meet in an aligned segment of kSegment lanes.
  static_assert(COUNT == 1 || COUNT == 2, "a lane segment per value");
  static constexpr int kSegment = 32 / COUNT;
  static_assert(kMaxThreads / 32 <= kSegment, "a lane per warp sum");

 public:
  // Zeroes the slots past the block's warps, which no call stores to (so no store of a
  // call races these); the first call's barrier orders them before any read.
  __device__ explicit BlockSums(float* scratch) : scratch_(scratch) {
    const int nwarps = blockDim.x >> 5;
    for (int k = threadIdx.x; k < kBlockSumsFloats; k += blockDim.x)
      if ((k & (kSegment - 1)) >= nwarps) scratch[k] = 0.f;
  }

  __device__ void operator()(float (&v)[COUNT], int half) const {
    float* buf = scratch_ + half * (kBlockSumsFloats / 2);
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    // The COUNT warp sums, spread over the lanes; each leader stores the ones it holds.
    float held[COUNT];
    HW_UNROLL
    for (int c = 0; c < COUNT; ++c) held[c] = v[c];
    hw::warp_sum_scatter(held);
    hw::store_scattered_sums(held, [&](int c, float sum) { buf[c * kSegment + warp] = sum; });
    __syncthreads();
    // Lane c kSegment + w reads warp w's sum of value c (0 past the block's warps: exact
    // in the sums), the segment adds them by a butterfly (a fixed tree, the same in every
    // lane), and a shuffle hands each total to every lane.
    float s = buf[lane];
    HW_UNROLL
    for (int offset = kSegment / 2; offset > 0; offset >>= 1) s += __shfl_xor_sync(hw::kFullWarp, s, offset);
    HW_UNROLL
    for (int c = 0; c < COUNT; ++c) v[c] = __shfl_sync(hw::kFullWarp, s, c * kSegment);
  }

 private:
  float* scratch_;
};

// Replaces each valid item's per-vector partial of COUNT values by its sum over the
// item's head. Every thread of the block must make each call. The scratch alternates
// between two halves by call parity: back-to-back calls need no extra barrier.
// kSegment: warp shuffles only; kWarps: one barrier for all COUNT values; kGeneric (the
// fallback for odd head widths): two barriers per value.
template <int ITEMS, int COUNT, HeadReduce MODE>
class HeadSums {
 public:
  __device__ HeadSums(float* scratch, int nvec, int kv, int heads)
      : scratch_(scratch), nvec_(nvec), kv_(kv), heads_(heads),
        half_(static_cast<int>(head_sums_floats(MODE, nvec, COUNT) / 2)) {}

  template <class Items>
  __device__ void operator()(float (&val)[COUNT][ITEMS], const Items& items) {
    const int tid = threadIdx.x;
    const int nthreads = blockDim.x;
    if (MODE == HeadReduce::kSegment) {
      HW_UNROLL
      for (int c = 0; c < COUNT; ++c) {
        HW_UNROLL
        for (int i = 0; i < ITEMS; ++i) val[c][i] = hw::warp_segment_sum(val[c][i], kv_);
      }
    } else if (MODE == HeadReduce::kWarps) {
      float* part = scratch_ + (calls_++ & 1) * half_;
      const int nw = nvec_ >> 5;
      // The warp sums of the COUNT x ITEMS values, spread over the lanes (value (c, i) at
      // c ITEMS + i); each leader stores the ones it holds.
      constexpr int kValues = COUNT * ITEMS;
      float held[kValues];
      HW_UNROLL
      for (int c = 0; c < COUNT; ++c) {
        HW_UNROLL
        for (int i = 0; i < ITEMS; ++i) held[c * ITEMS + i] = val[c][i];
      }
      hw::warp_sum_scatter(held);
      hw::store_scattered_sums(held, [&](int value, float sum) {
        const int i = value % ITEMS;
        if (items.valid(i)) part[value / ITEMS * nw + (items.offset(i) >> 5)] = sum;
      });
      __syncthreads();
      const int chunks = kv_ >> 5;
      if constexpr (Items::kCachedHeads || kValues > 32) {
        // Each thread adds its items' head sums (the vector layout, whose heads are
        // cached, and the scalar layout's backward, 16 items x 3 values: more values
        // than lanes). Item i lies in one head in every lane of the warp (a head is
        // whole warps), so the reads are broadcasts, with no shuffle to hand sums out.
        // With cached heads a head of 2 or 4 chunks reads its warp sums as one 8- or
        // 16-byte vector (at head * chunks, a multiple of chunks, as are nw and half_),
        // the chunk count chosen once a call; the sums are added in warp order.
        auto add_head_sums = [&](auto chunks_constant) {
          constexpr int kChunks = decltype(chunks_constant)::value;  // 0: chunks, at run time
          HW_UNROLL
          for (int i = 0; i < ITEMS; ++i) {
            if (!items.valid(i)) continue;
            const int c0 = items.head(i) * chunks;
            HW_UNROLL
            for (int c = 0; c < COUNT; ++c) {
              const float* sums = part + c * nw + c0;
              float s = 0.f;
              if constexpr (kChunks > 0) {
                float w[kChunks];
                hw::load_as_float<kChunks>(sums, w);
                s = w[0];
                for (int k = 1; k < kChunks; ++k) s += w[k];  // no pragma: 1 trip at kChunks = 2
              } else {
                HW_NO_UNROLL
                for (const float* w = sums; w != sums + chunks; ++w) s += *w;
              }
              val[c][i] = s;
            }
          }
        };
        if (Items::kCachedHeads && chunks == 2) add_head_sums(std::integral_constant<int, 2>{});
        else if (Items::kCachedHeads && chunks == 4) add_head_sums(std::integral_constant<int, 4>{});
        else add_head_sums(std::integral_constant<int, 0>{});
      } else {
        // The scalar layout's forward (16 items x 2 values, heads not cached): lane
        // c ITEMS + i adds the warp sums of value c of item i's head (in warp order) and
        // a shuffle hands each sum to every lane. Lanes past the values redo value 0.
        const int lane = tid & 31;
        const int k = lane < kValues ? lane : 0;
        const int c = k / ITEMS, i = k % ITEMS;
        const bool valid = items.valid(i);
        const int head = items.head(i);
        float s = 0.f;
        if (valid) {
          const float* sums = part + c * nw + head * chunks;
          HW_NO_UNROLL
          for (const float* w = sums; w != sums + chunks; ++w) s += *w;
        }
        HW_UNROLL
        for (int cv = 0; cv < COUNT; ++cv) {
          HW_UNROLL
          for (int iv = 0; iv < ITEMS; ++iv) {
            const float total = __shfl_sync(hw::kFullWarp, s, cv * ITEMS + iv);
            if (items.valid(iv)) val[cv][iv] = total;
          }
        }
      }
    } else {
      const int lane = tid & 31;
      HW_UNROLL
      for (int c = 0; c < COUNT; ++c) {
        float* part = scratch_ + (calls_++ & 1) * half_;
        HW_UNROLL
        for (int i = 0; i < ITEMS; ++i)
          if (items.valid(i)) part[items.offset(i)] = val[c][i];
        __syncthreads();
        // Warp w sums heads w, w + nwarps, ...; the sum lands in the head's first slot
        // once every lane has read the head (the shuffles order the reads before it).
        for (int h = tid >> 5; h < heads_; h += nthreads >> 5) {
          float s = 0.f;
          for (int j = lane; j < kv_; j += 32) s += part[h * kv_ + j];
          s = hw::warp_sum(s);
          if (lane == 0) part[h * kv_] = s;
        }
        __syncthreads();
        HW_UNROLL
        for (int i = 0; i < ITEMS; ++i)
          if (items.valid(i)) val[c][i] = part[items.head(i) * kv_];
      }
    }
  }

 private:
  float* scratch_;
  int nvec_, kv_, heads_, half_;
  unsigned calls_ = 0;
};

// The forwards' last step of a position, after a barrier: w[n,h] = exp(l[n,h] - max_h) /
// den_h from the raw logits s_logit [N, H], s_max [H] and s_den [H] (1 / den), written
// once by threads over (n, h). In w [N, B, T, H] the H weights of each n are contiguous
// (coalesced). T: the sources' type (softmax_exp's precision).
template <typename T>
__device__ __forceinline__ void store_position_weights(const FwdParams& p, int64_t pos, const float* s_logit,
                                                       const float* s_max, const float* s_den) {
  const int heads = static_cast<int>(p.route.heads);
  const int nh = p.route.num_sources * heads;
  for (int e = threadIdx.x; e < nh; e += blockDim.x) {
    const int n = e / heads;
    const int h = e - n * heads;
    p.weights[(n * p.route.positions + pos) * heads + h] = hw::softmax_exp<T>(s_logit[e] - s_max[h]) * s_den[h];
  }
}

// Forward. Blocks loop over positions (grid <= positions); per position one pass over
// the N rows in stages of ROWS rows (PREFETCH: the next stage's loads issued before the
// current stage's reductions), folding each stage into a [ITEMS, VEC] fp32 accumulator
// with the running-max softmax (a rescale only in a stage that raises the head's max; an
// odd N's last stage issues one row, not a zero row). The head's first thread keeps
// the raw logits in smem; at the end each weight is written once, as
// w[n,h] = exp(l[n,h] - max_h) / den_h, by threads over (n, h) (coalesced). The
// exponentials are hw::softmax_exp<T>: for 16-bit sources exp_ftz (2 instructions where
// expf's range reduction takes ~9; its error, 2 + floor(1.173 |x|) ulp, is smallest for the
// weights near the max, which carry the sum), for fp32 sources expf (the emulated build's
// is expf for both).
// Instructions per source element (the kernel issues, not HBM, set its pace at d = 4096:
// bench/RESULTS.md): a stage unpacks each element once (bf16: a shift or a mask), and the
// logit term is u * (q g) with u rounded two at a time (one cvt per pair), as the CPU
// kernel forms it.
template <typename T, int VEC, int ITEMS, int ROWS, bool PREFETCH, HeadReduce MODE>
__global__ void __launch_bounds__(kMaxThreads) mhar_route_fwd_kernel(const FwdParams p) {
  const int nthreads = blockDim.x;
  const int nvec = static_cast<int>(p.route.d / VEC);
  const int kv = static_cast<int>(p.route.head_dim / VEC);
  const int heads = static_cast<int>(p.route.heads);
  const int num_src = p.route.num_sources;
  const float inv_d = 1.f / static_cast<float>(p.route.d);
  const ThreadItems<ITEMS> items(nvec, kv);

  float* smem = reinterpret_cast<float*>(hw::dynamic_shared_memory());
  BlockSums<ROWS> block_sums(smem);
  HeadSums<ITEMS, ROWS, MODE> head_sums(smem + kBlockSumsFloats, nvec, kv, heads);
  float* pos_smem = smem + kBlockSumsFloats + head_sums_floats(MODE, nvec, ROWS);
  const int pos_floats = static_cast<int>(fwd_pos_floats(num_src, heads));
  float* slices = smem + fwd_slices_offset(MODE, nvec, ROWS, num_src, heads);

  constexpr bool kSlices = VEC == 1;
  const auto qg = forward_qg<ITEMS, VEC>(p.route, nvec, nthreads, slices);
  const float gate = p.gate == nullptr ? 1.f : *p.gate;

  int parity = 0;
  IndexSteps bt(blockIdx.x, gridDim.x, static_cast<int>(p.route.seq));  // the position's (b, t)
  for (int64_t pos = blockIdx.x; pos < p.route.positions; pos += gridDim.x, parity ^= 1, bt.next()) {
    // This position's logits [N, H], max [H], den [H]; the other parity's belong to the
    // previous position, which slower threads may still be reading.
    float* s_logit = pos_smem + parity * pos_floats;
    float* s_max = s_logit + num_src * heads;
    float* s_den = s_max + heads;
    const int64_t b = bt.q, t = bt.r;
    const T* src = static_cast<const T*>(p.route.sources) + b * p.route.src_stride_b + t * p.route.src_stride_t;

    ThreadVectors<ITEMS, VEC, kSlices> acc(slices + 2 * slice_block_floats(ITEMS, nthreads, VEC));
    // The running max of each item's head: registers, or (scalar layout) the second
    // slice block, free once qg is formed (16 more live registers would spill).
    ThreadVectors<ITEMS, VEC, kSlices> run_max(slices + slice_block_floats(ITEMS, nthreads, VEC));
    float run_den[ITEMS];
    HW_UNROLL
    for (int i = 0; i < ITEMS; ++i) {
      run_max.set(i, 0, -INFINITY);
      run_den[i] = 0.f;
      HW_UNROLL
      for (int k = 0; k < VEC; ++k) acc.set(i, k, 0.f);
    }

    // One stage: the rows [n0, n0 + ROWS) of the position, in cur; its block sums use
    // scratch half `half` (for_each_stage).
    using StageRows = hw::Pack<T, VEC>[ROWS][ITEMS];
    auto stage = [&](StageRows& cur, int n0, int half) {
      // The stage with its first R rows present (R = ROWS, or the 1 row left of an odd N
      // when ROWS = 2): the absent row's unpack, sums and fold are not issued at all, and
      // its sums enter the block and head reductions as zeros.
      auto fold_stage = [&](auto rows_present) {
        constexpr int R = decltype(rows_present)::value;
        // The vectorized layout unpacks the stage once; the scalar layout's 16 items per
        // row convert on use (16 more live fp32 registers would spill).
        float x[kSlices ? 1 : ROWS][kSlices ? 1 : ITEMS][VEC] = {};
        (void)x;  // unread in the scalar layout
        auto xv = [&](int j, int i, int k) -> float {
          if constexpr (kSlices) return static_cast<float>(cur[j][i].v[k]);
          else return x[j][i][k];
        };
        float r[ROWS];
        HW_UNROLL
        for (int j = 0; j < ROWS; ++j) {
          float ss = 0.f;
          if (j < R) {
            HW_UNROLL
            for (int i = 0; i < ITEMS; ++i) {
              if constexpr (!kSlices) hw::unpack_to_float<T, VEC>(cur[j][i], x[j][i]);
              HW_UNROLL
              for (int k = 0; k < VEC; ++k) ss += xv(j, i, k) * xv(j, i, k);
            }
          }
          r[j] = ss;
        }
        block_sums(r, half);
        HW_UNROLL
        for (int j = 0; j < R; ++j) r[j] = rsqrtf(r[j] * inv_d + p.route.eps);

        float logit[ROWS][ITEMS];
        HW_UNROLL
        for (int j = 0; j < ROWS; ++j) {
          HW_UNROLL
          for (int i = 0; i < ITEMS; ++i) {
            float l = 0.f;
            if (j < R) {
              float u[VEC], w[VEC];
              HW_UNROLL
              for (int k = 0; k < VEC; ++k) u[k] = xv(j, i, k) * r[j];
              hw::round_vec_to<T, VEC>(u);
              qg.load(i, w);
              HW_UNROLL
              for (int k = 0; k < VEC; ++k) l += u[k] * w[k];
            }
            logit[j][i] = l;
          }
        }
        head_sums(logit, items);

        HW_UNROLL
        for (int i = 0; i < ITEMS; ++i) {
          if (!items.valid(i)) continue;
          const float old_max = run_max.get(i, 0);
          float new_max = old_max;
          HW_UNROLL
          for (int j = 0; j < R; ++j) new_max = fmaxf(new_max, logit[j][i]);
          // Rescale only when the head's max rose (uniform over the head's threads) and
          // not on the first stage: with an equal max the factor is exp(0) = 1, and the
          // first stage's accumulator and denominator are 0, so skipping the products
          // leaves the same bits.
          float den = run_den[i];
          if (new_max > old_max) {
            if (old_max != -INFINITY) {
              const float alpha = hw::softmax_exp<T>(old_max - new_max);
              den *= alpha;
              HW_UNROLL
              for (int k = 0; k < VEC; ++k) acc.set(i, k, acc.get(i, k) * alpha);
            }
            run_max.set(i, 0, new_max);
          }
          float prob[R];
          HW_UNROLL
          for (int j = 0; j < R; ++j) {
            prob[j] = hw::softmax_exp<T>(logit[j][i] - new_max);
            den += prob[j];
          }
          HW_UNROLL
          for (int k = 0; k < VEC; ++k) {
            float a = acc.get(i, k);
            HW_UNROLL
            for (int j = 0; j < R; ++j) a += prob[j] * xv(j, i, k);
            acc.set(i, k, a);
          }
          run_den[i] = den;
          if (items.first(i)) {
            HW_UNROLL
            for (int j = 0; j < R; ++j) s_logit[(n0 + j) * heads + items.head(i)] = logit[j][i];
          }
        }
      };
      static_assert(ROWS <= 2, "a stage's tail is one row");
      if constexpr (ROWS == 1) {
        fold_stage(std::integral_constant<int, 1>{});
      } else if (n0 + ROWS <= num_src) {
        fold_stage(std::integral_constant<int, ROWS>{});
      } else {
        fold_stage(std::integral_constant<int, 1>{});
      }
    };
    for_each_stage<PREFETCH, T, VEC, ITEMS, ROWS>(src, p.route.src_stride_n, num_src, items, stage);

    T* out = static_cast<T*>(p.out) + pos * p.route.d;
    const T* res = p.residual == nullptr
                       ? nullptr
                       : static_cast<const T*>(p.residual) + b * p.res_stride_b + t * p.res_stride_t;
    HW_UNROLL
    for (int i = 0; i < ITEMS; ++i) {
      if (!items.valid(i)) continue;
      const int v = items.offset(i);
      const float inv_den = 1.f / run_den[i];
      const float scale = gate * inv_den;
      float rv[VEC];
      HW_UNROLL
      for (int k = 0; k < VEC; ++k) rv[k] = 0.f;
      if (res != nullptr) hw::load_as_float<VEC>(res + v * VEC, rv);
      float y[VEC];
      HW_UNROLL
      for (int k = 0; k < VEC; ++k) y[k] = acc.get(i, k) * scale + rv[k];
      hw::store_from_float<VEC>(out + v * VEC, y);
      if (items.first(i)) {
        s_max[items.head(i)] = run_max.get(i, 0);
        s_den[items.head(i)] = inv_den;
      }
    }
    __syncthreads();
    store_position_weights<T>(p, pos, s_logit, s_max, s_den);
  }
}

// Backward. Block j handles segments j, j + gridDim.x, ... of kBwdSegment positions and
// writes each segment's partial z (the query / norm-weight gradients up to a factor g or
// q) and partial dgate to row `segment` of z_partial / gate_partial.
// G: the dtype of grad_sources (T, or fp32 for the shared accumulation buffer of
// DepthBuffer); with p.accumulate the kernel adds to what grad_sources holds.
template <typename T, typename G, int VEC, int ITEMS, int ROWS, bool PREFETCH, HeadReduce MODE>
__global__ void __launch_bounds__(kMaxThreads) mhar_route_bwd_kernel(const BwdParams p) {
  const int tid = threadIdx.x;
  const int nthreads = blockDim.x;
  const int nvec = static_cast<int>(p.route.d / VEC);
  const int kv = static_cast<int>(p.route.head_dim / VEC);
  const int heads = static_cast<int>(p.route.heads);
  const int num_src = p.route.num_sources;
  const int nh = num_src * heads;
  const float inv_d = 1.f / static_cast<float>(p.route.d);
  const int64_t positions = p.route.positions;
  // Recomputed, not cached: the backward sits at the 128-register cap, and caching cost
  // up to 24 more registers (sm_90 ptxas: fp32 98 vs 122, bf16 123 vs 128).
  const ThreadItems<ITEMS, false> items(nvec, kv);

  float* smem = reinterpret_cast<float*>(hw::dynamic_shared_memory());
  hw::BlockSum block_sum(smem);
  // The head reductions of a stage: a, b and ss of its ROWS rows in one call, or (scalar
  // layout, to keep the registers) one call per value; or, deferred, the warp sums of
  // every row in s_warp_sums [3][N][nw], added per (n, h) after pass 1.
  constexpr bool kSlices = VEC == 1;
  constexpr int kPasses = kSlices ? 3 : 1;
  constexpr int kVals = 3 / kPasses;
  constexpr bool kDeferred = bwd_defers_head_sums(MODE, VEC);
  HeadSums<ITEMS, kVals * ROWS, MODE> head_sums(smem + 64, nvec, kv, heads);
  float* s_warp_sums = smem + 64;
  const int nw = nvec >> 5;
  // Deferred: a stage's a, b, ss of each (row, item) are warp-summed together by a
  // reduce-scatter (hw::warp_sum_scatter), after which each leader lane holds the three
  // of one (row, item). Its slot in s_warp_sums' [N][nw] planes (row of the stage * nw +
  // the item's warp; -1 for the other lanes), fixed for the kernel: for a stage of ROWS
  // rows and for an odd N's 1-row last stage.
  constexpr int kStageVals = 3 * ROWS * ITEMS;
  auto warp_sum_slot = [&](auto count) {
    constexpr int kCount = decltype(count)::value;
    static_assert((kCount >> hw::warp_scatter_levels(kCount)) == 3,
                  "a leader lane holds the three sums of one (row, item)");
    const int lane = tid & 31;
    const int ji = hw::warp_scatter_first<kCount>(lane) / 3;
    const int v = tid + (ji % ITEMS) * nthreads;
    return hw::warp_scatter_leader<kCount>(lane) && v < nvec ? (ji / ITEMS) * nw + (v >> 5) : -1;
  };
  int stage_slot = -1, tail_slot = -1;
  if constexpr (kDeferred) {
    stage_slot = warp_sum_slot(std::integral_constant<int, kStageVals>{});
    tail_slot = warp_sum_slot(std::integral_constant<int, 3 * ITEMS>{});
  }
  float* pos_smem = smem + 64 + bwd_head_scratch_floats(MODE, VEC, nvec, ROWS, num_src);
  const int pos_floats = static_cast<int>(bwd_pos_floats(num_src, heads));
  float* slices = pos_smem + bwd_pos_blocks(VEC) * pos_floats;
  const int64_t param_floats = param_slice_floats(kSlices, ITEMS, nthreads, VEC);
  // Pass 2's (n, h) coefficients gate w, r dl, dl as one 16-byte record each (the vector
  // layout's, one set; see emit_grads and bwd_pos_blocks).
  auto* s_rec = reinterpret_cast<hw::Pack<float, kBwdRecordFloats>*>(
      smem + bwd_records_offset(MODE, VEC, nvec, ROWS, num_src, heads, param_floats));
  // Staged rows: [n][i][tid] packs, each thread reading back only what it wrote.
  hw::Pack<T, VEC>* s_rows = reinterpret_cast<hw::Pack<T, VEC>*>(
      smem + bwd_smem_floats(MODE, VEC, nvec, ROWS, num_src, heads, param_floats));

  ThreadVectors<ITEMS, VEC, kSlices> qg = load_qg<ITEMS, VEC, kSlices>(p.route, nvec, nthreads, slices);
  // dout of the position (gate not applied): packs in registers, or fp32 in the second
  // slice (g is not needed once qg is formed).
  ThreadVectors<ITEMS, VEC, kSlices> dout_slice(slices + slice_block_floats(ITEMS, nthreads, VEC));
  const float gate = p.gate == nullptr ? 1.f : *p.gate;
  const int64_t segments = bwd_segments(positions);
  const int64_t wstride_n = positions * heads;

  int parity = 0;
  for (int64_t seg = blockIdx.x; seg < segments; seg += gridDim.x) {
    ThreadVectors<ITEMS, VEC, kSlices> z(slices + 2 * slice_block_floats(ITEMS, nthreads, VEC));
    HW_UNROLL
    for (int i = 0; i < ITEMS; ++i) {
      HW_UNROLL
      for (int k = 0; k < VEC; ++k) z.set(i, k, 0.f);
    }
    float gate_sum = 0.f;  // this thread's share of sum_h S_h: the heads it forms S_h for
    const int64_t pos_end = (seg + 1) * kBwdSegment < positions ? (seg + 1) * kBwdSegment : positions;
    for (int64_t pos = seg * kBwdSegment; pos < pos_end; ++pos, parity ^= 1) {
      // This position's [N, H] w, a, b, ss, dl and [N] r, r^3 c / d (the scalar layout:
      // the other parity's belong to the previous position; bwd_pos_blocks).
      float* s_w = pos_smem + (kSlices ? parity * pos_floats : 0);
      float* s_a = s_w + nh;
      float* s_b = s_a + nh;
      float* s_ss = s_b + nh;
      float* s_dl = s_ss + nh;
      float* s_r = s_dl + nh;
      float* s_r3c = s_r + num_src;
      const int64_t b = pos / p.route.seq;
      const int64_t t = pos - b * p.route.seq;
      const T* src = static_cast<const T*>(p.route.sources) + b * p.route.src_stride_b + t * p.route.src_stride_t;

      for (int e = tid; e < nh; e += nthreads) {
        const int n = e / heads;
        s_w[e] = p.weights[n * wstride_n + pos * heads + (e - n * heads)];
      }
      hw::Pack<T, VEC> dout[kSlices ? 1 : ITEMS];
      HW_UNROLL
      for (int i = 0; i < ITEMS; ++i) {
        const hw::Pack<T, VEC> pk = hw::load_pack_if<T, VEC>(
            static_cast<const T*>(p.grad_out) + pos * p.route.d + items.offset(i) * VEC, items.valid(i));
        if (kSlices) {
          HW_UNROLL
          for (int k = 0; k < VEC; ++k) dout_slice.set(i, k, static_cast<float>(pk.v[k]));
        } else {
          dout[kSlices ? 0 : i] = pk;
        }
      }
      // The fp32 dout of item i (unpacked from its pack, or read from the slice).
      auto dout_of = [&](int i, float (&o)[VEC]) {
        if (kSlices) {
          HW_UNROLL
          for (int k = 0; k < VEC; ++k) o[k] = dout_slice.get(i, k);
        } else {
          hw::unpack_to_float<T, VEC>(dout[kSlices ? 0 : i], o);
        }
      };

      // Pass 1: a, b and the sum of squares of every row, per head; a stage has the rows
      // [n0, n0 + ROWS) in cur.
      using StageRows = hw::Pack<T, VEC>[ROWS][ITEMS];
      auto pass1_stage = [&](StageRows& cur, int n0, int half) {
        (void)half;  // HeadSums alternates its halves itself
        const int rows = num_src - n0 < ROWS ? num_src - n0 : ROWS;
        if (p.stage_rows) {
          HW_UNROLL
          for (int j = 0; j < ROWS; ++j) {
            HW_UNROLL
            for (int i = 0; i < ITEMS; ++i) {
              const int v = tid + i * nthreads;
              if (j < rows && v < nvec)
                hw::store_pack<T, VEC>(reinterpret_cast<T*>(s_rows + ((n0 + j) * ITEMS + i) * nthreads + tid),
                                       cur[j][i]);
            }
          }
        }
        // Value c of a row: 0 a = <dout, s_n>, 1 b = <qg, s_n>, 2 ss = <s_n, s_n> (per head).
        // Deferred: the stage's values, (j, i, c) at warp_vals[(j ITEMS + i) 3 + c], are
        // warp-summed together (a reduce-scatter) and the leader lanes store them to
        // s_warp_sums; else they go into sums for head_sums.
        HW_UNROLL
        for (int pass = 0; pass < kPasses; ++pass) {
          float sums[kVals * ROWS][ITEMS];
          float warp_vals[kDeferred ? kStageVals : 1];
          HW_UNROLL
          for (int j = 0; j < ROWS; ++j) {
            HW_UNROLL
            for (int i = 0; i < ITEMS; ++i) {
              float part[3] = {0.f, 0.f, 0.f};
              // Deferred, an odd N's last stage: no work for the absent row.
              if (!kDeferred || j < rows) {
                float xs[VEC], dv[VEC];
                hw::unpack_to_float<T, VEC>(cur[j][i], xs);
                dout_of(i, dv);
                HW_UNROLL
                for (int k = 0; k < VEC; ++k) {
                  const float x = xs[k];
                  part[0] += dv[k] * x;
                  part[1] += qg.get(i, k) * x;
                  part[2] += x * x;
                }
              }
              if constexpr (kDeferred) {
                HW_UNROLL
                for (int c = 0; c < 3; ++c) warp_vals[(j * ITEMS + i) * 3 + c] = part[c];
              } else {
                HW_UNROLL
                for (int c = 0; c < kVals; ++c) sums[kVals * j + c][i] = part[pass * kVals + c];
              }
            }
          }
          if constexpr (kDeferred) {
            // The warp sums of vals (the stage's first rows), stored by the leader lanes.
            auto store_warp_sums = [&](auto& vals, int slot) {
              hw::warp_sum_scatter(vals);
              if (slot >= 0) {
                HW_UNROLL
                for (int c = 0; c < 3; ++c) s_warp_sums[(c * num_src + n0) * nw + slot] = vals[c];
              }
            };
            if (ROWS == 1 || rows == ROWS) {
              store_warp_sums(warp_vals, stage_slot);
            } else {  // an odd N's last stage: the present row's values only
              float row_vals[3 * ITEMS];
              HW_UNROLL
              for (int c = 0; c < 3 * ITEMS; ++c) row_vals[c] = warp_vals[c];
              store_warp_sums(row_vals, tail_slot);
            }
          } else {
            head_sums(sums, items);
            HW_UNROLL
            for (int i = 0; i < ITEMS; ++i) {
              if (!items.first(i)) continue;
              HW_UNROLL
              for (int j = 0; j < ROWS; ++j) {
                if (j >= rows) continue;
                const int e = (n0 + j) * heads + items.head(i);
                HW_UNROLL
                for (int c = 0; c < kVals; ++c) {
                  const int value = pass * kVals + c;
                  (value == 0 ? s_a : value == 1 ? s_b : s_ss)[e] = sums[kVals * j + c][i];
                }
              }
            }
          }
        }
      };
      for_each_stage<PREFETCH, T, VEC, ITEMS, ROWS>(src, p.route.src_stride_n, num_src, items, pass1_stage);
      __syncthreads();
      if constexpr (kDeferred) {
        // a, b, ss of (n, h): the head's kv / 32 warp sums in ascending order (HeadSums'
        // order and bits). Entry e = (c N + n) H + h of [3][N][H] owns warp sums
        // [e chunks, (e + 1) chunks), and s_a, s_b, s_ss are consecutive [N, H] arrays.
        const int chunks = kv >> 5;
        for (int e = tid; e < 3 * nh; e += nthreads) {
          float s = 0.f;
          for (int j = 0; j < chunks; ++j) s += s_warp_sums[e * chunks + j];
          s_a[e] = s;
        }
        __syncthreads();
      }

      // The per-(n, h) scalars, in ascending n and h: S_h and dl[., h] by thread h,
      // r_n by thread n.
      for (int h = tid; h < heads; h += nthreads) {
        float s = 0.f;
        for (int n = 0; n < num_src; ++n) s += s_w[n * heads + h] * s_a[n * heads + h];
        gate_sum += s;
        for (int n = 0; n < num_src; ++n) {
          const int e = n * heads + h;
          s_dl[e] = gate * s_w[e] * (s_a[e] - s);
        }
      }
      for (int n = tid; n < num_src; n += nthreads) {
        float ss = 0.f;
        for (int h = 0; h < heads; ++h) ss += s_ss[n * heads + h];
        s_r[n] = rsqrtf(ss * inv_d + p.route.eps);
      }
      __syncthreads();
      for (int n = tid; n < num_src; n += nthreads) {
        float c = 0.f;
        for (int h = 0; h < heads; ++h) c += s_dl[n * heads + h] * s_b[n * heads + h];
        const float r = s_r[n];
        s_r3c[n] = r * r * r * c * inv_d;
      }
      if constexpr (!kSlices) {
        for (int e = tid; e < nh; e += nthreads) {
          const float dl = s_dl[e];
          hw::Pack<float, kBwdRecordFloats> rec;
          rec.v[0] = gate * s_w[e];
          rec.v[1] = s_r[e / heads] * dl;
          rec.v[2] = dl;
          rec.v[3] = 0.f;
          hw::store_pack<float, kBwdRecordFloats>(reinterpret_cast<float*>(s_rec + e), rec);
        }
      }
      __syncthreads();

      // Pass 2: emit ds_n, accumulate z; no reductions.
      //   ds = gate w dout + (r dl) qg - r3c x   (the CPU kernel's association)
      // `staged` (the rows come from shared memory, else from the sources again) and
      // `accumulate` (ds adds to what grad_sources holds) are std::bool_constant in the
      // vector layout: as runtime flags they cost every element a predicated select of its
      // unpacked halves and an add. The scalar layout keeps one body with runtime flags
      // (four would spill its thread-slice base at the 128-register cap).
      // The items' heads, formed once per position in the vector layout (ITEMS
      // registers); the scalar layout's 16 items recompute them.
      using RowItems = ThreadItems<ITEMS, !kSlices>;
      // The vector layout addresses an item's packs from per-row pointers (item i at
      // + i nthreads vectors) and reads its coefficients as one 16-byte record; the
      // scalar layout, at the 128-register cap with 16 items, forms each item's addresses
      // from n and v and reads w and dl (held row pointers or records spilled it: 8-44
      // bytes, sm_80 / sm_90 / sm_100 ptxas).
      auto emit_grads = [&](auto staged, auto accumulate) {
        const RowItems row_items(nvec, kv);
        // The vector layout's row pointers, at the thread's first vector, stepped a row each
        // (unread in the scalar layout).
        const hw::Pack<T, VEC>* x_row = s_rows + tid;
        const T* src_row = src + tid * VEC;
        G* ds_row = static_cast<G*>(p.grad_sources) + pos * p.route.d + tid * VEC;
        const int64_t ds_row_stride = positions * p.route.d;
        for (int n = 0; n < num_src;
             ++n, x_row += ITEMS * nthreads, src_row += p.route.src_stride_n, ds_row += ds_row_stride) {
          const float r = s_r[n];
          const float r3c = s_r3c[n];
          // Unrolled by 4: all of ITEMS in the vectorized layout (its dout packs are
          // indexed by i), a quarter of the scalar layout's 16, whose item state is in
          // smem slices.
          HW_UNROLL_4
          for (int i = 0; i < ITEMS; ++i) {
            const int v = tid + i * nthreads;
            if (v >= nvec) continue;
            G* ds = kSlices ? static_cast<G*>(p.grad_sources) + (n * positions + pos) * p.route.d + v * VEC
                            : ds_row + i * nthreads * VEC;
            hw::Pack<T, VEC> xp;
            if (staged) {
              const hw::Pack<T, VEC>* at = kSlices ? s_rows + (n * ITEMS + i) * nthreads + tid : x_row + i * nthreads;
              xp = hw::load_pack<T, VEC>(reinterpret_cast<const T*>(at));
            } else {
              const T* at = kSlices ? src + n * p.route.src_stride_n + v * VEC : src_row + i * nthreads * VEC;
              hw::check_pack_alignment<T, VEC>(at);
              xp = hw::load_pack<T, VEC>(at);
            }
            float wg, rdl, dl;
            if constexpr (kSlices) {
              const int e = n * heads + row_items.head(i);
              wg = gate * s_w[e];
              rdl = r * s_dl[e];
              dl = s_dl[e];
            } else {
              const float* at = reinterpret_cast<const float*>(s_rec + n * heads + row_items.head(i));
              const hw::Pack<float, kBwdRecordFloats> rec = hw::load_pack<float, kBwdRecordFloats>(at);
              wg = rec.v[0];
              rdl = rec.v[1];
              dl = rec.v[2];
            }
            // What ds holds, loaded first: the scalar layout spills (sm_90) when the load
            // sits beside its use.
            float prev[VEC];
#if HW_SIM
            // Unused without `accumulate`. Zeros for g++'s flow analysis, which does not pair
            // the two tests of a runtime flag; in the GPU build this fill moved sm_90's
            // register allocation of the scalar layout to a spill.
            HW_UNROLL
            for (int k = 0; k < VEC; ++k) prev[k] = 0.f;
#endif
            if (accumulate) hw::load_as_float<VEC>(ds, prev);
            float x[VEC], dv[VEC], u[VEC], y[VEC];
            hw::unpack_to_float<T, VEC>(xp, x);
            dout_of(i, dv);
            HW_UNROLL
            for (int k = 0; k < VEC; ++k) u[k] = x[k] * r;
            hw::round_vec_to<T, VEC>(u);
            HW_UNROLL
            for (int k = 0; k < VEC; ++k) {
              y[k] = wg * dv[k] + rdl * qg.get(i, k) - r3c * x[k];
              z.set(i, k, z.get(i, k) + dl * u[k]);
            }
            if (accumulate) {
              HW_UNROLL
              for (int k = 0; k < VEC; ++k) y[k] = prev[k] + y[k];
            }
            hw::store_from_float<VEC>(ds, y);
          }
        }
      };
      if constexpr (kSlices) {
        emit_grads(p.stage_rows, p.accumulate);
      } else if (p.stage_rows) {
        if (p.accumulate) emit_grads(std::true_type{}, std::true_type{});
        else emit_grads(std::true_type{}, std::false_type{});
      } else {
        if (p.accumulate) emit_grads(std::false_type{}, std::true_type{});
        else emit_grads(std::false_type{}, std::false_type{});
      }
    }
    HW_UNROLL
    for (int i = 0; i < ITEMS; ++i) {
      const int v = tid + i * nthreads;
      if (v >= nvec) continue;
      float zi[VEC];
      HW_UNROLL
      for (int k = 0; k < VEC; ++k) zi[k] = z.get(i, k);
      hw::store_from_float<VEC>(p.z_partial + seg * p.route.d + v * VEC, zi);
    }
    const float seg_gate = block_sum(gate_sum);
    if (tid == 0) p.gate_partial[seg] = seg_gate;
  }
}

// Threads of mhar_param_grad_reduce_kernel: kReduceColumns columns x kReduceLanes lanes.
constexpr int kReduceColumns = 32;
constexpr int kReduceLanes = 8;
constexpr int kReduceUnroll = 16;

// Second stage of the query / norm-weight / gate gradients, column-parallel: block c
// sums columns [32 c, 32 c + 32) of the `rows` segment partials; lane l of a column sums
// rows l, l + 8, ... into 16 running sums in a fixed order, then the 8 lane sums are added
// in lane order.
// dq[j] = g[j] z[j], dg[j] = q[j] z[j]. Block 0 also sums the gate partials the same
// way over its 256 threads. Fixed order: bitwise deterministic for a given `rows`.
// Defined in mhar_param_grad_reduce_kernel.cuh (one translation unit).
__global__ void __launch_bounds__(kReduceColumns * kReduceLanes) mhar_param_grad_reduce_kernel(
    const float* __restrict__ z_partial, const float* __restrict__ gate_partial, int64_t rows, int64_t d,
    const float* __restrict__ query, const float* __restrict__ norm_weight, float* __restrict__ grad_query,
    float* __restrict__ grad_norm, float* __restrict__ grad_gate);

}  // namespace mhar
}  // namespace headwise
