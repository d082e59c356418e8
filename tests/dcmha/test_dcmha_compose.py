"""headwise.dcmha_compose (SPEC section 5): the factorized reference against the explicit
per-(t, s) H x H oracle, and every backend (CPU kernel, emulated CUDA kernel) against the
reference, forward and all gradients."""

import pytest
import torch

import headwise
from headwise import DCMHAWeights, reference
from headwise.testing import rel_err, with_one_and_many_threads

from dcmha_helpers import explicit_compose, make_weights

FP32_TOL = 2e-6


@pytest.mark.parametrize("slot", ["pre", "post"])
@pytest.mark.parametrize("h,groups", [(2, 1), (4, 1), (8, 1), (8, 2), (16, 4), (32, 1), (32, 8), (6, 3)])
def test_reference_matches_explicit_oracle(slot, h, groups):
    b, t = 2, 5
    a = torch.randn(b, h, t, t, dtype=torch.float64)
    w = make_weights(b, t, h, dtype=torch.float64)
    got = reference.dcmha_compose(a, w, slot, head_groups=groups)
    assert torch.allclose(got, explicit_compose(a, w, slot, groups), rtol=1e-12, atol=1e-12)


def _fwd_bwd(fn, a, w, grad, **kw):
    leaves = [x.detach().clone().requires_grad_() for x in (a, *w)]
    out = fn(leaves[0], DCMHAWeights(*leaves[1:]), **kw)
    out.backward(grad)
    return [out.detach()] + [x.grad for x in leaves]


@pytest.mark.parametrize("slot", ["pre", "post"])
@pytest.mark.parametrize("b,h,t,groups", [
    (2, 2, 3, 1), (1, 4, 5, 2), (2, 8, 37, 1), (1, 16, 5, 4), (1, 32, 37, 1), (1, 3, 123, 1), (1, 8, 123, 8),
    (2, 5, 5, 1), (1, 5, 37, 5), (1, 32, 123, 4), (1, 3, 3, 3),
])
def test_matches_reference_fp32(backend, slot, b, h, t, groups):
    gen = torch.Generator().manual_seed(t + h)
    a = torch.randn(b, h, t, t, generator=gen).to(backend.device)
    w = make_weights(b, t, h, device=backend.device, seed=h)
    grad = torch.randn(b, h, t, t, generator=gen).to(backend.device)
    kw = dict(slot=slot, head_groups=groups)
    got = _fwd_bwd(backend.dcmha_compose, a, w, grad, **kw)
    want = _fwd_bwd(reference.dcmha_compose, a, w, grad, **kw)
    names = ["out", "grad a", "grad w1", "grad w2", "grad g"]
    for name, x, y in zip(names, got, want):
        err = rel_err(x, y)
        assert err <= FP32_TOL, f"{name}: relative error {err:.3g}"
    # Slots the op does not use get exact zero gradients.
    unused = [2, 3] if slot == "pre" else [0, 1]
    for grad_w in got[2:]:
        assert torch.count_nonzero(grad_w[:, :, unused]) == 0


@pytest.mark.parametrize("slot,b,t", [("pre", 1, 37), ("post", 2, 5)])
def test_forward_whose_block_does_not_fit_uses_library_products(monkeypatch, slot, b, t):
    # fp32 at H = 32 in groups of one head: dcmha_compose_fwd's group totals
    # (G x 2 KiB) and column weights pass the 99 KiB of sm_86/89/120 (HEADWISE_SIM_SMEM_OPTIN),
    # so the forward takes compose_forward_by_library (einsums). It matches the reference,
    # and the kernel that an sm_90-sized limit runs.
    sim = headwise.testing.backend("sim")
    gen = torch.Generator().manual_seed(t)
    a = torch.randn(b, 32, t, t, generator=gen)
    w = make_weights(b, t, 32, seed=t)
    kw = dict(slot=slot, head_groups=32)
    with torch.profiler.profile() as prof:
        by_kernel = sim.dcmha_compose(a, w, **kw)
    assert not any(e.name == "aten::einsum" for e in prof.events())
    monkeypatch.setenv("HEADWISE_SIM_SMEM_OPTIN", "101376")
    with torch.profiler.profile() as prof:
        by_library = sim.dcmha_compose(a, w, **kw)
    assert any(e.name == "aten::einsum" for e in prof.events())
    want = reference.dcmha_compose(a.double(), DCMHAWeights(*(x.double() for x in w)), **kw)
    assert rel_err(by_library.double(), want) <= FP32_TOL
    assert rel_err(by_library, by_kernel) <= FP32_TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("slot,b,h,t,groups", [("pre", 1, 32, 37, 1), ("post", 2, 32, 5, 4), ("pre", 1, 30, 130, 3)])
def test_backward_on_parts_with_99_kib_uses_library_products(monkeypatch, dtype, slot, b, h, t, groups):
    # On a device whose opt-in shared memory is 99 KiB (sm_86/89/120, modelled by
    # HEADWISE_SIM_SMEM_OPTIN), dcmha_compose_bwd's key-side block does not fit at H ~ 32:
    # the backward takes compose_backward_by_library (einsums) and matches the reference.
    monkeypatch.setenv("HEADWISE_SIM_SMEM_OPTIN", "101376")
    sim = headwise.testing.backend("sim")
    gen = torch.Generator().manual_seed(t + h)
    a = torch.randn(b, h, t, t, generator=gen).to(dtype)
    w = make_weights(b, t, h, seed=h, dtype=dtype)
    grad = torch.randn(b, h, t, t, generator=gen).to(dtype)
    kw = dict(slot=slot, head_groups=groups)
    with torch.profiler.profile() as prof:
        got = _fwd_bwd(sim.dcmha_compose, a, w, grad, **kw)
    took_library = any(e.name == "aten::einsum" for e in prof.events())
    assert took_library == (h == 32 or dtype == torch.float32)  # bf16 fits up to H = 31, fp32 up to 27
    want = _fwd_bwd(reference.dcmha_compose, a.double(), [x.double() for x in w], grad.double(), **kw)
    tol = FP32_TOL if dtype == torch.float32 else 2e-2
    for name, x, y in zip(["out", "grad a", "grad w1", "grad w2", "grad g"], got, want):
        err = rel_err(x.double(), y)
        assert err <= tol, f"{name}: relative error {err:.3g}"
    unused = [2, 3] if slot == "pre" else [0, 1]
    for grad_w in got[2:]:
        assert torch.count_nonzero(grad_w[:, :, unused]) == 0


# The CUDA tile kernels (dcmha_kernel.cuh): 128 columns x 128 rows per CTA, 16-byte tiles
# where S * elem is a multiple of 16 and the tensors are 16-byte aligned, else 4-byte /
# 2-byte elements. These shapes cross the column tile and row chunk edges, on both paths,
# with one and several head groups (G > 1 keeps group totals in shared scratch).
@pytest.mark.parametrize("slot", ["pre", "post"])
@pytest.mark.parametrize("b,h,t,groups", [
    (1, 5, 132, 1),    # fp32 16-byte path (132 * 4 % 16 == 0), two column tiles and row chunks
    (1, 3, 131, 3),    # 4-byte fallback, hg = 1
    (2, 32, 130, 8),   # 4-byte fallback, H = 32 in 8 groups
    (1, 32, 136, 1),   # 16-byte path, H = 32 in one group
    (1, 32, 132, 32),  # 16-byte path, hg = 1: 32 groups
])
def test_tile_edges_match_reference_fp32(backend, slot, b, h, t, groups):
    if backend.name == "cpu":
        pytest.skip("the tile edges are the CUDA kernels'")
    gen = torch.Generator().manual_seed(t * h)
    a = torch.randn(b, h, t, t, generator=gen).to(backend.device)
    w = make_weights(b, t, h, device=backend.device, seed=t)
    grad = torch.randn(b, h, t, t, generator=gen).to(backend.device)
    kw = dict(slot=slot, head_groups=groups)
    got = _fwd_bwd(backend.dcmha_compose, a, w, grad, **kw)
    want = _fwd_bwd(reference.dcmha_compose, a, w, grad, **kw)
    for name, x, y in zip(["out", "grad a", "grad w1", "grad w2", "grad g"], got, want):
        err = rel_err(x, y)
        assert err <= FP32_TOL, f"{name}: relative error {err:.3g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [136, 37])  # 16-byte path (136 * 2 % 16 == 0) and the 2-byte fallback
def test_low_precision_tiles_close_to_reference(backend, dtype, t):
    if backend.name == "cpu":
        pytest.skip("the tile paths are the CUDA kernels'")
    gen = torch.Generator().manual_seed(t)
    a = torch.randn(1, 8, t, t, generator=gen).to(backend.device, dtype)
    w = make_weights(1, t, 8, device=backend.device, dtype=dtype)
    grad = torch.randn(1, 8, t, t, generator=gen).to(backend.device, dtype)
    got = _fwd_bwd(backend.dcmha_compose, a, w, grad, slot="pre", head_groups=2)
    want = _fwd_bwd(reference.dcmha_compose, a.double(), DCMHAWeights(*(x.double() for x in w)), grad.double(),
                    slot="pre", head_groups=2)
    for name, x, y in zip(["out", "grad a", "grad w1", "grad w2", "grad g"], got, want):
        assert rel_err(x, y) <= 2e-2, name


def _misaligned(x):
    """x's values in a contiguous view 4 bytes past a 16-byte boundary."""
    store = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
    view = store[1:].view(x.shape)
    view.copy_(x)
    assert view.is_contiguous() and view.data_ptr() % 16 != 0
    return view


def test_misaligned_views_match_aligned(backend):
    # a and the weights 4 bytes past a 16-byte boundary: the kernels take the element paths.
    t = 8
    a = torch.randn(2, 4, t, t).to(backend.device)
    w = make_weights(2, t, 4, device=backend.device)
    grad = torch.randn(2, 4, t, t).to(backend.device)
    ops = getattr(torch.ops, backend.ns)

    def run(a, w):  # the ops themselves: autograd would hand the backward aligned copies
        return [ops.dcmha_compose(a, *w, 1, 1), *ops.dcmha_compose_backward(grad, a, *w, 1, 1)]

    want = run(a, w)
    got = run(_misaligned(a), [_misaligned(x) for x in w])
    for x, y in zip(got, want):
        assert torch.equal(x, y)


def test_backward_bitwise_repeatable(backend):
    # Fixed-order reductions (no atomics): two runs give identical bits.
    gen = torch.Generator().manual_seed(11)
    a = torch.randn(2, 8, 133, 133, generator=gen).to(backend.device)
    w = make_weights(2, 133, 8, device=backend.device, seed=4)
    grad = torch.randn(2, 8, 133, 133, generator=gen).to(backend.device)
    first = _fwd_bwd(backend.dcmha_compose, a, w, grad, slot="pre", head_groups=2)
    second = _fwd_bwd(backend.dcmha_compose, a, w, grad, slot="pre", head_groups=2)
    for x, y in zip(first, second):
        assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("t,groups", [(131, 1), (144, 4)])
def test_backward_row_blocking_bitwise_equal_to_one_row(monkeypatch, dtype, t, groups):
    # dcmha_compose_bwd<T, 2> (two rows per step, the default where ~156 KiB fits) and
    # dcmha_compose_bwd<T, 1> (one row per step, taken under a 120000-byte opt-in limit)
    # sum in the same order: bitwise the same results (odd last step at T = 131).
    sim = headwise.testing.backend("sim")
    gen = torch.Generator().manual_seed(t)
    a = torch.randn(1, 32, t, t, generator=gen).to(dtype)
    w = make_weights(1, t, 32, seed=t, dtype=dtype)
    grad = torch.randn(1, 32, t, t, generator=gen).to(dtype)
    kw = dict(slot="post", head_groups=groups)
    two_rows = _fwd_bwd(sim.dcmha_compose, a, w, grad, **kw)
    monkeypatch.setenv("HEADWISE_SIM_SMEM_OPTIN", "120000")
    with torch.profiler.profile() as prof:
        one_row = _fwd_bwd(sim.dcmha_compose, a, w, grad, **kw)
    assert not any(e.name == "aten::einsum" for e in prof.events())
    for x, y in zip(two_rows, one_row):
        assert torch.equal(x, y)


def test_backward_rows_env_keeps_the_one_row_kernel(monkeypatch):
    # HEADWISE_DCMHA_COMPOSE_BWD_ROWS=1 launches the one-row kernel (less shared memory,
    # two CTAs per SM) where the two-row one fits: same bits, for A/B timing on a GPU.
    import importlib.util

    if importlib.util.find_spec("headwise._sim_profile") is None:
        pytest.skip("headwise._sim_profile not built")
    from headwise.ops import load_profile_library
    from headwise.testing import profiled_launches

    ops = load_profile_library()
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(1, 32, 70, 70, generator=gen).bfloat16()
    w = make_weights(1, 70, 32, seed=1, dtype=torch.bfloat16)
    grad = torch.randn(1, 32, 70, 70, generator=gen).bfloat16()

    def run():
        return profiled_launches(lambda: _fwd_bwd(ops.dcmha_compose, a, w, grad, slot="pre"))

    two, recs_two = run()
    monkeypatch.setenv("HEADWISE_DCMHA_COMPOSE_BWD_ROWS", "1")
    one, recs_one = run()
    smem = [[r["dynamic_smem_bytes"] for r in recs if r["kernel"] == "dcmha_compose_bwd"] for recs in (recs_two, recs_one)]
    assert len(smem[0]) == len(smem[1]) == 1 and smem[0][0] > smem[1][0], smem
    for x, y in zip(two, one):
        assert torch.equal(x, y)


def test_zero_weights_are_identity(backend):
    a = torch.randn(2, 4, 7, 7).to(backend.device)
    w = DCMHAWeights.zeros(2, 7, 4, device=backend.device)
    for slot in ("pre", "post"):
        assert torch.equal(backend.dcmha_compose(a, w, slot), a)


def test_groups_do_not_mix(backend):
    # With 2 groups, perturbing group 1's input leaves group 0's output unchanged.
    a = torch.randn(1, 8, 5, 5).to(backend.device)
    w = make_weights(1, 5, 8, device=backend.device)
    a2 = a.clone()
    a2[:, 4:] += 1.0
    y1 = backend.dcmha_compose(a, w, "pre", head_groups=2)
    y2 = backend.dcmha_compose(a2, w, "pre", head_groups=2)
    assert torch.equal(y1[:, :4], y2[:, :4])
    assert not torch.equal(y1[:, 4:], y2[:, 4:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_close_to_reference(backend, dtype):
    a = torch.randn(1, 4, 37, 37).to(backend.device, dtype)
    w = make_weights(1, 37, 4, device=backend.device, dtype=dtype)
    got = backend.dcmha_compose(a, w, "post")
    want = reference.dcmha_compose(a.double(), DCMHAWeights(*(x.double() for x in w)), "post")
    assert rel_err(got, want) <= 1e-2


def test_gradcheck_float64_cpu_kernel():
    a = torch.randn(2, 4, 5, 5, dtype=torch.float64, requires_grad=True)
    w = [x.requires_grad_() for x in make_weights(2, 5, 4, dtype=torch.float64, scale=0.8)]
    for slot, groups in (("pre", 1), ("post", 2)):
        fn = lambda a, w1, w2, g: headwise.dcmha_compose(a, DCMHAWeights(w1, w2, g), slot,  # noqa: E731
                                                           head_groups=groups)
        assert torch.autograd.gradcheck(fn, (a, *w))


def test_opcheck(backend):
    op = getattr(torch.ops, backend.ns).dcmha_compose
    a = torch.randn(2, 4, 5, 5, device=backend.device, requires_grad=True)
    w = [x.requires_grad_() for x in make_weights(2, 5, 4, device=backend.device)]
    for slot, groups in ((0, 1), (1, 2)):
        torch.library.opcheck(op, (a, *w, slot, groups))


def _run(ops):
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(2, 8, 70, 70, generator=gen)
    w = make_weights(2, 70, 8)
    return _fwd_bwd(ops.dcmha_compose, a, w, torch.randn(2, 8, 70, 70, generator=gen), slot="pre")


def test_deterministic_across_thread_counts(host_backend):
    one, many = with_one_and_many_threads(lambda: _run(host_backend))
    for x, y in zip(one, many):
        assert torch.equal(x, y)


def test_compiles_fullgraph(host_backend):
    a = torch.randn(1, 4, 5, 5, requires_grad=True)
    w = make_weights(1, 5, 4)

    def step(a, w1, w2, g):
        return host_backend.dcmha_compose(a, DCMHAWeights(w1, w2, g), "post").square().sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    compiled(a, *w).backward()
    got = a.grad.clone()
    a.grad = None
    step(a, *w).backward()
    assert torch.equal(got, a.grad)


class TestBadInput:
    def call(self, ops, a=None, w=None, slot="pre", head_groups=1):
        a = torch.randn(1, 4, 5, 5) if a is None else a
        w = make_weights(1, 5, 4) if w is None else w
        return ops.dcmha_compose(a, w, slot, head_groups=head_groups)

    def test_a_not_4d(self, host_backend):
        with pytest.raises(ValueError, match="a must be 4-D"):
            self.call(host_backend, a=torch.randn(4, 5, 5))

    def test_a_not_square(self, host_backend):
        with pytest.raises(ValueError, match="S = T"):
            self.call(host_backend, a=torch.randn(1, 4, 5, 6))

    def test_bad_slot(self, host_backend):
        with pytest.raises(ValueError, match="slot"):
            self.call(host_backend, slot="middle")

    def test_bad_groups(self, host_backend):
        with pytest.raises(ValueError, match="head_groups"):
            self.call(host_backend, head_groups=3)

    def test_weight_shapes(self, host_backend):
        w = make_weights(1, 5, 4)
        with pytest.raises(ValueError, match="weights.w1 dim 4"):
            self.call(host_backend, w=DCMHAWeights(w.w1[..., :3], w.w2, w.g))
        with pytest.raises(ValueError, match="weights.g dim 1"):
            self.call(host_backend, w=DCMHAWeights(w.w1, w.w2, w.g[:, :4]))
        with pytest.raises(ValueError, match="weights"):
            self.call(host_backend, w=(w.w1, w.w2))

    def test_weight_dtype(self, host_backend):
        w = make_weights(1, 5, 4)
        with pytest.raises(TypeError, match="weights.w2 must have the dtype of a"):
            self.call(host_backend, w=DCMHAWeights(w.w1, w.w2.double(), w.g))

    def test_double_rejected_by_sim(self):
        with pytest.raises(TypeError, match="a must be float32, bfloat16 or float16"):
            self.call(headwise.testing.backend("sim"), a=torch.randn(1, 4, 5, 5, dtype=torch.float64),
                      w=make_weights(1, 5, 4, dtype=torch.float64))
