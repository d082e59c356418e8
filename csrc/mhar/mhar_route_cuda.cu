// CUDA backend of the MHAR op route: mhar_route_launch.h compiled by nvcc.
#include "mhar_route_launch.h"
