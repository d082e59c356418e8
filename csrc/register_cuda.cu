// CUDA implementations of torch.ops.headwise.
#include "dcmha/dcmha_ops.h"
#include "gemm/gemm_ops.h"
#include "merge/merge_ops.h"
#include "mhar/mhar_ops.h"
#include "qkv/qkv_ops.h"

#include <torch/library.h>

TORCH_LIBRARY_IMPL(headwise, CUDA, m) {
  m.impl("mhar_route", &headwise::mhar::route_cuda);
  m.impl("mhar_route_backward", &headwise::mhar::route_backward_cuda);
  m.impl("mhar_route_backward_into", &headwise::mhar::route_backward_into_cuda);
  m.impl("qkv_project", &headwise::qkv::project_cuda);
  m.impl("qkv_project_backward", &headwise::qkv::project_backward_cuda);
  m.impl("head_merge", &headwise::merge::head_merge_cuda);
  m.impl("head_merge_backward", &headwise::merge::head_merge_backward_cuda);
  m.impl("dcmha_compose", &headwise::dcmha::compose_cuda);
  m.impl("dcmha_compose_backward", &headwise::dcmha::compose_backward_cuda);
  m.impl("dcmha_attention", &headwise::dcmha::attention_cuda);
  m.impl("dcmha_attention_backward", &headwise::dcmha::attention_backward_cuda);
  m.impl("sample_gemm", &headwise::gemm::sample_gemm_cuda);
}
