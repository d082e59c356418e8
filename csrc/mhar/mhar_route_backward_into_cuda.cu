// CUDA backend of the MHAR op route_backward_into: mhar_route_backward_into_launch.h compiled by nvcc.
#include "mhar_route_backward_into_launch.h"
