"""Shared definitions of DCMHA (SPEC section 5): the dynamic weights container and the
slot order of the four compose slots.

Slots ``c``: 0 = (pre, query), 1 = (pre, key), 2 = (post, query), 3 = (post, key).
``dcmha_compose(a, weights, slot="pre")`` uses slots (0, 1); ``slot="post"`` uses (2, 3).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

RANK = 2  # R: rank of each compose slot's dynamic low-rank projection
NUM_SLOTS = 4
SLOTS = {"pre": 0, "post": 1}  # slot name -> index s; the slots used are (2s, 2s + 1)


def hidden_size(num_heads: int) -> int:
    """Kh = 4H, the hidden width of the weight generator."""
    return 4 * num_heads


class DCMHAWeights(NamedTuple):
    """The dynamic compose weights of one attention layer, per token.

    ``w1 [B, T, 4, R, H]`` (RMS-normalized over H), ``w2 [B, T, 4, R, H]``,
    ``g [B, T, 4, H]``; the third axis is the slot c (see the module docstring)."""

    w1: torch.Tensor
    w2: torch.Tensor
    g: torch.Tensor

    @staticmethod
    def zeros(batch: int, seq: int, num_heads: int, **kw) -> "DCMHAWeights":
        """All-zero weights: compose is the identity, DCMHA is plain attention."""
        return DCMHAWeights(
            torch.zeros(batch, seq, NUM_SLOTS, RANK, num_heads, **kw),
            torch.zeros(batch, seq, NUM_SLOTS, RANK, num_heads, **kw),
            torch.zeros(batch, seq, NUM_SLOTS, num_heads, **kw),
        )


def slot_index(slot) -> int:
    if isinstance(slot, str) and slot in SLOTS:
        return SLOTS[slot]
    raise ValueError(f"headwise.dcmha_compose: slot must be 'pre' or 'post', got {slot!r}")


def check_weights(weights, op: str) -> DCMHAWeights:
    if not isinstance(weights, tuple) or len(weights) != 3:
        raise ValueError(f"headwise.{op}: weights must be a headwise.DCMHAWeights (w1, w2, g), got "
                         f"{type(weights).__name__}")
    return DCMHAWeights(*weights)
