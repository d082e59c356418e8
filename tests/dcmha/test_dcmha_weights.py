"""headwise.dcmha_weights (SPEC section 5) against the reference."""

import pytest
import torch

import headwise
from headwise import reference
from headwise.testing import rel_err


def make_params(d, h, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    kh = 4 * h
    x = torch.randn(2, 5, d, generator=gen)
    dw1 = torch.randn(d, 4, kh, generator=gen) * (2 / (d + kh)) ** 0.5
    qkw = torch.randn(4, kh, 4, h, generator=gen) * 0.3
    dd = torch.randn(d, 4 * h, generator=gen) * 0.1
    return [t.to(dtype) for t in (x, dw1, qkw, dd)]


@pytest.mark.parametrize("d,h", [(16, 2), (37, 4), (64, 8)])
def test_matches_reference_with_gradients(d, h):
    args = make_params(d, h)
    leaves = [a.clone().requires_grad_() for a in args]
    ref_leaves = [a.clone().requires_grad_() for a in args]
    got = headwise.dcmha_weights(*leaves)
    want = reference.dcmha_weights(*ref_leaves)
    assert isinstance(got, headwise.DCMHAWeights)
    assert got.w1.shape == (2, 5, 4, 2, h) and got.w2.shape == (2, 5, 4, 2, h) and got.g.shape == (2, 5, 4, h)
    for x, y in zip(got, want):
        assert rel_err(x, y) <= 1e-5
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(x.shape, generator=gen) for x in got]
    torch.autograd.backward(list(got), grads)
    torch.autograd.backward(list(want), grads)
    for a, b in zip(leaves, ref_leaves):
        assert rel_err(a.grad, b.grad) <= 1e-5
    # W1 is RMS-normalized over heads: mean_H W1^2 = ms / (ms + 1e-6) of the raw rows.
    ms = got.w1.square().mean(-1)
    assert (ms <= 1 + 1e-5).all() and ms.median() > 1 - 1e-4


def test_gradcheck_float64():
    args = [a.requires_grad_() for a in make_params(6, 2, dtype=torch.float64)]
    assert torch.autograd.gradcheck(lambda *a: tuple(headwise.dcmha_weights(*a)), args)


def test_bad_shapes():
    x, dw1, qkw, dd = make_params(16, 2)
    with pytest.raises(ValueError, match="dw1"):
        headwise.dcmha_weights(x, dw1[:8], qkw, dd)
    with pytest.raises(ValueError, match="qkw"):
        headwise.dcmha_weights(x, dw1, qkw[:, :, :2], dd)
    with pytest.raises(ValueError, match="dd"):
        headwise.dcmha_weights(x, dw1, qkw, dd[:, :4])
