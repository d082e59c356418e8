"""Shared test fixtures: every output buffer is poisoned (NaN) before a kernel writes it,
and `backend` parametrizes a test over cpu / sim / cuda (cuda skips without a GPU)."""

import os
import warnings

os.environ.setdefault("HEADWISE_POISON_OUTPUTS", "1")  # read once by the op libraries

import pytest  # noqa: E402
import torch  # noqa: E402

import headwise  # noqa: E402,F401
from headwise import testing  # noqa: E402


class CudaBackendUnused(UserWarning):
    """A test ran with the cuda backend but allocated nothing on the GPU: its inputs stayed
    on the CPU, so it tested the CPU kernels under the cuda id."""


def _backend(name, test):
    """The backend fixtures' body: skips cuda without a GPU, and after a cuda test warns
    (CudaBackendUnused) if the test allocated nothing on the GPU."""
    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    ops = testing.backend(name)
    if name != "cuda":
        yield ops
        return
    before = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
    yield ops
    try:
        after = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
    except RuntimeError:  # a sticky CUDA error of a failed test: that test reports it
        return
    if after == before:
        warnings.warn(f"{test}: nothing was allocated on the GPU; the test ran the CPU kernels", CudaBackendUnused)


@pytest.fixture(params=testing.BACKENDS)
def backend(request):
    yield from _backend(request.param, request.node.nodeid)


@pytest.fixture(params=["sim", "cuda"])
def kernel_backend(request):
    """Backends that run the CUDA kernels: emulated (sim), and on the GPU (cuda, skipped
    without one)."""
    yield from _backend(request.param, request.node.nodeid)


@pytest.fixture(params=["cpu", "sim"])
def host_backend(request):
    """Backends that run on this machine's CPU (for tests that count bytes or threads)."""
    return testing.backend(request.param)


@pytest.fixture
def fp32_precision_state():
    """A function that puts torch's float32 precision settings back as they were when the
    test began, called again after the test: the legacy ones (allow_tf32, the float32
    matmul precision) first, then the newer fp32_precision API's, so that both read as
    before (a state that only one of them set makes the other's reads raise in torch)."""
    if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        pytest.skip("this torch has no fp32_precision API")
    # The newer API's settings that the legacy setters write: set_float32_matmul_precision
    # writes oneDNN's matmul precision too.
    new = (torch.backends.fp32_precision, torch.backends.cuda.matmul.fp32_precision,
           torch.backends.mkldnn.matmul.fp32_precision)
    legacy = (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32)

    def restore():
        torch.backends.fp32_precision = torch.backends.cuda.matmul.fp32_precision = "none"
        torch.set_float32_matmul_precision(legacy[0])
        torch.backends.cuda.matmul.allow_tf32 = legacy[1]
        (torch.backends.fp32_precision, torch.backends.cuda.matmul.fp32_precision,
         torch.backends.mkldnn.matmul.fp32_precision) = new

    yield restore
    restore()
