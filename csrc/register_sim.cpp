// The emulated op library: the CUDA kernels run by the SIMT emulator on CPU tensors,
// registered as torch.ops.headwise_sim with the schemas of torch.ops.headwise.
// Compiled a second time with HW_SIM_PROFILE for the profile library headwise._sim_profile
// (setup.py): the same ops as torch.ops.headwise_sim_profile, whose kernels count their
// memory accesses (common/simt/simt_metrics.h), plus the two ops that read the counts.
#include "common/simt/simt.h"
#include "dcmha/dcmha_ops.h"
#include "gemm/gemm_ops.h"
#include "merge/merge_ops.h"
#include "mhar/mhar_ops.h"
#include "qkv/qkv_ops.h"
#include "common/python_module.h"
#include "schemas.h"

#include <ATen/Parallel.h>

#include <string>

#if defined(HW_SIM_PROFILE)
HW_PYTHON_MODULE(_sim_profile)
#define HW_SIM_LIBRARY headwise_sim_profile
#else
HW_PYTHON_MODULE(_sim)
#define HW_SIM_LIBRARY headwise_sim
#endif
// TORCH_LIBRARY pastes its namespace argument: expand HW_SIM_LIBRARY first.
#define HW_SIM_TORCH_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define HW_SIM_TORCH_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

namespace {
// Blocks of an emulated grid run in parallel on torch's intra-op thread pool.
void parallel_blocks(int64_t begin, int64_t end, const std::function<void(int64_t, int64_t)>& fn) {
  at::parallel_for(begin, end, 1, fn);
}
const bool kParallelHookInstalled = (hw_sim::set_parallel_for(&parallel_blocks), true);
}  // namespace

HW_SIM_TORCH_LIBRARY(HW_SIM_LIBRARY, m) {
  headwise::define_schemas(m);
#if defined(HW_SIM_PROFILE)
  // Collection switch, and the launches recorded since the last call as a JSON list
  // (fields: simt_metrics.h; python/headwise/bench/sim_profile.py reads them).
  m.def("sim_profile_enable(bool on) -> ()", [](bool on) { hw_sim::metrics::set_enabled(on); });
  m.def("sim_profile_take() -> str", []() { return hw_sim::metrics::take_json(); });
#endif
}

HW_SIM_TORCH_LIBRARY_IMPL(HW_SIM_LIBRARY, CPU, m) {
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
