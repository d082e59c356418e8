// headwise SIMT emulator: CUDA device built-ins for a plain C++17 host compiler.
//
// Include this header instead of the CUDA headers when __CUDACC__ is not
// defined. Device code written for CUDA then compiles unchanged with g++ and
// runs on the CPU: every CUDA thread is a fiber, the fibers of one block run
// cooperatively on one OS thread, and blocks may run in parallel on different
// OS threads (see README.md in this folder).
//
// Under nvcc (__CUDACC__ defined) this header is intentionally empty.
#pragma once

#if !defined(__CUDACC__)

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <math.h>  // libstdc++'s <math.h> also puts isfinite/isnan/... in ::

#include <atomic>
#include <cassert>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>

#define HW_SIM_EMULATION 1

// ---------------------------------------------------------------------------
// Qualifiers
// ---------------------------------------------------------------------------
#ifndef __global__
#define __global__
#endif
#ifndef __device__
#define __device__
#endif
#ifndef __host__
#define __host__
#endif
#ifndef __constant__
#define __constant__
#endif
#ifndef __managed__
#define __managed__
#endif
// __noinline__ is deliberately not defined: libstdc++ uses __attribute__((__noinline__)).
#ifndef __forceinline__
#define __forceinline__ inline __attribute__((always_inline))
#endif
#ifndef __restrict__
#define __restrict__ __restrict
#endif
#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif
#ifndef __align__
#define __align__(n) __attribute__((aligned(n)))
#endif
// Static shared memory: one instance per OS thread. A block runs on one OS
// thread from start to end and blocks on one OS thread run one after another,
// so `__shared__ T buf[N];` inside a kernel body is per-block storage. It is
// NOT reset or poisoned between blocks (unlike the dynamic buffer).
// `extern __shared__ T buf[];` is not supported: use hw_sim::dynamic_shared_memory().
#ifndef __shared__
#define __shared__ static thread_local
#endif

// ---------------------------------------------------------------------------
// dim3, vector types, built-in index variables
// ---------------------------------------------------------------------------
#define HW_SIM_VEC2(T, N, A)                                   \
  struct __attribute__((aligned(A))) N##2 { T x, y; };         \
  inline N##2 make_##N##2(T x, T y) { return N##2{x, y}; }
#define HW_SIM_VEC3(T, N)                                      \
  struct N##3 { T x, y, z; };                                  \
  inline N##3 make_##N##3(T x, T y, T z) { return N##3{x, y, z}; }
#define HW_SIM_VEC4(T, N, A)                                   \
  struct __attribute__((aligned(A))) N##4 { T x, y, z, w; };   \
  inline N##4 make_##N##4(T x, T y, T z, T w) { return N##4{x, y, z, w}; }
HW_SIM_VEC2(int, int, 8)
HW_SIM_VEC3(int, int)
HW_SIM_VEC4(int, int, 16)
HW_SIM_VEC2(unsigned, uint, 8)
HW_SIM_VEC3(unsigned, uint)
HW_SIM_VEC4(unsigned, uint, 16)
HW_SIM_VEC2(float, float, 8)
HW_SIM_VEC3(float, float)
HW_SIM_VEC4(float, float, 16)
HW_SIM_VEC2(double, double, 16)
HW_SIM_VEC2(long long, longlong, 16)
#undef HW_SIM_VEC2
#undef HW_SIM_VEC3
#undef HW_SIM_VEC4

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
  constexpr operator uint3() const { return uint3{x, y, z}; }
};

// Per-OS-thread built-ins. The scheduler rewrites threadIdx on every switch to
// a fiber and blockIdx/blockDim/gridDim at the start of every block, so plain
// reads in kernel code see the values of the current CUDA thread. (Fibers never
// migrate between OS threads.) Defined in simt_runtime.cpp.
#define HW_SIM_HIDDEN __attribute__((visibility("hidden")))
extern HW_SIM_HIDDEN __thread dim3 threadIdx;
extern HW_SIM_HIDDEN __thread dim3 blockIdx;
extern HW_SIM_HIDDEN __thread dim3 blockDim;
extern HW_SIM_HIDDEN __thread dim3 gridDim;
static constexpr int warpSize = 32;

// ---------------------------------------------------------------------------
// Half types
// ---------------------------------------------------------------------------
using __half = c10::Half;
using half = c10::Half;
using __nv_bfloat16 = c10::BFloat16;

// ---------------------------------------------------------------------------
// Runtime interface
// ---------------------------------------------------------------------------
namespace hw_sim {

struct SimtError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Runs body() once per thread of every block. Blocks may run in parallel
// through the parallel-for hook; a block's threads run as fibers on one OS
// thread. Errors (bad config, deadlock, divergent collective, exceptions
// thrown by device code, __trap) are rethrown from here.
void launch(const char* kernel_name, dim3 grid, dim3 block, size_t dynamic_smem_bytes,
            const std::function<void()>& body);

// parallel_for(begin, end, fn) must call fn(lo, hi) over disjoint sub-ranges
// covering [begin, end). Default: fn(begin, end) on the calling thread.
using ParallelFor = void (*)(int64_t begin, int64_t end,
                             const std::function<void(int64_t, int64_t)>& fn);
void set_parallel_for(ParallelFor);  // nullptr restores the sequential default

// launch() with thread block clusters (sm_90): grid must be a multiple of `cluster` in
// every dimension, at most 8 CTAs per cluster. The CTAs of one cluster are co-resident:
// they run interleaved on one OS thread, so a cluster barrier waits for all of them, and
// each can read and write the others' dynamic shared memory (detail::cluster_map_shared).
void launch_cluster(const char* kernel_name, dim3 grid, dim3 block, dim3 cluster, size_t dynamic_smem_bytes,
                    const std::function<void()>& body);

// Current block's dynamic shared memory: 128-byte aligned, sized by the launch,
// filled with 0xFF at block start. nullptr outside a kernel.
unsigned char* dynamic_shared_memory();

namespace detail {
enum CollKind : int {
  kShflIdx = 1,
  kShflUp,
  kShflDown,
  kShflXor,
  kVoteAll,
  kVoteAny,
  kVoteBallot,
  kSyncWarp,
  kWmmaFill,
  kWmmaLoad,
  kWmmaStore,
  kWmmaMma,
  kMmaSync,   // warp_op: mma.sync.aligned (primitives.h)
  kLdmatrix,  // warp_op: ldmatrix.sync.aligned (primitives.h)
};
// op: 0 = __syncthreads, 1 = _count, 2 = _and, 3 = _or
int block_barrier(int op, int pred);
// Shuffles: copies `size` bytes of this lane's value, blocks until the group
// named by mask has arrived, writes the result to out.
void warp_shfl(int kind, unsigned mask, const void* in, void* out, unsigned size, int arg,
               int width);
unsigned warp_vote(int kind, unsigned mask, int pred);
void warp_sync(int kind, unsigned mask);
unsigned active_mask();
[[noreturn]] void trap();
long long clock_now();
void yield_thread();  // let the block's other threads run (used by __nanosleep)

// --- Emulated GPU primitives (implementations of primitives.h; see README.md) ---
// A `.sync.aligned` warp operation: every lane of a full warp (32 threads) posts pointers
// to its operands and results; when the last lane arrives, fn runs once with all lanes'
// pointers in lane order and writes every lane's results. kind is kMmaSync or kLdmatrix
// and name (the instruction, for errors); lanes calling different fns are a divergent warp.
using WarpOpFn = void (*)(const void* const* lane_in, void* const* lane_out);
void warp_op(int kind, const char* name, WarpOpFn fn, const void* in, void* out);
// Throws SimtError "headwise sim: kernel 'k' block (..) thread (..): <what>".
[[noreturn]] void device_error(const std::string& what);
// True when [p, p + bytes) lies in the current block's dynamic shared memory.
bool in_shared_window(const void* p, size_t bytes);
// For shared-memory reads by ldmatrix: fails when a byte of [p, p + bytes) is the
// destination of a cp.async that has not landed, or that landed without a __syncthreads
// since (other threads may not see it yet). `who` names the reading instruction.
void check_async_copies_visible(const void* p, size_t bytes, const char* who);
// cp.async of cp_size bytes (4, 8, 16; 16 only for .cg) from global src to shared dst,
// src_size bytes copied and the rest zero-filled. The destination reads as 0xFF poison
// until the issuing thread's cp.async.wait_group retires the copy's group.
void cp_async(void* dst, const void* src, unsigned cp_size, unsigned src_size, bool cache_global);
void cp_async_commit_group();
void cp_async_wait_group(int pending_groups_allowed);
// Thread block clusters (a launch without a cluster shape is a cluster of one CTA).
unsigned cluster_ctarank();   // x + y*cx + z*cx*cy of this CTA in its cluster
unsigned cluster_num_ctas();  // cx * cy * cz
void cluster_barrier();       // barrier.cluster.arrive + wait of every thread of the cluster
void* cluster_map_shared(const void* p, unsigned rank);  // mapa: p's place in CTA `rank`
}  // namespace detail
}  // namespace hw_sim

// ---------------------------------------------------------------------------
// Block synchronisation and fences
// ---------------------------------------------------------------------------
inline void __syncthreads() { hw_sim::detail::block_barrier(0, 0); }
inline int __syncthreads_count(int pred) { return hw_sim::detail::block_barrier(1, pred); }
inline int __syncthreads_and(int pred) { return hw_sim::detail::block_barrier(2, pred); }
inline int __syncthreads_or(int pred) { return hw_sim::detail::block_barrier(3, pred); }

inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }

// ---------------------------------------------------------------------------
// Warp collectives
// ---------------------------------------------------------------------------
namespace hw_sim {
namespace detail {
template <typename T>
inline T shfl(int kind, unsigned mask, T var, int arg, int width) {
  static_assert(std::is_trivially_copyable<T>::value, "warp shuffle needs a trivially copyable type");
  static_assert(sizeof(T) <= 16, "warp shuffle supports values of at most 16 bytes");
  T out = var;
  warp_shfl(kind, mask, &var, &out, static_cast<unsigned>(sizeof(T)), arg, width);
  return out;
}
}  // namespace detail
}  // namespace hw_sim

template <typename T>
inline T __shfl_sync(unsigned mask, T var, int srcLane, int width = warpSize) {
  return hw_sim::detail::shfl(hw_sim::detail::kShflIdx, mask, var, srcLane, width);
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  return hw_sim::detail::shfl(hw_sim::detail::kShflUp, mask, var, static_cast<int>(delta), width);
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  return hw_sim::detail::shfl(hw_sim::detail::kShflDown, mask, var, static_cast<int>(delta), width);
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T var, int laneMask, int width = warpSize) {
  return hw_sim::detail::shfl(hw_sim::detail::kShflXor, mask, var, laneMask, width);
}
inline int __all_sync(unsigned mask, int pred) {
  return static_cast<int>(hw_sim::detail::warp_vote(hw_sim::detail::kVoteAll, mask, pred));
}
inline int __any_sync(unsigned mask, int pred) {
  return static_cast<int>(hw_sim::detail::warp_vote(hw_sim::detail::kVoteAny, mask, pred));
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  return hw_sim::detail::warp_vote(hw_sim::detail::kVoteBallot, mask, pred);
}
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  hw_sim::detail::warp_sync(hw_sim::detail::kSyncWarp, mask);
}
inline unsigned __activemask() { return hw_sim::detail::active_mask(); }

// ---------------------------------------------------------------------------
// Atomics (safe across OS threads; relaxed ordering like CUDA's atomicXxx)
// ---------------------------------------------------------------------------
namespace hw_sim {
namespace detail {
template <typename T, typename F>
inline T atomic_cas_loop(T* address, F update) {
  T old;
  __atomic_load(address, &old, __ATOMIC_RELAXED);
  T desired;
  do {
    desired = update(old);
  } while (!__atomic_compare_exchange(address, &old, &desired, true, __ATOMIC_RELAXED,
                                      __ATOMIC_RELAXED));
  return old;
}
}  // namespace detail
}  // namespace hw_sim

#define HW_SIM_ATOMIC_INT(T)                                                                     \
  inline T atomicAdd(T* a, T v) { return __atomic_fetch_add(a, v, __ATOMIC_RELAXED); }          \
  inline T atomicSub(T* a, T v) { return __atomic_fetch_sub(a, v, __ATOMIC_RELAXED); }          \
  inline T atomicExch(T* a, T v) { return __atomic_exchange_n(a, v, __ATOMIC_RELAXED); }        \
  inline T atomicAnd(T* a, T v) { return __atomic_fetch_and(a, v, __ATOMIC_RELAXED); }          \
  inline T atomicOr(T* a, T v) { return __atomic_fetch_or(a, v, __ATOMIC_RELAXED); }            \
  inline T atomicXor(T* a, T v) { return __atomic_fetch_xor(a, v, __ATOMIC_RELAXED); }          \
  inline T atomicMax(T* a, T v) {                                                               \
    return hw_sim::detail::atomic_cas_loop(a, [v](T o) { return o < v ? v : o; });             \
  }                                                                                             \
  inline T atomicMin(T* a, T v) {                                                               \
    return hw_sim::detail::atomic_cas_loop(a, [v](T o) { return v < o ? v : o; });             \
  }                                                                                             \
  inline T atomicCAS(T* a, T compare, T val) {                                                  \
    __atomic_compare_exchange_n(a, &compare, val, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);   \
    return compare;                                                                             \
  }
HW_SIM_ATOMIC_INT(int)
HW_SIM_ATOMIC_INT(unsigned)
HW_SIM_ATOMIC_INT(unsigned long long)
HW_SIM_ATOMIC_INT(long long)
#undef HW_SIM_ATOMIC_INT

inline float atomicAdd(float* a, float v) {
  return hw_sim::detail::atomic_cas_loop(a, [v](float o) { return o + v; });
}
inline double atomicAdd(double* a, double v) {
  return hw_sim::detail::atomic_cas_loop(a, [v](double o) { return o + v; });
}
inline float atomicExch(float* a, float v) {
  float old;
  __atomic_exchange(a, &v, &old, __ATOMIC_RELAXED);
  return old;
}
inline unsigned atomicInc(unsigned* a, unsigned v) {
  return hw_sim::detail::atomic_cas_loop(a, [v](unsigned o) { return o >= v ? 0u : o + 1u; });
}
inline unsigned atomicDec(unsigned* a, unsigned v) {
  return hw_sim::detail::atomic_cas_loop(
      a, [v](unsigned o) { return (o == 0u || o > v) ? v : o - 1u; });
}

// ---------------------------------------------------------------------------
// Bit manipulation and reinterpretation
// ---------------------------------------------------------------------------
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __clzll(long long x) {
  return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x));
}
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
  x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
  x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
  x = ((x >> 4) & 0x0F0F0F0Fu) | ((x & 0x0F0F0F0Fu) << 4);
  x = ((x >> 8) & 0x00FF00FFu) | ((x & 0x00FF00FFu) << 8);
  return (x >> 16) | (x << 16);
}
inline unsigned long long __brevll(unsigned long long x) {
  return (static_cast<unsigned long long>(__brev(static_cast<unsigned>(x))) << 32) |
         __brev(static_cast<unsigned>(x >> 32));
}
inline unsigned __umulhi(unsigned a, unsigned b) {
  return static_cast<unsigned>((static_cast<unsigned long long>(a) * b) >> 32);
}
inline int __mulhi(int a, int b) {
  return static_cast<int>((static_cast<long long>(a) * b) >> 32);
}
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
  __extension__ typedef unsigned __int128 u128;
  return static_cast<unsigned long long>((static_cast<u128>(a) * b) >> 64);
}
inline unsigned __funnelshift_l(unsigned lo, unsigned hi, unsigned shift) {
  const unsigned s = shift & 31u;
  return s == 0 ? hi : (hi << s) | (lo >> (32u - s));
}
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned shift) {
  const unsigned s = shift & 31u;
  return s == 0 ? lo : (lo >> s) | (hi << (32u - s));
}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const unsigned long long v = (static_cast<unsigned long long>(y) << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) {
    const unsigned sel = (s >> (4 * i)) & 7u;
    r |= static_cast<unsigned>((v >> (8 * sel)) & 0xFFu) << (8 * i);
  }
  return r;
}

namespace hw_sim {
namespace detail {
template <typename To, typename From>
inline To bit_cast(const From& f) {
  static_assert(sizeof(To) == sizeof(From), "size mismatch");
  To t;
  std::memcpy(&t, &f, sizeof(To));
  return t;
}
}  // namespace detail
}  // namespace hw_sim
inline int __float_as_int(float x) { return hw_sim::detail::bit_cast<int>(x); }
inline unsigned __float_as_uint(float x) { return hw_sim::detail::bit_cast<unsigned>(x); }
inline float __int_as_float(int x) { return hw_sim::detail::bit_cast<float>(x); }
inline float __uint_as_float(unsigned x) { return hw_sim::detail::bit_cast<float>(x); }
inline long long __double_as_longlong(double x) { return hw_sim::detail::bit_cast<long long>(x); }
inline double __longlong_as_double(long long x) { return hw_sim::detail::bit_cast<double>(x); }

// ---------------------------------------------------------------------------
// Loads / stores with cache hints: plain accesses
// ---------------------------------------------------------------------------
template <typename T> inline T __ldg(const T* p) { return *p; }
template <typename T> inline T __ldca(const T* p) { return *p; }
template <typename T> inline T __ldcg(const T* p) { return *p; }
template <typename T> inline T __ldcs(const T* p) { return *p; }
template <typename T> inline T __ldlu(const T* p) { return *p; }
template <typename T> inline T __ldcv(const T* p) { return *p; }
template <typename T> inline void __stwb(T* p, T v) { *p = v; }
template <typename T> inline void __stcg(T* p, T v) { *p = v; }
template <typename T> inline void __stcs(T* p, T v) { *p = v; }
template <typename T> inline void __stwt(T* p, T v) { *p = v; }

// ---------------------------------------------------------------------------
// Math. The standard single/double precision names (expf, logf, erff, tanhf,
// isfinite, ...) come from <math.h>/<cmath> in the global namespace. CUDA-only
// names are defined here; fast-math intrinsics are computed exactly.
// Names that a newer C library might also declare (C23 rsqrt) are templates
// with a defaulted parameter, so a library declaration wins without conflict.
// ---------------------------------------------------------------------------
template <typename = void> inline float rsqrtf(float x) { return 1.0f / ::sqrtf(x); }
template <typename = void> inline double rsqrt(double x) { return 1.0 / ::sqrt(x); }
template <typename = void> inline float rcbrtf(float x) { return 1.0f / ::cbrtf(x); }
inline float __expf(float x) { return ::expf(x); }
inline float __exp10f(float x) { return ::powf(10.0f, x); }
inline float __logf(float x) { return ::logf(x); }
inline float __log2f(float x) { return ::log2f(x); }
inline float __log10f(float x) { return ::log10f(x); }
inline float __powf(float x, float y) { return ::powf(x, y); }
inline float __sinf(float x) { return ::sinf(x); }
inline float __cosf(float x) { return ::cosf(x); }
inline float __tanf(float x) { return ::tanf(x); }
inline void __sincosf(float x, float* s, float* c) {
  *s = ::sinf(x);
  *c = ::cosf(x);
}
inline float __fdividef(float a, float b) { return a / b; }
inline float fdividef(float a, float b) { return a / b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return ::fmaf(a, b, c); }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return ::sqrtf(x); }
inline float __frsqrt_rn(float x) { return 1.0f / ::sqrtf(x); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __fma_rn(double a, double b, double c) { return ::fma(a, b, c); }
inline float __saturatef(float x) {
  return x > 0.0f ? (x < 1.0f ? x : 1.0f) : 0.0f;  // NaN -> 0
}

namespace hw_sim {
namespace detail {
inline int sat_float_to_int(float r) {  // CUDA conversions saturate, NaN -> 0
  if (r != r) return 0;
  if (r >= 2147483648.0f) return std::numeric_limits<int>::max();
  if (r < -2147483648.0f) return std::numeric_limits<int>::min();
  return static_cast<int>(r);
}
inline unsigned sat_float_to_uint(float r) {
  if (r != r || r <= 0.0f) return 0u;
  if (r >= 4294967296.0f) return std::numeric_limits<unsigned>::max();
  return static_cast<unsigned>(r);
}
}  // namespace detail
}  // namespace hw_sim
inline int __float2int_rn(float x) { return hw_sim::detail::sat_float_to_int(::nearbyintf(x)); }
inline int __float2int_rz(float x) { return hw_sim::detail::sat_float_to_int(::truncf(x)); }
inline int __float2int_rd(float x) { return hw_sim::detail::sat_float_to_int(::floorf(x)); }
inline int __float2int_ru(float x) { return hw_sim::detail::sat_float_to_int(::ceilf(x)); }
inline unsigned __float2uint_rn(float x) {
  return hw_sim::detail::sat_float_to_uint(::nearbyintf(x));
}
inline unsigned __float2uint_rz(float x) { return hw_sim::detail::sat_float_to_uint(::truncf(x)); }
inline float __int2float_rn(int x) { return static_cast<float>(x); }
inline float __uint2float_rn(unsigned x) { return static_cast<float>(x); }

// min / max as in CUDA's math headers (non-templates, so std::min is untouched
// and wins nothing by accident inside namespace std).
#define HW_SIM_MINMAX(R, A, B)                                                   \
  inline R min(A a, B b) { return static_cast<R>(a) < static_cast<R>(b) ? static_cast<R>(a) : static_cast<R>(b); } \
  inline R max(A a, B b) { return static_cast<R>(a) < static_cast<R>(b) ? static_cast<R>(b) : static_cast<R>(a); }
HW_SIM_MINMAX(int, int, int)
HW_SIM_MINMAX(unsigned, unsigned, unsigned)
HW_SIM_MINMAX(unsigned, int, unsigned)
HW_SIM_MINMAX(unsigned, unsigned, int)
HW_SIM_MINMAX(long, long, long)
HW_SIM_MINMAX(unsigned long, unsigned long, unsigned long)
HW_SIM_MINMAX(long long, long long, long long)
HW_SIM_MINMAX(unsigned long long, unsigned long long, unsigned long long)
HW_SIM_MINMAX(unsigned long long, long long, unsigned long long)
HW_SIM_MINMAX(unsigned long long, unsigned long long, long long)
#undef HW_SIM_MINMAX
inline float min(float a, float b) { return ::fminf(a, b); }
inline float max(float a, float b) { return ::fmaxf(a, b); }
inline double min(double a, double b) { return ::fmin(a, b); }
inline double max(double a, double b) { return ::fmax(a, b); }
inline double min(float a, double b) { return ::fmin(a, b); }
inline double max(float a, double b) { return ::fmax(a, b); }
inline double min(double a, float b) { return ::fmin(a, b); }
inline double max(double a, float b) { return ::fmax(a, b); }
inline unsigned umin(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned umax(unsigned a, unsigned b) { return a < b ? b : a; }
inline long long llmin(long long a, long long b) { return a < b ? a : b; }
inline long long llmax(long long a, long long b) { return a < b ? b : a; }
inline unsigned long long ullmin(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long ullmax(unsigned long long a, unsigned long long b) { return a < b ? b : a; }

// ---------------------------------------------------------------------------
// Half / bfloat16 helpers (scalar; arithmetic goes through float)
// ---------------------------------------------------------------------------
inline __half __float2half(float f) { return __half(f); }
inline __half __float2half_rn(float f) { return __half(f); }
inline float __half2float(__half h) { return static_cast<float>(h); }
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline float __bfloat162float(__nv_bfloat16 h) { return static_cast<float>(h); }
#define HW_SIM_HALF_OPS(H)                                                                  \
  inline H __hadd(H a, H b) { return H(static_cast<float>(a) + static_cast<float>(b)); }    \
  inline H __hsub(H a, H b) { return H(static_cast<float>(a) - static_cast<float>(b)); }    \
  inline H __hmul(H a, H b) { return H(static_cast<float>(a) * static_cast<float>(b)); }    \
  inline H __hdiv(H a, H b) { return H(static_cast<float>(a) / static_cast<float>(b)); }    \
  inline H __hneg(H a) { return H(-static_cast<float>(a)); }                                \
  inline H __habs(H a) { return H(::fabsf(static_cast<float>(a))); }                         \
  inline H __hfma(H a, H b, H c) {                                                          \
    return H(::fmaf(static_cast<float>(a), static_cast<float>(b), static_cast<float>(c)));  \
  }                                                                                         \
  inline H __hmax(H a, H b) { return H(::fmaxf(static_cast<float>(a), static_cast<float>(b))); } \
  inline H __hmin(H a, H b) { return H(::fminf(static_cast<float>(a), static_cast<float>(b))); } \
  inline bool __heq(H a, H b) { return static_cast<float>(a) == static_cast<float>(b); }    \
  inline bool __hne(H a, H b) { return static_cast<float>(a) != static_cast<float>(b); }    \
  inline bool __hlt(H a, H b) { return static_cast<float>(a) < static_cast<float>(b); }     \
  inline bool __hle(H a, H b) { return static_cast<float>(a) <= static_cast<float>(b); }    \
  inline bool __hgt(H a, H b) { return static_cast<float>(a) > static_cast<float>(b); }     \
  inline bool __hge(H a, H b) { return static_cast<float>(a) >= static_cast<float>(b); }    \
  inline bool __hisnan(H a) { return std::isnan(static_cast<float>(a)); }                   \
  inline int __hisinf(H a) {                                                                \
    const float f = static_cast<float>(a);                                                  \
    return std::isinf(f) ? (f > 0 ? 1 : -1) : 0;                                            \
  }
HW_SIM_HALF_OPS(__half)
HW_SIM_HALF_OPS(__nv_bfloat16)
#undef HW_SIM_HALF_OPS

// ---------------------------------------------------------------------------
// Misc
// ---------------------------------------------------------------------------
[[noreturn]] inline void __trap() { hw_sim::detail::trap(); }
inline long long clock64() { return hw_sim::detail::clock_now(); }
// A yield point: lets other threads of the block run, so intra-block spin-waits
// that sleep terminate. (Spin-waits without __nanosleep, or on other blocks, hang.)
inline void __nanosleep(unsigned) { hw_sim::detail::yield_thread(); }

#include "simt_metrics.h"
#include "wmma.h"
#include "primitives.h"

#endif  // !defined(__CUDACC__)
