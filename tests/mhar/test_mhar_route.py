"""headwise.mhar_route (SPEC section 4): every backend against headwise.reference."""

import math

import pytest
import torch

import headwise
from headwise import reference
from headwise.testing import rel_err, with_one_and_many_threads

# (N, B, T, d, H): odd sizes, and one case per kernel layout of the CUDA kernel:
# vec8 + lane segments, vec8 + whole warps per head, vec8 + generic, scalar + segments,
# scalar + generic; N up to 65, d up to 8192.
SHAPES = [
    pytest.param(3, 2, 5, 96, 3, id="N3-d96-H3-vec8-segment"),
    pytest.param(5, 2, 37, 123, 3, id="N5-T37-d123-H3-scalar-generic"),
    pytest.param(9, 1, 3, 1024, 8, id="N9-d1024-H8-vec8-segment"),
    pytest.param(4, 1, 3, 2048, 2, id="N4-d2048-H2-vec8-warps"),
    pytest.param(2, 3, 1, 96, 4, id="N2-d96-H4-vec8-generic"),
    pytest.param(7, 1, 5, 20, 5, id="N7-d20-H5-scalar-segment"),
    pytest.param(1, 2, 3, 37, 1, id="N1-d37-H1"),
    pytest.param(65, 1, 2, 64, 1, id="N65-d64-H1-attnres"),
    pytest.param(3, 1, 1, 8192, 8, id="N3-d8192-H8"),
    pytest.param(3, 1, 2, 8190, 2, id="N3-d8190-H2-scalar-generic-512-threads"),
    # The backward keeps a position's rows in shared memory between its passes when they
    # fit (100 KiB); 26 fp32 rows of d = 2048 do not: pass 2 rereads them.
    pytest.param(26, 1, 2, 2048, 8, id="N26-d2048-H8-rows-not-staged"),
    # 111 positions: the parameter gradients' 16-position segments end in a partial one.
    pytest.param(5, 3, 37, 96, 3, id="N5-B3-T37-segment-tail"),
    # More positions than the forward's 1024 blocks: blocks loop over positions.
    pytest.param(2, 1, 1100, 16, 2, id="N2-T1100-d16-blocks-loop"),
    # ... and across batch rows: a block's next position is 146 rows and 2 steps on
    # (1024 = 146 * 7 + 2), so its (b, t) steps wrap t (block 5: (0, 5) -> (147, 0)).
    pytest.param(2, 200, 7, 16, 2, id="N2-B200-T7-d16-blocks-loop-rows"),
]

FP32_TOL = 2e-6


def make_inputs(n, b, t, d, dtype=torch.float32, device="cpu", seed=0, qscale=0.3):
    gen = torch.Generator().manual_seed(seed)
    # Sources with different scales per row, like residual states of growing norm.
    scales = torch.linspace(0.5, 3.0, n).view(n, 1, 1, 1)
    sources = (torch.randn(n, b, t, d, generator=gen) * scales).to(dtype).to(device)
    query = (torch.randn(d, generator=gen) * qscale).to(device)
    norm_weight = (1.0 + 0.1 * torch.randn(d, generator=gen)).to(device)
    return sources, query, norm_weight


def check_against_reference(ops, n, b, t, d, h, *, num_sources=None, residual=False, tol=FP32_TOL):
    # Logit std about min(0.3 sqrt(K), 1.5): the fp32 reference itself is only ~1e-6 from
    # the fp64 truth, and a near one-hot softmax amplifies every reduction-order
    # difference; test_as_accurate_as_reference covers peaked softmaxes against fp64.
    qscale = min(0.3, 1.5 / math.sqrt(d // h))
    sources, query, norm_weight = make_inputs(n, b, t, d, device=ops.device, qscale=qscale)
    gen = torch.Generator().manual_seed(1)
    res = torch.randn(b, t, d, generator=gen).to(ops.device) if residual else None
    leaves = [x.clone().requires_grad_() for x in (sources, query, norm_weight)]
    ref_leaves = [x.clone().requires_grad_() for x in (sources, query, norm_weight)]
    kw = dict(num_heads=h, num_sources=num_sources)
    out = ops.mhar_route(*leaves, residual=res, **kw)
    expected = reference.mhar_route(*ref_leaves, residual=res, **kw)
    assert rel_err(out, expected) <= tol
    grad = torch.randn(expected.shape, generator=gen).to(ops.device)
    out.backward(grad)
    expected.backward(grad)
    for name, got, want in zip(("sources", "query", "norm_weight"), leaves, ref_leaves):
        err = rel_err(got.grad, want.grad)
        assert err <= tol, f"grad {name}: relative error {err:.3g} > {tol}"


def _fwd_bwd(fn, sources, query, norm_weight, grad, **kw):
    leaves = [x.clone().requires_grad_() for x in (sources, query, norm_weight)]
    out = fn(*leaves, **kw)
    out.backward(grad.to(out.dtype))
    return [out.detach()] + [x.grad for x in leaves]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("n,b,t,d,h", [(3, 1, 2, 8192, 8), (9, 2, 8, 1024, 8), (65, 1, 2, 64, 1)])
def test_as_accurate_as_reference_against_fp64(backend, seed, n, b, t, d, h):
    # Peaked softmax (logit std 0.3 sqrt(K), up to ~10): the fused fp32 kernels stay as
    # close to the fp64 truth as the fp32 reference does.
    sources, query, norm_weight = make_inputs(n, b, t, d, seed=seed, device=backend.device)
    grad = torch.randn(b, t, d, generator=torch.Generator().manual_seed(seed + 100)).to(backend.device)
    f64 = [x.double() for x in (sources, query, norm_weight)]
    truth = _fwd_bwd(reference.mhar_route, *f64, grad.double(), num_heads=h)
    eager = _fwd_bwd(reference.mhar_route, sources, query, norm_weight, grad, num_heads=h)
    fused = _fwd_bwd(backend.mhar_route, sources, query, norm_weight, grad, num_heads=h)
    for name, f, e, t_ in zip(("out", "sources", "query", "norm_weight"), fused, eager, truth):
        err, ref_err = rel_err(f, t_), rel_err(e, t_)
        assert err <= max(FP32_TOL, 2 * ref_err), f"{name}: fused {err:.3g} vs reference {ref_err:.3g}"


@pytest.mark.parametrize("n,b,t,d,h", SHAPES)
def test_matches_reference_fp32(backend, n, b, t, d, h):
    check_against_reference(backend, n, b, t, d, h)


def test_num_sources_prefix_and_residual(backend):
    # Rows [num_sources, N_max) are not read, and get a zero gradient.
    check_against_reference(backend, 6, 2, 5, 64, 4, num_sources=4, residual=True)


@pytest.mark.parametrize("n,b,t,d,h", [(3, 2, 5, 96, 3), (5, 2, 37, 123, 3), (4, 1, 3, 2048, 2)])
@pytest.mark.parametrize("gate_value", [0.0, -0.7, 1.3])
def test_gate_and_residual_match_reference(backend, n, b, t, d, h, gate_value):
    # Delta modes: out = residual + gate * mix; the gate's gradient is <dout, mix>, also
    # at gate = 0 (the zero-initialized state of a converted model).
    sources, query, norm_weight = make_inputs(n, b, t, d, device=backend.device, qscale=0.2)
    gen = torch.Generator().manual_seed(3)
    residual = torch.randn(b, t, d, generator=gen).to(backend.device)
    gate = torch.tensor(gate_value, device=backend.device)
    grad = torch.randn(b, t, d, generator=gen).to(backend.device)
    results = []
    for fn in (backend.mhar_route, reference.mhar_route):
        leaves = [x.clone().requires_grad_() for x in (sources, query, norm_weight, residual, gate)]
        out = fn(*leaves[:3], num_heads=h, residual=leaves[3], gate=leaves[4])
        out.backward(grad)
        results.append([out.detach()] + [x.grad for x in leaves])
    names = ("out", "sources", "query", "norm_weight", "residual", "gate")
    for name, got, want in zip(names, *results):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        err = rel_err(got, want)
        # The gate's gradient is one fp32 sum over B*T*d terms in both (up to 6144 here, in
        # different orders on the GPU): ~sqrt(n) ulps apart, not 2e-6.
        assert err <= (1e-5 if name == "gate" else FP32_TOL), f"{name}: relative error {err:.3g}"
    if gate_value == 0.0:
        assert torch.equal(results[0][0], residual)
        assert torch.count_nonzero(results[0][1]) == 0  # no gradient reaches the sources through a closed gate


def test_gate_without_residual_and_bf16_gate(backend):
    sources, query, norm_weight = make_inputs(3, 1, 5, 32, device=backend.device)
    mix = backend.mhar_route(sources, query, norm_weight, num_heads=2)
    gate = torch.tensor([0.5], device=backend.device, requires_grad=True)
    out = backend.mhar_route(sources, query, norm_weight, num_heads=2, gate=gate)
    torch.testing.assert_close(out, 0.5 * mix, rtol=1e-6, atol=1e-6)
    out.backward(torch.ones_like(out))
    torch.testing.assert_close(gate.grad, mix.sum().reshape(1), rtol=1e-5, atol=1e-5)
    gate16 = torch.tensor(0.25, dtype=torch.bfloat16, device=backend.device, requires_grad=True)
    out16 = backend.mhar_route(sources.bfloat16(), query, norm_weight, num_heads=2, gate=gate16)
    out16.float().sum().backward()
    assert gate16.grad.dtype == torch.bfloat16 and gate16.grad.shape == ()


def test_strided_sources_read_in_place(backend):
    # A [B, T, N, d] buffer viewed as [N, B, T, d]: non-contiguous, last dim stride 1.
    base = torch.randn(2, 5, 3, 48, device=backend.device)
    sources = base.permute(2, 0, 1, 3)
    _, query, norm_weight = make_inputs(3, 2, 5, 48, device=backend.device)
    out = backend.mhar_route(sources, query, norm_weight, num_heads=2)
    expected = reference.mhar_route(sources, query, norm_weight, num_heads=2)
    assert rel_err(out, expected) <= FP32_TOL


def test_misaligned_sources_use_the_scalar_path(backend):
    # An odd element offset breaks 16-byte alignment: the kernel must fall back, not fault.
    flat = torch.randn(1 + 3 * 2 * 64, device=backend.device)
    sources = flat[1:].view(3, 1, 2, 64)
    _, query, norm_weight = make_inputs(3, 1, 2, 64, device=backend.device)
    out = backend.mhar_route(sources, query, norm_weight, num_heads=1)
    expected = reference.mhar_route(sources, query, norm_weight, num_heads=1)
    assert rel_err(out, expected) <= FP32_TOL


def test_misaligned_grad_out_uses_the_scalar_path(backend):
    # A contiguous gradient at an odd element offset (as cat/reshape backward produce).
    sources, query, norm_weight = make_inputs(3, 2, 4, 64, device=backend.device)
    flat = torch.randn(1 + 2 * 4 * 64, device=backend.device)
    grad = flat[1:].view(2, 4, 64)
    leaves = [x.clone().requires_grad_() for x in (sources, query, norm_weight)]
    ref_leaves = [x.clone().requires_grad_() for x in (sources, query, norm_weight)]
    backend.mhar_route(*leaves, num_heads=2).backward(grad)
    reference.mhar_route(*ref_leaves, num_heads=2).backward(grad)
    for got, want in zip(leaves, ref_leaves):
        assert rel_err(got.grad, want.grad) <= FP32_TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,b,t,d,h", [(3, 2, 5, 96, 3), (5, 1, 37, 123, 3), (9, 1, 3, 1024, 8)])
def test_low_precision_close_to_reference(backend, dtype, n, b, t, d, h):
    sources, query, norm_weight = make_inputs(n, b, t, d, dtype=dtype, device=backend.device)
    out = backend.mhar_route(sources, query, norm_weight, num_heads=h)
    expected = reference.mhar_route(sources, query, norm_weight, num_heads=h)
    assert out.dtype == dtype
    # Both round the output once to the storage dtype from fp32 sums of different order.
    assert rel_err(out, expected) <= 2 ** -7


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bf16_gradients_at_least_as_accurate_as_reference(host_backend, seed):
    n, b, t, d, h = 9, 2, 16, 256, 4
    s64, q64, g64 = (x.double() for x in make_inputs(n, b, t, d, seed=seed))
    grad64 = torch.randn(b, t, d, generator=torch.Generator().manual_seed(seed + 100)).double()
    bf = lambda x: x.bfloat16().double()  # noqa: E731  the bf16-representable ground truth
    truth = _fwd_bwd(reference.mhar_route, bf(s64), q64, g64, bf(grad64), num_heads=h)[1:]
    s, g_out = s64.bfloat16(), grad64.bfloat16()
    fused = _fwd_bwd(host_backend.mhar_route, s, q64.float(), g64.float(), g_out, num_heads=h)[1:]
    eager = _fwd_bwd(reference.mhar_route, s, q64.float(), g64.float(), g_out, num_heads=h)[1:]
    ratios = [rel_err(f, t) / rel_err(e, t) for f, e, t in zip(fused, eager, truth)]
    # Geometric mean of fused/eager error over the three gradients, as the paper reports.
    assert math.exp(sum(math.log(r) for r in ratios) / 3) <= 1.0, ratios


def test_gradcheck_float64_cpu_kernel():
    sources, query, norm_weight = (x.double().requires_grad_() for x in make_inputs(3, 2, 3, 12, qscale=1.0))
    residual = torch.randn(2, 3, 12, dtype=torch.float64, requires_grad=True)
    fn = lambda s, q, g, r: headwise.mhar_route(s, q, g, num_heads=3, residual=r)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (sources, query, norm_weight, residual))
    fn2 = lambda s, q, g: headwise.mhar_route(s, q, g, num_heads=2, num_sources=2)  # noqa: E731
    assert torch.autograd.gradcheck(fn2, (sources, query, norm_weight))
    gate = torch.tensor(0.6, dtype=torch.float64, requires_grad=True)
    fn3 = lambda s, q, g, r, a: headwise.mhar_route(s, q, g, num_heads=3, residual=r, gate=a)  # noqa: E731
    assert torch.autograd.gradcheck(fn3, (sources, query, norm_weight, residual, gate))


def test_opcheck(backend):
    sources, query, norm_weight = make_inputs(3, 2, 5, 48, device=backend.device)
    op = getattr(torch.ops, backend.ns).mhar_route
    residual = torch.randn(2, 5, 48, device=backend.device, requires_grad=True)
    samples = [
        (sources.requires_grad_(), query.requires_grad_(), norm_weight.requires_grad_(), 4, 3, 1e-6, None, None),
        (sources, query, norm_weight, 2, 2, 1e-5, residual, None),
        (sources, query, norm_weight, 4, 3, 1e-6, residual, torch.tensor(0.3, requires_grad=True).to(backend.device)),
    ]
    for args in samples:
        torch.library.opcheck(op, args)


def _run_fwd_bwd(ops, seed=0):
    sources, query, norm_weight = make_inputs(9, 2, 37, 256, seed=seed, device=ops.device)
    leaves = [x.requires_grad_() for x in (sources, query, norm_weight)]
    out = ops.mhar_route(*leaves, num_heads=4)
    out.backward(torch.ones_like(out))
    return [out.detach()] + [x.grad for x in leaves]


def test_bitwise_deterministic(backend):
    first, second = _run_fwd_bwd(backend), _run_fwd_bwd(backend)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_deterministic_across_thread_counts(host_backend):
    one, many = with_one_and_many_threads(lambda: _run_fwd_bwd(host_backend))
    for a, b in zip(one, many):
        assert torch.equal(a, b)


def test_saves_only_routing_weights(host_backend):
    n, b, t, d, h = 5, 2, 7, 64, 4
    sources, query, norm_weight = make_inputs(n, b, t, d)
    leaves = [x.requires_grad_() for x in (sources, query, norm_weight)]
    input_storages = {x.untyped_storage().data_ptr() for x in leaves}
    new_bytes = []

    def pack(x):
        if x.untyped_storage().data_ptr() not in input_storages:
            new_bytes.append((tuple(x.shape), x.dtype, x.numel() * x.element_size()))
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        host_backend.mhar_route(*leaves, num_heads=h)
    assert new_bytes == [((n, b, t, h), torch.float32, n * b * t * h * 4)]


def test_zero_query_gives_exact_mean(backend):
    sources, _, norm_weight = make_inputs(6, 2, 5, 40, device=backend.device)
    query = torch.zeros(40, device=backend.device)
    out = backend.mhar_route(sources, query, norm_weight, num_heads=4)
    torch.testing.assert_close(out, sources.mean(0), rtol=1e-6, atol=1e-6)


def test_worked_example_d4(backend):
    sources = torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0]], device=backend.device).view(2, 1, 1, 4)
    query = torch.tensor([2.0, 0, 0, 0], device=backend.device)
    out = backend.mhar_route(sources, query, torch.ones(4, device=backend.device), num_heads=1)
    # Both rows have RMS 1/2, so the key of row 0 is [2, 0, 0, 0]: l = [4, 0].
    assert out[0, 0, 0].item() == pytest.approx(math.exp(4) / (math.exp(4) + 1), abs=2e-6)
    assert out[0, 0, 0].item() == pytest.approx(0.98201, abs=5e-6)


def test_query_and_norm_weight_in_sources_dtype(backend):
    sources, query, norm_weight = make_inputs(3, 1, 5, 32, dtype=torch.bfloat16, device=backend.device)
    q, g = query.bfloat16().requires_grad_(), norm_weight.bfloat16().requires_grad_()
    out = backend.mhar_route(sources, q, g, num_heads=2)
    out.float().sum().backward()
    assert q.grad.dtype == torch.bfloat16 and g.grad.dtype == torch.bfloat16


class TestBadInput:
    def setup_method(self):
        self.sources, self.query, self.norm_weight = make_inputs(3, 2, 5, 16)

    def call(self, ops, **over):
        args = dict(sources=self.sources, query=self.query, norm_weight=self.norm_weight, num_heads=4)
        args.update(over)
        s, q, g = args.pop("sources"), args.pop("query"), args.pop("norm_weight")
        return ops.mhar_route(s, q, g, **args)

    def test_sources_not_4d(self, host_backend):
        with pytest.raises(ValueError, match="sources"):
            self.call(host_backend, sources=self.sources[0])

    def test_num_heads_not_dividing_d(self, host_backend):
        with pytest.raises(ValueError, match="num_heads"):
            self.call(host_backend, num_heads=3)

    def test_zero_sources(self, host_backend):
        with pytest.raises(ValueError, match="num_sources"):
            self.call(host_backend, num_sources=0)
        with pytest.raises(ValueError, match="num_sources"):
            self.call(host_backend, sources=self.sources[:0])

    def test_too_many_sources(self, host_backend):
        with pytest.raises(ValueError, match="num_sources"):
            self.call(host_backend, num_sources=4)

    def test_query_shape(self, host_backend):
        with pytest.raises(ValueError, match="query"):
            self.call(host_backend, query=self.query[:8])

    def test_norm_weight_shape(self, host_backend):
        with pytest.raises(ValueError, match="norm_weight"):
            self.call(host_backend, norm_weight=self.norm_weight.view(4, 4))

    def test_sources_dtype(self, host_backend):
        with pytest.raises(TypeError, match="sources"):
            self.call(host_backend, sources=self.sources.to(torch.int32))

    def test_query_dtype(self, host_backend):
        with pytest.raises(TypeError, match="query"):
            self.call(host_backend, query=self.query.double())

    def test_residual_shape_and_dtype(self, host_backend):
        with pytest.raises(ValueError, match="residual"):
            self.call(host_backend, residual=torch.zeros(2, 5, 8))
        with pytest.raises(TypeError, match="residual"):
            self.call(host_backend, residual=torch.zeros(2, 5, 16, dtype=torch.bfloat16))

    def test_gate_shape_and_dtype(self, host_backend):
        with pytest.raises(ValueError, match="gate"):
            self.call(host_backend, gate=torch.zeros(2))
        with pytest.raises(TypeError, match="gate"):
            self.call(host_backend, gate=torch.zeros((), dtype=torch.float64))

    def test_last_dim_stride(self, host_backend):
        with pytest.raises(ValueError, match="stride"):
            self.call(host_backend, sources=self.sources.transpose(2, 3).contiguous().transpose(2, 3))

    def test_double_sources_rejected_by_sim(self):
        with pytest.raises(TypeError, match="sources"):
            self.call(headwise.testing.backend("sim"), sources=self.sources.double(), query=self.query.double(),
                      norm_weight=self.norm_weight.double())

    def test_cuda_tensor_on_sim(self):
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        # The emulated library registers CPU kernels only: the dispatcher refuses CUDA inputs.
        with pytest.raises(NotImplementedError, match="headwise_sim::mhar_route.*'CUDA' backend"):
            self.call(headwise.testing.backend("sim"), sources=self.sources.cuda())

    def test_device_mismatch(self):
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        with pytest.raises(RuntimeError, match="query"):
            self.call(headwise.testing.backend("cuda"), sources=self.sources.cuda())

    def test_bad_eps(self, host_backend):
        with pytest.raises(ValueError, match="eps"):
            self.call(host_backend, eps=0.0)


def test_compiles_fullgraph_without_graph_breaks(host_backend):
    sources, query, norm_weight = (x.requires_grad_() for x in make_inputs(3, 2, 5, 32))
    residual = torch.randn(2, 5, 32)

    def step(s, q, g, r):
        return host_backend.mhar_route(s, q, g, num_heads=4, num_sources=2, residual=r).square().sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    loss = compiled(sources, query, norm_weight, residual)
    loss.backward()
    grads = [x.grad.clone() for x in (sources, query, norm_weight)]
    for x in (sources, query, norm_weight):
        x.grad = None
    step(sources, query, norm_weight, residual).backward()
    for got, x in zip(grads, (sources, query, norm_weight)):
        assert torch.equal(got, x.grad)


@pytest.mark.parametrize("n,d,h,optin", [(65, 8192, 64, None), (65, 4096, 32, 101376)],
                         ids=["sm90-d8192-H64", "sm86_99KiB-d4096-H32"])
def test_backward_shared_memory_fits_at_many_sources_and_heads(monkeypatch, n, d, h, optin):
    # The backward keeps a position's per-(n, h) values in shared memory (w, the head sums,
    # dl and, in the vector layout, pass 2's coefficient records): 36 N H bytes, one block
    # (mhar_kernel.cuh, bwd_pos_blocks). At N = 65 (a 2L + 1 depth buffer at L = 32) that
    # fits sm_90's 227 KiB at d = 8192, H = 64 (147 KiB) and a 99 KiB part's at d = 4096,
    # H = 32 (74 KiB); double-buffered records did not (294 and 148 KiB).
    if optin is not None:
        monkeypatch.setenv("HEADWISE_SIM_SMEM_OPTIN", str(optin))
    sim = headwise.testing.backend("sim")
    sources, query, norm_weight = make_inputs(n, 1, 1, d, dtype=torch.bfloat16, qscale=0.02)
    grad = torch.randn(1, 1, d, generator=torch.Generator().manual_seed(5)).bfloat16()
    got = _fwd_bwd(sim.mhar_route, sources, query, norm_weight, grad, num_heads=h)
    want = _fwd_bwd(reference.mhar_route, sources, query, norm_weight, grad, num_heads=h)
    for name, g, w in zip(("out", "sources", "query", "norm_weight"), got, want):
        assert rel_err(g.float(), w.float()) <= 2 ** -6, name
