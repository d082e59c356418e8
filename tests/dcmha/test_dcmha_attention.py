"""headwise.dcmha_attention (SPEC section 5): the fused two-pass CPU kernel against the
materializing reference (output and every gradient), plain attention at zero dynamic
weights, window semantics, and the memory contract (no [B, H, T, T] saved or allocated).

These run the CPU kernel ("cpu" backend); test_dcmha_attention_sim.py runs the CUDA
kernels under the SIMT emulator against the same reference."""

import math

import pytest
import torch
import torch.nn.functional as F

import headwise
from headwise import DCMHAWeights, reference
from headwise.testing import rel_err, with_one_and_many_threads

from dcmha_helpers import make_weights

FP32_TOL = 5e-6
OPS = headwise.testing.backend("cpu")


def make_qkv(b, h, t, dh, dv=None, *, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dv = dh if dv is None else dv
    q = torch.randn(b, h, t, dh, generator=gen)
    k = torch.randn(b, h, t, dh, generator=gen)
    v = torch.randn(b, h, t, dv, generator=gen)
    return [x.to(dtype) for x in (q, k, v)]


def _fwd_bwd(fn, q, k, v, w, grad, **kw):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, *w)]
    out = fn(*leaves[:3], DCMHAWeights(*leaves[3:]), **kw)
    out.backward(grad)
    return [out.detach()] + [x.grad for x in leaves]


NAMES = ["out", "grad q", "grad k", "grad v", "grad w1", "grad w2", "grad g"]

CASES = [
    pytest.param(1, 2, 3, 4, 4, {}, id="T3-H2"),
    pytest.param(2, 4, 5, 8, 6, {}, id="T5-H4-dv6"),
    pytest.param(1, 8, 37, 16, 16, {}, id="T37-H8"),
    pytest.param(1, 16, 37, 8, 8, dict(head_groups=4), id="T37-H16-groups4"),
    pytest.param(1, 32, 37, 4, 4, {}, id="T37-H32"),
    pytest.param(1, 3, 123, 16, 8, {}, id="T123-H3"),
    pytest.param(2, 4, 123, 8, 8, dict(window=70), id="T123-window70"),
    pytest.param(1, 4, 123, 8, 8, dict(window=1), id="T123-window1"),
    pytest.param(1, 4, 37, 8, 8, dict(window=5, head_groups=2), id="T37-window5-groups2"),
    pytest.param(1, 4, 70, 8, 8, dict(causal=False), id="T70-noncausal"),
    pytest.param(1, 2, 5, 8, 8, dict(scale=0.9), id="T5-scale"),
    pytest.param(1, 8, 1, 8, 8, {}, id="T1"),
]


@pytest.mark.parametrize("b,h,t,dh,dv,kw", CASES)
def test_fused_matches_materializing_reference(b, h, t, dh, dv, kw):
    q, k, v = make_qkv(b, h, t, dh, dv, seed=t + h)
    w = make_weights(b, t, h, seed=h)
    grad = torch.randn(b, h, t, dv, generator=torch.Generator().manual_seed(7))
    got = _fwd_bwd(OPS.dcmha_attention, q, k, v, w, grad, **kw)
    want = _fwd_bwd(reference.dcmha_attention, q, k, v, w, grad, **kw)
    for name, x, y in zip(NAMES, got, want):
        err = rel_err(x, y)
        assert err <= FP32_TOL, f"{name}: relative error {err:.3g}"


@pytest.mark.parametrize("h", [2, 4, 8, 16, 32])
def test_heads(h):
    q, k, v = make_qkv(1, h, 37, 8, seed=h)
    w = make_weights(1, 37, h, seed=h)
    grad = torch.randn(1, h, 37, 8)
    got = _fwd_bwd(OPS.dcmha_attention, q, k, v, w, grad)
    want = _fwd_bwd(reference.dcmha_attention, q, k, v, w, grad)
    for name, x, y in zip(NAMES, got, want):
        assert rel_err(x, y) <= FP32_TOL, name


def test_zero_weights_give_plain_attention():
    q, k, v = make_qkv(2, 4, 37, 16)
    w = DCMHAWeights.zeros(2, 37, 4)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = reference.dcmha_attention(q, k, v, w)
    fused = OPS.dcmha_attention(q, k, v, w)
    assert rel_err(ref, sdpa) <= 1e-6
    assert rel_err(fused, sdpa) <= 1e-6
    # In float64 the compose is the identity and both agree to rounding.
    q64, k64, v64 = (x.double() for x in (q, k, v))
    w64 = DCMHAWeights.zeros(2, 37, 4, dtype=torch.float64)
    sdpa64 = F.scaled_dot_product_attention(q64, k64, v64, is_causal=True)
    assert rel_err(OPS.dcmha_attention(q64, k64, v64, w64), sdpa64) <= 1e-13


def test_window_semantics():
    # window=W reads the W keys t-W < s <= t, self included: W=1 returns v itself (zero
    # weights), and a window of at least T is plain causal attention.
    q, k, v = make_qkv(1, 2, 9, 4)
    w = DCMHAWeights.zeros(1, 9, 2)
    assert torch.allclose(OPS.dcmha_attention(q, k, v, w, window=1), v, atol=1e-6)
    assert torch.equal(OPS.dcmha_attention(q, k, v, w, window=9), OPS.dcmha_attention(q, k, v, w))
    keep = reference.dcmha_mask(9, 9, window=3)
    assert keep[5].nonzero().flatten().tolist() == [3, 4, 5]
    # W = 3 equals SDPA with the explicit band mask.
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    assert rel_err(OPS.dcmha_attention(q, k, v, w, window=3), sdpa) <= 1e-6


def test_single_token_sequence():
    # T = 1: one key, the row's own. (A fully masked row cannot occur in self-attention
    # with these masks, since key t is always in row t's band; the kernels' 0 convention
    # for such rows is therefore not exercised by any test.)
    q, k, v = make_qkv(1, 2, 1, 4)
    w = make_weights(1, 1, 2)
    assert rel_err(OPS.dcmha_attention(q, k, v, w), reference.dcmha_attention(q, k, v, w)) <= FP32_TOL


def test_gradcheck_float64_cpu_kernel():
    q, k, v = (x.double().requires_grad_() for x in make_qkv(1, 4, 5, 3))
    w = [x.requires_grad_() for x in make_weights(1, 5, 4, dtype=torch.float64, scale=0.8)]
    for kw in (dict(), dict(window=2, head_groups=2), dict(causal=False)):
        fn = lambda q, k, v, w1, w2, g: OPS.dcmha_attention(q, k, v, DCMHAWeights(w1, w2, g), **kw)  # noqa: E731
        assert torch.autograd.gradcheck(fn, (q, k, v, *w))


def test_opcheck():
    q, k, v = (x.requires_grad_() for x in make_qkv(2, 4, 5, 8))
    w = [x.requires_grad_() for x in make_weights(2, 5, 4)]
    op = torch.ops.headwise.dcmha_attention
    for args in ((True, 0, 0.35, 1), (True, 2, 0.35, 2), (False, 0, 1.0, 1)):
        torch.library.opcheck(op, (q, k, v, *w, *args))


def test_saves_no_score_tensor():
    b, h, t, d = 1, 4, 64, 8
    q, k, v = (x.requires_grad_() for x in make_qkv(b, h, t, d))
    w = [x.requires_grad_() for x in make_weights(b, t, h)]
    saved = []

    def pack(x):
        saved.append(tuple(x.shape))
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        OPS.dcmha_attention(q, k, v, DCMHAWeights(*w))
    assert saved, "nothing saved"
    for shape in saved:
        assert math.prod(shape) <= 4 * b * h * t * max(d, 8), f"saved {shape}"
    assert (2, b, h, t) in saved  # the row statistics


def test_allocations_are_linear_in_t():
    # The largest allocation of any single aten call (torch's CPU allocator, forward and
    # backward) is O(B H T), never B H T T; the kernels' own tile scratch is O(H tile^2).
    b, h, t, d = 1, 4, 256, 8
    q, k, v = (x.requires_grad_() for x in make_qkv(b, h, t, d))
    w = [x.requires_grad_() for x in make_weights(b, t, h)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        out = OPS.dcmha_attention(q, k, v, DCMHAWeights(*w))
        out.sum().backward()
    allocs = [e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0]
    assert allocs, "the profiler saw no allocation"
    assert max(allocs) < b * h * t * t * 4 // 8, max(allocs)
    # Against the reference, which does allocate [B, H, T, T].
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        reference.dcmha_attention(q, k, v, DCMHAWeights(*w)).sum().backward()
    ref_allocs = [e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0]
    assert max(ref_allocs) >= b * h * t * t * 4


def _run(seed=0):
    q, k, v = make_qkv(2, 4, 150, 8, seed=seed)
    w = make_weights(2, 150, 4)
    grad = torch.randn(2, 4, 150, 8, generator=torch.Generator().manual_seed(seed))
    return _fwd_bwd(OPS.dcmha_attention, q, k, v, w, grad, window=90)


def test_deterministic_across_thread_counts():
    one, many = with_one_and_many_threads(_run)
    for x, y in zip(one, many):
        assert torch.equal(x, y)


def test_bf16_close_to_reference():
    q, k, v = make_qkv(1, 4, 37, 16)
    w = make_weights(1, 37, 4)
    want = reference.dcmha_attention(q.double(), k.double(), v.double(), DCMHAWeights(*(x.double() for x in w)))
    got = OPS.dcmha_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), DCMHAWeights(*(x.bfloat16() for x in w)))
    assert got.dtype == torch.bfloat16
    assert rel_err(got, want) <= 2e-2


def test_compiles_fullgraph():
    q, k, v = (x.requires_grad_() for x in make_qkv(1, 4, 5, 8))
    w = make_weights(1, 5, 4)

    def step(q, k, v, w1, w2, g):
        return OPS.dcmha_attention(q, k, v, DCMHAWeights(w1, w2, g), window=3).square().sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    compiled(q, k, v, *w).backward()
    got = q.grad.clone()
    q.grad = None
    step(q, k, v, *w).backward()
    assert torch.equal(got, q.grad)


class TestBadInput:
    def call(self, q=None, k=None, v=None, w=None, **kw):
        q0, k0, v0 = make_qkv(1, 4, 5, 8)
        w = make_weights(1, 5, 4) if w is None else w
        return OPS.dcmha_attention(q0 if q is None else q, k0 if k is None else k, v0 if v is None else v, w, **kw)

    def test_k_shape(self):
        with pytest.raises(ValueError, match="k must have the shape of q"):
            self.call(k=torch.randn(1, 4, 6, 8))

    def test_v_shape(self):
        with pytest.raises(ValueError, match="v dim 2"):
            self.call(v=torch.randn(1, 4, 6, 8))

    def test_q_not_4d(self):
        with pytest.raises(ValueError, match="q must be a 4-D"):
            self.call(q=torch.randn(4, 5, 8))

    def test_window(self):
        with pytest.raises(ValueError, match="window"):
            self.call(window=0)

    def test_groups(self):
        with pytest.raises(ValueError, match="head_groups"):
            self.call(head_groups=3)

    def test_weights_shape(self):
        w = make_weights(1, 6, 4)
        with pytest.raises(ValueError, match="weights.w1 dim 1 must equal T"):
            self.call(w=w)

    def test_dtype(self):
        with pytest.raises(TypeError, match="v must have the dtype of q"):
            self.call(v=torch.randn(1, 4, 5, 8, dtype=torch.float64))


@pytest.mark.parametrize("op", ["attention", "compose"])
def test_autocast_casts_inputs_and_weights(host_backend, op):
    # Like F.scaled_dot_product_attention: inside autocast q, k, v (or a) and the dynamic
    # weights go to the autocast dtype (the kernels take the weights in the inputs' dtype).
    q, k, v = make_qkv(2, 4, 7, 8)
    w = make_weights(2, 7, 4)
    if op == "attention":
        run = lambda q, k, v, w: host_backend.dcmha_attention(q, k, v, w, window=3)  # noqa: E731
    else:
        a = q @ k.transpose(-1, -2)
        run = lambda q, k, v, w: host_backend.dcmha_compose(a if q.dtype == torch.float32 else a.bfloat16(), w)  # noqa: E731
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = run(q, k, v, w)
    want = run(q.bfloat16(), k.bfloat16(), v.bfloat16(), DCMHAWeights(*(t.bfloat16() for t in w)))
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


@pytest.mark.parametrize("t,chunk,kw", [(37, 16, {}), (64, 32, dict(window=9, head_groups=2)),
                                        (23, 5, dict(causal=False))])
def test_query_chunks_formulation_is_the_same_math(t, chunk, kw):
    # DCFormer's query-chunked formulation (the baseline of bench.targets) against the
    # whole-sequence oracle, in float64, values and gradients.
    gen = torch.Generator().manual_seed(t)
    leaves = [torch.randn(1, 4, t, 8, generator=gen, dtype=torch.float64) for _ in range(3)]
    leaves += list(make_weights(1, t, 4, dtype=torch.float64, seed=t))
    grad = torch.randn(1, 4, t, 8, generator=gen, dtype=torch.float64)

    def run(fn, **extra):
        xs = [x.clone().requires_grad_() for x in leaves]
        out = fn(*xs[:3], DCMHAWeights(*xs[3:]), **kw, **extra)
        out.backward(grad)
        return [out.detach()] + [x.grad for x in xs]

    for x, y in zip(run(reference.dcmha_attention_query_chunks, chunk=chunk), run(reference.dcmha_attention)):
        assert rel_err(x, y) <= 1e-12
