"""The MHAR routing site as a module (SPEC section 4)."""

from __future__ import annotations

from typing import Optional, Sequence, Union

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

    ``delta=True`` makes the router of the delta modes: it also owns a learnable null
    source ``null_source [d]`` and a scalar gate ``gate``, both zero-initialized, and
    computes ``residual + gate * route([null_source; deltas])`` in one kernel (the
    residual stream and the gate are applied in the kernel's epilogue). At ``gate = 0``
    it returns the residual stream exactly, so a model converted to delta routing
    computes its base model at step 0 while the gate still receives its gradient
    ``<dout, mix>``.
    """

    def __init__(self, d: int, num_heads: int = 1, *, delta: bool = False, eps: float = 1e-6,
                 ops: Optional[Ops] = None, device=None, dtype=None):
        super().__init__()
        if d <= 0 or num_heads <= 0 or d % num_heads != 0:
            raise ValueError(f"MHARRouter: num_heads ({num_heads}) must be a positive divisor of d ({d})")
        factory = {"device": device, "dtype": dtype}
        self.d, self.num_heads, self.eps, self.delta = d, num_heads, eps, delta
        self.query = nn.Parameter(torch.zeros(d, **factory))
        self.norm_weight = nn.Parameter(torch.ones(d, **factory))
        if delta:
            self.null_source = nn.Parameter(torch.zeros(d, **factory))
            self.gate = nn.Parameter(torch.zeros(1, **factory))  # [1], not 0-dim: FSDP2 shards no scalars
        self._ops = ops or DEFAULT_OPS

    def delta_sources(self, deltas: Sequence[torch.Tensor]) -> torch.Tensor:
        """The per-call stack ``[1 + len(deltas), B, T, d]``: the null source broadcast over
        (B, T), then the deltas (one copy)."""
        first = deltas[0]
        return torch.stack([self.null_source.to(first.dtype).expand_as(first), *deltas])

    def forward(self, sources: Union[torch.Tensor, Sequence[torch.Tensor]], *,
                num_sources: Optional[int] = None, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``out [B, T, d]`` = the routed mixture of rows ``[0, num_sources)`` (+ residual).

        For a delta router, ``sources`` are the deltas (a sequence of ``[B, T, d]`` tensors
        or a stacked ``[M, B, T, d]`` tensor) and ``residual`` is required:
        ``out = residual + gate * route([null_source; deltas])``.
        """
        if not self.delta:
            return self._ops.mhar_route(sources, self.query, self.norm_weight, num_heads=self.num_heads,
                                        num_sources=num_sources, eps=self.eps, residual=residual)
        if residual is None:
            raise ValueError("MHARRouter(delta=True): residual (the residual stream) is required")
        deltas = list(sources.unbind(0) if isinstance(sources, torch.Tensor) else sources)
        if num_sources is not None:
            deltas = deltas[:num_sources]
        return self._ops.mhar_route(self.delta_sources(deltas), self.query, self.norm_weight,
                                    num_heads=self.num_heads, eps=self.eps, residual=residual, gate=self.gate)

    def extra_repr(self) -> str:
        return f"d={self.d}, num_heads={self.num_heads}, delta={self.delta}, eps={self.eps}"
