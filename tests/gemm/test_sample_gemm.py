"""The sample tensor-core GEMM (csrc/gemm/sample_gemm_kernel.cuh: mma.sync, ldmatrix, a
3-stage cp.async pipeline) against torch.mm: torch.ops.headwise_sim.sample_gemm on the
emulator, torch.ops.headwise.sample_gemm on a GPU when there is one."""

import pytest
import torch

import headwise  # noqa: F401  (registers torch.ops.headwise and torch.ops.headwise_sim)


@pytest.fixture(params=["sim", "cuda"])
def gemm(request):
    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        return lambda a, b: torch.ops.headwise.sample_gemm(a.cuda(), b.cuda()).cpu()
    return torch.ops.headwise_sim.sample_gemm


def reference(a, b):
    """fp32 products and sums, rounded once to the input dtype."""
    return (a.double() @ b.double().t()).to(a.dtype)


# Odd edges in every dimension (partial CTA tiles, K not a multiple of the 32-deep tile
# nor of 8, which the launcher pads), several k tiles (the 3-stage ring wraps), several
# CTAs in M and N.
SHAPES = [(1, 1, 1), (3, 5, 37), (37, 123, 5), (16, 8, 16), (130, 129, 96), (123, 37, 200), (257, 140, 64)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("m, n, k", SHAPES)
def test_sample_gemm_matches_torch_mm(gemm, m, n, k, dtype):
    g = torch.Generator().manual_seed(m * 7 + n * 3 + k)
    a = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, k, generator=g).to(dtype)
    out = gemm(a, b)
    assert out.dtype == dtype and out.shape == (m, n)
    ref = reference(a, b)
    # fp32 accumulation in another order than the fp64 reference, then one rounding to
    # the 8 (bf16) or 11 (f16) bit mantissa: at most a unit or two in the last place.
    eps = 2**-7 if dtype == torch.bfloat16 else 2**-10
    tol = eps * (a.float().abs() @ b.float().abs().t()) + 1e-6
    assert torch.all((out.float() - ref.float()).abs() <= tol), (out.float() - ref.float()).abs().max()
    torch.testing.assert_close(out, torch.mm(a, b.t()), rtol=2 * eps, atol=2 * eps * k**0.5)


def test_sample_gemm_exact_on_small_integers(gemm):
    """Integer inputs with exact fp32 sums: every output element exact, so a wrong lane,
    swizzle or pipeline stage cannot hide in the tolerance."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-4, 5, (150, 77), generator=g).to(torch.bfloat16)
    b = torch.randint(-4, 5, (133, 77), generator=g).to(torch.bfloat16)
    assert torch.equal(gemm(a, b), (a.float() @ b.float().t()).to(torch.bfloat16))


def test_sample_gemm_strided_inputs(gemm):
    """Non-contiguous views (the launcher makes them contiguous), f16, integer-exact."""
    base = torch.randint(-4, 5, (40, 90)).to(torch.float16)
    a = base[1:, 3:67]
    b = base[:33, 2:66]
    assert torch.equal(gemm(a, b), (a.float() @ b.float().t()).to(torch.float16))


def test_sample_gemm_empty_shapes():
    op = torch.ops.headwise_sim.sample_gemm
    assert op(torch.ones(0, 8, dtype=torch.bfloat16), torch.ones(5, 8, dtype=torch.bfloat16)).shape == (0, 5)
    out = op(torch.ones(3, 0, dtype=torch.bfloat16), torch.ones(5, 0, dtype=torch.bfloat16))
    assert torch.equal(out, torch.zeros(3, 5, dtype=torch.bfloat16))


def test_sample_gemm_opcheck():
    """Schema, fake (meta) kernel and dispatch of the emulated op agree."""
    a = torch.randn(37, 24).to(torch.bfloat16)
    b = torch.randn(19, 24).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.headwise_sim.sample_gemm, (a, b))


def test_sample_gemm_checks_name_the_argument():
    op = torch.ops.headwise_sim.sample_gemm
    a = torch.ones(4, 8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="headwise.sample_gemm: a must be bfloat16 or float16, got Float"):
        op(a.float(), a.float())
    with pytest.raises(TypeError, match="b must have the dtype of a"):
        op(a, a.half())
    with pytest.raises(ValueError, match=r"b dim 1 must equal a.size\(1\), the shared K \(8\), got shape \[4, 7\]"):
        op(a, torch.ones(4, 7, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="a must be 2-D"):
        op(a[None], a)
