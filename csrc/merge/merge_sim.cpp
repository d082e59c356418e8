// Emulated CUDA backend of the head-merge ops: merge_launch.h compiled by the host
// compiler against the SIMT emulator (csrc/common/simt).
#include "merge_launch.h"
