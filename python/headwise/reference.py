"""Eager PyTorch oracles: the single source of truth for tests and benchmarks.

Every fused op of headwise is checked against, and timed beside, the function of the
same name here. These functions use only differentiable ``torch`` operations, so their
autograd is the reference backward. They are written for clarity, not speed.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = [
    "apply_rope",
    "dcmha_attention",
    "dcmha_attention_query_chunks",
    "dcmha_attention_rows",
    "dcmha_compose",
    "dcmha_mask",
    "dcmha_weights",
    "head_merge",
    "head_merge_coefficients",
    "head_merge_stats",
    "kv_project",
    "mhar_route",
    "mhar_route_weights",
    "q_project",
    "qkv_project",
    "rms_norm_heads",
]


def _accumulation_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for fp32 and narrower floats, fp64 for fp64 (so float64 runs are ground truth)."""
    return torch.promote_types(x.dtype, torch.float32)


def _mhar_logits(
    sources: torch.Tensor,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    num_heads: int,
    eps: float,
) -> torch.Tensor:
    """Per-head routing logits ``l[n, b, t, h]`` (fp32; fp64 for fp64 sources), SPEC section 4.

    ``sources [N, B, T, d]``; ``r_n = rsqrt(mean_j s_n[j]^2 + eps)`` over the full row in
    fp32; the normalized key is rounded to the storage dtype (where Hugging Face's
    RMSNorm rounds), then scaled by ``g`` in fp32; ``l = <q_h, khat_h>`` with no
    1/sqrt scale.
    """
    n, b, t, d = sources.shape
    acc = _accumulation_dtype(sources)
    s = sources.to(acc)
    r = torch.rsqrt(s.pow(2).mean(dim=-1, keepdim=True) + eps)
    khat = (s * r).to(sources.dtype).to(acc) * norm_weight.to(acc)
    prod = khat * query.to(acc)
    return prod.view(n, b, t, num_heads, d // num_heads).sum(dim=-1)


def mhar_route_weights(
    sources: torch.Tensor,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    num_heads: int,
    num_sources: Optional[int] = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Routing weights ``w [N, B, T, H]`` (fp32; fp64 for fp64 sources): softmax over sources."""
    n_read = sources.shape[0] if num_sources is None else num_sources
    logits = _mhar_logits(sources[:n_read], query, norm_weight, num_heads, eps)
    return torch.softmax(logits, dim=0)


def mhar_route(
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
    """MHAR depth routing (SPEC section 4).

    ``sources [N_max, B, T, d]`` (rows ``[0, num_sources)`` are read), ``query [d]``,
    ``norm_weight [d]``. Returns ``mix[b, t, h-slice] = sum_n w[n, b, t, h] *
    s_n[b, t, h-slice]``, times the one-element ``gate`` and plus ``residual [B, T, d]``
    when given (``residual + gate * mix``), accumulated in fp32 (fp64 for fp64
    sources) and returned in the sources' dtype.
    """
    n_read = sources.shape[0] if num_sources is None else num_sources
    src = sources[:n_read]
    n, b, t, d = src.shape
    w = mhar_route_weights(src, query, norm_weight, num_heads=num_heads, eps=eps)
    values = src.to(w.dtype).view(n, b, t, num_heads, d // num_heads)
    out = (w.unsqueeze(-1) * values).sum(dim=0).reshape(b, t, d)
    if gate is not None:
        out = out * gate.to(w.dtype).reshape(())
    if residual is not None:
        out = out + residual.to(w.dtype)
    return out.to(sources.dtype)


# -- fused QKV projection (SPEC section 2) ---------------------------------------------


def rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head RMSNorm over the last dim, Hugging Face Qwen3RMSNorm rounding: the
    statistic and the normalization in fp32 (fp64 for fp64), the normalized value cast
    to the input dtype, then multiplied by ``weight``."""
    acc = _accumulation_dtype(x)
    h = x.to(acc)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_interleaved(x: torch.Tensor) -> torch.Tensor:
    """GPT-J's rotate_every_two: pairs (2p, 2p + 1) -> (-x[2p + 1], x[2p])."""
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str = "rotate_half") -> torch.Tensor:
    """Rotary embedding ``x[..., :R] * cos + rotate(x[..., :R]) * sin`` on ``x [B, H, S, D]``
    with ``cos``/``sin`` ``[S, R]`` (broadcast over the batch) or ``[B, S, R]`` (per batch
    row); ``R <= D``, the dims from ``R`` on pass through (partial rotary). ``style``:
    ``"rotate_half"`` (Llama: ``cat(-x2, x1)`` of the halves) or ``"interleaved"``
    (GPT-J's rotate_every_two)."""
    if style not in ("rotate_half", "interleaved"):
        raise ValueError(f"headwise.reference.apply_rope: unknown style {style!r}")
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    turn = _rotate_half if style == "rotate_half" else _rotate_interleaved
    return torch.cat((rot * cos + turn(rot) * sin, rest), dim=-1)


def _split_packed(y: torch.Tensor, layout, roles):
    """The per-role slices of a packed projection ``y [B, S, rows]`` whose rows hold
    ``roles`` in the layout's packing order: linear -> split (slices for contiguous
    layouts, a row gather for interleaved ones) -> view -> transpose."""
    b, s, _ = y.shape
    offsets = layout.head_offsets(roles)
    out, i = {}, 0
    for role in ("q", "k", "v"):
        if role not in roles:
            continue
        n, w = layout.num_heads(role), layout.width(role)
        offs = offsets[i : i + n]
        i += n
        if all(offs[h] == offs[0] + h * w for h in range(n)):  # one contiguous span
            part = y[..., offs[0] : offs[0] + n * w]
        else:
            idx = torch.tensor([o + j for o in offs for j in range(w)], device=y.device)
            part = y.index_select(-1, idx)
        out[role] = part.view(b, s, n, w).transpose(1, 2)
    return out


def _epilogue(parts, x_dtype, *, q_norm, k_norm, norm_eps, rope, scale_q, rope_style="rotate_half"):
    acc = torch.float64 if x_dtype == torch.float64 else torch.float32
    outs = {}
    for role, t in parts.items():
        if role == "q" and q_norm is not None:
            t = rms_norm_heads(t, q_norm, norm_eps)
        if role == "k" and k_norm is not None:
            t = rms_norm_heads(t, k_norm, norm_eps)
        if role in ("q", "k") and rope is not None:
            cos, sin = rope
            t = apply_rope(t.to(acc), cos.to(acc), sin.to(acc), rope_style)
        if role == "q" and scale_q is not None:
            t = t * scale_q
        outs[role] = t.to(x_dtype).contiguous()
    return outs


def qkv_project(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    layout,
    q_norm: Optional[torch.Tensor] = None,
    k_norm: Optional[torch.Tensor] = None,
    norm_eps: float = 1e-6,
    rope=None,
    scale_q: Optional[float] = None,
    rope_style: str = "rotate_half",
):
    """Fused QKV projection, eager (SPEC section 2): ``F.linear`` -> split by the
    layout's spans -> view -> transpose -> per-head q/k RMSNorm (Qwen3 rounding) ->
    RoPE on q and k (in fp32; :func:`apply_rope`: ``[S, R]`` or ``[B, S, R]`` tables,
    partial when ``R < D``, ``rope_style`` rotate_half or interleaved) -> ``scale_q`` on
    q -> contiguous. Returns head-major ``q [B, Hq, S, D]``, ``k [B, Hkv, S, D]``,
    ``v [B, Hkv, S, Dv]`` in x's dtype."""
    y = torch.nn.functional.linear(x, weight, bias)
    parts = _split_packed(y, layout, ("q", "k", "v"))
    o = _epilogue(parts, x.dtype, q_norm=q_norm, k_norm=k_norm, norm_eps=norm_eps, rope=rope, scale_q=scale_q,
                  rope_style=rope_style)
    return o["q"], o["k"], o["v"]


def q_project(x, weight, bias=None, *, layout, q_norm=None, norm_eps=1e-6, rope=None, scale_q=None,
              rope_style="rotate_half"):
    """The query side of a cross-attention projection: ``weight`` holds the layout's Q
    rows only. Returns ``q [B, Hq, S, D]``."""
    y = torch.nn.functional.linear(x, weight, bias)
    parts = _split_packed(y, layout, ("q",))
    return _epilogue(parts, x.dtype, q_norm=q_norm, k_norm=None, norm_eps=norm_eps, rope=rope, scale_q=scale_q,
                     rope_style=rope_style)["q"]


def kv_project(x, weight, bias=None, *, layout, k_norm=None, norm_eps=1e-6, rope=None, rope_style="rotate_half"):
    """The source side of a cross-attention projection: ``weight`` holds the layout's K
    and V rows in packing order. Returns ``k [B, Hkv, S, D]``, ``v [B, Hkv, S, Dv]``."""
    y = torch.nn.functional.linear(x, weight, bias)
    parts = _split_packed(y, layout, ("k", "v"))
    o = _epilogue(parts, x.dtype, q_norm=None, k_norm=k_norm, norm_eps=norm_eps, rope=rope, scale_q=None,
                  rope_style=rope_style)
    return o["k"], o["v"]
def head_merge_coefficients(
    head_gate: Optional[torch.Tensor], batch: int, heads: int, *, rescale: bool = False, dtype=torch.float32
) -> Optional[torch.Tensor]:
    """``alpha[b, h] = s[b] * g[b, h]`` of the head merge (SPEC section 3), ``[B, H]``, or
    None when there is no gate (``alpha = 1``; rescale is then ``H / H = 1``).

    ``s[b] = min(H, H / S[b])`` with ``S[b] = sum_h g[b, h]`` under ``rescale`` (Shim et
    al.'s Bernoulli-gate output scale, clipped so that an all-closed row is not a division
    by zero), else 1. Written as ``where(S > 1, H / max(S, 1), H)`` so that the gradient is
    finite everywhere: ``ds/dS = -H / S^2`` for ``S > 1`` and 0 where the clip holds.
    """
    if head_gate is None:
        return None
    g = head_gate.to(dtype).expand(batch, heads)
    if rescale:
        total = g.sum(dim=-1, keepdim=True)
        scale = torch.where(total > 1, heads / total.clamp(min=1), torch.full_like(total, float(heads)))
        g = g * scale
    return g


def head_merge(
    z: torch.Tensor,
    weight_o: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    head_gate: Optional[torch.Tensor] = None,
    rescale: bool = False,
    return_stats: bool = False,
):
    """Head merge with the W_O block sum (SPEC section 3), eagerly: the concatenation of
    the (gated, rescaled) heads followed by one projection.

    ``z [B, H, Q, Dv]``, ``weight_o [D, H*Dv]``, ``bias [D]``, ``head_gate`` ``[H]`` or
    ``[B, H]``. Returns ``y [B, Q, D] = sum_h alpha[b,h] Z[b,h] @ W_h^T + bias`` in z's
    dtype (accumulated in fp32, fp64 for fp64 z), and with ``return_stats`` also
    :func:`head_merge_stats` (explicit per-head products).
    """
    b, h, q, dv = z.shape
    acc = _accumulation_dtype(z)
    zz = z.to(acc)
    alpha = head_merge_coefficients(head_gate, b, h, rescale=rescale, dtype=acc)
    if alpha is not None:
        zz = zz * alpha[:, :, None, None]
    concat = zz.transpose(1, 2).reshape(b, q, h * dv)
    y = torch.nn.functional.linear(concat, weight_o.to(acc), None if bias is None else bias.to(acc)).to(z.dtype)
    if return_stats:
        return y, head_merge_stats(z, weight_o, head_gate=head_gate)
    return y


def head_merge_stats(z: torch.Tensor, weight_o: torch.Tensor, *, head_gate: Optional[torch.Tensor] = None):
    """Per-head statistics by explicit per-head products (materializes ``[B, Q, H, D]``):
    ``z_norm[b, q, h] = ||Z[b,h,q]||`` and ``out_norm[b, q, h] = ||Z[b,h,q] @ W_h^T||``,
    float32 ``[B, Q, H]``, ungated (neither the gate nor the rescale applied), and 0 for a
    head whose gate is exactly 0 for that batch row (a closed head does no work)."""
    from .ops import HeadMergeStats

    b, h, q, dv = z.shape
    acc = _accumulation_dtype(z)
    zz = z.to(acc)
    per_head = torch.einsum("bhqk,nhk->bqhn", zz, weight_o.to(acc).view(-1, h, dv))
    z_norm = zz.norm(dim=-1).transpose(1, 2)
    out_norm = per_head.norm(dim=-1)
    if head_gate is not None:
        open_ = (head_gate.expand(b, h) != 0).to(acc)[:, None, :]
        z_norm, out_norm = z_norm * open_, out_norm * open_
    return HeadMergeStats(z_norm.float(), out_norm.float())


# -- DCMHA: dynamically composable multi-head attention (SPEC section 5) ----------------


def dcmha_weights(x: torch.Tensor, dw1: torch.Tensor, qkw: torch.Tensor, dd: torch.Tensor):
    """The dynamic compose weights of every token: a :class:`headwise.DCMHAWeights`.

    ``x [B, T, D]`` (the attention input after its norm), ``dw1 [D, 4, Kh]``,
    ``qkw [4, Kh, 2R, H]``, ``dd [D, 4H]``::

        hid = gelu_erf(x @ dw1)                       # [B, T, 4, Kh]
        w   = einsum('btck,ckjh->btcjh', hid, qkw)    # [B, T, 4, 2R, H]
        W1  = w[..., :R, :] * rsqrt(mean_H W1^2 + 1e-6);  W2 = w[..., R:, :]
        G   = tanh(x @ dd).view(B, T, 4, H)

    Computed in fp32 (fp64 for fp64 inputs), returned in x's dtype.
    """
    from .dcmha import RANK, DCMHAWeights

    b, t, d = x.shape
    acc = _accumulation_dtype(x)
    xa = x.to(acc)
    hid = torch.nn.functional.gelu(torch.einsum("btd,dck->btck", xa, dw1.to(acc)))
    w = torch.einsum("btck,ckjh->btcjh", hid, qkw.to(acc))
    w1, w2 = w[..., :RANK, :], w[..., RANK:, :]
    w1 = w1 * torch.rsqrt(w1.pow(2).mean(dim=-1, keepdim=True) + 1e-6)
    g = torch.tanh(xa @ dd.to(acc)).view(b, t, 4, -1)
    return DCMHAWeights(w1.to(x.dtype), w2.to(x.dtype), g.to(x.dtype))


def _compose(a: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, g: torch.Tensor, cq: int, ck: int,
             head_groups: int, rows=None) -> torch.Tensor:
    """Compose of ``a [B, H, T, S]`` (already in the accumulation dtype) for slots (cq, ck),
    each group of H / head_groups heads composing only within itself::

        A'[m,t,s] = A[m,t,s] (1 + G[t,cq,m] + G[s,ck,m])
                  + sum_r W2[t,cq,r,m] sum_n A[n,t,s] W1[t,cq,r,n]
                  + sum_r W2[s,ck,r,m] sum_n A[n,t,s] W1[s,ck,r,n]      (n, m in one group)

    The factorized form: two rank-R projections per (t, s), never a [B, T, S, H, H] tensor.
    The query side comes from ``rows`` (w1, w2, g of a's T query rows; default the first T
    rows of w1, w2, g), the key side from w1, w2, g.
    """
    b, h, t, s = a.shape
    ng, hg = head_groups, h // head_groups
    ag = a.reshape(b, ng, hg, t, s)
    r1, r2, rg = rows if rows is not None else (w1, w2, g)

    def side(x1, x2, c, n_len):  # (W1, W2) of slot c as [B, N, R, G, Hg] (N = T or S)
        return x1[:, :n_len, c].reshape(b, n_len, -1, ng, hg), x2[:, :n_len, c].reshape(b, n_len, -1, ng, hg)

    w1q, w2q = side(r1, r2, cq, t)
    w1k, w2k = side(w1, w2, ck, s)
    pq = torch.einsum("bgnts,btrgn->bgrts", ag, w1q)
    pk = torch.einsum("bgnts,bsrgn->bgrts", ag, w1k)
    mix = torch.einsum("bgrts,btrgm->bgmts", pq, w2q) + torch.einsum("bgrts,bsrgm->bgmts", pk, w2k)
    gate = 1 + rg[:, :t, cq].transpose(1, 2).unsqueeze(-1) + g[:, :s, ck].transpose(1, 2).unsqueeze(-2)
    return a * gate + mix.reshape(b, h, t, s)


def dcmha_compose(a: torch.Tensor, weights, slot: str = "pre", *, head_groups: int = 1) -> torch.Tensor:
    """Compose of a materialized ``a [B, H, T, S]`` (S = T: key-side weights are indexed by
    s) with the slots of ``slot`` ("pre": c = 0, 1; "post": c = 2, 3); fp32 accumulation
    (fp64 for fp64), returned in a's dtype."""
    from .dcmha import slot_index

    si = slot_index(slot)
    acc = _accumulation_dtype(a)
    w1, w2, g = (w.to(acc) for w in weights)
    return _compose(a.to(acc), w1, w2, g, 2 * si, 2 * si + 1, head_groups).to(a.dtype)


def dcmha_mask(t: int, s: int, *, causal: bool = True, window: Optional[int] = None, device=None) -> torch.Tensor:
    """``[T, S]`` boolean: True where query t may read key s (causal: s <= t; a window of
    W keys including self: t - W < s <= t)."""
    ti = torch.arange(t, device=device).unsqueeze(1)
    si = torch.arange(s, device=device).unsqueeze(0)
    keep = torch.ones(t, s, dtype=torch.bool, device=device)
    if causal:
        keep = keep & (si <= ti)
    if window is not None:
        keep = keep & (si > ti - window)
    return keep


def dcmha_attention_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, weights, row_weights,
                         keep: torch.Tensor, scale: float, head_groups: int = 1) -> torch.Tensor:
    """DCMHA attention of the query rows ``q [B, H, t, dh]`` against every key ``k [B, H, S,
    dh]``, ``v [B, H, S, dv]``: ``weights`` are every position's (the key side),
    ``row_weights`` those of the t query rows (the query side), ``keep [t, S]`` the mask
    rows. Materializes ``[B, H, t, S]``; ``O [B, H, t, dv]`` in q's dtype."""
    acc = _accumulation_dtype(q)
    w1, w2, g = (w.to(acc) for w in weights)
    rows = tuple(w.to(acc) for w in row_weights)
    logits = (q.to(acc) * scale) @ k.to(acc).transpose(-1, -2)
    logits = _compose(logits, w1, w2, g, 0, 1, head_groups, rows)
    row_any = keep.any(dim=-1, keepdim=True)
    # Fully masked rows: finite logits (no NaN in the softmax or its gradient), then 0.
    logits = torch.where(keep, logits, torch.where(row_any, float("-inf"), 0.0))
    probs = torch.softmax(logits, dim=-1) * row_any
    probs = _compose(probs, w1, w2, g, 2, 3, head_groups, rows)
    return (probs @ v.to(acc)).to(q.dtype)


def dcmha_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, weights, *, causal: bool = True,
                    window: Optional[int] = None, scale: Optional[float] = None,
                    head_groups: int = 1) -> torch.Tensor:
    """DCMHA attention, materializing ``[B, H, T, S]`` (the oracle of the fused kernel).

    ``q, k [B, H, T, dh]``, ``v [B, H, T, dv]``; ``L = q k^T * scale`` (default
    1/sqrt(dh)), pre-compose, mask (causal and/or a window of W keys including self),
    softmax over keys in fp32 (fully masked rows give 0), post-compose, ``O = P' v``.
    Returns ``O [B, H, T, dv]`` in q's dtype.
    """
    t, dh = q.shape[-2], q.shape[-1]
    scale = dh ** -0.5 if scale is None else scale
    keep = dcmha_mask(t, k.shape[-2], causal=causal, window=window, device=q.device)
    return dcmha_attention_rows(q, k, v, weights, weights, keep, scale, head_groups)


def dcmha_attention_query_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, weights, *, chunk: int = 128,
                                 causal: bool = True, window: Optional[int] = None, scale: Optional[float] = None,
                                 head_groups: int = 1, rows_fn=None) -> torch.Tensor:
    """The same math in DCFormer's formulation: query chunks of ``chunk`` rows (its default
    128), each materializing ``[B, H, chunk, S]``. ``rows_fn`` replaces
    ``dcmha_attention_rows`` (e.g. its ``torch.compile``: with T a multiple of ``chunk``
    every chunk has the same shapes). The issue-16 baseline of ``bench.targets``."""
    t, dh = q.shape[-2], q.shape[-1]
    scale = dh ** -0.5 if scale is None else scale
    keep = dcmha_mask(t, k.shape[-2], causal=causal, window=window, device=q.device)
    fn = rows_fn or dcmha_attention_rows
    outs = [fn(q[:, :, c0:c0 + chunk], k, v, weights, tuple(w[:, c0:c0 + chunk] for w in weights),
               keep[c0:c0 + chunk], scale, head_groups) for c0 in range(0, t, chunk)]
    return torch.cat(outs, dim=2)
