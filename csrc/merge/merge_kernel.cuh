// Head merge with the W_O block sum: device code of the forward and backward kernels
// (SPEC section 3). Compiled by nvcc for the GPU and by the host compiler against the
// SIMT emulator.
//
// Notation: z [B, H, Q, Dv] (any strides, stride-1 last dim), W = weight_o [D, H*Dv]
// (head h owns columns [h*Dv, (h+1)*Dv): W_h [D, Dv]), gate g [B, H] (1 when absent),
//   s[b]       = rescale ? (S > 1 ? H / S : H) : 1,   S = sum_h g[b,h]
//   alpha[b,h] = s[b] g[b,h]
//   y[b,q,:]   = sum_h alpha[b,h] Z[b,h,q,:] @ W_h^T + bias
// Backward, given dy:
//   dZ[b,h]    = alpha[b,h] dy_b @ W_h                      (P[b,h] = dy_b @ W_h)
//   dW_h       = sum_b alpha[b,h] dy_b^T Z[b,h]
//   c[b,h]     = <Z[b,h], P[b,h]>
//   dg[b,h]    = s[b] c[b,h] + ds/dS[b] sum_h' g[b,h'] c[b,h']
//
// The tensor-core kernels of merge_tc_kernel.cuh run the bf16/f16 forward without stats
// (and fp32 under TF32) and the bf16/f16 backward GEMMs; the SIMT kernels here run fp32 in
// full precision and the forward with stats. The bias and gate gradients below serve
// every path.
//
// The three SIMT GEMMs use one tile routine: 256 threads compute a kBM x kBN tile of fp32
// accumulators (thread (tx, ty) = (tid % 16, tid / 16) owns rows ty + 16 i, i < 2, and
// columns tx + 16 j, j < 4), staging kBK-deep slices of both operands in shared memory
// (converted to fp32). The forward's K loop runs over heads and skips a head whose gate
// is exactly 0 for the block's batch row: no reads of its Z or W_h, no FLOPs. Each head's
// product is formed in its own register tile before it is scaled into the output tile, so
// the per-head squared row norms of Z_h W_h^T (the out_norm statistic) come out of the
// same pass: summed over the tile's columns with lane-segment shuffles and written per
// column tile; a last small kernel sums the column tiles and takes square roots.
#pragma once

#include "../common/block_reduce.cuh"
#include "../common/simt_portability.h"
#include "../common/vec.cuh"

#include <cstdint>

namespace headwise {
namespace merge {

constexpr int kBM = 32;
constexpr int kBN = 64;
constexpr int kBK = 16;
constexpr int kThreads = 256;
constexpr int kRowsPerThread = kBM / 16;  // 2
constexpr int kColsPerThread = kBN / 16;  // 4

// A strided matrix view: element (r, c) at p[r * s_row + c * s_col], valid for r < rows,
// c < cols (zero outside).
template <typename T>
struct Mat {
  const T* p;
  int64_t s_row, s_col;
  int64_t rows, cols;
};

template <typename T>
__device__ __forceinline__ float load_or_zero(const Mat<T>& m, int64_t r, int64_t c) {
  return (r < m.rows && c < m.cols) ? static_cast<float>(m.p[r * m.s_row + c * m.s_col]) : 0.f;
}

// acc[i][j] += sum_k a(ty + 16 i, k) b(k, tx + 16 j) over k < a.cols (== b.rows).
// Every thread of the block must call it (it synchronizes). As: kBK * kBM floats,
// Bs: kBK * kBN floats of shared memory.
template <typename TA, typename TB>
__device__ __forceinline__ void tile_gemm(float (&acc)[kRowsPerThread][kColsPerThread], const Mat<TA>& a,
                                          const Mat<TB>& b, float* As, float* Bs) {
  const int tid = static_cast<int>(threadIdx.x);
  const int tx = tid % 16, ty = tid / 16;
  const bool a_k_fast = a.s_col == 1;  // consecutive threads read consecutive addresses
  const bool b_n_fast = b.s_col == 1;
  for (int64_t k0 = 0; k0 < a.cols; k0 += kBK) {
#pragma unroll
    for (int i = 0; i < kBM * kBK / kThreads; ++i) {
      const int e = tid + i * kThreads;
      const int m = a_k_fast ? e / kBK : e % kBM;
      const int k = a_k_fast ? e % kBK : e / kBM;
      As[k * kBM + m] = load_or_zero(a, m, k0 + k);
    }
#pragma unroll
    for (int i = 0; i < kBN * kBK / kThreads; ++i) {
      const int e = tid + i * kThreads;
      const int n = b_n_fast ? e % kBN : e / kBK;
      const int k = b_n_fast ? e / kBN : e % kBK;
      Bs[k * kBN + n] = load_or_zero(b, k0 + k, n);
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kBK; ++k) {
      float av[kRowsPerThread], bv[kColsPerThread];
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) av[i] = As[k * kBM + ty + 16 * i];
#pragma unroll
      for (int j = 0; j < kColsPerThread; ++j) bv[j] = Bs[k * kBN + tx + 16 * j];
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i)
#pragma unroll
        for (int j = 0; j < kColsPerThread; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
    }
    __syncthreads();
  }
}

// Gate of (b, h) (1 without a gate) and the row's scale s[b] (and ds/dS when asked).
struct Gate {
  const float* g;  // fp32 [H] (g_sb = 0) or [B, H] (g_sb = H); nullptr: all ones
  int64_t g_sb;
  int64_t heads;
  bool rescale;

  __device__ __forceinline__ float at(int64_t b, int64_t h) const { return g ? g[b * g_sb + h] : 1.f; }

  __device__ __forceinline__ float scale(int64_t b, float* dsds = nullptr) const {
    if (dsds) *dsds = 0.f;
    if (!rescale) return 1.f;
    float sum = 0.f;
    for (int64_t h = 0; h < heads; ++h) sum += at(b, h);
    const float hf = static_cast<float>(heads);
    if (sum > 1.f) {
      if (dsds) *dsds = -hf / (sum * sum);
      return hf / sum;
    }
    return hf;  // min(H, H / S): the clip, also for an all-closed row
  }
};

struct FwdParams {
  const void* z;
  int64_t z_sb, z_sh, z_sq;
  const void* w;
  int64_t ldw;
  const void* bias;  // [D] or nullptr
  Gate gate;
  void* out;  // [B, Q, D] contiguous
  float* znorm_sq;    // [B, Q, H] or nullptr (no stats)
  float* onorm_part;  // [n_tiles, B, Q, H]
  int64_t batch, heads, seq, dv, d;
};

// grid (B * ceil(D / kBN), ceil(Q / kBM)), kThreads threads: blockIdx.x = b * n_tiles +
// column tile (the batch on x, whose limit is 2^31 - 1, not on y/z's 65535).
template <typename T>
__global__ void __launch_bounds__(kThreads) head_merge_fwd_kernel(FwdParams p) {
  __shared__ float As[kBK * kBM];
  __shared__ float Bs[kBK * kBN];
  const int tid = static_cast<int>(threadIdx.x);
  const int tx = tid % 16, ty = tid / 16;
  const int64_t n_tiles = (p.d + kBN - 1) / kBN;
  const int64_t tile_n = static_cast<int64_t>(blockIdx.x) % n_tiles;
  const int64_t b = static_cast<int64_t>(blockIdx.x) / n_tiles;
  const int64_t n0 = tile_n * kBN;
  const int64_t q0 = static_cast<int64_t>(blockIdx.y) * kBM;
  const int64_t rows = p.seq - q0 < kBM ? p.seq - q0 : kBM;
  const int64_t cols = p.d - n0 < kBN ? p.d - n0 : kBN;
  const T* z = static_cast<const T*>(p.z);
  const T* w = static_cast<const T*>(p.w);
  const bool stats = p.znorm_sq != nullptr;
  const float s = p.gate.scale(b);

  float acc[kRowsPerThread][kColsPerThread] = {};
  for (int64_t h = 0; h < p.heads; ++h) {
    const float g = p.gate.at(b, h);
    const int64_t stat_base = (b * p.seq + q0) * p.heads + h;  // + r * heads
    if (g == 0.f) {  // closed: no work; its statistics are 0
      if (stats && tx == 0) {
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) {
          const int64_t r = ty + 16 * i;
          if (r < rows) {
            p.onorm_part[tile_n * p.batch * p.seq * p.heads + stat_base + r * p.heads] = 0.f;
            if (tile_n == 0) p.znorm_sq[stat_base + r * p.heads] = 0.f;
          }
        }
      }
      continue;
    }
    const Mat<T> za{z + b * p.z_sb + h * p.z_sh + q0 * p.z_sq, p.z_sq, 1, rows, p.dv};
    const Mat<T> wb{w + n0 * p.ldw + h * p.dv, 1, p.ldw, p.dv, cols};  // (k, n) = W[n0 + n, h Dv + k]
    float hacc[kRowsPerThread][kColsPerThread] = {};
    tile_gemm(hacc, za, wb, As, Bs);
    if (stats) {
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) {
        float sq = 0.f;
#pragma unroll
        for (int j = 0; j < kColsPerThread; ++j)  // columns beyond D excluded (inf * 0 padding is NaN)
          if (tx + 16 * j < cols) sq += hacc[i][j] * hacc[i][j];
        sq = hw::warp_segment_sum(sq, 16);
        const int64_t r = ty + 16 * i;
        if (tx == 0 && r < rows) p.onorm_part[tile_n * p.batch * p.seq * p.heads + stat_base + r * p.heads] = sq;
      }
      if (tile_n == 0 && tid < rows) {
        const T* zr = z + b * p.z_sb + h * p.z_sh + (q0 + tid) * p.z_sq;
        float zz = 0.f;
        for (int64_t j = 0; j < p.dv; ++j) {
          const float v = static_cast<float>(zr[j]);
          zz = fmaf(v, v, zz);
        }
        p.znorm_sq[stat_base + static_cast<int64_t>(tid) * p.heads] = zz;
      }
    }
    const float alpha = s * g;
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i)
#pragma unroll
      for (int j = 0; j < kColsPerThread; ++j) acc[i][j] = fmaf(alpha, hacc[i][j], acc[i][j]);
  }
  const T* bias = static_cast<const T*>(p.bias);
  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int64_t r = ty + 16 * i;
    if (r >= rows) continue;
#pragma unroll
    for (int j = 0; j < kColsPerThread; ++j) {
      const int64_t n = tx + 16 * j;
      if (n >= cols) continue;
      float v = acc[i][j];
      if (bias) v += static_cast<float>(bias[n0 + n]);
      out[(b * p.seq + q0 + r) * p.d + n0 + n] = static_cast<T>(v);
    }
  }
}

// z_norm = sqrt(znorm_sq) in place; out_norm = sqrt(sum over column tiles). One thread per
// (b, q, h).
__global__ void head_merge_stats_finalize_kernel(float* znorm, const float* onorm_part, float* onorm,
                                                 int64_t count, int64_t tiles) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count) return;
  float sum = 0.f;
  for (int64_t t = 0; t < tiles; ++t) sum += onorm_part[t * count + i];
  onorm[i] = sqrtf(sum);  // a sum of squares: >= 0, and a NaN propagates
  znorm[i] = sqrtf(znorm[i]);
}

struct BwdParams {
  const void* grad_out;  // [B, Q, D] contiguous
  const void* z;
  int64_t z_sb, z_sh, z_sq;
  const void* w;
  int64_t ldw;
  Gate gate;
  void* grad_z;
  int64_t gz_sb, gz_sh, gz_sq;
  void* grad_w;       // [D, H*Dv] contiguous, z's dtype
  float* c_part;      // [B, H, q_tiles * dv_tiles] or nullptr (no gate gradient)
  int64_t batch, heads, seq, dv, d;
};

// grad_z tiles: grid (B * H * ceil(Dv / kBN), ceil(Q / kBM)), kThreads threads:
// blockIdx.x = (b * H + h) * dv_tiles + column tile.
template <typename T>
__global__ void __launch_bounds__(kThreads) head_merge_bwd_dz_kernel(BwdParams p) {
  __shared__ float As[kBK * kBM];
  __shared__ float Bs[kBK * kBN];
  __shared__ float red[64];
  const int tid = static_cast<int>(threadIdx.x);
  const int tx = tid % 16, ty = tid / 16;
  const int64_t dv_tiles = (p.dv + kBN - 1) / kBN;
  const int64_t tile_n = static_cast<int64_t>(blockIdx.x) % dv_tiles;
  const int64_t bh = static_cast<int64_t>(blockIdx.x) / dv_tiles;
  const int64_t n0 = tile_n * kBN;
  const int64_t q0 = static_cast<int64_t>(blockIdx.y) * kBM;
  const int64_t b = bh / p.heads, h = bh % p.heads;
  const int64_t rows = p.seq - q0 < kBM ? p.seq - q0 : kBM;
  const int64_t cols = p.dv - n0 < kBN ? p.dv - n0 : kBN;
  const T* z = static_cast<const T*>(p.z);
  T* gz = static_cast<T*>(p.grad_z);
  const float g = p.gate.at(b, h);
  const bool need_c = p.c_part != nullptr;
  float acc[kRowsPerThread][kColsPerThread] = {};
  if (g != 0.f || need_c) {  // a closed head's P is only needed for the gate's gradient
    const Mat<T> dy{static_cast<const T*>(p.grad_out) + (b * p.seq + q0) * p.d, p.d, 1, rows, p.d};
    const Mat<T> wh{static_cast<const T*>(p.w) + h * p.dv + n0, p.ldw, 1, p.d, cols};
    tile_gemm(acc, dy, wh, As, Bs);
  }
  const float alpha = p.gate.scale(b) * g;
  float c = 0.f;
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int64_t r = ty + 16 * i;
    if (r >= rows) continue;
#pragma unroll
    for (int j = 0; j < kColsPerThread; ++j) {
      const int64_t n = tx + 16 * j;
      if (n >= cols) continue;
      if (need_c) c += acc[i][j] * static_cast<float>(z[b * p.z_sb + h * p.z_sh + (q0 + r) * p.z_sq + n0 + n]);
      gz[b * p.gz_sb + h * p.gz_sh + (q0 + r) * p.gz_sq + n0 + n] = static_cast<T>(alpha * acc[i][j]);
    }
  }
  if (need_c) {
    hw::BlockSum block_sum(red);
    c = block_sum(c);
    if (tid == 0)
      p.c_part[(bh * gridDim.y + blockIdx.y) * dv_tiles + tile_n] = c;
  }
}

// grad_weight_o tiles: grid (ceil(Dv / kBN), ceil(D / kBM), H), kThreads threads; the
// reduction over (b, q) runs inside the block (no atomics), skipping closed (b, h).
template <typename T>
__global__ void __launch_bounds__(kThreads) head_merge_bwd_dw_kernel(BwdParams p) {
  __shared__ float As[kBK * kBM];
  __shared__ float Bs[kBK * kBN];
  const int tid = static_cast<int>(threadIdx.x);
  const int tx = tid % 16, ty = tid / 16;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kBN;
  const int64_t m0 = static_cast<int64_t>(blockIdx.y) * kBM;
  const int64_t h = blockIdx.z;
  const int64_t rows = p.d - m0 < kBM ? p.d - m0 : kBM;
  const int64_t cols = p.dv - n0 < kBN ? p.dv - n0 : kBN;
  const T* z = static_cast<const T*>(p.z);
  float acc[kRowsPerThread][kColsPerThread] = {};
  for (int64_t b = 0; b < p.batch; ++b) {
    const float g = p.gate.at(b, h);
    if (g == 0.f) continue;
    const Mat<T> dyt{static_cast<const T*>(p.grad_out) + b * p.seq * p.d + m0, 1, p.d, rows, p.seq};
    const Mat<T> zb{z + b * p.z_sb + h * p.z_sh + n0, p.z_sq, 1, p.seq, cols};
    float hacc[kRowsPerThread][kColsPerThread] = {};
    tile_gemm(hacc, dyt, zb, As, Bs);
    const float alpha = p.gate.scale(b) * g;
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i)
#pragma unroll
      for (int j = 0; j < kColsPerThread; ++j) acc[i][j] = fmaf(alpha, hacc[i][j], acc[i][j]);
  }
  T* gw = static_cast<T*>(p.grad_w);
  const int64_t k = p.heads * p.dv;
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int64_t r = ty + 16 * i;
    if (r >= rows) continue;
#pragma unroll
    for (int j = 0; j < kColsPerThread; ++j) {
      const int64_t n = tx + 16 * j;
      if (n < cols) gw[(m0 + r) * k + h * p.dv + n0 + n] = static_cast<T>(acc[i][j]);
    }
  }
}

// grad_bias[n] = sum over rows r of dy[r, n] (dy [rows, D] contiguous), in two fixed-order
// stages (no atomics: the result depends on the shape only). Bytes: dy read once (the
// HBM floor, 134 MB at B*Q = 16384, D = 4096 bf16) plus 4 D ceil(rows / kBiasRows) bytes
// of partials written and read (2 MB there).
// Stage 1: grid (ceil(rows / kBiasRows), ceil(D / (32 VEC))), kThreads threads: lane l of
// warp w owns the VEC columns n0 + l VEC.. (VEC = 16 bytes of T where D and dy allow
// 16-byte loads, else 1) and sums them over rows w, w + 8, ... of the block's
// kBiasRows-row chunk, kBiasUnroll rows' loads in flight at a time (a warp reads 512
// contiguous bytes of a row per request at VEC = 16 bytes); the 8 warp sums of each column
// are then added in warp order through shared memory (a lane's VEC sums at a pitch of
// VEC + 1 words: conflict-free writes, reads at most 2-way) and leave as part[chunk, n],
// consecutive threads on consecutive columns.
constexpr int kBiasRows = 128;
constexpr int kBiasUnroll = 4;

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) head_merge_bwd_bias_partial_kernel(const T* dy, float* part, int64_t rows,
                                                                                 int64_t d) {
  constexpr int kWarps = kThreads / 32, kCols = 32 * VEC, kPitch = VEC == 1 ? 1 : VEC + 1;
  __shared__ float warp_sums[kWarps][32 * kPitch];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t chunk = blockIdx.x;
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * kCols;
  const int64_t n = n0 + lane * VEC;  // this lane's first column (VEC columns, all < d or none)
  const int64_t r0 = chunk * kBiasRows;
  const int64_t r1 = rows - r0 < kBiasRows ? rows : r0 + kBiasRows;
  float sum[VEC];
#pragma unroll
  for (int e = 0; e < VEC; ++e) sum[e] = 0.f;
  if (n < d) {
    const T* col = dy + n;
    int64_t r = r0 + warp;
    for (; r + (kBiasUnroll - 1) * kWarps < r1; r += kBiasUnroll * kWarps) {
      hw::Pack<T, VEC> x[kBiasUnroll];
#pragma unroll
      for (int u = 0; u < kBiasUnroll; ++u) x[u] = hw::load_pack<T, VEC>(col + (r + u * kWarps) * d);
#pragma unroll
      for (int u = 0; u < kBiasUnroll; ++u)
#pragma unroll
        for (int e = 0; e < VEC; ++e) sum[e] += static_cast<float>(x[u].v[e]);
    }
    // At most kBiasUnroll - 1 rows are left: kept rolled (ptxas unrolled it 4x, and at
    // sm_100's 32-register choice that spilled a loop invariant).
#pragma unroll 1
    for (; r < r1; r += kWarps) {
      const hw::Pack<T, VEC> x = hw::load_pack<T, VEC>(col + r * d);
#pragma unroll
      for (int e = 0; e < VEC; ++e) sum[e] += static_cast<float>(x.v[e]);
    }
  }
#pragma unroll
  for (int e = 0; e < VEC; ++e) warp_sums[warp][lane * kPitch + e] = sum[e];
  __syncthreads();
  for (int c = threadIdx.x; c < kCols && n0 + c < d; c += kThreads) {
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += warp_sums[w][(c / VEC) * kPitch + c % VEC];
    part[chunk * d + n0 + c] = total;
  }
}

// Stage 2: grad_bias[n] = sum over chunks of part[chunk, n]: grid ceil(D / 32), kThreads
// threads; warp w sums chunks w, w + 8, ... in order for column n0 + lane (a warp reads
// 128 contiguous bytes a request, kBiasUnroll chunks' loads in flight at a time), then
// the 8 warp sums are added in warp order.
template <typename T>
__global__ void __launch_bounds__(kThreads) head_merge_bwd_bias_finalize_kernel(const float* part, T* grad_bias,
                                                                                  int64_t chunks, int64_t d) {
  constexpr int kWarps = kThreads / 32;
  __shared__ float warp_sums[kWarps][32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * 32 + lane;
  float sum = 0.f;
  if (n < d) {
    int64_t c = warp;
    for (; c + (kBiasUnroll - 1) * kWarps < chunks; c += kBiasUnroll * kWarps) {
      float x[kBiasUnroll];
#pragma unroll
      for (int u = 0; u < kBiasUnroll; ++u) x[u] = part[(c + u * kWarps) * d + n];
#pragma unroll
      for (int u = 0; u < kBiasUnroll; ++u) sum += x[u];
    }
    for (; c < chunks; c += kWarps) sum += part[c * d + n];
  }
  warp_sums[warp][lane] = sum;
  __syncthreads();
  if (warp == 0 && n < d) {
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += warp_sums[w][lane];
    grad_bias[n] = static_cast<T>(total);
  }
}

// The gate's gradient from the <Z, P> partials: grid B, kThreads threads. For batch row
// b, c[b,h] = sum over parts (in order) of c_part[b, h, :], one thread per head (strided),
// gc = sum_h g[b,h] c[b,h] by a fixed-order block sum, then grad_gate[b, h] (fp32 [B, H];
// the host sums over b, in order, for an [H] gate).
__global__ void __launch_bounds__(kThreads) head_merge_gate_grad_kernel(Gate gate, const float* c_part,
                                                                         int64_t parts, float* grad_gate) {
  __shared__ float red[64];
  const int64_t H = gate.heads;
  const int64_t b = blockIdx.x;
  float dsds = 0.f;
  const float s = gate.scale(b, &dsds);
  auto c_of = [&](int64_t h) {
    float c = 0.f;
    for (int64_t t = 0; t < parts; ++t) c += c_part[(b * H + h) * parts + t];
    return c;
  };
  float local = 0.f;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) local += gate.at(b, h) * c_of(h);
  hw::BlockSum block_sum(red);
  const float gc = block_sum(local);
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
    const float c = c_of(h);
    // The rescale term only where it is active (dsds != 0): 0 * (a NaN of another head) must
    // not reach this head's gradient.
    grad_gate[b * H + h] = dsds != 0.f ? s * c + dsds * gc : s * c;
  }
}

}  // namespace merge
}  // namespace headwise
