// Emulated CUDA backend of the compose ops: dcmha_compose_launch.h compiled by the host
// compiler against the SIMT emulator (csrc/common/simt).
#include "dcmha_compose_launch.h"
