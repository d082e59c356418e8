"""Per-head scores from the statistics of :func:`headwise.head_merge` (SPEC section 3).

``head_merge(..., return_stats=True)`` returns ``HeadMergeStats(z_norm, out_norm)``,
float32 ``[B, Q, H]`` row norms computed in the merge's own pass. From them:

- **AHON** (average head-output norm, Sandoval-Segura et al., scored on the
  *pre-projection* head output ``Z_h = A_h V_h``): the mean over tokens of
  ``||Z_h[b, q]||``; its **layer-normalized** form (AHON (LN)) divides each head's score
  by the average score of the heads of the layer. A head is called inactive when its
  layer-normalized score is below a threshold tau (their example: 0.1, "less than 10% of
  the layer average"; experimental thresholds come from score quantiles).
- **Circuit-based** (Elhage et al., as used by Sandoval-Segura et al.): the same averages
  of ``||Z_h[b, q] W_O(h)^T||``, the head's contribution in the model space, with the
  same layer normalization.

Over a data set: :func:`collect_head_scores` runs a model whose attention layers merge
heads through ``headwise.head_gating`` and accumulates both scores per layer and head
(padding excluded by token masks) into a :class:`HeadScores`; :func:`quantile_masks`
(their experimental rule) and :func:`threshold_masks` (a fixed tau) turn scores into hard
masks.

Neither score is a Bernoulli gate: they are measurements of the heads' outputs, and the
thresholded mask they produce is a deterministic hard mask (``head_gate`` of 0/1). Both
scores are computed from the head outputs themselves, so they cannot save the compute of
the heads they later mark inactive in that same pass.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

__all__ = ["HeadScores", "ahon_scores", "circuit_scores", "collect_head_scores", "head_scores", "inactive_heads",
           "layer_normalize", "quantile_masks", "threshold_masks"]

SCORE_KINDS = ("ahon", "circuit")


def _sum_over_tokens(norms: torch.Tensor, token_mask: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum, count)``: the sum of ``norms [B, Q, H]`` over the tokens (b, q) where
    ``token_mask [B, Q]`` is true (e.g. non-padding; all tokens without a mask), ``[H]``
    float32, and how many tokens that is (a float32 ``[1]``)."""
    if norms.dim() != 3:
        raise ValueError(f"headwise.head_scores: norms must be [B, Q, H], got shape {list(norms.shape)}")
    n = norms.float()
    if token_mask is None:
        return n.sum(dim=(0, 1)), n.new_full((1,), float(n.shape[0] * n.shape[1]))
    if token_mask.shape != n.shape[:2]:
        raise ValueError(
            f"headwise.head_scores: token_mask must be [B, Q] = {list(n.shape[:2])}, got {list(token_mask.shape)}"
        )
    m = token_mask.to(device=n.device, dtype=n.dtype).unsqueeze(-1)
    return (n * m).sum(dim=(0, 1)), m.sum(dim=(0, 1))


def _average_over_tokens(norms: torch.Tensor, token_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Mean of ``norms [B, Q, H]`` over (b, q), counting only tokens where ``token_mask
    [B, Q]`` is true (e.g. non-padding); ``[H]`` float32."""
    if token_mask is None and norms.dim() == 3:
        return norms.float().mean(dim=(0, 1))
    total, count = _sum_over_tokens(norms, token_mask)
    return total / count.clamp(min=1)


def layer_normalize(scores: torch.Tensor) -> torch.Tensor:
    """``scores / mean_h scores`` over the last (head) axis: 1 is the layer average."""
    mean = scores.mean(dim=-1, keepdim=True)
    return scores / torch.where(mean == 0, torch.ones_like(mean), mean)


def ahon_scores(stats, *, layer_normalized: bool = True, token_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """AHON per head ``[H]`` from ``stats.z_norm`` (or a ``[B, Q, H]`` tensor of norms)."""
    z_norm = stats.z_norm if hasattr(stats, "z_norm") else stats
    s = _average_over_tokens(z_norm, token_mask)
    return layer_normalize(s) if layer_normalized else s


def circuit_scores(stats, *, layer_normalized: bool = True, token_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Circuit-based head-output scores ``[H]`` from ``stats.out_norm`` (or a tensor)."""
    out_norm = stats.out_norm if hasattr(stats, "out_norm") else stats
    s = _average_over_tokens(out_norm, token_mask)
    return layer_normalize(s) if layer_normalized else s


def _check_kind(kind: str, fn: str) -> None:
    if kind not in SCORE_KINDS:
        raise ValueError(f"headwise.{fn}: kind must be 'ahon' or 'circuit', got {kind!r}")


def head_scores(stats, kind: str = "ahon", **kwargs) -> torch.Tensor:
    """``ahon_scores`` (kind="ahon") or ``circuit_scores`` (kind="circuit")."""
    _check_kind(kind, "head_scores")
    return ahon_scores(stats, **kwargs) if kind == "ahon" else circuit_scores(stats, **kwargs)


def inactive_heads(scores: Union[torch.Tensor, Sequence[float]], threshold: float = 0.1) -> list[int]:
    """Indices of heads whose (layer-normalized) score is below ``threshold``."""
    s = torch.as_tensor(scores)
    return [int(i) for i in torch.nonzero(s < threshold).flatten().tolist()]


# -- scores of a whole model over data ---------------------------------------------------


@dataclass(frozen=True)
class HeadScores:
    """Scores of every attention layer of a model over a data set, ``[L, H]`` float32:
    ``ahon[l, h]`` = mean over the counted tokens of ``||Z_h||`` in layer l, ``circuit[l,
    h]`` = mean of ``||Z_h W_O(h)^T||`` (not layer-normalized: see :meth:`get`), from
    ``tokens`` tokens."""

    ahon: torch.Tensor
    circuit: torch.Tensor
    tokens: int

    def get(self, kind: str = "ahon", *, layer_normalized: bool = True) -> torch.Tensor:
        """``[L, H]`` scores of ``kind`` ("ahon" or "circuit"), each layer divided by its
        mean over heads when ``layer_normalized`` (AHON (LN) and its circuit form)."""
        _check_kind(kind, "HeadScores.get")
        s = self.ahon if kind == "ahon" else self.circuit
        return layer_normalize(s) if layer_normalized else s.clone()


def _split_batch(batch):
    """``(call model, token_mask or None)`` for one item of the data iterator."""
    if isinstance(batch, torch.Tensor):
        return (lambda model: model(batch)), None
    if isinstance(batch, Mapping):
        return (lambda model: model(**batch)), batch.get("attention_mask")
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[0], torch.Tensor):
        return (lambda model: model(batch[0])), batch[1]
    raise TypeError("headwise.collect_head_scores: each batch must be a token tensor, a (tokens, token_mask) "
                    f"pair, or a mapping of model keyword arguments, got {type(batch).__name__}")


def collect_head_scores(model: torch.nn.Module, batches: Iterable, *, max_batches: Optional[int] = None) -> HeadScores:
    """Runs ``model`` (in eval mode, without gradients; its mode is restored afterwards)
    over ``batches`` and accumulates, per attention layer and head, the AHON and
    circuit-based scores from the head merge's own statistics (``return_stats``, SPEC
    section 3): the sums of ``z_norm`` and ``out_norm`` over the counted tokens, divided
    by the token count at the end.

    Each batch is a token tensor ``[B, T]`` (``model(tokens)``, every token counted), a
    pair ``(tokens, token_mask [B, T])`` (``model(tokens)``, only tokens where the mask is
    true counted: padding), or a mapping of keyword arguments (``model(**batch)``, e.g. a
    ``transformers`` model's ``input_ids`` and ``attention_mask``; ``attention_mask`` is
    the token mask). The layers are :func:`headwise.head_gating.attention_layers`; a
    layer whose gate closes a head records 0 for it (the merge does not read the head).
    """
    from .head_gating import _layers_or_raise, head_counts, stats_sinks

    layers = _layers_or_raise(model, "collect_head_scores")
    heads = {head_counts(layer)[0] for layer in layers}
    if len(heads) != 1:
        raise ValueError(f"headwise.collect_head_scores: the layers have different head counts {sorted(heads)}; "
                         "scores are collected as one [L, H] table")
    if max_batches is not None and max_batches < 1:
        raise ValueError(f"headwise.collect_head_scores: max_batches must be None or at least 1, got {max_batches}")
    n_layers, n_heads = len(layers), heads.pop()
    z_sums = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    out_sums = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    counts = torch.zeros(n_layers, dtype=torch.float64)
    current_mask: list = [None]

    def sink_of(i: int):
        def sink(stats) -> None:
            z, n = _sum_over_tokens(stats.z_norm, current_mask[0])
            o, _ = _sum_over_tokens(stats.out_norm, current_mask[0])
            z_sums[i] += z.double().cpu()
            out_sums[i] += o.double().cpu()
            counts[i] += n.double().cpu().squeeze(0)
        return sink

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), stats_sinks(layers, [sink_of(i) for i in range(n_layers)]):
            for index, batch in enumerate(batches):
                if max_batches is not None and index >= max_batches:
                    break
                run, current_mask[0] = _split_batch(batch)
                run(model)
    finally:
        model.train(was_training)
    if not bool((counts > 0).all()):
        raise ValueError("headwise.collect_head_scores: no token was counted (an empty iterator, or masks that "
                         "exclude every token)")
    denom = counts[:, None]
    return HeadScores((z_sums / denom).float(), (out_sums / denom).float(), int(counts[0].item()))


# -- from scores to hard masks -----------------------------------------------------------


def _check_scores(scores: torch.Tensor, fn: str) -> torch.Tensor:
    s = torch.as_tensor(scores)
    if s.dim() not in (1, 2) or s.numel() == 0:
        raise ValueError(f"headwise.{fn}: scores must be a non-empty [H] or [L, H] tensor, got shape {list(s.shape)}")
    if not bool(torch.isfinite(s).all()):
        raise ValueError(f"headwise.{fn}: scores must be finite")
    return s.double()


def quantile_masks(scores: torch.Tensor, quantile: float, *, per_layer: bool = False) -> torch.Tensor:
    """Hard masks (``head_gate`` of 0/1, float32, shaped like ``scores`` ``[L, H]`` or
    ``[H]``) from a score quantile, the experimental rule of Sandoval-Segura et al.: the
    threshold ``tau`` is the ``quantile`` of all scores (``per_layer=True``: of each
    layer's row; linear interpolation, ``torch.quantile``), and heads scoring below it
    are closed (0). ``quantile = 0`` closes nothing; ``q`` in between closes about a
    fraction q of the heads (exactly ``ceil(q (N - 1))`` of N distinct scores). A
    deterministic mask, not a Bernoulli gate."""
    s = _check_scores(scores, "quantile_masks")
    if isinstance(quantile, bool) or not isinstance(quantile, (int, float)) or not (
            math.isfinite(quantile) and 0.0 <= quantile <= 1.0):
        raise ValueError(f"headwise.quantile_masks: quantile must be a number in [0, 1], got {quantile!r}")
    if per_layer and s.dim() == 2:
        tau = torch.quantile(s, float(quantile), dim=-1, keepdim=True)
    else:
        tau = torch.quantile(s.flatten(), float(quantile))
    return (s >= tau).to(torch.float32)


def threshold_masks(scores: torch.Tensor, tau: float) -> torch.Tensor:
    """Hard masks (0/1 float32, shaped like ``scores``) with a fixed threshold: heads whose
    score is below ``tau`` are closed (with layer-normalized scores, ``tau = 0.1`` is the
    paper's example "less than 10% of the layer average")."""
    s = _check_scores(scores, "threshold_masks")
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau):
        raise ValueError(f"headwise.threshold_masks: tau must be a finite number, got {tau!r}")
    return (s >= tau).to(torch.float32)
