"""Eager PyTorch oracles: the single source of truth for tests and benchmarks.

Every fused op of headwise is checked against, and timed beside, the function of the
same name here. These functions use only differentiable ``torch`` operations, so their
autograd is the reference backward. They are written for clarity, not speed.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["mhar_route", "mhar_route_weights"]


def _accumulation_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for fp32 and narrower floats, fp64 for fp64 (so float64 runs are ground truth)."""
    return torch.promote_types(x.dtype, torch.float32)


def _mhar_logits(
    sources: torch.Tensor,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    num_heads: int,
    eps: float,
) -> torch.Tensor:
    """Per-head routing logits ``l[n, b, t, h]`` (fp32; fp64 for fp64 sources), SPEC section 4.

    ``sources [N, B, T, d]``; ``r_n = rsqrt(mean_j s_n[j]^2 + eps)`` over the full row in
    fp32; the normalized key is rounded to the storage dtype (where Hugging Face's
    RMSNorm rounds), then scaled by ``g`` in fp32; ``l = <q_h, khat_h>`` with no
    1/sqrt scale.
    """
    n, b, t, d = sources.shape
    acc = _accumulation_dtype(sources)
    s = sources.to(acc)
    r = torch.rsqrt(s.pow(2).mean(dim=-1, keepdim=True) + eps)
    khat = (s * r).to(sources.dtype).to(acc) * norm_weight.to(acc)
    prod = khat * query.to(acc)
    return prod.view(n, b, t, num_heads, d // num_heads).sum(dim=-1)


def mhar_route_weights(
    sources: torch.Tensor,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    num_heads: int,
    num_sources: Optional[int] = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Routing weights ``w [N, B, T, H]`` (fp32; fp64 for fp64 sources): softmax over sources."""
    n_read = sources.shape[0] if num_sources is None else num_sources
    logits = _mhar_logits(sources[:n_read], query, norm_weight, num_heads, eps)
    return torch.softmax(logits, dim=0)


def mhar_route(
    sources: torch.Tensor,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    num_heads: int,
    num_sources: Optional[int] = None,
    eps: float = 1e-6,
    residual: Optional[torch.Tensor] = None,
    gate: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """MHAR depth routing (SPEC section 4).

    ``sources [N_max, B, T, d]`` (rows ``[0, num_sources)`` are read), ``query [d]``,
    ``norm_weight [d]``. Returns ``mix[b, t, h-slice] = sum_n w[n, b, t, h] *
    s_n[b, t, h-slice]``, times the one-element ``gate`` and plus ``residual [B, T, d]``
    when given (``residual + gate * mix``), accumulated in fp32 (fp64 for fp64
    sources) and returned in the sources' dtype.
    """
    n_read = sources.shape[0] if num_sources is None else num_sources
    src = sources[:n_read]
    n, b, t, d = src.shape
    w = mhar_route_weights(src, query, norm_weight, num_heads=num_heads, eps=eps)
    values = src.to(w.dtype).view(n, b, t, num_heads, d // num_heads)
    out = (w.unsqueeze(-1) * values).sum(dim=0).reshape(b, t, d)
    if gate is not None:
        out = out * gate.to(w.dtype).reshape(())
    if residual is not None:
        out = out + residual.to(w.dtype)
    return out.to(sources.dtype)
