// Emulated CUDA backend of the MHAR ops: mhar_launch.h compiled by the host compiler
// against the SIMT emulator (csrc/common/simt).
#include "mhar_launch.h"
