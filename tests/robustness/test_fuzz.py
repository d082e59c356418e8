"""Hypothesis fuzzing: reference vs CPU kernel vs emulated CUDA kernel over shapes,
strides and dtypes. Bounded so that CI stays fast: small shapes and a fixed,
derandomized set of HEADWISE_FUZZ_EXAMPLES examples per op (default 20; raise it to fuzz
longer). A failure prints the shrunk example."""

import os

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from headwise import QKVLayout, reference  # noqa: E402
from headwise.testing import backend, rel_err  # noqa: E402

BACKENDS = [backend("cpu"), backend("sim")]
TOL = {torch.float32: 2e-5, torch.bfloat16: 2 ** -5}
SETTINGS = settings(max_examples=int(os.environ.get("HEADWISE_FUZZ_EXAMPLES", "20")), deadline=None,
                    derandomize=True)


def grads_of(fn, leaves, grad):
    leaves = [x.detach().clone().requires_grad_() for x in leaves]
    out = fn(*leaves)
    out.backward(grad)
    return [out.detach()] + [x.grad for x in leaves]


@st.composite
def mhar_cases(draw):
    n = draw(st.integers(1, 6))
    b = draw(st.integers(1, 3))
    t = draw(st.integers(1, 6))
    h = draw(st.sampled_from([1, 2, 3, 4]))
    k = draw(st.sampled_from([1, 3, 5, 8, 16]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    layout = draw(st.sampled_from(["contiguous", "btnd", "padded"]))
    num_sources = draw(st.integers(1, n))
    residual = draw(st.booleans())
    gate = draw(st.sampled_from([None, 0.0, 0.7]))
    seed = draw(st.integers(0, 2 ** 16))
    return n, b, t, h * k, h, dtype, layout, num_sources, residual, gate, seed


def make_sources(n, b, t, d, dtype, layout, gen):
    if layout == "btnd":  # [B, T, N, d] memory viewed as [N, B, T, d]
        return torch.randn(b, t, n, d, generator=gen).to(dtype).permute(2, 0, 1, 3)
    if layout == "padded":  # rows of d + 3 elements, every stride odd
        return torch.randn(n, b, t, d + 3, generator=gen).to(dtype)[..., 1:d + 1]
    return torch.randn(n, b, t, d, generator=gen).to(dtype)


@SETTINGS
@given(mhar_cases())
def test_mhar_route_fuzz(case):
    n, b, t, d, h, dtype, layout, num_sources, residual, gate, seed = case
    gen = torch.Generator().manual_seed(seed)
    sources = make_sources(n, b, t, d, dtype, layout, gen)
    query = 0.5 * torch.randn(d, generator=gen)
    norm_weight = 1 + 0.1 * torch.randn(d, generator=gen)
    res = torch.randn(b, t, d, generator=gen).to(dtype) if residual else None
    gate_t = None if gate is None else torch.tensor([gate])
    grad = torch.randn(b, t, d, generator=gen).to(dtype)
    kw = dict(num_heads=h, num_sources=num_sources, residual=res, gate=gate_t)
    want = grads_of(lambda s, q, g: reference.mhar_route(s, q, g, **kw), (sources, query, norm_weight), grad)
    for ops in BACKENDS:
        got = grads_of(lambda s, q, g: ops.mhar_route(s, q, g, **kw), (sources, query, norm_weight), grad)
        for name, x, y in zip(("out", "sources", "query", "norm_weight"), got, want):
            assert x.dtype == y.dtype and rel_err(x, y) <= TOL[dtype], (ops.ns, name, rel_err(x, y))


@st.composite
def qkv_cases(draw):
    hkv = draw(st.integers(1, 3))
    hq = hkv * draw(st.integers(1, 3))
    d = draw(st.sampled_from([2, 4, 6, 16]))
    dv = draw(st.sampled_from([None, 3, 8]))
    order = draw(st.permutations(["q", "k", "v"]))
    interleave = draw(st.sampled_from([None, "kv_group"]))
    if interleave:
        order = ["q", "k", "v"]
    layout = QKVLayout(hq, hkv, d, dv, order=tuple(order), interleave=interleave)
    b, s, d_model = draw(st.integers(1, 2)), draw(st.integers(1, 7)), draw(st.sampled_from([3, 8, 13]))
    return (layout, b, s, d_model, draw(st.booleans()), draw(st.booleans()), draw(st.booleans()),
            draw(st.sampled_from([torch.float32, torch.bfloat16])), draw(st.booleans()), draw(st.integers(0, 2 ** 16)))


@SETTINGS
@given(qkv_cases())
def test_qkv_project_fuzz(case):
    layout, b, s, d_model, bias, norm, rope, dtype, strided_x, seed = case
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, d_model + (2 if strided_x else 0), generator=gen).to(dtype)[..., :d_model]
    weight = (torch.randn(layout.num_rows, d_model, generator=gen) / d_model ** 0.5).to(dtype)
    leaves = [x, weight] + ([torch.randn(layout.num_rows, generator=gen).to(dtype)] if bias else [])
    kw = dict(layout=layout, scale_q=0.5)
    if norm:
        kw.update(q_norm=1 + 0.1 * torch.randn(layout.head_dim, generator=gen),
                  k_norm=1 + 0.1 * torch.randn(layout.head_dim, generator=gen))
    if rope:
        ang = torch.randn(s, layout.head_dim // 2, generator=gen).repeat(1, 2)
        kw["rope"] = (ang.cos(), ang.sin())
    head_grads = None

    def run(fn):
        nonlocal head_grads
        ls = [t.detach().clone().requires_grad_() for t in leaves]
        outs = fn(*ls, **kw)
        if head_grads is None:
            head_grads = [torch.randn(o.shape, generator=gen).to(dtype) for o in outs]
        torch.autograd.backward(outs, head_grads)
        return [o.detach() for o in outs] + [t.grad for t in ls]

    want = run(reference.qkv_project)
    for ops in BACKENDS:
        got = run(ops.qkv_project)
        for i, (x_, y_) in enumerate(zip(got, want)):
            assert x_.dtype == y_.dtype and rel_err(x_, y_) <= TOL[dtype] * (4 if i >= 3 else 1), (ops.ns, i)


def autograd_grads(out, leaves, grad):
    """Gradients by torch.autograd.grad: returned as the backward computed them (no
    AccumulateGrad layout contract re-striding them), so their strides can be checked."""
    need = [x for x in leaves if x is not None]
    got = iter(torch.autograd.grad(out, need, grad))
    return [None if x is None else next(got) for x in leaves]


@st.composite
def merge_cases(draw):
    b = draw(st.integers(1, 3))
    h = draw(st.integers(1, 5))
    q = draw(st.integers(1, 9))
    dv = draw(st.sampled_from([1, 2, 3, 5, 8, 16]))
    d = draw(st.sampled_from([1, 3, 7, 13, 33, 70]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    layout = draw(st.sampled_from(["contiguous", "bqhd", "padded"]))
    gate_kind = draw(st.sampled_from([None, "h", "bh"]))
    # Exact zeros (closed heads) and non-binary values; dyadic except 0.7, so that every
    # rescale sum S = sum_h g is exact and S = 1 (the clip's edge) is decided alike.
    values = st.sampled_from([0.0, 0.0, 0.25, 0.5, 0.7, 1.0, 1.5])
    gate_shape = {None: 0, "h": h, "bh": b * h}[gate_kind]
    gate = draw(st.lists(values, min_size=gate_shape, max_size=gate_shape))
    gate_dtype = draw(st.sampled_from([torch.float32, dtype]))
    return (b, h, q, dv, d, dtype, layout, gate_kind, gate, gate_dtype, draw(st.booleans()), draw(st.booleans()),
            draw(st.booleans()), draw(st.integers(0, 2 ** 16)))


def make_z(b, h, q, dv, dtype, layout, gen):
    if layout == "bqhd":  # [B, Q, H, Dv] memory viewed as [B, H, Q, Dv] (read in place)
        return torch.randn(b, q, h, dv, generator=gen).to(dtype).transpose(1, 2)
    if layout == "padded":  # a non-dense slice: odd strides, stride-1 last dim
        return torch.randn(b, h + 1, q, dv + 3, generator=gen).to(dtype)[:, 1:, :, 2:dv + 2]
    return torch.randn(b, h, q, dv, generator=gen).to(dtype)


@SETTINGS
@given(merge_cases())
def test_head_merge_fuzz(case):
    b, h, q, dv, d, dtype, layout, gate_kind, gate, gate_dtype, rescale, bias, stats, seed = case
    gen = torch.Generator().manual_seed(seed)
    z = make_z(b, h, q, dv, dtype, layout, gen)
    weight_o = (torch.randn(d, h * dv, generator=gen) / (h * dv) ** 0.5).to(dtype)
    bias_t = torch.randn(d, generator=gen).to(dtype) if bias else None
    gate_t = None if gate_kind is None else torch.tensor(gate, dtype=gate_dtype).view(-1, h).view(
        (h,) if gate_kind == "h" else (b, h))
    grad = torch.randn(b, q, d, generator=gen).to(dtype)

    def run(fn):
        # detach() keeps z's strides (a clone would re-stride the padded view).
        leaves = [None if x is None else x.detach().requires_grad_() for x in (z, weight_o, bias_t, gate_t)]
        res = fn(leaves[0], leaves[1], leaves[2], head_gate=leaves[3], rescale=rescale, return_stats=stats)
        out, st_ = res if stats else (res, None)
        return out.detach(), st_, autograd_grads(out, leaves, grad)

    want_out, want_stats, want_grads = run(reference.head_merge)
    # The gate's gradient combines c[b,h] = <Z_bh, grad_b @ W_h^T>, times s <= H under
    # rescale, where it can cancel to exactly 0 (H = 1: alpha = g * H / g = 1).
    c = torch.einsum("bhqk,bqn,nhk->bh", z.double(), grad.double(), weight_o.double().view(d, h, dv))
    gate_scale = (h if rescale else 1) * c.abs().max().item()
    for ops in BACKENDS:
        out, st_, grads = run(ops.head_merge)
        assert out.dtype == dtype and rel_err(out, want_out) <= TOL[dtype], (ops.ns, "out", rel_err(out, want_out))
        if stats:
            stat_tol = 1e-4 if dtype == torch.float32 else 1e-3  # out_norm: Gram identity on the CPU kernel
            for name, x, y in zip(("z_norm", "out_norm"), st_, want_stats):
                assert x.dtype == torch.float32 and rel_err(x, y) <= stat_tol, (ops.ns, name, rel_err(x, y))
        for name, x, y in zip(("z", "weight_o", "bias", "gate"), grads, want_grads):
            if y is None:
                assert x is None
                continue
            err = rel_err(x, y)
            if name == "gate":  # a difference of terms under rescale: measured on their scale
                err = (x.double() - y.double()).abs().max().item() / max(y.abs().max().item(), gate_scale)
            assert x.dtype == y.dtype and err <= 4 * TOL[dtype], (ops.ns, name, err)
        # grad_z is allocated in z's layout: z's own strides when z is dense (the transposed
        # [B, Q, H, Dv] view included), else empty_like's suggested layout.
        assert grads[0].stride() == torch.empty_like(z).stride(), (ops.ns, grads[0].stride(), z.stride())
        if layout != "padded":
            assert grads[0].stride() == z.stride()


def make_dcmha_weights(b, t, h, dtype, gen, scale=0.3):
    """Dynamic weights of the magnitude DCMHA reaches in training, as tests/dcmha's
    make_weights builds them: w1 RMS-normalized over heads, w2 and g small."""
    from headwise import DCMHAWeights

    w1 = torch.randn(b, t, 4, 2, h, generator=gen, dtype=torch.float64)
    w1 = w1 * torch.rsqrt(w1.square().mean(-1, keepdim=True) + 1e-6)
    w2 = scale * torch.randn(b, t, 4, 2, h, generator=gen, dtype=torch.float64) / h
    g = scale * torch.randn(b, t, 4, h, generator=gen, dtype=torch.float64)
    return DCMHAWeights(*(x.to(dtype) for x in (w1, w2, g)))


def make_heads(b, h, t, d, dtype, layout, gen):
    """[B, H, T, d] contiguous, as a transposed view of [B, T, H, d] memory, or padded."""
    if layout == "bthd":
        return torch.randn(b, t, h, d, generator=gen).to(dtype).transpose(1, 2)
    if layout == "padded":
        return torch.randn(b, h, t, d + 2, generator=gen).to(dtype)[..., 1:d + 1]
    return torch.randn(b, h, t, d, generator=gen).to(dtype)


@st.composite
def dcmha_heads(draw):
    h = draw(st.sampled_from([2, 3, 4, 6]))
    groups = draw(st.sampled_from([g for g in (1, 2, 3) if h % g == 0]))
    return h, groups


@st.composite
def compose_cases(draw):
    h, groups = draw(dcmha_heads())
    return (draw(st.integers(1, 2)), h, groups, draw(st.sampled_from([1, 3, 5, 7, 11])),
            draw(st.sampled_from(["pre", "post"])), draw(st.sampled_from([torch.float32, torch.bfloat16])),
            draw(st.sampled_from(["contiguous", "tbhs", "padded"])), draw(st.integers(0, 2 ** 16)))


@SETTINGS
@given(compose_cases())
def test_dcmha_compose_fuzz(case):
    from headwise import DCMHAWeights

    b, h, groups, t, slot, dtype, layout, seed = case
    gen = torch.Generator().manual_seed(seed)
    if layout == "tbhs":  # [T, B, H, S] memory viewed as [B, H, T, S]
        a = torch.randn(t, b, h, t, generator=gen).to(dtype).permute(1, 2, 0, 3)
    elif layout == "padded":
        a = torch.randn(b, h, t, t + 3, generator=gen).to(dtype)[..., 2:t + 2]
    else:
        a = torch.randn(b, h, t, t, generator=gen).to(dtype)
    w = make_dcmha_weights(b, t, h, dtype, gen)
    grad = torch.randn(b, h, t, t, generator=gen).to(dtype)

    def run(fn):
        leaves = [x.detach().requires_grad_() for x in (a, *w)]
        out = fn(leaves[0], DCMHAWeights(*leaves[1:]), slot, head_groups=groups)
        return [out.detach()] + autograd_grads(out, leaves, grad)

    want = run(reference.dcmha_compose)
    for ops in BACKENDS:
        for name, x, y in zip(("out", "a", "w1", "w2", "g"), run(ops.dcmha_compose), want):
            assert x.dtype == y.dtype and rel_err(x, y) <= TOL[dtype] * (1 if name == "out" else 4), \
                (ops.ns, name, rel_err(x, y))


@st.composite
def attention_cases(draw):
    h, groups = draw(dcmha_heads())
    return (draw(st.integers(1, 2)), h, groups, draw(st.sampled_from([1, 3, 5, 7, 9, 13])),
            draw(st.sampled_from([1, 3, 4, 8])), draw(st.sampled_from([1, 2, 5, 8])), draw(st.booleans()),
            draw(st.sampled_from([None, 1, 2, 3, 5])), draw(st.sampled_from([torch.float32, torch.bfloat16])),
            draw(st.sampled_from(["contiguous", "bthd", "padded"])), draw(st.integers(0, 2 ** 16)))


@SETTINGS
@given(attention_cases())
def test_dcmha_attention_fuzz(case):
    from headwise import DCMHAWeights

    b, h, groups, t, dh, dv, causal, window, dtype, layout, seed = case
    gen = torch.Generator().manual_seed(seed)
    q, k = (make_heads(b, h, t, dh, dtype, layout, gen) for _ in range(2))
    v = make_heads(b, h, t, dv, dtype, layout, gen)
    w = make_dcmha_weights(b, t, h, dtype, gen)
    grad = torch.randn(b, h, t, dv, generator=gen).to(dtype)
    kw = dict(causal=causal, window=window, head_groups=groups)

    def run(fn):
        leaves = [x.detach().requires_grad_() for x in (q, k, v, *w)]
        out = fn(*leaves[:3], DCMHAWeights(*leaves[3:]), **kw)
        return [out.detach()] + autograd_grads(out, leaves, grad)

    want = run(reference.dcmha_attention)
    for ops in BACKENDS:
        for name, x, y in zip(("out", "q", "k", "v", "w1", "w2", "g"), run(ops.dcmha_attention), want):
            assert x.dtype == y.dtype and rel_err(x, y) <= TOL[dtype] * (1 if name == "out" else 4), \
                (ops.ns, name, rel_err(x, y))
