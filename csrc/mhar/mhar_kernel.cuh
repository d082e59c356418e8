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
//   then with dout <- gate dout (so a, S_h scale by gate):
//   dl[n,h]  = w[n,h] (a[n,h] - S_h)
//   du_n[j]  = dl[n,h(j)] q[j] g[j],  c_n = <du_n, s_n>
//   ds_n[j]  = w[n,h(j)] dout[j] + r_n du_n[j] - r_n^3 s_n[j] c_n / d
//   z[j]    += dl[n,h(j)] u_n[j]      (over n and positions; dq = g z, dg = q z)
//
// Thread layout: the row is cut into nvec = d / VEC vectors of VEC elements; thread
// `tid` owns vectors v = tid + i * blockDim.x for i < ITEMS (v < nvec). VEC divides K,
// so a vector lies in one head: h(v) = v / kv with kv = K / VEC vectors per head.
#pragma once

#include "../common/block_reduce.cuh"
#include "../common/online_softmax.cuh"
#include "../common/simt_portability.h"
#include "../common/vec.cuh"

#include <cstdint>

namespace headwise {
namespace mhar {

// How the per-head sums of a row are formed from per-vector partials.
enum class HeadReduce : int {
  kSegment = 0,  // kv a power of two <= 32: a head is an aligned lane segment of a warp
  kWarps = 1,    // kv a multiple of 32: a head is whole warps; warp sums meet in smem
  kGeneric = 2,  // anything else: partials in smem, one warp per head
};

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
  const float* gate;         // [1] or nullptr (gate = 1)
  float* z_partial;          // [gridDim.x, d]: per-block sums of dl[n,h(j)] u_n[j]
  float* gate_partial;       // [gridDim.x]: per-block sums of S_h over heads and positions
};

// Loads the thread's vectors of query and norm weight (zeros for v >= nvec).
template <int ITEMS, int VEC>
__device__ __forceinline__ void load_routing_params(const Routing& r, int nvec, float (&q)[ITEMS][VEC],
                                                    float (&g)[ITEMS][VEC]) {
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int v = threadIdx.x + i * blockDim.x;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      q[i][k] = 0.f;
      g[i][k] = 0.f;
    }
    if (v < nvec) {
      hw::load_as_float<VEC>(r.query + v * VEC, q[i]);
      hw::load_as_float<VEC>(r.norm_weight + v * VEC, g[i]);
    }
  }
}

// Floats of the per-call head-partial buffer: the warp sums (kWarps) or the vector
// partials (kGeneric) of one row.
__host__ __device__ inline int64_t head_partial_floats(HeadReduce mode, int64_t nvec) {
  return mode == HeadReduce::kSegment ? 0 : (mode == HeadReduce::kWarps ? nvec / 32 : nvec);
}

// Floats of dynamic shared memory: 2 x 32 for BlockSum, then two head-partial buffers.
__host__ __device__ inline int64_t smem_floats(HeadReduce mode, int64_t nvec) {
  return 64 + 2 * head_partial_floats(mode, nvec);
}

// Replaces each valid item's per-vector partial by the sum over its head. Every thread
// of the block must make each call. The smem buffer alternates between two halves by
// call parity (the BlockSum argument): back-to-back calls need no extra barrier.
template <int ITEMS, HeadReduce MODE>
class HeadSum {
 public:
  __device__ HeadSum(float* buffers, int nvec, int kv, int heads)
      : buffers_(buffers), nvec_(nvec), kv_(kv), heads_(heads),
        half_(static_cast<int>(head_partial_floats(MODE, nvec))) {}

  __device__ void operator()(float (&val)[ITEMS]) {
    float* part = buffers_ + (calls_++ & 1) * half_;
    const int tid = threadIdx.x;
    const int nthreads = blockDim.x;
    if (MODE == HeadReduce::kSegment) {
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) val[i] = hw::warp_segment_sum(val[i], kv_);
    } else if (MODE == HeadReduce::kWarps) {
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int v = tid + i * nthreads;
        const float s = hw::warp_sum(val[i]);
        if ((tid & 31) == 0 && v < nvec_) part[v >> 5] = s;
      }
      __syncthreads();
      const int chunks = kv_ >> 5;
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int v = tid + i * nthreads;
        if (v < nvec_) {
          const int c0 = (v / kv_) * chunks;
          float s = 0.f;
          for (int c = 0; c < chunks; ++c) s += part[c0 + c];
          val[i] = s;
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int v = tid + i * nthreads;
        if (v < nvec_) part[v] = val[i];
      }
      __syncthreads();
      // Warp w sums heads w, w + nwarps, ...; the sum lands in the head's first slot
      // once every lane has read the head (the shuffles order the reads before it).
      const int lane = tid & 31;
      for (int h = tid >> 5; h < heads_; h += nthreads >> 5) {
        float s = 0.f;
        for (int j = lane; j < kv_; j += 32) s += part[h * kv_ + j];
        s = hw::warp_sum(s);
        if (lane == 0) part[h * kv_] = s;
      }
      __syncthreads();
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int v = tid + i * nthreads;
        if (v < nvec_) val[i] = part[(v / kv_) * kv_];
      }
    }
  }

 private:
  float* buffers_;
  int nvec_, kv_, heads_, half_;
  unsigned calls_ = 0;
};

// One block per position (b, t). Loop over the N source rows once, folding each row into
// a [ITEMS, VEC] fp32 accumulator with the running-max softmax. The raw logit of
// (n, h) is stored by the head's first thread and rescaled into w at the end.
template <typename T, int VEC, int ITEMS, HeadReduce MODE>
__global__ void __launch_bounds__(VEC == 8 ? 512 : 1024) mhar_route_fwd_kernel(const FwdParams p) {
  const int tid = threadIdx.x;
  const int nthreads = blockDim.x;
  const int nvec = static_cast<int>(p.route.d / VEC);
  const int kv = static_cast<int>(p.route.head_dim / VEC);
  const float inv_d = 1.f / static_cast<float>(p.route.d);

  float* smem = reinterpret_cast<float*>(hw::dynamic_shared_memory());
  hw::BlockSum block_sum(smem);
  HeadSum<ITEMS, MODE> head_sum(smem + 64, nvec, kv, static_cast<int>(p.route.heads));

  float q[ITEMS][VEC], g[ITEMS][VEC];
  load_routing_params(p.route, nvec, q, g);
  const float gate = p.gate == nullptr ? 1.f : *p.gate;

  // Blocks loop over positions only when B * T exceeds the grid (2^31 - 1 blocks).
  for (int64_t pos = blockIdx.x; pos < p.route.positions; pos += gridDim.x) {
    const int64_t b = pos / p.route.seq;
    const int64_t t = pos - b * p.route.seq;
    const T* src = static_cast<const T*>(p.route.sources) + b * p.route.src_stride_b + t * p.route.src_stride_t;
    float acc[ITEMS][VEC] = {};
    hw::OnlineSoftmax sm[ITEMS];

    for (int n = 0; n < p.route.num_sources; ++n) {
      const T* row = src + n * p.route.src_stride_n;
      float x[ITEMS][VEC];
      float sumsq = 0.f;
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int v = tid + i * nthreads;
#pragma unroll
        for (int k = 0; k < VEC; ++k) x[i][k] = 0.f;
        if (v < nvec) hw::load_as_float<VEC>(row + v * VEC, x[i]);
#pragma unroll
        for (int k = 0; k < VEC; ++k) sumsq += x[i][k] * x[i][k];
      }
      const float r = rsqrtf(block_sum(sumsq) * inv_d + p.route.eps);

      float logit[ITEMS];
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        float l = 0.f;
#pragma unroll
        for (int k = 0; k < VEC; ++k) l += (hw::round_to<T>(x[i][k] * r) * g[i][k]) * q[i][k];
        logit[i] = l;
      }
      head_sum(logit);

#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int v = tid + i * nthreads;
        if (v >= nvec) continue;
        float alpha, prob;
        sm[i].fold(logit[i], alpha, prob);
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc[i][k] = acc[i][k] * alpha + prob * x[i][k];
        if (v % kv == 0) p.weights[(n * p.route.positions + pos) * p.route.heads + v / kv] = logit[i];
      }
    }

    T* out = static_cast<T*>(p.out) + pos * p.route.d;
    const T* res = p.residual == nullptr
                       ? nullptr
                       : static_cast<const T*>(p.residual) + b * p.res_stride_b + t * p.res_stride_t;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int v = tid + i * nthreads;
      if (v >= nvec) continue;
      const float inv_den = 1.f / sm[i].den;
      const float scale = gate * inv_den;
      float y[VEC];
      float rv[VEC];
#pragma unroll
      for (int k = 0; k < VEC; ++k) rv[k] = 0.f;
      if (res != nullptr) hw::load_as_float<VEC>(res + v * VEC, rv);
#pragma unroll
      for (int k = 0; k < VEC; ++k) y[k] = acc[i][k] * scale + rv[k];
      hw::store_from_float<VEC>(out + v * VEC, y);
      if (v % kv == 0) {
        for (int n = 0; n < p.route.num_sources; ++n) {
          float* wp = p.weights + (n * p.route.positions + pos) * p.route.heads + v / kv;
          *wp = expf(*wp - sm[i].max) * inv_den;
        }
      }
    }
  }
}

// Persistent blocks: block j handles positions j, j + gridDim.x, ... and leaves its
// partial z (the query / norm-weight gradients up to a factor g or q) in row j of
// z_partial, so that the final sum over blocks (mhar_param_grad_reduce_kernel) has a
// fixed order.
// G: the dtype of grad_sources (T, or fp32 for the shared accumulation buffer of
// DepthBuffer); with p.accumulate the kernel adds to what grad_sources holds.
template <typename T, typename G, int VEC, int ITEMS, HeadReduce MODE>
__global__ void __launch_bounds__(VEC == 8 ? 512 : 1024) mhar_route_bwd_kernel(const BwdParams p) {
  const int tid = threadIdx.x;
  const int nthreads = blockDim.x;
  const int nvec = static_cast<int>(p.route.d / VEC);
  const int kv = static_cast<int>(p.route.head_dim / VEC);
  const float inv_d = 1.f / static_cast<float>(p.route.d);
  const int heads = static_cast<int>(p.route.heads);

  float* smem = reinterpret_cast<float*>(hw::dynamic_shared_memory());
  hw::BlockSum block_sum(smem);
  HeadSum<ITEMS, MODE> head_sum(smem + 64, nvec, kv, heads);

  float q[ITEMS][VEC], g[ITEMS][VEC], z[ITEMS][VEC] = {};
  load_routing_params(p.route, nvec, q, g);
  const float gate = p.gate == nullptr ? 1.f : *p.gate;
  float gate_sum = 0.f;  // this thread's share of sum_h S_h: the heads whose first vector it owns

  for (int64_t pos = blockIdx.x; pos < p.route.positions; pos += gridDim.x) {
    const int64_t b = pos / p.route.seq;
    const int64_t t = pos - b * p.route.seq;
    const T* src = static_cast<const T*>(p.route.sources) + b * p.route.src_stride_b + t * p.route.src_stride_t;
    const float* wpos = p.weights + pos * heads;
    const int64_t wstride_n = p.route.positions * heads;

    float dout[ITEMS][VEC];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int v = tid + i * nthreads;
#pragma unroll
      for (int k = 0; k < VEC; ++k) dout[i][k] = 0.f;
      if (v < nvec) hw::load_as_float<VEC>(static_cast<const T*>(p.grad_out) + pos * p.route.d + v * VEC, dout[i]);
    }

    // Pass 1: S_h = sum_n w[n,h] <dout_h, s_n[h]>.
    float coupling[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) coupling[i] = 0.f;
    for (int n = 0; n < p.route.num_sources; ++n) {
      const T* row = src + n * p.route.src_stride_n;
      float dot[ITEMS];
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int v = tid + i * nthreads;
        float x[VEC];
        dot[i] = 0.f;
        if (v < nvec) {
          hw::load_as_float<VEC>(row + v * VEC, x);
#pragma unroll
          for (int k = 0; k < VEC; ++k) dot[i] += dout[i][k] * x[k];
        }
      }
      head_sum(dot);
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int v = tid + i * nthreads;
        if (v < nvec) coupling[i] += wpos[n * wstride_n + v / kv] * dot[i];
      }
    }
    // dgate collects the unscaled S_h; the rest of the backward sees gate * dout.
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int v = tid + i * nthreads;
      if (v < nvec && v % kv == 0) gate_sum += coupling[i];
      coupling[i] *= gate;
#pragma unroll
      for (int k = 0; k < VEC; ++k) dout[i][k] *= gate;
    }

    // Pass 2: recompute r_n and the head dots, emit ds_n, accumulate z.
    for (int n = 0; n < p.route.num_sources; ++n) {
      const T* row = src + n * p.route.src_stride_n;
      float x[ITEMS][VEC];
      float dot[ITEMS];
      float sumsq = 0.f;
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int v = tid + i * nthreads;
        dot[i] = 0.f;
#pragma unroll
        for (int k = 0; k < VEC; ++k) x[i][k] = 0.f;
        if (v < nvec) hw::load_as_float<VEC>(row + v * VEC, x[i]);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          sumsq += x[i][k] * x[i][k];
          dot[i] += dout[i][k] * x[i][k];
        }
      }
      const float r = rsqrtf(block_sum(sumsq) * inv_d + p.route.eps);
      head_sum(dot);

      float wn[ITEMS], dl[ITEMS];
      float c_part = 0.f;
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int v = tid + i * nthreads;
        wn[i] = 0.f;
        dl[i] = 0.f;
        if (v < nvec) {
          wn[i] = wpos[n * wstride_n + v / kv];
          dl[i] = wn[i] * (dot[i] - coupling[i]);
        }
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const float u = hw::round_to<T>(x[i][k] * r);
          c_part += dl[i] * q[i][k] * g[i][k] * x[i][k];
          z[i][k] += dl[i] * u;
        }
      }
      const float c = block_sum(c_part);
      const float r3c = r * r * r * c * inv_d;

      G* ds = static_cast<G*>(p.grad_sources) + (n * p.route.positions + pos) * p.route.d;
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int v = tid + i * nthreads;
        if (v >= nvec) continue;
        float y[VEC];
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
          const float du = dl[i] * q[i][k] * g[i][k];
          y[k] = wn[i] * dout[i][k] + r * du - r3c * x[i][k];
        }
        if (p.accumulate) {
          float prev[VEC];
          hw::load_as_float<VEC>(ds + v * VEC, prev);
#pragma unroll
          for (int k = 0; k < VEC; ++k) y[k] += prev[k];
        }
        hw::store_from_float<VEC>(ds + v * VEC, y);
      }
    }
  }

#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int v = tid + i * nthreads;
    if (v >= nvec) continue;
    hw::store_from_float<VEC>(p.z_partial + blockIdx.x * p.route.d + v * VEC, z[i]);
  }
  const float block_gate = block_sum(gate_sum);
  if (tid == 0) p.gate_partial[blockIdx.x] = block_gate;
}

// Second stage of the query / norm-weight / gate gradients: z[j] = sum_r z_partial[r][j]
// over the `rows` block partials in ascending order, then dq[j] = g[j] z[j],
// dg[j] = q[j] z[j]; thread j = d sums the gate partials the same way.
__global__ void __launch_bounds__(256) mhar_param_grad_reduce_kernel(
    const float* __restrict__ z_partial, const float* __restrict__ gate_partial, int64_t rows, int64_t d,
    const float* __restrict__ query, const float* __restrict__ norm_weight, float* __restrict__ grad_query,
    float* __restrict__ grad_norm, float* __restrict__ grad_gate) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j == d) {
    float s = 0.f;
    for (int64_t r = 0; r < rows; ++r) s += gate_partial[r];
    *grad_gate = s;
  }
  if (j >= d) return;
  float z = 0.f;
  for (int64_t r = 0; r < rows; ++r) z += z_partial[r * d + j];
  grad_query[j] = norm_weight[j] * z;
  grad_norm[j] = query[j] * z;
}

}  // namespace mhar
}  // namespace headwise
