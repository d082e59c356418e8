#pragma once
// Whether fp32 products may run as TF32 on the tensor cores: where torch's own float32 CUDA
// matmuls would (torch.backends.cuda.matmul.fp32_precision = "tf32", which the legacy
// torch.backends.cuda.matmul.allow_tf32 = True and set_float32_matmul_precision("high" /
// "medium") set as well), read as torch's cuBLAS calls read it: the (CUDA, MATMUL)
// precision (unset, it is (CUDA, ALL)'s, then the generic one's), and never inside an
// at::NoTF32Guard. The legacy getter allowTF32CuBLAS() raises once only the newer API was
// set (as transformers does), so it is read only on a torch older than that API.
#include <ATen/Context.h>
#include <torch/version.h>

namespace hw {

inline bool cuda_matmul_allows_tf32() {
  if (at::NoTF32Guard::should_disable_tf32()) return false;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 10)
  return at::globalContext().float32Precision(at::Float32Backend::CUDA, at::Float32Op::MATMUL) ==
         at::Float32Precision::TF32;
#else
  return at::globalContext().allowTF32CuBLAS();
#endif
}

}  // namespace hw
