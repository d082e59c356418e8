"""NaN/inf policy, 64-bit index math, and rejected calls that must not write anything."""

import pytest
import torch

from headwise import QKVLayout, reference
from headwise.testing import backend, rel_err

HOSTS = [backend("cpu"), backend("sim")]


@pytest.mark.parametrize("ops", HOSTS, ids=lambda o: o.ns)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_mhar_non_finite_inputs_propagate_like_the_reference(ops, bad):
    # Policy: non-finite inputs are not masked or repaired; each position's outputs are
    # non-finite exactly where the reference's are, and other positions are unaffected.
    sources = torch.randn(3, 2, 4, 16)
    sources[1, 0, 2, 5] = bad
    query, norm_weight = 0.3 * torch.randn(16), torch.ones(16)
    got = ops.mhar_route(sources, query, norm_weight, num_heads=4)
    want = reference.mhar_route(sources, query, norm_weight, num_heads=4)
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    assert not torch.isfinite(got[0, 2]).all() and torch.isfinite(got[1]).all()
    torch.testing.assert_close(got, want, equal_nan=True, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("ops", HOSTS, ids=lambda o: o.ns)
def test_qkv_non_finite_inputs_propagate_like_the_reference(ops):
    layout = QKVLayout(2, 1, 8)
    x = torch.randn(1, 3, 5)
    x[0, 1, 2] = float("nan")
    weight = torch.randn(layout.num_rows, 5)
    q_norm = torch.ones(8)
    got = ops.qkv_project(x, weight, layout=layout, q_norm=q_norm)
    want = reference.qkv_project(x, weight, layout=layout, q_norm=q_norm)
    for g, w in zip(got, want):
        assert torch.equal(torch.isnan(g), torch.isnan(w))
        assert torch.isnan(g[:, :, 1]).all() and not torch.isnan(g[:, :, [0, 2]]).any()


@pytest.mark.parametrize("ops", HOSTS, ids=lambda o: o.ns)
def test_mhar_64_bit_source_strides(ops):
    # Sources whose row stride exceeds 2^31 elements (a view into a sparse, mostly
    # untouched allocation of ~13 GB virtual memory; only the used pages are touched):
    # the kernels' index math must be 64-bit.
    stride_n = 2 ** 31 + 64
    try:
        base = torch.empty(2 * stride_n + 2 * 5 * 16, dtype=torch.bfloat16)
    except RuntimeError as e:  # the machine refuses the virtual allocation
        pytest.skip(f"cannot reserve the sparse buffer: {e}")
    sources = base.as_strided((3, 2, 5, 16), (stride_n, 5 * 16, 16, 1))
    values = torch.randn(3, 2, 5, 16).bfloat16()
    sources.copy_(values)
    query, norm_weight = 0.3 * torch.randn(16), torch.ones(16)
    got = ops.mhar_route(sources, query, norm_weight, num_heads=2)
    want = ops.mhar_route(values, query, norm_weight, num_heads=2)
    assert torch.equal(got, want)
    del sources, base


def grads_of(fn, leaves, grad, need=None):
    """Output and the gradients of the leaves whose index is in ``need`` (default: all)."""
    need = range(len(leaves)) if need is None else need
    ls = [x.detach().clone().requires_grad_(i in need) for i, x in enumerate(leaves)]
    out = fn(*ls)
    return [out.detach(), *torch.autograd.grad(out, [ls[i] for i in need], grad)]


def assert_same_non_finite(got, want, name, rtol=2e-5, atol=2e-5):
    """Non-finite exactly where the reference is (inf with its sign), close elsewhere."""
    assert torch.equal(torch.isfinite(got), torch.isfinite(want)), name
    torch.testing.assert_close(got, want, equal_nan=True, rtol=rtol, atol=atol, msg=name)


def merge_inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    b, h, q, dv, d = 2, 4, 5, 3, 7
    z = torch.randn(b, h, q, dv, generator=gen)
    weight_o, bias = torch.randn(d, h * dv, generator=gen) / 3, torch.randn(d, generator=gen)
    gate = torch.tensor([[0.5, 0.0, 1.5, 1.0], [1.0, 0.25, 0.7, 0.0]])  # a closed head per batch row
    return z, weight_o, bias, gate, torch.randn(b, q, d, generator=gen)


@pytest.mark.parametrize("ops", HOSTS, ids=lambda o: o.ns)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_head_merge_non_finite_inputs_propagate_like_the_reference(ops, bad):
    # A non-finite element of an open head's z reaches its (b, q) output row (every column:
    # W_O mixes Dv into D) and the stats of that (b, q, h); under rescale the gate's
    # gradient of every head of the row (through S). Nothing else.
    z, weight_o, bias, gate, grad = merge_inputs()
    z[1, 2, 3, 1] = bad  # head 2 of batch row 1 is open (g = 0.7)

    def fn(lib):
        def f(z, w, bias, gate):
            out, stats = lib.head_merge(z, w, bias, head_gate=gate, rescale=True, return_stats=True)
            f.stats = stats
            return out
        return f

    kernel, ref = fn(ops), fn(reference)
    got = grads_of(kernel, (z, weight_o, bias, gate), grad)
    want = grads_of(ref, (z, weight_o, bias, gate), grad)
    assert not torch.isfinite(got[0][1, 3]).any() and torch.isfinite(got[0][0]).all()
    assert torch.isfinite(got[0][1, [0, 1, 2, 4]]).all()
    for name, x, y in zip(("out", "z", "weight_o", "bias", "gate"), got, want):
        assert_same_non_finite(x, y, name)
    assert_same_non_finite(kernel.stats.z_norm, ref.stats.z_norm, "z_norm", rtol=1e-4, atol=1e-5)
    # out_norm: test_head_merge_non_finite_z_reaches_out_norm.


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("ops", HOSTS, ids=lambda o: o.ns)
def test_head_merge_non_finite_z_reaches_out_norm(ops, bad):
    z, weight_o, bias, gate, _ = merge_inputs()
    z[1, 2, 3, 1] = bad
    _, got = ops.head_merge(z, weight_o, bias, head_gate=gate, return_stats=True)
    _, want = reference.head_merge(z, weight_o, bias, head_gate=gate, return_stats=True)
    assert not torch.isfinite(want.out_norm[1, 3, 2]) and torch.isfinite(want.out_norm).sum() == want.out_norm.numel() - 1
    assert_same_non_finite(got.out_norm, want.out_norm, "out_norm", rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rescale", [False, True], ids=["plain", "clipped_rescale"])
@pytest.mark.parametrize("ops", HOSTS, ids=lambda o: o.ns)
def test_head_merge_non_finite_gate_grad_stays_in_its_head(ops, rescale):
    # Without rescale (or where the clip holds, S = sum_h g <= 1, so ds/dS = 0) the gate's
    # gradient of (b, h) is s c[b, h] alone: a NaN in head h's z makes only that entry NaN.
    z, weight_o, bias, gate, grad = merge_inputs()
    gate = gate / 4  # S <= 1 in every row: the rescale's clip is active
    z[1, 2, 3, 1] = float("nan")
    f = lambda lib: (lambda z, w, bias, g: lib.head_merge(z, w, bias, head_gate=g, rescale=rescale))  # noqa: E731
    got = grads_of(f(ops), (z, weight_o, bias, gate), grad)
    want = grads_of(f(reference), (z, weight_o, bias, gate), grad)
    assert torch.isnan(want[4]).sum() == 1 and torch.isnan(want[4][1, 2])
    assert_same_non_finite(got[4], want[4], "gate")


@pytest.mark.parametrize("ops", HOSTS, ids=lambda o: o.ns)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_head_merge_closed_head_is_not_read(ops, bad):
    # The documented deviation from the dense-mask reference: a head whose gate is exactly
    # 0 is not read, so a non-finite value in its z reaches neither the output nor the
    # stats (0 for a closed head), grad_weight_o or grad_z (0 there). The reference
    # multiplies it by 0 and gets NaN; the kernels equal the reference on a z whose closed
    # head is finite.
    z, weight_o, bias, gate, grad = merge_inputs()
    z_bad = z.clone()
    z_bad[1, 3] = bad  # head 3 of batch row 1 is closed
    z_bad[0, 1, 2, 0] = bad  # head 1 of batch row 0 is closed
    kw = dict(head_gate=gate, rescale=True)
    f = lambda lib: (lambda z, w, bias: lib.head_merge(z, w, bias, **kw))  # noqa: E731
    got = grads_of(f(ops), (z_bad, weight_o, bias), grad)
    want = grads_of(f(reference), (z, weight_o, bias), grad)
    for name, x, y in zip(("out", "z", "weight_o", "bias"), got, want):
        assert torch.isfinite(x).all(), name
        assert rel_err(x, y) <= 2e-5, name
    assert got[1][1, 3].eq(0).all() and got[1][0, 1].eq(0).all()
    _, stats = ops.head_merge(z_bad, weight_o, bias, return_stats=True, **kw)
    assert stats.z_norm[1, :, 3].eq(0).all() and stats.out_norm[0, :, 1].eq(0).all()
    assert torch.isfinite(stats.z_norm).all() and torch.isfinite(stats.out_norm).all()
    # The dense-mask reference does read it: NaN * 0.
    assert torch.isnan(reference.head_merge(z_bad, weight_o, bias, **kw)[1]).all()


DCMHA_NAN_CASES = [
    pytest.param(dict(), id="causal"),
    pytest.param(dict(window=5, head_groups=2), id="window5-groups2"),
    pytest.param(dict(causal=False), id="noncausal"),
]


@pytest.mark.parametrize("where", ["a", "w1", "g"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("ops", HOSTS, ids=lambda o: o.ns)
def test_dcmha_compose_non_finite_inputs_propagate_like_the_reference(ops, bad, where):
    # Compose is dense (no mask, nothing skipped): output and every gradient are
    # non-finite exactly where the reference's are. A non-finite a[b, h, t, s] reaches
    # (b, every head of h's group, t, s) and nothing else.
    from headwise import DCMHAWeights

    b, h, t = 2, 4, 7
    (_, _, _), w = dcmha_inputs(b, h, t, 1, torch.float32, seed=3)
    a = torch.randn(b, h, t, t, generator=torch.Generator().manual_seed(4))
    w1, w2, g = (x.clone() for x in w)
    if where == "a":
        a[1, 2, 3, 5] = bad
    elif where == "w1":
        w1[1, 3, 0, 1, 2] = w1[1, 3, 2, 1, 2] = bad  # query-side slots of pre and post at t = 3
    else:
        g[1, 3, 1, 1] = g[1, 3, 3, 1] = bad  # key-side slots at s = 3
    grad = torch.randn(b, h, t, t, generator=torch.Generator().manual_seed(5))
    for slot in ("pre", "post"):
        f = lambda lib: (lambda a, *w: lib.dcmha_compose(a, DCMHAWeights(*w), slot, head_groups=2))  # noqa: E731
        got = grads_of(f(ops), (a, w1, w2, g), grad)
        want = grads_of(f(reference), (a, w1, w2, g), grad)
        assert not torch.isfinite(want[0]).all()
        for name, x, y in zip(("out", "a", "w1", "w2", "g"), got, want):
            assert_same_non_finite(x, y, f"{slot} {name}")
        if where == "a":
            bad_at = ~torch.isfinite(got[0])
            assert bad_at[1, :2].sum() == 0 and bad_at[0].sum() == 0 and bad_at[1, 2:, 3, 5].all()
            assert bad_at.sum() == 2


@pytest.mark.parametrize("kw", DCMHA_NAN_CASES)
@pytest.mark.parametrize("where", ["q", "k", "w1"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("ops", HOSTS, ids=lambda o: o.ns)
def test_dcmha_attention_non_finite_inputs_propagate_like_the_reference(ops, bad, where, kw):
    # Forward: a non-finite q[b, h, t] (or a query-side pre-compose weight at (b, t))
    # makes the pre-composed logits of row t non-finite for every head of h's group, the
    # softmax spreads it along the row: output row t of those heads is non-finite, nothing
    # else. A non-finite k[b, h, s] reaches every row that attends to key s (masked
    # logits are replaced, not multiplied), for every head of the group. T = 70 spans two
    # CPU key tiles of 64.
    from headwise import DCMHAWeights

    b, h, t, d = 2, 4, 70, 3
    (q, k, v), w = dcmha_inputs(b, h, t, d, torch.float32, seed=6)
    w1, w2, g = (x.clone() for x in w)
    if where == "q":
        q[1, 2, 66, 1] = bad
    elif where == "k":
        k[1, 2, 60, 1] = bad
    else:
        w1[1, 66, 0, 1, 2] = bad
    got = ops.dcmha_attention(q, k, v, DCMHAWeights(w1, w2, g), **kw)
    want = reference.dcmha_attention(q, k, v, DCMHAWeights(w1, w2, g), **kw)
    assert_same_non_finite(got, want, "out")
    rows = (~torch.isfinite(got)).any(-1)  # [B, H, T]
    groups = kw.get("head_groups", 1)
    heads = slice(2, 4) if groups == 2 else slice(0, 4)
    assert rows.sum() == rows[1, heads].sum() and rows[1, heads].all(0).sum() == rows[1, heads].any(0).sum()
    if where == "k":
        keep = reference.dcmha_mask(t, t, causal=kw.get("causal", True), window=kw.get("window"))
        assert torch.equal(rows[1, 2], keep[:, 60])
    else:
        assert rows[1, 2].nonzero().flatten().tolist() == [66]


@pytest.mark.parametrize("kw", DCMHA_NAN_CASES)
@pytest.mark.parametrize("ops", HOSTS, ids=lambda o: o.ns)
def test_dcmha_attention_non_finite_v_reaches_every_row_that_reads_it(ops, kw):
    # A NaN in v[b, h, s, j] reaches column j of head h (post-compose mixes
    # probabilities, not values) in every row that attends to key s, and nothing outside
    # that column. Rows that mask key s: the dense reference computes P' v with P' = 0
    # there, so 0 * NaN = NaN in every row; the kernels skip masked key tiles, so such a
    # row is NaN only if its key tiles happen to include s (implementation-defined).
    # Where the kernel is finite, it equals the reference.
    from headwise import DCMHAWeights

    b, h, t, d = 2, 4, 70, 3
    (q, k, v), w = dcmha_inputs(b, h, t, d, torch.float32, seed=7)
    v[1, 2, 60, 1] = float("nan")
    got = ops.dcmha_attention(q, k, v, DCMHAWeights(*w), **kw)
    want = reference.dcmha_attention(q, k, v, DCMHAWeights(*w), **kw)
    keep = reference.dcmha_mask(t, t, causal=kw.get("causal", True), window=kw.get("window"))
    nan = torch.isnan(got)
    assert nan[1, 2, :, 1][keep[:, 60]].all()
    assert nan.sum() == nan[1, 2, :, 1].sum() and torch.isnan(want[1, 2, :, 1]).all()
    fin = torch.isfinite(got) & torch.isfinite(want)
    assert fin.sum() >= got.numel() - t
    torch.testing.assert_close(got[fin], want[fin], rtol=2e-5, atol=2e-5)


BIG = 2 ** 31 + 64  # a stride beyond int32, in elements


def sparse_view(size, stride, dtype):
    """A view with these strides into a sparse, mostly untouched allocation (several GB of
    virtual memory; only the pages the test writes are touched). Skips the test when the
    machine refuses the virtual allocation."""
    extent = sum((n - 1) * st for n, st in zip(size, stride)) + 1
    try:
        base = torch.empty(extent, dtype=dtype)
    except RuntimeError as e:
        pytest.skip(f"cannot reserve the sparse buffer: {e}")
    return base.as_strided(size, stride)


def fwd_grads(fn, leaves, grad):
    """Output and gradients by torch.autograd.grad (leaves keep their strides)."""
    ls = [x.detach().requires_grad_() for x in leaves]
    out = fn(*ls)
    return [out.detach(), *torch.autograd.grad(out, ls, grad)]


@pytest.mark.parametrize("ops", HOSTS, ids=lambda o: o.ns)
def test_qkv_64_bit_batch_stride(ops):
    # x [B, S, D] with a batch stride beyond 2^31 elements: outputs and every gradient
    # (x, weight, bias, q_norm) bitwise those of the compact x.
    layout = QKVLayout(2, 1, 4)
    x = sparse_view((2, 3, 5), (BIG, 5, 1), torch.float32)
    values = torch.randn(2, 3, 5)
    x.copy_(values)
    weight, bias, q_norm = torch.randn(layout.num_rows, 5), torch.randn(layout.num_rows), 1 + 0.1 * torch.randn(4)

    def fn(x, weight, bias, q_norm):
        return torch.cat([t.flatten() for t in ops.qkv_project(x, weight, bias, layout=layout, q_norm=q_norm)])

    grad = torch.randn(2 * 3 * (2 + 1 + 1) * 4)
    got = fwd_grads(fn, (x, weight, bias, q_norm), grad)
    want = fwd_grads(fn, (values, weight, bias, q_norm), grad)
    for name, a, b in zip(("out", "x", "weight", "bias", "q_norm"), got, want):
        assert torch.equal(a, b), name


# z [B, H, Q, Dv] with one stride beyond 2^31 elements. "batch" and "head" take the CPU
# kernel's gather path (bf16: half the virtual memory), "bqhd_batch" its direct path (a
# transposed [B, Q, H, Dv] view, read in place, with batch offsets beyond 2^31), "query"
# the direct path with a GEMM leading dimension beyond int32.
MERGE_64 = {
    "batch": ((2, 3, 5, 4), (BIG, 20, 4, 1), torch.bfloat16),
    "head": ((1, 3, 5, 4), (60, BIG, 4, 1), torch.bfloat16),
    "bqhd_batch": ((2, 3, 5, 4), (BIG, 4, 12, 1), torch.float32),
    "query": ((1, 3, 2, 4), (24, 4, BIG, 1), torch.float32),
}


@pytest.mark.parametrize("case", list(MERGE_64))
@pytest.mark.parametrize("ops", HOSTS, ids=lambda o: o.ns)
def test_head_merge_64_bit_z_strides(ops, case):
    # Forward (with stats) and backward of z, weight_o, bias and a soft gate with a closed
    # head, against the same op on compact z. grad_z is allocated in empty_like's layout
    # (merge_args.h empty_like_layout): z is not dense here, so that is a dense tensor in
    # z's dimension order, B*H*Q*Dv elements (checked), never a buffer spanning z's
    # 2^31-element strides.
    size, stride, dtype = MERGE_64[case]
    b, h, q, dv = size
    z = sparse_view(size, stride, dtype)
    values = torch.randn(size).to(dtype)
    z.copy_(values)
    weight_o, bias = torch.randn(7, h * dv).to(dtype), torch.randn(7).to(dtype)
    gate = torch.tensor([0.5, 0.0, 1.5])
    grad = torch.randn(b, q, 7).to(dtype)

    def fn(z, weight_o, bias, gate):
        out, stats = ops.head_merge(z, weight_o, bias, head_gate=gate, rescale=True, return_stats=True)
        fn.stats = stats
        return out

    tol = 1e-2 if dtype == torch.bfloat16 else 2e-5
    got = fwd_grads(fn, (z, weight_o, bias, gate), grad)
    got_stats = fn.stats
    want = fwd_grads(fn, (values, weight_o, bias, gate), grad)
    grad_z = got[1]
    assert grad_z.stride() == torch.empty_like(z).stride()  # dense, in z's dimension order
    assert grad_z.untyped_storage().nbytes() == grad_z.numel() * grad_z.element_size()
    if case == "query" and ops.name == "cpu":
        # The CPU kernel hands this z to at::addmm_ as a [Q, H*Dv] view with leading
        # dimension 2^31 + 64; ATen does not pass that to the 32-bit BLAS and computes the
        # product another way, in another summation order: equal up to rounding (the
        # stats, whose out_norm comes from the same products, too).
        for name, a, b_ in zip(("z_norm", "out_norm"), got_stats, fn.stats):
            torch.testing.assert_close(a, b_, rtol=2e-6, atol=2e-6, msg=name)
        for name, a, b_ in zip(("out", "z", "weight_o", "bias", "gate"), got, want):
            torch.testing.assert_close(a, b_, rtol=2e-6, atol=2e-6, msg=name)
    else:
        for a, b_ in zip(got_stats, fn.stats):
            assert torch.equal(a, b_)
        for name, a, b_ in zip(("out", "z", "weight_o", "bias", "gate"), got, want):
            assert torch.equal(a, b_), name
    torch.testing.assert_close(got[0], reference.head_merge(values, weight_o, bias, head_gate=gate, rescale=True),
                               rtol=tol, atol=tol)


def dcmha_inputs(b, h, t, d, dtype, seed=0):
    from headwise import DCMHAWeights

    gen = torch.Generator().manual_seed(seed)
    w1 = torch.randn(b, t, 4, 2, h, generator=gen)
    w1 = w1 * torch.rsqrt(w1.square().mean(-1, keepdim=True) + 1e-6)
    w2, g = 0.3 * torch.randn(b, t, 4, 2, h, generator=gen) / h, 0.3 * torch.randn(b, t, 4, h, generator=gen)
    qkv = [torch.randn(b, h, t, d, generator=gen).to(dtype) for _ in range(3)]
    return qkv, DCMHAWeights(*(x.to(dtype) for x in (w1, w2, g)))


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("ops", HOSTS, ids=lambda o: o.ns)
def test_dcmha_attention_64_bit_batch_stride(ops, which):
    # One of q, k, v [B, H, T, d] with a batch stride beyond 2^31 elements (bf16). The
    # kernels take any strides (each backend copies its inputs to contiguous first); the
    # output and every gradient must be bitwise those of the compact input.
    from headwise import DCMHAWeights

    b, h, t, d = 2, 3, 5, 4
    (q, k, v), w = dcmha_inputs(b, h, t, d, torch.bfloat16)
    inputs = dict(q=q, k=k, v=v)
    big = sparse_view((b, h, t, d), (BIG, t * d, d, 1), torch.bfloat16)
    big.copy_(inputs[which])
    strided = dict(inputs, **{which: big})
    grad = torch.randn(b, h, t, d).bfloat16()

    def fn(q, k, v, w1, w2, g):
        return ops.dcmha_attention(q, k, v, DCMHAWeights(w1, w2, g), window=3, head_groups=3)

    got = fwd_grads(fn, (strided["q"], strided["k"], strided["v"], *w), grad)
    want = fwd_grads(fn, (q, k, v, *w), grad)
    for name, a, b_ in zip(("out", "q", "k", "v", "w1", "w2", "g"), got, want):
        assert torch.equal(a, b_), name


@pytest.mark.parametrize("slot", ["pre", "post"])
@pytest.mark.parametrize("ops", HOSTS, ids=lambda o: o.ns)
def test_dcmha_compose_64_bit_batch_stride(ops, slot):
    from headwise import DCMHAWeights

    b, h, t = 2, 4, 5
    _, w = dcmha_inputs(b, h, t, 1, torch.float32, seed=1)
    values = torch.randn(b, h, t, t)
    a = sparse_view((b, h, t, t), (BIG, t * t, t, 1), torch.float32)
    a.copy_(values)
    grad = torch.randn(b, h, t, t)

    def fn(a, w1, w2, g):
        return ops.dcmha_compose(a, DCMHAWeights(w1, w2, g), slot, head_groups=2)

    got = fwd_grads(fn, (a, *w), grad)
    want = fwd_grads(fn, (values, *w), grad)
    for name, x, y in zip(("out", "a", "w1", "w2", "g"), got, want):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("ops", HOSTS, ids=lambda o: o.ns)
def test_rejected_backward_into_leaves_the_buffer_untouched(ops):
    lib = getattr(torch.ops, ops.ns)
    sources = torch.randn(3, 2, 5, 16)
    query, norm_weight = 0.3 * torch.randn(16), torch.ones(16)
    _, w = lib.mhar_route(sources, query, norm_weight, 4, 3, 1e-6, None, None)
    buf = torch.full((3, 2, 5, 16), 7.0)
    for bad in (dict(w=w[:2]), dict(grad_out=torch.randn(2, 5, 8)), dict(num_heads=3)):
        args = dict(grad_out=torch.randn(2, 5, 16), w=w, num_heads=4)
        args.update(bad)
        with pytest.raises((ValueError, TypeError)):
            lib.mhar_route_backward_into(args["grad_out"], sources, query, norm_weight, args["w"], buf,
                                         args["num_heads"], 3, 1e-6, True)
        assert torch.equal(buf, torch.full_like(buf, 7.0))
