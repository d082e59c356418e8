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
//     shared memory; each weight is written once at the end, coalesced.
//   - Backward, per position: pass 1 reads each row once (staged into shared memory when
//     N rows fit, each thread keeping its own vectors, so no barrier guards them) and
//     head-reduces a, b and the sums of squares; the per-(n, h) scalars S_h, dl, c_n
//     are formed by H + N threads from shared memory; pass 2 rereads the rows from shared
//     memory and emits the gradients with no reduction. The weights are loaded once per
//     position, coalesced, into shared memory.
//   - Query / norm-weight / gate gradients: per-segment partials (kBwdSegment consecutive
//     positions, summed in position order by one CTA) and a second kernel that sums the
//     segments' partials column-parallel in a fixed tree: bitwise deterministic and
//     independent of the grid.
#pragma once

#include "../common/block_reduce.cuh"
#include "../common/simt_portability.h"
#include "../common/unroll.h"
#include "../common/vec.cuh"

#include <cmath>
#include <cstdint>

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

// Floats of the thread-private slices of the scalar layout (three [d]-sized vectors per
// thread block: q, g and the accumulator, or q * g, dout and z; see ThreadVectors).
__host__ __device__ inline int64_t param_slice_floats(bool in_smem, int64_t items, int64_t threads, int64_t vec) {
  return in_smem ? 3 * items * threads * vec : 0;
}

// Forward dynamic smem (floats): BlockSums scratch (2 x 32 x ROWS), HeadSums scratch,
// per position (two, by parity) the logits [N, H], the heads' max and 1 / denominator
// [H], then the parameter slices.
__host__ __device__ inline int64_t fwd_pos_floats(int64_t n, int64_t heads) { return n * heads + 2 * heads; }
__host__ __device__ inline int64_t fwd_smem_floats(HeadReduce mode, int64_t nvec, int rows, int64_t n,
                                                   int64_t heads, int64_t param_floats) {
  return 64 * rows + head_sums_floats(mode, nvec, rows) + 2 * fwd_pos_floats(n, heads) + param_floats;
}

// Backward dynamic smem (floats): BlockSum scratch (64), HeadSums scratch (3 values per
// row of a stage), per position (two, by parity) w, a, b, sum of squares and dl [N, H],
// r_n and r_n^3 c_n / d [N], the parameter slices; then, with stage_rows, the staged
// rows (bytes, 16-aligned).
__host__ __device__ inline int64_t bwd_pos_floats(int64_t n, int64_t heads) { return 5 * n * heads + 2 * n; }
__host__ __device__ inline int64_t bwd_smem_floats(HeadReduce mode, int64_t nvec, int rows, int64_t n,
                                                   int64_t heads, int64_t param_floats) {
  const int64_t f = 64 + head_sums_floats(mode, nvec, 3 * rows) + 2 * bwd_pos_floats(n, heads) + param_floats;
  return (f + 3) / 4 * 4;
}

// The thread's ITEMS x VEC values of a [d]-sized fp32 vector: in registers, or (IN_SMEM,
// the scalar layout, whose 16 items per thread would not leave registers for the rest:
// the parameters and the accumulators live there)
// in a thread-private shared-memory slice laid out [ITEMS][blockDim.x][VEC]: consecutive
// lanes read consecutive words (conflict-free), and no barrier guards a thread's slice.
template <int ITEMS, int VEC, bool IN_SMEM>
struct ThreadVectors {
  float reg[IN_SMEM ? 1 : ITEMS][VEC];
  float* slice;

  __device__ explicit ThreadVectors(float* slice_base) : slice(slice_base) {}
  __device__ float get(int i, int k) const {
    return IN_SMEM ? slice[(i * blockDim.x + threadIdx.x) * VEC + k] : reg[IN_SMEM ? 0 : i][k];
  }
  __device__ void set(int i, int k, float x) {
    if (IN_SMEM) slice[(i * blockDim.x + threadIdx.x) * VEC + k] = x;
    else reg[IN_SMEM ? 0 : i][k] = x;
  }
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

template <typename T, int VEC>
__device__ __forceinline__ void zero_pack(hw::Pack<T, VEC>& pk) {
  HW_UNROLL
  for (int k = 0; k < VEC; ++k) pk.v[k] = static_cast<T>(0.f);
}

// Issues the loads of rows [n0, n0 + ROWS) of a position (the thread's vectors; zeros
// for rows >= n_end and vectors >= nvec).
template <typename T, int VEC, int ITEMS, int ROWS>
__device__ __forceinline__ void load_stage(const T* src, int64_t stride_n, int n0, int n_end, int nvec,
                                           hw::Pack<T, VEC> (&x)[ROWS][ITEMS]) {
  HW_UNROLL
  for (int r = 0; r < ROWS; ++r) {
    HW_UNROLL
    for (int i = 0; i < ITEMS; ++i) {
      const int v = threadIdx.x + i * blockDim.x;
      if (n0 + r < n_end && v < nvec) {
        hw::check_pack_alignment<T, VEC>(src + (n0 + r) * stride_n + v * VEC);
        x[r][i] = hw::load_pack<T, VEC>(src + (n0 + r) * stride_n + v * VEC);
      } else {
        zero_pack(x[r][i]);
      }
    }
  }
}

// The end of a stage at rows [n0, n0 + ROWS): the next stage's rows move into cur, from
// the registers they were prefetched into (PREFETCH), else by loading them now.
template <bool PREFETCH, typename T, int VEC, int ITEMS, int ROWS>
__device__ __forceinline__ void advance_stage(const T* src, int64_t stride_n, int n0, int n_end, int nvec,
                                              hw::Pack<T, VEC> (&cur)[ROWS][ITEMS],
                                              const hw::Pack<T, VEC> (&nxt)[ROWS][ITEMS]) {
  if constexpr (PREFETCH) {
    HW_UNROLL
    for (int j = 0; j < ROWS; ++j) {
      HW_UNROLL
      for (int i = 0; i < ITEMS; ++i) cur[j][i] = nxt[j][i];
    }
  } else if (n0 + ROWS < n_end) {
    load_stage<T, VEC, ITEMS, ROWS>(src, stride_n, n0 + ROWS, n_end, nvec, cur);
  }
}

// Block-wide sums of COUNT values with one __syncthreads per call; the scratch (2 x 32 x
// COUNT floats) alternates halves by call parity as hw::BlockSum's does.
template <int COUNT>
class BlockSums {
 public:
  __device__ explicit BlockSums(float* scratch) : scratch_(scratch) {}

  __device__ void operator()(float (&v)[COUNT]) {
    float* buf = scratch_ + (calls_++ & 1) * 32 * COUNT;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    HW_UNROLL
    for (int c = 0; c < COUNT; ++c) {
      const float s = hw::warp_sum(v[c]);
      if (lane == 0) buf[c * 32 + warp] = s;
    }
    __syncthreads();
    const int nwarps = blockDim.x >> 5;
    HW_UNROLL
    for (int c = 0; c < COUNT; ++c) {
      float total = 0.f;
      for (int w = 0; w < nwarps; ++w) total += buf[c * 32 + w];
      v[c] = total;
    }
  }

 private:
  float* scratch_;
  unsigned calls_ = 0;
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

  __device__ void operator()(float (&val)[COUNT][ITEMS]) {
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
      HW_UNROLL
      for (int c = 0; c < COUNT; ++c) {
        HW_UNROLL
        for (int i = 0; i < ITEMS; ++i) {
          const int v = tid + i * nthreads;
          const float s = hw::warp_sum(val[c][i]);
          if ((tid & 31) == 0 && v < nvec_) part[c * nw + (v >> 5)] = s;
        }
      }
      __syncthreads();
      const int chunks = kv_ >> 5;
      HW_UNROLL
      for (int i = 0; i < ITEMS; ++i) {
        const int v = tid + i * nthreads;
        if (v >= nvec_) continue;
        const int c0 = (v / kv_) * chunks;
        HW_UNROLL
        for (int c = 0; c < COUNT; ++c) {
          float s = 0.f;
          for (int j = 0; j < chunks; ++j) s += part[c * nw + c0 + j];
          val[c][i] = s;
        }
      }
    } else {
      const int lane = tid & 31;
      HW_UNROLL
      for (int c = 0; c < COUNT; ++c) {
        float* part = scratch_ + (calls_++ & 1) * half_;
        HW_UNROLL
        for (int i = 0; i < ITEMS; ++i) {
          const int v = tid + i * nthreads;
          if (v < nvec_) part[v] = val[c][i];
        }
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
        for (int i = 0; i < ITEMS; ++i) {
          const int v = tid + i * nthreads;
          if (v < nvec_) val[c][i] = part[(v / kv_) * kv_];
        }
      }
    }
  }

 private:
  float* scratch_;
  int nvec_, kv_, heads_, half_;
  unsigned calls_ = 0;
};

// Forward. Blocks loop over positions (grid <= positions); per position one pass over
// the N rows in stages of ROWS rows (PREFETCH: the next stage's loads issued before the
// current stage's reductions), folding each stage into a [ITEMS, VEC] fp32 accumulator
// with the running-max softmax (one rescale per stage). The head's first thread keeps
// the raw logits in smem; at the end each weight is written once, as
// w[n,h] = exp(l[n,h] - max_h) / den_h, by threads over (n, h) (coalesced).
template <typename T, int VEC, int ITEMS, int ROWS, bool PREFETCH, HeadReduce MODE>
__global__ void __launch_bounds__(kMaxThreads) mhar_route_fwd_kernel(const FwdParams p) {
  const int tid = threadIdx.x;
  const int nthreads = blockDim.x;
  const int nvec = static_cast<int>(p.route.d / VEC);
  const int kv = static_cast<int>(p.route.head_dim / VEC);
  const int heads = static_cast<int>(p.route.heads);
  const int num_src = p.route.num_sources;
  const float inv_d = 1.f / static_cast<float>(p.route.d);

  float* smem = reinterpret_cast<float*>(hw::dynamic_shared_memory());
  BlockSums<ROWS> block_sums(smem);
  HeadSums<ITEMS, ROWS, MODE> head_sums(smem + 64 * ROWS, nvec, kv, heads);
  float* pos_smem = smem + 64 * ROWS + head_sums_floats(MODE, nvec, ROWS);
  const int pos_floats = static_cast<int>(fwd_pos_floats(num_src, heads));
  float* slices = pos_smem + 2 * pos_floats;

  constexpr bool kSlices = VEC == 1;
  ThreadVectors<ITEMS, VEC, kSlices> q(slices), g(slices + ITEMS * nthreads * VEC);
  load_param(p.route.query, nvec, q);
  load_param(p.route.norm_weight, nvec, g);
  const float gate = p.gate == nullptr ? 1.f : *p.gate;

  int parity = 0;
  for (int64_t pos = blockIdx.x; pos < p.route.positions; pos += gridDim.x, parity ^= 1) {
    // This position's logits [N, H], max [H], den [H]; the other parity's belong to the
    // previous position, which slower threads may still be reading.
    float* s_logit = pos_smem + parity * pos_floats;
    float* s_max = s_logit + num_src * heads;
    float* s_den = s_max + heads;
    const int64_t b = pos / p.route.seq;
    const int64_t t = pos - b * p.route.seq;
    const T* src = static_cast<const T*>(p.route.sources) + b * p.route.src_stride_b + t * p.route.src_stride_t;

    ThreadVectors<ITEMS, VEC, kSlices> acc(slices + 2 * ITEMS * nthreads * VEC);
    float run_max[ITEMS], run_den[ITEMS];
    HW_UNROLL
    for (int i = 0; i < ITEMS; ++i) {
      run_max[i] = -INFINITY;
      run_den[i] = 0.f;
      HW_UNROLL
      for (int k = 0; k < VEC; ++k) acc.set(i, k, 0.f);
    }

    hw::Pack<T, VEC> cur[ROWS][ITEMS];
    load_stage<T, VEC, ITEMS, ROWS>(src, p.route.src_stride_n, 0, num_src, nvec, cur);
    for (int n0 = 0; n0 < num_src; n0 += ROWS) {
      hw::Pack<T, VEC> nxt[ROWS][ITEMS];
      if (PREFETCH) load_stage<T, VEC, ITEMS, ROWS>(src, p.route.src_stride_n, n0 + ROWS, num_src, nvec, nxt);

      float r[ROWS];
      HW_UNROLL
      for (int j = 0; j < ROWS; ++j) {
        float ss = 0.f;
        HW_UNROLL
        for (int i = 0; i < ITEMS; ++i) {
          HW_UNROLL
          for (int k = 0; k < VEC; ++k) {
            const float x = static_cast<float>(cur[j][i].v[k]);
            ss += x * x;
          }
        }
        r[j] = ss;
      }
      block_sums(r);
      HW_UNROLL
      for (int j = 0; j < ROWS; ++j) r[j] = rsqrtf(r[j] * inv_d + p.route.eps);

      float logit[ROWS][ITEMS];
      HW_UNROLL
      for (int j = 0; j < ROWS; ++j) {
        HW_UNROLL
        for (int i = 0; i < ITEMS; ++i) {
          float l = 0.f;
          HW_UNROLL
          for (int k = 0; k < VEC; ++k) {
            const float x = static_cast<float>(cur[j][i].v[k]);
            l += (hw::round_to<T>(x * r[j]) * g.get(i, k)) * q.get(i, k);
          }
          logit[j][i] = l;
        }
      }
      head_sums(logit);

      const int rows = num_src - n0 < ROWS ? num_src - n0 : ROWS;
      HW_UNROLL
      for (int i = 0; i < ITEMS; ++i) {
        const int v = tid + i * nthreads;
        if (v >= nvec) continue;
        float new_max = run_max[i];
        HW_UNROLL
        for (int j = 0; j < ROWS; ++j)
          if (j < rows) new_max = fmaxf(new_max, logit[j][i]);
        const float alpha = expf(run_max[i] - new_max);  // exp(-inf) = 0 on the first stage
        float prob[ROWS];
        float den = run_den[i] * alpha;
        HW_UNROLL
        for (int j = 0; j < ROWS; ++j) {
          prob[j] = j < rows ? expf(logit[j][i] - new_max) : 0.f;
          den += prob[j];
        }
        HW_UNROLL
        for (int k = 0; k < VEC; ++k) {
          float a = acc.get(i, k) * alpha;
          HW_UNROLL
          for (int j = 0; j < ROWS; ++j) a += prob[j] * static_cast<float>(cur[j][i].v[k]);
          acc.set(i, k, a);
        }
        run_max[i] = new_max;
        run_den[i] = den;
        if (v % kv == 0) {
          HW_UNROLL
          for (int j = 0; j < ROWS; ++j)
            if (j < rows) s_logit[(n0 + j) * heads + v / kv] = logit[j][i];
        }
      }

      advance_stage<PREFETCH, T, VEC, ITEMS, ROWS>(src, p.route.src_stride_n, n0, num_src, nvec, cur, nxt);
    }

    T* out = static_cast<T*>(p.out) + pos * p.route.d;
    const T* res = p.residual == nullptr
                       ? nullptr
                       : static_cast<const T*>(p.residual) + b * p.res_stride_b + t * p.res_stride_t;
    HW_UNROLL
    for (int i = 0; i < ITEMS; ++i) {
      const int v = tid + i * nthreads;
      if (v >= nvec) continue;
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
      if (v % kv == 0) {
        s_max[v / kv] = run_max[i];
        s_den[v / kv] = inv_den;
      }
    }
    __syncthreads();
    // w [N, B, T, H]: for each n, the H weights of this position are contiguous.
    const int nh = num_src * heads;
    for (int e = tid; e < nh; e += nthreads) {
      const int n = e / heads;
      const int h = e - n * heads;
      p.weights[(n * p.route.positions + pos) * heads + h] = expf(s_logit[e] - s_max[h]) * s_den[h];
    }
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

  float* smem = reinterpret_cast<float*>(hw::dynamic_shared_memory());
  hw::BlockSum block_sum(smem);
  // The head reductions of a stage: a, b and ss of its ROWS rows in one call, or (scalar
  // layout, to keep the registers) one call per value.
  constexpr bool kSlices = VEC == 1;
  constexpr int kPasses = kSlices ? 3 : 1;
  constexpr int kVals = 3 / kPasses;
  HeadSums<ITEMS, kVals * ROWS, MODE> head_sums(smem + 64, nvec, kv, heads);
  float* pos_smem = smem + 64 + head_sums_floats(MODE, nvec, 3 * ROWS);
  const int pos_floats = static_cast<int>(bwd_pos_floats(num_src, heads));
  float* slices = pos_smem + 2 * pos_floats;
  // Staged rows: [n][i][tid] packs, each thread reading back only what it wrote.
  hw::Pack<T, VEC>* s_rows = reinterpret_cast<hw::Pack<T, VEC>*>(smem + bwd_smem_floats(
      MODE, nvec, ROWS, num_src, heads, param_slice_floats(kSlices, ITEMS, nthreads, VEC)));

  // qg = q * g: the key path's weight of each element.
  ThreadVectors<ITEMS, VEC, kSlices> qg(slices);
  {
    ThreadVectors<ITEMS, VEC, kSlices> q(slices), g(slices + ITEMS * nthreads * VEC);
    load_param(p.route.query, nvec, q);
    load_param(p.route.norm_weight, nvec, g);
    HW_UNROLL
    for (int i = 0; i < ITEMS; ++i) {
      HW_UNROLL
      for (int k = 0; k < VEC; ++k) qg.set(i, k, q.get(i, k) * g.get(i, k));
    }
  }
  // dout of the position (gate not applied): packs in registers, or fp32 in the second
  // slice (g is not needed once qg is formed).
  ThreadVectors<ITEMS, VEC, kSlices> dout_slice(slices + ITEMS * nthreads * VEC);
  const float gate = p.gate == nullptr ? 1.f : *p.gate;
  const int64_t segments = bwd_segments(positions);
  const int64_t wstride_n = positions * heads;

  int parity = 0;
  for (int64_t seg = blockIdx.x; seg < segments; seg += gridDim.x) {
    ThreadVectors<ITEMS, VEC, kSlices> z(slices + 2 * ITEMS * nthreads * VEC);
    HW_UNROLL
    for (int i = 0; i < ITEMS; ++i) {
      HW_UNROLL
      for (int k = 0; k < VEC; ++k) z.set(i, k, 0.f);
    }
    float gate_sum = 0.f;  // this thread's share of sum_h S_h: the heads it forms S_h for
    const int64_t pos_end = (seg + 1) * kBwdSegment < positions ? (seg + 1) * kBwdSegment : positions;
    for (int64_t pos = seg * kBwdSegment; pos < pos_end; ++pos, parity ^= 1) {
      // This position's [N, H] w, a, b, ss, dl and [N] r, r^3 c / d; the other parity's
      // belong to the previous position.
      float* s_w = pos_smem + parity * pos_floats;
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
        const int v = tid + i * nthreads;
        hw::Pack<T, VEC> pk;
        if (v < nvec) {
          const T* dp = static_cast<const T*>(p.grad_out) + pos * p.route.d + v * VEC;
          hw::check_pack_alignment<T, VEC>(dp);
          pk = hw::load_pack<T, VEC>(dp);
        } else {
          zero_pack(pk);
        }
        if (kSlices) {
          HW_UNROLL
          for (int k = 0; k < VEC; ++k) dout_slice.set(i, k, static_cast<float>(pk.v[k]));
        } else {
          dout[kSlices ? 0 : i] = pk;
        }
      }
      auto dout_at = [&](int i, int k) {
        return kSlices ? dout_slice.get(i, k) : static_cast<float>(dout[kSlices ? 0 : i].v[k]);
      };

      // Pass 1: a, b and the sum of squares of every row, per head.
      hw::Pack<T, VEC> cur[ROWS][ITEMS];
      load_stage<T, VEC, ITEMS, ROWS>(src, p.route.src_stride_n, 0, num_src, nvec, cur);
      for (int n0 = 0; n0 < num_src; n0 += ROWS) {
        hw::Pack<T, VEC> nxt[ROWS][ITEMS];
        if (PREFETCH) load_stage<T, VEC, ITEMS, ROWS>(src, p.route.src_stride_n, n0 + ROWS, num_src, nvec, nxt);
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
        HW_UNROLL
        for (int pass = 0; pass < kPasses; ++pass) {
          float sums[kVals * ROWS][ITEMS];
          HW_UNROLL
          for (int j = 0; j < ROWS; ++j) {
            HW_UNROLL
            for (int i = 0; i < ITEMS; ++i) {
              float part[3] = {0.f, 0.f, 0.f};
              HW_UNROLL
              for (int k = 0; k < VEC; ++k) {
                const float x = static_cast<float>(cur[j][i].v[k]);
                part[0] += dout_at(i, k) * x;
                part[1] += qg.get(i, k) * x;
                part[2] += x * x;
              }
              HW_UNROLL
              for (int c = 0; c < kVals; ++c) sums[kVals * j + c][i] = part[pass * kVals + c];
            }
          }
          head_sums(sums);
          HW_UNROLL
          for (int i = 0; i < ITEMS; ++i) {
            const int v = tid + i * nthreads;
            if (v >= nvec || v % kv != 0) continue;
            HW_UNROLL
            for (int j = 0; j < ROWS; ++j) {
              if (j >= rows) continue;
              const int e = (n0 + j) * heads + v / kv;
              HW_UNROLL
              for (int c = 0; c < kVals; ++c) {
                const int value = pass * kVals + c;
                (value == 0 ? s_a : value == 1 ? s_b : s_ss)[e] = sums[kVals * j + c][i];
              }
            }
          }
        }
        advance_stage<PREFETCH, T, VEC, ITEMS, ROWS>(src, p.route.src_stride_n, n0, num_src, nvec, cur, nxt);
      }
      __syncthreads();

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
      __syncthreads();

      // Pass 2: emit ds_n, accumulate z; no reductions.
      for (int n = 0; n < num_src; ++n) {
        const float r = s_r[n];
        const float r3c = s_r3c[n];
        G* ds = static_cast<G*>(p.grad_sources) + (n * positions + pos) * p.route.d;
        HW_UNROLL
        for (int i = 0; i < ITEMS; ++i) {
          const int v = tid + i * nthreads;
          if (v >= nvec) continue;
          hw::Pack<T, VEC> xp;
          if (p.stage_rows) {
            xp = hw::load_pack<T, VEC>(reinterpret_cast<const T*>(s_rows + (n * ITEMS + i) * nthreads + tid));
          } else {
            hw::check_pack_alignment<T, VEC>(src + n * p.route.src_stride_n + v * VEC);
            xp = hw::load_pack<T, VEC>(src + n * p.route.src_stride_n + v * VEC);
          }
          const int e = n * heads + v / kv;
          const float wg = gate * s_w[e];
          const float dl = s_dl[e];
          float prev[VEC];
          if (p.accumulate) {
            hw::load_as_float<VEC>(ds + v * VEC, prev);
          } else {
            HW_UNROLL
            for (int k = 0; k < VEC; ++k) prev[k] = 0.f;
          }
          float y[VEC];
          HW_UNROLL
          for (int k = 0; k < VEC; ++k) {
            const float x = static_cast<float>(xp.v[k]);
            y[k] = prev[k] + (wg * dout_at(i, k) + r * (dl * qg.get(i, k)) - r3c * x);
            z.set(i, k, z.get(i, k) + dl * hw::round_to<T>(x * r));
          }
          hw::store_from_float<VEC>(ds + v * VEC, y);
        }
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
__global__ void __launch_bounds__(kReduceColumns * kReduceLanes) mhar_param_grad_reduce_kernel(
    const float* __restrict__ z_partial, const float* __restrict__ gate_partial, int64_t rows, int64_t d,
    const float* __restrict__ query, const float* __restrict__ norm_weight, float* __restrict__ grad_query,
    float* __restrict__ grad_norm, float* __restrict__ grad_gate) {
  __shared__ float lane_sums[kReduceLanes][kReduceColumns];
  const int col = threadIdx.x % kReduceColumns;
  const int lane = threadIdx.x / kReduceColumns;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kReduceColumns + col;
  // kReduceUnroll independent running sums (rows lane + 8 (16 m + u) go to sum u), so
  // that a thread has 16 loads in flight; added in u order.
  float acc[kReduceUnroll];
  HW_UNROLL
  for (int u = 0; u < kReduceUnroll; ++u) acc[u] = 0.f;
  if (j < d) {
    int64_t r = lane;
    for (; r + (kReduceUnroll - 1) * kReduceLanes < rows; r += kReduceUnroll * kReduceLanes) {
      HW_UNROLL
      for (int u = 0; u < kReduceUnroll; ++u) acc[u] += z_partial[(r + u * kReduceLanes) * d + j];
    }
    HW_UNROLL
    for (int u = 0; u < kReduceUnroll - 1; ++u)
      if (r + u * kReduceLanes < rows) acc[u] += z_partial[(r + u * kReduceLanes) * d + j];
  }
  float s = 0.f;
  HW_UNROLL
  for (int u = 0; u < kReduceUnroll; ++u) s += acc[u];
  lane_sums[lane][col] = s;
  __syncthreads();
  if (lane == 0 && j < d) {
    float z = 0.f;
    for (int l = 0; l < kReduceLanes; ++l) z += lane_sums[l][col];
    grad_query[j] = norm_weight[j] * z;
    grad_norm[j] = query[j] * z;
  }
  if (blockIdx.x == 0) {
    float gsum = 0.f;
    for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) gsum += gate_partial[r];
    __syncthreads();  // every thread has read lane_sums above
    lane_sums[lane][col] = gsum;
    __syncthreads();
    if (threadIdx.x == 0) {
      float total = 0.f;
      for (int l = 0; l < kReduceLanes; ++l)
        for (int c = 0; c < kReduceColumns; ++c) total += lane_sums[l][c];
      *grad_gate = total;
    }
  }
}

}  // namespace mhar
}  // namespace headwise
