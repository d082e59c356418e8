// Memory metrics of emulated launches (see simt_metrics.h for what is counted and how).
// Compiled into both emulated libraries; it has content only in the profile library
// (HW_SIM_PROFILE), and it must never be compiled with -fsanitize=kernel-address itself:
// it defines the functions that instrumentation calls.
#include "simt.h"

#if defined(HW_SIM_PROFILE)

#include <dlfcn.h>
#include <link.h>
#include <pthread.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace hw_sim {
namespace metrics {
namespace {

enum Space : uint8_t { kGlobal = 0, kShared = 1 };
constexpr int kNotes = 3;  // the counted notes (Note::async_load is a flag, not a count)
constexpr uint64_t kSectorBytes = 32;    // L2/DRAM access granularity
constexpr uint64_t kWavefrontBytes = 128;  // shared memory: 32 banks x 4 bytes per cycle
constexpr int kBanks = 32;
constexpr size_t kLinesReported = 12;   // worst call sites kept per launch

struct Access {
  uint64_t addr;
  uint32_t size;
};

// One warp-level request: what the lanes of one warp accessed at one call site, the k-th
// time each of them got there.
struct Request {
  uint32_t lanes = 0;
  Access a[32];
};

struct RequestKey {
  uint64_t pc;
  uint32_t occurrence;
  uint16_t warp;
  uint8_t space;
  uint8_t store;
  bool operator==(const RequestKey& o) const {
    return pc == o.pc && occurrence == o.occurrence && warp == o.warp && space == o.space && store == o.store;
  }
};
struct RequestKeyHash {
  size_t operator()(const RequestKey& k) const {
    uint64_t h = k.pc * 0x9E3779B97F4A7C15ull;
    h ^= (static_cast<uint64_t>(k.occurrence) << 20) ^ (static_cast<uint64_t>(k.warp) << 4) ^
         (static_cast<uint64_t>(k.space) << 1) ^ k.store;
    return static_cast<size_t>(h * 0xBF58476D1CE4E5B9ull >> 7);
  }
};

struct LineStats {
  uint64_t pc = 0;
  bool store = false;
  Space space = kGlobal;
  uint64_t requests = 0;
  uint64_t units = 0;        // sectors (global) or wavefronts (shared)
  uint64_t units_ideal = 0;  // the same for the distinct bytes requested
};

struct Launch {
  std::string kernel;
  dim3 grid, block;
  size_t dynamic_smem = 0;
  uint64_t ctas = 0;
  // [0] loads, [1] stores
  uint64_t global_requests[2] = {0, 0};
  uint64_t global_sectors[2] = {0, 0};
  uint64_t global_sectors_ideal[2] = {0, 0};
  uint64_t global_bytes[2] = {0, 0};  // distinct bytes per request, summed
  std::unordered_set<uint64_t> sectors_touched[2];
  uint64_t smem_requests = 0;
  uint64_t smem_wavefronts = 0;
  uint64_t smem_wavefronts_ideal = 0;
  uint64_t barriers = 0;
  long long lane_notes[kNotes] = {0, 0, 0};
  double in_flight_sum = 0.0;  // sum over CTAs that load of their bytes in flight
  uint64_t loading_ctas = 0;
  uint64_t load_rounds = 0;    // sum over CTAs of the most load rounds one of its threads made
  std::unordered_map<uint64_t, LineStats> lines;  // key: pc << 2 | store << 1 | space
};

// Per (thread, call site): how often the thread got there, and in which round it last
// loaded there (round + 1; 0 = never).
struct PcLane {
  uint32_t occurrence = 0;
  uint32_t load_round_tag = 0;
};

// A thread's load rounds: a round ends at a barrier or when the thread loads again at a
// call site it already loaded at in this round (the next iteration of a loop). The loads
// of one round are taken to be in flight together; a loop iteration's loads wait for
// nothing but each other, a later iteration is assumed to wait for the earlier one. A
// cp.async source (Note::async_load) waits for nothing: it never ends a round (the copies
// of a slice issued by a loop are in flight together until the K loop's barrier).
struct Lane {
  uint32_t round = 0;
  uint32_t load_rounds = 0;
  uint32_t last_load_round_tag = 0;
  bool async_next = false;
};

struct State {
  bool enabled = false;
  bool in_block = false;
  std::unique_ptr<Launch> launch;
  std::vector<Launch> done;
  // Address ranges of the current block.
  uintptr_t smem_lo = 0, smem_hi = 0;
  uintptr_t tls_lo = 0, tls_hi = 0;
  uintptr_t os_stack_lo = 0, os_stack_hi = 0;
  std::vector<uintptr_t> stack_lo, stack_hi;
  uintptr_t stacks_lo = UINTPTR_MAX, stacks_hi = 0;  // the hull of the block's fiber stacks
  unsigned bdx = 1, bdxy = 1;
  std::vector<Lane> lanes;
  std::unordered_map<uint64_t, PcLane> pc_lane;
  std::unordered_map<RequestKey, Request, RequestKeyHash> pending;
  uint64_t cta_dram_load_bytes = 0;  // load sectors the launch had not loaded before, x 32
};
State g;

// The calling thread's instance of this library's TLS block, where `__shared__`
// (static thread_local) variables live.
void module_tls_range(uintptr_t& lo, uintptr_t& hi) {
  lo = hi = 0;
  Dl_info info{};
  if (!dladdr(reinterpret_cast<void*>(&module_tls_range), &info)) return;
  struct Find {
    uintptr_t base, lo, hi;
  } f{reinterpret_cast<uintptr_t>(info.dli_fbase), 0, 0};
  dl_iterate_phdr(
      [](dl_phdr_info* i, size_t, void* p) -> int {
        Find* f = static_cast<Find*>(p);
        if (static_cast<uintptr_t>(i->dlpi_addr) != f->base) return 0;
        for (int k = 0; k < i->dlpi_phnum; ++k)
          if (i->dlpi_phdr[k].p_type == PT_TLS && i->dlpi_tls_data) {
            f->lo = reinterpret_cast<uintptr_t>(i->dlpi_tls_data);
            f->hi = f->lo + i->dlpi_phdr[k].p_memsz;
          }
        return 1;
      },
      &f);
  lo = f.lo;
  hi = f.hi;
}

void os_stack_range(uintptr_t& lo, uintptr_t& hi) {
  lo = hi = 0;
  pthread_attr_t a;
  if (pthread_getattr_np(pthread_self(), &a) != 0) return;
  void* addr = nullptr;
  size_t size = 0;
  if (pthread_attr_getstack(&a, &addr, &size) == 0) {
    lo = reinterpret_cast<uintptr_t>(addr);
    hi = lo + size;
  }
  pthread_attr_destroy(&a);
}

template <typename T>
bool inside(uintptr_t a, const T& v) {
  const uintptr_t p = reinterpret_cast<uintptr_t>(&v);
  return a >= p && a < p + sizeof(T);
}

// The running thread's index in its block, x fastest.
inline unsigned linear_tid() { return threadIdx.x + threadIdx.y * g.bdx + threadIdx.z * g.bdxy; }

inline void record(uintptr_t addr, uint32_t size, bool store, uintptr_t pc) {
  State& S = g;
  if (!S.in_block) return;
  const unsigned tid = linear_tid();
  if (addr >= S.stack_lo[tid] && addr < S.stack_hi[tid]) return;  // locals, parameters
  if (addr >= S.os_stack_lo && addr < S.os_stack_hi) return;        // the launch's captures
  // A warp-collective primitive (mma.sync, ldmatrix; simt/primitives.h) runs its warp step
  // on one lane's fiber and reads / writes the other lanes' fragment registers on their
  // stacks: registers on the GPU, not memory traffic.
  if (addr >= S.stacks_lo && addr < S.stacks_hi) {
    const size_t w0 = tid & ~31u, w1 = std::min<size_t>(w0 + 32, S.stack_lo.size());
    for (size_t l = w0; l < w1; ++l)
      if (addr >= S.stack_lo[l] && addr < S.stack_hi[l]) return;
  }
  Space space = kGlobal;
  if (addr >= S.smem_lo && addr < S.smem_hi) {
    space = kShared;
  } else if (addr >= S.tls_lo && addr < S.tls_hi) {
    // Built-in index variables are registers on the GPU.
    if (inside(addr, threadIdx) || inside(addr, blockIdx) || inside(addr, blockDim) || inside(addr, gridDim)) return;
    space = kShared;
  }
  PcLane& pl = S.pc_lane[(static_cast<uint64_t>(pc) << 10) | tid];
  const uint32_t occurrence = pl.occurrence++;
  if (space == kGlobal && !store) {
    Lane& lane = S.lanes[tid];
    if (pl.load_round_tag == lane.round + 1 && !lane.async_next) ++lane.round;
    lane.async_next = false;
    pl.load_round_tag = lane.round + 1;
    if (lane.last_load_round_tag != lane.round + 1) {
      lane.last_load_round_tag = lane.round + 1;
      ++lane.load_rounds;
    }
  }
  Request& r = S.pending[RequestKey{pc, occurrence, static_cast<uint16_t>(tid >> 5), space, store}];
  if (r.lanes < 32) r.a[r.lanes++] = Access{addr, size};
}

// Calls visit(u) once per distinct `unit_bytes`-sized unit (sector, bank word) that the
// request's lanes cover, in address order (lanes sorted by address); returns the distinct
// bytes the lanes cover (a byte read by two lanes counts once).
template <typename Visit>
uint64_t for_each_distinct_unit(const Request& r, uint64_t unit_bytes, Visit&& visit) {
  uint64_t distinct_bytes = 0, covered_to = 0, last_unit = UINT64_MAX;
  for (uint32_t i = 0; i < r.lanes; ++i) {
    const uint64_t lo = std::max(r.a[i].addr, covered_to), hi = r.a[i].addr + r.a[i].size;
    if (hi <= lo) continue;
    distinct_bytes += hi - lo;
    covered_to = hi;
    for (uint64_t u = lo / unit_bytes; u <= (hi - 1) / unit_bytes; ++u) {
      if (u == last_unit) continue;
      last_unit = u;
      visit(u);
    }
  }
  return distinct_bytes;
}

// Fold one finished request into the launch's counts.
void account(const RequestKey& key, Request& r) {
  State& S = g;
  Launch& L = *S.launch;
  std::sort(r.a, r.a + r.lanes, [](const Access& x, const Access& y) { return x.addr < y.addr; });
  uint64_t units = 0;  // sectors or wavefronts
  uint64_t ideal = 0;  // the same if the distinct bytes were packed densely
  if (key.space == kGlobal) {
    const uint64_t distinct_bytes = for_each_distinct_unit(r, kSectorBytes, [&](uint64_t sector) {
      ++units;
      // A load of a sector the launch has not loaded before comes from DRAM.
      if (L.sectors_touched[key.store].insert(sector).second && !key.store) S.cta_dram_load_bytes += kSectorBytes;
    });
    ideal = (distinct_bytes + kSectorBytes - 1) / kSectorBytes;
    L.global_requests[key.store] += 1;
    L.global_sectors[key.store] += units;
    L.global_sectors_ideal[key.store] += ideal;
    L.global_bytes[key.store] += distinct_bytes;
  } else {
    int words_in_bank[kBanks] = {};
    const uint64_t distinct_bytes =
        for_each_distinct_unit(r, 4, [&](uint64_t word) { ++words_in_bank[word % kBanks]; });
    ideal = (distinct_bytes + kWavefrontBytes - 1) / kWavefrontBytes;
    units = std::max<uint64_t>(*std::max_element(words_in_bank, words_in_bank + kBanks), ideal);
    L.smem_requests += 1;
    L.smem_wavefronts += units;
    L.smem_wavefronts_ideal += ideal;
  }
  LineStats& line = L.lines[(key.pc << 2) | (static_cast<uint64_t>(key.store) << 1) | key.space];
  line.pc = key.pc;
  line.store = key.store;
  line.space = static_cast<Space>(key.space);
  line.requests += 1;
  line.units += units;
  line.units_ideal += ideal;
}

void flush_requests() {
  for (auto& kv : g.pending) account(kv.first, kv.second);
  g.pending.clear();
}

void append_u64(std::string& s, const char* name, uint64_t v) {
  s += '"';
  s += name;
  s += "\": ";
  s += std::to_string(v);
  s += ", ";
}
void append_f64(std::string& s, const char* name, double v) {
  char b[64];
  std::snprintf(b, sizeof b, "\"%s\": %.17g, ", name, v);
  s += b;
}
std::string json_string(const std::string& v) {
  std::string s = "\"";
  for (char c : v) {
    if (c == '"' || c == '\\') s += '\\';
    s += c;
  }
  return s + "\"";
}

std::string launch_json(const Launch& L) {
  std::string s = "{\"kernel\": " + json_string(L.kernel) + ", ";
  s += "\"grid\": [" + std::to_string(L.grid.x) + ", " + std::to_string(L.grid.y) + ", " + std::to_string(L.grid.z) +
       "], \"block\": [" + std::to_string(L.block.x) + ", " + std::to_string(L.block.y) + ", " +
       std::to_string(L.block.z) + "], ";
  append_u64(s, "dynamic_smem_bytes", L.dynamic_smem);
  append_u64(s, "ctas", L.ctas);
  const char* kind[2] = {"load", "store"};
  for (int st = 0; st < 2; ++st) {
    const std::string p = std::string("global_") + kind[st];
    append_u64(s, (p + "_requests").c_str(), L.global_requests[st]);
    append_u64(s, (p + "_sectors").c_str(), L.global_sectors[st]);
    append_u64(s, (p + "_sectors_ideal").c_str(), L.global_sectors_ideal[st]);
    append_u64(s, (p + "_bytes").c_str(), L.global_bytes[st]);
    append_u64(s, (std::string("unique_") + kind[st] + "_bytes").c_str(), L.sectors_touched[st].size() * kSectorBytes);
  }
  append_u64(s, "unique_bytes", (L.sectors_touched[0].size() + L.sectors_touched[1].size()) * kSectorBytes);
  append_u64(s, "l2_sectors", L.global_sectors[0] + L.global_sectors[1]);
  append_u64(s, "smem_requests", L.smem_requests);
  append_u64(s, "smem_wavefronts", L.smem_wavefronts);
  append_u64(s, "smem_wavefronts_ideal", L.smem_wavefronts_ideal);
  append_f64(s, "mma", static_cast<double>(L.lane_notes[static_cast<int>(Note::mma)]));
  append_f64(s, "ldmatrix", static_cast<double>(L.lane_notes[static_cast<int>(Note::ldmatrix)]));
  append_u64(s, "cp_async_bytes", static_cast<uint64_t>(L.lane_notes[static_cast<int>(Note::cp_async_bytes)]));
  append_u64(s, "barriers", L.barriers);
  append_u64(s, "load_rounds", L.load_rounds);
  append_f64(s, "bytes_in_flight_per_cta", L.loading_ctas ? L.in_flight_sum / static_cast<double>(L.loading_ctas) : 0.0);
  // Worst call sites first: most sectors/wavefronts above the ideal, then most traffic.
  std::vector<const LineStats*> lines;
  for (const auto& kv : L.lines) lines.push_back(&kv.second);
  std::sort(lines.begin(), lines.end(), [](const LineStats* a, const LineStats* b) {
    const uint64_t ea = a->units - a->units_ideal, eb = b->units - b->units_ideal;
    if (ea != eb) return ea > eb;
    if (a->units != b->units) return a->units > b->units;
    return a->pc < b->pc;
  });
  if (lines.size() > kLinesReported) lines.resize(kLinesReported);
  s += "\"lines\": [";
  for (size_t i = 0; i < lines.size(); ++i) {
    const LineStats& l = *lines[i];
    Dl_info info{};
    const bool found = dladdr(reinterpret_cast<void*>(l.pc), &info) != 0 && info.dli_fname;
    s += i ? ", {" : "{";
    // The return address of the instrumentation call: the access is just before it.
    append_u64(s, "offset", found ? l.pc - reinterpret_cast<uintptr_t>(info.dli_fbase) - 1 : l.pc - 1);
    s += "\"module\": " + json_string(found ? info.dli_fname : "") + ", ";
    s += std::string("\"space\": \"") + (l.space == kGlobal ? "global" : "shared") + "\", ";
    s += std::string("\"access\": \"") + (l.store ? "store" : "load") + "\", ";
    append_u64(s, "requests", l.requests);
    append_u64(s, l.space == kGlobal ? "sectors" : "wavefronts", l.units);
    s += std::string("\"") + (l.space == kGlobal ? "sectors_ideal" : "wavefronts_ideal") + "\": " +
         std::to_string(l.units_ideal) + "}";
  }
  s += "]}";
  return s;
}

}  // namespace

void note(Note kind, long long n) {
  if (!g.in_block) return;
  if (kind == Note::async_load) {
    g.lanes[linear_tid()].async_next = true;
    return;
  }
  g.launch->lane_notes[static_cast<int>(kind)] += n;
}

void set_enabled(bool on) { g.enabled = on; }

std::string take_json() {
  std::string s = "[";
  for (size_t i = 0; i < g.done.size(); ++i) s += (i ? ",\n" : "") + launch_json(g.done[i]);
  g.done.clear();
  return s + "]";
}

namespace hooks {

bool enabled() { return g.enabled; }

void launch_begin(const char* name, const dim3& grid, const dim3& block, size_t dynamic_smem_bytes) {
  g.launch.reset(new Launch());
  g.launch->kernel = name;
  g.launch->grid = grid;
  g.launch->block = block;
  g.launch->dynamic_smem = dynamic_smem_bytes;
  os_stack_range(g.os_stack_lo, g.os_stack_hi);
  g.tls_lo = g.tls_hi = 0;  // found at the first block, when the TLS block surely exists
}

void launch_end() {
  g.in_block = false;
  g.pending.clear();
  if (g.launch) g.done.push_back(std::move(*g.launch));
  g.launch.reset();
}

void block_begin(const unsigned char* dynamic_smem, size_t dynamic_smem_bytes, int nthreads, const dim3& block) {
  if (!g.launch) return;
  if (g.tls_hi == 0) module_tls_range(g.tls_lo, g.tls_hi);
  g.smem_lo = reinterpret_cast<uintptr_t>(dynamic_smem);
  g.smem_hi = g.smem_lo + dynamic_smem_bytes;
  // The launch's block shape, passed in: the runtime sets the blockDim variable only when
  // the block's threads start running.
  g.bdx = block.x;
  g.bdxy = block.x * block.y;
  g.stack_lo.assign(static_cast<size_t>(nthreads), 0);
  g.stack_hi.assign(static_cast<size_t>(nthreads), 0);
  g.stacks_lo = UINTPTR_MAX;
  g.stacks_hi = 0;
  g.lanes.assign(static_cast<size_t>(nthreads), Lane{});
  g.pc_lane.clear();
  g.pending.clear();
  g.cta_dram_load_bytes = 0;
  g.in_block = true;
}

void fiber_stack(int thread, const void* lo, const void* hi) {
  g.stack_lo[static_cast<size_t>(thread)] = reinterpret_cast<uintptr_t>(lo);
  g.stack_hi[static_cast<size_t>(thread)] = reinterpret_cast<uintptr_t>(hi);
  g.stacks_lo = std::min(g.stacks_lo, reinterpret_cast<uintptr_t>(lo));
  g.stacks_hi = std::max(g.stacks_hi, reinterpret_cast<uintptr_t>(hi));
}

void block_end() {
  if (!g.in_block) return;
  g.in_block = false;
  flush_requests();
  Launch& L = *g.launch;
  L.ctas += 1;
  // Bytes in flight toward DRAM: the CTA's first-touch load sectors (the rest are taken
  // to hit in L2) spread over the mean number of load rounds of its threads that load.
  uint64_t rounds = 0, loading = 0, most = 0;
  for (const Lane& lane : g.lanes)
    if (lane.load_rounds) {
      rounds += lane.load_rounds;
      ++loading;
      most = std::max<uint64_t>(most, lane.load_rounds);
    }
  L.load_rounds += most;
  if (loading) {
    L.in_flight_sum += static_cast<double>(g.cta_dram_load_bytes) * static_cast<double>(loading) /
                       static_cast<double>(rounds);
    L.loading_ctas += 1;
  }
}

void barrier() {
  if (!g.in_block) return;
  flush_requests();
  g.launch->barriers += 1;
  for (Lane& lane : g.lanes) ++lane.round;
}

}  // namespace hooks
}  // namespace metrics
}  // namespace hw_sim

// ---------------------------------------------------------------------------
// The functions g++ calls under -fsanitize=kernel-address with
// asan-instrumentation-with-call-threshold=0: one per access, before it.
// ---------------------------------------------------------------------------
#define HW_SIM_ASAN_HOOK(N)                                                                    \
  extern "C" void __asan_load##N##_noabort(uintptr_t a) {                                      \
    hw_sim::metrics::record(a, N, false, reinterpret_cast<uintptr_t>(__builtin_return_address(0))); \
  }                                                                                            \
  extern "C" void __asan_store##N##_noabort(uintptr_t a) {                                     \
    hw_sim::metrics::record(a, N, true, reinterpret_cast<uintptr_t>(__builtin_return_address(0)));  \
  }
HW_SIM_ASAN_HOOK(1)
HW_SIM_ASAN_HOOK(2)
HW_SIM_ASAN_HOOK(4)
HW_SIM_ASAN_HOOK(8)
HW_SIM_ASAN_HOOK(16)
#undef HW_SIM_ASAN_HOOK
extern "C" void __asan_loadN_noabort(uintptr_t a, size_t n) {
  if (n) hw_sim::metrics::record(a, static_cast<uint32_t>(n), false, reinterpret_cast<uintptr_t>(__builtin_return_address(0)));
}
extern "C" void __asan_storeN_noabort(uintptr_t a, size_t n) {
  if (n) hw_sim::metrics::record(a, static_cast<uint32_t>(n), true, reinterpret_cast<uintptr_t>(__builtin_return_address(0)));
}
// Called before a noreturn call (a throw), and around the dynamic initialization of a
// translation unit's globals (initialization-order checking): nothing to do.
extern "C" void __asan_handle_no_return() {}
extern "C" void __asan_before_dynamic_init(const char*) {}
extern "C" void __asan_after_dynamic_init() {}

#endif  // HW_SIM_PROFILE
