// CUDA backend of the fused QKV projection: qkv_launch.h compiled by nvcc.
#include "qkv_launch.h"
