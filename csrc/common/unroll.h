// HW_UNROLL: full unrolling of a constant-trip loop, in the CUDA build and in the emulator.
// The emulator's host compiler does not know `#pragma unroll`; unrolled, each load of a
// loop has its own call site, which the profile library needs to see those loads as in
// flight together (a load site that repeats starts a new round of its latency model).
#pragma once

#include "simt_portability.h"

// HW_UNROLL_4: unrolled by 4, for a loop whose every access takes a runtime index (full
// unrolling of a 16-trip loop would hoist all 16 iterations' loads and spill).
// HW_NO_UNROLL: not unrolled, for a short loop whose runtime trip count is a few (a loop
// unrolled by 4 or more with a runtime count is mostly remainder dispatch when it runs
// twice).
#if HW_SIM
#define HW_UNROLL _Pragma("GCC unroll 64")
#define HW_UNROLL_4 _Pragma("GCC unroll 4")
#define HW_NO_UNROLL _Pragma("GCC unroll 1")
#else
#define HW_UNROLL _Pragma("unroll")
#define HW_UNROLL_4 _Pragma("unroll 4")
#define HW_NO_UNROLL _Pragma("unroll 1")
#endif
