// CUDA backend of the DCMHA compose op: dcmha_launch.h compiled by nvcc.
#include "dcmha_launch.h"
