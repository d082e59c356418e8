"""DepthBuffer: the depth-source buffer of an MHAR model (SPEC section 4).

One ``[rows, B, T, d]`` buffer per forward holds every routing source, each written once
as it is produced (in the papers' replacement models: the embedding v_0 and each
sublayer's output v_{s+1}); the routing call whose own source is row ``i`` reads rows
``[0, i]`` in place, with no per-call stack. In backward, all source gradients go into
one shared fp32 buffer in place: the first backward to run (the last routing call)
stores, every earlier call accumulates. This is exact because autograd runs the routing
calls' backwards in strictly reverse forward order (call i + 1's source is computed from
call i's output), so when call i runs, row i already holds the contributions of every
later call; the call then returns row i to autograd as the gradient of its own source,
and nothing else. The order is asserted at runtime.
"""

from __future__ import annotations

from typing import Optional

import torch

from .ops import DEFAULT_OPS, Ops, weights_dtype


class DepthBuffer:
    """Depth sources ``[rows, B, T, d]`` of one forward, routed in place.

    Usage per forward: ``buf = DepthBuffer(rows, B, T, d, ...)``; for each state in order,
    ``buf.write(i, state)``; ``buf.route(i, state, query, norm_weight, num_heads=H)`` mixes
    rows ``[0, i]`` and is differentiable w.r.t. the state written at row ``i``, the
    query and the norm weight. Every row must be routed exactly once, by the call that
    owns it, and the calls must be made in increasing row order.
    """

    def __init__(self, rows: int, batch: int, seq: int, d: int, *, dtype: torch.dtype = torch.float32,
                 device=None, ops: Optional[Ops] = None):
        if rows < 1:
            raise ValueError(f"DepthBuffer: rows must be at least 1, got {rows}")
        self.states = torch.empty(rows, batch, seq, d, dtype=dtype, device=device)
        self._ops = ops or DEFAULT_OPS
        self._lib = self._ops._lib
        self._written = [False] * rows
        self._routed: list[int] = []
        self._grad: Optional[torch.Tensor] = None  # the shared accumulator, made by the first backward
        self._expected_backward: Optional[int] = None

    def write(self, row: int, state: torch.Tensor) -> None:
        """Store the source of row ``row`` (once)."""
        if self._written[row]:
            raise RuntimeError(f"DepthBuffer: row {row} was already written; every state is written once")
        if state.shape != self.states.shape[1:]:
            raise ValueError(f"DepthBuffer.write: state must have shape {tuple(self.states.shape[1:])}, "
                             f"got {tuple(state.shape)}")
        with torch.no_grad():
            self.states[row].copy_(state)
        self._written[row] = True

    def route(self, row: int, state: torch.Tensor, query: torch.Tensor, norm_weight: torch.Tensor, *,
              num_heads: int, eps: float = 1e-6) -> torch.Tensor:
        """Route over rows ``[0, row]``; ``state`` is the tensor written at ``row`` (the
        autograd input whose gradient this call returns)."""
        if not all(self._written[: row + 1]):
            raise RuntimeError(f"DepthBuffer.route: rows [0, {row}] must be written before routing them")
        if self._routed and row <= self._routed[-1]:
            raise RuntimeError(f"DepthBuffer.route: rows must be routed in increasing order "
                               f"(row {row} after row {self._routed[-1]})")
        self._routed.append(row)
        return _BufferRoute.apply(state, query, norm_weight, self, row, int(num_heads), float(eps))

    def _backward(self, row: int, grad_out: torch.Tensor, query: torch.Tensor, norm_weight: torch.Tensor,
                  weights: torch.Tensor, num_heads: int, eps: float):
        first = self._expected_backward is None
        if first:
            if row != self._routed[-1]:
                raise RuntimeError(f"DepthBuffer: the first backward must be the last routing call "
                                   f"(row {self._routed[-1]}), got row {row}")
            self._grad = torch.empty(self.states.shape, dtype=weights_dtype(self.states),
                                     device=self.states.device)
        elif row != self._expected_backward:
            raise RuntimeError(f"DepthBuffer: routing backwards must run in reverse forward order; "
                               f"expected row {self._expected_backward}, got row {row}")
        index = self._routed.index(row)
        self._expected_backward = self._routed[index - 1] if index > 0 else -1
        grad_query, grad_norm = self._lib.mhar_route_backward_into(
            grad_out.to(self.states.dtype).contiguous(), self.states, query, norm_weight, weights, self._grad,
            num_heads, row + 1, eps, not first)
        return self._grad[row].to(self.states.dtype, copy=True), grad_query, grad_norm


class _BufferRoute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, state, query, norm_weight, buffer: DepthBuffer, row: int, num_heads: int, eps: float):
        out, weights = buffer._lib.mhar_route(buffer.states, query, norm_weight, num_heads, row + 1, eps, None, None)
        ctx.save_for_backward(query, norm_weight, weights)
        ctx.buffer, ctx.row, ctx.num_heads, ctx.eps = buffer, row, num_heads, eps
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, norm_weight, weights = ctx.saved_tensors
        grad_state, grad_query, grad_norm = ctx.buffer._backward(
            ctx.row, grad_out, query, norm_weight, weights, ctx.num_heads, ctx.eps)
        return grad_state, grad_query, grad_norm, None, None, None, None
