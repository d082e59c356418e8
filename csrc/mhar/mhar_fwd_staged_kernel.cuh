// MHAR forward with a position's rows staged in shared memory by cp.async (SPEC section 4;
// the notation of mhar_kernel.cuh). Compiled by nvcc and against the SIMT emulator.
//
// Budget (bf16, N = 9, d = 4096, H = 8, B T = 8192): a position reads N rows (72 KiB) and
// writes one (8 KiB) and N H fp32 weights: 673 MB in all, 0.14 ms at the H200's 4.8 TB/s.
// Its arithmetic is ~8 operations per source element (square, normalize, round, logit,
// fold), ~0.3 GFLOP: HBM-bound by ~10x over the FP32 ceiling, so what sets the pace is
// instruction issue and the latency between the loads and their use (the first H200 run
// measured the streaming kernel at 16% of HBM: bench/RESULTS.md).
//
// Where it is used: 16-bit sources on the 16-byte path (VEC = 8, 2 vectors a thread), heads
// of kv = 1, 2, 4, ..., 32 or 64 vectors (within a warp, see below), and the N rows of a
// position within the launcher's shared-memory budget (staged_fits); else the streaming
// kernel of mhar_kernel.cuh, which keeps the rows in registers stage by stage.
//
// Design, per position (the streaming kernel's stage of 2 rows costs two barriers, a block
// and a head reduction and a softmax step; here a position costs two barriers):
//   - Rows: each thread copies its own vectors of the N rows (cp.async.cg, 16 bytes, a
//     warp's request 512 contiguous bytes) into slots [n][item][tid], one commit group per
//     2 rows; only its warp reads them: pass A's ldmatrix, after a wait and a __syncwarp
//     (the lanes' copies), and pass B, a lane its own. The next position's rows are copied
//     into the slots as pass B frees them, so they are in flight for the rest of this
//     position and its epilogue; pass A's __syncthreads orders the other lanes' ldmatrix
//     reads of a slot before its owner's next copy to it (a __syncwarp would be the least).
//   - Thread layout: thread (warp w, lane l) holds vectors v = 64 w + 32 i + l (i < 2). A
//     head of 64 vectors is then one warp (both items), a head of kv <= 32 a segment of kv
//     lanes of one item: every logit is a warp (segment) reduction, no barrier.
//   - Pass A: the rows' sums of squares on tensor cores (each a diagonal of a warp's
//     A A^T, its 64 vectors A's rows: sum_of_squares), a warp's sums of 2 rows by three
//     butterfly steps over the diagonal's lanes (DiagonalLane), stored as [n][warp]. One
//     barrier.
//   - Pass B: r_n of the position's rows (lane n adds row n's 16 warp sums: rows_r), then
//     per 2 rows the rows re-read, u = round(s r), the logits reduced over the head's
//     lanes, and the online-softmax fold of the 2 rows (as the streaming kernel's stage:
//     a rescale only when a head's max rises). A head's first lane keeps the logits. For
//     bf16 heads of 64 vectors the products u q g are taken on tensor cores (logit_parts:
//     u stays in the bf16 pairs its rounding makes, q g as bf16 hi + lo parts, 8
//     m16n8k16 a group where the SIMT form spends 32 unpacks and 32 FFMA a lane).
//   - Epilogue: out = gate acc / den (+ residual); one barrier; the weights written once,
//     coalesced, by threads over (n, h), as in the streaming kernel.
// Shared memory: N rows of 16 warp sums, the logits [N, H], max and 1 / den [H], then the
// rows (N x 2 x blockDim.x x 16 bytes: 72 KiB at the shape above). The launcher keeps it
// within half an SM's (2 CTAs an SM, which is also what 81-128 registers allow 256-thread
// CTAs; these kernels take 96-128: bench/ptxas_sm*.txt), so a whole position, 144 KiB an
// SM, is in flight where the streaming kernel has one 2-row stage (36 KiB; HBM needs
// ~25 KiB an SM at its latency).
// A thread reads a slot with LDS.128 (a warp's 512 contiguous bytes).
// Each element is unpacked once, in pass B, as in the streaming kernel; the reductions,
// barriers and softmax steps are per position, not per stage.
#pragma once

#include "../common/mma_primitives.cuh"
#include "mhar_kernel.cuh"

namespace headwise {
namespace mhar {

constexpr int kStagedItems = 2;    // 8-element vectors a thread
constexpr int kStagedGroup = 2;    // rows a reduction and a cp.async group take
constexpr int kStagedSsPitch = kMaxThreads / 32;  // warp sums a row of s_ss holds
// Most shared memory the staged kernel takes: 2 CTAs fit an H100 / H200 SM (228 KiB); the
// launcher also keeps it within half the device's opt-in limit (an A100's 163 KiB).
constexpr int64_t kStagedSmemBudget = 112 * 1024;

// Whether heads of kv vectors lie within a warp in the staged layout.
__host__ __device__ inline bool staged_heads(int64_t kv) {
  return kv == 2 * 32 || (kv >= 1 && kv <= 32 && (kv & (kv - 1)) == 0);
}

// Floats before the staged rows: s_ss [N][16], s_logit [N][H], s_max and s_den [H],
// rounded up to 16 bytes.
__host__ __device__ inline int64_t fwd_staged_rows_offset(int64_t n, int64_t heads) {
  return (n * kStagedSsPitch + n * heads + 2 * heads + 3) / 4 * 4;
}
__host__ __device__ inline int64_t fwd_staged_smem_bytes(int64_t n, int64_t heads, int64_t threads) {
  return fwd_staged_rows_offset(n, heads) * 4 + n * kStagedItems * threads * 16;
}

// A thread's vectors of a row in the staged layout: item i is vector v0 + 32 i
// (v0 = 64 warp + lane), with its head, whether it lies in the row (valid) and whether it
// is its head's first vector.
struct StagedItems {
  int v0;
  bool valid[kStagedItems], first[kStagedItems];
  int head[kStagedItems];
  __device__ StagedItems(int warp, int lane, int nvec, int kv) : v0(warp * 32 * kStagedItems + lane) {
    HW_UNROLL
    for (int i = 0; i < kStagedItems; ++i) {
      const int v = v0 + 32 * i;
      valid[i] = v < nvec;
      head[i] = v / kv;
      first[i] = valid[i] && v % kv == 0;
    }
  }
};

// A thread's cp.async copies of a position's rows into its slots [n][item][thread]
// (cp.async.cg, 16 bytes a vector: a warp's request 512 contiguous bytes), a group of
// kStagedGroup rows (or the 1 row left of an odd N) a commit group. present(i): whether the
// thread's item i lies in the row (absent items are not copied).
template <typename T, typename Present>
struct StagedRowCopies {
  using PackT = hw::Pack<T, 8>;
  static constexpr int kItemElems = 32 * 8;  // elements from item i's vector to item i + 1's
  int num_src;
  int nthreads;
  int64_t stride_n;
  Present present;
  // f(std::integral_constant<int, R>) for the group of rows [n0, n0 + R).
  template <typename F>
  __device__ void with_group_rows(int n0, F&& f) const {
    if (n0 + kStagedGroup <= num_src) f(std::integral_constant<int, kStagedGroup>{});
    else f(std::integral_constant<int, 1>{});
  }
  // R rows as one commit group: row, the first of them at the thread's first vector;
  // slot, its slot of item 0.
  template <int R>
  __device__ void issue(std::integral_constant<int, R>, const T* row, PackT* slot) const {
    HW_UNROLL
    for (int j = 0; j < R; ++j) {
      HW_UNROLL
      for (int i = 0; i < kStagedItems; ++i)
        if (present(i)) hw::cp_async_cg16_full(slot + (j * kStagedItems + i) * nthreads, row + j * stride_n + i * kItemElems);
    }
    hw::cp_async_commit();
  }
  // The group of rows from n0 of the position whose row 0 is at src (the thread's first
  // vector), into slots from the thread's slot of (row 0, item 0).
  __device__ void issue_group(int n0, const T* src, PackT* slots) const {
    with_group_rows(n0, [&](auto rows) { issue(rows, src + n0 * stride_n, slots + n0 * kStagedItems * nthreads); });
  }
  // Every group of the position.
  __device__ void issue_position(const T* src, PackT* slots) const {
    for (int n0 = 0; n0 < num_src; n0 += kStagedGroup) issue_group(n0, src, slots);
  }
};
template <typename T, typename Present>
__device__ StagedRowCopies<T, Present> staged_row_copies(int num_src, int nthreads, int64_t stride_n, Present present) {
  return {num_src, nthreads, stride_n, present};
}

// The diagonal of m16n8k16 accumulators D (float[4] a lane) for the dot products the
// staged kernels take on tensor cores (B = the transpose of 8 of A's rows, matched element
// by element): lane 4 m + m / 2 holds D[m][m] (d0 for even m, d1 for odd) and D[8 + m][m]
// (d2, d3). Each is that lane's share of a warp's dot product; the other lanes' entries
// are cross products, never read: the diagonal's sums (pair_sums, sum) take the 8 diagonal
// lanes only. A diagonal lane's partners lane ^ 4, lane ^ 9 and lane ^ 18 are the diagonal
// lanes of m ^ 1, m ^ 2 and m ^ 4 (m / 2, the lane in its quad, moves with m), so three
// butterfly steps sum them, where a warp sum of a masked value takes five and the mask.
struct DiagonalLane {
  bool odd;  // m odd
  __device__ explicit DiagonalLane(int lane) : odd(((lane >> 2) & 1) != 0) {}
  // d[m][m] and d[8 + m][m] of one accumulator
  __device__ float upper(const float (&d)[4]) const { return odd ? d[1] : d[0]; }
  __device__ float lower(const float (&d)[4]) const { return odd ? d[3] : d[2]; }
  // up[m][m] + low[8 + m][m]
  __device__ float upper_lower(const float (&up)[4], const float (&low)[4]) const {
    return odd ? up[1] + low[3] : up[0] + low[2];
  }
  // d0[m][m] + d1[m][m], and d0[8 + m][m] + d1[8 + m][m]
  __device__ float upper(const float (&d0)[4], const float (&d1)[4]) const {
    return odd ? d0[1] + d1[1] : d0[0] + d1[0];
  }
  __device__ float lower(const float (&d0)[4], const float (&d1)[4]) const {
    return odd ? d0[3] + d1[3] : d0[2] + d1[2];
  }
  // The sums of a and of b over the diagonal lanes: the first step trades a for b between
  // m and m ^ 1 (even m keep a), so a's sum ends on the lanes of even m (lane 0 among
  // them), b's on those of odd m (lane 4). Returns the lane's one.
  __device__ float pair_sums(float a, float b) const {
    return steps_m2_m4((odd ? b : a) + __shfl_xor_sync(hw::kFullWarp, odd ? a : b, 4));
  }
  // The sum of v over the diagonal lanes, on every diagonal lane (lane 0 among them).
  __device__ float sum(float v) const { return steps_m2_m4(v + __shfl_xor_sync(hw::kFullWarp, v, 4)); }
  // The butterfly's last two steps: the partners of m ^ 2 (lane ^ 9) and m ^ 4 (lane ^ 18).
  __device__ static float steps_m2_m4(float v) {
    v += __shfl_xor_sync(hw::kFullWarp, v, 9);
    return v + __shfl_xor_sync(hw::kFullWarp, v, 18);
  }
};

// A thread's 8 values v (q g) as bf16 pairs hi + lo in the fragment order of its packed
// elements (pair m: elements 2 m, 2 m + 1), hi = round(v), lo = round(v - hi): the B
// operands of the tensor-core products with q g. hi + lo holds 16 significant bits of v:
// all of it when q and g are bf16 (a product of two 8-bit significands), a relative 2^-17
// of it for fp32 q, g (the SIMT products' q g is exact to 2^-24).
template <typename T, int VEC>
__device__ void split_pairs(const float (&v)[VEC], uint32_t (&hi)[VEC / 2], uint32_t (&lo)[VEC / 2]) {
  HW_UNROLL
  for (int m = 0; m < VEC / 2; ++m) {
    float a = v[2 * m], b = v[2 * m + 1];
    hi[m] = hw::pack_pair<T>(a, b);
    hw::round_pair_to<T>(a, b);
    lo[m] = hw::pack_pair<T>(v[2 * m] - a, v[2 * m + 1] - b);
  }
}

// kWarpHeads: heads of 64 vectors (a warp each); else heads of kv <= 32 vectors (lane
// segments of an item).
template <typename T, bool kWarpHeads>
__global__ void __launch_bounds__(kMaxThreads) mhar_route_fwd_staged_kernel(const FwdParams p) {
  static_assert(sizeof(T) == 2, "16-bit sources: a vector is one 16-byte copy");
  constexpr int VEC = 8, ITEMS = kStagedItems, G = kStagedGroup;
  static_assert(G == 2, "a group's rows lie in one 32-row chunk of rows_r (n0 even)");
  // Softmax states a thread keeps: one head (a warp's) or one per item.
  constexpr int kStates = kWarpHeads ? 1 : ITEMS;
  using PackT = hw::Pack<T, VEC>;
  static_assert(sizeof(PackT) == 16, "a vector is one 16-byte copy");
  auto state_of = [](int i) { return kWarpHeads ? 0 : i; };
  // The logits of a warp head of bf16 sources on tensor cores (logit_parts); fp16's q g
  // pairs would lose range (its lo part underflows), heads of lane segments would need
  // one accumulator a head: both keep the SIMT logits.
  constexpr bool kTensorLogits = kWarpHeads && std::is_same<T, c10::BFloat16>::value;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nthreads = blockDim.x, nwarps = nthreads >> 5;
  const int nvec = static_cast<int>(p.route.d / VEC);
  const int kv = static_cast<int>(p.route.head_dim / VEC);
  const int heads = static_cast<int>(p.route.heads);
  const int num_src = p.route.num_sources;
  const int groups = (num_src + G - 1) / G;
  const float inv_d = 1.f / static_cast<float>(p.route.d);
  const int64_t stride_n = p.route.src_stride_n;

  float* smem = reinterpret_cast<float*>(hw::dynamic_shared_memory());
  float* s_ss = smem;                                // [N][kStagedSsPitch]: warp sums of the squares
  float* s_logit = s_ss + num_src * kStagedSsPitch;  // [N][H]
  float* s_max = s_logit + num_src * heads;          // [H]
  float* s_den = s_max + heads;                      // [H]: 1 / denominator
  // The thread's slot of (row n, item i): slots[(n ITEMS + i) nthreads].
  PackT* const slots = reinterpret_cast<PackT*>(smem + fwd_staged_rows_offset(num_src, heads)) + tid;

  const StagedItems items(warp, lane, nvec, kv);
  const int v0 = items.v0;
  const auto& valid = items.valid;
  const auto& first = items.first;
  const auto& head = items.head;
  // q * g of the thread's vectors (a warp's item is 32 consecutive vectors: one coalesced
  // octet load each).
  float qg[ITEMS][VEC];
  HW_UNROLL
  for (int i = 0; i < ITEMS; ++i) {
    const int w0 = warp * 32 * ITEMS + 32 * i;
    float g[VEC];
    hw::warp_load_octets(p.route.query + static_cast<int64_t>(w0) * VEC, nvec - w0, qg[i]);
    hw::warp_load_octets(p.route.norm_weight + static_cast<int64_t>(w0) * VEC, nvec - w0, g);
    HW_UNROLL
    for (int k = 0; k < VEC; ++k) qg[i][k] *= g[k];
  }
  // The tensor-core logits' B operands (logit_parts): q g as bf16 pairs hi + lo.
  uint32_t qg_hi[ITEMS][VEC / 2], qg_lo[ITEMS][VEC / 2];
  if constexpr (kTensorLogits) {
    HW_UNROLL
    for (int i = 0; i < ITEMS; ++i) split_pairs<T>(qg[i], qg_hi[i], qg_lo[i]);
  }
  // Absent items' slots hold zeros for the kernel (no copy ever writes them), so their
  // reads need no guard.
  {
    PackT zero;
    HW_UNROLL
    for (int k = 0; k < VEC; ++k) zero.v[k] = static_cast<T>(0.f);
    for (int n = 0; n < num_src; ++n) {
      HW_UNROLL
      for (int i = 0; i < ITEMS; ++i)
        if (!valid[i]) hw::store_pack<T, VEC>(reinterpret_cast<T*>(slots + (n * ITEMS + i) * nthreads), zero);
    }
  }
  // s_ss's entries of warps past the block's last hold zeros (pass A writes those of
  // w < nwarps), so that rows_r sums every entry of a row.
  static_assert(kStagedSsPitch == 16, "rows_r reads a row of s_ss as 4 16-byte vectors");
  for (int e = tid; e < num_src * kStagedSsPitch; e += nthreads)
    if ((e & (kStagedSsPitch - 1)) >= nwarps) s_ss[e] = 0.f;
  const float gate = p.gate == nullptr ? 1.f : *p.gate;

  // Whether item i is present (heads of 64 vectors make nvec a multiple of 64: every item).
  auto present = [&](int i) { return kWarpHeads || valid[i]; };
  const auto copies = staged_row_copies<T>(num_src, nthreads, stride_n, present);
  if (blockIdx.x >= p.route.positions) return;  // the launcher's grid is at most the positions
  // This lane's share of the sum of squares of the warp's 64 vectors of row n: with A the
  // 16 x 16 tile whose 8-element row halves are the 32 lanes' vectors of one item (lane L's
  // own slot is ldmatrix's row address L), B = the transpose of A's rows 0-7 is A's own
  // fragment registers {a0, a2}, so D = A B has the squared norms of rows 0-7 on D[m][m];
  // B = {a1, a3}, the transpose of rows 8-15, puts theirs on D[8 + m][m]. The two products
  // accumulate apart (each one's other entries are cross products, and D[m][m] of the
  // second is one); both items go into the same two. Lane 4 m + m / 2 holds D[m][m] and
  // D[8 + m][m]. A warp's row costs 2 ldmatrix and 4 m16n8k16 where the SIMT sums take 2
  // loads, 16 unpacks and 16 FFMA a lane. The products are exact in fp32; the tensor core
  // adds them at fp32 width but not round-to-nearest (simt/primitives.h), a bias below the
  // last bit of r_n's sum of positive terms.
  const DiagonalLane diagonal(lane);
  auto sum_of_squares = [&](int n) {
    float upper[4] = {0.f, 0.f, 0.f, 0.f}, lower[4] = {0.f, 0.f, 0.f, 0.f};
    HW_UNROLL
    for (int i = 0; i < ITEMS; ++i) {
      uint32_t a[4];
      hw::ldmatrix<4>(a, slots + (n * ITEMS + i) * nthreads);
      const uint32_t upper_t[2] = {a[0], a[2]}, lower_t[2] = {a[1], a[3]};
      hw::mma_step<T>(upper, a, upper_t);
      hw::mma_step<T>(lower, a, lower_t);
    }
    return diagonal.upper_lower(upper, lower);
  };

  // This lane's shares of the logits of a group's R rows of a warp head, from their
  // u = round(s r) as bf16 pairs u[j][i][m] (elements 2 m, 2 m + 1 of item i), on tensor
  // cores as sum_of_squares forms its diagonals. B = q g of the elements in A's columns
  // is each lane's own b0, b1: the transpose of 8 of A's rows, which holds the products of
  // matching elements on a diagonal of D = A B: D[m][m] (and D[8 + m][m] for A's rows 8-15
  // against B) sums them over lanes 4 m .. 4 m + 3, and lane 4 m + m / 2 holds both.
  //   R = 2: A = {row 0's pair 2 e, row 1's pair 2 e, row 0's 2 e + 1, row 1's 2 e + 1},
  //          B = q g of pairs 2 e, 2 e + 1: row 0's sum on D[m][m], row 1's on D[8 + m][m];
  //          2 products (e) an item.
  //   R = 1: A = the row's pairs {0, 2, 1, 3}, B = q g of pairs {0, 1} into one D (A's
  //          rows 0-7) and of pairs {2, 3} into another (rows 8-15): the same 2 products an
  //          item, each B a consecutive register pair as for R = 2 (no moves to form it).
  // Each product is taken for q g's bf16 hi and lo parts (exact products of 8-bit
  // significands) into the same D, summed at fp32 width: 8 m16n8k16 a group, where the SIMT
  // logits take 16 unpacks and 16 FFMA a lane a row.
  auto logit_parts = [&](auto rows_present, const auto& u, float (&parts)[G]) {
    constexpr int R = decltype(rows_present)::value;
    float d0[4] = {0.f, 0.f, 0.f, 0.f}, d1[4] = {0.f, 0.f, 0.f, 0.f};
    HW_UNROLL
    for (int i = 0; i < ITEMS; ++i) {
      HW_UNROLL
      for (int h = 0; h < 2; ++h) {
        const auto& q = h == 0 ? qg_hi[i] : qg_lo[i];
        if constexpr (R == 2) {
          HW_UNROLL
          for (int e = 0; e < 2; ++e) {
            const uint32_t a[4] = {u[0][i][2 * e], u[1][i][2 * e], u[0][i][2 * e + 1], u[1][i][2 * e + 1]};
            const uint32_t b[2] = {q[2 * e], q[2 * e + 1]};
            hw::mma_step<T>(e == 0 ? d0 : d1, a, b);
          }
        } else {
          const uint32_t a[4] = {u[0][i][0], u[0][i][2], u[0][i][1], u[0][i][3]};
          const uint32_t b_upper[2] = {q[0], q[1]}, b_lower[2] = {q[2], q[3]};
          hw::mma_step<T>(d0, a, b_upper);
          hw::mma_step<T>(d1, a, b_lower);
        }
      }
    }
    if constexpr (R == 2) {
      parts[0] = diagonal.upper(d0, d1);
      parts[1] = diagonal.lower(d0, d1);
    } else {
      parts[0] = diagonal.upper_lower(d0, d1);
    }
  };

  const T* sources = static_cast<const T*>(p.route.sources) + static_cast<int64_t>(v0) * VEC;
  IndexSteps bt(blockIdx.x, gridDim.x, static_cast<int>(p.route.seq));  // the position's (b, t)
  const T* src = sources + bt.q * p.route.src_stride_b + bt.r * p.route.src_stride_t;
  copies.issue_position(src, slots);

  for (int64_t pos = blockIdx.x; pos < p.route.positions; pos += gridDim.x) {
    const int64_t b = bt.q, t = bt.r;
    const bool has_next = pos + gridDim.x < p.route.positions;
    bt.next();
    const T* next_src = sources + bt.q * p.route.src_stride_b + bt.r * p.route.src_stride_t;

    // Pass A: the sums of squares of the rows on tensor cores (sum_of_squares), a group's
    // two warp sums over the diagonal's lanes; the newer commit groups are this position's
    // later ones. ldmatrix hands each lane other lanes' copies: a __syncwarp after the
    // wait makes them visible.
    for (int g = 0; g < groups; ++g) {
      hw::cp_async_wait_upto(groups - 1 - g);
      __syncwarp();
      const int n0 = G * g;
      float ss[G];
      HW_UNROLL
      for (int j = 0; j < G; ++j) ss[j] = n0 + j < num_src ? sum_of_squares(n0 + j) : 0.f;
      // Row n0's warp sum on lane 0, row n0 + 1's on lane 4.
      const float sum = diagonal.pair_sums(ss[0], ss[1]);
      if (lane == 0 || (lane == 4 && n0 + 1 < num_src)) s_ss[(n0 + (lane >> 2)) * kStagedSsPitch + warp] = sum;
    }
    __syncthreads();

    // Pass B: logits and the online-softmax fold, 2 rows at a time; each group's slots
    // then take the next position's rows. (Every other lane read the slot in pass A, before
    // the barrier; its owner reads it here before issuing the copy, which writes it only
    // when its global read returns.)
    float acc[ITEMS][VEC];
    float run_max[kStates], run_den[kStates];
    HW_UNROLL
    for (int i = 0; i < ITEMS; ++i) {
      HW_UNROLL
      for (int k = 0; k < VEC; ++k) acc[i][k] = 0.f;
    }
    HW_UNROLL
    for (int s = 0; s < kStates; ++s) {
      run_max[s] = -INFINITY;
      run_den[s] = 0.f;
    }
    // r_n = rsqrt(sum of squares / d + eps) of the rows c0 + lane (a chunk of 32: the
    // whole position when N <= 32), from their 16 warp sums in s_ss (a lane past N takes
    // row N - 1's, unused); pass B's groups take theirs from it by a shuffle. A lane reads
    // its row's 4 16-byte vectors starting from vector (lane / 2) % 4: 8 lanes' reads of a
    // step then fall in distinct banks (rows 64 bytes apart). So with more than 8 warps the
    // order of a row's sum depends on (n % 32) / 2: fixed, and so deterministic.
    const int ss_rotation = (lane >> 1) & 3;
    auto rows_r = [&](int c0) {
      const int n = c0 + lane < num_src ? c0 + lane : num_src - 1;
      const float* ss = s_ss + n * kStagedSsPitch;
      hw::Pack<float, 4> v[4];
      HW_UNROLL
      for (int c = 0; c < 4; ++c) v[c] = hw::load_pack<float, 4>(ss + 4 * ((c + ss_rotation) & 3));
      float sum4[4];
      HW_UNROLL
      for (int k = 0; k < 4; ++k) sum4[k] = (v[0].v[k] + v[1].v[k]) + (v[2].v[k] + v[3].v[k]);
      const float sum = (sum4[0] + sum4[1]) + (sum4[2] + sum4[3]);
      return rsqrtf(sum * inv_d + p.route.eps);
    };
    float r_chunk = 0.f;
    const T* next_row = next_src;
    for (int g = 0; g < groups; ++g, next_row += G * stride_n) {
      const int n0 = G * g;
      if ((n0 & 31) == 0) r_chunk = rows_r(n0);
      float r[G];
      HW_UNROLL
      for (int j = 0; j < G; ++j) r[j] = __shfl_sync(hw::kFullWarp, r_chunk, (n0 + j) & 31);
      // The group with its first R rows present (an odd N's last group has one).
      PackT* const group_slots = slots + n0 * ITEMS * nthreads;
      auto fold_group = [&](auto rows_present) {
        constexpr int R = decltype(rows_present)::value;
        float x[R][ITEMS][VEC];
        float logit[R][kStates];
        if constexpr (kTensorLogits) {
          uint32_t u[R][ITEMS][VEC / 2];
          HW_UNROLL
          for (int j = 0; j < R; ++j) {
            HW_UNROLL
            for (int i = 0; i < ITEMS; ++i) {
              hw::unpack_to_float<T, VEC>(hw::load_pack<T, VEC>(reinterpret_cast<const T*>(group_slots + (j * ITEMS + i) * nthreads)), x[j][i]);
              HW_UNROLL
              for (int m = 0; m < VEC / 2; ++m) u[j][i][m] = hw::pack_pair<T>(x[j][i][2 * m] * r[j], x[j][i][2 * m + 1] * r[j]);
            }
          }
          float parts[G];
          logit_parts(rows_present, u, parts);
          // Sums over the diagonal lanes, then to every lane: row 0's from lane 0, row 1's
          // from lane 4.
          if constexpr (R == 2) {
            const float sum = diagonal.pair_sums(parts[0], parts[1]);
            logit[0][0] = __shfl_sync(hw::kFullWarp, sum, 0);
            logit[1][0] = __shfl_sync(hw::kFullWarp, sum, 4);
          } else {
            logit[0][0] = __shfl_sync(hw::kFullWarp, diagonal.sum(parts[0]), 0);
          }
        } else {
          HW_UNROLL
          for (int j = 0; j < R; ++j) {
            float part[ITEMS];
            HW_UNROLL
            for (int i = 0; i < ITEMS; ++i) {
              hw::unpack_to_float<T, VEC>(hw::load_pack<T, VEC>(reinterpret_cast<const T*>(group_slots + (j * ITEMS + i) * nthreads)), x[j][i]);
              float u[VEC];
              HW_UNROLL
              for (int k = 0; k < VEC; ++k) u[k] = x[j][i][k] * r[j];
              hw::round_vec_to<T, VEC>(u);
              float l = 0.f;
              HW_UNROLL
              for (int k = 0; k < VEC; ++k) l += u[k] * qg[i][k];
              part[i] = l;
            }
            if constexpr (kWarpHeads) {
              logit[j][0] = hw::warp_sum(part[0] + part[1]);
            } else {
              HW_UNROLL
              for (int i = 0; i < ITEMS; ++i) logit[j][i] = hw::warp_segment_sum(part[i], kv);
            }
          }
        }
        HW_UNROLL
        for (int s = 0; s < kStates; ++s) {
          const float old_max = run_max[s];
          float new_max = old_max;
          HW_UNROLL
          for (int j = 0; j < R; ++j) new_max = fmaxf(new_max, logit[j][s]);
          // Rescale only when the head's max rose and not on the first group (the
          // streaming kernel's rule: the same products where they are needed).
          float den = run_den[s];
          if (new_max > old_max) {
            if (old_max != -INFINITY) {
              const float alpha = hw::softmax_exp<T>(old_max - new_max);
              den *= alpha;
              HW_UNROLL
              for (int i = 0; i < ITEMS; ++i) {
                if (state_of(i) != s) continue;
                HW_UNROLL
                for (int k = 0; k < VEC; ++k) acc[i][k] *= alpha;
              }
            }
            run_max[s] = new_max;
          }
          float prob[R];
          HW_UNROLL
          for (int j = 0; j < R; ++j) {
            prob[j] = hw::softmax_exp<T>(logit[j][s] - new_max);
            den += prob[j];
          }
          HW_UNROLL
          for (int i = 0; i < ITEMS; ++i) {
            if (state_of(i) != s) continue;
            HW_UNROLL
            for (int k = 0; k < VEC; ++k) {
              float a = acc[i][k];
              HW_UNROLL
              for (int j = 0; j < R; ++j) a += prob[j] * x[j][i][k];
              acc[i][k] = a;
            }
          }
          run_den[s] = den;
        }
        HW_UNROLL
        for (int i = 0; i < (kWarpHeads ? 1 : ITEMS); ++i) {  // (a warp head's first vector is item 0's)
          if (!first[i]) continue;
          HW_UNROLL
          for (int j = 0; j < R; ++j) s_logit[(n0 + j) * heads + head[i]] = logit[j][state_of(i)];
        }
        if (has_next) copies.issue(rows_present, next_row, group_slots);
      };
      copies.with_group_rows(n0, fold_group);
    }

    // Epilogue: the output row, the heads' max and 1 / den; then the weights.
    T* out = static_cast<T*>(p.out) + pos * p.route.d + static_cast<int64_t>(v0) * VEC;
    const T* res = p.residual == nullptr ? nullptr
                                         : static_cast<const T*>(p.residual) + b * p.res_stride_b +
                                               t * p.res_stride_t + static_cast<int64_t>(v0) * VEC;
    float inv_den[kStates];
    HW_UNROLL
    for (int s = 0; s < kStates; ++s) inv_den[s] = 1.f / run_den[s];
    HW_UNROLL
    for (int i = 0; i < ITEMS; ++i) {
      if (!present(i)) continue;
      const float scale = gate * inv_den[state_of(i)];
      float rv[VEC];
      HW_UNROLL
      for (int k = 0; k < VEC; ++k) rv[k] = 0.f;
      if (res != nullptr) hw::load_as_float<VEC>(res + i * 32 * VEC, rv);
      float y[VEC];
      HW_UNROLL
      for (int k = 0; k < VEC; ++k) y[k] = acc[i][k] * scale + rv[k];
      hw::store_from_float<VEC>(out + i * 32 * VEC, y);
      if (first[i]) {
        s_max[head[i]] = run_max[state_of(i)];
        s_den[head[i]] = inv_den[state_of(i)];
      }
    }
    __syncthreads();
    // The next position writes s_logit, s_max and s_den only after its pass-A barrier.
    store_position_weights<T>(p, pos, s_logit, s_max, s_den);
  }
}

}  // namespace mhar
}  // namespace headwise
