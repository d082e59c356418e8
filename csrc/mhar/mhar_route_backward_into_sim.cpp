// Emulated CUDA backend of the MHAR op route_backward_into: mhar_route_backward_into_launch.h compiled by the host
// compiler against the SIMT emulator (csrc/common/simt).
#include "mhar_route_backward_into_launch.h"
