"""The fused DCMHA attention of the CUDA build on a GPU (skipped without one): the same
cases as the emulator's tests (test_dcmha_attention_sim.py), forward and backward against
the fp64 reference, fp32 (SIMT kernels) and bf16 / fp16 (the tensor-core forward and
backward), and a bitwise repeatable backward."""

import pytest
import torch

import headwise
from headwise import DCMHAWeights, reference
from headwise.testing import rel_err

from dcmha_helpers import make_weights
from test_dcmha_attention_sim import MMA_CASES, MMA_TOL, NAMES, TF32_TOL

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
CUDA = headwise.testing.backend("cuda") if torch.cuda.is_available() else None


def _inputs(b, h, t, dh, dv):
    gen = torch.Generator().manual_seed(t + h)
    q, k = torch.randn(b, h, t, dh, generator=gen), torch.randn(b, h, t, dh, generator=gen)
    v = torch.randn(b, h, t, dv, generator=gen)
    grad = torch.randn(b, h, t, dv, generator=gen)
    return [q, k, v, *make_weights(b, t, h, seed=h)], grad


def _run(fn, leaves, grad, kw):
    leaves = [x.clone().requires_grad_() for x in leaves]
    out = fn(*leaves[:3], DCMHAWeights(*leaves[3:]), **kw)
    out.backward(grad)
    return [out.detach()] + [x.grad for x in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "f16"])
@pytest.mark.parametrize("b,h,t,dh,dv,kw", MMA_CASES)
def test_cuda_forward_and_backward_match_reference(b, h, t, dh, dv, kw, dtype):
    leaves, grad = _inputs(b, h, t, dh, dv)
    leaves = [x.to(dtype) for x in leaves]  # the rounded values are the reference's inputs too
    grad = grad.to(dtype)
    got = _run(CUDA.dcmha_attention, [x.cuda() for x in leaves], grad.cuda(), kw)
    want = _run(reference.dcmha_attention, [x.double() for x in leaves], grad.double(), kw)
    fwd_tol = 1e-5 if dtype == torch.float32 else MMA_TOL[dtype]
    bwd_tol = 1e-5 if dtype == torch.float32 else 3e-2
    for name, x, y in zip(NAMES, got, want):
        err = rel_err(x.double(), y)
        assert err <= (fwd_tol if name == "out" else bwd_tol), f"{name}: relative error {err:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_backward_bitwise_repeatable(dtype):
    leaves, grad = _inputs(1, 8, 150, 16, 16)
    leaves = [x.to("cuda", dtype) for x in leaves]
    first, again = (_run(CUDA.dcmha_attention, leaves, grad.to("cuda", dtype), dict(window=90)) for _ in range(2))
    for name, x, y in zip(NAMES, first, again):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("b,h,t,dh,dv,kw", [(1, 4, 150, 8, 8, {}), (1, 2, 67, 37, 5, dict(causal=False)),
                                            (1, 2, 130, 24, 40, dict(window=1)), (1, 2, 67, 128, 128, {})])
def test_cuda_tf32_forward_and_backward_match_reference(b, h, t, dh, dv, kw):
    # fp32 with TF32 allowed: the tensor-core kernels at T = float (the SIMT backward where its
    # shared memory does not fit, as at dh = 128 on sm_80), bitwise repeatable.
    leaves, grad = _inputs(b, h, t, dh, dv)
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        got = _run(CUDA.dcmha_attention, [x.cuda() for x in leaves], grad.cuda(), kw)
        again = _run(CUDA.dcmha_attention, [x.cuda() for x in leaves], grad.cuda(), kw)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    want = _run(reference.dcmha_attention, [x.double() for x in leaves], grad.double(), kw)
    for name, x, y, z in zip(NAMES, got, want, again):
        err = rel_err(x.double(), y)
        assert err <= TF32_TOL, f"{name}: relative error {err:.3g}"
        assert torch.equal(x, z), name
