// headwise SIMT emulator: the tensor-core and async-copy primitives of sm_80/sm_90, lane by
// lane as the PTX ISA documents them (included by simt.h). Kernels do not call these
// directly: csrc/common/mma_primitives.cuh wraps each one as hw::... with the inline PTX
// under nvcc and these functions in the emulated build.
//
//   mma_m16n8<MmaType>   mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32,
//                        mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 and
//                        mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32
//   ldmatrix<Num, Trans> ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{,.trans}.shared.b16
//   cp_async*            cp.async.{ca,cg}.shared.global, commit_group, wait_group, wait_all
//
// Fragment maps (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type",
// "... for mma.m16n8k8", "ldmatrix"); lane = %laneid, g = lane >> 2 (groupID),
// t = lane % 4 (threadID_in_group). A 32-bit register holding two 16-bit elements keeps
// the lower-indexed one in its low half.
//   m16n8k16 bf16/f16  A [16 x 16] row-major, 4 regs: reg r holds A[g + 8*(r&1)][2t + 8*(r>>1) + {0,1}]
//                      B [16 x 8] ("col": k-major per column), 2 regs: reg r holds B[2t + 8r + {0,1}][g]
//   m16n8k8 tf32       A [16 x 8], 4 regs: a0 A[g][t], a1 A[g+8][t], a2 A[g][t+4], a3 A[g+8][t+4]
//                      B [8 x 8], 2 regs: b0 B[t][g], b1 B[t+4][g]
//   m16n8k8 bf16       A [16 x 8], 2 regs: a0 A[g][2t + {0,1}], a1 A[g+8][2t + {0,1}]
//                      B [8 x 8], 1 reg: b0 B[2t + {0,1}][g]
//   C, D [16 x 8] fp32 4 regs: c0, c1 = C[g][2t + {0,1}], c2, c3 = C[g+8][2t + {0,1}]
//   ldmatrix m8n8 .xN  lane 8i + r gives the shared address of row r of matrix i (i < N; the
//                      addresses of the other lanes are ignored); every lane receives, per
//                      matrix i, the word holding row g, elements 2t and 2t+1 (.trans: the
//                      elements [2t][g] and [2t+1][g] of the stored matrix).
// Arithmetic: D = C + A B with products exact in fp32 and fp32 sums over k in ascending
// order (the tensor core's internal order and rounding may differ in the last bits). tf32
// operands are fp32 bit patterns whose low 13 mantissa bits the tensor core ignores: they
// are truncated (not rounded) here; kernels that want rounding convert with
// cvt.rna.tf32.f32 (wmma::__float_to_tf32) first.
//
// Checks (hw_sim::SimtError naming the instruction, where a GPU faults or is undefined):
// mma.sync and ldmatrix need a full, converged warp (all 32 lanes at the same instruction);
// ldmatrix row addresses must be 16-byte aligned and inside the block's dynamic shared
// memory, and must not read a cp.async destination before it landed and a barrier
// (__syncthreads, a __syncwarp of the copying lanes, or the cluster barrier) published it; cp.async sizes, alignment (both addresses to cp-size) and state spaces
// (shared destination in the dynamic shared memory, global source outside it).
//
// Metrics: HW_SIM_NOTE(kind, n) (the emulator's per-launch counters when the metrics
// header defines it, else nothing) counts one mma / ldmatrix per warp instruction and the
// cp-size bytes of every thread's cp.async.
#pragma once

#include "simt.h"

#if !defined(__CUDACC__)

#if __has_include("simt_metrics.h")
#include "simt_metrics.h"  // the emulator's per-launch counters (HW_SIM_NOTE)
#endif
#ifndef HW_SIM_NOTE
#define HW_SIM_NOTE(kind, n) ((void)0)
#endif

// In the profile library the warp operations' model code (which reads every lane's
// operands) is not instrumented: it is the emulator, not the kernel's accesses. The
// accesses the instructions themselves make are reported per lane instead, as the
// kernel's: ldmatrix's 16-byte shared row reads and cp.async's global read and shared
// write (HW_SIM_COUNT, the metrics hooks of simt_metrics.cpp).
#if defined(HW_SIM_PROFILE)
extern "C" void __asan_loadN_noabort(uintptr_t a, size_t n);
extern "C" void __asan_storeN_noabort(uintptr_t a, size_t n);
#define HW_SIM_NOT_COUNTED __attribute__((no_sanitize_address))
#define HW_SIM_COUNT(store, p, n)                                                     \
  ((store) ? __asan_storeN_noabort(reinterpret_cast<uintptr_t>(p), static_cast<size_t>(n)) \
           : __asan_loadN_noabort(reinterpret_cast<uintptr_t>(p), static_cast<size_t>(n)))
#else
#define HW_SIM_NOT_COUNTED
#define HW_SIM_COUNT(store, p, n) ((void)0)
#endif

namespace hw_sim {
namespace prim {

// bf16_k8: m16n8k8 of bf16 (A 2 registers, B 1; the wrapper's a[2], a[3] and b[1] unused).
enum class MmaType { bf16, f16, tf32, bf16_k8 };

struct MmaLaneOperands {
  uint32_t a[4];
  uint32_t b[2];
  float c[4];
};

// Element `half` (0: low 16 bits, 1: high) of a register holding two bf16 / f16 values.
template <MmaType T>
inline float unpack_half(uint32_t reg, int half) {
  const uint16_t bits = static_cast<uint16_t>(half ? reg >> 16 : reg & 0xffffu);
  if (T == MmaType::bf16 || T == MmaType::bf16_k8)
    return static_cast<float>(c10::BFloat16(bits, c10::BFloat16::from_bits()));
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// TF32 operand as the tensor core reads it: the low 13 mantissa bits are ignored.
inline float tf32_operand(uint32_t reg) {
  float f = __uint_as_float(reg);
  return nvcuda::wmma::detail::tf32_truncate(f);
}

// Runs once per warp instruction with every lane's MmaLaneOperands and float[4] result.
template <MmaType T>
HW_SIM_NOT_COUNTED void mma_m16n8_warp(const void* const* lane_in, void* const* lane_out) {
  constexpr int K = T == MmaType::tf32 || T == MmaType::bf16_k8 ? 8 : 16;
  float A[16][K], B[K][8], C[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    const MmaLaneOperands& o = *static_cast<const MmaLaneOperands*>(lane_in[lane]);
    const int g = lane >> 2, t = lane & 3;
    if (T == MmaType::tf32) {
      A[g][t] = tf32_operand(o.a[0]);
      A[g + 8][t] = tf32_operand(o.a[1]);
      A[g][t + 4] = tf32_operand(o.a[2]);
      A[g + 8][t + 4] = tf32_operand(o.a[3]);
      B[t][g] = tf32_operand(o.b[0]);
      B[t + 4][g] = tf32_operand(o.b[1]);
    } else if (T == MmaType::bf16_k8) {
      for (int h = 0; h < 2; ++h) {
        A[g][2 * t + h] = unpack_half<T>(o.a[0], h);
        A[g + 8][2 * t + h] = unpack_half<T>(o.a[1], h);
        B[2 * t + h][g] = unpack_half<T>(o.b[0], h);
      }
    } else {
      for (int r = 0; r < 4; ++r)
        for (int h = 0; h < 2; ++h) A[g + 8 * (r & 1)][2 * t + 8 * (r >> 1) + h] = unpack_half<T>(o.a[r], h);
      for (int r = 0; r < 2; ++r)
        for (int h = 0; h < 2; ++h) B[2 * t + 8 * r + h][g] = unpack_half<T>(o.b[r], h);
    }
    for (int h = 0; h < 2; ++h) {
      C[g][2 * t + h] = o.c[h];
      C[g + 8][2 * t + h] = o.c[2 + h];
    }
  }
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, t = lane & 3;
    float* d = static_cast<float*>(lane_out[lane]);
    for (int i = 0; i < 4; ++i) {
      const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
      float acc = C[row][col];
      for (int k = 0; k < K; ++k) acc += A[row][k] * B[k][col];
      d[i] = acc;
    }
  }
  HW_SIM_NOTE(mma, 1);
}

// D = A B + C for one warp (d may alias c); a, b, c, d are this lane's fragment registers.
template <MmaType T>
constexpr const char* mma_name() {
  return T == MmaType::bf16      ? "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
         : T == MmaType::f16     ? "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
         : T == MmaType::bf16_k8 ? "mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32"
                                 : "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32";
}

template <MmaType T>
inline void mma_m16n8(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], const float (&c)[4]) {
  const MmaLaneOperands in{{a[0], a[1], a[2], a[3]}, {b[0], b[1]}, {c[0], c[1], c[2], c[3]}};
  float out[4];
  detail::warp_op(detail::kMmaSync, mma_name<T>(), &mma_m16n8_warp<T>, &in, out);
  for (int i = 0; i < 4; ++i) d[i] = out[i];
}

template <int Num, bool Trans>
constexpr const char* ldmatrix_name() {
  return Num == 1 ? (Trans ? "ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16" : "ldmatrix.sync.aligned.m8n8.x1.shared.b16")
         : Num == 2 ? (Trans ? "ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16" : "ldmatrix.sync.aligned.m8n8.x2.shared.b16")
                    : (Trans ? "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" : "ldmatrix.sync.aligned.m8n8.x4.shared.b16");
}

// Runs once per warp instruction: lane_in[l] points to lane l's row address (const void*),
// lane_out[l] to its uint32_t[Num] result.
template <int Num, bool Trans>
HW_SIM_NOT_COUNTED void ldmatrix_warp(const void* const* lane_in, void* const* lane_out) {
  constexpr const char* name = ldmatrix_name<Num, Trans>();
  uint16_t m[Num][8][8];  // m[i][row][col]: matrix i as stored, 8 rows of 8 b16 elements
  for (int i = 0; i < Num; ++i)
    for (int r = 0; r < 8; ++r) {
      const int lane = 8 * i + r;
      const void* row = *static_cast<const void* const*>(lane_in[lane]);
      auto which = [&] {  // built only for an error message
        return " (lane " + std::to_string(lane) + ", row " + std::to_string(r) + " of matrix " + std::to_string(i) +
               ")";
      };
      if (!detail::in_shared_window(row, 16))
        detail::device_error(std::string(name) + ": row address" + which() +
                             " is not inside the block's dynamic shared memory (hw::dynamic_shared_memory())");
      if (reinterpret_cast<uintptr_t>(row) % 16 != 0)
        detail::device_error(std::string(name) + ": row address" + which() + " is not 16-byte aligned");
      detail::check_async_copies_visible(row, 16, name);
      std::memcpy(m[i][r], row, 16);
    }
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, t = lane & 3;
    uint32_t* out = static_cast<uint32_t*>(lane_out[lane]);
    for (int i = 0; i < Num; ++i) {
      const uint16_t lo = Trans ? m[i][2 * t][g] : m[i][g][2 * t];
      const uint16_t hi = Trans ? m[i][2 * t + 1][g] : m[i][g][2 * t + 1];
      out[i] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
    }
  }
  HW_SIM_NOTE(ldmatrix, 1);
}

template <int Num, bool Trans>
inline void ldmatrix(uint32_t (&r)[Num], const void* row_address) {
  static_assert(Num == 1 || Num == 2 || Num == 4, "ldmatrix loads 1, 2 or 4 matrices");
  uint32_t out[Num];
  const unsigned tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  if (tid % 32 < 8 * Num) HW_SIM_COUNT(false, row_address, 16);  // this lane's row
  detail::warp_op(detail::kLdmatrix, ldmatrix_name<Num, Trans>(), &ldmatrix_warp<Num, Trans>, &row_address, out);
  for (int i = 0; i < Num; ++i) r[i] = out[i];
}

// cp.async.{ca,cg}.shared.global [dst], [src], cp_size, src_size.
inline void cp_async(void* dst, const void* src, unsigned cp_size, unsigned src_size, bool cache_global) {
  if (src_size) {
    HW_SIM_NOTE(async_load, 0);
    HW_SIM_COUNT(false, src, src_size);
  }
  HW_SIM_COUNT(true, dst, cp_size);
  detail::cp_async(dst, src, cp_size, src_size, cache_global);
  HW_SIM_NOTE(cp_async_bytes, cp_size);
}

}  // namespace prim
}  // namespace hw_sim

#endif  // !defined(__CUDACC__)
