"""The packed layout of a fused Q/K/V projection (SPEC section 2).

A fused QKV weight is one ``[N_total, D_model]`` matrix (nn.Linear orientation) whose
rows are the output features of the Q, K and V projections, packed in some order. Shape
alone cannot say which rows are which: two layouts with equal Q and K widths give the
same shapes with the roles swapped. :class:`QKVLayout` is the explicit, immutable
contract: it derives every half-open span of the packed axis from the head counts,
widths, role order and interleaving, and the kernels read the packed rows only through
the per-head row offsets it derives (:meth:`QKVLayout.head_offsets`).

:class:`QKVManifest` adds the identity that shapes cannot carry: fingerprints of each
role's weights taken from the role-named source tensors (a checkpoint's ``q_proj`` /
``k_proj`` / ``v_proj``), so that a fused weight whose Q and K spans were swapped is
rejected by :meth:`QKVLayout.validate` even though every shape is right.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Tuple

import torch

__all__ = [
    "QKVLayout",
    "QKVManifest",
    "from_multihead_attention",
    "from_hf_attention",
]

ROLES = ("q", "k", "v")
INTERLEAVES = (None, "kv_group")
Span = Tuple[int, int]


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"headwise.QKVLayout: {name} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True)
class QKVLayout:
    """Immutable description of a packed Q/K/V projection.

    ``num_q_heads`` query heads and ``num_kv_heads`` key/value heads (``num_kv_heads``
    must divide ``num_q_heads``: MHA, GQA, MQA), Q/K head width ``head_dim``, value head
    width ``v_head_dim`` (default ``head_dim``). ``order`` is any permutation of
    ``("q", "k", "v")``: the order of the role blocks on the packed axis.
    ``interleave="kv_group"`` packs per KV group instead: for each group g, its
    ``num_q_heads // num_kv_heads`` query heads, then its K head, then its V head (the
    layout of several checkpoint families); ``order`` must then be the default.

    Inside a role block, heads are consecutive and each head's rows are consecutive.
    """

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: Optional[int] = None
    order: Tuple[str, ...] = ROLES
    interleave: Optional[str] = None
    _offsets: Tuple[int, ...] = field(init=False, repr=False, compare=False)
    _offset_cache: Dict[Tuple[str, ...], Tuple[int, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        _positive_int(self.num_q_heads, "num_q_heads")
        _positive_int(self.num_kv_heads, "num_kv_heads")
        _positive_int(self.head_dim, "head_dim")
        v = self.head_dim if self.v_head_dim is None else self.v_head_dim
        _positive_int(v, "v_head_dim")
        object.__setattr__(self, "v_head_dim", v)
        if self.num_q_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"headwise.QKVLayout: num_kv_heads ({self.num_kv_heads}) must divide num_q_heads "
                f"({self.num_q_heads}) (each KV head serves an equal group of query heads)"
            )
        try:
            order = tuple(self.order)
        except TypeError:
            order = None
        if order is None or sorted(order) != sorted(ROLES):
            raise ValueError(
                f"headwise.QKVLayout: order must be a permutation of ('q', 'k', 'v'), got {self.order!r}"
            )
        object.__setattr__(self, "order", order)
        if self.interleave not in INTERLEAVES:
            raise ValueError(
                f"headwise.QKVLayout: interleave must be None or 'kv_group', got {self.interleave!r}"
            )
        if self.interleave == "kv_group" and order != ROLES:
            raise ValueError(
                "headwise.QKVLayout: order must be ('q', 'k', 'v') with interleave='kv_group' "
                f"(each group holds its query heads, then K, then V), got {order!r}"
            )
        object.__setattr__(self, "_offsets", tuple(self._derive_offsets()))
        # The role sets the ops use, derived once (plain attribute reads under torch.compile).
        object.__setattr__(
            self, "_offset_cache", {r: self._head_offsets(r) for r in (ROLES, ("q",), ("k", "v"))}
        )

    # -- derived geometry -------------------------------------------------------------

    def num_heads(self, role: str) -> int:
        return self.num_q_heads if role == "q" else self.num_kv_heads

    def width(self, role: str) -> int:
        """Rows per head of ``role``."""
        return self.v_head_dim if role == "v" else self.head_dim

    def role_rows(self, role: str) -> int:
        return self.num_heads(role) * self.width(role)

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def num_rows(self) -> int:
        """N_total: rows of the fused weight (the projection's output features)."""
        return sum(self.role_rows(r) for r in ROLES)

    out_features = num_rows

    def _derive_offsets(self):
        offsets = {r: [] for r in ROLES}
        if self.interleave == "kv_group":
            pos = 0
            group = self.group_size * self.head_dim + self.head_dim + self.v_head_dim
            for g in range(self.num_kv_heads):
                base = g * group
                for i in range(self.group_size):
                    offsets["q"].append(base + i * self.head_dim)
                offsets["k"].append(base + self.group_size * self.head_dim)
                offsets["v"].append(base + self.group_size * self.head_dim + self.head_dim)
                pos = base + group
            assert pos == self.num_rows
        else:
            pos = 0
            for role in self.order:
                for h in range(self.num_heads(role)):
                    offsets[role].append(pos + h * self.width(role))
                pos += self.role_rows(role)
        return offsets["q"] + offsets["k"] + offsets["v"]

    def head_offsets(self, roles: Sequence[str] = ROLES) -> Tuple[int, ...]:
        """First packed row of every head of ``roles`` (q heads, then k heads, then v
        heads, each in head order), in a weight that holds only those roles' rows in the
        layout's packing order. This is what the kernels read (``head_offsets``)."""
        roles = tuple(roles)
        cached = self._offset_cache.get(roles)
        if cached is not None:
            return cached
        return self._head_offsets(roles)

    def _head_offsets(self, roles: Tuple[str, ...]) -> Tuple[int, ...]:
        if any(r not in ROLES for r in roles) or len(set(roles)) != len(roles):
            raise ValueError(f"headwise.QKVLayout: roles must be distinct names from ('q', 'k', 'v'), got {roles!r}")
        keep = self.rows(roles)
        new_index = {old: new for new, old in enumerate(keep)}
        out = []
        for role in ROLES:
            if role in roles:
                out += [new_index[o] for o in self._role_offsets(role)]
        return tuple(out)

    def _role_offsets(self, role: str) -> Tuple[int, ...]:
        hq, hkv = self.num_q_heads, self.num_kv_heads
        start = {"q": 0, "k": hq, "v": hq + hkv}[role]
        return self._offsets[start : start + self.num_heads(role)]

    def rows(self, roles: Sequence[str] = ROLES) -> Tuple[int, ...]:
        """Packed row indices of ``roles``, in packing order."""
        marks = []
        for role in roles:
            w = self.width(role)
            for o in self._role_offsets(role):
                marks += range(o, o + w)
        return tuple(sorted(marks))

    @property
    def row_index(self) -> torch.Tensor:
        """``int64 [N_total]``: canonical row i (all Q heads, then all K heads, then all
        V heads, head-major) lives at packed row ``row_index[i]``."""
        idx = []
        for role in ROLES:
            w = self.width(role)
            for o in self._role_offsets(role):
                idx += range(o, o + w)
        return torch.tensor(idx, dtype=torch.int64)

    @property
    def is_contiguous(self) -> bool:
        """True when each role occupies one contiguous span."""
        return self.interleave is None or self.num_kv_heads == 1

    @property
    def spans(self) -> Dict[str, object]:
        """Half-open spans of the packed axis per role, e.g. ``{"q": (0, 512), "k":
        (512, 1024), "v": (1024, 1408)}``. For ``interleave="kv_group"`` each role is a
        tuple of spans, one per KV group (use :meth:`head_spans` for one per head)."""
        if self.is_contiguous:
            out = {}
            for role in ROLES:
                offs = self._role_offsets(role)
                out[role] = (offs[0], offs[0] + self.role_rows(role))
            return out
        out = {}
        gs = self.group_size
        for role in ROLES:
            offs = self._role_offsets(role)
            w = self.width(role)
            if role == "q":
                out[role] = tuple((offs[g * gs], offs[g * gs] + gs * w) for g in range(self.num_kv_heads))
            else:
                out[role] = tuple((o, o + w) for o in offs)
        return out

    def head_spans(self) -> Dict[str, Tuple[Span, ...]]:
        """Half-open span of every head, per role."""
        return {r: tuple((o, o + self.width(r)) for o in self._role_offsets(r)) for r in ROLES}

    @property
    def fingerprint(self) -> str:
        """A stable string naming this layout (stored in a :class:`QKVManifest`)."""
        return (
            f"qkv-layout/v1 hq={self.num_q_heads} hkv={self.num_kv_heads} d={self.head_dim} "
            f"dv={self.v_head_dim} order={','.join(self.order)} interleave={self.interleave}"
        )

    # -- storage conversion -----------------------------------------------------------

    def _check_weight(self, weight: torch.Tensor, name: str = "weight") -> None:
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            got = f"shape {list(weight.shape)}" if isinstance(weight, torch.Tensor) else type(weight).__name__
            raise ValueError(f"headwise.QKVLayout: {name} must be a 2-D [N_total, D_model] tensor, got {got}")
        if weight.shape[0] != self.num_rows:
            raise ValueError(
                f"headwise.QKVLayout: {name} has {weight.shape[0]} rows but the layout packs "
                f"{self.num_rows} (q {self.role_rows('q')} + k {self.role_rows('k')} + v {self.role_rows('v')}: "
                f"{self.num_q_heads} q heads and {self.num_kv_heads} kv heads of width {self.head_dim}, "
                f"v width {self.v_head_dim})"
            )

    def _check_bias(self, bias: Optional[torch.Tensor], name: str = "bias") -> None:
        if bias is not None and (bias.dim() != 1 or bias.shape[0] != self.num_rows):
            raise ValueError(
                f"headwise.QKVLayout: {name} must be [N_total] = [{self.num_rows}], got shape {list(bias.shape)}"
            )

    def fuse(self, q_w, k_w, v_w, q_b=None, k_b=None, v_b=None):
        """Packs separate ``[H*D, D_model]`` projection weights (and optional biases)
        into ``(weight [N_total, D_model], bias [N_total] or None)``; the exact inverse of
        :meth:`split`. Biases are all given or all omitted."""
        ws = {"q": q_w, "k": k_w, "v": v_w}
        bs = {"q": q_b, "k": k_b, "v": v_b}
        have_bias = [b is not None for b in bs.values()]
        if any(have_bias) and not all(have_bias):
            raise ValueError("headwise.QKVLayout.fuse: give all of q_b, k_b, v_b or none of them")
        d_model = q_w.shape[-1] if q_w.dim() == 2 else None
        for role in ROLES:
            w = ws[role]
            if w.dim() != 2 or w.shape[0] != self.role_rows(role) or w.shape[1] != d_model:
                raise ValueError(
                    f"headwise.QKVLayout.fuse: {role}_w must be [{self.role_rows(role)}, {d_model}] "
                    f"({self.num_heads(role)} heads of width {self.width(role)}), got shape {list(w.shape)}"
                )
            if w.dtype != q_w.dtype or w.device != q_w.device:
                raise ValueError(f"headwise.QKVLayout.fuse: {role}_w must match q_w's dtype and device")
            b = bs[role]
            if b is not None and (b.dim() != 1 or b.shape[0] != self.role_rows(role)):
                raise ValueError(
                    f"headwise.QKVLayout.fuse: {role}_b must be [{self.role_rows(role)}], got shape {list(b.shape)}"
                )
        canonical_w = torch.cat([ws[r] for r in ROLES], dim=0)
        weight = torch.empty_like(canonical_w)
        weight[self.row_index.to(weight.device)] = canonical_w
        bias = None
        if all(have_bias):
            canonical_b = torch.cat([bs[r] for r in ROLES], dim=0)
            bias = torch.empty_like(canonical_b)
            bias[self.row_index.to(bias.device)] = canonical_b
        return weight, bias

    def split(self, weight, bias=None):
        """``((q_w, q_b), (k_w, k_b), (v_w, v_b))``: the separate projections of a fused
        weight (biases None without ``bias``); the exact inverse of :meth:`fuse`."""
        self._check_weight(weight)
        self._check_bias(bias)
        idx = self.row_index.to(weight.device)
        cw = weight.index_select(0, idx)
        cb = bias.index_select(0, idx.to(bias.device)) if bias is not None else None
        out, start = [], 0
        for role in ROLES:
            n = self.role_rows(role)
            out.append((cw[start : start + n], cb[start : start + n] if cb is not None else None))
            start += n
        return tuple(out)

    # -- manifest ---------------------------------------------------------------------

    def manifest(self, weight, bias=None) -> "QKVManifest":
        """The manifest of a fused weight known to be packed by this layout."""
        (qw, qb), (kw, kb), (vw, vb) = self.split(weight, bias)
        return QKVManifest.from_separate(self, qw, kw, vw, qb, kb, vb)

    def validate(self, weight, bias=None, manifest: Optional["QKVManifest"] = None) -> None:
        """Checks that ``weight`` (and ``bias``) fit this layout, and with a
        ``manifest`` that each span holds the projection the manifest names for it.
        Raises ValueError naming what disagrees, e.g. a swapped Q/K span of equal width
        (``fused role order mismatch``), which no shape check can see."""
        self._check_weight(weight)
        self._check_bias(bias)
        if manifest is None:
            return
        if manifest.layout != self:
            raise ValueError(
                "headwise.QKVLayout.validate: layout mismatch: the manifest was written for "
                f"[{manifest.layout.fingerprint}] but this layout is [{self.fingerprint}]; convert "
                "the checkpoint explicitly instead of reinterpreting its spans"
            )
        if weight.shape[1] != manifest.d_model:
            raise ValueError(
                f"headwise.QKVLayout.validate: weight has D_model {weight.shape[1]}, the manifest {manifest.d_model}"
            )
        (qw, qb), (kw, kb), (vw, vb) = self.split(weight, bias)
        got = {"q": (qw, qb), "k": (kw, kb), "v": (vw, vb)}
        if (bias is None) != (manifest.bias_fingerprints is None):
            raise ValueError(
                "headwise.QKVLayout.validate: bias "
                + ("is missing but the manifest records biases" if bias is None else "is given but the manifest records none")
            )
        by_print = {fp: r for r, fp in manifest.weight_fingerprints.items()}
        for role in ROLES:
            fp = _fingerprint(got[role][0])
            if fp != manifest.weight_fingerprints[role]:
                other = by_print.get(fp)
                if other is not None:
                    raise ValueError(
                        f"headwise.QKVLayout.validate: fused role order mismatch: the {role} span of weight "
                        f"{self.spans[role]} holds the manifest's {other} projection"
                    )
                raise ValueError(
                    f"headwise.QKVLayout.validate: the {role} span of weight {self.spans[role]} does not hold the "
                    f"manifest's {role} projection (wrong checkpoint, or rows modified)"
                )
            if bias is not None and _fingerprint(got[role][1]) != manifest.bias_fingerprints[role]:
                raise ValueError(
                    f"headwise.QKVLayout.validate: the {role} span of bias does not hold the manifest's {role} bias"
                )


def _fingerprint(t: torch.Tensor) -> str:
    t = t.detach().contiguous().cpu()
    h = hashlib.sha256()
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:32]


@dataclass(frozen=True)
class QKVManifest:
    """Identity of a fused QKV checkpoint: its layout plus a fingerprint (SHA-256 of
    the bytes) of each role's weight and bias, taken from role-named tensors. Stored
    beside a fused weight, it lets :meth:`QKVLayout.validate` reject a weight whose
    spans hold the wrong roles even when every shape agrees."""

    layout: QKVLayout
    d_model: int
    dtype: str
    weight_fingerprints: Dict[str, str]
    bias_fingerprints: Optional[Dict[str, str]]

    @staticmethod
    def from_separate(layout: QKVLayout, q_w, k_w, v_w, q_b=None, k_b=None, v_b=None) -> "QKVManifest":
        ws, bs = {"q": q_w, "k": k_w, "v": v_w}, {"q": q_b, "k": k_b, "v": v_b}
        for role in ROLES:
            if ws[role].shape[0] != layout.role_rows(role):
                raise ValueError(
                    f"headwise.QKVManifest: {role}_w has {ws[role].shape[0]} rows, the layout's {role} "
                    f"span has {layout.role_rows(role)}"
                )
        biases = None if q_b is None else {r: _fingerprint(bs[r]) for r in ROLES}
        return QKVManifest(
            layout=layout,
            d_model=int(q_w.shape[1]),
            dtype=str(q_w.dtype),
            weight_fingerprints={r: _fingerprint(ws[r]) for r in ROLES},
            bias_fingerprints=biases,
        )


# -- converters ----------------------------------------------------------------------


def from_multihead_attention(mha: torch.nn.MultiheadAttention):
    """``(layout, weight, bias)`` of an ``nn.MultiheadAttention``'s packed input
    projection (``in_proj_weight [3E, E]`` with Q, K, V rows in that order, and
    ``in_proj_bias`` or None).

    Semantics to keep in mind: nn.MultiheadAttention projects query, key and value
    inputs separately (for self-attention they are the same tensor, which is what
    ``qkv_project`` computes), and scales the attention logits by ``head_dim ** -0.5``
    inside attention; pass ``scale_q=layout.head_dim ** -0.5`` to fold that scale into
    the projection and then attend with ``scale=1``. ``bias_k``/``bias_v``
    (``add_bias_kv``) and separate kdim/vdim projections are not a fused QKV layout and
    are rejected.
    """
    if not isinstance(mha, torch.nn.MultiheadAttention):
        raise ValueError(f"headwise.from_multihead_attention: mha must be nn.MultiheadAttention, got {type(mha).__name__}")
    if not mha._qkv_same_embed_dim or mha.in_proj_weight is None:
        raise ValueError(
            "headwise.from_multihead_attention: mha has separate kdim/vdim projections (no in_proj_weight); "
            "use q_project / kv_project with its q_proj_weight, k_proj_weight and v_proj_weight"
        )
    if mha.bias_k is not None:
        raise ValueError("headwise.from_multihead_attention: add_bias_kv=True is not a QKV projection")
    h = mha.num_heads
    layout = QKVLayout(h, h, mha.head_dim)
    bias = mha.in_proj_bias.detach() if mha.in_proj_bias is not None else None
    return layout, mha.in_proj_weight.detach(), bias


def _from_neox_attention(attn):
    qkv = attn.query_key_value
    heads = attn.config.num_attention_heads
    head_size = getattr(attn, "head_size", None) or attn.config.hidden_size // heads
    # query_key_value's output viewed as [..., H, 3 * head_size] and chunked in 3: per head
    # its q rows, then k, then v, i.e. the kv_group packing with one query head per group.
    layout = QKVLayout(heads, heads, head_size, interleave="kv_group")
    if qkv.weight.shape[0] != layout.num_rows:
        raise ValueError(f"headwise.from_hf_attention: query_key_value has {qkv.weight.shape[0]} rows, "
                         f"{heads} heads of width {head_size} need {layout.num_rows}")
    bias = qkv.bias.detach() if qkv.bias is not None else None
    return layout, qkv.weight.detach(), bias, None


def from_hf_attention(attn):
    """``(layout, weight, bias, norms)`` of a Hugging Face attention module.

    Llama- or Qwen3-style modules (``q_proj``, ``k_proj``, ``v_proj`` nn.Linear,
    ``head_dim`` and the config's head counts): the fused weight packs Q, K, V in that
    order; ``norms`` is None (Llama) or ``(q_norm_weight, k_norm_weight, eps)`` for
    Qwen3's per-head qk-norm.

    GPT-NeoX-style modules (GPT-NeoX, Pythia: a packed ``query_key_value`` nn.Linear
    whose rows hold, per head, its q, k and v rows): the packed weight is returned as is
    (not copied) with the ``kv_group`` layout ``QKVLayout(H, H, head_size,
    interleave="kv_group")``; ``norms`` is None. Their rotary embedding covers the
    leading ``rotary_ndims = head_size * rotary_pct`` dims: its ``[S or B, S, rotary_ndims]``
    tables passed as ``rope`` make qkv_project apply the same partial rotary.

    ``bias`` is None when the projections have none. The attention's own ``scaling``
    (``head_dim ** -0.5``) can be passed as ``scale_q``."""
    if isinstance(getattr(attn, "query_key_value", None), torch.nn.Linear):
        return _from_neox_attention(attn)
    for name in ("q_proj", "k_proj", "v_proj"):
        if not isinstance(getattr(attn, name, None), torch.nn.Linear):
            raise ValueError(f"headwise.from_hf_attention: attn has no nn.Linear {name}")
    cfg = attn.config
    hq = cfg.num_attention_heads
    hkv = getattr(cfg, "num_key_value_heads", None) or hq
    head_dim = getattr(attn, "head_dim", None) or cfg.hidden_size // hq
    layout = QKVLayout(hq, hkv, head_dim)
    q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
    biases = (q.bias, k.bias, v.bias)
    if any(b is not None for b in biases) and not all(b is not None for b in biases):
        raise ValueError("headwise.from_hf_attention: either all or none of q_proj, k_proj, v_proj have a bias")
    with torch.no_grad():
        weight, bias = layout.fuse(
            q.weight, k.weight, v.weight, *(b for b in biases) if biases[0] is not None else (None, None, None)
        )
    norms = None
    if getattr(attn, "q_norm", None) is not None and getattr(attn, "k_norm", None) is not None:
        eps = getattr(attn.q_norm, "variance_epsilon", None) or getattr(attn.q_norm, "eps", 1e-6)
        norms = (attn.q_norm.weight.detach(), attn.k_norm.weight.detach(), float(eps))
    return layout, weight, bias, norms
