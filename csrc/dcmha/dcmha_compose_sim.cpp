// Emulated CUDA backend of the compose forward: dcmha_compose_launch.h compiled by the host
// compiler against the SIMT emulator (csrc/common/simt).
#include "dcmha_compose_launch.h"
