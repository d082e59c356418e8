"""Head surgery (SPEC section 3): joint permutation invariance, physical pruning equal to
the logical hard mask, GQA rules, optimizer state, transactional failure, and the
AHON / circuit scores from head_merge's stats."""

import dataclasses
from typing import Optional, Tuple

import pytest
import torch
import torch.nn.functional as F

import headwise
from headwise import reference


@dataclasses.dataclass(frozen=True)
class MiniLayout:
    """The part of the QKVLayout interface (SPEC section 2) that head_surgery uses: head
    counts and widths, role blocks in ``order``, split / fuse."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: Optional[int] = None
    order: Tuple[str, ...] = ("q", "k", "v")

    def __post_init__(self):
        if self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", self.head_dim)

    def _rows(self, role):
        heads = self.num_q_heads if role == "q" else self.num_kv_heads
        return heads * (self.v_head_dim if role == "v" else self.head_dim)

    def split(self, weight, bias=None):
        parts, start = {}, 0
        for role in self.order:
            n = self._rows(role)
            parts[role] = (weight[start : start + n], None if bias is None else bias[start : start + n])
            start += n
        return parts["q"], parts["k"], parts["v"]

    def fuse(self, q_w, k_w, v_w, q_b=None, k_b=None, v_b=None):
        ws, bs = {"q": q_w, "k": k_w, "v": v_w}, {"q": q_b, "k": k_b, "v": v_b}
        weight = torch.cat([ws[r] for r in self.order])
        bias = None if q_b is None else torch.cat([bs[r] for r in self.order])
        return weight, bias


def layouts():
    out = [
        pytest.param(MiniLayout(4, 4, 3), id="mha"),
        pytest.param(MiniLayout(6, 2, 3, 5, order=("v", "q", "k")), id="gqa-vqk-dv5"),
    ]
    if hasattr(headwise, "QKVLayout"):  # issue 4's layout, once merged
        out.append(pytest.param(headwise.QKVLayout(6, 2, 3, interleave="kv_group"), id="QKVLayout-kv_group"))
    return out


def make_module(layout, d_model=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n_total = (layout.num_q_heads + layout.num_kv_heads) * layout.head_dim + layout.num_kv_heads * layout.v_head_dim
    qkv_w = torch.randn(n_total, d_model, generator=gen) / d_model**0.5
    qkv_b = torch.randn(n_total, generator=gen) * 0.1
    o_w = torch.randn(d_model, layout.num_q_heads * layout.v_head_dim, generator=gen) / 3
    o_b = torch.randn(d_model, generator=gen) * 0.1
    return qkv_w, qkv_b, o_w, o_b


def attention(layout, x, qkv_w, qkv_b, o_w, o_b, head_gate=None, merge=reference.head_merge):
    """A small causal GQA attention built from reference pieces, merged by ``merge``."""
    b, t, _ = x.shape
    (qw, qb), (kw, kb), (vw, vb) = layout.split(qkv_w, qkv_b)
    hq, hkv, d, dv = layout.num_q_heads, layout.num_kv_heads, layout.head_dim, layout.v_head_dim
    q = F.linear(x, qw, qb).view(b, t, hq, d).transpose(1, 2)
    k = F.linear(x, kw, kb).view(b, t, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, dim=1)
    v = F.linear(x, vw, vb).view(b, t, hkv, dv).transpose(1, 2).repeat_interleave(hq // hkv, dim=1)
    scores = (q @ k.transpose(-1, -2)) / d**0.5
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    z = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v  # [B, Hq, T, Dv]
    return merge(z, o_w, o_b, head_gate=head_gate)


@pytest.mark.parametrize("layout", layouts())
def test_joint_permutation_leaves_output_unchanged(host_backend, layout):
    qkv_w, qkv_b, o_w, o_b = make_module(layout)
    x = torch.randn(2, 5, 8)
    y = attention(layout, x, qkv_w, qkv_b, o_w, o_b, merge=host_backend.head_merge)
    group = layout.num_q_heads // layout.num_kv_heads
    # Reverse the KV groups, and the heads inside each group.
    perm = [g * group + i for g in reversed(range(layout.num_kv_heads)) for i in reversed(range(group))]
    p = headwise.permute_heads(layout, qkv_w, o_w, perm, qkv_bias=qkv_b)
    y_perm = attention(layout, x, p.qkv_weight, p.qkv_bias, p.o_weight, o_b, merge=host_backend.head_merge)
    torch.testing.assert_close(y_perm, y, rtol=1e-5, atol=1e-6)
    # One-sided permutations (only W_O's columns, or only Q/K/V) change the output.
    y_o_only = attention(layout, x, qkv_w, qkv_b, p.o_weight, o_b, merge=host_backend.head_merge)
    y_qkv_only = attention(layout, x, p.qkv_weight, p.qkv_bias, o_w, o_b, merge=host_backend.head_merge)
    assert not torch.allclose(y_o_only, y, atol=1e-3)
    assert not torch.allclose(y_qkv_only, y, atol=1e-3)


def test_permutation_must_move_whole_groups():
    layout = MiniLayout(4, 2, 3)
    qkv_w, _, o_w, _ = make_module(layout)
    with pytest.raises(ValueError, match="mix query heads of old groups"):
        headwise.permute_heads(layout, qkv_w, o_w, [0, 2, 1, 3])
    with pytest.raises(ValueError, match="permutation of range"):
        headwise.permute_heads(layout, qkv_w, o_w, [0, 0, 1, 2])


@pytest.mark.parametrize(
    "layout,heads",
    [
        pytest.param(MiniLayout(4, 4, 3), [1, 2], id="mha"),
        pytest.param(MiniLayout(6, 2, 3, 5, order=("v", "q", "k")), [1, 4], id="gqa-one-per-group"),
        pytest.param(MiniLayout(6, 2, 3, 5, order=("v", "q", "k")), [3, 4, 5], id="gqa-whole-group"),
    ],
)
def test_pruning_equals_hard_mask(host_backend, layout, heads):
    qkv_w, qkv_b, o_w, o_b = make_module(layout)
    x = torch.randn(2, 5, 8)
    gate = headwise.head_mask(layout.num_q_heads, heads)
    masked = attention(layout, x, qkv_w, qkv_b, o_w, o_b, head_gate=gate, merge=host_backend.head_merge)
    p = headwise.prune_heads(layout, qkv_w, o_w, heads, qkv_bias=qkv_b, o_bias=o_b)
    assert p.layout.num_q_heads == layout.num_q_heads - len(heads)
    assert p.new_to_old == tuple(h for h in range(layout.num_q_heads) if h not in heads)
    pruned = attention(p.layout, x, p.qkv_weight, p.qkv_bias, p.o_weight, p.o_bias, merge=host_backend.head_merge)
    torch.testing.assert_close(pruned, masked, rtol=1e-5, atol=1e-6)
    # And the reference agrees with both.
    torch.testing.assert_close(attention(layout, x, qkv_w, qkv_b, o_w, o_b, head_gate=gate), masked,
                               rtol=1e-5, atol=1e-6)


def test_prune_whole_group_drops_kv_head():
    layout = MiniLayout(6, 2, 3, 5, order=("v", "q", "k"))
    qkv_w, qkv_b, o_w, o_b = make_module(layout)
    p = headwise.prune_heads(layout, qkv_w, o_w, [0, 1, 2], qkv_bias=qkv_b)
    assert (p.layout.num_q_heads, p.layout.num_kv_heads) == (3, 1)
    assert p.kv_new_to_old == (1,)
    assert p.qkv_weight.shape == (3 * 3 + 3 + 5, 8) and p.o_weight.shape == (8, 3 * 5)
    p1 = headwise.prune_heads(layout, qkv_w, o_w, [1, 4])
    assert (p1.layout.num_q_heads, p1.layout.num_kv_heads) == (4, 2)


def test_gqa_pruning_rules():
    layout = MiniLayout(6, 2, 3)
    qkv_w, _, o_w, _ = make_module(layout)
    with pytest.raises(ValueError, match="cannot prune kv head 0 while its query heads \\[2\\] remain"):
        headwise.prune_heads(layout, qkv_w, o_w, [0, 1], kv_heads=[0])
    with pytest.raises(ValueError, match="unequal numbers of query heads"):
        headwise.prune_heads(layout, qkv_w, o_w, [0])
    with pytest.raises(ValueError, match="every query head"):
        headwise.prune_heads(layout, qkv_w, o_w, range(6))
    with pytest.raises(ValueError, match="out of range"):
        headwise.prune_heads(layout, qkv_w, o_w, [6])
    with pytest.raises(ValueError, match="qkv_weight must be"):
        headwise.prune_heads(layout, qkv_w[:-1], o_w, [0])


def test_prune_optimizer_state_and_transaction():
    layout = MiniLayout(4, 4, 3)
    qkv_w, qkv_b, o_w, o_b = (torch.nn.Parameter(t) for t in make_module(layout))
    other = torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.Adam([qkv_w, qkv_b, o_w, o_b, other], lr=1e-2)
    x = torch.randn(2, 5, 8)
    attention(layout, x, qkv_w, qkv_b, o_w, o_b, merge=headwise.head_merge).square().sum().backward()
    other.grad = torch.ones(3)
    opt.step()
    before = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in (qkv_w, qkv_b, o_w, o_b, other)}

    # A failing call changes nothing.
    with pytest.raises(ValueError):
        headwise.prune_heads(MiniLayout(4, 2, 3), qkv_w, o_w, [0], optimizer=opt)
    assert opt.param_groups[0]["params"][0] is qkv_w
    assert torch.equal(opt.state[qkv_w]["exp_avg"], before[id(qkv_w)]["exp_avg"])

    p = headwise.prune_heads(layout, qkv_w, o_w, [2], qkv_bias=qkv_b, o_bias=o_b, optimizer=opt)
    assert isinstance(p.qkv_weight, torch.nn.Parameter) and p.qkv_weight.requires_grad
    params = opt.param_groups[0]["params"]
    assert params[0] is p.qkv_weight and params[1] is p.qkv_bias and params[2] is p.o_weight
    assert params[3] is o_b and params[4] is other
    assert qkv_w not in opt.state
    keep_rows = torch.tensor([r for r in range(qkv_w.shape[0]) if (r % 12) // 3 != 2])  # head 2 of each role
    for old, new in ((qkv_w, p.qkv_weight), (qkv_b, p.qkv_bias)):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[new][key], before[id(old)][key][keep_rows], rtol=0, atol=0)
        assert torch.equal(opt.state[new]["step"], before[id(old)]["step"])
    keep_cols = torch.tensor([c for c in range(12) if c // 3 != 2])
    torch.testing.assert_close(opt.state[p.o_weight]["exp_avg"], before[id(o_w)]["exp_avg"][:, keep_cols],
                               rtol=0, atol=0)
    # The optimizer keeps working on the pruned module.
    attention(p.layout, x, p.qkv_weight, p.qkv_bias, p.o_weight, o_b, merge=headwise.head_merge).sum().backward()
    opt.step()


def test_prune_factored_optimizer_state():
    """Adafactor keeps factored second moments (row_var [N, 1], col_var [1, C]): the
    factor spanning the pruned axis is pruned, the other kept, and training continues."""
    layout = MiniLayout(4, 2, 3)
    qkv_w, qkv_b, o_w, o_b = (torch.nn.Parameter(t) for t in make_module(layout))
    opt = torch.optim.Adafactor([qkv_w, qkv_b, o_w, o_b], lr=1e-2)
    x = torch.randn(2, 5, 8)
    attention(layout, x, qkv_w, qkv_b, o_w, o_b, merge=headwise.head_merge).square().sum().backward()
    opt.step()
    before = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in (qkv_w, qkv_b, o_w)}
    p = headwise.prune_heads(layout, qkv_w, o_w, [0, 1], qkv_bias=qkv_b, optimizer=opt)  # KV group 0 goes too
    keep_rows = torch.tensor(list(range(6, 12)) + list(range(15, 18)) + list(range(21, 24)))  # q 2-3, kv 1
    st_w, st_o = opt.state[p.qkv_weight], opt.state[p.o_weight]
    assert st_w["row_var"].shape == (p.qkv_weight.shape[0], 1) and st_w["col_var"].shape == (1, 8)
    assert torch.equal(st_w["col_var"], before[id(qkv_w)]["col_var"])
    assert torch.equal(st_w["row_var"], before[id(qkv_w)]["row_var"][keep_rows])
    assert st_o["row_var"].shape == (o_w.shape[0], 1) and st_o["col_var"].shape == (1, p.o_weight.shape[1])
    assert torch.equal(st_o["row_var"], before[id(o_w)]["row_var"])
    keep_cols = torch.tensor([c for c in range(o_w.shape[1]) if c // 3 >= 2])
    assert torch.equal(st_o["col_var"], before[id(o_w)]["col_var"][:, keep_cols])
    assert torch.equal(opt.state[p.qkv_bias]["variance"], before[id(qkv_b)]["variance"][keep_rows])
    attention(p.layout, x, p.qkv_weight, p.qkv_bias, p.o_weight, o_b, merge=headwise.head_merge).sum().backward()
    opt.step()


def test_prune_refuses_an_unknown_state_shape():
    layout = MiniLayout(4, 4, 3)
    qkv_w, qkv_b, o_w, o_b = (torch.nn.Parameter(t) for t in make_module(layout))
    opt = torch.optim.SGD([qkv_w, o_w], lr=1e-2)
    opt.state[o_w]["odd"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="odd"):
        headwise.prune_heads(layout, qkv_w, o_w, [1], optimizer=opt)
    assert opt.param_groups[0]["params"][1] is o_w and "odd" in opt.state[o_w]


def test_scores_from_stats():
    b, h, q, dv, d = 2, 4, 9, 8, 16
    z = torch.randn(b, h, q, dv) * torch.tensor([1.0, 0.05, 2.0, 1.0]).view(1, h, 1, 1)
    w = torch.randn(d, h * dv)
    _, st = headwise.head_merge(z, w, return_stats=True)
    ahon_raw = z.norm(dim=-1).mean(dim=(0, 2))
    torch.testing.assert_close(headwise.ahon_scores(st, layer_normalized=False), ahon_raw, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(headwise.ahon_scores(st), ahon_raw / ahon_raw.mean(), rtol=1e-5, atol=1e-6)
    circ_raw = torch.stack([(z[:, i] @ w[:, i * dv : (i + 1) * dv].t()).norm(dim=-1).mean() for i in range(h)])
    torch.testing.assert_close(headwise.circuit_scores(st), circ_raw / circ_raw.mean(), rtol=1e-4, atol=1e-5)
    assert headwise.inactive_heads(headwise.ahon_scores(st), threshold=0.1) == [1]
    mask = torch.zeros(b, q, dtype=torch.bool)
    mask[:, :4] = True
    torch.testing.assert_close(headwise.ahon_scores(st, layer_normalized=False, token_mask=mask),
                               z[:, :, :4].norm(dim=-1).mean(dim=(0, 2)), rtol=1e-5, atol=1e-6)
