"""Head surgery on a fused QKV projection + W_O (SPEC section 3): physical pruning,
permutation, and the matching logical hard mask.

The QKV side is described by a layout object (``headwise.QKVLayout``, SPEC section 2).
These helpers use only this part of its interface:

- attributes ``num_q_heads``, ``num_kv_heads``, ``head_dim``, ``v_head_dim``;
- ``split(weight [N_total, C], bias=None) -> ((q_w, q_b), (k_w, k_b), (v_w, v_b))`` with
  each role's rows head-major (``q_w [num_q_heads * head_dim, C]``, ...);
- ``fuse(q_w, k_w, v_w, q_b=None, k_b=None, v_b=None) -> (weight, bias)``, the inverse;
- a new layout with other head counts: ``dataclasses.replace(layout, num_q_heads=...,
  num_kv_heads=...)`` (a frozen dataclass, as QKVLayout is), else
  ``layout.with_heads(num_q_heads, num_kv_heads)`` when the class defines it.

Everything else of the layout (role order, interleaving) is preserved by going through
split / fuse. Query head h reads KV head ``h // (num_q_heads // num_kv_heads)``
(GQA/MQA groups are consecutive query heads), and query head h owns W_O's input columns
``[h * v_head_dim, (h + 1) * v_head_dim)``.

**Pruning rules (GQA).** Removing a query head keeps its KV head as long as another
query head of its group remains. A KV head is removed when every query head of its group
is removed (its K/V rows would be dead weight); naming a KV head in ``kv_heads`` whose
group still has a query head raises. A layout needs equal groups, so the kept query heads
must be spread equally over the kept KV heads (e.g. prune the same number of query heads
from every group, or whole groups); anything else raises, before anything is changed.

**From an arbitrary mask to a prunable one** (:func:`prunable_mask`). A score or L0 mask
closes any set of query heads. The rule that makes it prunable never closes a head the
mask keeps open, and closes as many of the asked heads as a layout allows: every KV group
whose query heads are all closed is removed whole; of the other groups, each loses the
same number k of query heads, k = the fewest heads the mask closes in any of them (the
k lowest-``priority`` closed heads of each group, ties to the lower index). So the pruned
mask is the asked mask with some closed heads reopened; with MHA (groups of one) it is
the asked mask itself.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, NamedTuple, Optional, Sequence

import torch

__all__ = ["PrunedHeads", "PermutedHeads", "head_mask", "permute_heads", "prunable_mask", "prune_heads"]


class PrunedHeads(NamedTuple):
    """Result of :func:`prune_heads`. ``new_to_old[i]`` is the old index of new query head
    i; ``kv_new_to_old[j]`` the old index of new KV head j."""

    layout: object
    qkv_weight: torch.Tensor
    qkv_bias: Optional[torch.Tensor]
    o_weight: torch.Tensor
    o_bias: Optional[torch.Tensor]
    new_to_old: tuple
    kv_new_to_old: tuple


class PermutedHeads(NamedTuple):
    """Result of :func:`permute_heads` (same layout; ``new_to_old`` as in PrunedHeads)."""

    qkv_weight: torch.Tensor
    qkv_bias: Optional[torch.Tensor]
    o_weight: torch.Tensor
    new_to_old: tuple
    kv_new_to_old: tuple


def _with_heads(layout, num_q_heads: int, num_kv_heads: int):
    if dataclasses.is_dataclass(layout):
        return dataclasses.replace(layout, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads)
    if hasattr(layout, "with_heads"):
        return layout.with_heads(num_q_heads, num_kv_heads)
    raise TypeError(
        f"headwise.prune_heads: cannot derive a layout with other head counts from {type(layout).__name__} "
        "(expected a dataclass such as headwise.QKVLayout, or a with_heads(num_q_heads, num_kv_heads) method)"
    )


def _select(t: torch.Tensor, heads: int, width: int, index: Sequence[int]) -> torch.Tensor:
    """Rows of the head-major ``t [heads * width, ...]`` for the heads in ``index``, in order."""
    idx = torch.as_tensor(list(index), dtype=torch.long, device=t.device)
    return t.reshape(heads, width, *t.shape[1:]).index_select(0, idx).reshape(len(index) * width, *t.shape[1:])


def _remap_fused(layout, new_layout, t: torch.Tensor, q_index, kv_index) -> torch.Tensor:
    """A tensor shaped like the fused weight ([N_total, C]) or bias ([N_total]) of
    ``layout``, with its Q heads ``q_index`` and KV heads ``kv_index`` kept (in that
    order) and repacked by ``new_layout``."""
    flat = t.dim() == 1
    t2 = t.unsqueeze(-1) if flat else t
    (qw, _), (kw, _), (vw, _) = layout.split(t2)
    qw = _select(qw, layout.num_q_heads, layout.head_dim, q_index)
    kw = _select(kw, layout.num_kv_heads, layout.head_dim, kv_index)
    vw = _select(vw, layout.num_kv_heads, layout.v_head_dim, kv_index)
    out, _ = new_layout.fuse(qw, kw, vw)
    return out.squeeze(-1) if flat else out


def _remap_o(layout, t: torch.Tensor, q_index) -> torch.Tensor:
    """W_O-shaped ``t [D, num_q_heads * v_head_dim]`` with the input columns of ``q_index``."""
    dv = layout.v_head_dim
    cols = torch.tensor([h * dv + j for h in q_index for j in range(dv)], dtype=torch.long, device=t.device)
    return t.index_select(1, cols).contiguous()


def _check_fused(layout, qkv_weight, qkv_bias, o_weight, o_bias, fn: str) -> None:
    n_total = (layout.num_q_heads + layout.num_kv_heads) * layout.head_dim + layout.num_kv_heads * layout.v_head_dim
    if qkv_weight.dim() != 2 or qkv_weight.shape[0] != n_total:
        raise ValueError(f"headwise.{fn}: qkv_weight must be [{n_total}, D_model] for the layout, got {list(qkv_weight.shape)}")
    if qkv_bias is not None and tuple(qkv_bias.shape) != (n_total,):
        raise ValueError(f"headwise.{fn}: qkv_bias must be [{n_total}], got {list(qkv_bias.shape)}")
    k = layout.num_q_heads * layout.v_head_dim
    if o_weight.dim() != 2 or o_weight.shape[1] != k:
        raise ValueError(
            f"headwise.{fn}: o_weight must be [D_model, num_q_heads * v_head_dim = {k}], got {list(o_weight.shape)}"
        )
    if o_bias is not None and tuple(o_bias.shape) != (o_weight.shape[0],):
        raise ValueError(f"headwise.{fn}: o_bias must be [{o_weight.shape[0]}], got {list(o_bias.shape)}")


def head_mask(num_heads: int, heads: Iterable[int], *, batch: Optional[int] = None, dtype=torch.float32, device=None):
    """The logical hard mask of ``heads``: a ``head_gate`` ``[H]`` (or ``[B, H]``) of ones
    with 0 at ``heads``; ``head_merge`` skips those heads' work."""
    g = torch.ones(num_heads, dtype=dtype, device=device)
    idx = list(heads)
    if idx:
        g[torch.as_tensor(idx, dtype=torch.long)] = 0
    return g if batch is None else g.expand(batch, num_heads).clone()


def prunable_mask(mask: torch.Tensor, num_kv_heads: int, *, priority: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The prunable form of a hard mask (module docstring): ``mask [H]`` of 0/1 (0 =
    closed), ``num_kv_heads`` dividing H, optional ``priority [H]`` (e.g. the head scores
    or gate logits; among a group's closed heads the lowest-priority ones are pruned
    first). Returns a float32 0/1 ``[H]`` whose closed heads :func:`prune_heads` accepts
    (a subset of the asked closed heads)."""
    m = torch.as_tensor(mask)
    if m.dim() != 1 or m.numel() == 0:
        raise ValueError(f"headwise.prunable_mask: mask must be a non-empty [H] tensor, got shape {list(m.shape)}")
    if not bool(((m == 0) | (m == 1)).all()):
        raise ValueError("headwise.prunable_mask: mask must hold only 0 and 1")
    hq = m.numel()
    if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int) or num_kv_heads < 1 or hq % num_kv_heads:
        raise ValueError(f"headwise.prunable_mask: num_kv_heads must be a positive divisor of H ({hq}), "
                         f"got {num_kv_heads!r}")
    if priority is None:
        prio = torch.zeros(hq, dtype=torch.float64)
    else:
        prio = torch.as_tensor(priority).detach().double().cpu()
        if tuple(prio.shape) != (hq,):
            raise ValueError(f"headwise.prunable_mask: priority must be [H] = [{hq}], got shape {list(prio.shape)}")
    group = hq // num_kv_heads
    closed = (m.detach().cpu() == 0).tolist()
    groups = [list(range(j * group, (j + 1) * group)) for j in range(num_kv_heads)]
    partial = [g for g in groups if not all(closed[h] for h in g)]
    k = min(sum(closed[h] for h in g) for g in partial) if partial else 0
    out = torch.ones(hq, dtype=torch.float32)
    for g in groups:
        asked = [h for h in g if closed[h]]
        if g in partial:
            asked = sorted(asked, key=lambda h: (prio[h].item(), h))[:k]
        out[asked] = 0.0
    return out


def _kv_plan(layout, remove_q: set, kv_heads, fn: str):
    hq, hkv = layout.num_q_heads, layout.num_kv_heads
    group = hq // hkv
    for h in remove_q:
        if not 0 <= h < hq:
            raise ValueError(f"headwise.{fn}: query head {h} out of range [0, {hq})")
    explicit = set(int(h) for h in (kv_heads or ()))
    for j in explicit:
        if not 0 <= j < hkv:
            raise ValueError(f"headwise.{fn}: kv head {j} out of range [0, {hkv})")
        kept = [h for h in range(j * group, (j + 1) * group) if h not in remove_q]
        if kept:
            raise ValueError(
                f"headwise.{fn}: cannot prune kv head {j} while its query heads {kept} remain "
                "(prune all query heads of a KV group to prune the group's K/V head)"
            )
    remove_kv = explicit | {j for j in range(hkv) if all(h in remove_q for h in range(j * group, (j + 1) * group))}
    q_index = [h for h in range(hq) if h not in remove_q]
    kv_index = [j for j in range(hkv) if j not in remove_kv]
    if not q_index:
        raise ValueError(f"headwise.{fn}: cannot prune every query head")
    counts = [sum(1 for h in q_index if h // group == j) for j in kv_index]
    if len(set(counts)) != 1:
        raise ValueError(
            f"headwise.{fn}: after pruning, the kept KV heads {kv_index} would serve unequal numbers of query "
            f"heads {counts}; a layout needs equal groups (prune the same number of query heads per group, "
            "or whole groups)"
        )
    return q_index, kv_index


def _transform_optimizer_state(optimizer, pairs: Dict[int, tuple], fn_name: str):
    """New optimizer state tensors for the parameters in ``pairs`` (id(old) -> (old, new,
    fn, dim), fn remapping the heads along ``dim``): each state tensor shaped like the
    parameter goes through fn; a factored one (the parameter's shape with some sizes 1,
    e.g. Adafactor's ``row_var [N, 1]`` / ``col_var [1, C]``) goes through fn when it spans
    ``dim`` and is kept when its size there is 1; scalars (``step``) and non-tensors are
    kept. Any other tensor shape is refused (pruning it is undefined). Returns the list of
    (old, new, new_state); nothing is modified here."""
    plan = []
    for old, new, fn, dim in pairs.values():
        state = optimizer.state.get(old, None)
        new_state = {}
        if state is not None:
            for k, v in state.items():
                if not isinstance(v, torch.Tensor) or v.dim() == 0:
                    new_state[k] = v
                elif v.shape == old.shape:
                    new_state[k] = fn(v)
                elif v.dim() == old.dim() and all(a in (1, b) for a, b in zip(v.shape, old.shape)):
                    new_state[k] = fn(v) if v.shape[dim] == old.shape[dim] else v
                else:
                    raise ValueError(
                        f"headwise.{fn_name}: optimizer state {k!r} of a {list(old.shape)} parameter has shape "
                        f"{list(v.shape)}, which is neither the parameter's shape nor a factored (size-1) form of it; "
                        "cannot prune it"
                    )
        plan.append((old, new, new_state if state is not None else None))
    return plan


def prune_heads(
    layout,
    qkv_weight: torch.Tensor,
    o_weight: torch.Tensor,
    heads: Iterable[int],
    *,
    qkv_bias: Optional[torch.Tensor] = None,
    o_bias: Optional[torch.Tensor] = None,
    kv_heads: Optional[Iterable[int]] = None,
    optimizer: Optional[torch.optim.Optimizer] = None,
) -> PrunedHeads:
    """Physically removes query heads ``heads`` (and KV heads, see the module doc) from a
    fused QKV projection and the output projection.

    ``qkv_weight [N_total, D_model]`` (+ ``qkv_bias [N_total]``) packed by ``layout``,
    ``o_weight [D_model, num_q_heads * v_head_dim]`` (+ ``o_bias``, unchanged). Returns
    :class:`PrunedHeads` with the new layout, the new tensors and ``new_to_old``. The
    pruned module's output equals the unpruned one with ``head_gate = head_mask(H, heads)``
    (a hard mask without rescale) on the same heads.

    When the tensors are ``nn.Parameter``s the results are new Parameters (same
    ``requires_grad``). With ``optimizer``, its state of those parameters (tensors shaped
    like the parameter, e.g. Adam's ``exp_avg`` / ``exp_avg_sq``, and factored ones like
    Adafactor's ``row_var`` / ``col_var``) is pruned the same way and re-keyed to the new
    Parameters, which also replace the old ones in
    ``optimizer.param_groups``. The call is transactional: every result is computed and
    checked first; the optimizer is modified only after that, so a failing call leaves it
    (and the inputs, which are never modified) unchanged.
    """
    fn = "prune_heads"
    _check_fused(layout, qkv_weight, qkv_bias, o_weight, o_bias, fn)
    remove_q = set(int(h) for h in heads)
    q_index, kv_index = _kv_plan(layout, remove_q, kv_heads, fn)
    new_layout = _with_heads(layout, len(q_index), len(kv_index))

    def f_qkv(t):
        return _remap_fused(layout, new_layout, t, q_index, kv_index)

    def f_o(t):
        return _remap_o(layout, t, q_index)

    def rewrap(old, new):
        if isinstance(old, torch.nn.Parameter):
            return torch.nn.Parameter(new, requires_grad=old.requires_grad)
        return new

    with torch.no_grad():
        new_w = rewrap(qkv_weight, f_qkv(qkv_weight.detach()))
        new_b = rewrap(qkv_bias, f_qkv(qkv_bias.detach())) if qkv_bias is not None else None
        new_o = rewrap(o_weight, f_o(o_weight.detach()))
        plan = []
        if optimizer is not None:
            pairs = {id(qkv_weight): (qkv_weight, new_w, f_qkv, 0), id(o_weight): (o_weight, new_o, f_o, 1)}
            if qkv_bias is not None:
                pairs[id(qkv_bias)] = (qkv_bias, new_b, f_qkv, 0)
            plan = _transform_optimizer_state(optimizer, pairs, fn)
    # Commit: nothing above modified the optimizer.
    if optimizer is not None:
        replace = {id(old): new for old, new, _ in plan}
        for group in optimizer.param_groups:
            group["params"] = [replace.get(id(p), p) for p in group["params"]]
        for old, new, st in plan:
            optimizer.state.pop(old, None)
            if st is not None:
                optimizer.state[new] = st
    return PrunedHeads(new_layout, new_w, new_b, new_o, o_bias, tuple(q_index), tuple(kv_index))


def permute_heads(
    layout,
    qkv_weight: torch.Tensor,
    o_weight: torch.Tensor,
    new_to_old: Sequence[int],
    *,
    qkv_bias: Optional[torch.Tensor] = None,
) -> PermutedHeads:
    """Reorders the query heads jointly in Q/K/V and W_O: new head i is old head
    ``new_to_old[i]``. The module's output is unchanged (``Z' W_O' = Z P P^T W_O``).
    With GQA the permutation must move whole KV groups together with their KV heads
    (new group j's query heads all come from one old group); any order within a group is
    allowed. (Permuting only one side, e.g. W_O's columns, changes the output.)"""
    fn = "permute_heads"
    _check_fused(layout, qkv_weight, qkv_bias, o_weight, None, fn)
    perm = [int(h) for h in new_to_old]
    hq, hkv = layout.num_q_heads, layout.num_kv_heads
    if sorted(perm) != list(range(hq)):
        raise ValueError(f"headwise.{fn}: new_to_old must be a permutation of range({hq}), got {perm}")
    group = hq // hkv
    kv_perm = []
    for j in range(hkv):
        src = {perm[j * group + i] // group for i in range(group)}
        if len(src) != 1:
            raise ValueError(
                f"headwise.{fn}: new KV group {j} would mix query heads of old groups {sorted(src)}; "
                "a permutation must move whole KV groups"
            )
        kv_perm.append(src.pop())
    with torch.no_grad():
        w = _remap_fused(layout, layout, qkv_weight.detach(), perm, kv_perm)
        b = _remap_fused(layout, layout, qkv_bias.detach(), perm, kv_perm) if qkv_bias is not None else None
        o = _remap_o(layout, o_weight.detach(), perm)
    return PermutedHeads(w, b, o, tuple(perm), tuple(kv_perm))
