"""headwise.nn.DCMHAttention: the module against its reference composition, and its
DCFormer initialization starting close to plain MHA."""

import torch

import headwise
from headwise import DCMHAWeights
from headwise.testing import rel_err


def composing_module():
    """A small DCMHAttention with larger generator weights than the init, so that the
    composition matters, and its input."""
    torch.manual_seed(0)
    m = headwise.nn.DCMHAttention(32, 4, window=6)
    with torch.no_grad():
        m.qkw.normal_(0, 0.3)
        m.dd.normal_(0, 0.3)
    return m, torch.randn(2, 13, 32)


def test_module_matches_reference_forward_and_grads():
    m, x = composing_module()
    y = m(x)
    y_ref = m.reference_forward(x)
    assert rel_err(y, y_ref) <= 1e-5
    y.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    y_ref.square().sum().backward()
    for n, p in m.named_parameters():
        assert rel_err(grads[n], p.grad) <= 1e-4, n


def test_init_starts_close_to_plain_mha():
    torch.manual_seed(0)
    m = headwise.nn.DCMHAttention(64, 8)
    x = torch.randn(1, 33, 64)
    w = m.compose_weights(x)
    assert w.w2.abs().max() < 0.02 and w.g.abs().max() < 0.05
    plain = m(x, weights=DCMHAWeights.zeros(1, 33, 8))
    assert rel_err(m(x), plain) < 0.05


def test_module_under_bf16_autocast():
    # The whole module under autocast: fused QKV and head merge cast like nn.Linear, the
    # attention like SDPA; the output is bf16 and close to the fp32 module's, and every
    # parameter (fp32) gets a gradient close to the fp32 run's.
    m, x = composing_module()
    y32 = m(x)
    y32.square().sum().backward()
    g32 = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    assert y.dtype == torch.bfloat16
    assert rel_err(y.float(), y32) <= 3e-2
    y.float().square().sum().backward()
    for n, p in m.named_parameters():
        assert p.grad.dtype == torch.float32 and rel_err(p.grad, g32[n]) <= 0.1, n
