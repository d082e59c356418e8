// Emulated CUDA backend of the compose backward: dcmha_compose_backward_launch.h compiled by
// the host compiler against the SIMT emulator (csrc/common/simt).
#include "dcmha_compose_backward_launch.h"
