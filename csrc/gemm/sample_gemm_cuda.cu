// CUDA backend of the sample GEMM: sample_gemm_launch.h compiled by nvcc.
#include "sample_gemm_launch.h"
