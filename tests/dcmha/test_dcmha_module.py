"""headwise.nn.DCMHAttention: the module against its reference composition, and its
DCFormer initialization starting close to plain MHA."""

import pytest
import torch

import headwise
from headwise import DCMHAWeights
from headwise.testing import rel_err


def composing_module(qk_norm=False):
    """A small DCMHAttention with larger generator weights than the init, so that the
    composition matters (and, with qk_norm, norm weights away from one), and its input."""
    torch.manual_seed(0)
    m = headwise.nn.DCMHAttention(32, 4, window=6, qk_norm=qk_norm)
    with torch.no_grad():
        m.qkw.normal_(0, 0.3)
        m.dd.normal_(0, 0.3)
        if qk_norm:
            m.q_norm.normal_(1, 0.2)
            m.k_norm.normal_(1, 0.2)
    return m, torch.randn(2, 13, 32)


def rope_tables(t, head_dim):
    angles = torch.outer(torch.arange(t, dtype=torch.float32), 1e4 ** (-torch.arange(head_dim // 2) / (head_dim // 2)))
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk_norm_rope"])
def test_module_matches_reference_forward_and_grads(qk_norm):
    m, x = composing_module(qk_norm)
    rope = rope_tables(x.shape[1], m.head_dim) if qk_norm else None
    y = m(x, rope=rope)
    y_ref = m.reference_forward(x, rope=rope)
    assert rel_err(y, y_ref) <= 1e-5
    y.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    y_ref.square().sum().backward()
    for n, p in m.named_parameters():
        assert rel_err(grads[n], p.grad) <= 1e-4, n
    if qk_norm:
        assert grads["q_norm"].abs().max() > 0 and grads["k_norm"].abs().max() > 0


def test_qk_norm_normalizes_each_head_of_q_and_k():
    # With qk_norm the module's q and k are the per-head RMSNorms of the projections: scaling
    # the q/k rows of the packed weight by a per-head constant leaves the output unchanged.
    m, x = composing_module(qk_norm=True)
    y = m(x)
    with torch.no_grad():
        rows = m.layout.num_q_heads * m.head_dim + m.layout.num_kv_heads * m.head_dim
        m.qkv.weight[:rows] *= torch.linspace(0.5, 3.0, rows // m.head_dim).repeat_interleave(m.head_dim)[:, None]
    assert rel_err(m(x), y) <= 1e-5


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
