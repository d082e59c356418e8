// Emulated CUDA backend of the DCMHA compose op: dcmha_launch.h compiled by the host
// compiler against the SIMT emulator (csrc/common/simt).
#include "dcmha_launch.h"
