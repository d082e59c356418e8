// CUDA backend of the MHAR ops: mhar_launch.h compiled by nvcc.
#include "mhar_launch.h"
