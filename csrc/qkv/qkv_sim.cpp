// Emulated CUDA backend of the fused QKV projection: qkv_launch.h compiled by the host
// compiler against the SIMT emulator (csrc/common/simt).
#include "qkv_launch.h"
