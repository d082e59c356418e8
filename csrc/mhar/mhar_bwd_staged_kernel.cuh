// MHAR backward with a position's rows, its dout and its weights staged in shared memory by
// cp.async (SPEC section 4; the notation of mhar_kernel.cuh). Compiled by nvcc and against
// the SIMT emulator.
//
// Budget (bf16, N = 9, d = 4096, H = 8, B T = 8192): a position reads N rows, dout (80 KiB)
// and N H fp32 weights and writes N gradient rows (72 KiB): 1277 MB in all, 0.27 ms at the
// H200's 4.8 TB/s. Its arithmetic is ~18 operations per source element (three dot
// products in pass 1; normalize, round, the gradient's three terms and z in pass 2): HBM-
// bound by ~5x over the FP32 ceiling, so what sets the pace is instruction issue and the
// latency between the loads and their use (the first H200 run measured the register-
// staged kernel at 21% of HBM: bench/RESULTS.md).
//
// Where it is used: 16-bit sources on the 16-byte path, heads within a warp (staged_heads:
// kv = 1, 2, 4, ..., 32 or 64 vectors), and a position's rows within the launcher's shared-
// memory budget (staged_fits); else mhar_route_bwd_kernel, which loads the rows into
// registers stage by stage and stores them to shared memory for pass 2.
//
// Design, per position (mhar_route_bwd_kernel takes four barriers a position and its
// per-(n, h) scalars on N H threads; here one barrier, and each head's scalars in its warp):
//   - Copies: each thread copies its own vectors of dout and of the N rows (cp.async.cg,
//     16 bytes, a warp's request 512 contiguous bytes) into slots [item][tid] and
//     [n][item][tid], and a head's warp its N weights (4-byte cp.async.ca) into s_w; one
//     commit group per 2 rows, dout and the weights in the first. The next position's
//     copies are issued as pass 2 frees each group's slots, so they travel during the rest
//     of this position. The SIMT pass 1 and pass 2 read only a lane's own slots; the
//     tensor-core pass 1 reads its warp's rows and dout by ldmatrix after a wait and a
//     __syncwarp, and the position's barrier orders those reads before pass 2's copies
//     into the slots; the weights are read by the head's other lanes after a wait and a
//     __syncwarp.
//   - Thread layout (the staged forward's): thread (warp w, lane l) holds vectors
//     v = 64 w + 32 i + l (i < 2); a head of 64 vectors is one warp, a head of kv <= 32 a
//     segment of kv lanes of one item. So a, b and every per-head scalar are warp or
//     segment reductions, and a head's values are written and read by its warp only.
//   - Pass 1, 2 rows at a time: a = <dout, s_n>, b = <q g, s_n> per head and the warp's
//     sum of squares of the row, by one reduce-scatter (heads of 64 vectors) or segment
//     sums, or for bf16 heads of 64 vectors and bf16 grad_sources on tensor cores with
//     the sums on the diagonal lanes (pass1_pair_shares); one lane a row (a head's first,
//     or on tensor cores lane 0 for row n0 and lane 4 for n0 + 1) keeps a, b in s_hv,
//     the warp's squares go to s_sc.
//   - Head step (no barrier: the head is the warp's): S_h = sum_n w a, dl = gate w (a - S_h)
//     by the head's lanes over n; the records {gate w, dl} replace a, b in s_hv, and the
//     warp's sum of dl b over its heads goes to s_sc beside its squares. One barrier.
//   - r_n and r_n^3 c_n / d (c_n = sum_h dl b) by lane n of each warp from the warps' s_sc
//     pairs, into the warp's s_rr.
//   - Pass 2, a row at a time (copies 2 at a time): the row re-read from its slots,
//     ds = gate w dout + (r dl) q g - r^3 c / d s with no reduction, z += dl u in
//     registers over the segment's positions (for bf16 heads of 64 vectors the products
//     gate w dout and dl u on tensor cores, with the scalars as sums of bf16 parts:
//     identity_select). Then the group's slots take the next position's rows.
//   - Segment end: the z partial stored and the gate partial summed over the block
//     (the kBwdSegment positions in order: the sums do not depend on the grid).
// s_sc, which every warp reads after the barrier, alternates two blocks by position parity:
// a warp writes the next position's before that position's barrier, while other warps may
// still read this one's.
// Registers: q g is read from the thread's own shared-memory slots where it is used; in
// registers (16) it made the kernel spill at the 128-register cap of its launch bounds.
// Shared memory: the floats of bwd_staged_rows_offset, then q g (2 x 2 x blockDim.x x 16
// bytes), dout (2 x blockDim.x x 16) and the rows (N x 2 x blockDim.x x 16: 72 KiB at the
// shape above, 99 KiB in all); the launcher keeps it within half an SM's, so 2 CTAs an SM
// have their positions in flight.
#pragma once

#include "mhar_fwd_staged_kernel.cuh"

namespace headwise {
namespace mhar {

// Floats a (h, n) record of s_hv takes: 4 (16 bytes, one LDS.128 in pass 2) for bf16
// heads of 64 vectors, whose records hold the parts of pass 2's tensor-core products
// (kTensorPass2; also on sm_80, which keeps the SIMT form: the launcher's size does not
// depend on the arch), else 2 (mhar_kernel.cuh's kBwdRecordFloats is the other kernel's).
template <typename T, bool kWarpHeads>
constexpr int bwd_record_floats() {
  return kWarpHeads && std::is_same<T, c10::BFloat16>::value ? 4 : 2;
}
// Floats before the staged slots: the block sum's 64, then the records s_hv [H][N], pairs
// (8-byte aligned) s_sc [2][16][N] and s_rr [16][N], then s_dlb [H][N], s_w [H][N] and
// s_gate [H], rounded up to 16 bytes.
__host__ __device__ inline int64_t bwd_staged_rows_offset(int64_t n, int64_t heads, int64_t record) {
  return (64 + record * n * heads + 2 * 2 * n * kStagedSsPitch + 2 * kStagedSsPitch * n + 2 * n * heads + heads + 3) /
         4 * 4;
}
// Then q g (fp32, 2 x 16 bytes a vector), dout and the N rows (16 bytes a vector each).
__host__ __device__ inline int64_t bwd_staged_smem_bytes(int64_t n, int64_t heads, int64_t record, int64_t threads) {
  return bwd_staged_rows_offset(n, heads, record) * 4 + (n + 3) * kStagedItems * threads * 16;
}

// Whether the device code being compiled takes pass 2's products on tensor cores
// (kTensorPass2 below): sm_90 and newer, and the emulator.
#if HW_SIM || !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
constexpr bool kBwdTensorProductsArch = true;
#else
constexpr bool kBwdTensorProductsArch = false;
#endif

// T: the sources' 16-bit type; G: grad_sources' (T, or fp32 for a DepthBuffer's
// accumulator). kWarpHeads: heads of 64 vectors (a warp each); else kv <= 32.
// kSimtProducts: pass 2 in the SIMT form on every arch (the emulated build's launcher
// takes it under HEADWISE_SIM_MHAR_BWD_SIMT_PRODUCTS=1, so that the tests run the form
// sm_80 compiles).
template <typename T, typename G, bool kWarpHeads, bool kSimtProducts = false>
__global__ void __launch_bounds__(kMaxThreads) mhar_route_bwd_staged_kernel(const BwdParams p) {
  static_assert(sizeof(T) == 2, "16-bit sources: a vector is one 16-byte copy");
  constexpr int VEC = 8, ITEMS = kStagedItems, GR = kStagedGroup;
  static_assert(GR == 2, "a group: 2 rows, a commit group and one reduce-scatter");
  using PackT = hw::Pack<T, VEC>;
  static_assert(sizeof(PackT) == 16, "a vector is one 16-byte copy");
  // Pass 2's products gate w dout and dl u on tensor cores (see identity_select) for bf16
  // heads of 64 vectors on sm_90 and newer; fp16's parts would lose range, heads of lane
  // segments have scalars per segment where the identity's B takes one a warp, and on
  // sm_80 the kernel spilled 8-16 bytes at its 128-register cap: these keep the SIMT form.
  constexpr bool kTensorPass2 =
      kWarpHeads && std::is_same<T, c10::BFloat16>::value && kBwdTensorProductsArch && !kSimtProducts;
  // Pass 1's dot products on tensor cores (pass1_pair_shares) for bf16 heads of 64 vectors
  // where grad_sources is T, on every arch (sm_80 too: 128 registers, no spill); the
  // DepthBuffer's fp32 form keeps the SIMT sums (with the tiles' lane addresses it spilled
  // 8 bytes at the 128-register cap on sm_90).
  constexpr bool kTensorPass1 = kWarpHeads && std::is_same<T, c10::BFloat16>::value && std::is_same<G, T>::value;
  constexpr int kRecord = bwd_record_floats<T, kWarpHeads>();
  static_assert(!kTensorPass2 || kRecord == 4, "the tensor-core products' parts fill a 16-byte record");

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nthreads = blockDim.x, nwarps = nthreads >> 5;
  const int nvec = static_cast<int>(p.route.d / VEC);
  const int kv = kWarpHeads ? 64 : static_cast<int>(p.route.head_dim / VEC);  // vectors a head
  const int heads = static_cast<int>(p.route.heads);
  const int num_src = p.route.num_sources;
  const int groups = (num_src + GR - 1) / GR;
  const float inv_d = 1.f / static_cast<float>(p.route.d);
  const int64_t stride_n = p.route.src_stride_n;
  const int64_t positions = p.route.positions;
  const int64_t segments = bwd_segments(positions);
  const int64_t wstride_n = positions * heads;
  const int64_t ds_stride_n = positions * p.route.d;

  float* smem = reinterpret_cast<float*>(hw::dynamic_shared_memory());
  // Records: s_hv [H][N] a, b after pass 1, after the head step {gate w, dl} or, for the
  // tensor-core products, {gate w's 3 bf16 parts, dl, dl's 2} (rec_parts; the head's warp
  // writes and reads them). Pairs: s_sc [2][16][N] a warp's sum of squares and sum of dl b
  // over its heads of row n (read by every warp: two blocks by position parity); s_rr
  // [16][N] a warp's r_n, r_n^3 c_n / d. Then s_dlb [H][N] dl b, s_w [H][N] the weights and
  // s_gate [H] the segment's sum of S_h (a head's warp writes and reads them; s_gate its
  // first lane: in a register it spilled at the 128-register cap). Rows n are fastest:
  // the head step and the r step read them by lanes n, conflict-free.
  using Pair = hw::Pack<float, 2>;
  float* const s_hv = smem + 64;
  float* const s_sc0 = s_hv + kRecord * num_src * heads;
  float* const s_rr = s_sc0 + 2 * 2 * num_src * kStagedSsPitch + 2 * warp * num_src;
  float* const s_dlb = s_sc0 + (2 * 2 + 2) * num_src * kStagedSsPitch;
  float* const s_w = s_dlb + num_src * heads;
  float* const s_gate = s_w + num_src * heads;
  auto load_pair = [](const float* at) { return hw::load_pack<float, 2>(at); };
  auto store_pair = [](float* at, float x, float y) {
    Pair v;
    v.v[0] = x;
    v.v[1] = y;
    hw::store_pack<float, 2>(at, v);
  };
  // The thread's slots: q g of item i (two fp32 halves) at qg_slots[(2 i + half) nthreads],
  // dout of item i at dout_slots[i nthreads], row n's at slots[(n ITEMS + i) nthreads].
  using PackF = hw::Pack<float, 4>;
  PackF* const qg_slots = reinterpret_cast<PackF*>(smem + bwd_staged_rows_offset(num_src, heads, kRecord)) + tid;
  PackT* const dout_slots = reinterpret_cast<PackT*>(qg_slots - tid + 2 * ITEMS * nthreads) + tid;
  PackT* const slots = dout_slots + ITEMS * nthreads;

  const StagedItems items(warp, lane, nvec, kv);
  const int v0 = items.v0;
  const auto& valid = items.valid;
  const auto& first = items.first;
  const auto& head = items.head;
  // Whether item i is present (heads of 64 vectors make nvec a multiple of 64: every item).
  auto present = [&](int i) { return kWarpHeads || valid[i]; };
  // q * g of the thread's vectors (a warp's item is 32 consecutive vectors: one coalesced
  // octet load each), kept in the thread's own shared-memory slots and read where used.
  HW_UNROLL
  for (int i = 0; i < ITEMS; ++i) {
    const int w0 = warp * 32 * ITEMS + 32 * i;
    float q[VEC], g[VEC];
    hw::warp_load_octets(p.route.query + static_cast<int64_t>(w0) * VEC, nvec - w0, q);
    hw::warp_load_octets(p.route.norm_weight + static_cast<int64_t>(w0) * VEC, nvec - w0, g);
    HW_UNROLL
    for (int half = 0; half < 2; ++half) {
      PackF qg;
      HW_UNROLL
      for (int k = 0; k < 4; ++k) qg.v[k] = q[4 * half + k] * g[4 * half + k];
      hw::store_pack<float, 4>(reinterpret_cast<float*>(qg_slots + (2 * i + half) * nthreads), qg);
    }
  }
  auto load_qg = [&](int i, float (&qg)[VEC]) {
    HW_UNROLL
    for (int half = 0; half < 2; ++half) {
      const PackF v = hw::load_pack<float, 4>(reinterpret_cast<const float*>(qg_slots + (2 * i + half) * nthreads));
      HW_UNROLL
      for (int k = 0; k < 4; ++k) qg[4 * half + k] = v.v[k];
    }
  };
  const float gate = p.gate == nullptr ? 1.f : *p.gate;

  // The warp's heads [head0, head_end) of the 2^heads_log2 its layout holds (a
  // partial last warp holds fewer), and the lanes that work on one of them in the head
  // step (a segment of seg_lanes lanes, one per item; the whole warp for heads of 64
  // vectors).
  const int head0 = (warp * 32 * ITEMS) / kv;
  int heads_log2 = 0;
  while ((kv << heads_log2) < 32 * ITEMS) ++heads_log2;
  const int head_end = heads - head0 < (1 << heads_log2) ? heads : head0 + (1 << heads_log2);
  const int seg_lanes = kWarpHeads ? 32 : kv;

  const auto copies = staged_row_copies<T>(num_src, nthreads, stride_n, present);
  // The first commit group of a position: its dout (grad_out + pos d at the thread's first
  // vector) and the weights of the warp's N x (head_end - head0) (n, h); then each group
  // of rows closes a commit group (copies).
  const T* const grad_out = static_cast<const T*>(p.grad_out) + static_cast<int64_t>(v0) * VEC;
  auto issue_dout_and_weights = [&](int64_t pos) {
    HW_UNROLL
    for (int i = 0; i < ITEMS; ++i)
      if (present(i)) hw::cp_async_cg16_full(dout_slots + i * nthreads, grad_out + pos * p.route.d + i * 32 * VEC);
    for (int e = lane; e < (num_src << heads_log2); e += 32) {
      const int n = e >> heads_log2, h = head0 + (e & ((1 << heads_log2) - 1));
      if (kWarpHeads || h < head_end)
        hw::cp_async_ca<4>(s_w + h * num_src + n, p.weights + n * wstride_n + pos * heads + h);
    }
  };
  if (blockIdx.x >= segments) return;  // the launcher's grid is at most the segments

  // Pass 1's dot products of a group of 2 rows on tensor cores (kTensorPass1), by the
  // staged forward's diagonal (DiagonalLane): this diagonal lane's shares of
  // a = <dout, s_n>, b = <q g, s_n> and the sum of squares of s_n, for rows n0 and n0 + 1
  // of the warp's head, in 4 tiles of 16 vectors: tile k = (item k / 2, the vectors of
  // lanes 16 (k % 2) + 0..15). ldmatrix.x4 makes A of a tile: matrix 0 (A's rows 0-7,
  // k 0-7) row n0's vectors of lanes +0..7, matrix 1 (rows 8-15) row n0 + 1's of the same
  // lanes, matrices 2, 3 (k 8-15) the same for lanes +8..15 (tile_rows: lane 8 q + r
  // gives matrix q's row r). Lane (g, t) so holds pair t of vectors +g (a0: row n0, a1:
  // row n0 + 1) and +8 + g (a2, a3), and B = the other operand's pair t of those vectors
  // (b0, b1) puts the products of matching elements on D's diagonal: D[m][m] sums row n0's
  // over vectors +m and +8 + m (lanes 4 m + t), D[8 + m][m] row n0 + 1's, one m16n8k16 a
  // B for both rows. B = dout's pairs (ldmatrix.x2 of the dout slots: exact products) and
  // q g's bf16 parts hi and lo (tile_qg_parts, into the same D). The squares take m16n8k8
  // on A's pairs {a0, a1}, {a2, a3} with B = one of A's registers: {a0, a1} a0 puts row
  // n0's squares on D[m][m], {a0, a1} a1 row n0 + 1's on D[8 + m][m]. Per group 4 ldmatrix.x4,
  // 4 ldmatrix.x2, 12 m16n8k16 and 16 m16n8k8, where the SIMT sums take 96 FFMA, 32 unpacks
  // and a reduce-scatter of 6 values a lane; ldmatrix reads each slot once, conflict-free,
  // and hands A to the mma in its register order. The tensor core adds the exact products at
  // fp32 width (simt/primitives.h). The 1-row group of an odd N keeps the SIMT sums.
  // ldmatrix reads other lanes' slots: a __syncwarp after the group's wait makes their
  // copies visible, and the __syncthreads after the head step orders the reads before
  // pass 2's copies of the next position into the slots.
  const DiagonalLane diagonal(lane);
  const PackT* const tile_rows =
      slots - lane + ((lane & 7) | ((lane >> 1) & 8)) + ((lane >> 3) & 1) * ITEMS * nthreads;
  const PackT* const tile_dout = dout_slots - lane + (lane & 15);  // (x2: lanes 0-15's addresses)
  // q g of a tile as B: lane (g, t)'s pair t of vectors +g (c = 0) and +8 + g (c = 1) as
  // bf16 parts hi, lo.
  auto tile_qg_parts = [&](int k, uint32_t (&hi)[2], uint32_t (&lo)[2]) {
    const int g = lane >> 2, t = lane & 3;
    float qg[4];
    HW_UNROLL
    for (int c = 0; c < 2; ++c) {
      const PackF* const slot = qg_slots - lane + (2 * (k >> 1) + (t >> 1)) * nthreads + 16 * (k & 1) + 8 * c + g;
      const auto v = hw::load_pack<float, 2>(reinterpret_cast<const float*>(slot) + 2 * (t & 1));
      qg[2 * c] = v.v[0];
      qg[2 * c + 1] = v.v[1];
    }
    split_pairs<T>(qg, hi, lo);
  };
  auto pass1_pair_shares = [&](int n0, const auto& qg_hi, const auto& qg_lo, float (&a)[2], float (&bq)[2], float (&ss)[2]) {
    float d_a[4] = {}, d_b[4] = {}, d_s[2][4] = {};
    const PackT* const rows = tile_rows + n0 * ITEMS * nthreads;
    HW_UNROLL
    for (int k = 0; k < 4; ++k) {
      const int i = k >> 1, h = k & 1;
      uint32_t fa[4], b_dout[2];
      hw::ldmatrix<4>(fa, rows + i * nthreads + 16 * h);
      hw::ldmatrix<2>(b_dout, tile_dout + i * nthreads + 16 * h);
      hw::mma_step<T>(d_a, fa, b_dout);
      hw::mma_step<T>(d_b, fa, qg_hi[k]);
      hw::mma_step<T>(d_b, fa, qg_lo[k]);
      HW_UNROLL
      for (int c = 0; c < 2; ++c) {
        const uint32_t pair[2] = {fa[2 * c], fa[2 * c + 1]};
        hw::mma_m16n8k8_bf16(d_s[0], pair, pair[0], d_s[0]);
        hw::mma_m16n8k8_bf16(d_s[1], pair, pair[1], d_s[1]);
      }
    }
    a[0] = diagonal.upper(d_a);
    a[1] = diagonal.lower(d_a);
    bq[0] = diagonal.upper(d_b);
    bq[1] = diagonal.lower(d_b);
    ss[0] = diagonal.upper(d_s[0]);
    ss[1] = diagonal.lower(d_s[1]);
  };

  // Pass 2's products with a per-row scalar on tensor cores (kTensorPass2; the scalar is the
  // warp's: a head of 64 vectors): gate w dout and dl u, the vectors as the bf16 pairs
  // they are held in (dout as copied, u as its rounding makes it). An m16n8k8 with A = a
  // lane's 2 pairs (A's rows g and 8 + g, columns 2t, 2t + 1) and B = v I gives
  // D[m][c] = A[m][c] v: each lane's own 4 elements scaled, in the order it holds them,
  // added to the fp32 accumulator. v enters as bf16 parts, one m16n8k8 a part for each
  // 4 elements: gate w as 3 (hi = round(v), mid = round(v - hi), lo = round(v - hi - mid):
  // all 24 bits, so the products with dout are exact and ds differs from the SIMT form
  // only by rounding), dl as 2 (16 significant bits: each term of z within 2^-16 of
  // dl u); 10 m16n8k8 an item where the SIMT form takes 16 FFMA and u's and dout's
  // unpacks. B[2t, 2t + 1][g] of the identity is nonzero in lanes t = g / 2, half g % 2:
  // a part (in the low or high half of a word) is put there by one PRMT (selector nibble
  // 4: a zero byte; the high half's selector is the low's moved 2 bytes up: + 0x22 or
  // + 0x2200). The head step forms the parts once into the (h, n) record:
  // {gate w's hi | mid, its lo, dl, dl's hi | lo}.
  auto rec_parts = [](float gw, float dl) {
    using B16 = c10::BFloat16;
    const float gw_r1 = gw - hw::round_to<B16>(gw);
    const float gw_r2 = gw_r1 - hw::round_to<B16>(gw_r1);
    hw::Pack<float, 4> r;
    r.v[0] = __uint_as_float(hw::pack_pair<B16>(gw, gw_r1));
    r.v[1] = __uint_as_float(hw::pack_pair<B16>(gw_r2, 0.f));
    r.v[2] = dl;
    r.v[3] = __uint_as_float(hw::pack_pair<B16>(dl, dl - hw::round_to<B16>(dl)));
    return r;
  };
  const uint32_t identity_select = [&] {
    const int g = lane >> 2, t = lane & 3;
    if (t != g >> 1) return 0x4444u;
    return (g & 1) != 0 ? 0x1044u : 0x4410u;
  }();
  // B = I v from a part in the low or the high half of a word.
  auto identity_low = [&](uint32_t parts) { return __byte_perm(parts, 0u, identity_select); };
  auto identity_high = [&](uint32_t parts) {
    return __byte_perm(parts, 0u, identity_select + ((~identity_select & 0x4444u) >> 1));
  };
  // acc += pairs v for an item's 8 elements (elements 0-3: pairs 0, 1; then 4-7), v's
  // parts in the order of b.
  auto add_scaled_pairs = [](float (&acc)[VEC], const uint32_t (&pairs)[VEC / 2], const auto& b) {
    HW_UNROLL
    for (int c = 0; c < 2; ++c) {
      const uint32_t a[2] = {pairs[2 * c], pairs[2 * c + 1]};
      float d[4];
      HW_UNROLL
      for (int k = 0; k < 4; ++k) d[k] = acc[4 * c + k];
      HW_UNROLL
      for (uint32_t part : b) hw::mma_m16n8k8_bf16(d, a, part, d);
      HW_UNROLL
      for (int k = 0; k < 4; ++k) acc[4 * c + k] = d[k];
    }
  };

  const T* const sources = static_cast<const T*>(p.route.sources) + static_cast<int64_t>(v0) * VEC;
  const int seq = static_cast<int>(p.route.seq);  // b < B and t < T fit in 32 bits
  auto source_at = [&](int b, int t) { return sources + b * p.route.src_stride_b + t * p.route.src_stride_t; };
  // (b, t) of the block's next position to compute: its first one's copies are issued here.
  int b = static_cast<int>(blockIdx.x * kBwdSegment / seq);
  int t = static_cast<int>(blockIdx.x * kBwdSegment - static_cast<int64_t>(b) * seq);
  {
    const T* src = source_at(b, t);
    issue_dout_and_weights(static_cast<int64_t>(blockIdx.x) * kBwdSegment);
    copies.issue_position(src, slots);
  }
  G* const grad_sources = static_cast<G*>(p.grad_sources) + static_cast<int64_t>(v0) * VEC;

  int parity = 0;
  for (int64_t seg = blockIdx.x; seg < segments; seg += gridDim.x) {
    float z[ITEMS][VEC];
    HW_UNROLL
    for (int i = 0; i < ITEMS; ++i) {
      HW_UNROLL
      for (int k = 0; k < VEC; ++k) z[i][k] = 0.f;
    }
    HW_UNROLL
    for (int i = 0; i < ITEMS; ++i)
      if (first[i]) s_gate[head[i]] = 0.f;
    const int64_t pos_end = (seg + 1) * kBwdSegment < positions ? (seg + 1) * kBwdSegment : positions;
    for (int64_t pos = seg * kBwdSegment; pos < pos_end; ++pos, parity ^= 1) {
      // The next position: the segment's next, or the first of the block's next segment.
      int64_t next_pos;
      int next_b, next_t;
      if (pos + 1 < pos_end) {
        next_pos = pos + 1;
        next_b = t + 1 == seq ? b + 1 : b;
        next_t = t + 1 == seq ? 0 : t + 1;
      } else {
        next_pos = (seg + gridDim.x) * kBwdSegment;
        next_b = static_cast<int>(next_pos / seq);
        next_t = static_cast<int>(next_pos - static_cast<int64_t>(next_b) * seq);
      }
      const bool has_next = next_pos < positions;
      float* const s_sc = s_sc0 + parity * 2 * num_src * kStagedSsPitch;
      // Every lane has left the previous position's pass 2 (its reads of s_hv and s_rr)
      // before a head's first lane writes a, b below.
      __syncwarp();

      // dout of item i (the first commit group), read from its slot in each pass: kept in
      // registers from pass 1 to pass 2 it made the kernel spill.
      auto load_dout = [&](int i, float (&dv)[VEC]) {
        hw::unpack_to_float<T, VEC>(hw::load_pack<T, VEC>(reinterpret_cast<const T*>(dout_slots + i * nthreads)), dv);
      };

      // q g's bf16 parts, pass 1's B operands of the 4 tiles (tile_qg_parts), formed from the
      // fp32 slots a position: held over the position loop they would take 16 registers
      // from pass 2. (The position's __syncwarp above orders the slots' first writes.)
      [[maybe_unused]] uint32_t qg_hi[4][2], qg_lo[4][2];
      if constexpr (kTensorPass1) {
        HW_UNROLL
        for (int k = 0; k < 4; ++k) tile_qg_parts(k, qg_hi[k], qg_lo[k]);
      }

      // Pass 1: a, b of each (row, head) and the warp's sum of squares of each row (s_sc's
      // first of the pair).
      for (int g = 0; g < groups; ++g) {
        hw::cp_async_wait_upto(groups - 1 - g);
        if constexpr (kTensorPass1) __syncwarp();  // (other lanes' copies, for ldmatrix)
        const int n0 = GR * g;
        copies.with_group_rows(n0, [&](auto rows_present) {
          constexpr int R = decltype(rows_present)::value;
          if constexpr (kTensorPass1 && R == 2) {
            float a[2], bq[2], ss[2];
            pass1_pair_shares(n0, qg_hi, qg_lo, a, bq, ss);
            // Row n0's sums on lane 0, row n0 + 1's on lane 4 (pair_sums).
            const float a_sum = diagonal.pair_sums(a[0], a[1]);
            const float b_sum = diagonal.pair_sums(bq[0], bq[1]);
            const float s_sum = diagonal.pair_sums(ss[0], ss[1]);
            if ((lane & ~4) == 0) {
              const int n = n0 + (lane >> 2);
              store_pair(s_hv + kRecord * (head[0] * num_src + n), a_sum, b_sum);
              s_sc[2 * (warp * num_src + n)] = s_sum;
            }
          } else {
            // (row j, item i): a, b, ss of the thread's vector.
            float part[R][ITEMS][3];
            HW_UNROLL
            for (int j = 0; j < R; ++j) {
              HW_UNROLL
              for (int i = 0; i < ITEMS; ++i) {
                part[j][i][0] = part[j][i][1] = part[j][i][2] = 0.f;
                if (!present(i)) continue;
                float x[VEC], qg[VEC], dv[VEC];
                hw::unpack_to_float<T, VEC>(hw::load_pack<T, VEC>(reinterpret_cast<const T*>(slots + ((n0 + j) * ITEMS + i) * nthreads)), x);
                load_qg(i, qg);
                load_dout(i, dv);
                HW_UNROLL
                for (int k = 0; k < VEC; ++k) {
                  part[j][i][0] += dv[k] * x[k];
                  part[j][i][1] += qg[k] * x[k];
                  part[j][i][2] += x[k] * x[k];
                }
              }
            }
            if constexpr (kWarpHeads) {
              // [a, b, ss] of row j at 3 j: the warp's sums, row j's held by lanes 16 j + ...
              float vals[3 * R];
              HW_UNROLL
              for (int j = 0; j < R; ++j) {
                HW_UNROLL
                for (int c = 0; c < 3; ++c) vals[3 * j + c] = part[j][0][c] + part[j][1][c];
              }
              hw::warp_sum_scatter(vals);
              if (hw::warp_scatter_leader<3 * R>(lane)) {
                const int n = n0 + hw::warp_scatter_first<3 * R>(lane) / 3;
                store_pair(s_hv + kRecord * (head[0] * num_src + n), vals[0], vals[1]);
                s_sc[2 * (warp * num_src + n)] = vals[2];
              }
            } else {
              float ss[R];
              HW_UNROLL
              for (int j = 0; j < R; ++j) {
                ss[j] = part[j][0][2] + part[j][1][2];
                HW_UNROLL
                for (int i = 0; i < ITEMS; ++i) {
                  const float a = hw::warp_segment_sum(part[j][i][0], kv);
                  const float bv = hw::warp_segment_sum(part[j][i][1], kv);
                  if (first[i]) store_pair(s_hv + kRecord * (head[i] * num_src + n0 + j), a, bv);
                }
              }
              hw::warp_sum_scatter(ss);
              hw::store_scattered_sums(ss, [&](int j, float sum) { s_sc[2 * (warp * num_src + n0 + j)] = sum; });
            }
          }
        });
      }

      // Head step: the lanes of head h (seg_lanes of them) take rows n = their index,
      // + seg_lanes, ...: S_h = sum_n w a, then dl = gate w (a - S_h), the records
      // {gate w, dl} and dl b; then lane n adds dl b of row n over the warp's heads (s_sc's
      // second). The weights were copied by other lanes of the warp.
      __syncwarp();
      {
        const int seg_lane = lane & (seg_lanes - 1);
        HW_UNROLL
        for (int i = 0; i < (kWarpHeads ? 1 : ITEMS); ++i) {
          const int h = head[i];
          const bool mine = valid[i];
          float part = 0.f;
          if (mine)
            for (int n = seg_lane; n < num_src; n += seg_lanes) part += s_w[h * num_src + n] * s_hv[kRecord * (h * num_src + n)];
          const float s = hw::warp_segment_sum(part, seg_lanes);
          if (mine) {
            if (first[i]) s_gate[h] += s;
            for (int n = seg_lane; n < num_src; n += seg_lanes) {
              const int e = h * num_src + n;
              const float w = s_w[e];
              const Pair ab = load_pair(s_hv + kRecord * e);
              const float dl = gate * w * (ab.v[0] - s);
              if constexpr (kTensorPass2) hw::store_pack<float, 4>(s_hv + kRecord * e, rec_parts(gate * w, dl));
              else store_pair(s_hv + kRecord * e, gate * w, dl);
              if constexpr (kWarpHeads) s_sc[2 * (warp * num_src + n) + 1] = dl * ab.v[1];
              else s_dlb[e] = dl * ab.v[1];
            }
          }
        }
        if constexpr (!kWarpHeads) {
          __syncwarp();
          for (int n = lane; n < num_src; n += 32) {
            float c = 0.f;
            HW_NO_UNROLL
            for (int h = head0; h < head_end; ++h) c += s_dlb[h * num_src + n];
            s_sc[2 * (warp * num_src + n) + 1] = c;
          }
        }
      }
      __syncthreads();

      // r_n and r_n^3 c_n / d, c_n = sum_h dl b, from the warps' sums (in warp order), by
      // lane n into the warp's own s_rr.
      for (int n = lane; n < num_src; n += 32) {
        float ss = 0.f, c = 0.f;
        for (int w = 0; w < nwarps; ++w) {
          const Pair sc = load_pair(s_sc + 2 * (w * num_src + n));
          ss += sc.v[0];
          c += sc.v[1];
        }
        const float r = rsqrtf(ss * inv_d + p.route.eps);
        store_pair(s_rr + 2 * n, r, r * r * r * c * inv_d);
      }
      __syncwarp();

      // Pass 2: ds_n = gate w dout + (r dl) q g - r^3 c / d s_n (the CPU kernel's
      // association); z += dl round(s_n r). `accumulate` (ds adds to what grad_sources
      // holds) is a std::bool_constant.
      auto emit_grads = [&](auto accumulate) {
        // dout, from its slot before the first group's copies replace it: as fp32 or,
        // for the tensor-core products, as the bf16 pairs of the A fragment.
        [[maybe_unused]] float dout[ITEMS][VEC];
        [[maybe_unused]] uint32_t dout_pairs[ITEMS][VEC / 2];
        HW_UNROLL
        for (int i = 0; i < ITEMS; ++i) {
          if constexpr (kTensorPass2) {
            const auto v = hw::load_pack<uint32_t, VEC / 2>(reinterpret_cast<const uint32_t*>(dout_slots + i * nthreads));
            HW_UNROLL
            for (int m = 0; m < VEC / 2; ++m) dout_pairs[i][m] = v.v[m];
          } else if (present(i)) {
            load_dout(i, dout[i]);
          } else {
            HW_UNROLL
            for (int k = 0; k < VEC; ++k) dout[i][k] = 0.f;
          }
        }
        // Row n's ds, slots and records, stepped a row an iteration.
        G* ds = grad_sources + pos * p.route.d;
        const PackT* row_slots = slots;
        const float* rec_row = s_hv + kRecord * head[0] * num_src;
        const T* const next_src = source_at(next_b, next_t);
        // One row an iteration, not unrolled: two rows interleaved took the kernel to 122
        // live registers and spills (sm_90).
        HW_NO_UNROLL
        for (int n = 0; n < num_src; ++n, ds += ds_stride_n, row_slots += ITEMS * nthreads, rec_row += kRecord) {
          const Pair rr = load_pair(s_rr + 2 * n);  // r, r^3 c / d
          // gate w (the SIMT form's) and dl of the items' heads (one head: both items' in a
          // warp's head).
          [[maybe_unused]] float gw[kWarpHeads ? 1 : ITEMS];
          float dl[kWarpHeads ? 1 : ITEMS];
          // The tensor-core products' B operands: the identity times each of gate w's
          // parts (lo first: the sum's small terms first) and dl's.
          [[maybe_unused]] uint32_t b_gw[3], b_dl[2];
          if constexpr (kTensorPass2) {
            const auto r = hw::load_pack<float, 4>(rec_row);
            dl[0] = r.v[2];
            const uint32_t gw01 = __float_as_uint(r.v[0]), dl01 = __float_as_uint(r.v[3]);
            b_gw[0] = identity_low(__float_as_uint(r.v[1]));
            b_gw[1] = identity_high(gw01);
            b_gw[2] = identity_low(gw01);
            b_dl[0] = identity_high(dl01);
            b_dl[1] = identity_low(dl01);
          } else {
            HW_UNROLL
            for (int i = 0; i < (kWarpHeads ? 1 : ITEMS); ++i) {  // (an absent item's head may not exist)
              const Pair rec = load_pair(rec_row + kRecord * ((present(i) ? head[i] : head[0]) - head[0]) * num_src);
              gw[i] = rec.v[0];
              dl[i] = rec.v[1];
            }
          }
          HW_UNROLL
          for (int i = 0; i < ITEMS; ++i) {
            if (!present(i)) continue;
            const int hs = kWarpHeads ? 0 : i;  // the item's head's scalars
            [[maybe_unused]] float prev[VEC];  // what ds holds, with `accumulate`
            if constexpr (decltype(accumulate)::value) hw::load_as_float<VEC>(ds + i * 32 * VEC, prev);
            float x[VEC];
            hw::unpack_to_float<T, VEC>(hw::load_pack<T, VEC>(reinterpret_cast<const T*>(row_slots + i * nthreads)), x);
            const float rdl = rr.v[0] * dl[hs];
            float y[VEC], qg[VEC];
            load_qg(i, qg);
            if constexpr (kTensorPass2) {
              // y = ((r dl) q g - r^3 c / d s) + gate w dout, z += dl u: the products with
              // dout and u on tensor cores, u = round(s r) as the bf16 pairs its rounding
              // makes.
              HW_UNROLL
              for (int k = 0; k < VEC; ++k) y[k] = rdl * qg[k] - rr.v[1] * x[k];
              add_scaled_pairs(y, dout_pairs[i], b_gw);
              uint32_t u[VEC / 2];
              HW_UNROLL
              for (int m = 0; m < VEC / 2; ++m) u[m] = hw::pack_pair<T>(x[2 * m] * rr.v[0], x[2 * m + 1] * rr.v[0]);
              add_scaled_pairs(z[i], u, b_dl);
            } else {
              HW_UNROLL
              for (int k = 0; k < VEC; ++k) y[k] = gw[hs] * dout[i][k] + rdl * qg[k] - rr.v[1] * x[k];
              float u[VEC];
              HW_UNROLL
              for (int k = 0; k < VEC; ++k) u[k] = x[k] * rr.v[0];
              hw::round_vec_to<T, VEC>(u);
              HW_UNROLL
              for (int k = 0; k < VEC; ++k) z[i][k] += dl[hs] * u[k];
            }
            if constexpr (decltype(accumulate)::value) {
              HW_UNROLL
              for (int k = 0; k < VEC; ++k) y[k] = prev[k] + y[k];
            }
            hw::store_from_float<VEC>(ds + i * 32 * VEC, y);
          }
          // A group's slots are free after its last row: the next position's copies (its
          // dout and weights with the first group).
          if (has_next && ((n & 1) || n + 1 == num_src)) {
            const int n0 = n & ~1;
            if (n0 == 0) issue_dout_and_weights(next_pos);
            copies.issue_group(n0, next_src, slots);
          }
        }
      };
      if (p.accumulate) emit_grads(std::true_type{});
      else emit_grads(std::false_type{});

      b = next_b;
      t = next_t;
    }
    // The segment's partials: z of the thread's vectors (a warp's item is 32 consecutive
    // vectors: one coalesced octet store each, 16 sectors a request where a lane's own two
    // 16-byte stores take 32); the gate's over the block.
    HW_UNROLL
    for (int i = 0; i < ITEMS; ++i) {
      const int w0 = warp * 32 * ITEMS + 32 * i;
      hw::warp_store_octets(p.z_partial + seg * p.route.d + static_cast<int64_t>(w0) * VEC, nvec - w0, z[i]);
    }
    // The gate's: s_gate of heads tid, tid + nthreads (H <= nvec = 2 nthreads at most),
    // once every head's first lane has added its last S_h.
    __syncthreads();
    const float gate_sum = (tid < heads ? s_gate[tid] : 0.f) + (tid + nthreads < heads ? s_gate[tid + nthreads] : 0.f);
    // A BlockSum a segment: its first half, which a segment's position barriers keep from
    // the previous segment's readers (a counter kept over the loop was spilled).
    const float seg_gate = hw::BlockSum(smem)(gate_sum);
    if (tid == 0) p.gate_partial[seg] = seg_gate;
  }
}

}  // namespace mhar
}  // namespace headwise
