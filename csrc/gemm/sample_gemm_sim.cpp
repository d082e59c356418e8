// Emulated CUDA backend of the sample GEMM: sample_gemm_launch.h compiled by the host
// compiler against the SIMT emulator (csrc/common/simt).
#include "sample_gemm_launch.h"
