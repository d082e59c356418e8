"""The rotary forms of qkv_project beyond one full-width rotate-half table (SPEC section 2,
README): tables per batch row [B, S, R] (per-row position ids: left-padded generation,
packed documents), partial rotary (R < head_dim: the leading R dims rotate, the rest pass
through), and GPT-J's interleaved pairs (rope_style="interleaved"). Every backend against
headwise.reference, forward and gradients; gradcheck in fp64 on the CPU kernel; opcheck;
bad input."""

import math

import pytest
import torch

import headwise
from headwise import QKVLayout, reference
from headwise.testing import rel_err

FP32_TOL = 1e-5
BF16_TOL = 2 ** -6


def rope_tables(positions, rot, style="rotate_half", base=10000.0, dtype=torch.float32):
    """cos, sin of width `rot` for integer `positions` ([S] or [B, S]): Llama's
    cat(freqs, freqs) for rotate_half, GPT-J's repeat-interleaved freqs for interleaved."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    ang = positions.to(torch.float64)[..., None] * inv_freq
    emb = torch.cat([ang, ang], dim=-1) if style == "rotate_half" else ang.repeat_interleave(2, dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def per_row_positions(b, s):
    """Left-padded rows: row i starts 2 i tokens late (positions clamp at 0 over the pad,
    as HF's cumsum(mask) - 1 with masked_fill does)."""
    pos = torch.arange(s)[None, :] - 2 * torch.arange(b)[:, None]
    return pos.clamp(min=0)


def make_case(layout, b, s, d_model, *, rot, per_row, style, dtype=torch.float32, norm=True, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, d_model, generator=gen).to(dtype).to(device)
    weight = (torch.randn(layout.num_rows, d_model, generator=gen) / math.sqrt(d_model)).to(dtype).to(device)
    bias = (0.5 * torch.randn(layout.num_rows, generator=gen)).to(dtype).to(device)
    positions = per_row_positions(b, s) if per_row else torch.arange(s)
    cos, sin = rope_tables(positions, rot, style)
    kw = dict(layout=layout, scale_q=layout.head_dim ** -0.5, rope=(cos.to(device), sin.to(device)),
              rope_style=style)
    if norm:
        kw["q_norm"] = (1 + 0.2 * torch.randn(layout.head_dim, generator=gen)).to(device)
        kw["k_norm"] = (1 + 0.2 * torch.randn(layout.head_dim, generator=gen)).to(device)
    return (x, weight, bias), kw


def forward_backward(fn, args, kw, grads):
    leaves = [t.clone().requires_grad_() for t in args]
    kwl = dict(kw)
    for name in ("q_norm", "k_norm"):
        if name in kwl:
            kwl[name] = kwl[name].clone().requires_grad_()
            leaves.append(kwl[name])
    out = fn(*leaves[:3], **kwl)
    torch.autograd.backward(out, grads)
    return out, [t.grad for t in leaves]


def check(ops, layout, b, s, d_model, *, tol=FP32_TOL, dtype=torch.float32, **case):
    args, kw = make_case(layout, b, s, d_model, dtype=dtype, device=ops.device, **case)
    gen = torch.Generator().manual_seed(7)
    shapes = [(b, layout.num_q_heads, s, layout.head_dim), (b, layout.num_kv_heads, s, layout.head_dim),
              (b, layout.num_kv_heads, s, layout.v_head_dim)]
    grads = [torch.randn(sh, generator=gen).to(dtype).to(ops.device) for sh in shapes]
    out, got = forward_backward(ops.qkv_project, args, kw, grads)
    want_out, want = forward_backward(reference.qkv_project, args, kw, grads)
    for name, o, e in zip("qkv", out, want_out):
        assert o.shape == e.shape and o.dtype == dtype
        assert rel_err(o, e) <= tol, f"{name}: {rel_err(o, e):.3g}"
    for name, g, e in zip(("x", "weight", "bias", "q_norm", "k_norm"), got, want):
        assert rel_err(g, e) <= tol, f"grad {name}: {rel_err(g, e):.3g}"


# (layout, B, S, D_model, rot): odd shapes; the CUDA item widths 1, 2, 4; odd head_dim
# with an even partial rotary width; GQA, kv_group packing, value width != head width.
SHAPES = [
    pytest.param(QKVLayout(4, 2, 8), 3, 5, 37, 8, id="D8-full"),
    pytest.param(QKVLayout(4, 2, 8), 3, 5, 37, 4, id="D8-rot4"),
    pytest.param(QKVLayout(6, 3, 16, 12, interleave="kv_group"), 2, 37, 37, 6, id="kv-group-D16-rot6"),
    pytest.param(QKVLayout(3, 1, 37, 5), 2, 5, 123, 10, id="D37-odd-rot10"),
    pytest.param(QKVLayout(3, 3, 96, 80), 2, 37, 37, 24, id="D96-rot24-items2"),
    pytest.param(QKVLayout(2, 1, 256, 131), 2, 3, 37, 64, id="D256-rot64-items4"),
    pytest.param(QKVLayout(2, 1, 256, 131), 2, 3, 37, 256, id="D256-full-items4"),
]
FORMS = [
    pytest.param(True, "rotate_half", id="per-row-half"),
    pytest.param(False, "interleaved", id="shared-interleaved"),
    pytest.param(True, "interleaved", id="per-row-interleaved"),
    pytest.param(False, "rotate_half", id="shared-half"),
]


@pytest.mark.parametrize("per_row,style", FORMS)
@pytest.mark.parametrize("layout,b,s,d_model,rot", SHAPES)
def test_matches_reference_fp32(backend, layout, b, s, d_model, rot, per_row, style):
    check(backend, layout, b, s, d_model, rot=rot, per_row=per_row, style=style)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("per_row,style", [(True, "rotate_half"), (True, "interleaved")])
@pytest.mark.parametrize("rot", [128, 32])
def test_low_precision_close_to_reference(backend, dtype, per_row, style, rot):
    check(backend, QKVLayout(4, 2, 128), 2, 5, 123, rot=rot, per_row=per_row, style=style, dtype=dtype,
          tol=BF16_TOL)


@pytest.mark.parametrize("style", ["rotate_half", "interleaved"])
@pytest.mark.parametrize("rot", [16, 6])
def test_identical_rows_equal_the_shared_table(backend, style, rot):
    # A [B, S, R] table whose rows are equal gives the bits of the [S, R] table.
    layout = QKVLayout(4, 2, 16, 12)
    args, kw = make_case(layout, 3, 5, 37, rot=rot, per_row=False, style=style, device=backend.device)
    shared = backend.qkv_project(*args, **kw)
    cos, sin = kw["rope"]
    kw["rope"] = (cos.expand(3, -1, -1).contiguous(), sin.expand(3, -1, -1).contiguous())
    rows = backend.qkv_project(*args, **kw)
    for a, b_ in zip(shared, rows):
        assert torch.equal(a, b_)


def test_rows_follow_their_own_positions(backend):
    # Row i of a per-row call equals a single-row call with row i's table (up to the
    # GEMM's blocking, which may differ between 1 and 3 rows).
    layout = QKVLayout(4, 2, 16)
    args, kw = make_case(layout, 3, 7, 37, rot=10, per_row=True, style="rotate_half", device=backend.device)
    q, k, v = backend.qkv_project(*args, **kw)
    cos, sin = kw["rope"]
    for i in range(3):
        kwi = dict(kw, rope=(cos[i], sin[i]))
        qi, ki, vi = backend.qkv_project(args[0][i : i + 1], *args[1:], **kwi)
        for got, want in ((qi, q[i : i + 1]), (ki, k[i : i + 1]), (vi, v[i : i + 1])):
            assert rel_err(got, want) <= 1e-6


def test_partial_rotary_leaves_the_tail(backend):
    # The dims from R on are the un-rotated (normalized, scaled) values: rope with R
    # equals no rope there.
    layout = QKVLayout(4, 2, 16)
    args, kw = make_case(layout, 2, 5, 37, rot=6, per_row=True, style="interleaved", device=backend.device)
    q, k, _ = backend.qkv_project(*args, **kw)
    plain = dict(kw)
    plain.pop("rope")
    q0, k0, _ = backend.qkv_project(*args, **plain)
    assert torch.equal(q[..., 6:], q0[..., 6:]) and torch.equal(k[..., 6:], k0[..., 6:])
    assert not torch.equal(q[..., :6], q0[..., :6])


def test_q_project_and_kv_project_take_the_forms(backend):
    layout = QKVLayout(6, 2, 8, 6, interleave="kv_group")
    args, kw = make_case(layout, 2, 5, 37, rot=4, per_row=True, style="interleaved", device=backend.device)
    x, weight, bias = args
    q_rows, kv_rows = list(layout.rows(("q",))), list(layout.rows(("k", "v")))
    common = dict(layout=layout, rope=kw["rope"], rope_style="interleaved")
    q = backend.q_project(x, weight[q_rows], bias[q_rows], q_norm=kw["q_norm"], scale_q=0.5, **common)
    k, v = backend.kv_project(x, weight[kv_rows], bias[kv_rows], k_norm=kw["k_norm"], **common)
    eq = reference.q_project(x, weight[q_rows], bias[q_rows], q_norm=kw["q_norm"], scale_q=0.5, **common)
    ek, ev = reference.kv_project(x, weight[kv_rows], bias[kv_rows], k_norm=kw["k_norm"], **common)
    for got, want in ((q, eq), (k, ek), (v, ev)):
        assert rel_err(got, want) <= FP32_TOL


@pytest.mark.parametrize("per_row,style,rot", [(True, "rotate_half", 4), (True, "interleaved", 4),
                                               (False, "interleaved", 2), (True, "rotate_half", 6)])
def test_gradcheck_float64_cpu_kernel(per_row, style, rot):
    for layout in (QKVLayout(4, 2, 6, 3), QKVLayout(2, 1, 7, 2, interleave="kv_group")):
        args, kw = make_case(layout, 2, 3, 5, rot=rot, per_row=per_row, style=style, dtype=torch.float64)
        kw["rope"] = tuple(t.double() for t in kw["rope"])
        qn = kw.pop("q_norm").double().requires_grad_()
        kn = kw.pop("k_norm").double().requires_grad_()
        x, w, b = (t.requires_grad_() for t in args)

        def fn(x, w, b, qn, kn):
            return headwise.qkv_project(x, w, b, q_norm=qn, k_norm=kn, **kw)

        assert torch.autograd.gradcheck(fn, (x, w, b, qn, kn))


def test_opcheck(backend):
    op = getattr(torch.ops, backend.ns).qkv_project
    layout = QKVLayout(4, 2, 8, 6, interleave="kv_group")
    args, kw = make_case(layout, 3, 5, 12, rot=4, per_row=True, style="interleaved", device=backend.device)
    cos, sin = kw["rope"]
    c_full, s_full = (t.to(backend.device) for t in rope_tables(per_row_positions(3, 5), 8))
    offs = list(layout.head_offsets())
    x, w, b = (t.requires_grad_() for t in args)
    qn, kn = kw["q_norm"].requires_grad_(), kw["k_norm"].requires_grad_()
    samples = [
        (x, w, b, offs, 4, 2, 8, 6, qn, kn, 1e-6, cos, sin, 0.5, 1),
        (x, w, b, offs, 4, 2, 8, 6, qn, kn, 1e-6, c_full, s_full, 0.5, 0),
        (x, w, None, offs, 4, 2, 8, 6, None, kn, 1e-6, cos[0], sin[0], 1.0, 0),
    ]
    for sample in samples:
        torch.library.opcheck(op, sample)


class TestBadInput:
    def setup_method(self):
        self.layout = QKVLayout(2, 2, 6, 2)
        self.args, self.kw = make_case(self.layout, 2, 3, 6, rot=4, per_row=True, style="rotate_half")

    def call(self, ops, **over):
        return ops.qkv_project(*self.args, **dict(self.kw, **over))

    def test_unknown_style(self, host_backend):
        with pytest.raises(ValueError, match="rope_style must be one of"):
            self.call(host_backend, rope_style="gptj")
        lib = getattr(torch.ops, host_backend.ns)
        cos, sin = self.kw["rope"]
        with pytest.raises(ValueError, match=r"rope_style must be 0 \(rotate-half\) or 1"):
            lib.qkv_project(self.args[0], self.args[1], None, list(self.layout.head_offsets()), 2, 2, 6, 2, None,
                            None, 1e-6, cos, sin, 1.0, 2)

    def test_table_batch_and_width(self, host_backend):
        cos, sin = self.kw["rope"]
        with pytest.raises(ValueError, match=r"rope cos must be \[B, S, rotary_dim\]"):
            self.call(host_backend, rope=(cos[:1], sin[:1]))
        with pytest.raises(ValueError, match="rope sin"):
            self.call(host_backend, rope=(cos, sin[..., :2]))
        with pytest.raises(ValueError, match="rotary_dim .* must be even"):
            self.call(host_backend, rope=(cos[..., :3], sin[..., :3]))
        wide = rope_tables(per_row_positions(2, 3), 8)
        with pytest.raises(ValueError, match=r"rotary_dim .* in \[2, head_dim = 6\]"):
            self.call(host_backend, rope=wide)
        with pytest.raises(ValueError, match="rope cos must be"):
            self.call(host_backend, rope=(cos[None], sin[None]))
