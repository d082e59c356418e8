// CUDA backend of the compose ops: dcmha_compose_launch.h compiled by nvcc.
#include "dcmha_compose_launch.h"
