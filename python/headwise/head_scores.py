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

Neither score is a Bernoulli gate: they are measurements of the heads' outputs, and the
thresholded mask they produce is a deterministic hard mask (``head_gate`` of 0/1). Both
scores are computed from the head outputs themselves, so they cannot save the compute of
the heads they later mark inactive in that same pass.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

__all__ = ["ahon_scores", "circuit_scores", "head_scores", "inactive_heads", "layer_normalize"]


def _average_over_tokens(norms: torch.Tensor, token_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Mean of ``norms [B, Q, H]`` over (b, q), counting only tokens where ``token_mask
    [B, Q]`` is true (e.g. non-padding); ``[H]`` float32."""
    if norms.dim() != 3:
        raise ValueError(f"headwise.head_scores: norms must be [B, Q, H], got shape {list(norms.shape)}")
    n = norms.float()
    if token_mask is None:
        return n.mean(dim=(0, 1))
    if token_mask.shape != n.shape[:2]:
        raise ValueError(
            f"headwise.head_scores: token_mask must be [B, Q] = {list(n.shape[:2])}, got {list(token_mask.shape)}"
        )
    m = token_mask.to(n.dtype).unsqueeze(-1)
    return (n * m).sum(dim=(0, 1)) / m.sum(dim=(0, 1)).clamp(min=1)


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


def head_scores(stats, kind: str = "ahon", **kwargs) -> torch.Tensor:
    """``ahon_scores`` (kind="ahon") or ``circuit_scores`` (kind="circuit")."""
    if kind == "ahon":
        return ahon_scores(stats, **kwargs)
    if kind == "circuit":
        return circuit_scores(stats, **kwargs)
    raise ValueError(f"headwise.head_scores: kind must be 'ahon' or 'circuit', got {kind!r}")


def inactive_heads(scores: Union[torch.Tensor, Sequence[float]], threshold: float = 0.1) -> list[int]:
    """Indices of heads whose (layer-normalized) score is below ``threshold``."""
    s = torch.as_tensor(scores)
    return [int(i) for i in torch.nonzero(s < threshold).flatten().tolist()]
