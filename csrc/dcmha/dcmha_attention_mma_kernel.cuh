// DCMHA fused attention forward on tensor cores (SPEC section 5), bf16 / fp16 inputs with
// fp32 accumulation, and fp32 inputs as TF32 where torch's float32 matmul precision allows
// TF32 (below). fp32 at full precision keeps the SIMT kernel of dcmha_attention_kernel.cuh.
//
// Math, per batch b, head group (hg heads), query row t, key s, head n of the group
// (S_n = scale q_n[t] . k_n[s]; slot c of the weights: 0 pre-q, 1 pre-k, 2 post-q, 3 post-k):
//   pre partials   a_r = sum_n W1[t,0,r,n] S_n        b_r = sum_n W1[s,1,r,n] S_n      (r < 2)
//   logits         L_n = S_n (1 + G[t,0,n] + G[s,1,n]) + sum_r W2[t,0,r,n] a_r + W2[s,1,r,n] b_r
//   probabilities  P_n = exp(L_n - M_n[t]) / Z_n[t] on kept (t, s), 0 on masked ones
//   post partials  c_r = sum_n W1[t,2,r,n] P_n        d_r = sum_n W1[s,3,r,n] P_n
//   output         O_m[t] = sum_s (P_m (1 + G[t,2,m] + G[s,3,m]) + sum_r W2[t,2,r,m] c_r
//                                   + W2[s,3,r,m] d_r) v_m[s]
// The heads of a group meet only through the 8 rank partials (a, b, c, d) of each (t, s).
//
// Design: the kernels below, every T x S x d product on mma.sync m16n8k16 (m16n8k8 .tf32 for
// fp32; ldmatrix operands from padded shared memory filled by cp.async), 64 query rows x
// 32 keys per CTA tile,
// 4 warps of 16 query rows each; scores live only in the accumulator fragments, and the
// compose runs on those fragments (the accumulator element (row g + 8 (e >> 1), col
// 2 (lane % 4) + (e & 1)) of n8 tile j is (t, s); the row and column weights it needs are
// in shared memory).
//   0. dcmha_attn_weights_t: the weights transposed to head-major [B, H, 20, T] fp32
//      (fields 0-7 W1[c][r], 8-15 W2[c][r], 16-19 G[c]): O(B H T), so that every later
//      weight read is a contiguous run along t or s (coalesced).
//   1. dcmha_attn_stats: CTA per (64-key split, 64-row query tile, b * group), looping
//      the key tiles of the band within the split; per key tile two sweeps over the
//      group's heads (each head: Q_n and K_n tiles and the row and column weights the
//      sweep reads, one cp.async group, double-buffered across heads): sweep A accumulates
//      a_r, b_r in registers and, complete, rounds them to the scratch's words and stores
//      them (words 0-1 of the chunk's scratch); sweep B recomputes S_n, forms L_n from the
//      rounded a, b and updates the online row max M_n and sum Z_n (shared memory, one
//      warp owns its 16 rows: no cross-warp reduction). Writes the split's (M, Z) to
//      split_stats [splits, 2, B H, chunk]. The split bounds a CTA's work by 2 key tiles:
//      unsplit, a causal CTA's work grows with its query tile, and the longest CTAs set
//      the kernel's time; small splits also fill the GPU in a causal band's early chunks.
//   1b. dcmha_attn_stats_combine: thread per (row, b, head): M = max_i M_i,
//      Z = sum_i Z_i exp(M_i - M) over the splits of the row's band in split order; writes
//      stats [2, B, H, T] (M, Z), the layout the backward reads.
//   2. dcmha_attn_partials: CTA per (32-key tile, query tile, b * group): a, b of the tile
//      from the scratch (ab_saved; the backward, which has no statistics sweep, runs sweep A
//      as kernel 1 does), then sweep B forming P_n (from M, Z) and accumulating c_r, d_r;
//      writes c, d of its (t, s) tile to the scratch [B * G, 4, chunk, T] of PartWords (both
//      ranks of a partial as one word of two T, below). Its (t, s)
//      tiles are independent (no combine), so a CTA holds one key tile: the sweep runs a
//      launch per query chunk (its scratch bounds the chunk), and one key tile a CTA
//      gives even a causal band's early chunks enough CTAs to fill the GPU (256-key
//      splits left 256-row chunks at ~1.5x their balanced time: bench/RESULTS.md).
//   3. dcmha_attn_output: CTA per (head m, query tile, b): flash-style loop over the key
//      tiles of the band (K_m, V_m tiles by cp.async, double-buffered): S_m on mma, the
//      partials of the tile read from the scratch, L_m -> P_m -> P'_m on the fragments,
//      P'_m packed to bf16/fp16 A fragments, O_m += P'_m V_m on mma (V by ldmatrix.trans).
//      O is staged through shared memory and stored in 16-byte chunks.
// Kernels 1-3 run once per query chunk of `chunk` rows: the scratch is
// B * G * 4 * chunk * T * 4 bytes, with chunk = a multiple of 64 chosen by the launcher so
// the scratch and split_stats (B * H * 2 * ceil(T / 64) * 4 bytes a row) stay under
// kScratchBytes (512 MiB: 1024 rows at B = 8, G = 1, T = 4096) or it is 64 rows (the
// bound). No tensor of size T * S exists; the saved statistics are O(B H T).
//
// Why this split: the heads of a group are coupled twice per (t, s) (pre and post compose)
// and the post compose needs every head's final softmax statistics, so each (t, s) tile is
// visited by three sweeps. All H output accumulators of 64 rows (64 H dv fp32 = 1 MiB at
// H = 32, dv = 128) fit no CTA, so the output kernel is per head and gets the cross-head
// information as 8 16-bit values per (t, s) from the scratch (L2-resident per chunk) instead of
// recomputing every head's S_n (which would cost H times the QK^T work per head).
// sm_90 clusters could exchange the partials through DSMEM instead of the scratch; this
// kernel uses no sm_90-only feature, so sm_80 runs the same design.
//
// Budget per kept (t, s) and group of hg heads (dh = dv = d, causal halves the pairs):
//   FLOPs: stats 2 hg (2 d) + partials hg (2 d) + output hg (2 d + 2 d) = 10 hg d, against
//   4 hg d for plain attention (2.5x), plus ~60 hg FLOPs of compose on the CUDA cores.
//   Bytes: Q_n and K_n tiles re-read per key tile and sweep (L2; K/V reused by 64 query
//   rows), the scratch written once (16 B per (t, s) and group) and read once per head
//   (16 hg B per (t, s), L2-resident when the chunk's partials fit in L2).
// Shared memory (bytes, ldq = dh_pad + 8, ldv = dv_pad + 8 bf16 elements):
//   stats / partials: 2 x (64 + 32) ldq x 2 (Q, K double-buffered)
//     + 2 x 4 (7 x 65 + 7 x 33) (head n's row / column weights, double-buffered with its
//     tiles) + 4 (2 hg 64) (row statistics, the one term that grows with the group)
//     = 32.4 KiB + 0.5 KiB per head of the group at dh = 64 (56.4 KiB + 0.5 KiB hg at
//     dh = 128): 72.4 KiB at hg = 32, dh = 128, 3 CTAs (12 warps) per sm_90 SM and 2 per
//     sm_80 SM, where staging every head's weights for the whole CTA took 153 KiB (1 CTA,
//     4 warps per SM); 48.4 KiB at hg = 32, dh = 64, within the 99 KiB of sm_86/89 parts;
//   output: 64 ldq x 2 + 2 x 32 (ldq + ldv) x 2 + 2 x 6 x 32 x 4 = 53 KiB at dh = dv = 128.
//
// fp32 as TF32 (the same kernels at T = float): a k step is 32 bytes of the operands' rows for
// every T (16 bf16 / fp16 or 8 fp32: hw::mma_step), so QK^T keeps its ldmatrix addressing
// with k offsets in elements of T; PV permutes the k order within a step so that P' stays in
// the accumulator's registers (fragment_times_rows) and reads V by scalar loads, since
// ldmatrix.trans moves 16-bit elements. The tensor core takes the operands' fp32 bits and
// drops the low 13 mantissa bits, as torch's TF32 matmuls do. The scratch words are 64 bits
// (two fp32 ranks, PartWordOf<float>): the partials keep fp32 as the reference computes them,
// and the chunk halves under the same cap (512 rows at B = 8, H = 32, T = 4096). Per kept
// (t, s) the FLOPs are the bf16 kernels' at half the tensor-core rate of 16-bit operands, and
// the tile bytes double: shared memory at dh = dv = 128 is 2 x 96 x 132 x 4 + ~5.4 KiB
// + 0.5 KiB hg = 104.4 KiB + 0.5 KiB hg (120.4 KiB at hg = 32: one CTA per SM on sm_80 and
// sm_90) for the sweeps and 64 x 132 x 4 + 2 x 32 x 264 x 4 + 1.5 KiB = 100.5 KiB (two CTAs
// per sm_90 SM, one per sm_80 SM) for the output. The backward runs at T = float too
// (dcmha_attention_mma_bwd_kernel.cuh).
#pragma once

#include "../common/mma_primitives.cuh"
#include "../common/simt_portability.h"
#include "../common/unroll.h"
#include "../common/vec.cuh"
#include "dcmha_attention_kernel.cuh"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

namespace headwise {
namespace dcmha {

constexpr int kTileRows = 64;   // query rows per CTA
constexpr int kTileKeys = 32;   // keys per tile
constexpr int kMmaThreads = 128;
constexpr int kKeyN8 = kTileKeys / 8;         // n8 tiles of a key tile
constexpr int kWeightFields = 20;             // W1[4][2], W2[4][2], G[4]
constexpr int kStatsSplitKeys = 64;           // keys per CTA of the statistics sweep (split_stats)
constexpr int kSweepSplitKeys = 32;           // keys per CTA of the sweeps that write the scratch
constexpr int kRowPitch = kTileRows + 1;      // smem pitch of a head's row weights
constexpr int kColPitch = kTileKeys + 1;
constexpr int kLoopFields = 7;                // sides 0-6: W1 r0 r1, W2 r0 r1, G of the pre slot; W1 r0 r1 of post
constexpr int kOutFields = 6;                 // W2 r0 r1, G of the pre and post slots (one head)
// The cap of a call's rank-partial scratch (and of the forward's split_stats): memory
// against launch tails. A larger chunk means fewer launches, each with more CTAs, so less
// of the time goes to each launch's partly filled last wave: at the target (B = 8, H = 32,
// T = 4096 causal bf16) 512 MiB gives 1024 / 512-row chunks (forward / backward) and
// forward + backward ~1.04x its balanced time, 256 MiB 512 / 256 rows and ~1.07x
// (python -m headwise.bench.launch_balance, an ESTIMATE).
constexpr int64_t kScratchBytes = int64_t(512) << 20;
constexpr int kFwdPartWords = 4;  // the forward's scratch planes: a, b, c, d (both ranks a word)

struct MmaAttnParams {
  AttnParams f;
  const float* wt;   // [B, H, wfields, T] transposed weights (fields 0-19; the backward adds 20-22)
  uint32_t* partials;  // [B * G, pwords, chunk, T] PartWord: words 0-3 (a, b, c, d) written by the partials kernel
  float* split_stats;  // [splits, 2, B * H, chunk]: (M, Z) of each key split, by the statistics sweep
  int wfields;       // kWeightFields in the forward, kBwdWeightFields in the backward
  int pwords;        // kFwdPartWords in the forward, kBwdPartWords in the backward
  int ab_saved;      // 1: the statistics sweep wrote words 0-1 (a, b) of the chunk; the partials sweep
                     // reads them and skips its sweep A (the forward); 0: it makes them (the backward)
  int chunk0;        // first query row of this chunk
  int split0;        // key split of a sweep's blockIdx.x = 0 (the splits before the chunk's band have no work)
  int chunk;         // rows of the scratch (a multiple of 64)
  int dh_pad, dv_pad;
  int vec16;         // q, k, v, out 16-byte aligned and dh, dv multiples of kChunk<T> (8, or 4 for fp32)
};

__host__ __device__ inline int wfield_w1(int c, int r) { return c * 2 + r; }
__host__ __device__ inline int wfield_w2(int c, int r) { return 8 + c * 2 + r; }
__host__ __device__ inline int wfield_g(int c) { return 16 + c; }

// The transposed weights table wt [B, H, wfields, T]: the 20 weight fields above; the
// backward's table adds the row statistics M, 1/Z (0 where Z = 0) and D.
constexpr int kFieldM = 20, kFieldInvZ = 21, kFieldD = 22, kBwdWeightFields = 23;
// One side of head n's compose weights: a query row t (slots 0, 2, then M, 1/Z, D: the
// backward's) or a key column s (slots 1, 3). The forward's sweeps read sides 0-6.
constexpr int kW1Pre = 0, kW2Pre = 2, kGPre = 4, kW1Post = 5, kW2Post = 7, kGPost = 9;
constexpr int kKeySide = 10, kStatM = 10, kStatInvZ = 11, kStatD = 12, kQuerySide = 13;

__host__ __device__ inline int side_wfield(int i, bool key) {
  if (i >= kKeySide) return kFieldM + (i - kKeySide);
  const int pre = key ? 1 : 0, post = pre + 2;
  return i < 2   ? wfield_w1(pre, i)
         : i < 4 ? wfield_w2(pre, i - 2)
         : i == 4 ? wfield_g(pre)
         : i < 7 ? wfield_w1(post, i - 5)
         : i < 9 ? wfield_w2(post, i - 7)
                 : wfield_g(post);
}

// Elements of T in 16 bytes: the chunk of a cp.async row copy and of a 16-byte store, and the
// pad of every shared tile row. A row pitch of d_pad + 16 / elem elements (d_pad a multiple of
// 16) is an odd multiple of 16 bytes modulo 128, so the 8 rows an ldmatrix reads fall in
// 8 distinct 16-byte bank groups.
template <typename T>
constexpr int kChunk = 16 / static_cast<int>(sizeof(T));
__host__ __device__ inline int tile_pitch(int d_pad, int elem) { return d_pad + 16 / elem; }

// elem: bytes of the inputs' dtype (2, or 4 for the TF32 path).
__host__ __device__ inline int64_t mma_loop_smem_bytes(int hg, int dh_pad, int elem = 2) {
  const int ldq = tile_pitch(dh_pad, elem);
  return int64_t(2) * (kTileRows + kTileKeys) * ldq * elem +
         int64_t(4) * 2 * kLoopFields * (kRowPitch + kColPitch) + int64_t(4) * 2 * hg * kTileRows;
}

__host__ __device__ inline int64_t mma_out_smem_bytes(int dh_pad, int dv_pad, int elem = 2) {
  const int ldq = tile_pitch(dh_pad, elem), ldv = tile_pitch(dv_pad, elem);
  const int64_t q = int64_t(kTileRows) * (ldq > ldv ? ldq : ldv) * elem;  // also holds the O tile
  return q + int64_t(2) * kTileKeys * (ldq + ldv) * elem + int64_t(2) * kOutFields * kTileKeys * 4;
}

// (t, s) takes part in the softmax.
__device__ __forceinline__ bool kept_pair(int t, int s, int T, int causal, int window) {
  return s < T && (!causal || s <= t) && (window == 0 || s > t - window);
}

// The key band [lo, hi) of query rows [q0, q0 + rows).
__host__ __device__ inline void key_band(int q0, int rows, int T, int causal, int window, int& lo, int& hi) {
  const int q1 = (q0 + rows < T ? q0 + rows : T) - 1;  // last real row
  hi = causal ? q1 + 1 : T;
  lo = window > 0 ? (q0 - window + 1 > 0 ? q0 - window + 1 : 0) : 0;
}

// The key band of query rows [q0, q0 + rows) within the key split [s_lo, s_lo + split_keys):
// empty (hi <= lo) when the two do not meet.
__device__ __forceinline__ void split_key_band(int q0, int rows, int T, int causal, int window, int s_lo,
                                               int split_keys, int& lo, int& hi) {
  key_band(q0, rows, T, causal, window, lo, hi);
  lo = lo > s_lo ? lo : s_lo;
  hi = hi < s_lo + split_keys ? hi : s_lo + split_keys;
}

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  const T l = static_cast<T>(lo), h = static_cast<T>(hi);
  return static_cast<uint32_t>(l.x) | (static_cast<uint32_t>(h.x) << 16);
}

// The scratch of rank partials: the two ranks (r = 0 low, r = 1 high) of one partial of one
// (t, s) as one word of two T: 32 bits of two bf16 / fp16 rounded to nearest even, or (the
// TF32 path, PartWordOf<float>) 64 bits of two fp32.
// The scratch reads (each head's kernels read the group's partials of every (t, s) they
// visit) are the term that bounds the kernels reading it (bench/RESULTS.md); as 16-bit
// pairs they are half the bytes and half the loads of fp32. Precision and range are the
// inputs' dtype: those in which the eager composition holds its [B, H, T, S] logits,
// probabilities and their gradients, and of the P' and dL operands the products here take.
using PartWord = uint32_t;
template <typename T>
using PartWordOf = typename std::conditional<std::is_same<T, float>::value, uint64_t, PartWord>::type;
// sizeof(PartWordOf<T>) from the inputs' bytes, for the launchers, which size the scratch
// before they dispatch on T.
__host__ __device__ constexpr int part_word_bytes(int elem) { return elem == 4 ? 8 : 4; }
static_assert(part_word_bytes(4) == sizeof(PartWordOf<float>) &&
                  part_word_bytes(2) == sizeof(PartWordOf<c10::BFloat16>),
              "part_word_bytes is sizeof(PartWordOf<T>)");
template <typename T>
__device__ __forceinline__ PartWordOf<T> pack_part(float r0, float r1) {
  if constexpr (std::is_same<T, float>::value)
    return static_cast<uint64_t>(__float_as_uint(r0)) | (static_cast<uint64_t>(__float_as_uint(r1)) << 32);
  else
    return pack2<T>(r0, r1);
}
template <typename T>
__device__ __forceinline__ void unpack_part(PartWordOf<T> w, float& r0, float& r1) {
  if constexpr (std::is_same<T, float>::value) {
    r0 = __uint_as_float(static_cast<uint32_t>(w));
    r1 = __uint_as_float(static_cast<uint32_t>(w >> 32));
  } else {
    hw::Pack<T, 2> pk;
    std::memcpy(&pk, &w, sizeof(w));
    float f[2];
    hw::unpack_to_float<T, 2>(pk, f);
    r0 = f[0];
    r1 = f[1];
  }
}
// The scratch planes of the chunk as words of T (the launcher sizes them by sizeof(PartWordOf<T>)).
template <typename T>
__device__ __forceinline__ PartWordOf<T>* part_words(PartWord* partials) {
  return reinterpret_cast<PartWordOf<T>*>(partials);
}
static_assert(kR == 2, "a scratch word holds the two ranks of a partial");

// The words of the pair (t, s), (t, s + 1) of one scratch plane at dst / src: one 8-byte (16-byte
// for 64-bit words) access where `pair` (s + 1 < T and T even), else one word each, the second
// where `second` (s + 1 < T); a word not loaded reads 0.
template <typename W>
__device__ __forceinline__ void store_part_words(W* dst, W w0, W w1, bool pair, bool second) {
  if (pair) {
    hw::Pack<W, 2> pk;
    pk.v[0] = w0;
    pk.v[1] = w1;
    hw::store_pack<W, 2>(dst, pk);
  } else {
    dst[0] = w0;
    if (second) dst[1] = w1;
  }
}
template <typename W>
__device__ __forceinline__ void load_part_words(const W* src, W& w0, W& w1, bool pair, bool second) {
  if (pair) {
    const hw::Pack<W, 2> pk = hw::load_pack<W, 2>(src);
    w0 = pk.v[0];
    w1 = pk.v[1];
  } else {
    w0 = src[0];
    w1 = second ? src[1] : W(0);
  }
}

// a_r, b_r of a warp's 16 x 32 fragment (pa, pb [r][n8 tile][element]) and scratch words 0-1
// of the tile: element e of n8 tile j is (row 16 warp + lane / 4 + 8 (e >> 1), column 8 j +
// 2 (lane % 4) + (e & 1)), at tile[row * T + column] of planes 0 (a) and 1 (b = tile + plane);
// rows and keys are the tile's rows and keys before T (no word past them is read or written).
template <typename T>
__device__ __forceinline__ void round_ab(float (&pa)[kR][kKeyN8][4], float (&pb)[kR][kKeyN8][4]) {
  if constexpr (!std::is_same<T, float>::value) {  // fp32 words hold them exactly
HW_UNROLL
    for (int j = 0; j < kKeyN8; ++j)
HW_UNROLL
      for (int e = 0; e < 4; ++e) {
        unpack_part<T>(pack_part<T>(pa[0][j][e], pa[1][j][e]), pa[0][j][e], pa[1][j][e]);
        unpack_part<T>(pack_part<T>(pb[0][j][e], pb[1][j][e]), pb[0][j][e], pb[1][j][e]);
      }
  }
}
template <typename T, bool Store>
__device__ __forceinline__ void ab_words(float (&pa)[kR][kKeyN8][4], float (&pb)[kR][kKeyN8][4], PartWordOf<T>* tile,
                                         int64_t plane, int TT, int rows, int keys, int warp, int lane) {
  const int gq = lane / 4, tq = lane % 4;
HW_UNROLL
  for (int j = 0; j < kKeyN8; ++j)
HW_UNROLL
    for (int h = 0; h < 2; ++h) {
      const int r = warp * 16 + gq + 8 * h, c = j * 8 + 2 * tq;
      if (r >= rows || c >= keys) continue;
      const bool pair = c + 1 < keys && TT % 2 == 0, second = c + 1 < keys;
      PartWordOf<T>* a = tile + static_cast<int64_t>(r) * TT + c;
      if constexpr (Store) {
        store_part_words(a, pack_part<T>(pa[0][j][2 * h], pa[1][j][2 * h]),
                         pack_part<T>(pa[0][j][2 * h + 1], pa[1][j][2 * h + 1]), pair, second);
        store_part_words(a + plane, pack_part<T>(pb[0][j][2 * h], pb[1][j][2 * h]),
                         pack_part<T>(pb[0][j][2 * h + 1], pb[1][j][2 * h + 1]), pair, second);
      } else {
        PartWordOf<T> w[2][2];
        load_part_words(a, w[0][0], w[0][1], pair, second);
        load_part_words(a + plane, w[1][0], w[1][1], pair, second);
HW_UNROLL
        for (int e2 = 0; e2 < 2; ++e2) {
          unpack_part<T>(w[0][e2], pa[0][j][2 * h + e2], pa[1][j][2 * h + e2]);
          unpack_part<T>(w[1][e2], pb[0][j][2 * h + e2], pb[1][j][2 * h + e2]);
        }
      }
    }
}

// Rows [r0, r0 + rows) of a [T, d] row-major matrix into smem [rows][ld] (ld = tile_pitch),
// zero past T and in the columns [d, d_pad). 16-byte cp.async when vec16, else plain
// element copies (visible after the caller's __syncthreads).
template <typename T>
__device__ __forceinline__ void load_rows(T* dst, const T* src, int r0, int rows, int nrows, int d, int d_pad,
                                          int vec16) {
  constexpr int E = kChunk<T>;
  const int ld = d_pad + E, chunks = d_pad / E;
  for (int i = threadIdx.x; i < rows * chunks; i += blockDim.x) {
    const int r = i / chunks, c = i % chunks, row = r0 + r;
    T* out = dst + r * ld + c * E;
    if (vec16) {
      const bool inside = row < nrows && c * E < d;
      const T* g = inside ? src + static_cast<int64_t>(row) * d + c * E : src;
      hw::cp_async_cg16(out, g, inside ? 16 : 0);
    } else {
      for (int e = 0; e < E; ++e) {
        const int col = c * E + e;
        out[e] = (row < nrows && col < d) ? src[static_cast<int64_t>(row) * d + col] : static_cast<T>(0.f);
      }
    }
  }
}

// Fields of side `key` listed in mask, of positions [x0, x0 + n) of one head's weights
// table row block (wt_head = wt + head * wfields * T), into dst [field][pitch] by 4-byte
// cp.async (zero past T). Part of the caller's commit group.
__device__ __forceinline__ void load_side_fields(float* dst, const float* wt_head, int x0, int n, int pitch, int TT,
                                                 unsigned mask, int nfields, bool key) {
  for (int i = threadIdx.x; i < nfields * n; i += blockDim.x) {
    const int f = i / n, c = i % n, x = x0 + c;
    if (!((mask >> f) & 1u)) continue;
    const bool inside = x < TT;
    hw::cp_async_ca<4>(dst + f * pitch + c, inside ? wt_head + static_cast<int64_t>(side_wfield(f, key)) * TT + x
                                                  : wt_head,
                       inside ? 4 : 0);
  }
}

// The same fields, position-major: field f of position x0 + c at dst[c * pitch + f], a
// record per position that one thread reads by 16-byte loads (load_side_record). Consecutive
// threads take consecutive positions of a field: the global reads stay coalesced.
__device__ __forceinline__ void load_side_records(float* dst, const float* wt_head, int x0, int n, int pitch,
                                                  int TT, unsigned mask, int nfields, bool key) {
  for (int i = threadIdx.x; i < nfields * n; i += blockDim.x) {
    const int f = i / n, c = i % n, x = x0 + c;
    if (!((mask >> f) & 1u)) continue;
    const bool inside = x < TT;
    hw::cp_async_ca<4>(dst + c * pitch + f, inside ? wt_head + static_cast<int64_t>(side_wfield(f, key)) * TT + x
                                                  : wt_head,
                       inside ? 4 : 0);
  }
}

// Fields [0, N) of one position's side record (p 16-byte aligned) into registers: a 16-byte
// load per 4 fields, then a pair and a single where N leaves them.
template <int N>
__device__ __forceinline__ void load_side_record(float (&v)[N], const float* p) {
  HW_UNROLL
  for (int f = 0; f + 4 <= N; f += 4) {
    float x[4];
    hw::load_as_float<4>(p + f, x);
    HW_UNROLL
    for (int u = 0; u < 4; ++u) v[f + u] = x[u];
  }
  constexpr int kQuads = N / 4 * 4;
  if constexpr (N % 4 >= 2) {
    float x[2];
    hw::load_as_float<2>(p + kQuads, x);
    v[kQuads] = x[0];
    v[kQuads + 1] = x[1];
  }
  if constexpr (N % 2 == 1) v[N - 1] = p[N - 1];
}

// S[16 x 8 N8] of this warp: rows 16 warp.. of the Q tile times the first 8 N8 rows of the
// K tile (both [.][ld]); N8 even (kKeyN8: a whole key tile). A k step is 32 bytes (16
// bf16 / fp16 or 8 fp32 elements, hw::mma_step), each ldmatrix matrix 16 bytes of k.
template <typename T, int N8>
__device__ __forceinline__ void qk_tile(float (&acc)[N8][4], const T* qs, const T* ks, int ld, int d_pad, int warp,
                                        int lane, float scale) {
  static_assert(N8 % 2 == 0, "n8 tiles in pairs (one ldmatrix.x4 each)");
HW_UNROLL
  for (int j = 0; j < N8; ++j)
HW_UNROLL
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
  constexpr int E = kChunk<T>;
  const int quad = lane / 8, rq = lane % 8;
  const int a_row = warp * 16 + (quad & 1) * 8 + rq, a_col = (quad >> 1) * E;
  const int b_row = (quad >> 1) * 8 + rq, b_col = (quad & 1) * E;
  for (int k0 = 0; k0 < d_pad; k0 += 2 * E) {
    uint32_t fa[4];
    hw::ldmatrix<4>(fa, qs + a_row * ld + k0 + a_col);
HW_UNROLL
    for (int j = 0; j < N8; j += 2) {
      uint32_t r[4];
      hw::ldmatrix<4>(r, ks + (j * 8 + b_row) * ld + k0 + b_col);
      const uint32_t b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
      hw::mma_step<T>(acc[j], fa, b0);
      hw::mma_step<T>(acc[j + 1], fa, b1);
    }
  }
HW_UNROLL
  for (int j = 0; j < N8; ++j)
HW_UNROLL
    for (int e = 0; e < 4; ++e) acc[j][e] *= scale;
}

// Every element of a register tile to 0.
template <int M, int N>
__device__ __forceinline__ void zero_tile(float (&a)[M][N]) {
HW_UNROLL
  for (int i = 0; i < M; ++i)
HW_UNROLL
    for (int j = 0; j < N; ++j) a[i][j] = 0.f;
}

// o[j] += A B for one k16 step of 16 rows: A the rows' fragment fa (mma's A layout), B =
// smem rows [16][ld] (k = the row) read by ldmatrix.trans; n8 tiles j < n8 (<= DTiles).
template <typename T, int DTiles>
__device__ __forceinline__ void a_times_rows_k16(float (&o)[DTiles][4], const uint32_t (&fa)[4], const T* rows, int ld,
                                                 int n8, int lane) {
  const int quad = lane / 8, rq8 = lane % 8;
HW_UNROLL
  for (int j = 0; j < DTiles; j += 2) {
    if (j >= n8) break;
    uint32_t r[4];
    hw::ldmatrix<4, true>(r, rows + ((quad & 1) * 8 + rq8) * ld + (j + (quad >> 1)) * 8);
    const uint32_t b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
    hw::mma_step<T>(o[j], fa, b0);
    hw::mma_step<T>(o[j + 1], fa, b1);
  }
}

// o[j] += A B for one k8 step of TF32 (fp32 operands) in the pair order: ldmatrix.trans moves
// 16-bit elements, so B = smem rows [8][ld] (k = the row) is read by scalar loads, and the
// step's k slots tq and tq + 4 (mma's) are rows 2 tq and 2 tq + 1, so that a lane's A values
// are the adjacent pairs an accumulator fragment or an 8-byte load holds: A's (a0, a1, a2,
// a3) = (row g k 2tq, row g+8 k 2tq, row g k 2tq+1, row g+8 k 2tq+1), B's (b0, b1) = rows
// 2 tq and 2 tq + 1, column 8 j + g. Those loads are conflict-free at ld = d_pad + 4 (d_pad a
// multiple of 16): bank 8 tq + g. n8 tiles j < n8 (<= DTiles).
template <int DTiles>
__device__ __forceinline__ void tf32_pair_step(float (&o)[DTiles][4], const uint32_t (&fa)[4], const float* rows,
                                               int ld, int n8, int lane) {
  const float* r0 = rows + 2 * (lane % 4) * ld + lane / 4;
HW_UNROLL
  for (int j = 0; j < DTiles; ++j) {
    if (j >= n8) break;
    const uint32_t fb[2] = {__float_as_uint(r0[j * 8]), __float_as_uint(r0[ld + j * 8])};
    hw::mma_step<float>(o[j], fa, fb);
  }
}

// The pair-order A fragment of tf32_pair_step from smem: (a0, a2) at p (row g: k 2 tq, 2 tq + 1
// of the step) and (a1, a3) at p + row8 (row g + 8), 8-byte loads.
__device__ __forceinline__ void tf32_pair_a(uint32_t (&fa)[4], const float* p, int row8) {
  const hw::Pack<float, 2> lo = hw::load_pack<float, 2>(p), hi = hw::load_pack<float, 2>(p + row8);
  fa[0] = __float_as_uint(lo.v[0]);
  fa[1] = __float_as_uint(hi.v[0]);
  fa[2] = __float_as_uint(lo.v[1]);
  fa[3] = __float_as_uint(hi.v[1]);
}

// o[j] += A B for the warp's 16 rows: A = the warp's 16 x 32 accumulator fragment acc packed
// to T (k = the tile's 32 columns, two k16 steps), B = smem rows [32][ld] (k = the row) read
// by ldmatrix.trans; n8 tiles j < n8 (<= DTiles). fp32: four k8 steps of tf32_pair_step, A the
// accumulator as it stands (n8 tile kk's (c0, c2, c1, c3)).
template <typename T, int DTiles>
__device__ __forceinline__ void fragment_times_rows(float (&o)[DTiles][4], const float (&acc)[kKeyN8][4], const T* rows,
                                                    int ld, int n8, int lane) {
  if constexpr (std::is_same<T, float>::value) {
HW_UNROLL
    for (int kk = 0; kk < kKeyN8; ++kk) {
      const uint32_t fa[4] = {__float_as_uint(acc[kk][0]), __float_as_uint(acc[kk][2]), __float_as_uint(acc[kk][1]),
                              __float_as_uint(acc[kk][3])};
      tf32_pair_step(o, fa, rows + kk * 8 * ld, ld, n8, lane);
    }
  } else {
HW_UNROLL
    for (int kk = 0; kk < kTileKeys / 16; ++kk) {
      uint32_t fa[4];
      fa[0] = pack2<T>(acc[2 * kk][0], acc[2 * kk][1]);
      fa[1] = pack2<T>(acc[2 * kk][2], acc[2 * kk][3]);
      fa[2] = pack2<T>(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
      fa[3] = pack2<T>(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
      a_times_rows_k16<T>(o, fa, rows + kk * 16 * ld, ld, n8, lane);
    }
  }
}

// A warp's fragment tile x (rows row0 + [0, 16), n8 tiles j0 + [0, n8)) as T into the smem
// tile stage [rows][ld].
template <typename T, int DTiles>
__device__ __forceinline__ void stage_fragment_rows(const float (&x)[DTiles][4], T* stage, int ld, int row0, int j0,
                                                    int n8, int lane) {
  const int gq = lane / 4, tq = lane % 4;
HW_UNROLL
  for (int j = 0; j < DTiles; ++j) {
    if (j >= n8) break;
HW_UNROLL
    for (int h = 0; h < 2; ++h) {
      const int r = row0 + gq + 8 * h, c = (j0 + j) * 8 + 2 * tq;
      stage[r * ld + c] = static_cast<T>(x[j][2 * h]);
      stage[r * ld + c + 1] = static_cast<T>(x[j][2 * h + 1]);
    }
  }
}

// Rows [0, rows) of the smem tile stage [.][ld] to rows r0.. of out [T, d], by the whole
// CTA: 16-byte chunks when vec16 (d a multiple of kChunk<T>, out 16-byte aligned), else per element.
template <typename T>
__device__ __forceinline__ void store_staged_rows(const T* stage, int ld, T* out, int r0, int rows, int d, int vec16) {
  if (vec16) {
    constexpr int E = kChunk<T>;
    const int chunks = d / E;
    for (int x = threadIdx.x; x < rows * chunks; x += blockDim.x) {
      const int r = x / chunks, c = x % chunks;
      hw::store_pack<T, E>(out + static_cast<int64_t>(r0 + r) * d + c * E,
                           *reinterpret_cast<const hw::Pack<T, E>*>(stage + r * ld + c * E));
    }
  } else {
    for (int x = threadIdx.x; x < rows * d; x += blockDim.x) {
      const int r = x / d, c = x % d;
      out[static_cast<int64_t>(r0 + r) * d + c] = stage[r * ld + c];
    }
  }
}

// The CTA's [64, d] tile o (warp w holds rows 16 w.., n8 tiles j < n8) to rows q0.. of
// out [T, d]: staged in smem stage [64][ld] (free when called: the caller synchronizes),
// then stored in 16-byte chunks when vec16, else per element.
template <typename T, int DTiles>
__device__ __forceinline__ void store_row_tile(const float (&o)[DTiles][4], T* stage, int ld, int n8, T* out, int q0,
                                               int TT, int d, int vec16, int warp, int lane) {
  stage_fragment_rows<T>(o, stage, ld, warp * 16, 0, n8, lane);
  __syncthreads();
  store_staged_rows<T>(stage, ld, out, q0, TT - q0 < kTileRows ? TT - q0 : kTileRows, d, vec16);
}

// Kernels 0 (and the backward's grads_untranspose, its inverse): the weights [B, T, 20 H] of
// a row (the columns j = field * H + head: w1's 8 H, w2's 8 H, g's 4 H, each contiguous)
// and the table [B, H, fields, T] (a column j contiguous along t), through a shared tile of
// kTransposeRows rows x kTransposeCols columns. CTA of kTransposeThreads per (32 rows, b,
// 128 columns): 17 KiB of smem, so 8 CTAs (64 warps) per SM, 4 KiB of loads in flight each.
constexpr int kTransposeRows = 32, kTransposeCols = 128, kTransposeThreads = 256;
// Pitches of the tile [column][row]: weights_t writes 4 columns of a row per lane, a warp 8
// rows x 16 columns (bank 8 (lane / 8) + lane % 8 at a pitch of 2 mod 8: conflict-free);
// grads_untranspose writes 4 rows of a column per lane, a warp 4 columns x 32 rows (bank
// 4 (lane % 8) + lane / 8 at an odd pitch). Both read a column's 32 rows or a row's 32
// columns per warp: conflict-free at either pitch.
constexpr int kWeightsTPitch = kTransposeRows + 2, kGradsTPitch = kTransposeRows + 1;
__host__ __device__ inline int64_t transpose_smem_bytes() {
  return int64_t(4) * kTransposeCols * (kWeightsTPitch > kGradsTPitch ? kWeightsTPitch : kGradsTPitch);
}

// A transpose CTA's tile: rows [t0, t0 + rows) of batch b, columns [j0, j0 + cols) of the 20 H.
struct TransposeTile {
  int b, t0, j0, rows, cols;
  __device__ __forceinline__ explicit TransposeTile(const AttnParams& p)
      : b(blockIdx.y), t0(blockIdx.x * kTransposeRows), j0(blockIdx.z * kTransposeCols) {
    rows = p.T - t0 < kTransposeRows ? p.T - t0 : kTransposeRows;
    cols = kWeightFields * p.H - j0 < kTransposeCols ? kWeightFields * p.H - j0 : kTransposeCols;
  }
};

// Column j of a weights row: w1 [.., 8 H], then w2, then g [.., 4 H] (row = b T + t).
__device__ __forceinline__ const float* weights_row_column(const AttnParams& p, int64_t row, int j) {
  const int H = p.H;
  return j < 8 * H ? p.w1 + row * 8 * H + j : j < 16 * H ? p.w2 + row * 8 * H + j - 8 * H : p.g + row * 4 * H + j - 16 * H;
}

// Kernel 0: wt[b, h, f, t] = the weight field f < 20 of (b, t, h), wt's field pitch `wfields`.
// Loads: 16-byte chunks of a row's columns (vec4: w1, w2, g 16-byte aligned; a chunk of 4
// columns never spans two of them, 8 H and 16 H being multiples of 4), a warp 8 rows x 64 B.
// Stores: a warp one column's 32 rows (128 B).
// Defined in dcmha_attention_mma_fp32_kernels.cuh (one translation unit).
__global__ void __launch_bounds__(kTransposeThreads) dcmha_attn_weights_t(const AttnParams p, float* wt, int wfields,
                                                                          int vec4);

// Kernels 1 and 2 (Partials = false / true): CTA per (key split, query tile, b * G), the
// split kStatsSplitKeys (statistics) or kSweepSplitKeys (partials) keys.
template <typename T, bool Partials>
__global__ void __launch_bounds__(kMmaThreads) dcmha_attn_sweep(const MmaAttnParams mp) {
  const AttnParams& p = mp.f;
  const int H = p.H, TT = p.T, hg = p.hg;
  // Head n of the CTA's group is b * H + grp * hg + n = bg * hg + n of the [B * H] heads.
  const int bg = blockIdx.z;
  const int q0 = mp.chunk0 + blockIdx.y * kTileRows;
  if (q0 >= TT) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gq = lane / 4, tq = lane % 4;
  const int ldq = tile_pitch(mp.dh_pad, sizeof(T));

  // The tile's key band within this CTA's split; a split outside the band has no work
  // (the combine reads only the splits of each row's band, so writes nothing either).
  constexpr int kSplit = Partials ? kSweepSplitKeys : kStatsSplitKeys;
  int lo, hi;
  split_key_band(q0, kTileRows, TT, p.causal, p.window, (mp.split0 + blockIdx.x) * kSplit, kSplit, lo, hi);
  if (hi <= lo) return;
  const int kt_lo = lo / kTileKeys, kt_hi = (hi + kTileKeys - 1) / kTileKeys;

  unsigned char* base = hw::dynamic_shared_memory();
  T* qbuf = reinterpret_cast<T*>(base);                   // [2][64][ldq]
  T* kbuf = qbuf + 2 * kTileRows * ldq;                   // [2][32][ldq]
  float* rowf = reinterpret_cast<float*>(kbuf + 2 * kTileKeys * ldq);  // [2][7][65] head n's row sides
  float* colf = rowf + 2 * kLoopFields * kRowPitch;                     // [2][7][33] and column sides
  float* st_m = colf + 2 * kLoopFields * kColPitch;                     // [hg][64]
  float* st_z = st_m + hg * kTileRows;                                  // [hg][64] (Partials: 1 / Z)

  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  // The sides an item reads: sweep A W1 of the pre slot; sweep B W2 and G of the pre slot,
  // and W1 of the post slot for the partials.
  constexpr unsigned kSweepA = (1u << kW1Pre) | (1u << (kW1Pre + 1));
  constexpr unsigned kSweepB = (1u << kW2Pre) | (1u << (kW2Pre + 1)) | (1u << kGPre) |
                               (Partials ? (1u << kW1Post) | (1u << (kW1Post + 1)) : 0u);

  // Statistics of the tile.
  for (int i = threadIdx.x; i < hg * kTileRows; i += blockDim.x) {
    const int n = i / kTileRows, r = i % kTileRows, t = q0 + r;
    if (Partials) {
      const int64_t so = (static_cast<int64_t>(bg) * hg + n) * TT + t;
      const float z = t < TT ? p.stats[static_cast<int64_t>(p.B) * H * TT + so] : 0.f;
      st_m[i] = t < TT ? p.stats[so] : 0.f;
      st_z[i] = z > 0.f ? 1.f / z : 0.f;
    } else {
      st_m[i] = -INFINITY;
      st_z[i] = 0.f;
    }
  }

  // Item = (key tile, sweep, head n): head n's Q and K tiles and the sides of its sweep,
  // one commit group, double-buffered. Where a, b are saved, a key tile's items are sweep B's.
  const bool ab_saved = Partials && mp.ab_saved;
  const int sweeps = ab_saved ? 1 : 2;
  const int n_items = (kt_hi - kt_lo) * sweeps * hg;
  auto item_sweep = [&](int item) { return ab_saved ? 1 : (item / hg) % 2; };
  // This group's scratch [4 or kBwdPartWords][chunk][T] of the chunk.
  PartWordOf<T>* const scratch = part_words<T>(mp.partials) + static_cast<int64_t>(bg) * mp.pwords * mp.chunk * TT;
  const int64_t plane = static_cast<int64_t>(mp.chunk) * TT;
  auto tile_words = [&](int s0) { return scratch + static_cast<int64_t>(q0 - mp.chunk0) * TT + s0; };
  auto issue = [&](int item) {
    if (item < n_items) {
      const int kt = kt_lo + item / (sweeps * hg), sweep = item_sweep(item), n = item % hg, stage = item & 1;
      const int64_t head = static_cast<int64_t>(bg) * hg + n;
      load_rows(qbuf + stage * kTileRows * ldq, q + head * TT * p.dh, q0, kTileRows, TT, p.dh, mp.dh_pad, mp.vec16);
      load_rows(kbuf + stage * kTileKeys * ldq, k + head * TT * p.dh, kt * kTileKeys, kTileKeys, TT, p.dh, mp.dh_pad,
                mp.vec16);
      const float* wt_head = mp.wt + head * mp.wfields * TT;
      const unsigned mask = sweep == 0 ? kSweepA : kSweepB;
      load_side_fields(rowf + stage * kLoopFields * kRowPitch, wt_head, q0, kTileRows, kRowPitch, TT, mask,
                       kLoopFields, false);
      load_side_fields(colf + stage * kLoopFields * kColPitch, wt_head, kt * kTileKeys, kTileKeys, kColPitch, TT,
                       mask, kLoopFields, true);
    }
    hw::cp_async_commit();
  };

  float pa[kR][kKeyN8][4] = {}, pb[kR][kKeyN8][4] = {};  // a_r, b_r of the warp's 16 x 32 fragment
  float pc[kR][kKeyN8][4] = {}, pd[kR][kKeyN8][4] = {};  // c_r, d_r (Partials)
  issue(0);
  for (int item = 0; item < n_items; ++item) {
    const int kt = kt_lo + item / (sweeps * hg), sweep = item_sweep(item), n = item % hg, stage = item & 1;
    const int s0 = kt * kTileKeys;
    __syncthreads();  // every warp is done with the stage of item - 1
    issue(item + 1);
    if (item % (sweeps * hg) == 0) {
      // A new key tile: zero partials, or a, b of the statistics sweep from the scratch.
      zero_tile(pc[0]);
      zero_tile(pc[1]);
      zero_tile(pd[0]);
      zero_tile(pd[1]);
      zero_tile(pa[0]);
      zero_tile(pa[1]);
      zero_tile(pb[0]);
      zero_tile(pb[1]);
      if (ab_saved) ab_words<T, false>(pa, pb, tile_words(s0), plane, TT, TT - q0, TT - s0, warp, lane);
    }
    hw::cp_async_wait<1>();
    __syncthreads();
    float acc[kKeyN8][4];
    qk_tile<T>(acc, qbuf + stage * kTileRows * ldq, kbuf + stage * kTileKeys * ldq, ldq, mp.dh_pad, warp, lane,
               p.scale);
    const float* rwn = rowf + stage * kLoopFields * kRowPitch;  // side f of row r at rwn[f * fs_r + r]
    const float* cwn = colf + stage * kLoopFields * kColPitch;
    constexpr int fs_r = kRowPitch, fs_c = kColPitch;
    if (sweep == 0) {
HW_UNROLL
      for (int j = 0; j < kKeyN8; ++j)
HW_UNROLL
        for (int e = 0; e < 4; ++e) {
          const int r = warp * 16 + gq + 8 * (e >> 1), c = j * 8 + 2 * tq + (e & 1);
HW_UNROLL
          for (int rr = 0; rr < kR; ++rr) {
            pa[rr][j][e] += rwn[rr * fs_r + r] * acc[j][e];
            pb[rr][j][e] += cwn[rr * fs_c + c] * acc[j][e];
          }
        }
      if (n == hg - 1) {
        // a, b of the tile are complete: every later use (sweep B's logits here, the partials,
        // output and backward kernels) takes them as the scratch holds them, rounded to T, so
        // M and Z are the statistics of exactly the logits those kernels form. The statistics
        // sweep stores them (words 0-1) for the forward's partials sweep.
        round_ab<T>(pa, pb);
        if constexpr (!Partials) ab_words<T, true>(pa, pb, tile_words(s0), plane, TT, TT - q0, TT - s0, warp, lane);
      }
      continue;
    }
    // Sweep B: the composed logits of head n.
    float lg[kKeyN8][4];
    bool kept[kKeyN8][4];
HW_UNROLL
    for (int j = 0; j < kKeyN8; ++j)
HW_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int r = warp * 16 + gq + 8 * (e >> 1), c = j * 8 + 2 * tq + (e & 1);
        float x = acc[j][e] * (1.f + rwn[4 * fs_r + r] + cwn[4 * fs_c + c]);
HW_UNROLL
        for (int rr = 0; rr < kR; ++rr)
          x += rwn[(2 + rr) * fs_r + r] * pa[rr][j][e] + cwn[(2 + rr) * fs_c + c] * pb[rr][j][e];
        lg[j][e] = x;
        kept[j][e] = q0 + r < TT && kept_pair(q0 + r, s0 + c, TT, p.causal, p.window);
      }
    if constexpr (!Partials) {
      // Online row max and sum of head n over the warp's rows (quad = the 4 lanes of a row).
HW_UNROLL
      for (int h = 0; h < 2; ++h) {
        const int r = warp * 16 + gq + 8 * h;
        float mx = -INFINITY;
HW_UNROLL
        for (int j = 0; j < kKeyN8; ++j)
HW_UNROLL
          for (int e2 = 0; e2 < 2; ++e2)
            if (kept[j][2 * h + e2]) mx = fmaxf(mx, lg[j][2 * h + e2]);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_old = st_m[n * kTileRows + r];
        const float m_new = fmaxf(m_old, mx);
        float sum = 0.f;
        if (m_new != -INFINITY) {
HW_UNROLL
          for (int j = 0; j < kKeyN8; ++j)
HW_UNROLL
            for (int e2 = 0; e2 < 2; ++e2)
              if (kept[j][2 * h + e2]) sum += expf(lg[j][2 * h + e2] - m_new);
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        // Every lane of the quad has read st_m above; lane 0 overwrites it below. A shuffle
        // orders no memory, so the warp synchronizes first (compute-sanitizer racecheck
        // reported this read/write pair on an H200).
        __syncwarp();
        if (tq == 0 && m_new != -INFINITY) {
          const float z_old = st_z[n * kTileRows + r];
          st_z[n * kTileRows + r] = (m_old == -INFINITY ? 0.f : z_old * expf(m_old - m_new)) + sum;
          st_m[n * kTileRows + r] = m_new;
        }
      }
    } else {
      // Partials: P_n and the post partials.
HW_UNROLL
      for (int j = 0; j < kKeyN8; ++j)
HW_UNROLL
        for (int e = 0; e < 4; ++e) {
          const int r = warp * 16 + gq + 8 * (e >> 1), c = j * 8 + 2 * tq + (e & 1);
          const float prob = kept[j][e] ? expf(lg[j][e] - st_m[n * kTileRows + r]) * st_z[n * kTileRows + r] : 0.f;
HW_UNROLL
          for (int rr = 0; rr < kR; ++rr) {
            pc[rr][j][e] += rwn[(5 + rr) * fs_r + r] * prob;
            pd[rr][j][e] += cwn[(5 + rr) * fs_c + c] * prob;
          }
        }
      if (n == hg - 1) {
        // The tile's 4 partials (a, b, c, d; both ranks a word) to the scratch [bg][4][chunk][T]
        // (c, d where the statistics sweep stored a, b).
        PartWordOf<T>* out = scratch;
HW_UNROLL
        for (int j = 0; j < kKeyN8; ++j)
HW_UNROLL
          for (int h = 0; h < 2; ++h) {
            const int r = warp * 16 + gq + 8 * h, t = q0 + r, s = s0 + j * 8 + 2 * tq;
            if (t >= TT || s >= TT) continue;
            PartWordOf<T> w[4][2];
HW_UNROLL
            for (int e2 = 0; e2 < 2; ++e2) {
              const int e = 2 * h + e2;
              w[0][e2] = pack_part<T>(pa[0][j][e], pa[1][j][e]);
              w[1][e2] = pack_part<T>(pb[0][j][e], pb[1][j][e]);
              w[2][e2] = pack_part<T>(pc[0][j][e], pc[1][j][e]);
              w[3][e2] = pack_part<T>(pd[0][j][e], pd[1][j][e]);
            }
            const bool pair = s + 1 < TT && (TT % 2 == 0), second = s + 1 < TT;
            PartWordOf<T>* dst = out + static_cast<int64_t>(t - mp.chunk0) * TT + s;
HW_UNROLL
            for (int x = 0; x < 4; ++x, dst += plane)
              if (x >= 2 || !ab_saved) store_part_words(dst, w[x][0], w[x][1], pair, second);
          }
      }
    }
  }
  hw::cp_async_wait<0>();
  if (!Partials) {
    // The split's (M, Z) of the tile's rows (-inf, 0 where a row keeps no key of the split).
    __syncthreads();
    const int64_t stats_plane = static_cast<int64_t>(p.B) * H * mp.chunk;
    float* out = mp.split_stats + static_cast<int64_t>(mp.split0 + blockIdx.x) * 2 * stats_plane;
    for (int i = threadIdx.x; i < hg * kTileRows; i += blockDim.x) {
      const int n = i / kTileRows, r = i % kTileRows, t = q0 + r;
      if (t >= TT) continue;
      const int64_t so = (static_cast<int64_t>(bg) * hg + n) * mp.chunk + t - mp.chunk0;
      out[so] = st_m[i];
      out[stats_plane + so] = st_z[i];
    }
  }
}

// Kernel 1b: stats [2, B, H, T] of the chunk's rows from the splits of each row's key band,
// in split order: M = max_i M_i, Z = sum_i Z_i exp(M_i - M) (splits where M_i = -inf
// skipped; one split gives M_0, Z_0 bitwise). Thread per row; CTA per (64-row query tile,
// head, b).
// Defined in dcmha_attention_mma_fp32_kernels.cuh (one translation unit).
__global__ void __launch_bounds__(kTileRows) dcmha_attn_stats_combine(const MmaAttnParams mp);

// Kernel 3: CTA per (head m, query tile of the chunk, b), heads fastest in the grid: the
// heads of a group read the same scratch partials of a tile (16 B per (t, s), twice the
// bytes of its K, V), so they run together and the partials come from HBM once, then from
// L2. DvTiles = dv_pad / 8 bound.
template <typename T, int DvTiles>
__global__ void __launch_bounds__(kMmaThreads) dcmha_attn_output(const MmaAttnParams mp) {
  const AttnParams& p = mp.f;
  const int H = p.H, TT = p.T, hg = p.hg, m = blockIdx.x, b = blockIdx.z;
  const int bg = b * (H / hg) + m / hg;
  const int q0 = mp.chunk0 + blockIdx.y * kTileRows;
  if (q0 >= TT) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gq = lane / 4, tq = lane % 4;
  const int ldq = tile_pitch(mp.dh_pad, sizeof(T)), ldv = tile_pitch(mp.dv_pad, sizeof(T)), dv_n8 = mp.dv_pad / 8;
  const int64_t head = static_cast<int64_t>(b) * H + m;

  unsigned char* base = hw::dynamic_shared_memory();
  T* qs = reinterpret_cast<T*>(base);                           // [64][max(ldq, ldv)]
  T* kbuf = qs + kTileRows * (ldq > ldv ? ldq : ldv);           // [2][32][ldq]
  T* vbuf = kbuf + 2 * kTileKeys * ldq;                         // [2][32][ldv]
  float* cw = reinterpret_cast<float*>(vbuf + 2 * kTileKeys * ldv);  // [2][6][32]

  const T* q = static_cast<const T*>(p.q) + head * TT * p.dh;
  const T* k = static_cast<const T*>(p.k) + head * TT * p.dh;
  const T* v = static_cast<const T*>(p.v) + head * TT * p.dv;
  const float* wt = mp.wt + head * mp.wfields * TT;
  const PartWordOf<T>* part = part_words<T>(mp.partials) + static_cast<int64_t>(bg) * mp.pwords * mp.chunk * TT;
  const int64_t plane = static_cast<int64_t>(mp.chunk) * TT;
  // Column field f < 6: W2 r0, W2 r1, G of slot 1 (pre), then of slot 3 (post).
  auto out_field = [](int f) {
    const int c = f < 3 ? 1 : 3, i = f % 3;
    return i < 2 ? wfield_w2(c, i) : wfield_g(c);
  };

  // Row constants of this thread's two rows.
  float rq[2][8];  // W2pre r0 r1, Gpre, W2post r0 r1, Gpost, M, 1/Z
HW_UNROLL
  for (int h = 0; h < 2; ++h) {
    const int t = q0 + warp * 16 + gq + 8 * h;
    const bool in = t < TT;
    rq[h][0] = in ? wt[wfield_w2(0, 0) * TT + t] : 0.f;
    rq[h][1] = in ? wt[wfield_w2(0, 1) * TT + t] : 0.f;
    rq[h][2] = in ? wt[wfield_g(0) * TT + t] : 0.f;
    rq[h][3] = in ? wt[wfield_w2(2, 0) * TT + t] : 0.f;
    rq[h][4] = in ? wt[wfield_w2(2, 1) * TT + t] : 0.f;
    rq[h][5] = in ? wt[wfield_g(2) * TT + t] : 0.f;
    rq[h][6] = in ? p.stats[head * TT + t] : 0.f;
    const float z = in ? p.stats[static_cast<int64_t>(p.B) * H * TT + head * TT + t] : 0.f;
    rq[h][7] = z > 0.f ? 1.f / z : 0.f;
  }

  int lo, hi;
  key_band(q0, kTileRows, TT, p.causal, p.window, lo, hi);
  const int kt_lo = lo / kTileKeys, kt_hi = hi > lo ? (hi + kTileKeys - 1) / kTileKeys : kt_lo;
  const int n_tiles = kt_hi - kt_lo;

  load_rows(qs, q, q0, kTileRows, TT, p.dh, mp.dh_pad, mp.vec16);
  auto issue = [&](int i) {
    if (i < n_tiles) {
      const int s0 = (kt_lo + i) * kTileKeys, stage = i & 1;
      load_rows(kbuf + stage * kTileKeys * ldq, k, s0, kTileKeys, TT, p.dh, mp.dh_pad, mp.vec16);
      load_rows(vbuf + stage * kTileKeys * ldv, v, s0, kTileKeys, TT, p.dv, mp.dv_pad, mp.vec16);
      // The tile's kOutFields x 32 column weights, a word a thread and step. Rolled: ptxas
      // unrolled the loop 4x with per-field offsets kept live, which spilled 8-12 bytes in
      // the 4-tile variants on sm_100 (its 128-register choice).
#pragma unroll 1
      for (int x = threadIdx.x; x < kOutFields * kTileKeys; x += kMmaThreads) {
        const int f = x / kTileKeys, c = x % kTileKeys, s = s0 + c;
        cw[(stage * kOutFields + f) * kTileKeys + c] = s < TT ? wt[out_field(f) * TT + s] : 0.f;
      }
    }
    hw::cp_async_commit();
  };

  float o[DvTiles][4];
  zero_tile(o);

  issue(0);
  for (int i = 0; i < n_tiles; ++i) {
    const int stage = i & 1, s0 = (kt_lo + i) * kTileKeys;
    __syncthreads();
    issue(i + 1);
    hw::cp_async_wait<1>();
    __syncthreads();
    float acc[kKeyN8][4];
    qk_tile<T>(acc, qs, kbuf + stage * kTileKeys * ldq, ldq, mp.dh_pad, warp, lane, p.scale);
    const float* cws = cw + stage * kOutFields * kTileKeys;
    // Compose on the fragments: L -> P -> P'.
HW_UNROLL
    for (int j = 0; j < kKeyN8; ++j)
HW_UNROLL
      for (int h = 0; h < 2; ++h) {
        const int r = warp * 16 + gq + 8 * h, t = q0 + r, c = j * 8 + 2 * tq, s = s0 + c;
        float pv[8][2];
        const bool in = t < TT && s < TT;
        if (in) {
          const bool pair = s + 1 < TT && (TT % 2 == 0);
          const PartWordOf<T>* src = part + static_cast<int64_t>(t - mp.chunk0) * TT + s;
HW_UNROLL
          for (int x = 0; x < 4; ++x, src += plane) {
            PartWordOf<T> w0, w1;
            load_part_words(src, w0, w1, pair, s + 1 < TT);
            unpack_part<T>(w0, pv[2 * x][0], pv[2 * x + 1][0]);
            unpack_part<T>(w1, pv[2 * x][1], pv[2 * x + 1][1]);
          }
        }
HW_UNROLL
        for (int e2 = 0; e2 < 2; ++e2) {
          const int e = 2 * h + e2, cc = c + e2;
          float y = 0.f;
          if (in && kept_pair(t, s + e2, TT, p.causal, p.window)) {
            float l = acc[j][e] * (1.f + rq[h][2] + cws[2 * kTileKeys + cc]) + rq[h][0] * pv[0][e2] +
                      rq[h][1] * pv[1][e2] + cws[0 * kTileKeys + cc] * pv[2][e2] + cws[1 * kTileKeys + cc] * pv[3][e2];
            const float prob = expf(l - rq[h][6]) * rq[h][7];
            y = prob * (1.f + rq[h][5] + cws[5 * kTileKeys + cc]) + rq[h][3] * pv[4][e2] + rq[h][4] * pv[5][e2] +
                cws[3 * kTileKeys + cc] * pv[6][e2] + cws[4 * kTileKeys + cc] * pv[7][e2];
          } else if (in && s + e2 < TT) {
            // Masked pairs have P = 0 but the post compose still mixes the other heads' P
            // through the partials, which are 0 there too: P' = 0.
            y = 0.f;
          }
          acc[j][e] = y;
        }
      }
    // O += P' V: P' as A fragments (k = the 32 keys), V by ldmatrix.trans (fp32: scalar loads).
    fragment_times_rows<T>(o, acc, vbuf + stage * kTileKeys * ldv, ldv, dv_n8, lane);
  }
  hw::cp_async_wait<0>();
  __syncthreads();  // every warp is done with qs: it takes the O tile
  store_row_tile<T>(o, qs, ldv, dv_n8, static_cast<T*>(p.out) + head * TT * p.dv, q0, TT, p.dv, mp.vec16, warp, lane);
}

}  // namespace dcmha
}  // namespace headwise
