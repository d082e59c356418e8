"""Typed wrappers of the headwise ops, with fake (meta) kernels and autograd.

Each op is registered for two libraries with identical schemas: ``headwise`` (CPU and
CUDA kernels) and ``headwise_sim`` (the CUDA kernels run by the SIMT emulator on CPU
tensors). :class:`Ops` binds the public functions to one of them; the module-level
functions use ``headwise``.
"""

from __future__ import annotations

from typing import Optional

import torch

LIBRARIES = ("headwise", "headwise_sim")


def weights_dtype(sources: torch.Tensor) -> torch.dtype:
    """dtype of the routing weights (and of a DepthBuffer's gradient accumulator)."""
    return torch.float64 if sources.dtype == torch.float64 else torch.float32


def _register(ns: str) -> None:
    route = f"{ns}::mhar_route"
    route_backward = f"{ns}::mhar_route_backward"

    @torch.library.register_fake(route)
    def _(sources, query, norm_weight, num_heads, num_sources, eps, residual, gate):
        _, b, t, d = sources.shape
        torch._check(d % num_heads == 0, lambda: f"num_heads ({num_heads}) must divide d ({d})")
        out = sources.new_empty((b, t, d))
        weights = sources.new_empty((num_sources, b, t, num_heads), dtype=weights_dtype(sources))
        return out, weights

    @torch.library.register_fake(route_backward)
    def _(grad_out, sources, query, norm_weight, weights, gate, num_heads, num_sources, eps):
        return (
            torch.empty(sources.shape, dtype=sources.dtype, device=sources.device),
            query.new_empty(query.shape),
            norm_weight.new_empty(norm_weight.shape),
            gate.new_empty(gate.shape) if gate is not None else weights.new_empty(()),
        )

    @torch.library.register_fake(f"{ns}::mhar_route_backward_into")
    def _(grad_out, sources, query, norm_weight, weights, grad_sources, num_heads, num_sources, eps, accumulate):
        return query.new_empty(query.shape), norm_weight.new_empty(norm_weight.shape)

    def setup_context(ctx, inputs, output):
        sources, query, norm_weight, num_heads, num_sources, eps, residual, gate = inputs
        _, weights = output
        ctx.save_for_backward(sources, query, norm_weight, weights, gate)
        ctx.num_heads, ctx.num_sources, ctx.eps = num_heads, num_sources, eps
        ctx.has_residual = residual is not None
        ctx.mark_non_differentiable(weights)

    def backward(ctx, grad_out, _grad_weights):
        sources, query, norm_weight, weights, gate = ctx.saved_tensors
        grad_out = grad_out.to(sources.dtype).contiguous()
        grad_sources, grad_query, grad_norm, grad_gate = getattr(torch.ops, ns).mhar_route_backward(
            grad_out, sources, query, norm_weight, weights, gate, ctx.num_heads, ctx.num_sources, ctx.eps
        )
        grad_residual = grad_out if ctx.has_residual else None
        grad_gate = grad_gate if gate is not None else None
        return grad_sources, grad_query, grad_norm, None, None, None, grad_residual, grad_gate

    torch.library.register_autograd(route, backward, setup_context=setup_context)


class Ops:
    """The public functions of headwise bound to one op library (``headwise`` or
    ``headwise_sim``); see :func:`headwise.testing.backend`."""

    def __init__(self, ns: str = "headwise"):
        if ns not in LIBRARIES:
            raise ValueError(f"unknown op library {ns!r}; expected one of {LIBRARIES}")
        self.ns = ns
        self._lib = getattr(torch.ops, ns)

    def mhar_route(
        self,
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
        """MHAR depth routing (SPEC section 4): ``out [B, T, d]`` in the sources' dtype.

        ``sources [N_max, B, T, d]`` (rows ``[0, num_sources)`` are read, default all),
        ``query [d]`` and ``norm_weight [d]`` (float32 or the sources' dtype), ``d``
        divisible by ``num_heads``. With ``residual [B, T, d]`` and a one-element ``gate``
        (float32 or the sources' dtype) the output is ``residual + gate * mix`` (the delta
        modes; each is optional). Saves only the routing weights ``[N, B, T, H]`` (fp32)
        for backward; the gate's gradient ``<dout, mix>`` comes out of the backward's
        first pass.
        """
        if not isinstance(sources, torch.Tensor) or sources.dim() != 4:
            raise ValueError(
                "headwise.mhar_route: sources must be a 4-D tensor [N, B, T, d], got "
                + (f"shape {list(sources.shape)}" if isinstance(sources, torch.Tensor) else type(sources).__name__)
            )
        n = sources.shape[0] if num_sources is None else int(num_sources)
        out, _ = self._lib.mhar_route(sources, query, norm_weight, int(num_heads), n, float(eps), residual, gate)
        return out


for _ns in LIBRARIES:
    _register(_ns)

DEFAULT_OPS = Ops("headwise")  # what modules use when no backend is given
mhar_route = DEFAULT_OPS.mhar_route
