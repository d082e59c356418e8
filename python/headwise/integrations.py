"""Run Hugging Face attention layers through headwise (SPEC section 8).

``patch_hf_attention(model)`` makes every supported attention module of a
``transformers`` model (Llama, Qwen3 and the other ``*Attention`` classes with the same
q_proj / k_proj / v_proj / o_proj layout, optional q_norm / k_norm) compute

    q, k, v = headwise.qkv_project(x, [W_q; W_k; W_v], [b_q; b_k; b_v], q/k norm, rope)
    z       = the model's own attention function (sdpa, eager, ...) on q, k, v
    out     = headwise.head_merge(z viewed as [B, H, S, D], W_o, b_o)

instead of three linears, views, transposes, the norms, the rotary embedding and a
contiguous copy before o_proj. The module keeps its parameters and state-dict keys (the
fused weight is the concatenation of q_proj, k_proj and v_proj, formed per call, so
optimizers, checkpoints and tied/frozen parameters are unaffected); masks, caches,
sliding windows and the attention implementation are the model's own. Outputs and
gradients equal the unpatched model's up to fp32 rounding order (tested on tiny random
Llama and Qwen3 models built from configs). ``unpatch_hf_attention(model)`` restores
the original forwards.

Head gates and statistics: every patched module gets the ``head_gate`` and
``head_stats_sink`` slots of :mod:`headwise.head_gating` (learned
:class:`headwise.nn.HeadGate`s, hard masks, score collection), and
:func:`headwise.prune_model_heads` prunes its heads physically (the module's head counts
then come from its layout and ``num_key_value_groups``, not from the shared config).

GPT-NeoX-style modules (``query_key_value`` packed per head as q, k, v: the
``kv_group`` layout, ``dense`` output projection, partial rotary of ``rotary_ndims``
dims) are patched the same way, with the packed weight used as is.

Rotary tables: HF's ``position_embeddings`` are ``[B, S, R]``; one shared by the batch
(``position_ids`` of batch 1) is passed to the kernel as ``[S, R]``, per-row tables
(left-padded batched generation, packed documents) as they are. ``R`` below the head
width is partial rotary (the leading ``R`` dims rotate). Attention dropout runs inside
the model's attention function, as before.
"""

from __future__ import annotations

import sys
import types
from typing import Optional

import torch
from torch import nn

from .head_gating import GATED_ATTENTION, merge_heads
from .ops import DEFAULT_OPS, Ops
from .qkv_layout import QKVLayout

__all__ = ["patch_hf_attention", "unpatch_hf_attention"]

_ORIGINAL = "_headwise_original_forward"


def _is_supported(module: nn.Module) -> bool:
    return (type(module).__name__.endswith("Attention")
            and all(isinstance(getattr(module, n, None), nn.Linear) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
            and hasattr(module, "head_dim") and hasattr(module, "config"))


def _is_neox(module: nn.Module) -> bool:
    """A GPT-NeoX-style attention: packed ``query_key_value`` (per head q, k, v) and ``dense``."""
    return (type(module).__name__.endswith("Attention")
            and all(isinstance(getattr(module, n, None), nn.Linear) for n in ("query_key_value", "dense"))
            and hasattr(module, "head_size") and hasattr(module, "config"))


def _rope_table(t: torch.Tensor) -> torch.Tensor:
    """HF's rotary table ``[B, S, R]`` as qkv_project takes it: ``[S, R]`` when one row
    serves the batch (position_ids of batch 1), else per row ``[B, S, R]``."""
    return t[0] if t.dim() == 3 and t.shape[0] == 1 else t


def _headwise_attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                                cache=None, past_key_values=None, **kwargs):
    ops: Ops = self._headwise_ops
    layout: QKVLayout = self._headwise_layout
    weight = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
    bias = None
    if self.q_proj.bias is not None:
        bias = torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias])
    q_norm = getattr(self, "q_norm", None)
    k_norm = getattr(self, "k_norm", None)
    eps = getattr(q_norm if q_norm is not None else k_norm, "variance_epsilon", 1e-6)
    rope = None
    if position_embeddings is not None:
        cos, sin = position_embeddings
        rope = (_rope_table(cos), _rope_table(sin))
    q, k, v = ops.qkv_project(hidden_states, weight, bias, layout=layout,
                              q_norm=None if q_norm is None else q_norm.weight,
                              k_norm=None if k_norm is None else k_norm.weight, norm_eps=eps, rope=rope)
    cache = cache if cache is not None else past_key_values
    if cache is not None:
        k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
    modeling = sys.modules[type(self).__module__]
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                      modeling.eager_attention_forward)
    if getattr(self, "sliding_window", None) is not None:
        kwargs.setdefault("sliding_window", self.sliding_window)
    attn_output, attn_weights = attention(
        self, q, k, v, attention_mask, dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling, **kwargs)
    # attn_output [B, S, H, D]: its transpose is the [B, H, S, D] z that head_merge reads in place.
    out = merge_heads(self, ops.head_merge, attn_output.transpose(1, 2), self.o_proj.weight, self.o_proj.bias)
    return out, attn_weights


def _headwise_neox_attention_forward(self, hidden_states, attention_mask=None, layer_past=None,
                                     position_embeddings=None, **kwargs):
    ops: Ops = self._headwise_ops
    layout: QKVLayout = self._headwise_layout
    rope = None
    if position_embeddings is not None:
        cos, sin = position_embeddings
        rope = (_rope_table(cos), _rope_table(sin))
    qkv = self.query_key_value
    q, k, v = ops.qkv_project(hidden_states, qkv.weight, qkv.bias, layout=layout, rope=rope)
    if layer_past is not None:
        k, v = layer_past.update(k, v, self.layer_idx)
    modeling = sys.modules[type(self).__module__]
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                      modeling.eager_attention_forward)
    attn_output, attn_weights = attention(
        self, q, k, v, attention_mask, scaling=self.scaling,
        dropout=0.0 if not self.training else self.attention_dropout, **kwargs)
    out = merge_heads(self, ops.head_merge, attn_output.transpose(1, 2), self.dense.weight, self.dense.bias)
    return out, attn_weights


def patch_hf_attention(model: nn.Module, *, ops: Optional[Ops] = None) -> int:
    """Route every supported attention module of ``model`` through headwise; returns how
    many were patched. ``ops`` binds a backend (``headwise.testing.backend(...)``)."""
    count = 0
    for module in model.modules():
        if hasattr(module, _ORIGINAL):
            continue
        if _is_neox(module):
            heads = module.config.num_attention_heads
            module._headwise_layout = QKVLayout(heads, heads, module.head_size, interleave="kv_group")
            forward = _headwise_neox_attention_forward
        elif _is_supported(module):
            cfg = module.config
            heads = cfg.num_attention_heads
            kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
            module._headwise_layout = QKVLayout(heads, kv_heads, module.head_dim)
            forward = _headwise_attention_forward
        else:
            continue
        module._headwise_ops = ops or DEFAULT_OPS
        module.head_gate = None
        module.head_stats_sink = None
        setattr(module, GATED_ATTENTION, True)
        setattr(module, _ORIGINAL, module.forward)
        module.forward = types.MethodType(forward, module)
        count += 1
    return count


def unpatch_hf_attention(model: nn.Module) -> int:
    """Undo :func:`patch_hf_attention`; returns how many modules were restored."""
    count = 0
    for module in model.modules():
        if hasattr(module, _ORIGINAL):
            module.forward = getattr(module, _ORIGINAL)
            for name in (_ORIGINAL, "_headwise_layout", "_headwise_ops", "head_gate", "head_stats_sink",
                         GATED_ATTENTION):
                delattr(module, name)
            count += 1
    return count
