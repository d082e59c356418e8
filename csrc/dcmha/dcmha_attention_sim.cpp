// Emulated CUDA backend of the fused attention forward: dcmha_attention_launch.h compiled by the host
// compiler against the SIMT emulator (csrc/common/simt).
#include "dcmha_attention_launch.h"
