"""headwise.qkv_project / q_project / kv_project (SPEC section 2): every backend against
headwise.reference, gradients, gradcheck, opcheck, torch.compile and bad input."""

import math

import pytest
import torch

import headwise
from headwise import QKVLayout, reference
from headwise.testing import rel_err, with_one_and_many_threads

FP32_TOL = 1e-5
BF16_TOL = 2 ** -6


def rope_tables(seq, dim, base=10000.0, dtype=torch.float32):
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    ang = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def make_case(layout, b, s, d_model, *, dtype=torch.float32, bias=True, norm=True, rope=True, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, d_model, generator=gen)
    weight = torch.randn(layout.num_rows, d_model, generator=gen) / math.sqrt(d_model)
    args = dict(
        x=x.to(dtype).to(device),
        weight=weight.to(dtype).to(device),
        bias=(0.5 * torch.randn(layout.num_rows, generator=gen)).to(dtype).to(device) if bias else None,
    )
    kw = dict(layout=layout, scale_q=layout.head_dim ** -0.5)
    if norm:
        kw["q_norm"] = (1 + 0.2 * torch.randn(layout.head_dim, generator=gen)).to(device)
        kw["k_norm"] = (1 + 0.2 * torch.randn(layout.head_dim, generator=gen)).to(device)
    if rope:
        kw["rope"] = tuple(t.to(device) for t in rope_tables(s, layout.head_dim))
    return args, kw


GRAD_NAMES = ("x", "weight", "bias", "q_norm", "k_norm")


def run(fn, args, kw, grads=None):
    """Forward (and backward with `grads`) of fn; returns outputs and the leaves' grads."""
    leaves = {k: (v.clone().requires_grad_() if v is not None else None) for k, v in args.items()}
    kwl = dict(kw)
    for name in ("q_norm", "k_norm"):
        if kwl.get(name) is not None:
            kwl[name] = kwl[name].clone().requires_grad_()
    out = fn(leaves["x"], leaves["weight"], leaves["bias"], **kwl)
    got = {}
    if grads is not None:
        torch.autograd.backward(out, grads)
        for name in GRAD_NAMES:
            t = leaves.get(name, kwl.get(name))
            if t is not None:
                got[name] = t.grad
    return out, got


def check_against_reference(ops, layout, b, s, d_model, *, tol=FP32_TOL, dtype=torch.float32, **case):
    args, kw = make_case(layout, b, s, d_model, dtype=dtype, device=ops.device, **case)
    expected, _ = run(reference.qkv_project, args, kw)
    gen = torch.Generator().manual_seed(7)
    grads = [torch.randn(e.shape, generator=gen).to(dtype).to(ops.device) for e in expected]
    out, got = run(ops.qkv_project, args, kw, grads)
    expected, want = run(reference.qkv_project, args, kw, grads)
    for name, o, e in zip("qkv", out, expected):
        assert o.shape == e.shape and o.dtype == dtype and o.is_contiguous()
        err = rel_err(o, e)
        assert err <= tol, f"{name}: relative error {err:.3g} > {tol}"
    assert set(got) == set(want)
    for name in want:
        err = rel_err(got[name], want[name])
        assert err <= tol, f"grad {name}: relative error {err:.3g} > {tol}"


# (layout, B, S, D_model): odd shapes 3, 5, 37, 123; every CUDA item width (1, 2, 4).
SHAPES = [
    pytest.param(QKVLayout(2, 2, 3, 2), 2, 3, 6, dict(rope=False), id="asym-fixture"),
    pytest.param(QKVLayout(2, 2, 3, 2, order=("v", "k", "q")), 2, 5, 6, dict(rope=False), id="asym-vkq"),
    pytest.param(QKVLayout(4, 2, 8), 2, 5, 37, {}, id="gqa-D8"),
    pytest.param(QKVLayout(6, 3, 16, 12, interleave="kv_group"), 1, 37, 37, {}, id="kv-group-D16-Dv12"),
    pytest.param(QKVLayout(5, 1, 6, 5, order=("k", "v", "q")), 3, 5, 123, {}, id="mqa-kvq"),
    pytest.param(QKVLayout(3, 3, 96, 80), 1, 123, 37, {}, id="D96-items4"),
    pytest.param(QKVLayout(2, 1, 256, 131), 1, 3, 37, {}, id="D256-Dv131"),
    pytest.param(QKVLayout(4, 4, 64), 2, 37, 123, dict(bias=False), id="mha-D64-nobias"),
    pytest.param(QKVLayout(4, 2, 10), 1, 5, 37, dict(norm=False), id="rope-only"),
    pytest.param(QKVLayout(4, 2, 5, 7), 1, 5, 37, dict(norm=False, rope=False), id="plain-split"),
]


@pytest.mark.parametrize("layout,b,s,d_model,case", SHAPES)
def test_matches_reference_fp32(backend, layout, b, s, d_model, case):
    check_against_reference(backend, layout, b, s, d_model, **case)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout,b,s,d_model", [
    (QKVLayout(4, 2, 8), 2, 5, 37),
    (QKVLayout(6, 3, 16, 12, interleave="kv_group"), 1, 37, 64),
    (QKVLayout(2, 2, 128), 1, 5, 123),
])
def test_low_precision_close_to_reference(backend, dtype, layout, b, s, d_model):
    # The kernel rounds once at the end from fp32; the reference rounds the linear output
    # and the normalized value to the storage dtype first.
    check_against_reference(backend, layout, b, s, d_model, dtype=dtype, tol=BF16_TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_rounding_points_match_the_reference(backend, dtype):
    # Bias inside the GEMM (rounded once, as F.linear) and norm weights stored in the
    # storage dtype (weight * h rounded, as Qwen3RMSNorm): without rope and q scale,
    # whose elementwise products the reference rounds op by op, the outputs are
    # bitwise the reference's.
    layout = QKVLayout(4, 2, 16, 12)
    args, kw = make_case(layout, 2, 5, 37, dtype=dtype, rope=False, device=backend.device)
    kw["scale_q"] = None
    kw["q_norm"], kw["k_norm"] = kw["q_norm"].to(dtype), kw["k_norm"].to(dtype)
    got = backend.qkv_project(*args.values(), **kw)
    want = reference.qkv_project(*args.values(), **kw)
    for name, g, w in zip("qkv", got, want):
        assert torch.equal(g, w), name


def test_q_only_and_kv_only(backend):
    layout = QKVLayout(6, 2, 8, 6, interleave="kv_group")
    args, kw = make_case(layout, 2, 5, 37, device=backend.device)
    q_w = args["weight"][list(layout.rows(("q",)))]
    kv_w = args["weight"][list(layout.rows(("k", "v")))]
    q_b = args["bias"][list(layout.rows(("q",)))]
    kv_b = args["bias"][list(layout.rows(("k", "v")))]
    x_src = torch.randn(2, 7, 37).to(backend.device)
    rope7 = tuple(t.to(backend.device) for t in rope_tables(7, layout.head_dim))
    q = backend.q_project(args["x"], q_w, q_b, layout=layout, q_norm=kw["q_norm"], rope=kw["rope"],
                          scale_q=kw["scale_q"])
    k, v = backend.kv_project(x_src, kv_w, kv_b, layout=layout, k_norm=kw["k_norm"],
                              rope=rope7)
    eq = reference.q_project(args["x"], q_w, q_b, layout=layout, q_norm=kw["q_norm"], rope=kw["rope"],
                             scale_q=kw["scale_q"])
    ek, ev = reference.kv_project(x_src, kv_w, kv_b, layout=layout, k_norm=kw["k_norm"],
                                  rope=rope7)
    # The self-attention projection gives the same Q (and K, V for the same input).
    full_q, _, _ = reference.qkv_project(args["x"], args["weight"], args["bias"], **kw)
    assert rel_err(eq, full_q) <= FP32_TOL
    for got, want in ((q, eq), (k, ek), (v, ev)):
        assert rel_err(got, want) <= FP32_TOL
    assert q.shape == (2, 6, 5, 8) and k.shape == (2, 2, 7, 8) and v.shape == (2, 2, 7, 6)
    # Gradients of the cross-attention pieces.
    xs = x_src.clone().requires_grad_()
    w = kv_w.clone().requires_grad_()
    kn = kw["k_norm"].clone().requires_grad_()
    k, v = backend.kv_project(xs, w, None, layout=layout, k_norm=kn, rope=rope7)
    (k.square().sum() + v.sum()).backward()
    xs2, w2, kn2 = (t.detach().clone().requires_grad_() for t in (x_src, kv_w, kw["k_norm"]))
    ek, ev = reference.kv_project(xs2, w2, None, layout=layout, k_norm=kn2, rope=rope7)
    (ek.square().sum() + ev.sum()).backward()
    for a, b_ in ((xs, xs2), (w, w2), (kn, kn2)):
        assert rel_err(a.grad, b_.grad) <= FP32_TOL


def test_unused_outputs_get_zero_gradients(host_backend):
    layout = QKVLayout(4, 2, 8)
    args, kw = make_case(layout, 2, 5, 16)
    out, got = run(host_backend.qkv_project, args, kw, grads=None)
    x = args["x"].clone().requires_grad_()
    q, k, v = host_backend.qkv_project(x, args["weight"], args["bias"], **kw)
    q.sum().backward()  # k and v unused
    xr = args["x"].clone().requires_grad_()
    rq, _, _ = reference.qkv_project(xr, args["weight"], args["bias"], **kw)
    rq.sum().backward()
    assert rel_err(x.grad, xr.grad) <= FP32_TOL


def test_strided_x_read(backend):
    # x as a [B, S, D] view of [S, B, D] memory (stride-1 last dim) and a sliced weight.
    layout = QKVLayout(4, 2, 8)
    args, kw = make_case(layout, 2, 5, 37, device=backend.device)
    x = args["x"].transpose(0, 1).contiguous().transpose(0, 1)
    wide = torch.randn(layout.num_rows, 50, device=backend.device)
    wide[:, :37] = args["weight"]
    weight = wide[:, :37]
    out = backend.qkv_project(x, weight, args["bias"], **kw)
    exp = reference.qkv_project(args["x"], args["weight"], args["bias"], **kw)
    for o, e in zip(out, exp):
        assert rel_err(o, e) <= FP32_TOL


def test_gradcheck_float64_cpu_kernel():
    for layout, case in [(QKVLayout(4, 2, 4, 3), {}), (QKVLayout(2, 1, 4, 2, interleave="kv_group"), {}),
                         (QKVLayout(2, 2, 3, 2), dict(rope=False))]:
        args, kw = make_case(layout, 2, 3, 5, dtype=torch.float64, **case)
        if "rope" in kw:
            kw["rope"] = tuple(t.double() for t in kw["rope"])
        qn = kw.pop("q_norm").double().requires_grad_()
        kn = kw.pop("k_norm").double().requires_grad_()
        x, w, b = (args[k].requires_grad_() for k in ("x", "weight", "bias"))

        def fn(x, w, b, qn, kn):
            return headwise.qkv_project(x, w, b, q_norm=qn, k_norm=kn, **kw)

        assert torch.autograd.gradcheck(fn, (x, w, b, qn, kn))


def test_opcheck(backend):
    op = getattr(torch.ops, backend.ns).qkv_project
    layout = QKVLayout(4, 2, 8, 6, interleave="kv_group")
    args, kw = make_case(layout, 2, 5, 12, device=backend.device)
    cos, sin = kw["rope"]
    offs = list(layout.head_offsets())
    x, w, b = (args[k].requires_grad_() for k in ("x", "weight", "bias"))
    qn, kn = kw["q_norm"].requires_grad_(), kw["k_norm"].requires_grad_()
    samples = [
        (x, w, b, offs, 4, 2, 8, 6, qn, kn, 1e-6, cos, sin, 0.5),
        (x, w, None, offs, 4, 2, 8, 6, None, None, 1e-6, None, None, 1.0),
        (x, w, b, list(layout.head_offsets(("q",))), 4, 0, 8, 6, qn, None, 1e-5, cos, sin, 1.0),
    ]
    samples[2] = (x, w[list(layout.rows(("q",)))].detach().requires_grad_(), b[list(layout.rows(("q",)))].detach()
                  .requires_grad_(), *samples[2][3:])
    for sample in samples:
        torch.library.opcheck(op, sample)


def test_compiles_fullgraph_without_graph_breaks(host_backend):
    layout = QKVLayout(4, 2, 8, interleave="kv_group")
    args, kw = make_case(layout, 2, 5, 16)
    x, w, b = (args[k].requires_grad_() for k in ("x", "weight", "bias"))

    def step(x, w, b):
        q, k, v = host_backend.qkv_project(x, w, b, **kw)
        return (q.square().sum() + (k * 2).sum() + v.square().sum())

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    compiled(x, w, b).backward()
    grads = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    step(x, w, b).backward()
    for got, t in zip(grads, (x, w, b)):
        assert torch.equal(got, t.grad)


def _fwd_bwd(ops):
    layout = QKVLayout(4, 2, 16)
    args, kw = make_case(layout, 2, 123, 37)
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(2, h, 123, 16, generator=gen) for h in (4, 2, 2)]
    out, got = run(ops.qkv_project, args, kw, grads)
    return list(out) + [got[k] for k in sorted(got)]


def test_deterministic_across_thread_counts(host_backend):
    one, many = with_one_and_many_threads(lambda: _fwd_bwd(host_backend))
    again = with_one_and_many_threads(lambda: _fwd_bwd(host_backend))[1]
    # Norm-weight gradients: fixed-order reductions, bitwise reproducible.
    for a, b, c in zip(one[-2:], many[-2:], again[-2:]):
        assert torch.equal(a, b) and torch.equal(b, c)


def test_weight_grad_deterministic_across_thread_counts(host_backend):
    # fp32 weight gradient over 1203 tokens: the contraction runs in fixed 512-token
    # chunks (one GEMM over all tokens gave other bits with 2 threads than with 1).
    layout = QKVLayout(4, 2, 16)
    args, kw = make_case(layout, 3, 401, 24, norm=False, rope=False)
    gen = torch.Generator().manual_seed(2)
    grads = [torch.randn(3, h, 401, 16, generator=gen) for h in (4, 2, 2)]
    one, many = with_one_and_many_threads(lambda: run(host_backend.qkv_project, args, kw, grads)[1])
    for name in ("x", "weight", "bias"):
        assert torch.equal(one[name], many[name]), name
    _, want = run(reference.qkv_project, args, kw, grads)
    assert rel_err(one["weight"], want["weight"]) <= 1e-5


def test_saves_packed_product_only_with_a_norm(host_backend):
    layout = QKVLayout(4, 2, 8)
    for norm, expected in ((False, []), (True, [((10, layout.num_rows), torch.float32)])):
        args, kw = make_case(layout, 2, 5, 16, norm=norm)
        leaves = [args[k].requires_grad_() for k in ("x", "weight", "bias")]
        inputs = {t.untyped_storage().data_ptr() for t in leaves}
        new = []

        def pack(t):
            if t.untyped_storage().data_ptr() not in inputs and t.numel() > 0 and t.dim() == 2 and t.shape[0] == 10:
                new.append((tuple(t.shape), t.dtype))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            host_backend.qkv_project(*leaves, **kw)
        assert new == expected


def test_mha_semantics_scale_q(backend):
    # scale_q multiplies q only, after rope.
    layout = QKVLayout(2, 2, 4)
    args, kw = make_case(layout, 1, 3, 8, device=backend.device)
    kw1 = dict(kw, scale_q=1.0)
    q1, k1, v1 = backend.qkv_project(args["x"], args["weight"], args["bias"], **kw1)
    q2, k2, v2 = backend.qkv_project(args["x"], args["weight"], args["bias"], **dict(kw, scale_q=0.25))
    assert torch.allclose(q2, 0.25 * q1, rtol=1e-6, atol=1e-7)
    assert torch.equal(k1, k2) and torch.equal(v1, v2)


class TestBadInput:
    def setup_method(self):
        self.layout = QKVLayout(2, 2, 4, 2)
        self.args, self.kw = make_case(self.layout, 2, 3, 6)

    def call(self, ops, **over):
        a = dict(self.args)
        kw = dict(self.kw)
        for k, v in over.items():
            (a if k in a else kw)[k] = v
        return ops.qkv_project(a["x"], a["weight"], a["bias"], **kw)

    def raw(self, ops, offsets=None, hq=2, hkv=2, d=4, dv=2, weight=None):
        lib = getattr(torch.ops, ops.ns)
        w = self.args["weight"] if weight is None else weight
        offs = list(self.layout.head_offsets()) if offsets is None else offsets
        return lib.qkv_project(self.args["x"], w, None, offs, hq, hkv, d, dv, None, None, 1e-6, None, None, 1.0)

    def test_weight_rows_disagree_with_layout(self, host_backend):
        with pytest.raises(ValueError, match="weight has 17 rows but the layout packs 20"):
            self.call(host_backend, weight=torch.zeros(17, 6), bias=None)

    def test_widths_not_dividing_into_heads(self, host_backend):
        # 20 rows cannot be 2 q + 2 kv heads of width 3 with v width 2 (16 rows).
        with pytest.raises(ValueError, match="widths do not divide into these heads"):
            self.raw(host_backend, offsets=[0, 3, 6, 9, 12, 14], d=3)

    def test_kv_heads_not_dividing_q_heads(self, host_backend):
        with pytest.raises(ValueError, match="num_kv_heads"):
            self.raw(host_backend, hq=3, hkv=2, offsets=[0] * 7)
        with pytest.raises(ValueError, match="num_kv_heads"):
            QKVLayout(3, 2, 4)

    def test_overlapping_spans(self, host_backend):
        with pytest.raises(ValueError, match="layout: spans overlap"):
            self.raw(host_backend, offsets=[0, 2, 8, 12, 16, 18])

    def test_gapped_spans(self, host_backend):
        with pytest.raises(ValueError, match="layout: spans leave a gap"):
            self.raw(host_backend, offsets=[0, 4, 8, 13, 16, 18])

    def test_span_outside(self, host_backend):
        with pytest.raises(ValueError, match="outside the packed axis"):
            self.raw(host_backend, offsets=[0, 4, 8, 12, 16, 19])
        with pytest.raises(ValueError, match="head_offsets"):
            self.raw(host_backend, offsets=[0, 4, 8])

    def test_x_dtype_and_weight_dtype(self, host_backend):
        with pytest.raises(TypeError, match="x must be"):
            self.call(host_backend, x=self.args["x"].to(torch.int32))
        with pytest.raises(TypeError, match="weight must have the dtype of x"):
            self.call(host_backend, weight=self.args["weight"].double())

    def test_small_param_dtype_and_shape(self, host_backend):
        with pytest.raises(TypeError, match="bias"):
            self.call(host_backend, bias=self.args["bias"].double())
        with pytest.raises(ValueError, match="bias"):
            self.call(host_backend, bias=self.args["bias"][:5])
        with pytest.raises(ValueError, match="q_norm"):
            self.call(host_backend, q_norm=torch.ones(5))
        with pytest.raises(ValueError, match="k_norm"):
            self.call(host_backend, k_norm=torch.ones(2, 2))
        with pytest.raises(ValueError, match="norm_eps"):
            self.call(host_backend, norm_eps=0.0)

    def test_rope(self, host_backend):
        cos, sin = self.kw["rope"]
        with pytest.raises(ValueError, match="rope cos"):
            self.call(host_backend, rope=(cos[:2], sin))
        with pytest.raises(ValueError, match="rope"):
            self.call(host_backend, rope=(cos,))
        odd = QKVLayout(2, 2, 3, 2)
        args, _ = make_case(odd, 2, 3, 6)
        # A table wider than the head (partial rotary takes R <= head_dim, R even).
        with pytest.raises(ValueError, match=r"rotary_dim \(the tables' last dim\) must be even and in \[2, head_dim"):
            host_backend.qkv_project(args["x"], args["weight"], layout=odd, rope=rope_tables(3, 4))

    def test_last_dim_stride(self, host_backend):
        x = self.args["x"]
        with pytest.raises(ValueError, match="x must have a stride-1 last dim"):
            self.call(host_backend, x=x.transpose(1, 2).contiguous().transpose(1, 2))
        w = self.args["weight"]
        with pytest.raises(ValueError, match="weight must have a stride-1 last dim"):
            self.call(host_backend, weight=w.t().contiguous().t())

    def test_x_not_3d_and_layout_type(self, host_backend):
        with pytest.raises(ValueError, match="x must be a 3-D"):
            self.call(host_backend, x=self.args["x"][0])
        with pytest.raises(ValueError, match="layout must be a headwise.QKVLayout"):
            self.call(host_backend, layout=(2, 2, 4))

    def test_double_rejected_by_sim(self):
        sim = headwise.testing.backend("sim")
        args, kw = make_case(self.layout, 2, 3, 6, dtype=torch.float64, norm=False, rope=False)
        with pytest.raises(TypeError, match="x"):
            sim.qkv_project(args["x"], args["weight"], args["bias"], **kw)

    def test_device_mismatch(self):
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        with pytest.raises(RuntimeError, match="weight"):
            self.call(headwise.testing.backend("cuda"), x=self.args["x"].cuda())


def test_autocast_policy_casts_the_gemm_operands(host_backend):
    # Like nn.Linear: inside autocast the GEMM operands go to the autocast dtype; the
    # fp32 norm weights and rope tables are used as given.
    layout = QKVLayout(4, 2, 8)
    args, kw = make_case(layout, 2, 5, 37)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = host_backend.qkv_project(*args.values(), **kw)
        q_only = host_backend.q_project(args["x"], args["weight"][:32], args["bias"][:32], layout=layout,
                                        q_norm=kw["q_norm"], rope=kw["rope"], scale_q=kw["scale_q"])
    want = host_backend.qkv_project(*(t.bfloat16() for t in args.values()), **kw)
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16 and torch.equal(g, w)
    assert torch.equal(q_only, want[0])
