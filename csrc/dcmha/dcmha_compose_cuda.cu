// CUDA backend of the compose forward: dcmha_compose_launch.h compiled by nvcc.
#include "dcmha_compose_launch.h"
