// Emulated CUDA backend of the MHAR op route: mhar_route_launch.h compiled by the host
// compiler against the SIMT emulator (csrc/common/simt).
#include "mhar_route_launch.h"
