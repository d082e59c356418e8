"""Shared test fixtures: every output buffer is poisoned (NaN) before a kernel writes it,
and `backend` parametrizes a test over cpu / sim / cuda (cuda skips without a GPU)."""

import os

os.environ.setdefault("HEADWISE_POISON_OUTPUTS", "1")  # read once by the op libraries

import pytest  # noqa: E402
import torch  # noqa: E402

import headwise  # noqa: E402,F401
from headwise import testing  # noqa: E402


@pytest.fixture(params=testing.BACKENDS)
def backend(request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return testing.backend(request.param)


@pytest.fixture(params=["cpu", "sim"])
def host_backend(request):
    """Backends that run on this machine's CPU (for tests that count bytes or threads)."""
    return testing.backend(request.param)
