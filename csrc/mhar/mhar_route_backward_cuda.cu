// CUDA backend of the MHAR op route_backward: mhar_route_backward_launch.h compiled by nvcc.
#include "mhar_route_backward_launch.h"
