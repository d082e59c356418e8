"""The CUDA kernels of the fused DCMHA attention (forward and backward), run by the SIMT
emulator (torch.ops.headwise_sim), against the materializing reference."""

import pytest
import torch

import headwise
from headwise import DCMHAWeights, reference
from headwise.testing import rel_err

from dcmha_helpers import make_weights

SIM = headwise.testing.backend("sim")
# (B, H, T, dh, dv, kwargs): odd T, every H the CUDA kernels take up to 32, head groups,
# windows, tiles beyond one block.
CASES = [
    (1, 2, 3, 4, 4, {}),
    (2, 4, 5, 8, 6, {}),
    (1, 8, 37, 16, 16, {}),
    (1, 16, 37, 8, 8, dict(head_groups=4)),
    (1, 32, 5, 4, 4, {}),
    (1, 3, 123, 16, 8, dict(window=70)),
    (1, 4, 150, 8, 8, {}),
    (1, 4, 37, 8, 8, dict(causal=False, window=5)),
]


@pytest.mark.parametrize("b,h,t,dh,dv,kw", CASES + [(1, 4, 37, 8, 8, dict(window=1))])
def test_sim_forward_matches_reference(b, h, t, dh, dv, kw):
    gen = torch.Generator().manual_seed(t + h)
    q, k = torch.randn(b, h, t, dh, generator=gen), torch.randn(b, h, t, dh, generator=gen)
    v = torch.randn(b, h, t, dv, generator=gen)
    w = make_weights(b, t, h, seed=h)
    got = SIM.dcmha_attention(q, k, v, w, **kw)
    want = reference.dcmha_attention(q, k, v, w, **kw)
    assert rel_err(got, want) <= 5e-6
    # The row statistics agree with the CPU kernel's.
    args = (q, k, v, *w, kw.get("causal", True), kw.get("window", 0), dh ** -0.5, kw.get("head_groups", 1))
    _, stats_sim = torch.ops.headwise_sim.dcmha_attention(*args)
    _, stats_cpu = torch.ops.headwise.dcmha_attention(*args)
    assert rel_err(stats_sim, stats_cpu) <= 5e-6


def test_sim_forward_bf16_and_zero_weights():
    q, k, v = (torch.randn(1, 4, 37, 16) for _ in range(3))
    w = DCMHAWeights.zeros(1, 37, 4)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert rel_err(SIM.dcmha_attention(q, k, v, w), sdpa) <= 1e-6
    wb = DCMHAWeights(*(x.bfloat16() for x in make_weights(1, 37, 4)))
    got = SIM.dcmha_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), wb)
    want = reference.dcmha_attention(q.double(), k.double(), v.double(), DCMHAWeights(*(x.double() for x in wb)))
    assert got.dtype == torch.bfloat16 and rel_err(got, want) <= 2e-2


def test_sim_forward_opcheck_schema_and_fake():
    q, k, v = (torch.randn(1, 4, 5, 8) for _ in range(3))
    w = make_weights(1, 5, 4)
    q.requires_grad_()
    for args in ((True, 0, 0.35, 1), (True, 2, 0.35, 2), (False, 0, 1.0, 1)):
        torch.library.opcheck(torch.ops.headwise_sim.dcmha_attention, (q, k, v, *w, *args))


def test_sim_rejects_too_many_heads():
    q = torch.randn(1, 33, 3, 4)
    with pytest.raises(ValueError, match="exceeds the most heads"):
        SIM.dcmha_attention(q, q, q, make_weights(1, 3, 33))



NAMES = ["out", "grad q", "grad k", "grad v", "grad w1", "grad w2", "grad g"]


@pytest.mark.parametrize("b,h,t,dh,dv,kw", CASES + [(1, 4, 37, 8, 8, dict(causal=False))])
def test_sim_backward_matches_reference(b, h, t, dh, dv, kw):
    gen = torch.Generator().manual_seed(t + h)
    q, k = torch.randn(b, h, t, dh, generator=gen), torch.randn(b, h, t, dh, generator=gen)
    v = torch.randn(b, h, t, dv, generator=gen)
    w = make_weights(b, t, h, seed=h)
    grad = torch.randn(b, h, t, dv, generator=gen)

    def run(fn):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, *w)]
        out = fn(*leaves[:3], DCMHAWeights(*leaves[3:]), **kw)
        out.backward(grad)
        return [out.detach()] + [x.grad for x in leaves]

    for name, x, y in zip(NAMES, run(SIM.dcmha_attention), run(reference.dcmha_attention)):
        err = rel_err(x, y)
        assert err <= 1e-5, f"{name}: relative error {err:.3g}"


def test_sim_backward_deterministic():
    q, k, v = (torch.randn(1, 4, 70, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    w = make_weights(1, 70, 4)

    def run():
        leaves = [x.clone().requires_grad_() for x in (q, k, v, *w)]
        SIM.dcmha_attention(*leaves[:3], DCMHAWeights(*leaves[3:]), window=33).square().sum().backward()
        return [x.grad for x in leaves]

    for x, y in zip(run(), run()):
        assert torch.equal(x, y)


def test_sim_refuses_launches_cuda_cannot_make():
    # B goes on grid y, which CUDA caps at 65535 blocks.
    b = 65536
    q, k, v = (torch.zeros(b, 1, 1, 2) for _ in range(3))
    with pytest.raises(ValueError, match=r"kernel 'dcmha_attention_fwd' needs a grid of \(1, 65536, 1\) blocks, "
                                         r"beyond CUDA's limits \(2147483647, 65535, 65535\)"):
        SIM.dcmha_attention(q, k, v, DCMHAWeights.zeros(b, 1, 1))
    # Shared memory per block: (H*dh + 10*H + 2*H*128 + H*dv) floats = 241064 bytes at
    # H = 1, dh = dv = 30000, over the emulated device's (sm_90's) opt-in limit.
    q, k, v = (torch.zeros(1, 1, 1, 30000) for _ in range(3))
    with pytest.raises(ValueError, match=r"headwise\.dcmha_attention: needs 241064 bytes of dynamic shared memory "
                                         r"per block, more than this device's limit of 232448 bytes"):
        SIM.dcmha_attention(q, k, v, DCMHAWeights.zeros(1, 1, 1))
