"""Head gates and head-merge statistics inside models: the attention layers of
``headwise.models.Decoder`` (``attention="mha"`` and ``"dcmha"``), ``nn.DCMHAttention`` and
a ``transformers`` model patched by :func:`headwise.integrations.patch_hf_attention`
merge their heads through :func:`merge_heads`, which reads two per-layer slots of the attention module:

- ``head_gate``: ``None`` (all heads, no gate) or a module called as
  ``head_gate(batch_size) -> [H] or [B, H]`` with a ``rescale`` attribute: a learned
  :class:`headwise.nn.HeadGate` (Shim et al.'s BinConcrete gate, ``rescale=True``) or a
  fixed :class:`HeadMask` (a deterministic hard mask, e.g. from score thresholds:
  Sandoval-Segura et al. zero heads without rescaling; not a Bernoulli gate). The merge
  computes ``y = s sum_h g_h Z_h W_O(h)^T + b``, ``s = min(H, H / sum_h g_h)`` when
  ``rescale`` else 1, and skips the work of heads whose gate is exactly 0.
- ``head_stats_sink``: ``None`` or a callable that receives the merge's
  :class:`headwise.HeadMergeStats` (``z_norm``, ``out_norm``, float32 ``[B, Q, H]``) of
  every call (used by :func:`headwise.head_scores.collect_head_scores`).

:func:`attention_layers` lists those modules in ``model.modules()`` order (layer 0
first); :func:`set_head_gates`, :func:`set_head_masks`, :func:`add_head_gates` and
:func:`clear_head_gates` fill the slots; :func:`gate_masks` reads the deterministic 0/1
masks of the gates in place (what a pruning would keep).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

if TYPE_CHECKING:  # imported where used: headwise.nn's modules import this module
    from .nn.head_gate import HeadGate

__all__ = [
    "HeadMask",
    "add_head_gates",
    "attention_layers",
    "clear_head_gates",
    "gate_masks",
    "head_counts",
    "merge_heads",
    "set_head_gates",
    "set_head_masks",
    "stats_sinks",
]

# Marks an attention module that merges its heads through merge_heads (set by the
# decoder's Attention and by patch_hf_attention).
GATED_ATTENTION = "_headwise_gated_attention"


class HeadMask(nn.Module):
    """A fixed hard mask of one layer's heads: ``mask [H]`` of 0/1 (float32 buffer), the
    same for every batch row; ``rescale`` (default False: a hard zero of the heads'
    outputs, as Sandoval-Segura et al. do) applies ``s = H / H_open`` when True. This is a
    deterministic mask, not a Bernoulli gate."""

    def __init__(self, mask: torch.Tensor, *, rescale: bool = False):
        super().__init__()
        m = torch.as_tensor(mask)
        if m.dim() != 1 or m.numel() < 1:
            raise ValueError(f"HeadMask: mask must be a non-empty [H] tensor, got shape {list(m.shape)}")
        if not bool(((m == 0) | (m == 1)).all()):
            raise ValueError("HeadMask: mask must hold only 0 and 1")
        self.num_heads, self.rescale = int(m.numel()), bool(rescale)
        self.register_buffer("mask", m.detach().to(torch.float32).clone())

    def forward(self, batch_size: Optional[int] = None) -> torch.Tensor:
        return self.mask

    def extra_repr(self) -> str:
        return f"open={int(self.mask.sum())}/{self.num_heads}, rescale={self.rescale}"


def attention_layers(model: nn.Module) -> List[nn.Module]:
    """The attention modules of ``model`` that merge heads through :func:`merge_heads`."""
    return [m for m in model.modules() if getattr(m, GATED_ATTENTION, False)]


def _layers_or_raise(model: nn.Module, fn: str) -> List[nn.Module]:
    layers = attention_layers(model)
    if not layers:
        raise ValueError(
            f"headwise.{fn}: the model has no gateable attention layers (a headwise.models.Decoder, "
            "headwise.nn.DCMHAttention, or a transformers model after headwise.integrations.patch_hf_attention)")
    return layers


def head_counts(module: nn.Module) -> Tuple[int, int, int]:
    """``(num_q_heads, num_kv_heads, head_dim)`` of a gateable attention module: a patched
    transformers attention (its layout), the decoder's ``Attention`` (``n_heads``,
    ``n_kv``) or ``nn.DCMHAttention`` (``num_heads`` full heads)."""
    layout = getattr(module, "_headwise_layout", None)
    if layout is not None:
        return layout.num_q_heads, layout.num_kv_heads, layout.head_dim
    if hasattr(module, "n_heads"):
        return module.n_heads, module.n_kv, module.head_dim
    return module.num_heads, module.num_heads, module.head_dim


def merge_heads(module: nn.Module, merge: Callable, z: torch.Tensor, weight_o: torch.Tensor,
                bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``merge(z [B, H, Q, Dv], weight_o, bias, head_gate=..., rescale=..., return_stats=...)``
    (``ops.head_merge`` or ``headwise.reference.head_merge``) with the module's
    ``head_gate`` and ``head_stats_sink`` slots applied (module docstring)."""
    gate = getattr(module, "head_gate", None)
    g, rescale = None, False
    if gate is not None:
        g = gate(z.shape[0])
        rescale = bool(getattr(gate, "rescale", False))
        if g.shape not in ((z.shape[1],), (z.shape[0], z.shape[1])):
            raise ValueError(f"headwise.merge_heads: head_gate returned shape {list(g.shape)}; expected "
                             f"[H] = [{z.shape[1]}] or [B, H] = [{z.shape[0]}, {z.shape[1]}]")
    sink = getattr(module, "head_stats_sink", None)
    if sink is None:
        return merge(z, weight_o, bias, head_gate=g, rescale=rescale)
    out, stats = merge(z, weight_o, bias, head_gate=g, rescale=rescale, return_stats=True)
    sink(stats)
    return out


def set_head_gates(model: nn.Module, gates: Sequence[Optional[nn.Module]]) -> None:
    """Puts ``gates[i]`` (a :class:`HeadGate`, a :class:`HeadMask`, or None) into layer i's
    ``head_gate`` slot. Checks every gate's ``num_heads`` against its layer first; on an
    error nothing is changed."""
    layers = _layers_or_raise(model, "set_head_gates")
    gates = list(gates)
    if len(gates) != len(layers):
        raise ValueError(f"headwise.set_head_gates: gates must have one entry per attention layer "
                         f"({len(layers)}), got {len(gates)}")
    for i, (layer, gate) in enumerate(zip(layers, gates)):
        if gate is None:
            continue
        if not isinstance(gate, nn.Module) or not hasattr(gate, "rescale"):
            raise TypeError(f"headwise.set_head_gates: gates[{i}] must be an nn.Module with a rescale attribute "
                            f"(HeadGate, HeadMask) or None, got {type(gate).__name__}")
        heads = head_counts(layer)[0]
        if getattr(gate, "num_heads", None) != heads:
            raise ValueError(f"headwise.set_head_gates: gates[{i}] has num_heads="
                             f"{getattr(gate, 'num_heads', None)}, layer {i} has {heads} heads")
    for layer, gate in zip(layers, gates):
        layer.head_gate = gate


def _as_layer_masks(masks, layers: Sequence[nn.Module], fn: str, name: str = "masks") -> List[torch.Tensor]:
    """``masks`` ([L, H] tensor or a sequence of [H_l] tensors) as a list of float32 0/1
    ``[H_l]`` tensors, checked against the layers' head counts and for 0/1 values."""
    if isinstance(masks, torch.Tensor):
        if masks.dim() != 2:
            raise ValueError(f"headwise.{fn}: {name} must be [num_layers, H] or a list of [H] tensors, "
                             f"got shape {list(masks.shape)}")
        rows = list(masks.unbind(0))
    else:
        rows = [torch.as_tensor(m) for m in masks]
    if len(rows) != len(layers):
        raise ValueError(f"headwise.{fn}: {name} must have one row per attention layer ({len(layers)}), "
                         f"got {len(rows)}")
    out = []
    for i, (row, layer) in enumerate(zip(rows, layers)):
        heads = head_counts(layer)[0]
        if tuple(row.shape) != (heads,):
            raise ValueError(f"headwise.{fn}: {name}[{i}] must be [H] = [{heads}] (one shared mask per layer, "
                             f"not per row), got shape {list(row.shape)}")
        if not bool(((row == 0) | (row == 1)).all()):
            raise ValueError(f"headwise.{fn}: {name}[{i}] must hold only 0 and 1, got {row.tolist()}")
        out.append(row.detach().to(torch.float32).cpu())
    return out


def set_head_masks(model: nn.Module, masks: Union[torch.Tensor, Sequence[torch.Tensor]], *,
                   rescale: bool = False) -> List[HeadMask]:
    """A :class:`HeadMask` per layer from ``masks`` (``[L, H]`` 0/1, or a list of ``[H]``);
    returns them. Checked before anything is set."""
    layers = _layers_or_raise(model, "set_head_masks")
    rows = _as_layer_masks(masks, layers, "set_head_masks")
    gates = []
    for layer, row in zip(layers, rows):
        device = layer.o_proj.weight.device
        gates.append(HeadMask(row.to(device), rescale=rescale))
    set_head_gates(model, gates)
    return gates


def add_head_gates(model: nn.Module, **gate_kwargs) -> List[HeadGate]:
    """A new :class:`headwise.nn.HeadGate` (``gate_kwargs``: init, temperature, per_row,
    distribution, rescale, generator) in every attention layer, on the layer's device;
    returns them (their ``pi`` are parameters of the model from now on)."""
    from .nn.head_gate import HeadGate

    layers = _layers_or_raise(model, "add_head_gates")
    gates = [HeadGate(head_counts(layer)[0], **gate_kwargs).to(layer.o_proj.weight.device) for layer in layers]
    set_head_gates(model, gates)
    return gates


def clear_head_gates(model: nn.Module) -> None:
    """Empties every layer's ``head_gate`` slot (all heads open, no rescale)."""
    for layer in attention_layers(model):
        layer.head_gate = None


def gate_masks(model: nn.Module) -> List[torch.Tensor]:
    """Per layer, the deterministic 0/1 mask ``[H]`` (float32, CPU) of the gate in place:
    a :class:`HeadGate`'s open heads (``pi > 0`` for BinConcrete; a nonzero test-time gate
    for Hard-Concrete), a :class:`HeadMask`'s mask, all ones without a gate."""
    from .nn.head_gate import HeadGate

    masks = []
    for layer in _layers_or_raise(model, "gate_masks"):
        gate = layer.head_gate
        if gate is None:
            masks.append(torch.ones(head_counts(layer)[0]))
        elif isinstance(gate, HeadGate):
            masks.append(gate.open_heads().to(torch.float32).cpu())
        elif isinstance(gate, HeadMask):
            masks.append(gate.mask.detach().cpu().clone())
        else:
            raise TypeError(f"headwise.gate_masks: cannot read a deterministic mask from a {type(gate).__name__}")
    return masks


@contextlib.contextmanager
def stats_sinks(layers: Sequence[nn.Module], sinks: Sequence[Callable]) -> Iterator[None]:
    """Sets ``layers[i].head_stats_sink = sinks[i]`` inside the block, restores after."""
    previous = [getattr(layer, "head_stats_sink", None) for layer in layers]
    try:
        for layer, sink in zip(layers, sinks):
            layer.head_stats_sink = sink
        yield
    finally:
        for layer, sink in zip(layers, previous):
            layer.head_stats_sink = sink
