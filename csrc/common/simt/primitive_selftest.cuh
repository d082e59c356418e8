// Lane-by-lane self-tests of the primitives of csrc/common/mma_primitives.cuh, cluster.cuh
// and warp_octets.cuh: tiny kernels
// that feed each lane's fragment registers in and read each lane's results out, so the
// Python side (tests/simt/test_primitives.py) checks every lane against the PTX ISA's
// fragment maps. Compiled twice: into the emulated library (simt_selftest.cpp registers the
// entries for CPU tensors as torch.ops.headwise_simtest.*) and into the CUDA op library
// (csrc/common/primitive_selftest_cuda.cu, CUDA tensors): on a GPU the same tests check the
// maps against the hardware.
//
//   mma_lanes(a_regs [32, 4] i32, b_regs [32, 2] i32, c [32, 4] f32, kind) -> d [32, 4] f32
//       kind 0: m16n8k16 bf16, 1: m16n8k16 f16, 2: m16n8k8 tf32, 3: m16n8k8 bf16 (a_regs[:, :2]
//       and b_regs[:, 0] used); row l = lane l's registers
//   ldmatrix_lanes(smem [S] i16, row_offsets [32] i32, num, trans) -> [32, num] i32
//       smem is copied to the block's shared memory; lane l's row address is
//       smem + row_offsets[l] (elements); row l of the result is lane l's registers
//   cp_async_roundtrip(src [W] i32, copy_bytes, cache_global, src_bytes [C] i32, skip_wait)
//       -> [2, C * copy_bytes / 4] i32: copy c moves copy_bytes bytes of src at byte offset
//       c * copy_bytes into shared memory (src_bytes[c] of them, the rest zero-filled), issued
//       by thread c % 64 of a 64-thread block; copies c < C/2 form group 0, the others group 1.
//       Row 0: shared memory read (by other threads) after wait_group 1 + __syncthreads (group
//       0 defined); row 1: after wait_group 0 + __syncthreads. skip_wait: row 0 is read after
//       a __syncthreads with no wait at all (the emulator's poison), row 1 after wait_all.
//   cp_async_ldmatrix(src [128] i32, sync) -> [32, 4] i32: lane l cp.asyncs the 16 bytes
//       src[4l .. 4l+3] to shared row l and waits; after `sync` (1: __syncwarp, 2:
//       __syncthreads) the warp reads rows 0..31 with ldmatrix.x4 (lane l gives row l).
//       (The faulty cases of simt_selftest.cpp run the kernel without the wait / the sync.)
//   cluster_exchange(like, blocks, cluster_x) -> [blocks, 4, 64] i32 on like's device
//       (sm_90; like only selects the backend): a 1-D grid of
//       64-thread CTAs in clusters of cluster_x. CTA b fills its shared words [0, 64) with
//       1000 b + i, cluster-syncs, writes 1000 b + 500 + i into words [64, 128) of the next
//       rank's CTA, cluster-syncs, and thread i records its %cluster_ctarank, the cluster's
//       CTA count, word i of the next rank's CTA and its own word 64 + i.
//   warp_octets(x [512] f32, lanes) -> (loaded [64, 8], stored [512]) f32: two warps, warp
//       w's span x[256 w, 256 w + 256) with lanes - 32 w owned lanes; loaded[t] = the octet
//       hw::warp_load_octets hands thread t, stored = what hw::warp_store_octets writes of
//       the octets x[8 t, 8 t + 8) (each thread's, read directly) into a NaN-filled span.
#pragma once

#include "../backend_device.h"
#include "../cluster.cuh"
#include "../mma_primitives.cuh"
#include "../warp_octets.cuh"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <tuple>

namespace headwise {
namespace primtest {

template <int Kind>
__global__ void mma_lanes_kernel(const uint32_t* __restrict__ a, const uint32_t* __restrict__ b,
                                 const float* __restrict__ c, float* __restrict__ d) {
  const int lane = threadIdx.x;
  uint32_t ra[4], rb[2];
  float rc[4], rd[4];
  for (int i = 0; i < 4; ++i) {
    ra[i] = a[lane * 4 + i];
    rc[i] = c[lane * 4 + i];
  }
  for (int i = 0; i < 2; ++i) rb[i] = b[lane * 2 + i];
  if (Kind == 0)
    hw::mma_m16n8k16_bf16(rd, ra, rb, rc);
  else if (Kind == 1)
    hw::mma_m16n8k16_f16(rd, ra, rb, rc);
  else if (Kind == 2)
    hw::mma_m16n8k8_tf32(rd, ra, rb, rc);
  else {
    const uint32_t ra2[2] = {ra[0], ra[1]};
    hw::mma_m16n8k8_bf16(rd, ra2, rb[0], rc);
  }
  for (int i = 0; i < 4; ++i) d[lane * 4 + i] = rd[i];
}

template <int Num, bool Trans>
__global__ void ldmatrix_lanes_kernel(const uint16_t* __restrict__ image, int image_len,
                                      const int* __restrict__ row_offsets, uint32_t* __restrict__ out) {
  uint16_t* smem = reinterpret_cast<uint16_t*>(hw::dynamic_shared_memory());
  for (int i = threadIdx.x; i < image_len; i += blockDim.x) smem[i] = image[i];
  __syncthreads();
  const int lane = threadIdx.x;
  uint32_t r[Num];
  hw::ldmatrix<Num, Trans>(r, smem + row_offsets[lane]);
  for (int i = 0; i < Num; ++i) out[lane * Num + i] = r[i];
}

template <int Bytes, bool CacheGlobal>
__device__ __forceinline__ void issue_copy(unsigned char* dst, const unsigned char* src, int src_bytes) {
  if constexpr (CacheGlobal)
    hw::cp_async_cg16(dst, src, src_bytes);
  else
    hw::cp_async_ca<Bytes>(dst, src, src_bytes);
}

constexpr int kCopyThreads = 64;

template <int Bytes, bool CacheGlobal>
__global__ void cp_async_roundtrip_kernel(const unsigned char* __restrict__ src, const int* __restrict__ src_bytes,
                                          int copies, bool skip_wait, int* __restrict__ out) {
  unsigned char* smem = hw::dynamic_shared_memory();
  const int words = copies * Bytes / 4;
  const int half = copies / 2;
  for (int c = threadIdx.x; c < half; c += blockDim.x)
    issue_copy<Bytes, CacheGlobal>(smem + c * Bytes, src + c * Bytes, src_bytes[c]);
  hw::cp_async_commit();
  for (int c = half + threadIdx.x; c < copies; c += blockDim.x)
    issue_copy<Bytes, CacheGlobal>(smem + c * Bytes, src + c * Bytes, src_bytes[c]);
  hw::cp_async_commit();
  if (!skip_wait) hw::cp_async_wait<1>();
  __syncthreads();
  const int* shared_words = reinterpret_cast<const int*>(smem);
  // Word w is read by thread (w + 1) % blockDim: usually not the thread that copied it.
  const int me = (threadIdx.x + blockDim.x - 1) % blockDim.x;
  for (int w = me; w < words; w += blockDim.x) out[w] = shared_words[w];
  __syncthreads();  // every read of row 0 happens before any thread's next wait lands copies
  if (skip_wait)
    hw::cp_async_wait_all();
  else
    hw::cp_async_wait<0>();
  __syncthreads();
  for (int w = me; w < words; w += blockDim.x) out[words + w] = shared_words[w];
}

enum CpAsyncLdmatrixSync { kNoWait = -1, kNoSync = 0, kSyncWarp = 1, kSyncThreads = 2 };

template <int Sync>
__global__ void cp_async_ldmatrix_kernel(const int* __restrict__ src, uint32_t* __restrict__ out) {
  unsigned char* smem = hw::dynamic_shared_memory();
  const int lane = threadIdx.x;
  hw::cp_async_cg16(smem + 16 * lane, src + 4 * lane, 16);
  hw::cp_async_commit();
  if (Sync != kNoWait) hw::cp_async_wait<0>();
  if (Sync == kSyncWarp) __syncwarp();
  if (Sync == kSyncThreads) __syncthreads();
  uint32_t r[4];
  hw::ldmatrix<4>(r, smem + 16 * lane);
  for (int i = 0; i < 4; ++i) out[lane * 4 + i] = r[i];
}

template <int Sync>
inline void launch_cp_async_ldmatrix(const int* src, uint32_t* out) {
  auto kernel = &cp_async_ldmatrix_kernel<Sync>;
  HW_LAUNCH("cp_async_ldmatrix", kernel, dim3(1), dim3(32), 32 * 16, src, out);
}

constexpr int kClusterThreads = 64;

__global__ void cluster_exchange_kernel(int* __restrict__ out) {
  int* words = reinterpret_cast<int*>(hw::dynamic_shared_memory());
  const int i = threadIdx.x;
  const unsigned rank = hw::cluster_ctarank(), ctas = hw::cluster_num_ctas();
  const unsigned next = (rank + 1) % ctas;
  words[i] = 1000 * static_cast<int>(blockIdx.x) + i;
  hw::cluster_sync();  // every CTA's words [0, 64) written
  int* next_words = hw::cluster_map_shared(words, next);
  next_words[kClusterThreads + i] = 1000 * static_cast<int>(blockIdx.x) + 500 + i;
  const int from_next = next_words[i];
  hw::cluster_sync();  // every CTA's words [64, 128) written by its predecessor
  int* o = out + static_cast<int64_t>(blockIdx.x) * 4 * kClusterThreads;
  o[i] = static_cast<int>(rank);
  o[kClusterThreads + i] = static_cast<int>(ctas);
  o[2 * kClusterThreads + i] = from_next;
  o[3 * kClusterThreads + i] = words[kClusterThreads + i];
}

// Two 32-lane warps; see warp_octets above.
__global__ void warp_octets_kernel(const float* __restrict__ x, int lanes, float* __restrict__ loaded,
                                   float* __restrict__ stored) {
  const int t = threadIdx.x, w0 = t & ~31;
  float v[8];
  hw::warp_load_octets(x + 8 * w0, lanes - w0, v);
  for (int k = 0; k < 8; ++k) loaded[t * 8 + k] = v[k];
  for (int k = 0; k < 8; ++k) v[k] = x[t * 8 + k];
  hw::warp_store_octets(stored + 8 * w0, lanes - w0, v);
}

// --- host entries (HW_BACKEND_ENTRY: *_sim for the emulated library, *_cuda for CUDA) ---

inline void check_test_tensor(const at::Tensor& t, const char* op, const char* arg, at::ScalarType dtype,
                              std::initializer_list<int64_t> shape) {
  TORCH_CHECK(hw::on_backend_device(t), "headwise_simtest.", op, ": ", arg, " is on ", t.device(), " but ",
              hw::kBackendDevice);
  TORCH_CHECK(t.scalar_type() == dtype, "headwise_simtest.", op, ": ", arg, " must be ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.sizes().equals(shape), "headwise_simtest.", op, ": ", arg, " must have shape ", at::IntArrayRef(shape),
              ", got ", t.sizes());
}

// The 16-byte alignment the kernels' vector accesses need, of t as the kernel reads it.
inline void check_test_aligned16(const at::Tensor& t, const char* op, const char* arg) {
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "headwise_simtest.", op, ": ", arg,
              " must be 16-byte aligned");
}

inline at::Tensor HW_BACKEND_ENTRY(mma_lanes)(const at::Tensor& a_regs, const at::Tensor& b_regs,
                                              const at::Tensor& c, int64_t kind) {
  constexpr const char* op = "mma_lanes";
  check_test_tensor(a_regs, op, "a_regs", at::kInt, {32, 4});
  check_test_tensor(b_regs, op, "b_regs", at::kInt, {32, 2});
  check_test_tensor(c, op, "c", at::kFloat, {32, 4});
  TORCH_CHECK(kind >= 0 && kind <= 3,
              "headwise_simtest.mma_lanes: kind must be 0 (bf16), 1 (f16), 2 (tf32) or 3 (bf16, k = 8)");
  const at::OptionalDeviceGuard guard(c.device());
  const at::Tensor a = a_regs.contiguous(), b = b_regs.contiguous(), cc = c.contiguous();
  at::Tensor d = at::full({32, 4}, std::numeric_limits<float>::quiet_NaN(), c.options());
  const auto* ap = reinterpret_cast<const uint32_t*>(a.data_ptr<int>());
  const auto* bp = reinterpret_cast<const uint32_t*>(b.data_ptr<int>());
  const float* cp = cc.data_ptr<float>();
  float* dp = d.data_ptr<float>();
  if (kind == 0) {
    auto kernel = &mma_lanes_kernel<0>;
    HW_LAUNCH("mma_lanes_bf16", kernel, dim3(1), dim3(32), 0, ap, bp, cp, dp);
  } else if (kind == 1) {
    auto kernel = &mma_lanes_kernel<1>;
    HW_LAUNCH("mma_lanes_f16", kernel, dim3(1), dim3(32), 0, ap, bp, cp, dp);
  } else if (kind == 2) {
    auto kernel = &mma_lanes_kernel<2>;
    HW_LAUNCH("mma_lanes_tf32", kernel, dim3(1), dim3(32), 0, ap, bp, cp, dp);
  } else {
    auto kernel = &mma_lanes_kernel<3>;
    HW_LAUNCH("mma_lanes_bf16_k8", kernel, dim3(1), dim3(32), 0, ap, bp, cp, dp);
  }
  return d;
}

template <int Num, bool Trans>
inline void launch_ldmatrix_lanes(const uint16_t* image, int len, const int* offsets, uint32_t* out) {
  auto kernel = &ldmatrix_lanes_kernel<Num, Trans>;
  HW_LAUNCH("ldmatrix_lanes", kernel, dim3(1), dim3(32), static_cast<size_t>(len) * 2, image, len, offsets, out);
}

inline at::Tensor HW_BACKEND_ENTRY(ldmatrix_lanes)(const at::Tensor& smem, const at::Tensor& row_offsets, int64_t num,
                                                   bool trans) {
  constexpr const char* op = "ldmatrix_lanes";
  TORCH_CHECK(smem.dim() == 1 && smem.numel() >= 64 && smem.numel() <= 16384,
              "headwise_simtest.ldmatrix_lanes: smem must be 1-D with 64..16384 elements, got ", smem.sizes());
  check_test_tensor(smem, op, "smem", at::kShort, {smem.numel()});
  check_test_tensor(row_offsets, op, "row_offsets", at::kInt, {32});
  TORCH_CHECK(num == 1 || num == 2 || num == 4, "headwise_simtest.ldmatrix_lanes: num must be 1, 2 or 4");
  const at::OptionalDeviceGuard guard(smem.device());
  const at::Tensor image = smem.contiguous(), offsets = row_offsets.contiguous();
  at::Tensor out = at::full({32, num}, -1, row_offsets.options());
  const auto* ip = reinterpret_cast<const uint16_t*>(image.data_ptr<int16_t>());
  const int len = static_cast<int>(image.numel());
  const int* op_ = offsets.data_ptr<int>();
  auto* outp = reinterpret_cast<uint32_t*>(out.data_ptr<int>());
  if (num == 1)
    trans ? launch_ldmatrix_lanes<1, true>(ip, len, op_, outp) : launch_ldmatrix_lanes<1, false>(ip, len, op_, outp);
  else if (num == 2)
    trans ? launch_ldmatrix_lanes<2, true>(ip, len, op_, outp) : launch_ldmatrix_lanes<2, false>(ip, len, op_, outp);
  else
    trans ? launch_ldmatrix_lanes<4, true>(ip, len, op_, outp) : launch_ldmatrix_lanes<4, false>(ip, len, op_, outp);
  return out;
}

template <int Bytes, bool CacheGlobal>
inline void launch_cp_async_roundtrip(const unsigned char* src, const int* src_bytes, int copies, bool skip_wait,
                                      int* out) {
  auto kernel = &cp_async_roundtrip_kernel<Bytes, CacheGlobal>;
  HW_LAUNCH("cp_async_roundtrip", kernel, dim3(1), dim3(kCopyThreads), static_cast<size_t>(copies) * Bytes, src,
            src_bytes, copies, skip_wait, out);
}

inline at::Tensor HW_BACKEND_ENTRY(cp_async_roundtrip)(const at::Tensor& src, int64_t copy_bytes, bool cache_global,
                                                       const at::Tensor& src_bytes, bool skip_wait) {
  constexpr const char* op = "cp_async_roundtrip";
  TORCH_CHECK(copy_bytes == 4 || copy_bytes == 8 || copy_bytes == 16, "headwise_simtest.", op,
              ": copy_bytes must be 4, 8 or 16");
  TORCH_CHECK(!cache_global || copy_bytes == 16, "headwise_simtest.", op, ": cache_global copies 16 bytes");
  const int64_t copies = src_bytes.numel();
  TORCH_CHECK(copies >= 2 && copies * copy_bytes <= 32768, "headwise_simtest.", op,
              ": 2..32768/copy_bytes copies, got ", copies);
  check_test_tensor(src_bytes, op, "src_bytes", at::kInt, {copies});
  check_test_tensor(src, op, "src", at::kInt, {copies * copy_bytes / 4});
  const at::OptionalDeviceGuard guard(src.device());
  const at::Tensor s = src.contiguous(), sb = src_bytes.contiguous();
  check_test_aligned16(s, op, "src");
  at::Tensor out = at::full({2, copies * copy_bytes / 4}, 0x5a5a5a5a, src.options());
  const auto* sp = static_cast<const unsigned char*>(s.data_ptr());
  const int* sbp = sb.data_ptr<int>();
  int* outp = out.data_ptr<int>();
  const int n = static_cast<int>(copies);
  if (cache_global)
    launch_cp_async_roundtrip<16, true>(sp, sbp, n, skip_wait, outp);
  else if (copy_bytes == 16)
    launch_cp_async_roundtrip<16, false>(sp, sbp, n, skip_wait, outp);
  else if (copy_bytes == 8)
    launch_cp_async_roundtrip<8, false>(sp, sbp, n, skip_wait, outp);
  else
    launch_cp_async_roundtrip<4, false>(sp, sbp, n, skip_wait, outp);
  return out;
}

inline at::Tensor HW_BACKEND_ENTRY(cp_async_ldmatrix)(const at::Tensor& src, int64_t sync) {
  check_test_tensor(src, "cp_async_ldmatrix", "src", at::kInt, {128});
  TORCH_CHECK(sync == kSyncWarp || sync == kSyncThreads,
              "headwise_simtest.cp_async_ldmatrix: sync must be 1 (__syncwarp) or 2 (__syncthreads)");
  const at::OptionalDeviceGuard guard(src.device());
  const at::Tensor s = src.contiguous();
  at::Tensor out = at::full({32, 4}, -1, src.options());
  auto* outp = reinterpret_cast<uint32_t*>(out.data_ptr<int>());
  if (sync == kSyncWarp)
    launch_cp_async_ldmatrix<kSyncWarp>(s.data_ptr<int>(), outp);
  else
    launch_cp_async_ldmatrix<kSyncThreads>(s.data_ptr<int>(), outp);
  return out;
}

inline at::Tensor HW_BACKEND_ENTRY(cluster_exchange)(const at::Tensor& like, int64_t blocks, int64_t cluster_x) {
  TORCH_CHECK(hw::on_backend_device(like), "headwise_simtest.cluster_exchange: like is on ", like.device(), " but ",
              hw::kBackendDevice);
  TORCH_CHECK(cluster_x >= 1 && cluster_x <= 8 && blocks >= 1 && blocks % cluster_x == 0 && blocks <= 4096,
              "headwise_simtest.cluster_exchange: cluster_x must be in [1, 8] and divide blocks (at most 4096)");
  const at::OptionalDeviceGuard guard(like.device());
  at::Tensor out = at::full({blocks, 4, kClusterThreads}, -1, like.options().dtype(at::kInt));
  int* op = out.data_ptr<int>();
  auto kernel = &cluster_exchange_kernel;
  HW_LAUNCH_CLUSTER("cluster_exchange", kernel, dim3(static_cast<unsigned>(blocks)), dim3(kClusterThreads),
                    dim3(static_cast<unsigned>(cluster_x)), 2 * kClusterThreads * sizeof(int), op);
  return out;
}

inline std::tuple<at::Tensor, at::Tensor> HW_BACKEND_ENTRY(warp_octets)(const at::Tensor& x, int64_t lanes) {
  check_test_tensor(x, "warp_octets", "x", at::kFloat, {512});
  TORCH_CHECK(lanes >= -1024 && lanes <= 1024, "headwise_simtest.warp_octets: lanes must be in [-1024, 1024]");
  const at::OptionalDeviceGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  check_test_aligned16(xc, "warp_octets", "x");
  at::Tensor loaded = at::full({64, 8}, std::numeric_limits<float>::quiet_NaN(), xc.options());
  at::Tensor stored = at::full_like(xc, std::numeric_limits<float>::quiet_NaN());
  auto kernel = &warp_octets_kernel;
  HW_LAUNCH("warp_octets", kernel, dim3(1), dim3(64), 0, xc.data_ptr<float>(), static_cast<int>(lanes),
            loaded.data_ptr<float>(), stored.data_ptr<float>());
  return {loaded, stored};
}

}  // namespace primtest
}  // namespace headwise
