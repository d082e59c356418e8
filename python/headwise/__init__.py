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
from .head_gating import (HeadMask, add_head_gates, attention_layers, clear_head_gates, gate_masks, set_head_gates,
                          set_head_masks)
from .head_pruning import AllHeadsClosedError, ModelPruning, prune_model_heads
from .head_scores import (HeadScores, ahon_scores, circuit_scores, collect_head_scores, inactive_heads, quantile_masks,
                          threshold_masks)
from .head_surgery import PermutedHeads, PrunedHeads, head_mask, permute_heads, prunable_mask, prune_heads
from .ops import (HeadMergeStats, dcmha_attention, dcmha_compose, dcmha_weights, head_merge, kv_project, mhar_route,
                  q_project, qkv_project)
from .qkv_layout import QKVLayout, QKVManifest, from_hf_attention, from_multihead_attention

__all__ = [
    "AllHeadsClosedError",
    "DCMHAWeights",
    "dcmha_attention",
    "dcmha_compose",
    "dcmha_weights",
    "DepthBuffer",
    "HeadMask",
    "HeadMergeStats",
    "HeadScores",
    "ModelPruning",
    "PermutedHeads",
    "PrunedHeads",
    "QKVLayout",
    "QKVManifest",
    "add_head_gates",
    "ahon_scores",
    "attention_layers",
    "circuit_scores",
    "clear_head_gates",
    "collect_head_scores",
    "from_hf_attention",
    "from_multihead_attention",
    "gate_masks",
    "head_mask",
    "head_merge",
    "inactive_heads",
    "integrations",
    "kv_project",
    "mhar_route",
    "models",
    "nn",
    "permute_heads",
    "prunable_mask",
    "prune_heads",
    "prune_model_heads",
    "q_project",
    "qkv_project",
    "quantile_masks",
    "reference",
    "set_head_gates",
    "set_head_masks",
    "testing",
    "threshold_masks",
]
__version__ = "0.1.0"
