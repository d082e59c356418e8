// The op library: schemas of torch.ops.headwise and the CPU implementations.
// (CUDA implementations: register_cuda.cu.)
#include "dcmha/dcmha_ops.h"
#include "merge/merge_ops.h"
#include "mhar/mhar_ops.h"
#include "qkv/qkv_ops.h"
#include "common/python_module.h"
#include "schemas.h"

HW_PYTHON_MODULE(_C)

TORCH_LIBRARY(headwise, m) { headwise::define_schemas(m); }

TORCH_LIBRARY_IMPL(headwise, CPU, m) {
  m.impl("mhar_route", &headwise::mhar::route_cpu);
  m.impl("mhar_route_backward", &headwise::mhar::route_backward_cpu);
  m.impl("mhar_route_backward_into", &headwise::mhar::route_backward_into_cpu);
  m.impl("qkv_project", &headwise::qkv::project_cpu);
  m.impl("qkv_project_backward", &headwise::qkv::project_backward_cpu);
  m.impl("head_merge", &headwise::merge::head_merge_cpu);
  m.impl("head_merge_backward", &headwise::merge::head_merge_backward_cpu);
  m.impl("dcmha_compose", &headwise::dcmha::compose_cpu);
  m.impl("dcmha_compose_backward", &headwise::dcmha::compose_backward_cpu);
  m.impl("dcmha_attention", &headwise::dcmha::attention_cpu);
  m.impl("dcmha_attention_backward", &headwise::dcmha::attention_backward_cpu);
}
