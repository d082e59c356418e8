// Tensor-core and async-copy primitives with one spelling for both builds of a kernel:
// inline PTX under nvcc (sm_80 and newer), the SIMT emulator's lane-exact model
// (csrc/common/simt/primitives.h, which documents the fragment maps and the checks)
// in the emulated build.
//
//   hw::mma_m16n8k16_bf16(d, a, b, c)  mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32
//   hw::mma_m16n8k16_f16(d, a, b, c)   mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32
//   hw::mma_m16n8k8_tf32(d, a, b, c)   mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32
//       d, c: float[4]; a: uint32_t[4]; b: uint32_t[2] (this lane's fragment registers)
//   hw::mma_m16n8k8_bf16(d, a, b, c)   mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32
//       a: uint32_t[2]; b: one uint32_t
//   hw::mma_step<T>(d, a, b)           d += A B over one 32-byte k step of T: m16n8k16 for
//       bf16 / fp16, m16n8k8 tf32 for float (fp32 bit patterns as operands)
//   hw::ldmatrix<Num, Trans>(r, row)   ldmatrix.sync.aligned.m8n8.x{Num}{.trans}.shared.b16
//       r: uint32_t[Num]; row: this lane's row address in shared memory (lanes 0..8*Num-1)
//   hw::cp_async_ca<Bytes>(dst, src, src_bytes)   cp.async.ca.shared.global, Bytes = 4, 8, 16
//   hw::cp_async_cg16(dst, src, src_bytes)        cp.async.cg.shared.global, 16 bytes
//       copies src_bytes (<= the copy size) and zero-fills the rest of the copy
//   hw::cp_async_cg16_full(dst, src)              the same for a whole chunk (no size operand)
//   hw::SmemAddr(p)                    a dynamic-shared-memory byte address formed once (see below);
//       ldmatrix and the cp.async copies also take one in place of a pointer
//   hw::cp_async_commit()              cp.async.commit_group
//   hw::cp_async_wait<N>()             cp.async.wait_group N (all but the N newest groups landed)
//   hw::cp_async_wait_upto(newer)      the same with a run-time count, clamped to 7 (a stronger wait)
//   hw::cp_async_wait_all()            cp.async.wait_all
// A cp.async is visible to the issuing thread after its wait, to the block's other threads
// after a __syncthreads that follows the wait (to its warp's lanes after a __syncwarp). Shared operands must lie in the dynamic
// shared memory (hw::dynamic_shared_memory()): that is the buffer the emulator checks.
#pragma once

#include "simt_portability.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

namespace hw {

// PTX for sm_80 and newer; compiled for an older arch the primitive traps.
#if !HW_SIM && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define HW_PRIM_PTX 1
#else
#define HW_PRIM_PTX 0
#endif

#if !HW_SIM
__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
#endif

// A byte address in the dynamic shared memory: the 32-bit shared-window address under nvcc,
// a pointer in the emulator. A K loop forms its ring's address once and offsets it (an
// IADD, or an immediate of the access) instead of converting a generic pointer per access:
// on sm_90 that conversion re-reads the CTA's shared window (S2UR SR_CgaCtaId) each time.
struct SmemAddr {
#if HW_SIM
  unsigned char* p;
  SmemAddr() = default;
  explicit SmemAddr(const void* ptr) : p(static_cast<unsigned char*>(const_cast<void*>(ptr))) {}
  SmemAddr operator+(int bytes) const { return SmemAddr(p + bytes); }
  void* pointer() const { return p; }
#else
  uint32_t a;
  SmemAddr() = default;
  __device__ __forceinline__ explicit SmemAddr(const void* ptr) : a(shared_address(ptr)) {}
  __device__ __forceinline__ SmemAddr operator+(int bytes) const {
    SmemAddr r = *this;
    r.a += static_cast<uint32_t>(bytes);
    return r;
  }
  // The generic pointer (for plain shared loads and stores).
  __device__ __forceinline__ void* pointer() const {
    return __cvta_shared_to_generic(a);
  }
#endif
};

// D = A B + C over one 16x8 tile, fp32 accumulation (d may alias c).
#if HW_SIM
#define HW_MMA_BODY(sim_type, ptx) hw_sim::prim::mma_m16n8<hw_sim::prim::MmaType::sim_type>(d, a, b, c);
#elif HW_PRIM_PTX
#define HW_MMA_BODY(sim_type, ptx)                                                                        \
  asm volatile(ptx " {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"               \
               : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])                                           \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]),   \
                 "f"(c[2]), "f"(c[3]));
#else
#define HW_MMA_BODY(sim_type, ptx) \
  (void)d;                         \
  (void)a;                         \
  (void)b;                         \
  (void)c;                         \
  __trap();
#endif
#define HW_DEFINE_MMA(fn, sim_type, ptx)                                                            \
  __device__ __forceinline__ void fn(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], \
                                     const float (&c)[4]) {                                         \
    HW_MMA_BODY(sim_type, ptx)                                                                      \
  }
HW_DEFINE_MMA(mma_m16n8k16_bf16, bf16, "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32")
HW_DEFINE_MMA(mma_m16n8k16_f16, f16, "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32")
HW_DEFINE_MMA(mma_m16n8k8_tf32, tf32, "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32")
#undef HW_DEFINE_MMA
#undef HW_MMA_BODY

// D = A B + C over a 16x8 tile with k = 8 of bf16: half the k16 product's work, for
// elementwise products by a diagonal B (a: 2 registers, b: 1).
__device__ __forceinline__ void mma_m16n8k8_bf16(float (&d)[4], const uint32_t (&a)[2], uint32_t b,
                                                 const float (&c)[4]) {
#if HW_SIM
  const uint32_t a4[4] = {a[0], a[1], 0u, 0u}, b2[2] = {b, 0u};
  hw_sim::prim::mma_m16n8<hw_sim::prim::MmaType::bf16_k8>(d, a4, b2, c);
#elif HW_PRIM_PTX
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%7, %8, %9, %10};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(b), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
#else
  (void)d;
  (void)a;
  (void)b;
  (void)c;
  __trap();
#endif
}

// One k step of 32 bytes of T: k16 of bf16 / fp16, k8 of tf32 for float. The A and B fragments
// of both cover the same bytes of their rows (a lane's register holds 4 bytes of k at byte
// 4 (lane % 4), and 16 bytes further), so one ldmatrix addressing serves every T.
template <typename T>
__device__ __forceinline__ void mma_step(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  if constexpr (std::is_same<T, c10::BFloat16>::value)
    mma_m16n8k16_bf16(d, a, b, d);
  else if constexpr (std::is_same<T, c10::Half>::value)
    mma_m16n8k16_f16(d, a, b, d);
  else
    mma_m16n8k8_tf32(d, a, b, d);  // fp32 bit patterns; the tensor core drops the low 13 mantissa bits
}

template <int Num, bool Trans = false>
__device__ __forceinline__ void ldmatrix(uint32_t (&r)[Num], SmemAddr row_address) {
  static_assert(Num == 1 || Num == 2 || Num == 4, "ldmatrix loads 1, 2 or 4 matrices");
#if HW_SIM
  hw_sim::prim::ldmatrix<Num, Trans>(r, row_address.p);
#elif HW_PRIM_PTX
  const uint32_t s = row_address.a;
  if constexpr (Num == 1 && !Trans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(s) : "memory");
  else if constexpr (Num == 1)
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(s) : "memory");
  else if constexpr (Num == 2 && !Trans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(s) : "memory");
  else if constexpr (Num == 2)
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(s) : "memory");
  else if constexpr (!Trans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s) : "memory");
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s) : "memory");
#else
  (void)r;
  (void)row_address;
  __trap();
#endif
}

template <int Num, bool Trans = false>
__device__ __forceinline__ void ldmatrix(uint32_t (&r)[Num], const void* row_address) {
  ldmatrix<Num, Trans>(r, SmemAddr(row_address));
}

template <int Bytes>
__device__ __forceinline__ void cp_async_ca(SmemAddr smem_dst, const void* gmem_src, int src_bytes = Bytes) {
  static_assert(Bytes == 4 || Bytes == 8 || Bytes == 16, "cp.async.ca copies 4, 8 or 16 bytes");
#if HW_SIM
  hw_sim::prim::cp_async(smem_dst.p, gmem_src, Bytes, static_cast<unsigned>(src_bytes), false);
#elif HW_PRIM_PTX
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(smem_dst.a), "l"(gmem_src),
               "n"(Bytes), "r"(src_bytes)
               : "memory");
#else
  (void)smem_dst;
  (void)gmem_src;
  (void)src_bytes;
  __trap();
#endif
}

__device__ __forceinline__ void cp_async_cg16(SmemAddr smem_dst, const void* gmem_src, int src_bytes = 16) {
#if HW_SIM
  hw_sim::prim::cp_async(smem_dst.p, gmem_src, 16, static_cast<unsigned>(src_bytes), true);
#elif HW_PRIM_PTX
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_dst.a), "l"(gmem_src),
               "r"(src_bytes)
               : "memory");
#else
  (void)smem_dst;
  (void)gmem_src;
  (void)src_bytes;
  __trap();
#endif
}

// cp.async.cg of a whole 16-byte chunk (no source size operand: nothing to zero-fill).
__device__ __forceinline__ void cp_async_cg16_full(SmemAddr smem_dst, const void* gmem_src) {
#if HW_SIM
  hw_sim::prim::cp_async(smem_dst.p, gmem_src, 16, 16u, true);
#elif HW_PRIM_PTX
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_dst.a), "l"(gmem_src)
               : "memory");
#else
  (void)smem_dst;
  (void)gmem_src;
  __trap();
#endif
}

// p advanced by a byte offset (a copy source: one 64-bit add where the offset is kept in bytes).
template <typename T>
__device__ __forceinline__ const T* byte_offset(const T* p, int64_t bytes) {
  return reinterpret_cast<const T*>(reinterpret_cast<const unsigned char*>(p) + bytes);
}

// The same copies to a generic pointer into the dynamic shared memory.
template <int Bytes>
__device__ __forceinline__ void cp_async_ca(void* smem_dst, const void* gmem_src, int src_bytes = Bytes) {
  cp_async_ca<Bytes>(SmemAddr(smem_dst), gmem_src, src_bytes);
}
__device__ __forceinline__ void cp_async_cg16(void* smem_dst, const void* gmem_src, int src_bytes = 16) {
  cp_async_cg16(SmemAddr(smem_dst), gmem_src, src_bytes);
}
__device__ __forceinline__ void cp_async_cg16_full(void* smem_dst, const void* gmem_src) {
  cp_async_cg16_full(SmemAddr(smem_dst), gmem_src);
}

__device__ __forceinline__ void cp_async_commit() {
#if HW_SIM
  hw_sim::detail::cp_async_commit_group();
#elif HW_PRIM_PTX
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  static_assert(N >= 0, "cp.async.wait_group N needs N >= 0");
#if HW_SIM
  hw_sim::detail::cp_async_wait_group(N);
#elif HW_PRIM_PTX
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// cp.async.wait_group with a run-time count: every group but the `newer` newest has
// landed on return. The count is an immediate of the instruction, so this switches over
// 0..7; more than 7 newer groups wait as if there were 7 (all but the 7 newest).
__device__ __forceinline__ void cp_async_wait_upto(int newer) {
  switch (newer) {
    case 0: cp_async_wait<0>(); break;
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    case 3: cp_async_wait<3>(); break;
    case 4: cp_async_wait<4>(); break;
    case 5: cp_async_wait<5>(); break;
    case 6: cp_async_wait<6>(); break;
    default: cp_async_wait<7>(); break;
  }
}

__device__ __forceinline__ void cp_async_wait_all() {
#if HW_SIM
  hw_sim::detail::cp_async_commit_group();
  hw_sim::detail::cp_async_wait_group(0);
#elif HW_PRIM_PTX
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

}  // namespace hw
