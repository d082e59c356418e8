"""headwise: fused CUDA/CPU kernels for the head axis of attention.

Ops are registered as ``torch.ops.headwise.*`` (CPU and CUDA kernels) and, for testing
without a GPU, as ``torch.ops.headwise_sim.*`` (the CUDA kernels run by a SIMT emulator
on CPU tensors). The functions below are typed, differentiable wrappers.
"""

import torch  # noqa: F401  (the op libraries link against libtorch)

from . import _C, _sim  # noqa: F401  (load torch.ops.headwise and torch.ops.headwise_sim)
from . import integrations, models, nn, reference, testing
from .dcmha import DCMHAWeights
from .depth_buffer import DepthBuffer
from .head_scores import ahon_scores, circuit_scores, inactive_heads
from .head_surgery import PermutedHeads, PrunedHeads, head_mask, permute_heads, prune_heads
from .ops import (HeadMergeStats, dcmha_attention, dcmha_compose, dcmha_weights, head_merge, kv_project, mhar_route,
                  q_project, qkv_project)
from .qkv_layout import QKVLayout, QKVManifest, from_hf_attention, from_multihead_attention

__all__ = [
    "DCMHAWeights",
    "dcmha_attention",
    "dcmha_compose",
    "dcmha_weights",
    "DepthBuffer",
    "HeadMergeStats",
    "PermutedHeads",
    "PrunedHeads",
    "QKVLayout",
    "QKVManifest",
    "ahon_scores",
    "circuit_scores",
    "from_hf_attention",
    "from_multihead_attention",
    "head_mask",
    "head_merge",
    "inactive_heads",
    "integrations",
    "kv_project",
    "mhar_route",
    "models",
    "nn",
    "permute_heads",
    "prune_heads",
    "q_project",
    "qkv_project",
    "reference",
    "testing",
]
__version__ = "0.1.0"
