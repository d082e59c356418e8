// DCMHA fused attention backward on tensor cores (SPEC section 5), bf16 / fp16 inputs with
// fp32 accumulation, and fp32 inputs as TF32 after a TF32 forward; the forward is
// dcmha_attention_mma_kernel.cuh (its notation below).
//
// Math, per (t, s) and head n of a group (S_n = scale q_n[t] . k_n[s]; P, P' of the forward;
// dP'_n = dO_n[t] . v_n[s]; the rank partials a, b, c, d of the forward):
//   dc_r = sum_n W2[t,2,r,n] dP'_n           dd_r = sum_n W2[s,3,r,n] dP'_n
//   dP_n = dP'_n (1 + G[t,2,n] + G[s,3,n]) + sum_r W1[t,2,r,n] dc_r + W1[s,3,r,n] dd_r
//   D_n[t] = sum_s P_n dP_n,   dL'_n = P_n (dP_n - D_n[t])
//   da_r = sum_n W2[t,0,r,n] dL'_n           db_r = sum_n W2[s,1,r,n] dL'_n
//   dL_n = dL'_n (1 + G[t,0,n] + G[s,1,n]) + sum_r W1[t,0,r,n] da_r + W1[s,1,r,n] db_r
//   dq_n[t] = scale sum_s dL_n k_n[s],  dk_n[s] = scale sum_t dL_n q_n[t],  dv_n[s] = sum_t P'_n dO_n[t]
//   query slots (sums over s): dG[t,2] = P dP', dW1[t,2,r] = P dc_r, dW2[t,2,r] = c_r dP',
//                              dG[t,0] = S dL', dW1[t,0,r] = S da_r, dW2[t,0,r] = a_r dL';
//   key slots (sums over t):   the same with (3, dd, d) and (1, db, b).
// The heads of a group meet only through the rank sums (dc, dd) and (da, db), as in the
// forward through (a, b) and (c, d); D needs a whole row of keys before dL' exists.
//
// Design: per query chunk (rows [c0, c0 + chunk), the scratch [B G, 8, chunk, T] of
// PartWords: the 16 rank fields a b c d dc dd da db, both ranks of each one word of two
// T, the forward's pack_part), seven launches, every T x S x d product on
// mma.sync m16n8k16 (the forward's 64 x 32 warp tiling, qk_tile and fragment_times_rows):
//   1. dcmha_attn_partials (the forward's kernel): a, b, c, d of the chunk.
//   2. dcmha_attn_bwd_sweep<Pre = false>: CTA per (32-key tile, 64-row query tile, b G);
//      per key tile and head dP' = dO V^T on mma, dc and dd summed over the group's heads.
//   3. dcmha_attn_bwd_rows<Dq = false>: CTA per (heads, key split, query tile, b), the
//      tile's key band cut into kRowsumKeySplits runs of key tiles; per key tile S and
//      dP' on mma, P and dP on the fragments: D and the slot-2 weight grads of the run,
//      reduced over its keys in registers then across the quad (fixed order), stored per
//      split. dcmha_attn_bwd_rowsum_combine adds the splits in split order: D goes to the
//      weights table (field kFieldD), which the later launches read like the other row
//      fields, the grads to the grads table. (The splits give a launch three times the
//      CTAs of one per tile, which left its last wave mostly empty.)
//   4. dcmha_attn_bwd_sweep<Pre = true>: S and dP' per head, dL': da and db.
//   5. dcmha_attn_bwd_rows<Dq = true>: dL on the fragments, packed to A fragments,
//      dq += dL K on mma (K by ldmatrix.trans); the slot-0 grads. dq staged through smem
//      and stored in 16-byte chunks (every query row lives in one chunk: written once).
//   6. dcmha_attn_bwd_keys: CTA of 8 warps per (head, 64-key tile, b), the roles of rows
//      and columns swapped (S^T = K Q^T and dP'^T = V dO^T on mma, the 32 query columns of
//      the chunk's tiles looped, each warp 16 keys x 16 queries): P' and dL^T on the
//      fragments, staged to smem as T, then dv += P'^T dO and dk += dL^T Q on mma (each
//      warp 16 keys x half the columns); the slot-1 and slot-3 grads. dk, dv and the
//      key-slot grads are fp32 sums over the chunks in launch order (bitwise repeatable, no
//      atomics): the first chunk that reads a key tile stores its share of dk, dv, later
//      ones add theirs, and the last writes the sum in T to dk, dv (no zero-fill and no
//      conversion pass over the fp32 sums).
// Around the chunks: dcmha_attn_weights_t builds the weights table [B, H, 23, T] (the 20
// weight fields, then M, 1/Z from the forward's statistics and D from launch 3), and
// dcmha_attn_grads_untranspose turns the grads table [B, H, 20, T] (written with t or s
// consecutive: coalesced) into dw1, dw2, dg.
// Operands by cp.async (16 bytes, or element copies for unaligned views / odd dims) into
// [rows][d_pad + 8] smem (ldmatrix conflict-free), double-buffered across key (query)
// tiles; the per-row and per-column compose weights by 4-byte cp.async into [field][pitch]
// smem with the tiles they belong to, or into registers for the CTA's own rows.
//
// Budget per kept (t, s) and head (d = dh = dv): tensor FLOPs 2 d per product; products
// per launch: 1 partials 2 (S twice), 2 dP' 1, 3 (S, dP') 2, 4 (S, dP') 2, 5 (S, dP', dq) 3,
// 6 (S, dP', dv, dk) 4 = 14 products = 28 d FLOPs against flash attention's backward 5
// products (10 d): 2.8x.
// Bytes: the scratch (8 words, 32 B per (t, s) and group) is read from L2, per (t, s):
//   launch 3: a, b, dc, dd (16 B) once per pair of heads (rowsum_heads), c (4 B) per head;
//   launch 4: a, b, dc, dd (16 B) once per group (kept in registers across its heads);
//   launch 5: a, b, dc, dd, da, db (24 B) per head;   launch 6: all 8 words (32 B) per head;
// so 12 hg + 16 + 24 hg + 32 hg = 68 hg + 16 bytes a group (a load per head in every launch
// would be 92 hg). L2 and shared memory bound the backward at dh <= 128 (bench/RESULTS.md).
// No tensor scales with T S: the scratch is B G 8 chunk T words with chunk rows chosen
// under kScratchBytes (512 MiB; 512 rows at B = 8, G = 1, T = 4096) but at least 64 (so
// B G 2 KiB T where that is over the cap); dk, dv fp32 are O(B H T d), the tables O(B H T),
// launch 3's split sums B H 3 6 chunk fp32 (0.8 MiB at the target).
// Shared memory (the *_smem_bytes functions; ldq = dh_pad + 8, ldv = dv_pad + 8 elements), at
// dh = dv = 128: the dL' sweep 111.2 KiB (double-buffered dO, V, Q, K tiles + the weights
// of a query and a key tile), the dP' sweep 60.2 KiB, the row kernels 70.6 KiB, the key
// kernel 108.5 KiB: sm_80 / sm_90 (163 / 227 KiB); the 99 KiB parts run the dL' sweep and
// the key kernel with one buffer of their streamed tiles (see the fp32 note below).
//
// fp32 as TF32 (the same kernels at T = float, after a forward that took the tensor cores, so
// both form the logits from the same truncated operands): the products as the forward's
// (qk_tile; fragment_times_rows for dq += dL K, K by scalar loads in tf32_pair_step's pair
// order), and the key kernel's dv += P'^T dO, dk += dL^T Q in that order too: P'^T and dL^T
// staged as fp32 and read as (a0, a2), (a1, a3) pairs by 8-byte loads (tf32_pair_a), dO and
// Q by scalar loads. The scratch words are 64 bits (two fp32 ranks), so the held words that
// save the 16-bit path's reloads would take twice the registers: the dL' sweep loads them
// per head where it uses them, and launch 3 takes one head a CTA (rowsum_heads). Shared
// memory at dh = dv = 128: the dL' sweep 207 KiB, the dP' sweep 108 KiB, the row kernels
// 135 KiB (dq) and the key kernel 183 KiB: sm_90 (227 KiB) holds them; on sm_80 (163 KiB) the
// dL' sweep and the key kernel keep one buffer of their streamed tiles (104 / 147 KiB: their
// Stages = 1 instantiations), so the next tile loads after the current one's
// products instead of during them. So do bf16's at dh = dv = 128 on the 99 KiB parts (56 /
// 89 KiB), with the rowsum at one head a CTA (its two heads' tiles take 104.5 KiB).
#pragma once

#include "dcmha_attention_mma_kernel.cuh"

#include <cstdint>

namespace headwise {
namespace dcmha {

// The scratch fields per (t, s) and head group.
constexpr int kPartA = 0, kPartB = 2, kPartC = 4, kPartD = 6, kPartDC = 8, kPartDD = 10, kPartDA = 12, kPartDB = 14;
constexpr int kBwdPartFields = 16;
constexpr int kBwdPartWords = kBwdPartFields / 2;  // scratch planes: one PartWord (both ranks) a partial
constexpr int kQueryTileCols = 32;  // query rows per step of the key-tile kernels
// The key kernel's warps (4 key slabs x 2 halves), its query columns per warp's score
// fragments, and the pitch (elements) of its P'^T, dL^T tiles: 80-byte rows, so that the
// fragment stores and the ldmatrix reads are conflict-free.
constexpr int kKeyWarps = 8;
constexpr int kKeyThreads = 32 * kKeyWarps;
constexpr int kKeyHalfN8 = kQueryTileCols / 16;
constexpr int kGradPitch = kQueryTileCols + 8;
constexpr int kKeySlotGrads = 20;  // a thread's slot-1 and slot-3 grads of its 2 rows
// The key kernel's side records (load_side_records): a query column's 13 fields at a pitch
// of 20 floats, a key row's 10 at 12. A warp's side load reads 4 columns 2 apart (160 B:
// banks 0, 8, 16, 24 + 4) or 8 consecutive rows (48 B: 8 disjoint runs of 4 banks), so
// every 16-byte read is one wavefront.
constexpr int kQueryRecord = 20, kKeyRecord = 12;
// Launch 3's key splits per query tile, and its per-split sums of a row: the 5 slot-2
// grads, then D. A constant, so the order of D's sums depends on the shape only.
constexpr int kRowsumKeySplits = 3, kRowsumFields = 6;
// Launch 3's heads a CTA: 2 where the group's size is even (the two share the scratch reads
// of every (t, s)) and the words are 32-bit, else 1 (the TF32 path's 64-bit words, held for
// the second head, would take twice the registers).
__host__ __device__ inline int rowsum_heads(int hg, int elem = 2) { return hg % 2 == 0 && elem == 2 ? 2 : 1; }

struct MmaAttnBwdParams {
  MmaAttnParams m;   // q, k, v, stats, wt (kBwdWeightFields), partials (kBwdPartFields), chunk
  float* wt;         // m.wt, writable: launch 3 writes field kFieldD
  const void* dout;  // [B, H, T, dv]
  void* dq;          // [B, H, T, dh]
  float* dk;         // [B, H, T, dh] fp32 sums of the chunks' shares: stored by the first chunk
  float* dv;         // that reads a key tile, added to by the later ones ([B, H, T, dv])
  void* dk_out;      // [B, H, T, dh] in q's dtype: the last chunk that reads a key tile writes
  void* dv_out;      // its sum + share here ([B, H, T, dv]): no zero-fill, no conversion pass
  int key_tile0;     // 64-key tile of the key kernels' blockIdx.y = 0 (the first of the chunk's band)
  float* rowsum_parts;  // [B H, kRowsumKeySplits, kRowsumFields, rowsum_pitch] fp32: launch 3's
                        // per-split sums of the chunk's rows (row t at t - chunk0)
  int rowsum_pitch;     // the chunk's rows rounded up to 32 (32-byte aligned row runs)
  float* gt;         // [B, H, 20, T] fp32 weight grads in the weights table's fields (W1, W2, G
                     // per slot): query slots written, key slots added to (zeroed); the
                     // launcher transposes it to dw1, dw2, dg (dcmha_attn_grads_untranspose)
};

// Launch 3's sums of split `split` of (b, head m) = `head`: field i of chunk row r at
// [i * rowsum_pitch + r]. The row kernel stores them, the combine reads them.
__device__ __forceinline__ float* rowsum_parts_of(const MmaAttnBwdParams& bp, int64_t head, int split) {
  return bp.rowsum_parts + (head * kRowsumKeySplits + split) * kRowsumFields * bp.rowsum_pitch;
}

// A side held in shared memory: field f of column c at p[f * pitch].
struct SmemSide {
  const float* p;
  int pitch;
  __device__ __forceinline__ float operator[](int f) const { return p[f * pitch]; }
};

// Element math (q: query side, k: key side, pt: the 16 scratch fields of (t, s)).
// The logit in the order of the forward's sweeps (dcmha_attn_sweep), which made M and Z.
template <class Q, class K>
__device__ __forceinline__ float bwd_prob(float S, const Q& q, const K& k, const float* pt, bool kept) {
  float l = S * (1.f + q[kGPre] + k[kGPre]);
  l += q[kW2Pre] * pt[kPartA] + k[kW2Pre] * pt[kPartB];
  l += q[kW2Pre + 1] * pt[kPartA + 1] + k[kW2Pre + 1] * pt[kPartB + 1];
  return kept ? expf(l - q[kStatM]) * q[kStatInvZ] : 0.f;
}
template <class Q, class K>
__device__ __forceinline__ float bwd_post_prob(float P, const Q& q, const K& k, const float* pt, bool kept) {
  const float y = P * (1.f + q[kGPost] + k[kGPost]) + q[kW2Post] * pt[kPartC] + q[kW2Post + 1] * pt[kPartC + 1] +
                  k[kW2Post] * pt[kPartD] + k[kW2Post + 1] * pt[kPartD + 1];
  return kept ? y : 0.f;
}
template <class Q, class K>
__device__ __forceinline__ float bwd_grad_prob(float dPp, const Q& q, const K& k, const float* pt) {
  return dPp * (1.f + q[kGPost] + k[kGPost]) + q[kW1Post] * pt[kPartDC] + q[kW1Post + 1] * pt[kPartDC + 1] +
         k[kW1Post] * pt[kPartDD] + k[kW1Post + 1] * pt[kPartDD + 1];
}
template <class Q, class K>
__device__ __forceinline__ float bwd_grad_logit(float dLp, const Q& q, const K& k, const float* pt) {
  return dLp * (1.f + q[kGPre] + k[kGPre]) + q[kW1Pre] * pt[kPartDA] + q[kW1Pre + 1] * pt[kPartDA + 1] +
         k[kW1Pre] * pt[kPartDB] + k[kW1Pre + 1] * pt[kPartDB + 1];
}

// The 5 weight-grad terms of one slot at one element: dG += x dy, dW1[r] += x dp[r],
// dW2[r] += part[r] dy (x: the slot's input S or P, dy: dL' or dP', dp: da/db or dc/dd,
// part: a/b or c/d).
__device__ __forceinline__ void add_slot_grads(float* acc, float x, float dy, const float* dp, const float* part) {
  acc[0] += x * dy;
  acc[1] += x * dp[0];
  acc[2] += x * dp[1];
  acc[3] += part[0] * dy;
  acc[4] += part[1] * dy;
}

// Sum of v over the 4 lanes of a quad (the lanes of one accumulator row), fixed order.
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  v += __shfl_xor_sync(0xffffffffu, v, 2);
  return v;
}

// Stores (Add = false) or adds (Add = true) the 5 grads of slot c of one head at position
// x (a row t or column s) in the grads table: consecutive positions are consecutive floats.
template <bool Add>
__device__ __forceinline__ void put_slot_grads(const MmaAttnBwdParams& bp, int64_t head, int x, int c,
                                               const float* acc) {
  const int64_t TT = bp.m.f.T;
  float* g = bp.gt + head * kWeightFields * TT + x;
  float* dst[5] = {g + wfield_g(c) * TT, g + wfield_w1(c, 0) * TT, g + wfield_w1(c, 1) * TT,
                   g + wfield_w2(c, 0) * TT, g + wfield_w2(c, 1) * TT};
HW_UNROLL
  for (int i = 0; i < 5; ++i) *dst[i] = Add ? *dst[i] + acc[i] : acc[i];
}

// The grads table [B, H, 20, T] to dw1, dw2 [B, T, 4, R, H] and dg [B, T, 4, H]: the inverse
// of dcmha_attn_weights_t, on its tiles (CTA per (32 rows, b, 128 columns)). Loads: 16-byte
// chunks of a column's rows (vec4: T a multiple of 4), a warp 4 columns x 32 rows (128 B
// each); stores: a warp 32 consecutive columns of a row.
__global__ void __launch_bounds__(kTransposeThreads) dcmha_attn_grads_untranspose(const AttnParams p, const float* gt,
                                                                                  float* dw1, float* dw2, float* dg,
                                                                                  int vec4) {
  const TransposeTile tile(p);
  const int b = tile.b, t0 = tile.t0, j0 = tile.j0, rows = tile.rows, cols = tile.cols, H = p.H, TT = p.T;
  float* s = reinterpret_cast<float*>(hw::dynamic_shared_memory());  // [kTransposeCols][kGradsTPitch]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // The tile as 32 blocks of 4 columns x 32 rows, a warp's block per step.
  for (int blk = warp; blk < kTransposeCols / 4; blk += kTransposeThreads / 32) {
    const int c = blk * 4 + lane / 8, r = (lane % 8) * 4, j = j0 + c;
    if (c >= cols || r >= rows) continue;
    const float* src = gt + ((static_cast<int64_t>(b) * H + j % H) * kWeightFields + j / H) * TT + t0 + r;
    float x[4] = {};
    if (vec4 && r + 4 <= rows) {
      hw::load_as_float<4>(src, x);
    } else {
HW_UNROLL
      for (int k = 0; k < 4; ++k) x[k] = r + k < rows ? src[k] : 0.f;
    }
HW_UNROLL
    for (int k = 0; k < 4; ++k) s[c * kGradsTPitch + r + k] = x[k];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < rows * cols; i += blockDim.x) {
    const int r = i / cols, c = i % cols, j = j0 + c;
    const int64_t row = static_cast<int64_t>(b) * TT + t0 + r;
    const float x = s[c * kGradsTPitch + r];
    if (j < 8 * H) dw1[row * 8 * H + j] = x;
    else if (j < 16 * H) dw2[row * 8 * H + j - 8 * H] = x;
    else dg[row * 4 * H + j - 16 * H] = x;
  }
}

// The scratch words of `Mask`'s planes (bit i: plane i, fields 2i and 2i + 1) of the pair
// (t, s), (t, s + 1) at offset at: 8-byte loads where `pair`, else word loads (second:
// s + 1 < T); 0 where !in; the words of other planes are left as they are. Kept as words until a column's element math unpacks them
// (unpack_part_column): half the registers of their fields. The planes' addresses step by
// `plane` from the first's (a 64-bit add each): written as part + f plane + at, nvcc
// factored T out of plane and at and formed each address with 64-bit multiplies (~10
// instructions a load in the key kernel's SASS).
template <unsigned Mask, typename W>
__device__ __forceinline__ void load_part_word_pair(W (&w)[kBwdPartWords][2], const W* part, int64_t plane, int64_t at,
                                                    bool in, bool pair, bool second) {
  const W* src = part + at;
HW_UNROLL
  for (int i = 0; i < kBwdPartWords; ++i, src += plane) {
    if (!((Mask >> i) & 1u)) continue;
    w[i][0] = w[i][1] = W(0);
    if (in) load_part_words(src, w[i][0], w[i][1], pair, second);
  }
}

// load_part_word_pair of the pair of a warp's 16 x 32 fragment that element row h of n8 tile
// j holds: t = q0 + 16 warp + lane / 4 + 8 h, s = s0 + 8 j + 2 (lane % 4), at chunk row t - chunk0.
template <unsigned Mask, typename W>
__device__ __forceinline__ void load_fragment_words(W (&w)[kBwdPartWords][2], const W* part, int64_t plane, int q0,
                                                    int s0, int chunk0, int TT, int j, int h, int warp, int lane) {
  const int t = q0 + warp * 16 + lane / 4 + 8 * h, s = s0 + j * 8 + 2 * (lane % 4);
  load_part_word_pair<Mask>(w, part, plane, static_cast<int64_t>(t - chunk0) * TT + s, t < TT && s < TT,
                            s + 1 < TT && TT % 2 == 0, s + 1 < TT);
}

// Column e (0: s, 1: s + 1) of those words as the 16 fields of (t, s + e): 0 where !kept
// and outside Mask.
template <typename T, unsigned Mask>
__device__ __forceinline__ void unpack_part_column(const PartWordOf<T> (&w)[kBwdPartWords][2], int e, bool kept,
                                                   float (&pt)[kBwdPartFields]) {
HW_UNROLL
  for (int i = 0; i < kBwdPartWords; ++i) {
    const PartWordOf<T> x = ((Mask >> i) & 1u) && kept ? (e == 0 ? w[i][0] : w[i][1]) : PartWordOf<T>(0);
    unpack_part<T>(x, pt[2 * i], pt[2 * i + 1]);
  }
}

template <typename T, unsigned Mask>
__device__ __forceinline__ void load_part_one(float (&pt)[kBwdPartFields], const PartWordOf<T>* part, int64_t plane,
                                              int64_t at, bool in) {
  const PartWordOf<T>* src = part + at;
HW_UNROLL
  for (int i = 0; i < kBwdPartWords; ++i, src += plane) {
    if (!((Mask >> i) & 1u)) continue;
    unpack_part<T>(in ? *src : PartWordOf<T>(0), pt[2 * i], pt[2 * i + 1]);
  }
}

constexpr unsigned part_bits(int f) { return 1u << (f / 2); }

// Shared memory of the three kernels.
// elem: bytes of the inputs' dtype (2, or 4 for the TF32 path); stages: buffers of the tiles
// the sweeps and the key kernel stream (their Stages: kBufferStages, or 1 where two do not fit
// the device's shared memory, so that the next tile loads after the current one's products
// instead of during them).
constexpr int kBufferStages = 2;
__host__ __device__ inline int64_t bwd_sweep_smem_bytes(bool pre, int dh_pad, int dv_pad, int elem = 2,
                                                        int stages = kBufferStages) {
  const int64_t ldq = tile_pitch(dh_pad, elem), ldv = tile_pitch(dv_pad, elem);
  return int64_t(stages) * (kTileRows + kTileKeys) * (ldv + (pre ? ldq : 0)) * elem +
         int64_t(4) * stages * (kQuerySide * kRowPitch + kKeySide * kColPitch);
}
__host__ __device__ inline int64_t bwd_rows_smem_bytes(int dh_pad, int dv_pad, int heads, int elem = 2) {
  const int64_t ldq = tile_pitch(dh_pad, elem), ldv = tile_pitch(dv_pad, elem);
  return int64_t(heads) * kTileRows * (ldq + ldv) * elem + int64_t(2) * kTileKeys * (ldq + ldv) * elem +
         int64_t(4) * 2 * kKeySide * kColPitch;
}
__host__ __device__ inline int64_t bwd_keys_smem_bytes(int dh_pad, int dv_pad, int elem = 2,
                                                       int stages = kBufferStages) {
  const int64_t ldq = tile_pitch(dh_pad, elem), ldv = tile_pitch(dv_pad, elem);
  return int64_t(kTileRows) * (ldq + ldv) * elem + int64_t(stages) * kQueryTileCols * (ldq + ldv) * elem +
         int64_t(2) * kTileRows * kGradPitch * elem +
         int64_t(4) * (stages * kQueryTileCols * kQueryRecord + kTileRows * kKeyRecord +
                       kTileRows * kKeySlotGrads / 2 + kKeyThreads * kKeySlotGrads);
}

// Launches 2 and 4: CTA per (kSweepSplitKeys keys, query tile of the chunk, b * G), like
// launch 1's: one key tile, so the per-chunk launches fill the GPU. The dL' sweep's shared
// memory (111 KiB at dh = dv = 128) leaves 2 CTAs an sm_90 SM: its bound of 2 lets ptxas
// use the registers (at the default it stopped at 168 and spilled on sm_90).
template <typename T, bool Pre, int Stages = kBufferStages>
__global__ void __launch_bounds__(kMmaThreads, 2) dcmha_attn_bwd_sweep(const MmaAttnBwdParams bp) {
  const MmaAttnParams& mp = bp.m;
  const AttnParams& p = mp.f;
  const int H = p.H, TT = p.T, hg = p.hg, G = H / hg;
  const int bg = blockIdx.z, b = bg / G, h0 = (bg % G) * hg;
  const int q0 = mp.chunk0 + blockIdx.y * kTileRows;
  if (q0 >= TT) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gq = lane / 4, tq = lane % 4;
  const int ldq = tile_pitch(mp.dh_pad, sizeof(T)), ldv = tile_pitch(mp.dv_pad, sizeof(T));

  int lo, hi;
  split_key_band(q0, kTileRows, TT, p.causal, p.window, (mp.split0 + blockIdx.x) * kSweepSplitKeys,
                 kSweepSplitKeys, lo, hi);
  if (hi <= lo) return;
  const int kt_lo = lo / kTileKeys, kt_hi = (hi + kTileKeys - 1) / kTileKeys;

  static_assert(Stages == 1 || Stages == 2, "one or two buffers of the streamed tiles");
  constexpr int stages = Stages;  // buffers of an item's tiles (2, or 1 where two do not fit)
  unsigned char* base = hw::dynamic_shared_memory();
  T* obuf = reinterpret_cast<T*>(base);            // [stages][64][ldv] dO
  T* vbuf = obuf + stages * kTileRows * ldv;        // [stages][32][ldv] V
  T* qbuf = vbuf + stages * kTileKeys * ldv;        // [stages][64][ldq] Q (Pre)
  T* kbuf = qbuf + (Pre ? stages * kTileRows * ldq : 0);  // [stages][32][ldq] K (Pre)
  float* rowf = reinterpret_cast<float*>(kbuf + (Pre ? stages * kTileKeys * ldq : 0));  // [stages][13][65]
  float* colf = rowf + stages * kQuerySide * kRowPitch;                                  // [stages][10][33]

  // Pre = false reads W2 of the post slots; Pre = true P, dP and W2 of the pre slots.
  constexpr unsigned kPostW2 = (1u << kW2Post) | (1u << (kW2Post + 1));
  constexpr unsigned kPreFields = (1u << kW2Pre) | (1u << (kW2Pre + 1)) | (1u << kGPre) | (1u << kW1Post) |
                                  (1u << (kW1Post + 1)) | (1u << kGPost);
  constexpr unsigned kRowMask = Pre ? kPreFields | (1u << kStatM) | (1u << kStatInvZ) | (1u << kStatD) : kPostW2;
  constexpr unsigned kColMask = Pre ? kPreFields : kPostW2;

  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const T* dout = static_cast<const T*>(bp.dout);
  const int n_items = (kt_hi - kt_lo) * hg;
  auto issue = [&](int item) {
    if (item < n_items) {
      const int kt = kt_lo + item / hg, n = item % hg, stage = item & (stages - 1), s0 = kt * kTileKeys;
      const int64_t head = static_cast<int64_t>(b) * H + h0 + n;
      load_rows(obuf + stage * kTileRows * ldv, dout + head * TT * p.dv, q0, kTileRows, TT, p.dv, mp.dv_pad, mp.vec16);
      load_rows(vbuf + stage * kTileKeys * ldv, v + head * TT * p.dv, s0, kTileKeys, TT, p.dv, mp.dv_pad, mp.vec16);
      if (Pre) {
        load_rows(qbuf + stage * kTileRows * ldq, q + head * TT * p.dh, q0, kTileRows, TT, p.dh, mp.dh_pad, mp.vec16);
        load_rows(kbuf + stage * kTileKeys * ldq, k + head * TT * p.dh, s0, kTileKeys, TT, p.dh, mp.dh_pad, mp.vec16);
      }
      const float* wt_head = mp.wt + head * mp.wfields * TT;
      load_side_fields(rowf + stage * kQuerySide * kRowPitch, wt_head, q0, kTileRows, kRowPitch, TT, kRowMask,
                       kQuerySide, false);
      load_side_fields(colf + stage * kKeySide * kColPitch, wt_head, s0, kTileKeys, kColPitch, TT, kColMask, kKeySide,
                       true);
    }
    hw::cp_async_commit();
  };

  PartWordOf<T>* part = part_words<T>(mp.partials) + static_cast<int64_t>(bg) * mp.pwords * mp.chunk * TT;
  const int64_t plane = static_cast<int64_t>(mp.chunk) * TT;
  float sq[kR][kKeyN8][4] = {}, sk[kR][kKeyN8][4] = {};  // (dc, dd) or (da, db) of the warp's 16 x 32 fragment
  // Pre: the words a, b, dc, dd of the warp's fragment, the same for every head of the group:
  // loaded at a key tile's first head and kept in registers for the others (read once per
  // (t, s) and group, where a load per head read the scratch hg times). fp32 words would hold
  // 128 registers so: the TF32 path loads them per head where it uses them.
  constexpr unsigned kPreWords = part_bits(kPartA) | part_bits(kPartB) | part_bits(kPartDC) | part_bits(kPartDD);
  constexpr bool kHoldWords = !std::is_same<T, float>::value;
  PartWordOf<T> pw[kKeyN8][2][kBwdPartWords][2] = {};
  // Two stages: item + 1's tiles load while item's are used. One: item's load after item - 1's
  // products (the barrier), waited for before its own.
  if constexpr (stages == 2) issue(0);
  for (int item = 0; item < n_items; ++item) {
    const int kt = kt_lo + item / hg, n = item % hg, stage = item & (stages - 1), s0 = kt * kTileKeys;
    __syncthreads();  // every warp is done with the stage of item - 1
    issue(stages == 2 ? item + 1 : item);
    if (n == 0) {
HW_UNROLL
      for (int r = 0; r < kR; ++r)
HW_UNROLL
        for (int j = 0; j < kKeyN8; ++j)
HW_UNROLL
          for (int e = 0; e < 4; ++e) sq[r][j][e] = sk[r][j][e] = 0.f;
      if constexpr (Pre && kHoldWords) {
HW_UNROLL
        for (int j = 0; j < kKeyN8; ++j)
HW_UNROLL
          for (int h = 0; h < 2; ++h)
            load_fragment_words<kPreWords>(pw[j][h], part, plane, q0, s0, mp.chunk0, TT, j, h, warp, lane);
      }
    }
    hw::cp_async_wait<stages - 1>();
    __syncthreads();
    float dpp[kKeyN8][4], sc[kKeyN8][4];
    qk_tile<T>(dpp, obuf + stage * kTileRows * ldv, vbuf + stage * kTileKeys * ldv, ldv, mp.dv_pad, warp, lane, 1.f);
    if (Pre)
      qk_tile<T>(sc, qbuf + stage * kTileRows * ldq, kbuf + stage * kTileKeys * ldq, ldq, mp.dh_pad, warp, lane,
                 p.scale);
    const float* rows = rowf + stage * kQuerySide * kRowPitch;
    const float* cols = colf + stage * kKeySide * kColPitch;
HW_UNROLL
    for (int j = 0; j < kKeyN8; ++j)
HW_UNROLL
      for (int h = 0; h < 2; ++h) {
        const int r = warp * 16 + gq + 8 * h, t = q0 + r, c = j * 8 + 2 * tq, s = s0 + c;
        const SmemSide qs{rows + r, kRowPitch};
        if constexpr (Pre && !kHoldWords)
          load_fragment_words<kPreWords>(pw[j][h], part, plane, q0, s0, mp.chunk0, TT, j, h, warp, lane);
HW_UNROLL
        for (int e2 = 0; e2 < 2; ++e2) {
          const int e = 2 * h + e2;
          const SmemSide ks{cols + c + e2, kColPitch};
          const bool kept = t < TT && kept_pair(t, s + e2, TT, p.causal, p.window);
          float y;
          if (Pre) {
            float pt[kBwdPartFields];
            unpack_part_column<T, kPreWords>(pw[j][h], e2, kept, pt);
            const float P = bwd_prob(sc[j][e], qs, ks, pt, kept);
            y = P * (bwd_grad_prob(dpp[j][e], qs, ks, pt) - qs[kStatD]);  // dL'
HW_UNROLL
            for (int rr = 0; rr < kR; ++rr) {
              sq[rr][j][e] += qs[kW2Pre + rr] * y;
              sk[rr][j][e] += ks[kW2Pre + rr] * y;
            }
          } else {
            y = kept ? dpp[j][e] : 0.f;
HW_UNROLL
            for (int rr = 0; rr < kR; ++rr) {
              sq[rr][j][e] += qs[kW2Post + rr] * y;
              sk[rr][j][e] += ks[kW2Post + rr] * y;
            }
          }
        }
      }
    if (n == hg - 1) {
      // The tile's 2 rank sums (both ranks a word) to the scratch planes of dc dd
      // (Pre = false) or da db.
      PartWordOf<T>* planes = part + (Pre ? kPartDA : kPartDC) / 2 * plane;
HW_UNROLL
      for (int j = 0; j < kKeyN8; ++j)
HW_UNROLL
        for (int h = 0; h < 2; ++h) {
          const int r = warp * 16 + gq + 8 * h, t = q0 + r, s = s0 + j * 8 + 2 * tq;
          if (t >= TT || s >= TT) continue;
          const bool pair = s + 1 < TT && TT % 2 == 0, second = s + 1 < TT;
          PartWordOf<T>* dst = planes + static_cast<int64_t>(t - mp.chunk0) * TT + s;
          store_part_words(dst, pack_part<T>(sq[0][j][2 * h], sq[1][j][2 * h]),
                           pack_part<T>(sq[0][j][2 * h + 1], sq[1][j][2 * h + 1]), pair, second);
          store_part_words(dst + plane, pack_part<T>(sk[0][j][2 * h], sk[1][j][2 * h]),
                           pack_part<T>(sk[0][j][2 * h + 1], sk[1][j][2 * h + 1]), pair, second);
        }
    }
  }
  hw::cp_async_wait<0>();
}

// Launches 3 (Dq = false: D, slot-2 grads, per key split) and 5 (Dq = true: dq, slot-0
// grads): CTA per (Heads heads m0.., [key split,] query tile of the chunk, b), heads fastest
// in the grid (the group's heads of a tile read the same scratch words: run together, they
// read them from HBM once, then from L2). DTiles bounds dh_pad / 8. Heads = 2 (launch 3
// where the group's size is even): the CTA's two heads share the scratch words of each
// (t, s), loaded once per key tile and kept in registers for the second head (the scratch
// reads, 20 B per (t, s) and head at one head a CTA, bound launch 3 by L2); its items (key
// tile, head) are double-buffered, the two heads' Q and dO resident.
template <typename T, bool Dq, int DTiles, int Heads>
__global__ void __launch_bounds__(kMmaThreads) dcmha_attn_bwd_rows(const MmaAttnBwdParams bp) {
  static_assert(Heads == 1 || (Heads == 2 && !Dq), "two heads a CTA in launch 3 only (dq holds a dq tile a head)");
  const MmaAttnParams& mp = bp.m;
  const AttnParams& p = mp.f;
  const int H = p.H, TT = p.T, hg = p.hg, m0 = static_cast<int>(blockIdx.x) * Heads, b = blockIdx.z;
  const int bg = b * (H / hg) + m0 / hg;
  // Dq = false: blockIdx.y = split + kRowsumKeySplits * query tile (the splits of a tile adjacent).
  const int split = Dq ? 0 : static_cast<int>(blockIdx.y % kRowsumKeySplits);
  const int q0 = mp.chunk0 + static_cast<int>(Dq ? blockIdx.y : blockIdx.y / kRowsumKeySplits) * kTileRows;
  if (q0 >= TT) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gq = lane / 4, tq = lane % 4;
  const int ldq = tile_pitch(mp.dh_pad, sizeof(T)), ldv = tile_pitch(mp.dv_pad, sizeof(T)), dh_n8 = mp.dh_pad / 8;
  auto head_of = [&](int u) { return static_cast<int64_t>(b) * H + m0 + u; };

  unsigned char* base = hw::dynamic_shared_memory();
  T* qs = reinterpret_cast<T*>(base);            // [Heads][64][ldq] Q, then (Dq) the dq tile
  T* os = qs + Heads * kTileRows * ldq;           // [Heads][64][ldv] dO
  T* kbuf = os + Heads * kTileRows * ldv;         // [2][32][ldq]
  T* vbuf = kbuf + 2 * kTileKeys * ldq;           // [2][32][ldv]
  float* colf = reinterpret_cast<float*>(vbuf + 2 * kTileKeys * ldv);  // [2][10][33]

  const PartWordOf<T>* part = part_words<T>(mp.partials) + static_cast<int64_t>(bg) * mp.pwords * mp.chunk * TT;
  const int64_t plane = static_cast<int64_t>(mp.chunk) * TT;

  // The query side of this thread's two rows per head (D only once launch 3 has written it).
  float rq[Heads][2][kQuerySide];
HW_UNROLL
  for (int u = 0; u < Heads; ++u)
HW_UNROLL
    for (int h = 0; h < 2; ++h) {
      const int t = q0 + warp * 16 + gq + 8 * h;
      const float* wt_head = mp.wt + head_of(u) * mp.wfields * TT;
HW_UNROLL
      for (int f = 0; f < kQuerySide; ++f)
        rq[u][h][f] =
            t < TT && (Dq || f != kStatD) ? wt_head[static_cast<int64_t>(side_wfield(f, false)) * TT + t] : 0.f;
    }

  int lo, hi;
  key_band(q0, kTileRows, TT, p.causal, p.window, lo, hi);
  const int band_lo = lo / kTileKeys, band_tiles = (hi + kTileKeys - 1) / kTileKeys - band_lo;
  // Dq = false: the split's run of the band's key tiles (empty runs store zeros).
  const int kt_lo = Dq ? band_lo : band_lo + band_tiles * split / kRowsumKeySplits;
  const int n_tiles = Dq ? band_tiles : band_lo + band_tiles * (split + 1) / kRowsumKeySplits - kt_lo;

HW_UNROLL
  for (int u = 0; u < Heads; ++u) {
    load_rows(qs + u * kTileRows * ldq, static_cast<const T*>(p.q) + head_of(u) * TT * p.dh, q0, kTileRows, TT, p.dh,
              mp.dh_pad, mp.vec16);
    load_rows(os + u * kTileRows * ldv, static_cast<const T*>(bp.dout) + head_of(u) * TT * p.dv, q0, kTileRows, TT,
              p.dv, mp.dv_pad, mp.vec16);
  }
  // Item = (key tile i, head u): head u's K and V tiles and key sides, one commit group.
  const int n_items = n_tiles * Heads;
  auto issue = [&](int item) {
    if (item < n_items) {
      const int s0 = (kt_lo + item / Heads) * kTileKeys, stage = item & 1;
      const int64_t head = head_of(item % Heads);
      load_rows(kbuf + stage * kTileKeys * ldq, static_cast<const T*>(p.k) + head * TT * p.dh, s0, kTileKeys, TT,
                p.dh, mp.dh_pad, mp.vec16);
      load_rows(vbuf + stage * kTileKeys * ldv, static_cast<const T*>(p.v) + head * TT * p.dv, s0, kTileKeys, TT,
                p.dv, mp.dv_pad, mp.vec16);
      load_side_fields(colf + stage * kKeySide * kColPitch, mp.wt + head * mp.wfields * TT, s0, kTileKeys, kColPitch,
                       TT, 0x3ffu, kKeySide, true);
    }
    hw::cp_async_commit();
  };

  float o[DTiles][4];
  zero_tile(o);
  float acc[Heads][2][6];  // per head and row: the slot's 5 grads, then D (Dq = false)
HW_UNROLL
  for (int u = 0; u < Heads; ++u) zero_tile(acc[u]);

  constexpr unsigned kMask = Dq ? part_bits(kPartA) | part_bits(kPartB) | part_bits(kPartDC) | part_bits(kPartDD) |
                                      part_bits(kPartDA) | part_bits(kPartDB)
                                : part_bits(kPartA) | part_bits(kPartB) | part_bits(kPartC) | part_bits(kPartDC) |
                                      part_bits(kPartDD);
  // The key tile's words of the warp's fragment: Heads = 2 loads a, b, dc, dd at the tile's
  // first head and keeps them for the second (64 registers), and c, which only the dW2 grads
  // read, per head where it is used (holding it too spilled on sm_80); Heads = 1 loads every
  // word of an n8 tile's half where it uses it (dq's registers hold its dq tile).
  constexpr unsigned kHeld = Heads > 1 ? kMask & ~part_bits(kPartC) : 0u, kPerHead = kMask & ~kHeld;
  PartWordOf<T> pw[kKeyN8][2][kBwdPartWords][2] = {};
  issue(0);
  for (int i = 0; i < n_tiles; ++i) {
    const int s0 = (kt_lo + i) * kTileKeys;
HW_UNROLL
    for (int u = 0; u < Heads; ++u) {
      const int item = i * Heads + u, stage = item & 1;
      __syncthreads();
      issue(item + 1);
      if (Heads > 1 && u == 0) {
HW_UNROLL
        for (int j = 0; j < kKeyN8; ++j)
HW_UNROLL
          for (int h = 0; h < 2; ++h)
            load_fragment_words<kHeld>(pw[j][h], part, plane, q0, s0, mp.chunk0, TT, j, h, warp, lane);
      }
      hw::cp_async_wait<1>();
      __syncthreads();
      float sc[kKeyN8][4], dpp[kKeyN8][4];
      qk_tile<T>(sc, qs + u * kTileRows * ldq, kbuf + stage * kTileKeys * ldq, ldq, mp.dh_pad, warp, lane, p.scale);
      qk_tile<T>(dpp, os + u * kTileRows * ldv, vbuf + stage * kTileKeys * ldv, ldv, mp.dv_pad, warp, lane, 1.f);
      const float* cols = colf + stage * kKeySide * kColPitch;
HW_UNROLL
      for (int j = 0; j < kKeyN8; ++j)
HW_UNROLL
        for (int h = 0; h < 2; ++h) {
          const int t = q0 + warp * 16 + gq + 8 * h, c = j * 8 + 2 * tq, s = s0 + c;
          load_fragment_words<kPerHead>(pw[j][h], part, plane, q0, s0, mp.chunk0, TT, j, h, warp, lane);
HW_UNROLL
          for (int e2 = 0; e2 < 2; ++e2) {
            const int e = 2 * h + e2;
            const SmemSide ks{cols + c + e2, kColPitch};
            const bool kept = t < TT && kept_pair(t, s + e2, TT, p.causal, p.window);
            float pt[kBwdPartFields];
            unpack_part_column<T, kMask>(pw[j][h], e2, kept, pt);
            const float S = sc[j][e];
            const float P = bwd_prob(S, rq[u][h], ks, pt, kept);
            const float dP = bwd_grad_prob(dpp[j][e], rq[u][h], ks, pt);
            if (Dq) {
              const float dLp = P * (dP - rq[u][h][kStatD]);
              add_slot_grads(acc[u][h], S, dLp, pt + kPartDA, pt + kPartA);
              sc[j][e] = kept ? bwd_grad_logit(dLp, rq[u][h], ks, pt) * p.scale : 0.f;
            } else {
              acc[u][h][5] += P * dP;
              add_slot_grads(acc[u][h], P, kept ? dpp[j][e] : 0.f, pt + kPartDC, pt + kPartC);
            }
          }
        }
      // dq += (scale dL) K: K by ldmatrix.trans (fp32: scalar loads, fragment_times_rows).
      if (Dq) fragment_times_rows<T>(o, sc, kbuf + stage * kTileKeys * ldq, ldq, dh_n8, lane);
    }
  }
  hw::cp_async_wait<0>();
HW_UNROLL
  for (int u = 0; u < Heads; ++u)
HW_UNROLL
    for (int h = 0; h < 2; ++h) {
HW_UNROLL
      for (int f = 0; f < (Dq ? 5 : 6); ++f) acc[u][h][f] = quad_sum(acc[u][h][f]);
      const int t = q0 + warp * 16 + gq + 8 * h;
      if (tq == 0 && t < TT) {
        if (Dq) {
          put_slot_grads<false>(bp, head_of(u), t, 0, acc[u][h]);
        } else {
          float* dst = rowsum_parts_of(bp, head_of(u), split) + (t - mp.chunk0);
HW_UNROLL
          for (int f = 0; f < kRowsumFields; ++f) dst[f * bp.rowsum_pitch] = acc[u][h][f];
        }
      }
    }
  if (Dq) {
    __syncthreads();  // every warp is done with qs: it takes the dq tile
    store_row_tile<T>(o, qs, ldq, dh_n8, static_cast<T*>(bp.dq) + head_of(0) * TT * p.dh, q0, TT, p.dh, mp.vec16,
                      warp, lane);
  }
}

// Launch 3's combine: a thread per (row t of the chunk, head m = blockIdx.y, b = blockIdx.z)
// adds the row's kRowsumKeySplits sums in split order (bitwise repeatable, no atomics) and
// stores D in the weights table, the slot-2 grads in the grads table. Consecutive threads
// take consecutive rows: every load and store is a warp's 32 consecutive floats.
__global__ void __launch_bounds__(kMmaThreads) dcmha_attn_bwd_rowsum_combine(const MmaAttnBwdParams bp) {
  const MmaAttnParams& mp = bp.m;
  const int r = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x), t = mp.chunk0 + r;
  if (r >= mp.chunk || t >= mp.f.T) return;
  const int64_t head = static_cast<int64_t>(blockIdx.z) * mp.f.H + blockIdx.y;
  float acc[kRowsumFields];
HW_UNROLL
  for (int i = 0; i < kRowsumFields; ++i) acc[i] = rowsum_parts_of(bp, head, 0)[i * bp.rowsum_pitch + r];
HW_UNROLL
  for (int split = 1; split < kRowsumKeySplits; ++split) {
    const float* src = rowsum_parts_of(bp, head, split) + r;
HW_UNROLL
    for (int i = 0; i < kRowsumFields; ++i) acc[i] += src[i * bp.rowsum_pitch];
  }
  put_slot_grads<false>(bp, head, t, 2, acc);
  bp.wt[(head * mp.wfields + kFieldD) * mp.f.T + t] = acc[5];
}

// Launch 6: CTA per (head m, 64-key tile of the chunk's key band, b), kKeyWarps warps,
// looping the chunk's 32-row query tiles that read its keys. Heads are fastest in the grid:
// the group's heads of a key tile read the same scratch words (32 B per (t, s), four times
// the bytes of its query side), so they run together and the words come from HBM once,
// then from L2; a grid with key tiles fastest would run a tile's heads 64 CTAs apart at
// T = 4096, with the chunk's whole scratch (64 MiB a b at 512 rows) between them. Rows of
// the fragments are keys s, columns queries t. Per query tile, warp w (key slab ks = w % 4: keys 16 ks..;
// half hf = w / 4):
//   1. S^T = K Q^T and dP'^T = V dO^T of its 16 keys x the 16 queries 16 hf.. on mma;
//   2. on the fragments: P, P' (-> dv), dL' and dL (-> dk), the slot-3 (P, dP') and slot-1
//      (S, dL') grads of its keys, summed over its queries;
//   3. P'^T and (scale dL)^T to smem [64][kGradPitch] (T, rounded as the A operands), a barrier;
//   4. dv += P'^T dO and dk += (scale dL)^T Q over the tile's 32 queries, for its keys and
//      the n8 tiles of half hf of dv and of dk (A by ldmatrix from step 3's tiles, B by
//      ldmatrix.trans).
// So every product is made once per (t, s): 4 here where separate dv and dk kernels made 6
// (S^T and dP'^T twice), and the scratch and the query side are read once. The A operands
// are the values and layout the fragments would have packed: dv and dk are the bits of
// packing them in registers. The slot grads of a key add the two halves' quad sums (half 0
// first) after the loop: a fixed order.
// Registers: dv, dk accumulators of 16 keys x half the columns (2 x DTiles x 4) and the two
// 16 x 16 score fragments (16); a thread's 20 slot grads wait in its own smem row between
// query tiles. The side weights of an n8 tile's elements (2 query columns x 13 fields, 2
// key rows x 10) come from smem records by 16-byte loads, 14 per tile where scalar reads
// of [field][position] tables took 46. DTiles bounds half of max(dh_pad, dv_pad) / 8
// (key_half_n8). 225-241 registers (1 CTA of 8 warps per SM), no spill (bench/ptxas_sm*.txt).

// The n8 tiles [first, first + count) of half hf of a d_pad-wide product: half 0 takes the
// even number at or above n8 / 2, so that each half's tiles go in pairs.
__host__ __device__ inline int key_half_first(int n8, int hf) { return hf == 0 ? 0 : (n8 / 2 + 1) / 2 * 2; }
__host__ __device__ inline int key_half_n8(int n8, int hf) {
  return hf == 0 ? key_half_first(n8, 1) : n8 - key_half_first(n8, 1);
}

template <typename T, int DTiles, int Stages = kBufferStages>
__global__ void __launch_bounds__(kKeyThreads) dcmha_attn_bwd_keys(const MmaAttnBwdParams bp) {
  const MmaAttnParams& mp = bp.m;
  const AttnParams& p = mp.f;
  const int H = p.H, TT = p.T, hg = p.hg, m = blockIdx.x, b = blockIdx.z;
  const int bg = b * (H / hg) + m / hg;
  const int s0 = (bp.key_tile0 + blockIdx.y) * kTileRows;
  // Query rows reading keys [s0, s0 + 64): [lo_all, hi_all), causal t >= s0, window
  // t < s0 + 63 + W; this chunk's share of them, [lo, hi).
  const int lo_all = p.causal ? s0 : 0;
  const int hi_all = p.window > 0 && s0 + kTileRows - 1 + p.window < TT ? s0 + kTileRows - 1 + p.window : TT;
  const int c1 = mp.chunk0 + mp.chunk < TT ? mp.chunk0 + mp.chunk : TT;
  const int lo = lo_all > mp.chunk0 ? lo_all : mp.chunk0, hi = hi_all < c1 ? hi_all : c1;
  if (s0 >= TT || lo >= hi) return;
  // The chunks run in order: the first that reads the tile holds lo_all, the last hi_all - 1.
  const bool first_chunk = lo_all >= mp.chunk0, last_chunk = hi_all <= c1;
  const int t_lo = lo / kQueryTileCols * kQueryTileCols;
  const int n_tiles = (hi - t_lo + kQueryTileCols - 1) / kQueryTileCols;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gq = lane / 4, tq = lane % 4;
  const int slab = warp % 4, hf = warp / 4;
  const int ldq = tile_pitch(mp.dh_pad, sizeof(T)), ldv = tile_pitch(mp.dv_pad, sizeof(T));
  const int dk0 = key_half_first(mp.dh_pad / 8, hf), dk8 = key_half_n8(mp.dh_pad / 8, hf);
  const int dv0 = key_half_first(mp.dv_pad / 8, hf), dv8 = key_half_n8(mp.dv_pad / 8, hf);
  const int64_t head = static_cast<int64_t>(b) * H + m;

  static_assert(Stages == 1 || Stages == 2, "one or two buffers of the streamed tiles");
  constexpr int stages = Stages;  // buffers of the query tiles (2, or 1 where two do not fit)
  unsigned char* base = hw::dynamic_shared_memory();
  T* ks = reinterpret_cast<T*>(base);            // [64][ldq] K
  T* vs = ks + kTileRows * ldq;                   // [64][ldv] V
  T* qbuf = vs + kTileRows * ldv;                 // [stages][32][ldq] Q
  T* obuf = qbuf + stages * kQueryTileCols * ldq;  // [stages][32][ldv] dO
  T* ppt = obuf + stages * kQueryTileCols * ldv;  // [64][kGradPitch] P'^T
  T* dlt = ppt + kTileRows * kGradPitch;          // [64][kGradPitch] (scale dL)^T
  // [kKeyThreads][kKeySlotGrads] (16-byte aligned rows): each thread's running slot grads
  float* own_block = reinterpret_cast<float*>(dlt + kTileRows * kGradPitch);
  float* colf = own_block + kKeyThreads * kKeySlotGrads;  // [stages][32][kQueryRecord] the query tiles' side records
  float* rowk = colf + stages * kQueryTileCols * kQueryRecord;  // [64][kKeyRecord] those of the CTA's keys
  float* half1 = rowk + kTileRows * kKeyRecord;           // [64][10] half 1's slot grads of each key
  float* own = own_block + threadIdx.x * kKeySlotGrads;

  const T* q = static_cast<const T*>(p.q) + head * TT * p.dh;
  const T* dout = static_cast<const T*>(bp.dout) + head * TT * p.dv;
  const float* wt_head = mp.wt + head * mp.wfields * TT;
  const PartWordOf<T>* part = part_words<T>(mp.partials) + static_cast<int64_t>(bg) * mp.pwords * mp.chunk * TT;
  const int64_t plane = static_cast<int64_t>(mp.chunk) * TT;

  // The key side in smem (its 10 fields a row would take 20 registers through the kernel);
  // joins the first tile's commit group.
  load_side_records(rowk, wt_head, s0, kTileRows, kKeyRecord, TT, 0x3ffu, kKeySide, true);
  load_rows(ks, static_cast<const T*>(p.k) + head * TT * p.dh, s0, kTileRows, TT, p.dh, mp.dh_pad, mp.vec16);
  load_rows(vs, static_cast<const T*>(p.v) + head * TT * p.dv, s0, kTileRows, TT, p.dv, mp.dv_pad, mp.vec16);
  auto issue = [&](int i) {
    if (i < n_tiles) {
      const int t0 = t_lo + i * kQueryTileCols, stage = i & (stages - 1);
      load_rows(qbuf + stage * kQueryTileCols * ldq, q, t0, kQueryTileCols, TT, p.dh, mp.dh_pad, mp.vec16);
      load_rows(obuf + stage * kQueryTileCols * ldv, dout, t0, kQueryTileCols, TT, p.dv, mp.dv_pad, mp.vec16);
      load_side_records(colf + stage * kQueryTileCols * kQueryRecord, wt_head, t0, kQueryTileCols, kQueryRecord, TT,
                        0x1fffu, kQuerySide, false);
    }
    hw::cp_async_commit();
  };

  float odv[DTiles][4], odk[DTiles][4];
  zero_tile(odv);
  zero_tile(odk);
  // The thread's running grads per row (key) h: acc[h][0..4] slot 1's, acc[h][5..9] slot
  // 3's (add_slot_grads' order). In its smem row between query tiles, so that no register
  // holds them through the products.
  static_assert(kKeySlotGrads == 2 * 10, "two rows of two slots' 5 grads");
  auto slot_grads = [&](float (&acc)[2][10], bool store) {
HW_UNROLL
    for (int v = 0; v < kKeySlotGrads; v += 4) {
      float x[4];
      if (store) {
HW_UNROLL
        for (int u = 0; u < 4; ++u) x[u] = acc[(v + u) / 10][(v + u) % 10];
        hw::store_from_float<4>(own + v, x);
      } else {
        hw::load_as_float<4>(own + v, x);
HW_UNROLL
        for (int u = 0; u < 4; ++u) acc[(v + u) / 10][(v + u) % 10] = x[u];
      }
    }
  };
  {
    float acc[2][10];
    zero_tile(acc);
    slot_grads(acc, true);
  }

  constexpr unsigned kMask = part_bits(kPartA) | part_bits(kPartB) | part_bits(kPartC) | part_bits(kPartD) |
                             part_bits(kPartDC) | part_bits(kPartDD) | part_bits(kPartDA) | part_bits(kPartDB);
  // Two stages: tile i + 1 loads while tile i is used; one: tile i loads after tile i - 1's
  // products (the K, V tiles and key records join tile 0's group either way).
  if constexpr (stages == 2) issue(0);
  for (int i = 0; i < n_tiles; ++i) {
    const int stage = i & (stages - 1), t0 = t_lo + i * kQueryTileCols;
    __syncthreads();  // every warp is done with tile i - 1: its stage and the P'^T, dL^T tiles
    issue(stages == 2 ? i + 1 : i);
    hw::cp_async_wait<stages - 1>();
    __syncthreads();
    const T* qt = qbuf + stage * kQueryTileCols * ldq;
    const T* ot = obuf + stage * kQueryTileCols * ldv;
    const int c_half = hf * 16;
    float sc[kKeyHalfN8][4], dpp[kKeyHalfN8][4];
    qk_tile<T>(sc, ks, qt + c_half * ldq, ldq, mp.dh_pad, slab, lane, p.scale);  // S^T: rows s, columns t
    qk_tile<T>(dpp, vs, ot + c_half * ldv, ldv, mp.dv_pad, slab, lane, 1.f);     // dP'^T = V dO^T
    const float* cols = colf + stage * kQueryTileCols * kQueryRecord;
    float acc[2][10];
    slot_grads(acc, false);
    // One n8 tile of the fragments at a time, in a loop that is not unrolled: unrolled,
    // ptxas issued both tiles' loads together (8 elements x 16 scratch fields, and their
    // side values) and spilled at the 255-register cap. The tile's P' and scale dL go to
    // the smem tiles as the A operands of the products, at (key r, query c): what the
    // fragments would pack.
    static_assert(kKeyHalfN8 == 2, "the element loop selects one of two n8 tiles");
HW_NO_UNROLL
    for (int j = 0; j < kKeyHalfN8; ++j) {
      // The side records of the tile's elements: its 2 query columns (e & 1) and its 2 key
      // rows (e >> 1), each read once.
      float qside[2][kQuerySide], kside[2][kKeySide];
HW_UNROLL
      for (int u = 0; u < 2; ++u) {
        load_side_record(qside[u], cols + (c_half + j * 8 + 2 * tq + u) * kQueryRecord);
        load_side_record(kside[u], rowk + (slab * 16 + gq + 8 * u) * kKeyRecord);
      }
      float pp[4], dl[4];
HW_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int h = e >> 1, r = slab * 16 + gq + 8 * h, c = c_half + j * 8 + 2 * tq + (e & 1);
        const int s = s0 + r, t = t0 + c;
        const bool in = t < TT && s < TT && t >= mp.chunk0 && t < c1;
        const bool kept = in && kept_pair(t, s, TT, p.causal, p.window);
        float pt[kBwdPartFields] = {};
        // Every in-range lane loads (whole 32-byte rows of s per request), then only kept
        // pairs keep their values: the scratch (zeroed once) holds this chunk's values for
        // each 64-row query tile's key band only, elsewhere older ones; masked pairs add 0.
        load_part_one<T, kMask>(pt, part, plane, static_cast<int64_t>(t - mp.chunk0) * TT + s, in);
HW_UNROLL
        for (int f = 0; f < kBwdPartFields; ++f) pt[f] = kept ? pt[f] : 0.f;
        const float(&qs)[kQuerySide] = qside[e & 1];
        const float(&ks)[kKeySide] = kside[h];
        const float S = j == 0 ? sc[0][e] : sc[1][e];
        const float P = bwd_prob(S, qs, ks, pt, kept);
        const float dPp = kept ? (j == 0 ? dpp[0][e] : dpp[1][e]) : 0.f;
        const float dLp = P * (bwd_grad_prob(dPp, qs, ks, pt) - qs[kStatD]);
        add_slot_grads(acc[h] + 5, P, dPp, pt + kPartDD, pt + kPartD);  // slot 3
        add_slot_grads(acc[h], S, dLp, pt + kPartDB, pt + kPartB);      // slot 1
        pp[e] = bwd_post_prob(P, qs, ks, pt, kept);                   // P'
        dl[e] = kept ? bwd_grad_logit(dLp, qs, ks, pt) * p.scale : 0.f;  // scale dL
      }
HW_UNROLL
      for (int h = 0; h < 2; ++h) {
        const int at = (slab * 16 + gq + 8 * h) * kGradPitch + c_half + j * 8 + 2 * tq;
        if constexpr (std::is_same<T, float>::value) {  // one 8-byte store each (conflict-free at pitch 40)
          hw::Pack<float, 2> x, y;
          x.v[0] = pp[2 * h];
          x.v[1] = pp[2 * h + 1];
          y.v[0] = dl[2 * h];
          y.v[1] = dl[2 * h + 1];
          hw::store_pack<float, 2>(ppt + at, x);
          hw::store_pack<float, 2>(dlt + at, y);
        } else {
          *reinterpret_cast<uint32_t*>(ppt + at) = pack2<T>(pp[2 * h], pp[2 * h + 1]);
          *reinterpret_cast<uint32_t*>(dlt + at) = pack2<T>(dl[2 * h], dl[2 * h + 1]);
        }
      }
    }
    slot_grads(acc, true);
    __syncthreads();
    // dv += P'^T dO, dk += (scale dL)^T Q over the 32 queries: the slab's A rows by
    // ldmatrix, the query rows by ldmatrix.trans, half hf's n8 tiles. fp32: k8 steps in the
    // pair order of tf32_pair_step, A as (a0, a2) and (a1, a3) 8-byte loads of the rows g and
    // g + 8 (2 tq, 2 tq + 1 of the step: conflict-free at kGradPitch = 40 words).
    if constexpr (std::is_same<T, float>::value) {
HW_NO_UNROLL
      for (int kk = 0; kk < kQueryTileCols / 8; ++kk) {
        const int a_at = (slab * 16 + gq) * kGradPitch + kk * 8 + 2 * tq;
        uint32_t fa[4];
        tf32_pair_a(fa, ppt + a_at, 8 * kGradPitch);  // a loop (not unrolled): unrolled, 8 B spilled on sm_90
        tf32_pair_step(odv, fa, ot + kk * 8 * ldv + dv0 * 8, ldv, dv8, lane);
        tf32_pair_a(fa, dlt + a_at, 8 * kGradPitch);
        tf32_pair_step(odk, fa, qt + kk * 8 * ldq + dk0 * 8, ldq, dk8, lane);
      }
    } else {
      const int quad = lane / 8, rq8 = lane % 8;
HW_UNROLL
      for (int kk = 0; kk < kQueryTileCols / 16; ++kk) {
        const int a_at = (slab * 16 + (quad & 1) * 8 + rq8) * kGradPitch + kk * 16 + (quad >> 1) * 8;
        uint32_t fa[4];
        hw::ldmatrix<4>(fa, ppt + a_at);
        a_times_rows_k16<T>(odv, fa, ot + kk * 16 * ldv + dv0 * 8, ldv, dv8, lane);
        hw::ldmatrix<4>(fa, dlt + a_at);
        a_times_rows_k16<T>(odk, fa, qt + kk * 16 * ldq + dk0 * 8, ldq, dk8, lane);
      }
    }
  }
  hw::cp_async_wait<0>();
  // The fp32 sums of the dk / dv rows at this thread's fragment elements (pairs: a row's 32
  // bytes a request): add, o = sums + o (the shares of the chunks before this one); else
  // sums = o.
  auto sum_rows = [&](float (&o)[DTiles][4], float* sums, int d, int j0, int n8, bool add) {
HW_UNROLL
    for (int j = 0; j < DTiles; ++j) {
      if (j >= n8) break;
HW_UNROLL
      for (int h = 0; h < 2; ++h) {
        const int s = s0 + slab * 16 + gq + 8 * h, c = (j0 + j) * 8 + 2 * tq;
        if (s >= TT) continue;
        const int64_t at = static_cast<int64_t>(s) * d + c;
        if (d % 2 == 0 && c < d) {  // 8-byte accesses (rows of even length start 8-byte aligned)
          float pair[2] = {o[j][2 * h], o[j][2 * h + 1]};
          if (add) {
            hw::load_as_float<2>(sums + at, pair);
            o[j][2 * h] = pair[0] + o[j][2 * h];
            o[j][2 * h + 1] = pair[1] + o[j][2 * h + 1];
          } else {
            hw::store_from_float<2>(sums + at, pair);
          }
        } else {
HW_UNROLL
          for (int e = 0; e < 2; ++e) {
            if (c + e >= d) continue;
            if (add) o[j][2 * h + e] = sums[at + e] + o[j][2 * h + e];
            else sums[at + e] = o[j][2 * h + e];
          }
        }
      }
    }
  };
  float* dk_sums = bp.dk + head * TT * p.dh;
  float* dv_sums = bp.dv + head * TT * p.dv;
  if (!first_chunk) {
    sum_rows(odv, dv_sums, p.dv, dv0, dv8, true);
    sum_rows(odk, dk_sums, p.dh, dk0, dk8, true);
  }
  if (last_chunk) {
    // dk, dv in T as whole rows through the K and V tiles' smem (16-byte chunks; stored from
    // the fragments, a row's 16 bytes a request would take a 32-byte sector each).
    __syncthreads();  // every warp is done with the K and V tiles
    stage_fragment_rows<T>(odk, ks, ldq, slab * 16, dk0, dk8, lane);
    stage_fragment_rows<T>(odv, vs, ldv, slab * 16, dv0, dv8, lane);
    __syncthreads();
    const int rows = TT - s0 < kTileRows ? TT - s0 : kTileRows;
    store_staged_rows<T>(ks, ldq, static_cast<T*>(bp.dk_out) + head * TT * p.dh, s0, rows, p.dh, mp.vec16);
    store_staged_rows<T>(vs, ldv, static_cast<T*>(bp.dv_out) + head * TT * p.dv, s0, rows, p.dv, mp.vec16);
  } else {
    sum_rows(odv, dv_sums, p.dv, dv0, dv8, false);
    sum_rows(odk, dk_sums, p.dh, dk0, dk8, false);
  }
  // The key-slot grads: each half's quad sums, half 1's through smem, added to half 0's.
  float acc[2][10];
  slot_grads(acc, false);
HW_UNROLL
  for (int h = 0; h < 2; ++h)
HW_UNROLL
    for (int i = 0; i < 10; ++i) acc[h][i] = quad_sum(acc[h][i]);
  if (hf == 1 && tq == 0) {
HW_UNROLL
    for (int h = 0; h < 2; ++h) {
      float* x = half1 + (slab * 16 + gq + 8 * h) * (kKeySlotGrads / 2);
HW_UNROLL
      for (int i = 0; i < 10; ++i) x[i] = acc[h][i];
    }
  }
  __syncthreads();
  if (hf == 0 && tq == 0) {
HW_UNROLL
    for (int h = 0; h < 2; ++h) {
      const int r = slab * 16 + gq + 8 * h, s = s0 + r;
      if (s >= TT) continue;
      const float* x = half1 + r * (kKeySlotGrads / 2);
HW_UNROLL
      for (int i = 0; i < 10; ++i) acc[h][i] += x[i];
      put_slot_grads<true>(bp, head, s, 1, acc[h]);
      put_slot_grads<true>(bp, head, s, 3, acc[h] + 5);
    }
  }
}

}  // namespace dcmha
}  // namespace headwise
