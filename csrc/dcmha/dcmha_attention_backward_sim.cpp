// Emulated CUDA backend of the fused attention backward: dcmha_attention_backward_launch.h compiled by the host
// compiler against the SIMT emulator (csrc/common/simt).
#include "dcmha_attention_backward_launch.h"
