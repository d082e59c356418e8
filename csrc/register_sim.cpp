// The emulated op library: the CUDA kernels run by the SIMT emulator on CPU tensors,
// registered as torch.ops.headwise_sim with the schemas of torch.ops.headwise.
#include "common/simt/simt.h"
#include "dcmha/dcmha_ops.h"
#include "gemm/gemm_ops.h"
#include "merge/merge_ops.h"
#include "mhar/mhar_ops.h"
#include "qkv/qkv_ops.h"
#include "common/python_module.h"
#include "schemas.h"

#include <ATen/Parallel.h>

HW_PYTHON_MODULE(_sim)

namespace {
// Blocks of an emulated grid run in parallel on torch's intra-op thread pool.
void parallel_blocks(int64_t begin, int64_t end, const std::function<void(int64_t, int64_t)>& fn) {
  at::parallel_for(begin, end, 1, fn);
}
const bool kParallelHookInstalled = (hw_sim::set_parallel_for(&parallel_blocks), true);
}  // namespace

TORCH_LIBRARY(headwise_sim, m) { headwise::define_schemas(m); }

TORCH_LIBRARY_IMPL(headwise_sim, CPU, m) {
  m.impl("mhar_route", &headwise::mhar::route_sim);
  m.impl("mhar_route_backward", &headwise::mhar::route_backward_sim);
  m.impl("mhar_route_backward_into", &headwise::mhar::route_backward_into_sim);
  m.impl("qkv_project", &headwise::qkv::project_sim);
  m.impl("qkv_project_backward", &headwise::qkv::project_backward_sim);
  m.impl("head_merge", &headwise::merge::head_merge_sim);
  m.impl("head_merge_backward", &headwise::merge::head_merge_backward_sim);
  m.impl("dcmha_compose", &headwise::dcmha::compose_sim);
  m.impl("dcmha_compose_backward", &headwise::dcmha::compose_backward_sim);
  m.impl("dcmha_attention", &headwise::dcmha::attention_sim);
  m.impl("dcmha_attention_backward", &headwise::dcmha::attention_backward_sim);
  m.impl("sample_gemm", &headwise::gemm::sample_gemm_sim);
}
