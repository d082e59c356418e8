// CUDA backend of the compose backward: dcmha_compose_backward_launch.h compiled by nvcc.
#include "dcmha_compose_backward_launch.h"
