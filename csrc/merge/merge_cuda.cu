// CUDA backend of the head-merge ops: merge_launch.h compiled by nvcc.
#include "merge_launch.h"
