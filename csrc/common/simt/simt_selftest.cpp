// Self-tests of the SIMT emulator: tiny CUDA kernels, written as device code for nvcc
// would be, launched through hw_sim::launch and registered as torch.ops.headwise_simtest.*
// in the emulated library headwise._sim. tests/simt/test_simt_emulator.py checks them
// against pure-Python models of the CUDA semantics, and checks that every faulty
// kernel of faulty_kernel() fails fast with a precise message instead of hanging.
//
// Ops (CPU tensors):
//   block_sum(x [R, n] f32, threads, kind)      one block per row; kind 0: shared-memory
//                                               tree, kind 1: warp shuffles + shared memory
//   block_vote(pred [R, T] i32)                 __syncthreads_count/_and/_or per thread
//   index_map(grid[3], block[3])                built-in index variables of every thread
//   warp_shuffle(x [T] i32/i64, kind, arg, width, mask)
//   warp_vote(pred [T] i32, mask)               __all_sync/__any_sync/__ballot_sync
//   warp_sum_scatter(x [32, M] f32)             hw::warp_sum_scatter's held sums, and
//                                               hw::warp_sum of each column
//   dynamic_smem_roundtrip(blocks, threads, bytes)
//   atomic_add_blocks(blocks, threads)          atomics across blocks on several OS threads
//   spin_wait(threads)                          an intra-block spin-wait with __nanosleep
//   wmma_gemm(a [M, K], b [K, N] or [N, K], b_col_major)  f16/bf16 tiles, f32 accumulation
//   faulty_kernel(which)                        a buggy kernel; always raises RuntimeError
//   mma_lanes, ldmatrix_lanes, cp_async_roundtrip, cp_async_ldmatrix, cluster_exchange,
//   warp_octets                                 lane-by-lane tests of the primitives of
//                                               csrc/common/{mma_primitives,cluster,
//                                               warp_octets}.cuh (kernels in
//                                               primitive_selftest.cuh, also built for CUDA)
#include "simt.h"
#include "../block_reduce.cuh"
#include "primitive_selftest.cuh"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
#include <stdexcept>
#include <thread>
#include <tuple>
#include <type_traits>

namespace headwise {
namespace simtest {
namespace {

// ---------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------

// Sum of each row; any block size in [1, 1024].
__global__ void block_sum_smem_kernel(const float* __restrict__ x, int n, float* __restrict__ out) {
  __shared__ float partial[1024];
  const int tid = threadIdx.x;
  const int nt = blockDim.x;
  const float* row = x + static_cast<int64_t>(blockIdx.x) * n;
  float acc = 0.0f;
  for (int i = tid; i < n; i += nt) acc += row[i];
  partial[tid] = acc;
  __syncthreads();
  int s = 1;  // largest power of two below nt (1 for nt <= 2)
  while (2 * s < nt) s *= 2;
  for (; s > 0; s >>= 1) {
    if (tid < s && tid + s < nt) partial[tid] += partial[tid + s];
    __syncthreads();
  }
  if (tid == 0) out[blockIdx.x] = partial[0];
}

// Sum of each row; the block size is a multiple of 32.
__global__ void block_sum_shfl_kernel(const float* __restrict__ x, int n, float* __restrict__ out) {
  __shared__ float warp_sums[32];
  const int tid = threadIdx.x;
  const int lane = tid % warpSize;
  const int warp = tid / warpSize;
  const float* row = x + static_cast<int64_t>(blockIdx.x) * n;
  float acc = 0.0f;
  for (int i = tid; i < n; i += blockDim.x) acc += row[i];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) warp_sums[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    const int nwarps = blockDim.x / warpSize;
    float v = lane < nwarps ? warp_sums[lane] : 0.0f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    if (lane == 0) out[blockIdx.x] = v;
  }
}

// out[row, tid] = (count, and, or) of the row's predicates, as seen by every thread.
__global__ void block_vote_kernel(const int* __restrict__ pred, int* __restrict__ out) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int p = pred[t];
  const int count = __syncthreads_count(p);
  const int all = __syncthreads_and(p);
  const int any = __syncthreads_or(p);
  out[3 * t + 0] = count;
  out[3 * t + 1] = all;
  out[3 * t + 2] = any;
}

// One row of 12 per thread, at the thread's global linear index.
__global__ void index_map_kernel(int64_t* __restrict__ out) {
  const int64_t block = blockIdx.x + static_cast<int64_t>(gridDim.x) * (blockIdx.y + static_cast<int64_t>(gridDim.y) * blockIdx.z);
  const int64_t tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const int64_t nthreads = static_cast<int64_t>(blockDim.x) * blockDim.y * blockDim.z;
  int64_t* o = out + (block * nthreads + tid) * 12;
  o[0] = blockIdx.x;
  o[1] = blockIdx.y;
  o[2] = blockIdx.z;
  o[3] = threadIdx.x;
  o[4] = threadIdx.y;
  o[5] = threadIdx.z;
  o[6] = blockDim.x;
  o[7] = blockDim.y;
  o[8] = blockDim.z;
  o[9] = gridDim.x;
  o[10] = gridDim.y;
  o[11] = gridDim.z;
}

// One block. Lanes outside `mask` keep their value and do not take part.
template <typename T>
__global__ void warp_shuffle_kernel(const T* __restrict__ in, T* __restrict__ out, int kind, int arg,
                                    int width, unsigned mask) {
  const int t = threadIdx.x;
  const int lane = t % warpSize;
  const T v = in[t];
  if (!((mask >> lane) & 1u)) {
    out[t] = v;
    return;
  }
  T r;
  switch (kind) {
    case 0: r = __shfl_sync(mask, v, arg, width); break;
    case 1: r = __shfl_up_sync(mask, v, static_cast<unsigned>(arg), width); break;
    case 2: r = __shfl_down_sync(mask, v, static_cast<unsigned>(arg), width); break;
    default: r = __shfl_xor_sync(mask, v, arg, width); break;
  }
  out[t] = r;
}

// One warp; x [32, M]. scattered[lane, first + k] = the k-th sum the lane holds after
// hw::warp_sum_scatter<M> (NaN elsewhere); butterfly[m] = hw::warp_sum of column m.
template <int M>
__global__ void warp_sum_scatter_kernel(const float* __restrict__ x, float* __restrict__ scattered,
                                        float* __restrict__ butterfly) {
  const int lane = threadIdx.x;
  float v[M];
  for (int m = 0; m < M; ++m) v[m] = x[lane * M + m];
  for (int m = 0; m < M; ++m) {
    const float s = hw::warp_sum(v[m]);
    if (lane == 0) butterfly[m] = s;
  }
  hw::warp_sum_scatter(v);
  const int first = hw::warp_scatter_first<M>(lane);
  for (int k = 0; k < (M >> hw::warp_scatter_levels(M)); ++k) scattered[lane * M + first + k] = v[k];
}

// One block; out[t] = (all, any, ballot), or -1s for lanes outside `mask`.
__global__ void warp_vote_kernel(const int* __restrict__ pred, int64_t* __restrict__ out, unsigned mask) {
  const int t = threadIdx.x;
  const int lane = t % warpSize;
  if (!((mask >> lane) & 1u)) {
    out[3 * t] = out[3 * t + 1] = out[3 * t + 2] = -1;
    return;
  }
  const int p = pred[t];
  __syncwarp(mask);
  out[3 * t + 0] = __all_sync(mask, p);
  out[3 * t + 1] = __any_sync(mask, p);
  out[3 * t + 2] = __ballot_sync(mask, p);
}

// out[b, 0, :] = the block's dynamic shared memory as read before any write (the
// emulator's 0xFF poison), out[b, 1, :] = words written by other threads of the block.
__global__ void dynamic_smem_kernel(int nwords, int* __restrict__ out) {
  int* smem = reinterpret_cast<int*>(hw_sim::dynamic_shared_memory());
  if (reinterpret_cast<uintptr_t>(smem) % 128 != 0) __trap();
  int* before = out + static_cast<int64_t>(blockIdx.x) * 2 * nwords;
  int* after = before + nwords;
  for (int i = threadIdx.x; i < nwords; i += blockDim.x) before[i] = smem[i];
  __syncthreads();
  for (int i = threadIdx.x; i < nwords; i += blockDim.x) smem[i] = static_cast<int>(blockIdx.x) * 1000003 + i;
  __syncthreads();
  // Read the words in reverse thread order: each comes from another thread's write.
  for (int i = threadIdx.x; i < nwords; i += blockDim.x) {
    const int j = nwords - 1 - i;
    after[j] = smem[j];
  }
}

// An id of the OS thread running the block (emulator only: shows blocks in parallel).
int64_t os_thread_token() {
  return static_cast<int64_t>(std::hash<std::thread::id>{}(std::this_thread::get_id()) &
                              0x7fffffffffffffffULL);
}

__global__ void atomics_kernel(float* __restrict__ fsum, int* __restrict__ ints,
                               unsigned long long* __restrict__ gid_sum, int64_t* __restrict__ owner) {
  const int gid = blockIdx.x * blockDim.x + threadIdx.x;
  atomicAdd(fsum, 1.0f);
  atomicAdd(&ints[0], 1);
  atomicMax(&ints[1], gid);
  atomicMin(&ints[2], gid);
  atomicAdd(gid_sum, static_cast<unsigned long long>(gid));
  if (threadIdx.x == 0) owner[blockIdx.x] = os_thread_token();
}

// C[M, N] = A[M, K] B[K, N] (B stored row-major [K, N], or column-major as [N, K]).
// Two warps per block, one 16x16 output tile per warp.
template <typename T, typename LayoutB>
__global__ void wmma_gemm_kernel(const T* __restrict__ a, const T* __restrict__ b, float* __restrict__ c,
                                 int M, int N, int K) {
  using namespace nvcuda;
  constexpr bool b_col = std::is_same<LayoutB, wmma::col_major>::value;
  const int warp = threadIdx.x / warpSize;
  const int tile_n = blockIdx.x * 2 + warp;
  const int tile_m = blockIdx.y;
  if (tile_n * 16 >= N || tile_m * 16 >= M) return;  // the whole warp leaves
  wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, T, LayoutB> fb;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  wmma::fill_fragment(acc, 0.0f);
  for (int k = 0; k < K; k += 16) {
    wmma::load_matrix_sync(fa, a + static_cast<int64_t>(tile_m) * 16 * K + k, K);
    if (b_col)
      wmma::load_matrix_sync(fb, b + static_cast<int64_t>(tile_n) * 16 * K + k, K);
    else
      wmma::load_matrix_sync(fb, b + static_cast<int64_t>(k) * N + tile_n * 16, N);
    wmma::mma_sync(acc, fa, fb, acc);
  }
  wmma::store_matrix_sync(c + static_cast<int64_t>(tile_m) * 16 * N + tile_n * 16, acc, N, wmma::mem_row_major);
}

// --- faulty kernels (faulty_kernel(which)) ---

// 0: half of the block returns before the barrier.
__global__ void early_return_kernel(int* __restrict__ out) {
  if (threadIdx.x >= 32) return;
  out[threadIdx.x] = 1;
  __syncthreads();
}

// 1: a barrier inside a divergent branch.
__global__ void divergent_barrier_kernel(int* __restrict__ out) {
  if (threadIdx.x < 16) {
    out[threadIdx.x] = 1;
    __syncthreads();
  }
}

// 2: a full-mask shuffle after lane 31 has returned.
__global__ void exited_lane_shuffle_kernel(int* __restrict__ out) {
  const int lane = threadIdx.x % warpSize;
  if (lane == 31) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, lane, 1);
}

// 3: even and odd lanes at two different collectives with the same mask.
__global__ void mixed_collectives_kernel(int* __restrict__ out) {
  const int lane = threadIdx.x % warpSize;
  if (lane % 2 == 0)
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, lane, 2);
  else
    out[threadIdx.x] = static_cast<int>(__ballot_sync(0xffffffffu, 1));
}

// 4: __trap() in thread 5 of block 3 while the others wait at a barrier.
__global__ void trap_kernel(int* __restrict__ out) {
  if (blockIdx.x == 3 && threadIdx.x == 5) __trap();
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = 1;
}

// 5 (bad launch configuration) launches this one with 2048 threads per block.
__global__ void trivial_kernel(int* __restrict__ out) { out[threadIdx.x] = 1; }

// 6: a C++ exception thrown by device code (emulator only; nvcc rejects `throw`).
__global__ void throwing_kernel(int* __restrict__ out) {
  if (threadIdx.x == 7) throw std::out_of_range("device index 99 out of range in thread 7");
  __syncthreads();
  out[threadIdx.x] = 1;
}

// 7: a shuffle width that is not a power of two.
__global__ void bad_width_kernel(int* __restrict__ out) {
  out[threadIdx.x] = __shfl_down_sync(0xffffffffu, static_cast<int>(threadIdx.x), 1, 3);
}

// 8: lanes 16..31 call a shuffle whose mask names only lanes 0..15.
__global__ void mask_without_caller_kernel(int* __restrict__ out) {
  out[threadIdx.x] = __shfl_sync(0x0000ffffu, static_cast<int>(threadIdx.x), 0);
}

// 9: the early return of case 0 in block (2,0,0) of a 4-block grid only.
__global__ void early_return_block2_kernel(int* __restrict__ out) {
  if (blockIdx.x == 2 && threadIdx.x >= 32) return;
  out[blockIdx.x * blockDim.x + threadIdx.x] = 1;
  __syncthreads();
}

// 10: two groups with different masks, each waiting for lanes of the other.
__global__ void crossed_masks_kernel(int* __restrict__ out) {
  const int lane = threadIdx.x % warpSize;
  if (lane < 16) {
    __syncwarp(0xffffffffu);
    out[threadIdx.x] = lane;
  } else {
    out[threadIdx.x] = static_cast<int>(__ballot_sync(0xfffffffeu, 1));
  }
}

// 11: warp 0 at __syncthreads while warp 1 waits at __syncwarp for its exited lane 31.
__global__ void barrier_vs_warp_kernel(int* __restrict__ out) {
  const int warp = threadIdx.x / warpSize;
  const int lane = threadIdx.x % warpSize;
  if (warp == 0) {
    __syncthreads();
  } else {
    if (lane == 31) return;
    __syncwarp();
  }
  out[threadIdx.x] = 1;
}

// 12: a launch from device code.
__global__ void nested_launch_kernel(int* __restrict__ out) {
  if (threadIdx.x == 0) hw_sim::launch("inner", 1, 1, 0, [] {});
  out[threadIdx.x] = 1;
}

// --- faulty uses of the primitives of csrc/common/mma_primitives.cuh (cases 14..) ---

// 14: a 16-byte cp.async to a shared address that is only 4-byte aligned.
__global__ void cp_async_misaligned_kernel(const int* __restrict__ src) {
  unsigned char* smem = hw::dynamic_shared_memory();
  if (threadIdx.x == 3) hw::cp_async_cg16(smem + 4, src, 16);
  hw::cp_async_wait_all();
}

// 15: a cp.async whose destination is global memory, not shared.
__global__ void cp_async_global_dst_kernel(int* __restrict__ buf) {
  if (threadIdx.x == 0) hw::cp_async_ca<8>(buf + 64, buf, 8);
  hw::cp_async_wait_all();
}

// 16: ldmatrix with lane 9's row address 4 bytes past a 16-byte boundary.
__global__ void ldmatrix_misaligned_kernel(int* __restrict__ out) {
  unsigned char* smem = hw::dynamic_shared_memory();
  uint32_t r[2];
  hw::ldmatrix<2>(r, smem + 16 * (threadIdx.x % 16) + (threadIdx.x == 9 ? 4 : 0));
  out[threadIdx.x] = static_cast<int>(r[0]);
}

// 17 / 18: primtest::cp_async_ldmatrix_kernel without the wait (17), or with the wait but
// without a __syncwarp / __syncthreads before the ldmatrix (18).

// 19: mma.sync in a block of 48 threads (warp 1 has 16 lanes). 20: lane 31 has exited.
// 21: lanes 0..15 at the bf16 mma, lanes 16..31 at the tf32 one.
__global__ void mma_misuse_kernel(int which, float* __restrict__ out) {
  const uint32_t a[4] = {0, 0, 0, 0}, b[2] = {0, 0};
  const float c[4] = {0, 0, 0, 0};
  float d[4];
  if (which == 20 && threadIdx.x % 32 == 31) return;
  if (which == 21 && threadIdx.x % 32 >= 16)
    hw::mma_m16n8k8_tf32(d, a, b, c);
  else
    hw::mma_m16n8k16_bf16(d, a, b, c);
  out[threadIdx.x] = d[0];
}

// 22: ldmatrix with lane 5's row address in global memory.
__global__ void ldmatrix_global_row_kernel(int* __restrict__ buf) {
  unsigned char* smem = hw::dynamic_shared_memory();
  uint32_t r[1];
  hw::ldmatrix<1>(r, threadIdx.x == 5 ? static_cast<void*>(buf + 64) : static_cast<void*>(smem + 16 * (threadIdx.x % 8)));
  buf[threadIdx.x] = static_cast<int>(r[0]);
}

// 23: CTA rank 1 of each 2-CTA cluster returns before the cluster barrier.
__global__ void cluster_barrier_early_exit_kernel(int* __restrict__ out) {
  if (hw::cluster_ctarank() == 1) return;
  hw::cluster_sync();
  out[blockIdx.x * blockDim.x + threadIdx.x] = 1;
}

// 24: mapa of a rank outside the 2-CTA cluster.
__global__ void cluster_bad_rank_kernel(int* __restrict__ out) {
  int* words = reinterpret_cast<int*>(hw::dynamic_shared_memory());
  out[threadIdx.x] = *hw::cluster_map_shared(words, 2);
}

// spin_wait(threads): thread 0 spins, sleeping, until the block's last thread sets a
// flag. It terminates because __nanosleep is a yield point of the emulator.
__global__ void spin_wait_kernel(int* __restrict__ out) {
  volatile int* flag = out;
  if (threadIdx.x == 0) {
    while (*flag == 0) __nanosleep(100);
    out[1] = 2;
  } else if (threadIdx.x == blockDim.x - 1) {
    atomicExch(&out[0], 1);
  }
}

// ---------------------------------------------------------------------------
// Host side
// ---------------------------------------------------------------------------

// Runs the launch; errors of the emulator (and exceptions of device code) become
// c10::Error, i.e. RuntimeError in Python, with the emulator's message.
template <typename F>
void checked(F&& launch_fn) {
  try {
    launch_fn();
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& e) {
    TORCH_CHECK(false, e.what());
  }
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "headwise_simtest: ", name, " must be a CPU tensor");
}

at::Tensor block_sum(const at::Tensor& x, int64_t threads, int64_t kind) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "block_sum: x must be a 2-D float32 tensor");
  TORCH_CHECK(threads >= 1 && threads <= 1024, "block_sum: threads must be in [1, 1024]");
  TORCH_CHECK(kind == 0 || kind == 1, "block_sum: kind must be 0 (shared-memory tree) or 1 (warp shuffles)");
  TORCH_CHECK(kind == 0 || threads % 32 == 0, "block_sum: kind 1 needs a multiple of 32 threads");
  TORCH_CHECK(x.size(0) >= 1 && x.size(1) <= std::numeric_limits<int>::max(), "block_sum: bad shape");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::full({x.size(0)}, std::numeric_limits<float>::quiet_NaN(), x.options());
  const float* xp = xc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int n = static_cast<int>(x.size(1));
  const dim3 grid(static_cast<unsigned>(x.size(0)));
  const dim3 block(static_cast<unsigned>(threads));
  checked([&] {
    if (kind == 0)
      hw_sim::launch("block_sum_smem", grid, block, 0, [&] { block_sum_smem_kernel(xp, n, op); });
    else
      hw_sim::launch("block_sum_shfl", grid, block, 0, [&] { block_sum_shfl_kernel(xp, n, op); });
  });
  return out;
}

at::Tensor block_vote(const at::Tensor& pred) {
  check_cpu(pred, "pred");
  TORCH_CHECK(pred.dim() == 2 && pred.scalar_type() == at::kInt, "block_vote: pred must be a 2-D int32 tensor");
  TORCH_CHECK(pred.size(0) >= 1 && pred.size(1) >= 1 && pred.size(1) <= 1024, "block_vote: bad shape");
  const at::Tensor pc = pred.contiguous();
  at::Tensor out = at::full({pred.size(0), pred.size(1), 3}, -7, pred.options());
  const int* pp = pc.data_ptr<int>();
  int* op = out.data_ptr<int>();
  checked([&] {
    hw_sim::launch("block_vote", dim3(static_cast<unsigned>(pred.size(0))), dim3(static_cast<unsigned>(pred.size(1))),
                   0, [&] { block_vote_kernel(pp, op); });
  });
  return out;
}

at::Tensor index_map(at::IntArrayRef grid, at::IntArrayRef block) {
  TORCH_CHECK(grid.size() == 3 && block.size() == 3, "index_map: grid and block are [x, y, z]");
  // Dimensions the emulator must reject (0, block.z > 64, ...) are passed through.
  int64_t total = 1;
  for (int i = 0; i < 3; ++i) {
    TORCH_CHECK(grid[i] >= 0 && grid[i] <= 0xffffffffLL && block[i] >= 0 && block[i] <= 0xffffffffLL,
                "index_map: dimensions must be 32-bit unsigned values");
    total *= grid[i] > 0 ? grid[i] : 0;
    total *= block[i] > 0 ? block[i] : 0;
    TORCH_CHECK(total <= (int64_t{1} << 22), "index_map: too many threads for a test");
  }
  const dim3 g(static_cast<unsigned>(grid[0]), static_cast<unsigned>(grid[1]), static_cast<unsigned>(grid[2]));
  const dim3 b(static_cast<unsigned>(block[0]), static_cast<unsigned>(block[1]), static_cast<unsigned>(block[2]));
  at::Tensor out = at::full({total, 12}, -7, at::TensorOptions().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  checked([&] { hw_sim::launch("index_map", g, b, 0, [&] { index_map_kernel(op); }); });
  return out;
}

at::Tensor warp_shuffle(const at::Tensor& x, int64_t kind, int64_t arg, int64_t width, int64_t mask) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 1 && x.size(0) >= 1 && x.size(0) <= 1024, "warp_shuffle: x must be [threads], 1..1024");
  TORCH_CHECK(kind >= 0 && kind <= 3, "warp_shuffle: kind is 0 (idx), 1 (up), 2 (down) or 3 (xor)");
  TORCH_CHECK(arg >= std::numeric_limits<int>::min() && arg <= std::numeric_limits<int>::max() &&
                  width >= std::numeric_limits<int>::min() && width <= std::numeric_limits<int>::max(),
              "warp_shuffle: arg and width must fit in int");
  TORCH_CHECK(mask >= 0 && mask <= 0xffffffffLL, "warp_shuffle: mask must be a 32-bit unsigned value");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::full_like(xc, -7);
  const int k = static_cast<int>(kind), a = static_cast<int>(arg), w = static_cast<int>(width);
  const unsigned m = static_cast<unsigned>(mask);
  const dim3 block(static_cast<unsigned>(x.size(0)));
  if (x.scalar_type() == at::kInt) {
    const int* ip = xc.data_ptr<int>();
    int* op = out.data_ptr<int>();
    checked([&] { hw_sim::launch("warp_shuffle<int>", 1, block, 0, [&] { warp_shuffle_kernel(ip, op, k, a, w, m); }); });
  } else {
    TORCH_CHECK(x.scalar_type() == at::kLong, "warp_shuffle: x must be int32 or int64");
    const int64_t* ip = xc.data_ptr<int64_t>();
    int64_t* op = out.data_ptr<int64_t>();
    checked([&] {
      hw_sim::launch("warp_shuffle<int64>", 1, block, 0, [&] { warp_shuffle_kernel(ip, op, k, a, w, m); });
    });
  }
  return out;
}

std::tuple<at::Tensor, at::Tensor> warp_sum_scatter(const at::Tensor& x) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 32 && x.scalar_type() == at::kFloat,
              "warp_sum_scatter: x must be float32 [32, M]");
  const at::Tensor xc = x.contiguous();
  at::Tensor scattered = at::full_like(xc, std::numeric_limits<float>::quiet_NaN());
  at::Tensor butterfly = at::empty({x.size(1)}, xc.options());
  const float* xp = xc.data_ptr<float>();
  float* sp = scattered.data_ptr<float>();
  float* bp = butterfly.data_ptr<float>();
  auto run = [&](auto m) {
    constexpr int M = decltype(m)::value;
    checked([&] {
      hw_sim::launch("warp_sum_scatter", 1, dim3(32), 0, [&] { warp_sum_scatter_kernel<M>(xp, sp, bp); });
    });
  };
  switch (x.size(1)) {
    case 1: run(std::integral_constant<int, 1>{}); break;
    case 2: run(std::integral_constant<int, 2>{}); break;
    case 3: run(std::integral_constant<int, 3>{}); break;
    case 4: run(std::integral_constant<int, 4>{}); break;
    case 6: run(std::integral_constant<int, 6>{}); break;
    case 12: run(std::integral_constant<int, 12>{}); break;
    case 16: run(std::integral_constant<int, 16>{}); break;
    case 24: run(std::integral_constant<int, 24>{}); break;
    case 96: run(std::integral_constant<int, 96>{}); break;
    default: TORCH_CHECK(false, "warp_sum_scatter: M must be 1, 2, 3, 4, 6, 12, 16, 24 or 96, got ", x.size(1));
  }
  return {scattered, butterfly};
}

at::Tensor warp_vote(const at::Tensor& pred, int64_t mask) {
  check_cpu(pred, "pred");
  TORCH_CHECK(pred.dim() == 1 && pred.size(0) >= 1 && pred.size(0) <= 1024 && pred.scalar_type() == at::kInt,
              "warp_vote: pred must be an int32 tensor [threads], 1..1024");
  TORCH_CHECK(mask >= 0 && mask <= 0xffffffffLL, "warp_vote: mask must be a 32-bit unsigned value");
  const at::Tensor pc = pred.contiguous();
  at::Tensor out = at::full({pred.size(0), 3}, -7, pred.options().dtype(at::kLong));
  const int* pp = pc.data_ptr<int>();
  int64_t* op = out.data_ptr<int64_t>();
  const unsigned m = static_cast<unsigned>(mask);
  checked([&] {
    hw_sim::launch("warp_vote", 1, dim3(static_cast<unsigned>(pred.size(0))), 0, [&] { warp_vote_kernel(pp, op, m); });
  });
  return out;
}

at::Tensor dynamic_smem_roundtrip(int64_t blocks, int64_t threads, int64_t bytes) {
  TORCH_CHECK(blocks >= 1 && blocks <= 65535 && threads >= 1 && threads <= 4096,
              "dynamic_smem_roundtrip: bad blocks / threads");
  TORCH_CHECK(bytes >= 4 && bytes % 4 == 0 && bytes <= (int64_t{1} << 20),
              "dynamic_smem_roundtrip: bytes must be a positive multiple of 4");
  TORCH_CHECK(hw_sim::dynamic_shared_memory() == nullptr,
              "dynamic_smem_roundtrip: dynamic shared memory visible outside a kernel");
  const int nwords = static_cast<int>(bytes / 4);
  at::Tensor out = at::full({blocks, 2, nwords}, -7, at::TensorOptions().dtype(at::kInt));
  int* op = out.data_ptr<int>();
  // threads > 1024 and bytes > 227 KiB are passed through: the emulator must reject them.
  checked([&] {
    hw_sim::launch("dynamic_smem_roundtrip", dim3(static_cast<unsigned>(blocks)), dim3(static_cast<unsigned>(threads)),
                   static_cast<size_t>(bytes), [&] { dynamic_smem_kernel(nwords, op); });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> atomic_add_blocks(int64_t blocks, int64_t threads) {
  TORCH_CHECK(blocks >= 1 && blocks <= 65535 && threads >= 1 && threads <= 1024,
              "atomic_add_blocks: bad blocks / threads");
  at::Tensor fsum = at::zeros({1}, at::TensorOptions().dtype(at::kFloat));
  at::Tensor ints = at::tensor({0, std::numeric_limits<int>::min(), std::numeric_limits<int>::max()},
                               at::TensorOptions().dtype(at::kInt));
  at::Tensor gid_sum = at::zeros({1}, at::TensorOptions().dtype(at::kLong));  // holds an unsigned 64-bit sum
  at::Tensor owner = at::full({blocks}, -1, at::TensorOptions().dtype(at::kLong));
  float* fp = fsum.data_ptr<float>();
  int* ip = ints.data_ptr<int>();
  unsigned long long* gp = static_cast<unsigned long long*>(gid_sum.data_ptr());
  int64_t* op = owner.data_ptr<int64_t>();
  checked([&] {
    hw_sim::launch("atomic_add_blocks", dim3(static_cast<unsigned>(blocks)), dim3(static_cast<unsigned>(threads)), 0,
                   [&] { atomics_kernel(fp, ip, gp, op); });
  });
  return {fsum, ints, gid_sum, owner};
}

at::Tensor spin_wait(int64_t threads) {
  TORCH_CHECK(threads >= 2 && threads <= 1024, "spin_wait: threads must be in [2, 1024]");
  at::Tensor out = at::zeros({2}, at::TensorOptions().dtype(at::kInt));
  int* op = out.data_ptr<int>();
  checked([&] { hw_sim::launch("spin_wait", 1, dim3(static_cast<unsigned>(threads)), 0, [&] { spin_wait_kernel(op); }); });
  return out;
}

template <typename T>
void launch_wmma(const at::Tensor& a, const at::Tensor& b, at::Tensor& c, bool b_col_major) {
  const int M = static_cast<int>(a.size(0)), K = static_cast<int>(a.size(1));
  const int N = static_cast<int>(c.size(1));
  const T* ap = reinterpret_cast<const T*>(a.data_ptr());
  const T* bp = reinterpret_cast<const T*>(b.data_ptr());
  float* cp = c.data_ptr<float>();
  const dim3 grid(static_cast<unsigned>((N / 16 + 1) / 2), static_cast<unsigned>(M / 16));
  checked([&] {
    if (b_col_major)
      hw_sim::launch("wmma_gemm", grid, 64, 0,
                     [&] { wmma_gemm_kernel<T, nvcuda::wmma::col_major>(ap, bp, cp, M, N, K); });
    else
      hw_sim::launch("wmma_gemm", grid, 64, 0,
                     [&] { wmma_gemm_kernel<T, nvcuda::wmma::row_major>(ap, bp, cp, M, N, K); });
  });
}

at::Tensor wmma_gemm(const at::Tensor& a, const at::Tensor& b, bool b_col_major) {
  check_cpu(a, "a");
  check_cpu(b, "b");
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.scalar_type() == b.scalar_type(),
              "wmma_gemm: a and b must be 2-D with the same dtype");
  const int64_t M = a.size(0), K = a.size(1);
  const int64_t N = b_col_major ? b.size(0) : b.size(1);
  TORCH_CHECK((b_col_major ? b.size(1) : b.size(0)) == K, "wmma_gemm: inner dimensions differ");
  TORCH_CHECK(M > 0 && N > 0 && K > 0 && M % 16 == 0 && N % 16 == 0 && K % 16 == 0 && M <= 4096 && N <= 4096 &&
                  K <= 4096,
              "wmma_gemm: M, N, K must be positive multiples of 16 (at most 4096)");
  const at::Tensor ac = a.contiguous(), bc = b.contiguous();
  at::Tensor c = at::full({M, N}, std::numeric_limits<float>::quiet_NaN(), a.options().dtype(at::kFloat));
  if (a.scalar_type() == at::kHalf)
    launch_wmma<__half>(ac, bc, c, b_col_major);
  else if (a.scalar_type() == at::kBFloat16)
    launch_wmma<__nv_bfloat16>(ac, bc, c, b_col_major);
  else
    TORCH_CHECK(false, "wmma_gemm: dtype must be float16 or bfloat16");
  return c;
}

void faulty_kernel(int64_t which) {
  at::Tensor buf = at::zeros({4096}, at::TensorOptions().dtype(at::kInt));
  int* p = buf.data_ptr<int>();
  checked([&] {
    switch (which) {
      case 0: hw_sim::launch("early_return", 1, 64, 0, [&] { early_return_kernel(p); }); break;
      case 1: hw_sim::launch("divergent_barrier", 1, 64, 0, [&] { divergent_barrier_kernel(p); }); break;
      case 2: hw_sim::launch("exited_lane_shuffle", 1, 32, 0, [&] { exited_lane_shuffle_kernel(p); }); break;
      case 3: hw_sim::launch("mixed_collectives", 1, 32, 0, [&] { mixed_collectives_kernel(p); }); break;
      case 4: hw_sim::launch("trap", 8, 64, 0, [&] { trap_kernel(p); }); break;
      case 5: hw_sim::launch("too_many_threads", 1, 2048, 0, [&] { trivial_kernel(p); }); break;
      case 6: hw_sim::launch("throwing", 1, 32, 0, [&] { throwing_kernel(p); }); break;
      case 7: hw_sim::launch("bad_width", 1, 32, 0, [&] { bad_width_kernel(p); }); break;
      case 8: hw_sim::launch("mask_without_caller", 1, 32, 0, [&] { mask_without_caller_kernel(p); }); break;
      case 9: hw_sim::launch("early_return_block2", 4, 64, 0, [&] { early_return_block2_kernel(p); }); break;
      case 10: hw_sim::launch("crossed_masks", 1, 32, 0, [&] { crossed_masks_kernel(p); }); break;
      case 11: hw_sim::launch("barrier_vs_warp", 1, 64, 0, [&] { barrier_vs_warp_kernel(p); }); break;
      case 12: hw_sim::launch("nested_launch", 1, 32, 0, [&] { nested_launch_kernel(p); }); break;
      case 13: __syncthreads(); break;  // device code called on the host
      case 14: hw_sim::launch("cp_async_misaligned", 1, 64, 256, [&] { cp_async_misaligned_kernel(p); }); break;
      case 15: hw_sim::launch("cp_async_global_dst", 1, 32, 256, [&] { cp_async_global_dst_kernel(p); }); break;
      case 16: hw_sim::launch("ldmatrix_misaligned", 1, 32, 512, [&] { ldmatrix_misaligned_kernel(p); }); break;
      case 17: primtest::launch_cp_async_ldmatrix<primtest::kNoWait>(p, reinterpret_cast<uint32_t*>(p + 1024)); break;
      case 18: primtest::launch_cp_async_ldmatrix<primtest::kNoSync>(p, reinterpret_cast<uint32_t*>(p + 1024)); break;
      case 19:
      case 20:
      case 21: {
        float* f = reinterpret_cast<float*>(p);
        hw_sim::launch("mma_misuse", 1, which == 19 ? 48 : 32, 0, [&] { mma_misuse_kernel(static_cast<int>(which), f); });
        break;
      }
      case 22: hw_sim::launch("ldmatrix_global_row", 1, 32, 256, [&] { ldmatrix_global_row_kernel(p); }); break;
      case 23:
        hw_sim::launch_cluster("cluster_barrier_early_exit", 2, 64, 2, 0, [&] { cluster_barrier_early_exit_kernel(p); });
        break;
      case 24: hw_sim::launch_cluster("cluster_bad_rank", 2, 32, 2, 256, [&] { cluster_bad_rank_kernel(p); }); break;
      case 25: hw_sim::launch_cluster("cluster_grid_mismatch", 3, 32, 2, 0, [&] { trivial_kernel(p); }); break;
      default: TORCH_CHECK(false, "faulty_kernel: unknown case ", which);
    }
  });
  TORCH_CHECK(false, "faulty_kernel(", which, "): the faulty kernel completed without an error");
}

}  // namespace
}  // namespace simtest
}  // namespace headwise

TORCH_LIBRARY(headwise_simtest, m) {
  m.def("block_sum(Tensor x, int threads, int kind=0) -> Tensor");
  m.def("block_vote(Tensor pred) -> Tensor");
  m.def("index_map(int[] grid, int[] block) -> Tensor");
  m.def("warp_shuffle(Tensor x, int kind, int arg, int width=32, int mask=4294967295) -> Tensor");
  m.def("warp_vote(Tensor pred, int mask=4294967295) -> Tensor");
  m.def("warp_sum_scatter(Tensor x) -> (Tensor, Tensor)");
  m.def("dynamic_smem_roundtrip(int blocks, int threads, int bytes) -> Tensor");
  m.def("atomic_add_blocks(int blocks, int threads) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("spin_wait(int threads) -> Tensor");
  m.def("wmma_gemm(Tensor a, Tensor b, bool b_col_major=False) -> Tensor");
  m.def("faulty_kernel(int which) -> ()");
  m.def("mma_lanes(Tensor a_regs, Tensor b_regs, Tensor c, int kind) -> Tensor");
  m.def("ldmatrix_lanes(Tensor smem, Tensor row_offsets, int num, bool trans=False) -> Tensor");
  m.def(
      "cp_async_roundtrip(Tensor src, int copy_bytes, bool cache_global, Tensor src_bytes, bool skip_wait=False) "
      "-> Tensor");
  m.def("cp_async_ldmatrix(Tensor src, int sync) -> Tensor");
  m.def("cluster_exchange(Tensor like, int blocks, int cluster_x) -> Tensor");
  m.def("warp_octets(Tensor x, int lanes) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(headwise_simtest, CPU, m) {
  m.impl("block_sum", &headwise::simtest::block_sum);
  m.impl("block_vote", &headwise::simtest::block_vote);
  m.impl("warp_shuffle", &headwise::simtest::warp_shuffle);
  m.impl("warp_vote", &headwise::simtest::warp_vote);
  m.impl("warp_sum_scatter", &headwise::simtest::warp_sum_scatter);
  m.impl("wmma_gemm", &headwise::simtest::wmma_gemm);
  m.impl("mma_lanes", &headwise::primtest::mma_lanes_sim);
  m.impl("ldmatrix_lanes", &headwise::primtest::ldmatrix_lanes_sim);
  m.impl("cp_async_roundtrip", &headwise::primtest::cp_async_roundtrip_sim);
  m.impl("cp_async_ldmatrix", &headwise::primtest::cp_async_ldmatrix_sim);
  m.impl("cluster_exchange", &headwise::primtest::cluster_exchange_sim);
  m.impl("warp_octets", &headwise::primtest::warp_octets_sim);
}

// Ops without tensor arguments have no device to dispatch on.
TORCH_LIBRARY_IMPL(headwise_simtest, CompositeExplicitAutograd, m) {
  m.impl("index_map", &headwise::simtest::index_map);
  m.impl("dynamic_smem_roundtrip", &headwise::simtest::dynamic_smem_roundtrip);
  m.impl("atomic_add_blocks", &headwise::simtest::atomic_add_blocks);
  m.impl("spin_wait", &headwise::simtest::spin_wait);
  m.impl("faulty_kernel", &headwise::simtest::faulty_kernel);
}
