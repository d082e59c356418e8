// CUDA backend of the fused attention backward: dcmha_attention_backward_launch.h compiled by nvcc.
#include "dcmha_attention_backward_launch.h"
