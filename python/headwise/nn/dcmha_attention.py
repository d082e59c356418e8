"""DCMHA self-attention as a module (SPEC section 5)."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ..dcmha import RANK, DCMHAWeights, hidden_size
from ..head_gating import GATED_ATTENTION, merge_heads
from ..ops import DEFAULT_OPS, Ops
from ..qkv_layout import QKVLayout


class DCMHAttention(nn.Module):
    """Dynamically composable multi-head self-attention: fused QKV projection
    (``qkv_project``), the dynamic compose weights of the input (``dcmha_weights``), the
    fused two-pass ``dcmha_attention`` and the output projection (``head_merge``, which
    reads the head-major attention output in place: no concatenation copy).

    ``x [B, T, d_model]`` (the attention input after its norm) -> ``[B, T, d_model]``.
    The generator parameters are initialized as DCFormer does, so that a new module is
    close to plain MHA: ``dw1 [D, 4, Kh]`` with std ``sqrt(2 / (D + Kh))``,
    ``qkw [4, Kh, 2R, H]`` with std ``0.02 / (sqrt(4H) (H + 2))``, ``dd [D, 4H]`` with
    std ``0.005 sqrt(2 / (D + H))`` (Kh = 4H, R = 2). The ``dd`` init follows DCFormer's
    JAX code; its PyTorch file uses 0.05 instead of 0.005.

    ``qk_norm=True`` adds Qwen3-style per-head RMSNorms of q and k (weights ``q_norm``,
    ``k_norm`` ``[head_dim]``, ones-init, statistic in fp32 with ``norm_eps``), applied in
    the QKV epilogue before the rotary embedding, as the decoder's ``mha`` layer does.

    The merge reads the ``head_gate`` and ``head_stats_sink`` slots of
    ``headwise.head_gating`` (learned gates, hard masks, score collection on the composed
    heads' outputs). Physical pruning (``headwise.prune_model_heads``) refuses this module:
    the compose weights mix every head of a group.
    """

    def __init__(self, d_model: int, num_heads: int, head_dim: Optional[int] = None, *, causal: bool = True,
                 window: Optional[int] = None, head_groups: int = 1, bias: bool = False,
                 qk_norm: bool = False, norm_eps: float = 1e-6, ops: Optional[Ops] = None):
        super().__init__()
        head_dim = d_model // num_heads if head_dim is None else head_dim
        self.d_model, self.num_heads, self.head_dim = d_model, num_heads, head_dim
        self.causal, self.window, self.head_groups = causal, window, head_groups
        self.ops = DEFAULT_OPS if ops is None else ops
        self.layout = QKVLayout(num_heads, num_heads, head_dim)
        self.qkv = nn.Linear(d_model, self.layout.num_rows, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, d_model, bias=bias)
        self.norm_eps = norm_eps
        self.q_norm = nn.Parameter(torch.ones(head_dim)) if qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(head_dim)) if qk_norm else None
        kh = hidden_size(num_heads)
        self.dw1 = nn.Parameter(torch.empty(d_model, 4, kh))
        self.qkw = nn.Parameter(torch.empty(4, kh, 2 * RANK, num_heads))
        self.dd = nn.Parameter(torch.empty(d_model, 4 * num_heads))
        self.head_gate: Optional[nn.Module] = None
        self.head_stats_sink = None
        setattr(self, GATED_ATTENTION, True)
        self.reset_dcmha_parameters()

    def reset_dcmha_parameters(self) -> None:
        d, h = self.d_model, self.num_heads
        kh = hidden_size(h)
        with torch.no_grad():
            self.dw1.normal_(0.0, math.sqrt(2.0 / (d + kh)))
            self.qkw.normal_(0.0, 0.02 / (math.sqrt(4 * h) * (h + 2)))
            self.dd.normal_(0.0, 0.005 * math.sqrt(2.0 / (d + h)))

    def compose_weights(self, x: torch.Tensor) -> DCMHAWeights:
        return self.ops.dcmha_weights(x, self.dw1, self.qkw, self.dd)

    def forward(self, x: torch.Tensor, weights: Optional[DCMHAWeights] = None, *, rope=None) -> torch.Tensor:
        """``rope=(cos, sin)`` (each ``[T, head_dim]``) rotates q and k in the QKV epilogue."""
        q, k, v = self.ops.qkv_project(x, self.qkv.weight, self.qkv.bias, layout=self.layout, q_norm=self.q_norm,
                                       k_norm=self.k_norm, norm_eps=self.norm_eps, rope=rope)
        w = self.compose_weights(x) if weights is None else weights
        o = self.ops.dcmha_attention(q, k, v, w, causal=self.causal, window=self.window,
                                     head_groups=self.head_groups)
        return merge_heads(self, self.ops.head_merge, o, self.o_proj.weight, self.o_proj.bias)

    def reference_forward(self, x: torch.Tensor, *, rope=None) -> torch.Tensor:
        """The same function through ``headwise.reference`` only (the test oracle)."""
        from .. import reference

        q, k, v = reference.qkv_project(x, self.qkv.weight, self.qkv.bias, layout=self.layout, q_norm=self.q_norm,
                                        k_norm=self.k_norm, norm_eps=self.norm_eps, rope=rope)
        w = reference.dcmha_weights(x, self.dw1, self.qkw, self.dd)
        o = reference.dcmha_attention(q, k, v, w, causal=self.causal, window=self.window,
                                      head_groups=self.head_groups)
        return merge_heads(self, reference.head_merge, o, self.o_proj.weight, self.o_proj.bias)
