"""headwise.nn.MHARRouter: initialization, gradients, backend binding."""

import pytest
import torch

import headwise
from headwise import reference
from headwise.testing import rel_err


def test_new_router_returns_the_mean(backend):
    router = headwise.nn.MHARRouter(48, num_heads=4, ops=backend, device=backend.device)
    sources = torch.randn(5, 2, 3, 48, device=backend.device)
    torch.testing.assert_close(router(sources), sources.mean(0), rtol=1e-6, atol=1e-6)
    assert set(dict(router.named_parameters())) == {"query", "norm_weight"}


def test_trains_like_the_reference(backend):
    torch.manual_seed(0)
    router = headwise.nn.MHARRouter(40, num_heads=5, ops=backend, device=backend.device)
    with torch.no_grad():
        router.query.normal_(0, 0.3)
    sources = torch.randn(6, 2, 7, 40, device=backend.device, requires_grad=True)
    residual = torch.randn(2, 7, 40, device=backend.device)
    out = router(sources, num_sources=4, residual=residual)
    q, g = (p.detach().clone().requires_grad_() for p in (router.query, router.norm_weight))
    s_ref = sources.detach().clone().requires_grad_()
    expected = reference.mhar_route(s_ref, q, g, num_heads=5, num_sources=4, residual=residual)
    assert rel_err(out, expected) <= 2e-6
    grad = torch.randn_like(expected)
    out.backward(grad)
    expected.backward(grad)
    for got, want in ((sources.grad, s_ref.grad), (router.query.grad, q.grad), (router.norm_weight.grad, g.grad)):
        assert rel_err(got, want) <= 2e-6


def test_rejects_heads_not_dividing_d():
    with pytest.raises(ValueError, match="num_heads"):
        headwise.nn.MHARRouter(10, num_heads=3)
