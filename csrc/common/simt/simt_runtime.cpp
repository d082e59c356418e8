// headwise SIMT emulator runtime: fibers, per-block scheduler, launch.
// Compile with the host C++ compiler (never nvcc). See README.md.
#include "simt.h"

#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define HW_SIM_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define HW_SIM_ASAN 1
#endif
#endif
#ifndef HW_SIM_ASAN
#define HW_SIM_ASAN 0
#endif
#if HW_SIM_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#if defined(__x86_64__) && !defined(HW_SIM_FORCE_UCONTEXT)
#define HW_SIM_CTX_ASM 1
#elif defined(__aarch64__) && !defined(HW_SIM_FORCE_UCONTEXT)
#define HW_SIM_CTX_ASM 1
#else
#define HW_SIM_CTX_ASM 0
#include <fenv.h>
#include <ucontext.h>
#endif

// Built-in index variables (declared in simt.h).
HW_SIM_HIDDEN __thread dim3 threadIdx(0, 0, 0);
HW_SIM_HIDDEN __thread dim3 blockIdx(0, 0, 0);
HW_SIM_HIDDEN __thread dim3 blockDim(0, 0, 0);
HW_SIM_HIDDEN __thread dim3 gridDim(0, 0, 0);

// ---------------------------------------------------------------------------
// Context switch. hw_sim_ctx_switch(save, to): pushes the callee-saved state on
// the current stack, stores the stack pointer to *save, loads `to` as the new
// stack pointer and pops the state saved there. No syscall.
// ---------------------------------------------------------------------------
#if HW_SIM_CTX_ASM
extern "C" {
HW_SIM_HIDDEN void hw_sim_ctx_switch(void** save_sp, void* to_sp);
HW_SIM_HIDDEN void hw_sim_fiber_trampoline();
}
#if defined(__x86_64__)
// Frame (low to high): [mxcsr:4][x87 cw:2][pad:2] r15 r14 r13 r12 rbx rbp ret
// mxcsr / x87 control word are reloaded only when they differ (ldmxcsr and
// fldcw dominate the switch cost otherwise).
asm(R"(
    .text
    .p2align 4
    .globl hw_sim_ctx_switch
    .hidden hw_sim_ctx_switch
    .type hw_sim_ctx_switch,@function
hw_sim_ctx_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsp, %rdx
    movq %rsi, %rsp
    movl (%rsp), %eax
    cmpl (%rdx), %eax
    je 1f
    ldmxcsr (%rsp)
1:
    movw 4(%rsp), %ax
    cmpw 4(%rdx), %ax
    je 2f
    fldcw 4(%rsp)
2:
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size hw_sim_ctx_switch,.-hw_sim_ctx_switch

    .p2align 4
    .globl hw_sim_fiber_trampoline
    .hidden hw_sim_fiber_trampoline
    .type hw_sim_fiber_trampoline,@function
hw_sim_fiber_trampoline:
    .cfi_startproc
    .cfi_undefined rip
    movq %rbx, %rdi
    callq *%r12
    ud2
    .cfi_endproc
    .size hw_sim_fiber_trampoline,.-hw_sim_fiber_trampoline
)");
#else  // __aarch64__
// Frame (low to high): x19..x30 (x29 = fp, x30 = lr), d8..d15; 160 bytes.
asm(R"(
    .text
    .p2align 4
    .globl hw_sim_ctx_switch
    .hidden hw_sim_ctx_switch
    .type hw_sim_ctx_switch,%function
hw_sim_ctx_switch:
    sub sp, sp, #160
    stp x19, x20, [sp, #0]
    stp x21, x22, [sp, #16]
    stp x23, x24, [sp, #32]
    stp x25, x26, [sp, #48]
    stp x27, x28, [sp, #64]
    stp x29, x30, [sp, #80]
    stp d8, d9, [sp, #96]
    stp d10, d11, [sp, #112]
    stp d12, d13, [sp, #128]
    stp d14, d15, [sp, #144]
    mov x2, sp
    str x2, [x0]
    mov sp, x1
    ldp x19, x20, [sp, #0]
    ldp x21, x22, [sp, #16]
    ldp x23, x24, [sp, #32]
    ldp x25, x26, [sp, #48]
    ldp x27, x28, [sp, #64]
    ldp x29, x30, [sp, #80]
    ldp d8, d9, [sp, #96]
    ldp d10, d11, [sp, #112]
    ldp d12, d13, [sp, #128]
    ldp d14, d15, [sp, #144]
    add sp, sp, #160
    ret
    .size hw_sim_ctx_switch,.-hw_sim_ctx_switch

    .p2align 4
    .globl hw_sim_fiber_trampoline
    .hidden hw_sim_fiber_trampoline
    .type hw_sim_fiber_trampoline,%function
hw_sim_fiber_trampoline:
    .cfi_startproc
    .cfi_undefined x30
    mov x0, x19
    blr x20
    brk #0
    .cfi_endproc
    .size hw_sim_fiber_trampoline,.-hw_sim_fiber_trampoline
)");
#endif
#endif  // HW_SIM_CTX_ASM

namespace hw_sim {
namespace detail {
namespace {

constexpr int kMaxThreads = 1024;
constexpr int kMaxWarps = kMaxThreads / 32;

constexpr int kMaxClusterCtas = 8;  // the portable cluster size limit
enum FiberState : unsigned char { kReady, kRunning, kAtBarrier, kAtWarp, kAtCluster, kExited };

struct Ctx {
#if HW_SIM_CTX_ASM
  void* sp = nullptr;
#else
  ucontext_t uc;
#endif
};

struct Stack {
  char* map = nullptr;  // start of mapping (guard page first)
  size_t map_size = 0;
  char* lo = nullptr;   // usable stack [lo, hi)
  char* hi = nullptr;
};

struct Fiber {
  Ctx ctx;
  dim3 tid;
  FiberState state = kReady;
  bool started = false;
  // Posted warp-collective request.
  unsigned char kind = 0;
  unsigned char size = 0;
  int width = 32;
  unsigned mask = 0;
  int arg = 0;
  alignas(16) unsigned char val[16];
  // Result written at release time.
  alignas(16) unsigned char res[16];
  unsigned res_u = 0;
  // Posted warp_op (mma.sync / ldmatrix): the lane's operands and results.
  WarpOpFn op_fn = nullptr;
  const char* op_name = nullptr;  // the instruction, e.g. "ldmatrix.sync.aligned.m8n8.x4.shared.b16"
  const void* op_in = nullptr;
  void* op_out = nullptr;
  // cp.async copies issued by this thread and not yet retired by a wait, in issue order;
  // group -1 until cp.async.commit_group closes the group they belong to.
  struct AsyncCopy {
    unsigned char* dst;
    const unsigned char* src;
    unsigned cp_size, src_size;
    int group;
  };
  std::vector<AsyncCopy> async_copies;
  int async_groups_committed = 0;
};

struct LaunchCtx {
  const char* name;
  dim3 grid, block;
  size_t smem;
  int nthreads;
  const std::function<void()>* body;
  dim3 cluster;  // (1,1,1) for a launch without clusters
};

struct Runner;

// The co-resident CTAs of one cluster and its barrier.cluster state.
struct ClusterCtx {
  Runner* cta[kMaxClusterCtas];  // by %cluster_ctarank
  int ctas = 0;
  int threads = 0;  // threads of all its CTAs: the barrier's arrival count
  int arrived = 0;
};

HW_SIM_HIDDEN __thread Runner* tl_runner = nullptr;

size_t page_size() {
  static const size_t ps = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return ps;
}

// HW_SIM_STACK_KB: a fiber's stack in KiB, a whole decimal number from kMinStackKb (room for
// the stagger offset below, <= 16 KiB, and the entry frames) to kMaxStackKb; unset or empty is
// 256. Any other value is refused (SimtError naming the variable) by every launch until it is
// mended: a clamped or truncated size ("1M" read as 1) could overflow a kernel's stack.
constexpr size_t kMinStackKb = 64, kMaxStackKb = 1 << 20;

size_t stack_kb_setting() {
  const char* e = std::getenv("HW_SIM_STACK_KB");
  if (!e || !*e) return 256;
  size_t kb = 0;
  bool ok = true;
  for (const char* c = e; *c && ok; ++c) {
    ok = *c >= '0' && *c <= '9';
    if (ok) kb = kb * 10 + static_cast<size_t>(*c - '0');
    ok = ok && kb <= kMaxStackKb;
  }
  if (!ok || kb < kMinStackKb)
    throw SimtError("headwise sim: HW_SIM_STACK_KB must be an integer from " + std::to_string(kMinStackKb) +
                    " to " + std::to_string(kMaxStackKb) + " (KiB), got '" + e + "'");
  return kb;
}

size_t stack_bytes() {
  static const size_t sz = [] {
    const size_t ps = page_size();
    return (stack_kb_setting() * 1024 + ps - 1) / ps * ps;
  }();
  return sz;
}

std::string range_list(const std::vector<int>& v) {  // sorted ints -> "0..3, 7, 9..12"
  std::string s;
  for (size_t i = 0; i < v.size();) {
    size_t j = i;
    while (j + 1 < v.size() && v[j + 1] == v[j] + 1) ++j;
    if (!s.empty()) s += ", ";
    s += std::to_string(v[i]);
    if (j > i) s += ".." + std::to_string(v[j]);
    i = j + 1;
  }
  return s;
}

std::string hex(unsigned m) {
  char b[16];
  std::snprintf(b, sizeof b, "0x%08x", m);
  return b;
}

std::string dim_str(const dim3& d) {
  return "(" + std::to_string(d.x) + "," + std::to_string(d.y) + "," + std::to_string(d.z) + ")";
}

const char* kind_name(int k) {
  switch (k) {
    case kShflIdx: return "__shfl_sync";
    case kShflUp: return "__shfl_up_sync";
    case kShflDown: return "__shfl_down_sync";
    case kShflXor: return "__shfl_xor_sync";
    case kVoteAll: return "__all_sync";
    case kVoteAny: return "__any_sync";
    case kVoteBallot: return "__ballot_sync";
    case kSyncWarp: return "__syncwarp";
    case kWmmaFill: return "wmma::fill_fragment";
    case kWmmaLoad: return "wmma::load_matrix_sync";
    case kWmmaStore: return "wmma::store_matrix_sync";
    case kWmmaMma: return "wmma::mma_sync";
    case kMmaSync: return "mma.sync.aligned";
    case kLdmatrix: return "ldmatrix.sync.aligned";
    default: return "warp collective";
  }
}

// The collective a blocked fiber waits at, for messages: a warp_op's instruction name.
const char* collective_name(const Fiber& f) { return f.op_fn ? f.op_name : kind_name(f.kind); }

[[noreturn]] void fiber_main(void*);

struct Runner {
  // Pool of fiber stacks owned by this OS thread, reused across blocks/launches.
  std::vector<Stack> stacks;
  Fiber fibers[kMaxThreads];
  // Ready queue (ring buffer; a fiber is in it at most once).
  int q[kMaxThreads];
  unsigned qhead = 0, qcount = 0;

  Ctx sched;  // the OS thread's own context while a block runs
  const LaunchCtx* L = nullptr;
  int n = 0;
  int cur = -1;
  int alive = 0;
  int arrived = 0;
  int bar_count = 0;
  int bar_result = 0;
  int nwarps = 0;
  unsigned warp_exist[kMaxWarps];
  unsigned warp_posted[kMaxWarps];
  unsigned warp_exited[kMaxWarps];
  bool failed = false;
  bool in_block = false;
  std::exception_ptr error;
  dim3 block_idx{0, 0, 0};
  ClusterCtx* cluster = nullptr;  // the cluster this CTA belongs to
  int cluster_rank = 0;
  ClusterCtx solo;                // the one-CTA cluster of a launch without clusters
  dim3 tid_dim{0, 0, 0};  // block shape for which fibers[].tid is valid
  unsigned char* smem = nullptr;
  size_t smem_cap = 0;
  size_t smem_used = 0;  // dynamic shared bytes of the running launch
  // cp.async visibility, one entry per 4-byte word of the dynamic shared memory: 0, or the
  // linear index + 1 of the thread whose cp.async targets the word, with kAsyncLanded set
  // once that thread's wait retired the copy. A __syncthreads clears landed words (the
  // copies are then visible to every thread of the block).
  static constexpr uint16_t kAsyncLanded = 0x8000;
  std::vector<uint16_t> async_word_owner;
  std::vector<uint32_t> async_landed_words;  // words with kAsyncLanded set
#if HW_SIM_CTX_ASM && defined(__x86_64__)
  unsigned long long fpctl = 0;  // mxcsr | x87 cw << 32 for new fibers
#endif
#if !HW_SIM_CTX_ASM
  fenv_t block_fenv;  // floating-point environment new fibers start with
#endif
#if HW_SIM_ASAN
  const void* os_stack_lo = nullptr;
  size_t os_stack_size = 0;
#endif

  Runner() {
#if HW_SIM_ASAN
    pthread_attr_t a;
    if (pthread_getattr_np(pthread_self(), &a) == 0) {
      void* addr = nullptr;
      size_t sz = 0;
      pthread_attr_getstack(&a, &addr, &sz);
      os_stack_lo = addr;
      os_stack_size = sz;
      pthread_attr_destroy(&a);
    }
#endif
  }
  ~Runner() {
    for (Stack& s : stacks) munmap(s.map, s.map_size);
    std::free(smem);
  }
  Runner(const Runner&) = delete;
  Runner& operator=(const Runner&) = delete;

  // -- ready queue --
  void push_back(int i) {
    q[(qhead + qcount) & (kMaxThreads - 1)] = i;
    ++qcount;
  }
  void push_front(int i) {
    qhead = (qhead - 1) & (kMaxThreads - 1);
    q[qhead] = i;
    ++qcount;
  }
  int pop() {
    if (qcount == 0) return -1;
    const int i = q[qhead];
    qhead = (qhead + 1) & (kMaxThreads - 1);
    --qcount;
    return i;
  }

  std::string prefix() const {
    return std::string("headwise sim: kernel '") + (L ? L->name : "?") + "' block " + dim_str(block_idx) + ": ";
  }
  std::string thread_prefix() const {
    return std::string("headwise sim: kernel '") + (L ? L->name : "?") + "' block " + dim_str(block_idx) +
           " thread " + dim_str(threadIdx) + ": ";
  }

  void ensure_stacks(int count) {
    while (static_cast<int>(stacks.size()) < count) {
      const size_t guard = page_size();
      const size_t total = guard + stack_bytes();
      void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
      if (p == MAP_FAILED)
        throw SimtError(prefix() + "cannot map a " + std::to_string(total) + "-byte fiber stack");
      // Guard page below the stack; if the kernel refuses (e.g. map count limit) run without it.
      (void)mprotect(p, guard, PROT_NONE);
      Stack s;
      s.map = static_cast<char*>(p);
      s.map_size = total;
      s.lo = s.map + guard;
      s.hi = s.map + total;
      stacks.push_back(s);
    }
  }

  void ensure_smem(size_t bytes) {
    const size_t want = bytes < 128 ? 128 : (bytes + 127) / 128 * 128;
    if (want <= smem_cap) return;
    std::free(smem);
    smem = static_cast<unsigned char*>(std::aligned_alloc(128, want));
    if (!smem) {
      smem_cap = 0;
      throw SimtError(prefix() + "cannot allocate dynamic shared memory");
    }
    smem_cap = want;
  }

  // -- context switching --
  void init_fiber_ctx(int i) {
    Fiber& f = fibers[i];
    const Stack& s = stacks[i];
#if HW_SIM_ASAN
    // The previous fiber on this stack never returned from its entry frames
    // (it switched away for good), so their redzones are still poisoned.
    {
      const size_t len = static_cast<size_t>(s.hi - s.lo) < 32768 ? static_cast<size_t>(s.hi - s.lo) : 32768;
      __asan_unpoison_memory_region(s.hi - len, len);
    }
#endif
#if HW_SIM_CTX_ASM
    // Stagger the stack tops: page-aligned tops would put every fiber's hot
    // frames in the same cache sets (measured ~2x slower switching).
    const uintptr_t color = (static_cast<uintptr_t>(i) * 7 % 64) * 64 + (static_cast<uintptr_t>(i) / 64 % 4) * 4096;
    uintptr_t top = (reinterpret_cast<uintptr_t>(s.hi) - color) & ~uintptr_t(15);
#if defined(__x86_64__)
    uint64_t* sp = reinterpret_cast<uint64_t*>(top);
    *--sp = reinterpret_cast<uint64_t>(&hw_sim_fiber_trampoline);  // return address
    *--sp = 0;                                                      // rbp
    *--sp = 0;                                                      // rbx (arg)
    *--sp = reinterpret_cast<uint64_t>(&fiber_main);                // r12 (entry)
    *--sp = 0;                                                      // r13
    *--sp = 0;                                                      // r14
    *--sp = 0;                                                      // r15
    *--sp = fpctl;                                                  // mxcsr, x87 cw
    f.ctx.sp = sp;
#else
    uint64_t* sp = reinterpret_cast<uint64_t*>(top - 160);
    std::memset(sp, 0, 160);
    sp[0] = 0;                                                  // x19 (arg)
    sp[1] = reinterpret_cast<uint64_t>(&fiber_main);            // x20 (entry)
    sp[10] = 0;                                                 // x29
    sp[11] = reinterpret_cast<uint64_t>(&hw_sim_fiber_trampoline);  // x30
    f.ctx.sp = sp;
#endif
#else
    getcontext(&f.ctx.uc);
    f.ctx.uc.uc_stack.ss_sp = s.lo;
    f.ctx.uc.uc_stack.ss_size = static_cast<size_t>(s.hi - s.lo);
    f.ctx.uc.uc_link = nullptr;
    makecontext(&f.ctx.uc, reinterpret_cast<void (*)()>(&uc_entry), 0);
#endif
  }
#if !HW_SIM_CTX_ASM
  static void uc_entry() { fiber_main(nullptr); }
#endif

  // Switch from context `from` to `to`. to_lo/to_size describe the target stack (ASan only).
  static void raw_switch(Ctx& from, Ctx& to, const void* to_lo, size_t to_size, bool dying) {
#if HW_SIM_ASAN
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(dying ? nullptr : &fake, to_lo, to_size);
#else
    (void)to_lo;
    (void)to_size;
    (void)dying;
#endif
#if HW_SIM_CTX_ASM
    hw_sim_ctx_switch(&from.sp, to.sp);
#else
    swapcontext(&from.uc, &to.uc);
#endif
#if HW_SIM_ASAN
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
  }

  // Make fiber `next` current and switch to it from context `from`.
  void resume(Ctx& from, int next, bool dying) {
    Fiber& f = fibers[next];
    cur = next;
    f.state = kRunning;
    threadIdx = f.tid;
    if (!f.started) {
      f.started = true;
      init_fiber_ctx(next);
    }
    raw_switch(from, f.ctx, stacks[next].lo, static_cast<size_t>(stacks[next].hi - stacks[next].lo), dying);
  }

  void to_scheduler(Ctx& from, bool dying) {
    cur = -1;
#if HW_SIM_ASAN
    raw_switch(from, sched, os_stack_lo, os_stack_size, dying);
#else
    raw_switch(from, sched, nullptr, 0, dying);
#endif
  }

  // The current fiber has set its blocked state: run someone else.
  void wait_current() {
    Fiber& me = fibers[cur];
    const int next = pop();
    if (next >= 0)
      resume(me.ctx, next, false);
    else
      to_scheduler(me.ctx, false);
  }

  // Called on the fiber's own stack when its body returned or threw.
  [[noreturn]] void exit_current(bool threw) {
    Fiber& me = fibers[cur];
    me.state = kExited;
    --alive;
    warp_exited[cur >> 5] |= 1u << (cur & 31);
    const int next = threw ? -1 : pop();
    if (next >= 0)
      resume(me.ctx, next, true);
    else
      to_scheduler(me.ctx, true);
    std::abort();  // never resumed
  }

  // A __syncthreads: copies retired by their thread's wait become visible block-wide.
  void publish_landed_async_copies() {
    for (uint32_t w : async_landed_words)
      if (async_word_owner[w] & kAsyncLanded) async_word_owner[w] = 0;
    async_landed_words.clear();
  }
  // A __syncwarp of `group` in warp `warp`: the copies those lanes retired become visible
  // to the lanes of the group (recorded as visible to all: the emulator keeps no per-thread
  // view, so a later read by another warp without a __syncthreads is not flagged).
  void publish_landed_async_copies_of(int warp, unsigned group) {
    size_t kept = 0;
    for (uint32_t w : async_landed_words) {
      const uint16_t owner = async_word_owner[w];
      if (!(owner & kAsyncLanded)) continue;
      const int t = (owner & ~kAsyncLanded) - 1;
      if (t >> 5 == warp && ((group >> (t & 31)) & 1u))
        async_word_owner[w] = 0;
      else
        async_landed_words[kept++] = w;
    }
    async_landed_words.resize(kept);
  }
  void land_async_copy(const Fiber::AsyncCopy& c);

  // A block runs as start_block, run_ready until no thread is ready (once for a lone
  // block; in turns with the cluster's other CTAs for a cluster), then finish_block.
  void start_block(const LaunchCtx& lc, dim3 idx, ClusterCtx* c, int rank);
  void run_ready();
  void finish_block(bool abandoned);
  void run_block(const LaunchCtx& lc, int64_t b);
  std::string waiting_at(int t) const;
  std::string deadlock_message();
  void release_warp(int w, unsigned group, int me);
  [[noreturn]] __attribute__((noinline, cold)) void divergent(int w, unsigned group, unsigned mask);
};

// This OS thread's runners: runner(0) runs lone blocks, runner(r) the CTA of rank r of a
// cluster. tl_runner points to the one whose fibers run (or ran last).
Runner& runner(int i = 0) {
  static thread_local std::vector<std::unique_ptr<Runner>> pool;
  while (static_cast<int>(pool.size()) <= i) pool.emplace_back(new Runner());
  if (!tl_runner) tl_runner = pool[0].get();
  return *pool[i];
}

[[noreturn]] __attribute__((noinline, cold)) void outside_launch(int kind) {
  const char* what = kind == -1   ? "__syncthreads"
                     : kind == -2 ? "__activemask"
                     : kind == -3 ? "barrier.cluster / %cluster_ctarank / mapa"
                                  : kind_name(kind);
  throw SimtError(std::string("headwise sim: ") + what + " called outside a kernel launch");
}

// kind: a CollKind, -1 for __syncthreads, -2 for __activemask, -3 for the cluster
// functions (names only used for errors).
inline Runner& current_runner(int kind) {
  Runner* R = tl_runner;
  if (__builtin_expect(!R || !R->in_block || R->cur < 0, 0)) outside_launch(kind);
  return *R;
}

[[noreturn]] __attribute__((noinline, cold)) void bad_collective(Runner& R, int kind, unsigned mask, int width) {
  const int lane = R.cur & 31;
  if (!((mask >> lane) & 1u))
    throw SimtError(R.thread_prefix() + kind_name(kind) + "(mask=" + hex(mask) + ") called by lane " +
                    std::to_string(lane) + ", which is not in the mask");
  throw SimtError(R.thread_prefix() + kind_name(kind) + ": width " + std::to_string(width) +
                  " is not a power of two in [1, 32]");
}

[[noreturn]] void fiber_main(void*) {
#if HW_SIM_ASAN
  __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
#endif
  Runner& R = *tl_runner;
#if !HW_SIM_CTX_ASM
  fesetenv(&R.block_fenv);  // getcontext() captured whichever fiber initialised us
#endif
  bool threw = false;
  try {
    (*R.L->body)();
  } catch (...) {
    // Leave the handler before switching away (the C++ runtime's caught-exception
    // stack is per OS thread and shared by all fibers on it).
    R.error = std::current_exception();
    threw = true;
  }
  if (threw) R.failed = true;
  R.exit_current(threw);
}

void Runner::start_block(const LaunchCtx& lc, dim3 idx, ClusterCtx* c, int rank) {
  L = &lc;
  block_idx = idx;
  cluster = c;
  cluster_rank = rank;
  n = lc.nthreads;
  ensure_stacks(n);
  ensure_smem(lc.smem);
  if (lc.smem) std::memset(smem, 0xFF, lc.smem);
  smem_used = lc.smem;
  async_word_owner.assign((lc.smem + 3) / 4, 0);
  async_landed_words.clear();
#if defined(HW_SIM_PROFILE)
  if (metrics::hooks::enabled()) {
    metrics::hooks::block_begin(smem, lc.smem, n, lc.block);
    for (int i = 0; i < n; ++i) metrics::hooks::fiber_stack(i, stacks[i].lo, stacks[i].hi);
  }
#endif

  const dim3 bd = lc.block;
  if (tid_dim.x != bd.x || tid_dim.y != bd.y || tid_dim.z != bd.z) {
    unsigned x = 0, y = 0, z = 0;
    for (int i = 0; i < n; ++i) {
      fibers[i].tid = dim3(x, y, z);
      if (++x == bd.x) {
        x = 0;
        if (++y == bd.y) {
          y = 0;
          ++z;
        }
      }
    }
    tid_dim = bd;
  }
  qhead = 0;
  qcount = 0;
  for (int i = 0; i < n; ++i) {
    fibers[i].state = kReady;
    fibers[i].started = false;
    fibers[i].op_fn = nullptr;  // an abandoned fiber of a failed launch may have left one
    fibers[i].async_copies.clear();
    fibers[i].async_groups_committed = 0;
    push_back(i);
  }
  nwarps = (n + 31) / 32;
  for (int w = 0; w < nwarps; ++w) {
    const int lanes = n - 32 * w >= 32 ? 32 : n - 32 * w;
    warp_exist[w] = lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u);
    warp_posted[w] = 0;
    warp_exited[w] = 0;
  }
  alive = n;
  arrived = 0;
  bar_count = 0;
  failed = false;
  error = nullptr;
#if !HW_SIM_CTX_ASM
  fegetenv(&block_fenv);
#endif
#if HW_SIM_CTX_ASM && defined(__x86_64__)
  {
    unsigned mx = 0;
    unsigned short cw = 0;
    asm volatile("stmxcsr %0" : "=m"(mx));
    asm volatile("fnstcw %0" : "=m"(cw));
    fpctl = static_cast<unsigned long long>(mx) | (static_cast<unsigned long long>(cw) << 32);
  }
#endif
  in_block = true;
}

void Runner::run_ready() {
  tl_runner = this;
  blockIdx = block_idx;
  blockDim = L->block;
  gridDim = L->grid;
  const int first = pop();
  if (first >= 0) resume(sched, first, false);
  // Back on the OS thread's stack: no thread of this block is ready, or one failed.
  cur = -1;
  threadIdx = dim3(0, 0, 0);
}

// Ends the block's run; `abandoned`: its fibers are dropped where they wait (an error or
// a deadlock somewhere in the launch).
void Runner::finish_block(bool abandoned) {
  in_block = false;
#if HW_SIM_ASAN
  // Abandoned fibers leave poisoned frames behind; clean the stacks for reuse.
  if (abandoned)
    for (int i = 0; i < n; ++i)
      if (fibers[i].started && fibers[i].state != kExited)
        __asan_unpoison_memory_region(stacks[i].lo, static_cast<size_t>(stacks[i].hi - stacks[i].lo));
#else
  (void)abandoned;
#endif
}

void Runner::run_block(const LaunchCtx& lc, int64_t b) {
  const dim3 g = lc.grid;
  solo.cta[0] = this;
  solo.ctas = 1;
  solo.threads = lc.nthreads;
  solo.arrived = 0;
  start_block(lc,
              dim3(static_cast<unsigned>(b % g.x), static_cast<unsigned>((b / g.x) % g.y),
                   static_cast<unsigned>(b / (static_cast<int64_t>(g.x) * g.y))),
              &solo, 0);
  run_ready();
  // All fibers exited, or an error, or deadlock.
  finish_block(failed || alive > 0);
  if (failed) {
    std::exception_ptr e = error;
    error = nullptr;
    std::rethrow_exception(e);
  }
  if (alive > 0) throw SimtError(deadlock_message());
#if defined(HW_SIM_PROFILE)
  // Cluster launches are not profiled block by block (their CTAs interleave).
  if (metrics::hooks::enabled()) metrics::hooks::block_end();
#endif
}

// barrier.cluster reached by only some threads of the cluster: which CTAs' threads are
// missing and where they are.
std::string cluster_deadlock_message(const ClusterCtx& C) {
  const Runner& R0 = *C.cta[0];
  std::string msg = std::string("headwise sim: kernel '") + R0.L->name + "' cluster of blocks " +
                    dim_str(R0.block_idx) + ".." + dim_str(C.cta[C.ctas - 1]->block_idx) +
                    ": deadlock (no thread can make progress): barrier.cluster reached by " +
                    std::to_string(C.arrived) + " of " + std::to_string(C.threads) + " threads of " +
                    std::to_string(C.ctas) + " CTAs";
  for (int r = 0; r < C.ctas; ++r) {
    const Runner& R = *C.cta[r];
    std::vector<std::string> where(static_cast<size_t>(R.n));  // empty: at the cluster barrier
    for (int t = 0; t < R.n; ++t)
      if (R.fibers[t].state != kAtCluster) where[t] = R.waiting_at(t);
    for (int t = 0; t < R.n; ++t) {
      if (where[t].empty()) continue;
      const std::string what = where[t];
      std::vector<int> threads;
      for (int u = t; u < R.n; ++u)
        if (where[u] == what) {
          threads.push_back(u);
          where[u].clear();
        }
      msg += "; CTA rank " + std::to_string(r) + " (block " + dim_str(R.block_idx) + "): thread" +
             (threads.size() > 1 ? "s " : " ") + range_list(threads) + " " + what +
             (what == "exited" ? " without reaching it" : " instead");
    }
  }
  return msg;
}

// Runs cluster number c of a cluster launch: its CTAs take turns on this OS thread until
// every thread exited, one failed, or none can make progress.
void run_cluster(const LaunchCtx& lc, int64_t c) {
  const dim3 g = lc.grid, cd = lc.cluster;
  const int64_t cgx = g.x / cd.x, cgy = g.y / cd.y;
  const dim3 first(static_cast<unsigned>(c % cgx) * cd.x, static_cast<unsigned>((c / cgx) % cgy) * cd.y,
                   static_cast<unsigned>(c / (cgx * cgy)) * cd.z);
  ClusterCtx C;
  C.ctas = static_cast<int>(cd.x * cd.y * cd.z);
  C.threads = C.ctas * lc.nthreads;
  for (int r = 0; r < C.ctas; ++r) {
    C.cta[r] = &runner(r);
    const dim3 idx(first.x + r % cd.x, first.y + (r / cd.x) % cd.y, first.z + r / (cd.x * cd.y));
    C.cta[r]->start_block(lc, idx, &C, r);
  }
  Runner* failed = nullptr;
  for (bool progress = true; progress && !failed;) {
    progress = false;
    for (int r = 0; r < C.ctas && !failed; ++r) {
      Runner& R = *C.cta[r];
      if (R.qcount == 0) continue;
      R.run_ready();
      progress = true;
      if (R.failed) failed = &R;
    }
  }
  Runner* stuck = nullptr;
  for (int r = 0; r < C.ctas; ++r)
    if (!stuck && C.cta[r]->alive > 0) stuck = C.cta[r];
  std::string deadlock;
  if (!failed && stuck) deadlock = C.arrived > 0 ? cluster_deadlock_message(C) : stuck->deadlock_message();
  for (int r = 0; r < C.ctas; ++r) C.cta[r]->finish_block(failed || stuck);
  tl_runner = &runner(0);
  if (failed) {
    std::exception_ptr e = failed->error;
    failed->error = nullptr;
    std::rethrow_exception(e);
  }
  if (stuck) throw SimtError(deadlock);
}

std::string Runner::waiting_at(int t) const {
  const Fiber& f = fibers[t];
  switch (f.state) {
    case kExited: return "exited";
    case kAtBarrier: return "wait at __syncthreads";
    case kAtCluster: return "wait at barrier.cluster";
    case kAtWarp: return std::string("wait at ") + collective_name(f) + "(mask=" + hex(f.mask) + ")";
    default: return "are runnable";
  }
}

std::string Runner::deadlock_message() {
  std::string msg = prefix() + "deadlock (no thread can make progress): ";
  bool first_part = true;
  auto sep = [&] {
    if (!first_part) msg += "; ";
    first_part = false;
  };
  auto where = [&](int t) { return waiting_at(t); };
  // Block barrier.
  if (arrived > 0) {
    sep();
    msg += "__syncthreads reached by " + std::to_string(arrived) + " of " + std::to_string(n) + " threads";
    std::vector<int> exited;
    std::vector<int> at_warp;
    for (int t = 0; t < n; ++t) {
      if (fibers[t].state == kExited) exited.push_back(t);
      if (fibers[t].state == kAtWarp) at_warp.push_back(t);
    }
    if (!exited.empty())
      msg += "; thread" + std::string(exited.size() > 1 ? "s " : " ") + range_list(exited) +
             " exited without reaching it";
    if (!at_warp.empty())
      msg += "; thread" + std::string(at_warp.size() > 1 ? "s " : " ") + range_list(at_warp) +
             " wait at warp collectives instead";
    std::vector<int> at_cluster;
    for (int t = 0; t < n; ++t)
      if (fibers[t].state == kAtCluster) at_cluster.push_back(t);
    if (!at_cluster.empty())
      msg += "; thread" + std::string(at_cluster.size() > 1 ? "s " : " ") + range_list(at_cluster) +
             " wait at barrier.cluster instead";
  }
  // Warp collectives.
  for (int w = 0; w < nwarps; ++w) {
    unsigned posted = warp_posted[w];
    while (posted) {
      const int l0 = __builtin_ctz(posted);
      const Fiber& f0 = fibers[w * 32 + l0];
      const unsigned mask = f0.mask;
      unsigned same = 0;
      for (unsigned p = posted; p; p &= p - 1) {
        const int l = __builtin_ctz(p);
        if (fibers[w * 32 + l].mask == mask) same |= 1u << l;
      }
      posted &= ~same;
      const unsigned need = mask & warp_exist[w];
      sep();
      msg += "warp " + std::to_string(w) + ": " + collective_name(f0) + "(mask=" + hex(mask) + ") reached by " +
             std::to_string(__builtin_popcount(same)) + " of " + std::to_string(__builtin_popcount(need)) +
             " lanes";
      // Group the missing lanes by what they are doing.
      unsigned missing = need & ~same;
      while (missing) {
        const int m0 = __builtin_ctz(missing);
        const std::string what = where(w * 32 + m0);
        std::vector<int> lanes;
        for (unsigned p = missing; p; p &= p - 1) {
          const int l = __builtin_ctz(p);
          if (where(w * 32 + l) == what) {
            lanes.push_back(l);
            missing &= ~(1u << l);
          }
        }
        std::vector<int> threads;
        for (int l : lanes) threads.push_back(w * 32 + l);
        msg += "; lane" + std::string(lanes.size() > 1 ? "s " : " ") + range_list(lanes) + " (thread" +
               (threads.size() > 1 ? "s " : " ") + range_list(threads) + ") " + what +
               (what == "exited" ? " without reaching it" : " instead");
      }
    }
  }
  if (first_part) msg += std::to_string(alive) + " threads blocked";
  return msg;
}

void Runner::divergent(int w, unsigned group, unsigned mask) {
  const Fiber* F = fibers + w * 32;
  std::string msg =
      thread_prefix() + "divergent warp collective in warp " + std::to_string(w) + " (mask=" + hex(mask) + "):";
  unsigned left = group;
  bool first = true;
  while (left) {
    const Fiber& a = F[__builtin_ctz(left)];
    std::vector<int> lanes;
    for (unsigned q2 = left; q2; q2 &= q2 - 1) {
      const int l = __builtin_ctz(q2);
      if (F[l].kind == a.kind && F[l].width == a.width && F[l].size == a.size && F[l].op_fn == a.op_fn) {
        lanes.push_back(l);
        left &= ~(1u << l);
      }
    }
    msg += std::string(first ? " " : "; ") + "lane" + (lanes.size() > 1 ? "s " : " ") + range_list(lanes) +
           " at " + collective_name(a);
    if (a.kind <= kShflXor) msg += "(width=" + std::to_string(a.width) + ", " + std::to_string(a.size) + "-byte value)";
    first = false;
  }
  throw SimtError(msg);
}

// All lanes of `group` (warp w) have posted matching masks: validate and compute results.
void Runner::release_warp(int w, unsigned group, int me) {
  Fiber* F = fibers + w * 32;
  const Fiber& fm = fibers[me];
  // Validate: same collective, same width and value size.
  for (unsigned p = group; p; p &= p - 1) {
    const Fiber& f = F[__builtin_ctz(p)];
    if (f.kind != fm.kind || f.width != fm.width || f.size != fm.size || f.op_fn != fm.op_fn)
      divergent(w, group, fm.mask);
  }
  const int kind = fm.kind;
  if (kind >= kShflIdx && kind <= kShflXor) {
    const int segmask = (32 - fm.width) & 31;
    for (unsigned p = group; p; p &= p - 1) {
      const int lane = __builtin_ctz(p);
      Fiber& f = F[lane];
      // PTX shfl.sync semantics.
      const int bval = f.arg & 31;
      const int minLane = lane & segmask;
      const int maxLane_hi = minLane | (31 & ~segmask);  // cval = 31 for idx/down/bfly
      int j = lane;
      bool pval = true;
      switch (kind) {
        case kShflIdx: j = minLane | (bval & ~segmask); pval = j <= maxLane_hi; break;
        case kShflUp: j = lane - bval; pval = j >= minLane; break;  // cval = 0 -> maxLane = minLane
        case kShflDown: j = lane + bval; pval = j <= maxLane_hi; break;
        case kShflXor: j = lane ^ bval; pval = j <= maxLane_hi; break;
        default: break;
      }
      if (!pval) j = lane;
      if ((group >> j) & 1u)
        std::memcpy(f.res, F[j].val, sizeof f.res);
      else
        std::memset(f.res, 0xFF, sizeof f.res);  // source lane not participating: undefined on hardware
    }
  } else if (kind == kSyncWarp) {
    if (!async_landed_words.empty()) publish_landed_async_copies_of(w, group);
  } else if (kind == kMmaSync || kind == kLdmatrix) {
    const void* in[32];
    void* out[32];
    for (int l = 0; l < 32; ++l) {
      in[l] = F[l].op_in;
      out[l] = F[l].op_out;
    }
    fm.op_fn(in, out);
  } else if (kind >= kVoteAll && kind <= kVoteBallot) {
    unsigned ballot = 0;
    for (unsigned p = group; p; p &= p - 1) {
      const int l = __builtin_ctz(p);
      if (F[l].arg) ballot |= 1u << l;
    }
    const unsigned r = kind == kVoteBallot ? ballot : kind == kVoteAll ? (ballot == group ? 1u : 0u)
                                                                        : (ballot != 0 ? 1u : 0u);
    for (unsigned p = group; p; p &= p - 1) F[__builtin_ctz(p)].res_u = r;
  }
  // Wake the others (front of the queue, lane order) and clear their posts.
  warp_posted[w] &= ~group;
  const int my_lane = me & 31;
  for (int l = 31; l >= 0; --l) {
    if (l == my_lane || !((group >> l) & 1u)) continue;
    F[l].state = kReady;
    push_front(w * 32 + l);
  }
}

inline void copy_small(void* dst, const void* src, unsigned size) {
  switch (size) {
    case 0: break;
    case 2: std::memcpy(dst, src, 2); break;
    case 4: std::memcpy(dst, src, 4); break;
    case 8: std::memcpy(dst, src, 8); break;
    case 16: std::memcpy(dst, src, 16); break;
    default: std::memcpy(dst, src, size); break;
  }
}

// Post a warp collective request for the current lane and wait for its group.
Fiber& warp_collective(int kind, unsigned mask, const void* in, unsigned size, int arg, int width) {
  Runner& R = current_runner(kind);
  const int me = R.cur;
  Fiber& f = R.fibers[me];
  const int w = me >> 5;
  const int lane = me & 31;
  if (__builtin_expect(!((mask >> lane) & 1u) || width < 1 || width > 32 || (width & (width - 1)) != 0, 0))
    bad_collective(R, kind, mask, width);
  f.kind = static_cast<unsigned char>(kind);
  f.mask = mask;
  f.arg = arg;
  f.width = width;
  f.size = static_cast<unsigned char>(size);
  copy_small(f.val, in, size);
  const unsigned group = mask & R.warp_exist[w];
  const unsigned others = group & ~(1u << lane);
  bool complete = (R.warp_posted[w] & others) == others;
  if (complete) {
    for (unsigned p = others; p; p &= p - 1)
      if (R.fibers[w * 32 + __builtin_ctz(p)].mask != mask) {
        complete = false;
        break;
      }
  }
  if (complete) {
    R.warp_posted[w] |= 1u << lane;
    R.release_warp(w, group, me);
  } else {
    R.warp_posted[w] |= 1u << lane;
    f.state = kAtWarp;
    R.wait_current();
  }
  return f;
}

}  // namespace

// ---------------------------------------------------------------------------
// Device-side entry points
// ---------------------------------------------------------------------------
int block_barrier(int op, int pred) {
  Runner& R = current_runner(-1);
  R.bar_count += pred != 0;
  if (++R.arrived == R.n) {
#if defined(HW_SIM_PROFILE)
    metrics::hooks::barrier();
#endif
    R.bar_result = R.bar_count;
    R.arrived = 0;
    R.bar_count = 0;
    R.publish_landed_async_copies();
    for (int i = 0; i < R.n; ++i) {
      if (i == R.cur) continue;
      R.fibers[i].state = kReady;
      R.push_back(i);
    }
  } else {
    R.fibers[R.cur].state = kAtBarrier;
    R.wait_current();
  }
  const int c = R.bar_result;
  switch (op) {
    case 1: return c;
    case 2: return c == R.n ? 1 : 0;
    case 3: return c > 0 ? 1 : 0;
    default: return 0;
  }
}

void warp_shfl(int kind, unsigned mask, const void* in, void* out, unsigned size, int arg, int width) {
  Fiber& f = warp_collective(kind, mask, in, size, arg, width);
  copy_small(out, f.res, size);
}

unsigned warp_vote(int kind, unsigned mask, int pred) {
  return warp_collective(kind, mask, nullptr, 0, pred != 0, 32).res_u;
}

void warp_sync(int kind, unsigned mask) { warp_collective(kind, mask, nullptr, 0, 0, 32); }

// ---------------------------------------------------------------------------
// Emulated primitives: warp operations (mma.sync, ldmatrix) and cp.async
// ---------------------------------------------------------------------------
void device_error(const std::string& what) {
  Runner* R = tl_runner;
  if (!R || !R->in_block) throw SimtError("headwise sim: " + what + " (called outside a kernel launch)");
  throw SimtError(R->thread_prefix() + what);
}

void warp_op(int kind, const char* name, WarpOpFn fn, const void* in, void* out) {
  Runner& R = current_runner(kind);
  const int w = R.cur >> 5;
  if (R.warp_exist[w] != 0xffffffffu)
    device_error(std::string(name) + " needs a full warp of 32 threads, but warp " + std::to_string(w) +
                 " of this " + std::to_string(R.n) + "-thread block has " +
                 std::to_string(__builtin_popcount(R.warp_exist[w])));
  Fiber& f = R.fibers[R.cur];
  f.op_fn = fn;
  f.op_name = name;
  f.op_in = in;
  f.op_out = out;
  warp_collective(kind, 0xffffffffu, nullptr, 0, 0, 32);
  f.op_fn = nullptr;
}

bool in_shared_window(const void* p, size_t bytes) {
  Runner* R = tl_runner;
  if (!R || !R->in_block || R->smem_used == 0) return false;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p), lo = reinterpret_cast<uintptr_t>(R->smem);
  return a >= lo && a - lo <= R->smem_used && bytes <= R->smem_used - (a - lo);
}

void check_async_copies_visible(const void* p, size_t bytes, const char* who) {
  Runner& R = current_runner(kLdmatrix);
  const size_t off = static_cast<size_t>(static_cast<const unsigned char*>(p) - R.smem);
  for (size_t w = off / 4; w < (off + bytes + 3) / 4; ++w) {
    const uint16_t owner = R.async_word_owner[w];
    if (owner == 0) continue;
    const std::string thread = "thread " + std::to_string((owner & ~Runner::kAsyncLanded) - 1);
    if (owner & Runner::kAsyncLanded)
      device_error(std::string(who) + " reads shared byte offset " + std::to_string(4 * w) + ", written by " +
                   thread + "'s cp.async, which landed at that thread's cp.async.wait but no __syncthreads "
                   "has made it visible to other threads since");
    device_error(std::string(who) + " reads shared byte offset " + std::to_string(4 * w) + ", the destination of " +
                 thread + "'s cp.async that no cp.async.wait_group/wait_all has retired (it reads as poison)");
  }
}

void Runner::land_async_copy(const Fiber::AsyncCopy& c) {
  std::memcpy(c.dst, c.src, c.src_size);
  std::memset(c.dst + c.src_size, 0, c.cp_size - c.src_size);  // the zero-fill of src-size < cp-size
  const size_t w0 = static_cast<size_t>(c.dst - smem) / 4;
  for (size_t w = w0; w < w0 + c.cp_size / 4; ++w) {
    if (async_word_owner[w] != cur + 1) continue;  // a later copy of another thread owns it
    async_word_owner[w] |= kAsyncLanded;
    async_landed_words.push_back(static_cast<uint32_t>(w));
  }
}

void cp_async(void* dst, const void* src, unsigned cp_size, unsigned src_size, bool cache_global) {
  const char* op = cache_global ? "cp.async.cg.shared.global" : "cp.async.ca.shared.global";
  Runner* R = tl_runner;
  if (!R || !R->in_block || R->cur < 0) device_error(std::string(op) + " called outside a kernel launch");
  auto fail = [&](const std::string& why) {
    char where[64];
    std::snprintf(where, sizeof where, " (dst %p, src %p)", dst, src);
    device_error(std::string(op) + " of " + std::to_string(cp_size) + " bytes: " + why + where);
  };
  if (cache_global ? cp_size != 16 : (cp_size != 4 && cp_size != 8 && cp_size != 16))
    fail(cache_global ? "cp-size must be 16" : "cp-size must be 4, 8 or 16");
  if (src_size > cp_size) fail("src-size " + std::to_string(src_size) + " exceeds cp-size");
  if (!in_shared_window(dst, cp_size))
    fail("the destination is not in the block's dynamic shared memory (hw::dynamic_shared_memory())");
  if (reinterpret_cast<uintptr_t>(dst) % cp_size) fail("the shared destination is not aligned to cp-size");
  if (src_size > 0 && src == nullptr) fail("the global source is a null pointer");
  if (in_shared_window(src, 1)) fail("the source is in shared memory; it must be a global address");
  if (reinterpret_cast<uintptr_t>(src) % cp_size) fail("the global source is not aligned to cp-size");
  unsigned char* d = static_cast<unsigned char*>(dst);
  std::memset(d, 0xFF, cp_size);  // poison until the issuing thread's wait
  const size_t w0 = static_cast<size_t>(d - R->smem) / 4;
  for (size_t w = w0; w < w0 + cp_size / 4; ++w) R->async_word_owner[w] = static_cast<uint16_t>(R->cur + 1);
  R->fibers[R->cur].async_copies.push_back({d, static_cast<const unsigned char*>(src), cp_size, src_size, -1});
}

void cp_async_commit_group() {
  Runner* R = tl_runner;
  if (!R || !R->in_block || R->cur < 0) device_error("cp.async.commit_group called outside a kernel launch");
  Fiber& f = R->fibers[R->cur];
  for (Fiber::AsyncCopy& c : f.async_copies)
    if (c.group < 0) c.group = f.async_groups_committed;
  ++f.async_groups_committed;
}

void cp_async_wait_group(int pending_groups_allowed) {
  Runner* R = tl_runner;
  if (!R || !R->in_block || R->cur < 0) device_error("cp.async.wait_group called outside a kernel launch");
  if (pending_groups_allowed < 0) device_error("cp.async.wait_group: N must be a non-negative constant");
  Fiber& f = R->fibers[R->cur];
  // Retire every committed group but the newest `pending_groups_allowed`; copies not yet
  // committed stay in flight (PTX: wait_group waits for committed groups only).
  const int retire_below = f.async_groups_committed - pending_groups_allowed;
  size_t kept = 0;
  for (size_t i = 0; i < f.async_copies.size(); ++i) {
    const Fiber::AsyncCopy c = f.async_copies[i];
    if (c.group >= 0 && c.group < retire_below)
      R->land_async_copy(c);
    else
      f.async_copies[kept++] = c;
  }
  f.async_copies.resize(kept);
}

// ---------------------------------------------------------------------------
// Thread block clusters
// ---------------------------------------------------------------------------
unsigned cluster_ctarank() { return static_cast<unsigned>(current_runner(-3).cluster_rank); }

unsigned cluster_num_ctas() { return static_cast<unsigned>(current_runner(-3).cluster->ctas); }

void cluster_barrier() {
  Runner& R = current_runner(-3);
  ClusterCtx& C = *R.cluster;
  if (++C.arrived == C.threads) {
    C.arrived = 0;
    for (int r = 0; r < C.ctas; ++r) {
      Runner& P = *C.cta[r];
      for (int i = 0; i < P.n; ++i) {
        if (P.fibers[i].state != kAtCluster) continue;
        P.fibers[i].state = kReady;
        P.push_back(i);
      }
      P.publish_landed_async_copies();  // the barrier orders shared memory cluster-wide
    }
  } else {
    R.fibers[R.cur].state = kAtCluster;
    R.wait_current();
  }
}

void* cluster_map_shared(const void* p, unsigned rank) {
  Runner& R = current_runner(-3);
  if (rank >= static_cast<unsigned>(R.cluster->ctas))
    device_error("mapa (cluster_map_shared): rank " + std::to_string(rank) + " is not in this cluster of " +
                 std::to_string(R.cluster->ctas) + " CTAs");
  if (!in_shared_window(p, 1))
    device_error("mapa (cluster_map_shared): the address is not in the block's dynamic shared memory "
                 "(hw::dynamic_shared_memory())");
  return R.cluster->cta[rank]->smem + (static_cast<const unsigned char*>(p) - R.smem);
}

unsigned active_mask() {
  Runner& R = current_runner(-2);
  const int w = R.cur >> 5;
  return R.warp_exist[w] & ~R.warp_exited[w];
}

void trap() {
  Runner* R = tl_runner;
  if (!R || !R->in_block) throw SimtError("headwise sim: __trap() called outside a kernel launch");
  throw SimtError(R->thread_prefix() + "__trap() called");
}

void yield_thread() {
  Runner* R = tl_runner;
  if (!R || !R->in_block || R->cur < 0 || R->qcount == 0) return;
  R->fibers[R->cur].state = kReady;
  R->push_back(R->cur);
  R->wait_current();
}

long long clock_now() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace detail

// ---------------------------------------------------------------------------
// Host-side API
// ---------------------------------------------------------------------------
namespace {
std::atomic<ParallelFor> g_parallel_for{nullptr};
}

void set_parallel_for(ParallelFor pf) { g_parallel_for.store(pf); }

unsigned char* dynamic_shared_memory() {
  detail::Runner* R = detail::tl_runner;
  return (R && R->in_block) ? R->smem : nullptr;
}

void launch(const char* kernel_name, dim3 grid, dim3 block, size_t dynamic_smem_bytes,
            const std::function<void()>& body) {
  launch_cluster(kernel_name, grid, block, dim3(1, 1, 1), dynamic_smem_bytes, body);
}

void launch_cluster(const char* kernel_name, dim3 grid, dim3 block, dim3 cluster, size_t dynamic_smem_bytes,
                    const std::function<void()>& body) {
  const std::string name = kernel_name ? kernel_name : "?";
  const bool clustered = cluster.x * cluster.y * cluster.z != 1;
  auto bad = [&](const std::string& why) {
    throw SimtError("headwise sim: kernel '" + name + "': invalid launch configuration: grid " +
                    detail::dim_str(grid) + ", block " + detail::dim_str(block) +
                    (clustered ? ", cluster " + detail::dim_str(cluster) : std::string()) + ", " +
                    std::to_string(dynamic_smem_bytes) + " bytes dynamic shared memory: " + why);
  };
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) bad("empty grid");
  if (block.x == 0 || block.y == 0 || block.z == 0) bad("empty block");
  if (grid.x > 2147483647u) bad("grid.x exceeds 2147483647");
  if (grid.y > 65535u || grid.z > 65535u) bad("grid.y and grid.z must be at most 65535");
  const uint64_t nthreads = static_cast<uint64_t>(block.x) * block.y * block.z;
  if (nthreads > 1024u) bad(std::to_string(nthreads) + " threads per block (max 1024)");
  if (block.z > 64u) bad("block.z exceeds 64");
  if (dynamic_smem_bytes > 227u * 1024u) bad("dynamic shared memory exceeds 232448 bytes");
  if (!body) bad("empty kernel body");
  if (cluster.x == 0 || cluster.y == 0 || cluster.z == 0) bad("empty cluster");
  if (grid.x % cluster.x || grid.y % cluster.y || grid.z % cluster.z) bad("grid is not a multiple of the cluster");
  if (static_cast<uint64_t>(cluster.x) * cluster.y * cluster.z > detail::kMaxClusterCtas)
    bad("more than " + std::to_string(detail::kMaxClusterCtas) + " CTAs per cluster (the portable limit)");
  if (detail::tl_runner && detail::tl_runner->in_block)
    throw SimtError("headwise sim: kernel '" + name + "': launch from device code is not supported");

  detail::LaunchCtx lc{name.c_str(), grid, block, dynamic_smem_bytes, static_cast<int>(nthreads), &body, cluster};
  // Work items: blocks, or whole clusters (a cluster's CTAs run together on one OS thread).
  const int64_t total = static_cast<int64_t>(grid.x / cluster.x) * (grid.y / cluster.y) * (grid.z / cluster.z);
  std::atomic<bool> failed{false};
  std::mutex mu;
  std::exception_ptr first;
  const std::function<void(int64_t, int64_t)> fn = [&](int64_t lo, int64_t hi) {
    if (failed.load(std::memory_order_relaxed)) return;
    try {
      detail::Runner& R = detail::runner();
      for (int64_t b = lo; b < hi; ++b) {
        if (failed.load(std::memory_order_relaxed)) return;
        if (clustered)
          detail::run_cluster(lc, b);
        else
          R.run_block(lc, b);
      }
    } catch (...) {
      std::lock_guard<std::mutex> g(mu);
      if (!first) first = std::current_exception();
      failed.store(true);
    }
  };
  ParallelFor pf = g_parallel_for.load();
#if defined(HW_SIM_PROFILE)
  // Collected metrics are filled by one thread: the blocks run one after another.
  const bool profiling = metrics::hooks::enabled();
  if (profiling) {
    pf = nullptr;
    metrics::hooks::launch_begin(lc.name, grid, block, dynamic_smem_bytes);
  }
#endif
  if (pf)
    pf(0, total, fn);
  else
    fn(0, total);
#if defined(HW_SIM_PROFILE)
  if (profiling) metrics::hooks::launch_end();
#endif
  if (first) std::rethrow_exception(first);
}

}  // namespace hw_sim
