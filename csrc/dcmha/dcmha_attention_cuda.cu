// CUDA backend of the fused attention forward: dcmha_attention_launch.h compiled by nvcc.
#include "dcmha_attention_launch.h"
