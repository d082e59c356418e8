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
