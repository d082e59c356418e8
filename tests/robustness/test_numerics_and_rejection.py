"""NaN/inf policy, 64-bit index math, and rejected calls that must not write anything."""

import pytest
import torch

from headwise import QKVLayout, reference
from headwise.testing import backend

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
