"""Learned per-head gates with an L0 penalty (Shim et al., ``seeds/000_*``), and the
schedule that trains them.

:class:`HeadGate` owns one real parameter ``pi_h`` per head and returns the gate ``g``
that :func:`headwise.head_merge` multiplies into the head sum (``head_gate=g,
rescale=True``: ``y = s_g sum_h g_h Z_h W_O(h)^T + b`` with ``s_g = min(H, H / sum_h
g_h)``). Two distributions:

``"bin_concrete"`` (default; the gate of Shim et al.). In training, with logistic noise
``L = log u - log(1 - u)``, ``u ~ U(0, 1)``::

    soft = sigmoid((pi + L) / tau)          # the BinConcrete relaxation, in (0, 1)
    hard = 1[pi + L > 0]                    # = 1[soft > 1/2], in {0, 1}
    g    = hard + (soft - stopgrad(soft))   # value: exactly hard; gradient: d soft / d pi

so ``P(g = 1) = P(L > -pi) = sigmoid(pi)`` whatever ``tau`` is (init 2: 0.881, init 0:
0.5, as the seed states), the forward sees an exact 0/1 gate (a closed head costs the
merge nothing) and the straight-through gradient ``soft (1 - soft) / tau`` reaches every
``pi_h``, open or closed. ``tau`` shapes only that gradient. Shim et al. do not give the
sampler's constants; ``tau = 2/3`` (the value of Maddison et al. and Louizos et al.) is
*our choice*. At eval ``g = 1[pi > 0]`` (deterministic). ``expected_l0() = sum_h
sigmoid(pi_h)``, the expected number of open heads.

``"hard_concrete"`` (Louizos, Welling and Kingma 2018): ``s = sigmoid((pi + L) / beta)``
stretched to ``(gamma, zeta) = (-0.1, 1.1)`` and clipped, ``g = clamp(s (zeta - gamma) +
gamma, 0, 1)``, ``beta = 2/3``. The gate is *continuous* in [0, 1] (exact 0 and 1 have
positive mass), trained by the reparameterization gradient (no straight-through), and
``P(g > 0) = sigmoid(pi - beta log(-gamma / zeta))``: 0.973 at ``pi = 2`` (not 0.881),
so the same ``init`` opens heads more often than the BinConcrete gate. ``expected_l0()``
is the sum of those probabilities. At eval ``g = clamp(sigmoid(pi) (zeta - gamma) +
gamma, 0, 1)`` (their test-time estimator), also continuous.

``per_row=True`` samples one gate row per batch row (``[B, H]``); otherwise one ``[H]``
sample serves the whole batch. :meth:`HeadGate.freeze` ends training of the gate: from
then on it is the deterministic eval gate in training too and ``pi`` gets no gradient
(Shim et al. stop training the gates after 16,000 iterations so that later steps are not
driven by L0 randomness; making the frozen gate deterministic is our reading of that).

:class:`L0Schedule` is that schedule: the L0 weight ``lambda`` warms up linearly from 0
over ``warmup_steps`` (their run: 4,000) and the gates freeze after ``freeze_after``
steps (their run: 16,000).
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import torch
from torch import nn

__all__ = ["GATE_DISTRIBUTIONS", "HeadGate", "L0Schedule"]

GATE_DISTRIBUTIONS = ("bin_concrete", "hard_concrete")
# Hard-Concrete constants of Louizos et al. 2018: stretch interval and temperature.
HARD_CONCRETE_GAMMA = -0.1
HARD_CONCRETE_ZETA = 1.1
HARD_CONCRETE_BETA = 2.0 / 3.0
# Our choice for the BinConcrete temperature (not given by Shim et al.).
BIN_CONCRETE_TEMPERATURE = 2.0 / 3.0


def _logistic_noise(shape, like: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """``log u - log(1 - u)`` with ``u ~ U(eps, 1 - eps)`` (float32 eps keeps it finite)."""
    u = torch.rand(shape, dtype=like.dtype, device=like.device, generator=generator)
    u = u.clamp(1e-6, 1.0 - 1e-6)
    return torch.log(u) - torch.log1p(-u)


class HeadGate(nn.Module):
    """One layer's learned head gate: ``pi [H]`` (float32 parameter, all ``init``).

    ``forward(batch_size=None)`` returns the gate for the merge: ``[H]``, or ``[B, H]``
    with ``per_row=True`` in training (``batch_size`` rows), float32. See the module
    docstring for the math. ``rescale`` (default True, Shim et al.'s ``s_g``) is read by
    the attention layers that apply the gate (``headwise.head_pruning.merge_heads``).
    ``generator`` (optional) makes the samples reproducible.
    """

    def __init__(self, num_heads: int, *, init: float = 2.0, temperature: Optional[float] = None,
                 per_row: bool = False, distribution: str = "bin_concrete", rescale: bool = True,
                 generator: Optional[torch.Generator] = None):
        super().__init__()
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"HeadGate: num_heads must be a positive int, got {num_heads!r}")
        if distribution not in GATE_DISTRIBUTIONS:
            raise ValueError(f"HeadGate: distribution must be one of {GATE_DISTRIBUTIONS}, got {distribution!r}")
        default_tau = BIN_CONCRETE_TEMPERATURE if distribution == "bin_concrete" else HARD_CONCRETE_BETA
        tau = default_tau if temperature is None else float(temperature)
        if not (math.isfinite(tau) and tau > 0):
            raise ValueError(f"HeadGate: temperature must be a positive finite number, got {temperature!r}")
        if not math.isfinite(float(init)):
            raise ValueError(f"HeadGate: init must be finite, got {init!r}")
        self.num_heads, self.temperature, self.per_row = num_heads, tau, bool(per_row)
        self.distribution, self.rescale, self.generator = distribution, bool(rescale), generator
        self.pi = nn.Parameter(torch.full((num_heads,), float(init), dtype=torch.float32))
        self.register_buffer("frozen", torch.zeros((), dtype=torch.bool))

    # -- the distribution --------------------------------------------------------------

    def open_probability(self) -> torch.Tensor:
        """``P(g_h > 0)`` per head ``[H]``: ``sigmoid(pi)`` (BinConcrete, where it is
        ``P(g_h = 1)``), ``sigmoid(pi - beta log(-gamma / zeta))`` (Hard-Concrete)."""
        if self.distribution == "bin_concrete":
            return torch.sigmoid(self.pi)
        shift = self.temperature * math.log(-HARD_CONCRETE_GAMMA / HARD_CONCRETE_ZETA)
        return torch.sigmoid(self.pi - shift)

    def expected_l0(self) -> torch.Tensor:
        """Expected number of open heads, ``sum_h P(g_h > 0)`` (a differentiable scalar)."""
        return self.open_probability().sum()

    def eval_gate(self) -> torch.Tensor:
        """The deterministic gate ``[H]``: ``1[pi > 0]`` (BinConcrete) or the
        Hard-Concrete test-time estimator ``clamp(sigmoid(pi) (zeta - gamma) + gamma, 0, 1)``."""
        if self.distribution == "bin_concrete":
            return (self.pi > 0).to(self.pi.dtype)
        stretched = torch.sigmoid(self.pi) * (HARD_CONCRETE_ZETA - HARD_CONCRETE_GAMMA) + HARD_CONCRETE_GAMMA
        return stretched.clamp(0.0, 1.0)

    def open_heads(self) -> torch.Tensor:
        """Bool ``[H]``: heads whose deterministic gate is nonzero (the heads a pruning keeps)."""
        return self.eval_gate().detach() > 0

    def sample(self, batch_size: Optional[int] = None) -> torch.Tensor:
        """One training sample of the gate, ``[H]`` or ``[batch_size, H]``."""
        shape = (self.num_heads,) if batch_size is None else (int(batch_size), self.num_heads)
        logits = self.pi + _logistic_noise(shape, self.pi, self.generator)
        if self.distribution == "bin_concrete":
            soft = torch.sigmoid(logits / self.temperature)
            hard = (logits > 0).to(soft.dtype)
            return hard + (soft - soft.detach())  # exactly hard in value (x - x = 0)
        s = torch.sigmoid(logits / self.temperature)
        return (s * (HARD_CONCRETE_ZETA - HARD_CONCRETE_GAMMA) + HARD_CONCRETE_GAMMA).clamp(0.0, 1.0)

    def forward(self, batch_size: Optional[int] = None) -> torch.Tensor:
        if self.training and not bool(self.frozen):
            return self.sample(batch_size if self.per_row else None)
        return self.eval_gate().detach()

    # -- training control --------------------------------------------------------------

    def freeze(self) -> None:
        """Stop training this gate: the deterministic gate from now on, no grad to ``pi``."""
        self.frozen.fill_(True)
        self.pi.requires_grad_(False)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, distribution={self.distribution!r}, temperature={self.temperature:.4g}, "
                f"per_row={self.per_row}, rescale={self.rescale}, frozen={bool(self.frozen)}")


class L0Schedule:
    """Shim et al.'s training schedule for the L0 penalty: ``lambda_at(step) = lambda_max *
    min(1, step / warmup_steps)`` (a linear warm-up from 0; ``warmup_steps = 0``: full
    weight from step 0), and the gates frozen once ``step >= freeze_after`` (``lambda``
    is 0 from then on: a frozen gate has no L0 to minimize). Their run: 4,000 and 16,000.
    """

    def __init__(self, lambda_max: float, *, warmup_steps: int = 4000, freeze_after: int = 16000):
        if not (math.isfinite(float(lambda_max)) and lambda_max >= 0):
            raise ValueError(f"L0Schedule: lambda_max must be a finite number >= 0, got {lambda_max!r}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"L0Schedule: warmup_steps must be an int >= 0, got {warmup_steps!r}")
        if isinstance(freeze_after, bool) or not isinstance(freeze_after, int) or freeze_after < warmup_steps:
            raise ValueError(
                f"L0Schedule: freeze_after must be an int >= warmup_steps ({warmup_steps}), got {freeze_after!r}")
        self.lambda_max, self.warmup_steps, self.freeze_after = float(lambda_max), warmup_steps, freeze_after

    def frozen_at(self, step: int) -> bool:
        return step >= self.freeze_after

    def lambda_at(self, step: int) -> float:
        if self.frozen_at(step):
            return 0.0
        if self.warmup_steps == 0:
            return self.lambda_max
        return self.lambda_max * min(1.0, max(0, step) / self.warmup_steps)

    def penalty(self, step: int, gates: Iterable[HeadGate]) -> torch.Tensor:
        """``lambda_at(step) * sum over gates of expected_l0()``; freezes the gates at
        ``freeze_after`` (call it once per training step, before the forward)."""
        gates = list(gates)
        if self.frozen_at(step):
            for g in gates:
                if not bool(g.frozen):
                    g.freeze()
        lam = self.lambda_at(step)
        if lam == 0.0 or not gates:
            return torch.zeros((), dtype=torch.float32, device=gates[0].pi.device if gates else None)
        return lam * torch.stack([g.expected_l0() for g in gates]).sum()

    def __repr__(self) -> str:
        return (f"L0Schedule(lambda_max={self.lambda_max}, warmup_steps={self.warmup_steps}, "
                f"freeze_after={self.freeze_after})")
