"""headwise.head_merge (SPEC section 3): every backend against headwise.reference."""

import pytest
import torch

import headwise
from headwise import reference
from headwise.testing import FP32_MATMUL_SETTINGS, profiled_launches, rel_err, with_one_and_many_threads

FP32_TOL = 1e-5

# (B, H, Q, Dv, D): odd sizes; sizes beyond one CUDA tile in Q (32), D (64) and Dv (64).
SHAPES = [
    pytest.param(2, 3, 5, 4, 7, id="B2-H3-Q5-Dv4-D7"),
    pytest.param(1, 2, 37, 8, 33, id="B1-H2-Q37-Dv8-D33"),
    pytest.param(2, 4, 3, 16, 70, id="B2-H4-Q3-Dv16-D70"),
    pytest.param(1, 5, 3, 3, 5, id="B1-H5-Q3-Dv3-D5"),
    pytest.param(1, 2, 5, 67, 9, id="B1-H2-Q5-Dv67-D9"),
]
LAYOUTS = ["bhqd", "bqhd_view", "sliced"]


def make_z(b, h, q, dv, layout, dtype=torch.float32, seed=0, device="cpu"):
    """z [B, H, Q, Dv] in one of three layouts: contiguous, a transposed view of
    [B, Q, H, Dv] memory, and a non-dense slice (stride-1 last dim); the view is taken
    on `device`, so the layout survives the move."""
    gen = torch.Generator().manual_seed(seed)
    if layout == "bhqd":
        return torch.randn(b, h, q, dv, generator=gen).to(device, dtype)
    if layout == "bqhd_view":
        return torch.randn(b, q, h, dv, generator=gen).to(device, dtype).transpose(1, 2)
    if layout == "sliced":
        return torch.randn(b, h + 1, q, dv + 3, generator=gen).to(device, dtype)[:, 1:, :, 2 : 2 + dv]
    raise ValueError(layout)


def make_params(h, dv, d, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(d, h * dv, generator=gen) / (h * dv) ** 0.5).to(dtype)
    bias = torch.randn(d, generator=gen).to(dtype)
    return w, bias


def make_gate(kind, b, h, seed=2):
    gen = torch.Generator().manual_seed(seed)
    if kind is None:
        return None
    if kind == "hard":  # [H] with one closed head
        g = torch.ones(h)
        g[h // 2] = 0
        return g
    if kind == "row_hard":  # [B, H], a different closed head per batch row
        g = torch.ones(b, h)
        for i in range(b):
            g[i, i % h] = 0
        return g
    if kind == "soft":  # [B, H] non-binary, with one exact zero
        g = torch.rand(b, h, generator=gen) + 0.1
        g[0, 0] = 0
        return g
    raise ValueError(kind)


def run_both(ops, z, w, bias, gate, rescale, *, stats=True, grad_seed=3, leaves=("z", "w", "bias", "gate")):
    """(out, stats, grads) of ops.head_merge and of the reference on the same inputs."""
    results = []
    for fn in (ops.head_merge, reference.head_merge):
        zz = z.detach().clone() if fn is reference.head_merge else z.detach()
        # The parameters are made on the CPU; both run on z's device.
        args = {"z": zz, "w": w.detach().to(z.device, copy=True),
                "bias": None if bias is None else bias.detach().to(z.device, copy=True),
                "gate": None if gate is None else gate.detach().to(z.device, copy=True)}
        for k in leaves:
            if args[k] is not None:
                args[k].requires_grad_()
        res = fn(args["z"], args["w"], args["bias"], head_gate=args["gate"], rescale=rescale, return_stats=stats)
        out, st = res if stats else (res, None)
        gen = torch.Generator().manual_seed(grad_seed)
        grad = torch.randn(out.shape, generator=gen).to(out.device, out.dtype)
        out.backward(grad)
        grads = {k: (args[k].grad if args[k] is not None and args[k].requires_grad else None) for k in args}
        results.append((out, st, grads, args["z"]))
    return results


@pytest.mark.parametrize("b,h,q,dv,d", SHAPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_reference_fp32(backend, b, h, q, dv, d, layout):
    z = make_z(b, h, q, dv, layout).to(backend.device)
    w, bias = make_params(h, dv, d)
    for gate_kind, rescale in [(None, False), ("soft", True), ("row_hard", False)]:
        gate = make_gate(gate_kind, b, h)
        (out, st, grads, zz), (eout, est, egrads, _) = run_both(backend, z, w, bias, gate, rescale)
        assert rel_err(out, eout) <= FP32_TOL
        assert rel_err(st.z_norm, est.z_norm) <= FP32_TOL
        assert rel_err(st.out_norm, est.out_norm) <= 1e-4  # Gram identity on the CPU kernel
        for k in grads:
            if egrads[k] is not None:
                err = rel_err(grads[k], egrads[k])
                assert err <= FP32_TOL, f"grad {k} ({gate_kind}, rescale={rescale}): {err:.3g}"
        if layout != "sliced":
            assert grads["z"].stride() == z.stride()


@pytest.mark.parametrize("gate_kind", [None, "hard", "row_hard", "soft"])
@pytest.mark.parametrize("rescale", [False, True])
@pytest.mark.parametrize("layout", ["bhqd", "bqhd_view"])
def test_every_path_without_stats(host_backend, gate_kind, rescale, layout):
    """Without stats (the CPU kernel's direct GEMM paths), with gates that do and do not
    need their gradient."""
    b, h, q, dv, d = 3, 4, 37, 8, 33
    z = make_z(b, h, q, dv, layout)
    w, bias = make_params(h, dv, d)
    gate = make_gate(gate_kind, b, h)
    for leaves in (("z", "w", "bias"), ("z", "w", "bias", "gate")):
        (out, _, grads, _), (eout, _, egrads, _) = run_both(host_backend, z, w, bias, gate, rescale, stats=False,
                                                            leaves=leaves)
        assert rel_err(out, eout) <= FP32_TOL
        for k in leaves:
            if egrads[k] is not None:
                assert rel_err(grads[k], egrads[k]) <= FP32_TOL, k


def test_no_bias_and_partial_grads(host_backend):
    z = make_z(2, 3, 5, 4, "bqhd_view")
    w, _ = make_params(3, 4, 6)
    (out, _, grads, _), (eout, _, egrads, _) = run_both(host_backend, z, w, None, None, False, leaves=("w",))
    assert rel_err(out, eout) <= FP32_TOL
    assert rel_err(grads["w"], egrads["w"]) <= FP32_TOL
    assert grads["z"] is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_close_to_reference(backend, dtype):
    b, h, q, dv, d = 2, 4, 37, 16, 70
    z = make_z(b, h, q, dv, "bqhd_view", dtype=dtype).to(backend.device)
    w, bias = make_params(h, dv, d, dtype=dtype)
    gate = make_gate("soft", b, h)
    (out, st, grads, _), (eout, est, egrads, _) = run_both(backend, z, w, bias, gate, True)
    assert out.dtype == dtype and grads["z"].dtype == dtype and grads["w"].dtype == dtype
    assert grads["gate"].dtype == torch.float32
    assert rel_err(out, eout) <= 1e-2
    assert rel_err(st.out_norm, est.out_norm) <= 1e-3
    for k in grads:
        assert rel_err(grads[k], egrads[k]) <= 2e-2, k


def test_two_head_trace(backend):
    """seeds/001: z3 = [0.752, 0.752, -0.546, 0.926] and W_O give y3 ~ [0.479, 1.215, -0.170,
    1.302]; ablating head 2 before the projection gives [0.752, 0.752, 0.376, 0.376] W_O."""
    w_o = torch.tensor([[1, 0, 0.5, 0], [0, 1, 0, 0.5], [0.5, 0, 1, 0], [0, 0.5, 0, 1]])  # Y = Z W_O
    weight_o = w_o.t().contiguous()  # nn.Linear orientation [D_model, H*Dv]
    z = torch.tensor([[0.752, 0.752], [-0.546, 0.926]]).view(1, 2, 1, 2)  # [B=1, H=2, Q=1, Dv=2]
    z, weight_o, w_o = (t.to(backend.device) for t in (z, weight_o, w_o))
    y = backend.head_merge(z, weight_o)
    torch.testing.assert_close(y.view(4).cpu(), torch.tensor([0.479, 1.215, -0.170, 1.302]), atol=1e-3, rtol=0)
    gate = torch.tensor([1.0, 0.0], device=backend.device)
    y_ablated = backend.head_merge(z, weight_o, head_gate=gate)
    expected = torch.tensor([0.752, 0.752, 0.0, 0.0], device=backend.device) @ w_o
    torch.testing.assert_close(y_ablated.view(4), expected, atol=1e-6, rtol=0)
    # Permuting the head blocks of Z and the matching rows of W_O leaves y unchanged.
    z_swapped = z.flip(1)
    w_swapped = torch.cat([weight_o[:, 2:], weight_o[:, :2]], dim=1)
    torch.testing.assert_close(backend.head_merge(z_swapped, w_swapped), y, atol=1e-6, rtol=0)
    assert not torch.allclose(backend.head_merge(z_swapped, weight_o), y, atol=1e-3)


def test_rescale_one_closed_of_eight_is_exactly_eight_sevenths(backend):
    b, h, q, dv, d = 2, 8, 5, 4, 12
    dev = backend.device
    z = make_z(b, h, q, dv, "bqhd_view", device=dev)
    w = make_params(h, dv, d)[0].to(dev)
    gate = torch.ones(h, device=dev)
    gate[3] = 0
    plain = backend.head_merge(z, w, head_gate=gate)
    scaled = backend.head_merge(z, w, head_gate=gate, rescale=True)
    torch.testing.assert_close(scaled, plain * (8 / 7), rtol=1e-6, atol=1e-7)
    # Rescale of an all-open gate is 1.
    ones = torch.ones(h, device=dev)
    torch.testing.assert_close(backend.head_merge(z, w, head_gate=ones, rescale=True), backend.head_merge(z, w))


def test_all_closed_gives_bias_alone(backend):
    b, h, q, dv, d = 2, 3, 5, 4, 7
    dev = backend.device
    z = make_z(b, h, q, dv, "bhqd", device=dev).requires_grad_()
    w, bias = (t.to(dev) for t in make_params(h, dv, d))
    gate = torch.zeros(b, h, device=dev, requires_grad=True)
    for rescale in (False, True):
        out = backend.head_merge(z, w, bias, head_gate=gate, rescale=rescale)
        assert torch.equal(out, bias.expand(b, q, d))
        out.sum().backward()
        assert torch.equal(z.grad, torch.zeros_like(z))
        assert torch.isfinite(gate.grad).all()
        z.grad = gate.grad = None
    assert torch.equal(backend.head_merge(z, w, head_gate=torch.zeros(h, device=dev)), torch.zeros(b, q, d, device=dev))


def test_closed_heads_are_not_read(backend):
    """A gate of exactly 0 skips the head: NaN in a closed head's z does not reach the
    output (a dense mask would give NaN * 0 = NaN), nor grad_weight_o."""
    b, h, q, dv, d = 2, 4, 5, 8, 9
    dev = backend.device
    z = make_z(b, h, q, dv, "bqhd_view", device=dev).clone()
    w, bias = (t.to(dev) for t in make_params(h, dv, d))
    gate = torch.ones(b, h, device=dev)
    gate[0, 1] = 0
    gate[1, 2] = 0
    z_nan = z.clone()
    z_nan[0, 1] = float("nan")
    z_nan[1, 2] = float("nan")
    wl = w.clone().requires_grad_()
    zl = z_nan.clone().requires_grad_()
    out, st = backend.head_merge(zl, wl, bias, head_gate=gate, rescale=True, return_stats=True)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, reference.head_merge(z, w, bias, head_gate=gate, rescale=True))
    assert st.z_norm[0, :, 1].eq(0).all() and st.out_norm[1, :, 2].eq(0).all()
    out.sum().backward()
    assert torch.isfinite(wl.grad).all()
    assert zl.grad[0, 1].eq(0).all() and zl.grad[1, 2].eq(0).all()


def test_stats_against_explicit_per_head_products(backend):
    b, h, q, dv, d = 2, 3, 37, 16, 70
    dev = backend.device
    z = make_z(b, h, q, dv, "sliced", device=dev)
    w, bias = (t.to(dev) for t in make_params(h, dv, d))
    gate = torch.tensor([1.0, 0.0, 0.5], device=dev)
    _, st = backend.head_merge(z, w, bias, head_gate=gate, return_stats=True)
    assert st.z_norm.shape == (b, q, h) and st.z_norm.dtype == torch.float32
    for hh in range(h):
        contrib = z[:, hh] @ w[:, hh * dv : (hh + 1) * dv].t()  # [B, Q, D], ungated
        want_z = z[:, hh].norm(dim=-1) if gate[hh] != 0 else torch.zeros(b, q, device=dev)
        want_o = contrib.norm(dim=-1) if gate[hh] != 0 else torch.zeros(b, q, device=dev)
        torch.testing.assert_close(st.z_norm[:, :, hh], want_z, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(st.out_norm[:, :, hh], want_o, rtol=1e-4, atol=1e-5)
    # Stats do not change the output.
    with_stats = backend.head_merge(z, w, bias, head_gate=gate, return_stats=True)[0]
    torch.testing.assert_close(backend.head_merge(z, w, bias, head_gate=gate), with_stats, rtol=1e-6, atol=1e-6)


def test_out_norm_keeps_relative_accuracy_for_a_near_dead_head(backend):
    """A head whose output is tiny relative to ||z|| ||W_h||: W_h = 10 u v^T + 1e-4 N with
    every z row orthogonal to v, so ||z W_h^T|| ~ 1e-4 ||z|| while ||W_h|| ~ 10. A Gram
    form z^T (W_h^T W_h) z loses everything to cancellation in fp32; out_norm must keep
    its relative accuracy (fp64 products as the truth)."""
    gen = torch.Generator().manual_seed(5)
    b, h, q, dv, d = 1, 2, 37, 16, 40
    v = torch.nn.functional.normalize(torch.randn(dv, generator=gen), dim=0)
    z = torch.randn(b, h, q, dv, generator=gen)
    z = z - (z @ v).unsqueeze(-1) * v  # rows orthogonal to v
    w = torch.randn(d, h * dv, generator=gen) / dv ** 0.5
    u = torch.randn(d, generator=gen)
    w[:, :dv] = 10 * torch.outer(u, v) + 1e-4 * torch.randn(d, dv, generator=gen)
    z, w = z.to(backend.device), w.to(backend.device)
    _, st = backend.head_merge(z, w, return_stats=True)
    want = (z[:, 0].double() @ w[:, :dv].double().t()).norm(dim=-1)
    assert want.max() < 1e-3 * z[:, 0].norm(dim=-1).min() * w[:, :dv].norm()
    torch.testing.assert_close(st.out_norm[:, :, 0].double(), want, rtol=2e-2, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_out_norm_with_rank_deficient_heads(host_backend, dtype):
    """Heads whose W_h is zero or has repeated columns (a singular W_h^T W_h: the CPU
    kernel's Cholesky factor does not exist and it falls back to QR): out_norm still
    equals the explicit per-head product's norm. fp64 on the CPU backend only."""
    if dtype == torch.float64 and host_backend.ns != "headwise":
        pytest.skip("fp64 is a CPU-backend dtype")
    gen = torch.Generator().manual_seed(6)
    b, h, q, dv, d = 2, 3, 5, 8, 24
    z = torch.randn(b, h, q, dv, generator=gen, dtype=dtype)
    w = torch.randn(d, h * dv, generator=gen, dtype=dtype)
    w[:, :dv] = 0  # a zeroed head
    w[:, dv : 2 * dv] = w[:, dv : dv + 1].repeat(1, dv)  # rank 1
    _, st = host_backend.head_merge(z, w, return_stats=True)
    for hh in range(h):
        want = (z[:, hh] @ w[:, hh * dv : (hh + 1) * dv].t()).norm(dim=-1).float()
        torch.testing.assert_close(st.out_norm[:, :, hh], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dv, d", [(37, 70), (64, 96), (80, 123), (37, 24)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_out_norm_across_head_widths(host_backend, dv, d, dtype):
    """out_norm against the explicit per-head product (fp64) at head widths around the CPU
    kernel's vector blocks of its triangular factor (37, 64 and 80 columns, padded to 48,
    64 and 80 in fp32), with d < dv (a QR factor of fewer columns than rows), q = 37 rows
    (fours and a remainder) and a closed head. fp64 on the CPU backend only."""
    if dtype == torch.float64 and host_backend.ns != "headwise":
        pytest.skip("fp64 is a CPU-backend dtype")
    gen = torch.Generator().manual_seed(8)
    b, h, q = 2, 3, 37
    z = torch.randn(b, h, q, dv, generator=gen, dtype=dtype)
    w = torch.randn(d, h * dv, generator=gen, dtype=dtype) / dv ** 0.5
    gate = torch.tensor([1.0, 0.0, 1.0], dtype=dtype)
    _, st = host_backend.head_merge(z, w, head_gate=gate, return_stats=True)
    for hh in range(h):
        want = (z[:, hh].double() @ w[:, hh * dv : (hh + 1) * dv].double().t()).norm(dim=-1).float()
        if gate[hh] == 0:
            want = torch.zeros_like(want)
        torch.testing.assert_close(st.out_norm[:, :, hh], want, rtol=2e-5, atol=1e-6)


def test_transposed_view_is_read_in_place(host_backend):
    """z as a transposed view of [B, Q, H, Dv] memory: correct, grad_z in z's strides,
    and no [B, Q, H*Dv]-sized copy is made (peak extra memory below one z)."""
    b, h, q, dv, d = 2, 4, 64, 16, 8
    mem = torch.randn(b, q, h, dv)
    z = mem.transpose(1, 2).requires_grad_()
    w, bias = make_params(h, dv, d)
    out = host_backend.head_merge(z, w, bias)
    torch.testing.assert_close(out, reference.head_merge(z.detach(), w, bias), rtol=1e-5, atol=1e-5)
    out.backward(torch.ones_like(out))
    assert z.grad.stride() == z.stride() == mem.transpose(1, 2).stride()
    if host_backend.name == "cpu":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            host_backend.head_merge(z.detach(), w, bias)
        big = [e for e in prof.events() if e.cpu_memory_usage >= z.numel() * z.element_size()]
        assert not big, f"allocations of a z-sized buffer: {[e.name for e in big]}"


def test_gradcheck_float64_cpu_kernel():
    b, h, q, dv, d = 2, 3, 3, 2, 4
    z = make_z(b, h, q, dv, "bqhd_view", dtype=torch.float64).requires_grad_()
    w, bias = make_params(h, dv, d, dtype=torch.float64)
    w.requires_grad_()
    bias.requires_grad_()
    gate = (torch.rand(b, h, dtype=torch.float64) + 0.5).requires_grad_()  # sum > 1: rescale active
    fn = lambda z, w, bias, g: headwise.head_merge(z, w, bias, head_gate=g, rescale=True)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (z, w, bias, gate))
    gate_h = torch.tensor([0.3, 0.2, 0.1], dtype=torch.float64, requires_grad=True)  # sum <= 1: clipped at H
    assert torch.autograd.gradcheck(fn, (z, w, bias, gate_h))
    fn2 = lambda z, w, g: headwise.head_merge(z, w, head_gate=g)  # noqa: E731
    gate_c = torch.tensor([1.0, 0.0, 0.7], dtype=torch.float64, requires_grad=True)  # closed head's gate grad
    assert torch.autograd.gradcheck(fn2, (z, w, gate_c))


def test_opcheck(backend):
    dev = backend.device
    op = getattr(torch.ops, backend.ns).head_merge
    z = make_z(2, 3, 5, 4, "bqhd_view").to(dev).requires_grad_()
    w, bias = make_params(3, 4, 7)
    w, bias = w.to(dev).requires_grad_(), bias.to(dev).requires_grad_()
    samples = [
        (z, w, bias, None, False, False),
        (z, w, None, torch.tensor([1.0, 0.0, 0.5], device=dev, requires_grad=True), True, True),
        (make_z(2, 3, 5, 4, "bhqd").to(dev), w, bias, torch.rand(2, 3, device=dev, requires_grad=True), False, True),
    ]
    for args in samples:
        torch.library.opcheck(op, args)
    bwd = getattr(torch.ops, backend.ns).head_merge_backward
    grad = torch.randn(2, 5, 7, device=dev)
    torch.library.opcheck(bwd, (grad, z.detach(), w.detach(), torch.rand(2, 3, device=dev), True, True, True))


def test_compiles_fullgraph_without_graph_breaks(host_backend):
    z = make_z(2, 3, 5, 4, "bqhd_view").requires_grad_()
    w, bias = make_params(3, 4, 7)
    w.requires_grad_()
    gate = torch.tensor([1.0, 0.0, 0.5], requires_grad=True)

    def step(z, w, bias, gate):
        out, st = host_backend.head_merge(z, w, bias, head_gate=gate, rescale=True, return_stats=True)
        return out.square().sum() + st.out_norm.sum().detach()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    loss = compiled(z, w, bias, gate)
    loss.backward()
    grads = [x.grad.clone() for x in (z, w, gate)]
    for x in (z, w, gate):
        x.grad = None
    step(z, w, bias, gate).backward()
    for got, x in zip(grads, (z, w, gate)):
        assert torch.equal(got, x.grad)


def test_deterministic_across_thread_counts():
    z = make_z(2, 4, 200, 16, "bhqd").requires_grad_()
    w, bias = make_params(4, 16, 24)
    gate = torch.rand(2, 4, requires_grad=True)

    def run():
        z.grad = gate.grad = None
        out, st = headwise.head_merge(z, w, bias, head_gate=gate, rescale=True, return_stats=True)
        out.backward(torch.ones_like(out))
        return [out.detach(), st.out_norm, z.grad.clone(), gate.grad.clone()]

    one, many = with_one_and_many_threads(run)
    for a, b in zip(one, many):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype,layout,gate_kind", [(torch.float32, "bhqd", "row_hard"),
                                                   (torch.bfloat16, "bhqd", "row_hard"),
                                                   (torch.float32, "bqhd_view", None)])
def test_backward_chunks_deterministic_across_thread_counts(dtype, layout, gate_kind):
    """The backward's chunked routes (grad_z scattered from BLAS-threaded GEMMs, grad
    weight_o over more than two 512-row chunks, gathered or, for a transposed view
    without gate, read in place; a [B, H] gate that does not need its gradient, heads
    closed in some rows): bitwise the same for 1 and several threads, and equal to the
    reference. (One GEMM over all 1203 rows gave other bits with 2 threads than with 1.)"""
    b, h, q, dv, d = 3, 4, 401, 8, 24
    z = make_z(b, h, q, dv, layout, dtype)
    w, bias = make_params(h, dv, d, dtype)
    gate = make_gate(gate_kind, b, h)

    def run():
        zz, ww = z.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        out = headwise.head_merge(zz, ww, bias, head_gate=gate, rescale=True)
        out.backward(torch.ones_like(out))
        return [out.detach(), zz.grad, ww.grad]

    one, many = with_one_and_many_threads(run)
    for x, y in zip(one, many):
        assert torch.equal(x, y)
    if dtype == torch.float32:
        (out, _, grads, _), (eout, _, egrads, _) = run_both(headwise.testing.backend("cpu"), z, w, bias, gate, True,
                                                            stats=False, leaves=("z", "w"))
        for k in ("z", "w"):
            assert rel_err(grads[k], egrads[k]) <= FP32_TOL, k


def test_out_norm_of_a_head_with_non_finite_weights(host_backend):
    """A head whose W_h holds an inf: its out_norm is what the product gives (inf or
    NaN, as the reference's); the other heads are unaffected."""
    gen = torch.Generator().manual_seed(7)
    z = torch.randn(1, 3, 5, 4, generator=gen)
    w = torch.randn(6, 12, generator=gen)
    w[2, 5] = float("inf")  # head 1
    _, got = host_backend.head_merge(z, w, return_stats=True)
    _, want = reference.head_merge(z, w, return_stats=True)
    assert torch.equal(torch.isnan(got.out_norm), torch.isnan(want.out_norm))
    assert torch.equal(torch.isinf(got.out_norm), torch.isinf(want.out_norm))
    assert not torch.isfinite(want.out_norm[..., 1]).any()
    fin = torch.isfinite(want.out_norm)
    torch.testing.assert_close(got.out_norm[fin], want.out_norm[fin], rtol=1e-5, atol=1e-5)


class TestBadInput:
    z = make_z(2, 3, 5, 4, "bqhd_view")
    w, bias = make_params(3, 4, 7)

    def call(self, ops, z=None, w=None, bias=None, gate=None, **kw):
        return ops.head_merge(self.z if z is None else z, self.w if w is None else w,
                              bias, head_gate=gate, **kw)

    def test_z_not_4d(self, host_backend):
        with pytest.raises(ValueError, match="z must be 4-D"):
            self.call(host_backend, z=self.z[0])

    def test_weight_o_columns(self, host_backend):
        with pytest.raises(ValueError, match="weight_o dim 1 must equal H\\*Dv"):
            self.call(host_backend, w=self.w[:, :-1])

    def test_weight_o_dtype(self, host_backend):
        with pytest.raises(TypeError, match="weight_o must have the dtype of z"):
            self.call(host_backend, w=self.w.double())

    def test_bias_shape_and_dtype(self, host_backend):
        with pytest.raises(ValueError, match="bias dim 0"):
            self.call(host_backend, bias=self.bias[:-1])
        with pytest.raises(TypeError, match="bias must have the dtype"):
            self.call(host_backend, bias=self.bias.half())

    def test_gate_shape_and_dtype(self, host_backend):
        with pytest.raises(ValueError, match="head_gate must be \\[H\\]"):
            self.call(host_backend, gate=torch.ones(4))
        with pytest.raises(ValueError, match="head_gate must be \\[H\\]"):
            self.call(host_backend, gate=torch.ones(3, 3))
        with pytest.raises(TypeError, match="head_gate must be float32"):
            self.call(host_backend, gate=torch.ones(3, dtype=torch.int64))

    def test_last_dim_stride(self, host_backend):
        with pytest.raises(ValueError, match="z must have a stride-1 last dim"):
            self.call(host_backend, z=self.z.transpose(2, 3).contiguous().transpose(2, 3))
        with pytest.raises(ValueError, match="weight_o must have a stride-1 last dim"):
            self.call(host_backend, w=self.w.t().contiguous().t())

    def test_z_dtype(self, host_backend):
        with pytest.raises(TypeError, match="z must be"):
            self.call(host_backend, z=self.z.int(), w=self.w.int())

    def test_double_rejected_by_sim(self):
        with pytest.raises(TypeError, match="z"):
            self.call(headwise.testing.backend("sim"), z=self.z.double(), w=self.w.double())

    def test_grad_out_shape(self, host_backend):
        bwd = getattr(torch.ops, host_backend.ns).head_merge_backward
        with pytest.raises(ValueError, match="grad_out dim 2"):
            bwd(torch.zeros(2, 5, 6), self.z, self.w, None, False, True, False)

    def test_device_mismatch(self):
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        with pytest.raises(RuntimeError, match="weight_o"):
            self.call(headwise.testing.backend("cuda"), z=self.z.cuda())


@pytest.mark.parametrize("layout", ["bhqd", "bqhd_view"])
def test_several_cpu_tiles(layout):
    """Q beyond one CPU tile (256 rows), batch rows with different gates, every grad."""
    b, h, q, dv, d = 2, 3, 300, 8, 20
    z = make_z(b, h, q, dv, layout)
    w, bias = make_params(h, dv, d)
    for gate_kind, stats in [("soft", True), ("row_hard", False), (None, True)]:
        gate = make_gate(gate_kind, b, h)
        (out, st, grads, _), (eout, est, egrads, _) = run_both(headwise.testing.backend("cpu"), z, w, bias, gate,
                                                               True, stats=stats)
        assert rel_err(out, eout) <= FP32_TOL
        if stats:
            assert rel_err(st.out_norm, est.out_norm) <= 1e-4
        for k in grads:
            if egrads[k] is not None:
                assert rel_err(grads[k], egrads[k]) <= FP32_TOL, k


@pytest.mark.parametrize("shape", [(2, 3, 0, 4, 5), (0, 3, 2, 4, 5), (1, 1, 1, 1, 1), (3, 1, 2, 5, 1)],
                         ids=["Q0", "B0", "all1", "D1-H1"])
def test_degenerate_shapes(backend, shape):
    b, h, q, dv, d = shape
    z = torch.randn(b, h, q, dv).to(backend.device)
    w, bias = make_params(h, dv, d)
    gate = torch.rand(h) + 0.2
    (out, st, grads, _), (eout, est, egrads, _) = run_both(backend, z, w, bias, gate, True)
    assert out.shape == eout.shape and st.z_norm.shape == (b, q, h)
    torch.testing.assert_close(out, eout, rtol=1e-5, atol=1e-5)
    for k in grads:
        torch.testing.assert_close(grads[k], egrads[k], rtol=1e-5, atol=1e-5)


def test_autocast_casts_the_gemm_operands(host_backend):
    # Like nn.Linear: inside autocast z, weight_o and bias go to the autocast dtype; the
    # fp32 gate is used as given.
    gen = torch.Generator().manual_seed(5)
    z = torch.randn(2, 5, 4, 3, generator=gen).transpose(1, 2)  # [B, H, Q, Dv] view
    weight_o, bias = torch.randn(7, 12, generator=gen), torch.randn(7, generator=gen)
    gate = torch.tensor([1.0, 0.0, 0.5, 1.0])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = host_backend.head_merge(z, weight_o, bias, head_gate=gate)
    want = host_backend.head_merge(z.bfloat16(), weight_o.bfloat16(), bias.bfloat16(), head_gate=gate)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


# ---------------------------------------------------------------------------------------
# The tensor-core forward (csrc/merge/merge_tc_kernel.cuh) on the emulator: bf16/fp16
# without stats, fp32 when torch allows TF32 matmuls. On the emulator every such call runs
# the hand kernel (the CUDA build sends ungated calls to cuBLAS, merge_launch.h fwd_path).
# ---------------------------------------------------------------------------------------
TC_SHAPES = [
    pytest.param(2, 3, 37, 40, 24, id="B2-H3-Q37-Dv40-D24"),  # Dv not a multiple of the 32-deep slice
    pytest.param(1, 2, 5, 67, 9, id="B1-H2-Q5-Dv67-D9"),  # odd Dv: partial copies, zero-filled k
    pytest.param(2, 2, 130, 16, 133, id="B2-H2-Q130-Dv16-D133"),  # two row and two column tiles, odd D
    pytest.param(1, 3, 3, 72, 5, id="B1-H3-Q3-Dv72-D5"),  # three slices per head
    # Whole 128-row / 128-column tiles with whole slices (the copies' unbounded fast path)
    # beside partial ones in every kernel: Q, D, Dv past one tile, Dv and D past whole slices.
    pytest.param(2, 2, 160, 136, 144, id="B2-H2-Q160-Dv136-D144"),
    # The forward's CTA-wide whole-slice path (every row of both operands in range, Dv a
    # multiple of the slice): tile (0, 0) takes it, the others the bounded copies.
    pytest.param(2, 3, 130, 64, 136, id="B2-H3-Q130-Dv64-D136"),
]
# Copy widths: bhqd / bqhd_view with Dv % 8 == 0 take 16-byte copies, "offset2" (a view
# 2 elements into each row) 4-byte copies, "sliced" (odd row stride) 2-byte loads;
# "padded" (rows of a multiple of 8 elements, the first Dv used) 16-byte copies with a
# partial last chunk when Dv % 8 != 0.
TC_LAYOUTS = ["bhqd", "bqhd_view", "offset2", "sliced", "padded"]


def make_tc_z(b, h, q, dv, layout, dtype, seed=0, device="cpu"):
    if layout == "offset2":
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(b, h, q, dv + 2, generator=gen).to(device, dtype)[..., 2:]
    if layout == "padded":  # 16-byte aligned rows longer than Dv (odd Dv: a partial last chunk)
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(b, h, q, dv // 8 * 8 + 8, generator=gen).to(device, dtype)[..., :dv]
    return make_z(b, h, q, dv, layout, dtype=dtype, seed=seed, device=device)


# The tensor-core kernels' tests run on kernel_backend (conftest.py): the emulator, and a
# GPU when there is one (where plain ungated calls without stats go to cuBLAS instead,
# fwd_path).


def merge64(z, w, bias, gate, rescale):
    """The reference in fp64 on the same (rounded) inputs."""
    return reference.head_merge(z.double(), w.double(), None if bias is None else bias.double(),
                                head_gate=None if gate is None else gate.double(), rescale=rescale)


def all_closed_row_gate(b, h):
    g = torch.rand(b, h, generator=torch.Generator().manual_seed(5)) + 0.25
    g[0] = 0  # batch row 0: every head closed, y = bias
    return g


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("layout", TC_LAYOUTS)
@pytest.mark.parametrize("b,h,q,dv,d", TC_SHAPES)
def test_tensor_core_forward_matches_reference(kernel_backend, b, h, q, dv, d, layout, dtype):
    cpu, dev = headwise.testing.backend("cpu"), kernel_backend.device
    z = make_tc_z(b, h, q, dv, layout, dtype, device=dev)
    w, bias = (t.to(dev) for t in make_params(h, dv, d, dtype=dtype))
    gates = [(None, False), (make_gate("row_hard", b, h), False), (make_gate("soft", b, h), True),
             (all_closed_row_gate(b, h), True)]
    for gate, rescale in gates:
        gate = None if gate is None else gate.to(dev)
        for bb in (bias, None):
            out = kernel_backend.head_merge(z, w, bb, head_gate=gate, rescale=rescale)
            assert out.dtype == dtype and out.shape == (b, q, d)
            want = merge64(z, w, bb, gate, rescale)
            # fp32 accumulation, one rounding of the output to 8 (bf16) / 11 (f16) bits
            tol = 8e-3 if dtype == torch.bfloat16 else 1e-3
            assert rel_err(out, want) <= tol, (gate, rescale, bb is None)
            on_cpu = cpu.head_merge(*(None if t is None else t.cpu() for t in (z, w, bb)),
                                    head_gate=None if gate is None else gate.cpu(), rescale=rescale)
            assert rel_err(out, on_cpu) <= 2 * tol
            if gate is not None and bool((gate.expand(b, h)[0] == 0).all()):
                want0 = torch.zeros(q, d, dtype=dtype, device=dev) if bb is None else bb.expand(q, d)
                assert torch.equal(out[0], want0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("layout", TC_LAYOUTS)
@pytest.mark.parametrize("b,h,q,dv,d", TC_SHAPES + [pytest.param(2, 2, 37, 136, 50, id="B2-H2-Q37-Dv136-D50"),
                                                   # the statistics pass's whole-slice path (Q, Dv >= 128)
                                                   pytest.param(1, 2, 128, 128, 128, id="B1-H2-Q128-Dv128-D128")])
def test_tensor_core_stats_match_reference(kernel_backend, b, h, q, dv, d, layout, dtype):
    """return_stats on tensor cores (the statistics pass): z_norm and out_norm against the
    fp64 reference, also for D < Dv (a rank-deficient W_h^T W_h), Dv over one 128-column
    tile, and a near-dead head (W_h scaled by 1e-6) whose out_norm keeps its relative
    accuracy; closed heads give 0 and their NaN z is never read; asking for stats leaves
    y as it is."""
    dev = kernel_backend.device
    z = make_tc_z(b, h, q, dv, layout, dtype, device=dev)
    w, bias = (t.to(dev) for t in make_params(h, dv, d, dtype=dtype))
    w_dead = w.clone()
    w_dead[:, :dv] *= 1e-6
    row_hard = make_gate("row_hard", b, h).to(dev)
    z_nan = z.clone()
    z_nan[row_hard == 0] = float("nan")  # closed (b, h) blocks
    for ww, zz, gate in [(w, z, None), (w_dead, z, make_gate("soft", b, h).to(dev)), (w, z_nan, row_hard)]:
        out, st = kernel_backend.head_merge(zz, ww, bias, head_gate=gate, rescale=True, return_stats=True)
        assert torch.equal(out, kernel_backend.head_merge(zz, ww, bias, head_gate=gate, rescale=True))
        want = reference.head_merge_stats(z.double(), ww.double(), head_gate=gate)
        assert rel_err(st.z_norm, want.z_norm) <= 1e-5
        assert rel_err(st.out_norm, want.out_norm) <= 1e-4
        if ww is w_dead:
            assert rel_err(st.out_norm[..., 0], want.out_norm[..., 0]) <= 1e-4  # the near-dead head itself
        if gate is row_hard:
            closed = (row_hard == 0)[:, None, :].expand(b, q, h)
            assert (st.z_norm[closed] == 0).all() and (st.out_norm[closed] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", TC_LAYOUTS)
def test_library_gemm_paths_match_reference(monkeypatch, layout, dtype):
    """The CUDA build's library-GEMM paths (merge_launch.h: the ungated forward's addmm
    after a gather or on token-major z in place, and the ungated backward's two GEMMs with
    grad_z written in z's layout), run on the CPU by the emulated build with
    HEADWISE_SIM_LIBRARY_GEMM=1, against the fp64 reference; bf16 with the stats pass."""
    monkeypatch.setenv("HEADWISE_SIM_LIBRARY_GEMM", "1")
    sim = headwise.testing.backend("sim")
    b, h, q, dv, d = 2, 3, 37, 40, 24
    z = make_tc_z(b, h, q, dv, layout, dtype)
    w, bias = make_params(h, dv, d, dtype=dtype)
    grad = torch.randn(b, q, d, generator=torch.Generator().manual_seed(9)).to(dtype)
    leaves = [z.detach().requires_grad_(), w.detach().clone().requires_grad_(), bias.detach().clone().requires_grad_()]
    stats = dtype != torch.float32  # fp32 stats take the SIMT kernel
    res = sim.head_merge(*leaves, return_stats=stats)
    out = res[0] if stats else res
    out.backward(grad)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(out, merge64(z, w, bias, None, False)) <= tol
    for name, got, want in zip("zwb", (x.grad for x in leaves), grads64(z, w, bias, None, False, grad)):
        assert rel_err(got, want) <= tol, name
    if layout in ("bhqd", "bqhd_view"):
        assert leaves[0].grad.stride() == z.stride()
    if stats:
        want = reference.head_merge_stats(z.double(), w.double())
        assert rel_err(res[1].z_norm, want.z_norm) <= 1e-5 and rel_err(res[1].out_norm, want.out_norm) <= 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_tensor_core_forward_skips_closed_heads(kernel_backend, dtype):
    """NaN in the closed heads' z (per batch row) does not reach the output: those tiles
    are never loaded."""
    dev = kernel_backend.device
    b, h, q, dv, d = 2, 4, 37, 24, 40
    z = make_tc_z(b, h, q, dv, "bqhd_view", dtype, device=dev).clone()
    w, bias = (t.to(dev) for t in make_params(h, dv, d, dtype=dtype))
    gate = torch.rand(b, h, generator=torch.Generator().manual_seed(7)) + 0.5
    gate[0, 1] = gate[1, 3] = 0
    gate = gate.to(dev)
    z_nan = z.clone()
    z_nan[0, 1] = float("nan")
    z_nan[1, 3] = float("inf")
    out = kernel_backend.head_merge(z_nan, w, bias, head_gate=gate, rescale=True)
    assert torch.isfinite(out).all()
    assert rel_err(out, merge64(z, w, bias, gate, True)) <= 8e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_tensor_core_gates_of_any_range(kernel_backend, dtype):
    """Gates from 1 down to 1e-39 (subnormal) in one row: the accumulators' alpha rescale
    visits heads (and, for grad_weight_o, batch rows) in ascending |gate| order, so no
    rescale factor overflows; outputs and gradients stay finite and match the reference."""
    dev = kernel_backend.device
    b, h, q, dv, d = 3, 5, 37, 24, 40
    z = make_tc_z(b, h, q, dv, "bqhd_view", dtype, device=dev).clone().requires_grad_()
    w, bias = (t.to(dev) for t in make_params(h, dv, d, dtype=dtype))
    w.requires_grad_()
    gate = torch.tensor([[1.0, 1e-39, 0.5, 1e-30, 0.0],
                         [1e-39, 1.0, 1e-20, 0.25, 1.0],
                         [0.0, 1e-38, 0.0, 1.0, 3e-39]], device=dev)
    for rescale in (False, True):
        out = kernel_backend.head_merge(z, w, bias, head_gate=gate, rescale=rescale)
        want = merge64(z.detach(), w.detach(), bias, gate, rescale)
        assert torch.isfinite(out).all(), rescale
        assert rel_err(out, want) <= (8e-3 if dtype == torch.bfloat16 else 1e-3), rescale
        dy = torch.randn(b, q, d, generator=torch.Generator().manual_seed(3)).to(dev, dtype)
        gz, gw = torch.autograd.grad(out, (z, w), dy)
        gz64, gw64 = grads64(z, w, bias, gate, rescale, dy)[:2]
        assert torch.isfinite(gz).all() and torch.isfinite(gw).all(), rescale
        assert rel_err(gw, gw64) <= 1e-2 and rel_err(gz, gz64) <= 1e-2, rescale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_tensor_core_backward_many_rows_in_ascending_gate_order(monkeypatch, kernel_backend, dtype):
    """grad_weight_o with a [B, H] gate over 133 batch rows: head 0's rows alternate between
    gates in [0.5, 1] and in [1e-39, 2e-39], head 1's span 1 to 1e-39 with ties, both with
    closed rows. The accumulators visit each head's open rows in ascending |gate| order, so
    no rescale factor overflows; in index order each step from ~1 to ~1e-39 would scale them
    by ~1e39 (inf in fp32). The order is sorted in one chunk of rows (B <= 4096), or in
    chunks of 32 or 2 rows and ranked across them (HEADWISE_MERGE_ROW_SORT_CHUNK): the same
    order, so the same bits."""
    dev = kernel_backend.device
    b, h, q, dv, d = 133, 3, 2, 24, 40
    gen = torch.Generator().manual_seed(11)
    u = torch.rand(b, generator=gen)
    gate = torch.empty(b, h)
    gate[:, 0] = torch.where(torch.arange(b) % 2 == 0, 0.5 + 0.5 * u, 1e-39 * (1 + u))
    gate[:, 1] = torch.pow(10.0, -39 * torch.rand(b, generator=gen))
    gate[5::7, 1] = gate[4, 1]  # ties, broken by row index
    gate[:, :2][torch.rand(b, 2, generator=gen) < 0.2] = 0.0  # closed rows of heads 0 and 1
    gate[:, 2] = 0.5  # a column of one value: index order
    gate = gate.to(dev)
    z = make_tc_z(b, h, q, dv, "bhqd", dtype, device=dev).requires_grad_()
    w, bias = (t.to(dev) for t in make_params(h, dv, d, dtype=dtype))
    w.requires_grad_()
    dy = torch.randn(b, q, d, generator=gen).to(dev, dtype)
    for rescale in (False, True):
        def grad_z_w():
            return torch.autograd.grad(kernel_backend.head_merge(z, w, bias, head_gate=gate, rescale=rescale), (z, w), dy)

        (gz, gw), (gz_again, gw_again) = grad_z_w(), grad_z_w()
        gz64, gw64 = grads64(z, w, bias, gate, rescale, dy)[:2]
        assert torch.equal(gw, gw_again) and torch.equal(gz, gz_again), rescale
        assert torch.isfinite(gw).all(), rescale
        assert rel_err(gw, gw64) <= 1e-2 and rel_err(gz, gz64) <= 1e-2, rescale
        for chunk in ("32", "2"):
            monkeypatch.setenv("HEADWISE_MERGE_ROW_SORT_CHUNK", chunk)
            gz_chunked, gw_chunked = grad_z_w()
            assert torch.equal(gw_chunked, gw) and torch.equal(gz_chunked, gz), (rescale, chunk)
        for bad in ("48", "32abc", "8192"):
            monkeypatch.setenv("HEADWISE_MERGE_ROW_SORT_CHUNK", bad)
            with pytest.raises(ValueError, match="HEADWISE_MERGE_ROW_SORT_CHUNK must be a power of two from 2 to 4096"):
                grad_z_w()
        monkeypatch.delenv("HEADWISE_MERGE_ROW_SORT_CHUNK")


def test_fp32_follows_torch_matmul_precision():
    """fp32: TF32 tensor cores only when torch lets matmuls use TF32, else full precision."""
    sim = headwise.testing.backend("sim")
    b, h, q, dv, d = 2, 3, 37, 40, 24
    z = make_tc_z(b, h, q, dv, "bqhd_view", torch.float32)
    w, bias = make_params(h, dv, d)
    gate = make_gate("soft", b, h)
    want = merge64(z, w, bias, gate, True)
    previous = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        full = sim.head_merge(z, w, bias, head_gate=gate, rescale=True)
        torch.backends.cuda.matmul.allow_tf32 = True
        tf32 = {layout: sim.head_merge(make_tc_z(b, h, q, dv, layout, torch.float32), w, bias, head_gate=gate,
                                       rescale=True) for layout in ("bqhd_view", "offset2", "sliced")}
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    assert rel_err(full, want) <= 1e-6
    for layout, out in tf32.items():
        # TF32 operands keep 10 mantissa bits (truncated): ~1e-3 relative, far above fp32's.
        err = rel_err(out, merge64(make_tc_z(b, h, q, dv, layout, torch.float32), w, bias, gate, True))
        assert 1e-5 < err <= 5e-3, (layout, err)


def test_bf16_reads_no_tf32_setting():
    """Only fp32 reads torch's TF32 setting: bf16 merges under the newer fp32_precision API's
    setting, whose legacy reading (what allowTF32CuBLAS checks) raises in torch."""
    sim = headwise.testing.backend("sim")
    z = make_tc_z(1, 3, 37, 40, "bqhd_view", torch.bfloat16)
    w, bias = make_params(3, 40, 24, torch.bfloat16)
    previous = torch.backends.cuda.matmul.fp32_precision
    try:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        with pytest.raises(RuntimeError, match="mix of the legacy and new APIs"):
            torch.backends.cuda.matmul.allow_tf32
        out = sim.head_merge(z, w, bias)
    finally:
        torch.backends.cuda.matmul.fp32_precision = previous
    assert rel_err(out.double(), merge64(z, w, bias, None, False)) <= 1e-2


@pytest.mark.parametrize("setting", sorted(FP32_MATMUL_SETTINGS))
def test_fp32_follows_every_way_torch_sets_its_matmul_precision(fp32_precision_state, setting):
    """fp32 takes TF32 tensor cores under each API that selects TF32, with the bits of
    allow_tf32 (the legacy getter, which raises after the newer API was used, is not read),
    and full precision under the others."""
    sim = headwise.testing.backend("sim")
    z = make_tc_z(2, 3, 37, 40, "bqhd_view", torch.float32)
    w, bias = make_params(3, 40, 24)
    gate = make_gate("soft", 2, 3)
    apply, tf32 = FP32_MATMUL_SETTINGS[setting]
    torch.backends.cuda.matmul.allow_tf32 = not tf32
    other = sim.head_merge(z, w, bias, head_gate=gate)
    torch.backends.cuda.matmul.allow_tf32 = tf32
    want = sim.head_merge(z, w, bias, head_gate=gate)
    assert not torch.equal(other, want)
    fp32_precision_state()  # the state the test began in (torch's default, as a process starts)
    apply()
    assert torch.equal(sim.head_merge(z, w, bias, head_gate=gate), want), setting


def test_tensor_core_forward_metrics():
    """Every product on mma.sync (one m16n8k16 per 16x8x16 of each open head's 128x128 tile,
    none for a closed head), global loads at the ideal sectors per request and
    conflict-free shared memory, on aligned head-major and token-major z."""
    import importlib.util

    if importlib.util.find_spec("headwise._sim_profile") is None:
        pytest.skip("headwise._sim_profile not built")
    from headwise.ops import load_profile_library

    ops = load_profile_library()
    b, h, q, dv, d = 1, 3, 128, 64, 128
    w, bias = make_params(h, dv, d, dtype=torch.bfloat16)
    gate = torch.tensor([1.0, 0.0, 0.5])
    for layout in ("bhqd", "bqhd_view"):
        z = make_tc_z(b, h, q, dv, layout, torch.bfloat16)
        _, recs = profiled_launches(lambda: ops.head_merge(z, w, bias, head_gate=gate))
        (rec,) = [r for r in recs if r["kernel"] == "head_merge_fwd_tc"]
        open_heads, slices, ksteps, warps = 2, 2, 2, 4  # 4 warps of 64 x 64: 4 x 8 mma a 16-deep step
        assert rec["mma"] == open_heads * slices * ksteps * warps * 32
        assert rec["global_load_sectors"] <= 1.1 * rec["global_load_sectors_ideal"]
        assert rec["smem_wavefronts"] <= 1.1 * rec["smem_wavefronts_ideal"]
        # The closed head's z is never read: unique bytes of z are the open heads' only.
        assert rec["unique_load_bytes"] <= (open_heads * q * dv + d * h * dv + d) * 2



def test_tensor_core_backward_store_metrics():
    """grad_z (in z's layout, with and without the gate's gradient) and grad_weight_o leave
    the tensor-core backward kernels through the staged epilogue: global stores at the
    ideal sectors per request, in 16-byte row chunks, on aligned head-major and
    token-major z. With the gate's gradient, the grad_z kernel's global loads (dy, W, and
    Z for c = <Z, P>) are within 1.1x of the ideal sectors too."""
    import importlib.util

    if importlib.util.find_spec("headwise._sim_profile") is None:
        pytest.skip("headwise._sim_profile not built")
    from headwise.ops import load_profile_library

    ops = load_profile_library()
    b, h, q, dv, d = 1, 2, 128, 64, 128
    w, bias = make_params(h, dv, d, dtype=torch.bfloat16)
    grad = torch.randn(b, q, d, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    for layout in ("bhqd", "bqhd_view"):
        for gate in (None, torch.tensor([[1.0, 0.5]])):
            z = make_tc_z(b, h, q, dv, layout, torch.bfloat16).requires_grad_()
            leaves = [w.detach().requires_grad_(), None if gate is None else gate.clone().requires_grad_()]

            def run():
                ops.head_merge(z, leaves[0], bias, head_gate=leaves[1], rescale=gate is not None).backward(grad)

            _, recs = profiled_launches(run)
            for kernel in ("head_merge_bwd_dz_tc", "head_merge_bwd_dw_tc"):
                (rec,) = [r for r in recs if r["kernel"] == kernel]
                assert rec["global_store_sectors"] <= 1.1 * rec["global_store_sectors_ideal"], (layout, kernel)
                # every element once (+ one c partial float per grad_z CTA with the gate's
                # gradient), in 16-byte lane stores: a warp request covers two 128-byte rows
                # of the 64-column tile (the fragments' pair stores covered 64 bytes)
                dz = kernel == "head_merge_bwd_dz_tc"
                tile_bytes = h * (q if dz else d) * dv * 2
                c_stores = rec["ctas"] if dz and gate is not None else 0
                assert rec["global_store_bytes"] == tile_bytes + 4 * c_stores, (layout, kernel)
                assert (rec["global_store_requests"] - c_stores) * 256 <= tile_bytes, (layout, kernel)
                if dz and gate is not None:
                    # the gate's gradient reads Z in 16-byte row chunks against P staged in
                    # shared memory (tile_dot_staged), not at the fragments' positions (4x
                    # the ideal sectors); the staging is conflict-free
                    assert rec["global_load_sectors"] <= 1.1 * rec["global_load_sectors_ideal"], (layout, rec)
                    assert rec["smem_wavefronts"] <= 1.1 * rec["smem_wavefronts_ideal"], (layout, rec)


def grads64(z, w, bias, gate, rescale, grad):
    """Output gradients of the fp64 reference on the same (rounded) inputs."""
    leaves = [t.detach().double().requires_grad_() if t is not None else None for t in (z, w, bias, gate)]
    out = reference.head_merge(leaves[0], leaves[1], leaves[2], head_gate=leaves[3], rescale=rescale)
    out.backward(grad.double())
    return [t.grad if t is not None else None for t in leaves]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("layout", TC_LAYOUTS)
@pytest.mark.parametrize("b,h,q,dv,d", TC_SHAPES)
def test_tensor_core_backward_matches_reference(kernel_backend, b, h, q, dv, d, layout, dtype):
    """grad_z (in z's layout), grad_weight_o, grad_bias and the gate's gradient of the
    tensor-core backward against the fp64 reference and the CPU kernel; repeatable bitwise."""
    cpu = headwise.testing.backend("cpu")
    z = make_tc_z(b, h, q, dv, layout, dtype)
    w, bias = make_params(h, dv, d, dtype=dtype)
    grad = torch.randn(b, q, d, generator=torch.Generator().manual_seed(9)).to(dtype)
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    z_dev = make_tc_z(b, h, q, dv, layout, dtype, device=kernel_backend.device)  # same values and strides
    for gate, rescale in [(None, False), (make_gate("row_hard", b, h), False), (make_gate("soft", b, h), True),
                          (all_closed_row_gate(b, h), True)]:
        results = []
        for ops in (kernel_backend, kernel_backend, cpu):
            dev = ops.device
            leaves = [(z_dev if dev == kernel_backend.device else z).detach().requires_grad_(),  # z keeps its strides
                      w.detach().to(dev, copy=True).requires_grad_(), bias.detach().to(dev, copy=True).requires_grad_(),
                      None if gate is None else gate.detach().to(dev, copy=True).requires_grad_()]
            out = ops.head_merge(leaves[0], leaves[1], leaves[2], head_gate=leaves[3], rescale=rescale)
            out.backward(grad.to(dev))
            results.append([t.grad.cpu() if t is not None else None for t in leaves])
        want = grads64(z, w, bias, gate, rescale, grad)
        for name, got, again, on_cpu, ref in zip(("z", "w", "bias", "gate"), *results, want):
            if ref is None:
                continue
            assert torch.equal(got, again), name  # fixed-order reductions, no atomics
            assert rel_err(got, ref) <= tol, (name, rel_err(got, ref))
            assert rel_err(got, on_cpu) <= 2 * tol, name
        if layout in ("bhqd", "bqhd_view"):  # dense z: grad_z in its layout
            assert results[0][0].stride() == z.stride()
