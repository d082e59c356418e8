"""The MHAR routing site as a module (SPEC section 4)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..ops import DEFAULT_OPS, Ops


class MHARRouter(nn.Module):
    """One MHAR routing site: a learned query ``q`` and norm weight ``g`` (both ``[d]``)
    that read the depth history ``sources [N, B, T, d]`` with ``num_heads`` independent
    softmaxes over sources.

    The query starts at zero and the norm weight at one, so that a new router returns the
    uniform mean of its sources (Attention Residuals' zero initialization). ``num_heads=1``
    is the single-query Attention Residuals router. ``ops`` binds the router to a backend
    (``headwise.testing.backend(...)``); the default is ``torch.ops.headwise``.
    """

    def __init__(self, d: int, num_heads: int = 1, *, eps: float = 1e-6, ops: Optional[Ops] = None,
                 device=None, dtype=None):
        super().__init__()
        if d <= 0 or num_heads <= 0 or d % num_heads != 0:
            raise ValueError(f"MHARRouter: num_heads ({num_heads}) must be a positive divisor of d ({d})")
        factory = {"device": device, "dtype": dtype}
        self.d, self.num_heads, self.eps = d, num_heads, eps
        self.query = nn.Parameter(torch.zeros(d, **factory))
        self.norm_weight = nn.Parameter(torch.ones(d, **factory))
        self._ops = ops or DEFAULT_OPS

    def forward(self, sources: torch.Tensor, *, num_sources: Optional[int] = None,
                residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``out [B, T, d]`` = the routed mixture of rows ``[0, num_sources)`` (+ residual)."""
        return self._ops.mhar_route(sources, self.query, self.norm_weight, num_heads=self.num_heads,
                                    num_sources=num_sources, eps=self.eps, residual=residual)

    def extra_repr(self) -> str:
        return f"d={self.d}, num_heads={self.num_heads}, eps={self.eps}"
