"""From a hard head mask to a physically smaller model: :func:`prune_heads` applied to
every attention layer of a ``headwise.models.Decoder`` (``attention="mha"``) or of a
``transformers`` model patched by :func:`headwise.integrations.patch_hf_attention`
(``nn.DCMHAttention`` layers take gates and masks but are refused here: its compose
weights mix the heads of a group).

``prune_model_heads(model, masks, rescale=...)`` takes one shared mask ``[H]`` per layer
(0 = remove the head; not per batch row). Per layer:

1. the mask is made prunable by the GQA rule of :func:`headwise.head_surgery.prunable_mask`
   (whole KV groups, plus the same number of query heads from every other group; heads
   the mask keeps are never removed). The result reports both masks.
2. ``q_proj/k_proj/v_proj`` are fused as ``[W_q; W_k; W_v]`` (``QKVLayout(H, H_kv,
   head_dim)``) and pruned with ``o_proj`` by :func:`headwise.prune_heads`, then split
   back into new ``nn.Linear`` modules; the layer's head counts are updated and its
   ``head_gate`` slot emptied.
3. ``rescale=True`` folds the merge's rescale into the kept heads: the masked layer
   computes ``y = s sum_{h open} Z_h W_O(h)^T + b`` with ``s = H / H_open``; the pruned
   layer has all gates open (``s = 1``), so its kept ``W_O`` columns are multiplied by
   ``s``. ``rescale=False`` is the plain hard mask (no scale).

The pruned model's output equals the masked model's (``set_head_masks(model,
pruned_masks, rescale=rescale)``) up to fp32 rounding order. Masks are binary: from a
BinConcrete :class:`headwise.nn.HeadGate` at eval, ``gate_masks(model)`` *is* the gate
(and ``rescale=True`` its ``s_g``); a Hard-Concrete gate's test-time values lie in [0, 1]
and are not folded in, so its pruning equals the model masked by ``gate_masks``, not the
continuously gated one. A mask that closes every
head of a layer is refused with :class:`AllHeadsClosedError` (the layer would compute
only its output bias; headwise does not replace an attention module by its bias) before
any layer is changed: every layer's new tensors are computed and checked first, and the
model is modified only after that. The optimizer is not carried over (the parameters
are new ``nn.Linear`` modules): build a new one after pruning.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence, Union

import torch
from torch import nn

from .head_gating import _as_layer_masks, _layers_or_raise, head_counts
from .head_surgery import prunable_mask, prune_heads
from .qkv_layout import QKVLayout

__all__ = ["AllHeadsClosedError", "ModelPruning", "prune_model_heads"]


class AllHeadsClosedError(ValueError):
    """A mask closes every head of an attention layer; :func:`prune_model_heads` refuses
    it (before changing anything) rather than replacing the layer by its bias."""


class ModelPruning(NamedTuple):
    """Result of :func:`prune_model_heads`, one entry per attention layer: the mask asked
    for, the mask pruned (after the GQA rule), and the kept heads' old indices."""

    asked: List[torch.Tensor]
    pruned: List[torch.Tensor]
    new_to_old: List[tuple]
    kv_new_to_old: List[tuple]


def _linear(weight: torch.Tensor, bias: Optional[torch.Tensor], like: nn.Linear) -> nn.Linear:
    """A new ``nn.Linear`` holding ``weight [out, in]`` (+ ``bias``), with ``like``'s
    ``requires_grad`` flags."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device,
                      dtype=weight.dtype)
    with torch.no_grad():
        layer.weight = nn.Parameter(weight.detach().clone(), requires_grad=like.weight.requires_grad)
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=like.bias.requires_grad)
    return layer


def _plan_layer(layer: nn.Module, pruned: torch.Tensor, rescale: bool):
    """The new modules and head counts of one layer (nothing is modified here)."""
    hq, hkv, hd = head_counts(layer)
    layout = QKVLayout(hq, hkv, hd)
    q, k, v, o = layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj
    weight = torch.cat([q.weight, k.weight, v.weight])
    bias = None if q.bias is None else torch.cat([q.bias, k.bias, v.bias])
    closed = [h for h in range(hq) if pruned[h] == 0]
    result = prune_heads(layout, weight.detach(), o.weight.detach(), closed, qkv_bias=None if bias is None
                         else bias.detach(), o_bias=None if o.bias is None else o.bias.detach())
    o_weight = result.o_weight
    if rescale and closed:
        o_weight = o_weight * (hq / (hq - len(closed)))
    (qw, qb), (kw, kb), (vw, vb) = result.layout.split(result.qkv_weight, result.qkv_bias)
    modules = {"q_proj": _linear(qw, qb, q), "k_proj": _linear(kw, kb, k), "v_proj": _linear(vw, vb, v),
               "o_proj": _linear(o_weight, result.o_bias, o)}
    return modules, result.layout, result.new_to_old, result.kv_new_to_old


def _commit_layer(layer: nn.Module, modules: dict, new_layout: QKVLayout) -> None:
    for name, module in modules.items():
        setattr(layer, name, module)
    if getattr(layer, "_headwise_layout", None) is not None:  # a patched transformers attention
        layer._headwise_layout = new_layout
        if hasattr(layer, "num_key_value_groups"):
            layer.num_key_value_groups = new_layout.num_q_heads // new_layout.num_kv_heads
    else:
        layer.n_heads, layer.n_kv = new_layout.num_q_heads, new_layout.num_kv_heads
    layer.head_gate = None


def prune_model_heads(model: nn.Module, masks: Union[torch.Tensor, Sequence[torch.Tensor]], *,
                      rescale: bool = False, priority: Optional[Union[torch.Tensor, Sequence[torch.Tensor]]] = None
                      ) -> ModelPruning:
    """Physically removes the heads that ``masks`` (``[L, H]`` 0/1 or a list of ``[H_l]``;
    0 = remove) closes, in every attention layer of ``model`` (module docstring).
    ``priority`` (same shapes, e.g. the scores or gate logits) orders the heads the GQA
    rule removes first within a group. Returns :class:`ModelPruning`. Raises before any
    change on bad shapes or values, and :class:`AllHeadsClosedError` for a layer whose
    prunable mask closes every head."""
    fn = "prune_model_heads"
    layers = _layers_or_raise(model, fn)
    for i, layer in enumerate(layers):
        if not all(isinstance(getattr(layer, n, None), nn.Linear) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            raise TypeError(f"headwise.{fn}: attention layer {i} ({type(layer).__name__}) has no separate q/k/v/o "
                            "projections to prune (DCMHA's compose weights mix the heads of a group); nothing was "
                            "changed")
    asked = _as_layer_masks(masks, layers, fn)
    if priority is not None:
        prio_rows = list(priority.unbind(0)) if isinstance(priority, torch.Tensor) and priority.dim() == 2 \
            else list(priority)
        if len(prio_rows) != len(layers):
            raise ValueError(f"headwise.{fn}: priority must have one row per attention layer ({len(layers)}), "
                             f"got {len(prio_rows)}")
    else:
        prio_rows = [None] * len(layers)
    pruned = [prunable_mask(m, head_counts(layer)[1], priority=p) for m, layer, p in zip(asked, layers, prio_rows)]
    for i, m in enumerate(pruned):
        if not bool(m.any()):
            raise AllHeadsClosedError(
                f"headwise.{fn}: the mask of layer {i} closes every head; pruning would leave the layer only its "
                "output bias, which headwise does not do (keep at least one head open; nothing was changed)")
    with torch.no_grad():
        plans = [_plan_layer(layer, m, rescale) for layer, m in zip(layers, pruned)]
    for layer, (modules, new_layout, _, _) in zip(layers, plans):
        _commit_layer(layer, modules, new_layout)
    return ModelPruning(asked, pruned, [p[2] for p in plans], [p[3] for p in plans])
