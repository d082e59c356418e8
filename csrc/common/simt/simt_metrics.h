// Memory metrics of emulated kernel launches, the counts ncu reports (SPEC section 6).
//
// Only the profile library (headwise._sim_profile, setup.py) collects them. There the
// kernels' translation units are compiled with
//   -fsanitize=kernel-address --param asan-instrumentation-with-call-threshold=0
//   --param asan-stack=0 --param asan-globals=0
// so g++ calls __asan_{load,store}{1,2,4,8,16,N}_noabort(addr[, size]) before every
// memory access of device code; simt_metrics.cpp defines those functions. The emulator
// runtime and simt_metrics.cpp are compiled without instrumentation.
//
// Every access made by a CUDA thread inside a block is classified as
//   shared: inside the block's dynamic shared buffer or the static __shared__ storage
//           (the `static thread_local` variables of this library's TLS block, minus the
//           built-in index variables threadIdx/blockIdx/blockDim/gridDim);
//   local:  inside the thread's own fiber stack or the launching OS thread's stack
//           (registers, local arrays, kernel parameters): not counted;
//   global: everything else.
// A warp-level request is the set of accesses its lanes make at one call site (return
// address) for the k-th time (k counted per lane), so a loop that every lane runs the
// same number of times makes one request per iteration, as a warp instruction does.
// Per request:
//   global: sectors = distinct 32-byte sectors touched; ideal = ceil(distinct bytes / 32);
//   shared: wavefronts = max(most distinct 4-byte words in one of the 32 banks,
//           ceil(distinct bytes / 128)): 1 for a conflict-free 4-byte access, 4 for
//           a 16-byte-per-lane access, 32 for a 32-way bank conflict.
// Per launch (summed over its CTAs): requests, sectors and ideal sectors of global loads
// and stores, l2_sectors (every global sector of every request, re-reads included),
// unique load/store bytes (distinct sectors x 32: the DRAM lower bound), shared requests
// and wavefronts, barriers (block-wide __syncthreads completions), the HW_SIM_NOTE
// counters below, bytes_in_flight_per_cta: the DRAM bytes (load sectors the launch had
// not loaded before) a CTA's threads load per round, and load_rounds: per CTA the most load
// rounds one of its threads made, summed over the CTAs (rounds: see simt_metrics.cpp).
//
// HW_SIM_NOTE(kind, n): emulated primitives count work the emulator cannot see as memory
// accesses (csrc/common/simt/primitives.h calls it):
//   mma             once per warp-wide mma.sync (from the warp's compute step)
//   ldmatrix        once per warp-wide ldmatrix
//   cp_async_bytes  n = the bytes one lane's cp.async copies, called by each issuing lane
//   async_load      the lane's next global load is a cp.async source: it waits for nothing,
//                   so it joins the lane's load round even from a call site already in it
//                   (a loop issuing a slice's copies); the round ends at a barrier
// Outside the profile library it expands to nothing (its argument is not evaluated).
#pragma once

#if defined(HW_SIM_PROFILE)

#include <cstddef>
#include <string>

namespace hw_sim {
namespace metrics {

enum class Note : int { mma = 0, ldmatrix = 1, cp_async_bytes = 2, async_load = 3 };
void note(Note kind, long long n);

// Host side (the profiler): collection is off until enabled; take_json() returns the
// launches recorded since the previous call as a JSON list and forgets them.
void set_enabled(bool on);
std::string take_json();

// Called by simt_runtime.cpp. While collection is enabled, launches run their blocks one
// after another on the calling thread (the counters are not shared between threads).
namespace hooks {
bool enabled();
void launch_begin(const char* name, const dim3& grid, const dim3& block, size_t dynamic_smem_bytes);
void launch_end();
// The block's dynamic shared buffer and the fiber stack [lo, hi) of each of its threads
// (indexed by linear thread id), set before any thread runs.
void block_begin(const unsigned char* dynamic_smem, size_t dynamic_smem_bytes, int nthreads, const dim3& block);
void fiber_stack(int thread, const void* lo, const void* hi);
void block_end();
void barrier();  // a block-wide barrier completed
}  // namespace hooks

}  // namespace metrics
}  // namespace hw_sim

#define HW_SIM_NOTE(kind, n) ::hw_sim::metrics::note(::hw_sim::metrics::Note::kind, static_cast<long long>(n))

#else

#define HW_SIM_NOTE(kind, n) ((void)sizeof(n))

#endif
