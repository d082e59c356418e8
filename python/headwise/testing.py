"""Test support: one test body, every backend.

``backend("cpu")`` and ``backend("cuda")`` run ``torch.ops.headwise`` (the op picks its
kernel by the tensors' device; the object also carries the device tests should use),
``backend("sim")`` runs ``torch.ops.headwise_sim``: the CUDA kernels executed by the
SIMT emulator on CPU tensors.
"""

from __future__ import annotations

import torch

from .ops import Ops

BACKENDS = ("cpu", "sim", "cuda")


class Backend(Ops):
    def __init__(self, name: str):
        if name not in BACKENDS:
            raise ValueError(f"unknown backend {name!r}; expected one of {BACKENDS}")
        if name == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("headwise.testing.backend('cuda'): no CUDA device is available")
        super().__init__("headwise_sim" if name == "sim" else "headwise")
        self.name = name
        self.device = torch.device("cuda" if name == "cuda" else "cpu")

    def __repr__(self) -> str:
        return f"headwise.testing.backend({self.name!r})"


def backend(name: str) -> Backend:
    """The public functions of headwise bound to backend ``name`` ("cpu", "sim", "cuda")."""
    return Backend(name)


def available_backends() -> list[str]:
    return [b for b in BACKENDS if b != "cuda" or torch.cuda.is_available()]


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Norm-wise relative error ``max |actual - expected| / max |expected|``.

    Fails on a shape mismatch or on a non-finite element of ``actual`` (with poisoned
    outputs, an element the kernel never wrote is NaN)."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if a.shape != e.shape:
        raise AssertionError(f"shape {tuple(a.shape)} != expected {tuple(e.shape)}")
    if not torch.isfinite(a).all():
        raise AssertionError("result has NaN/inf elements (unwritten output?)")
    scale = e.abs().max().item() if e.numel() else 0.0
    return (a - e).abs().max().item() / (scale if scale > 0 else 1.0)


def with_one_and_many_threads(run):
    """``(run() with 1 thread, run() with max(2, current) threads)``, the thread count
    restored afterwards: for tests that results do not depend on it."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(max(2, threads))
        many = run()
    finally:
        torch.set_num_threads(threads)
    return one, many


def profiled_launches(run):
    """``(run(), launch records)``: run() with the profile library's counters on (its
    ops, ``headwise.ops.load_profile_library()``, run the emulated kernels instrumented),
    and one dict per kernel launch it made (``kernel`` name, grid, mma count, sectors...)."""
    import json

    lib = torch.ops.headwise_sim_profile
    lib.sim_profile_take()  # drop anything recorded before
    lib.sim_profile_enable(True)
    try:
        result = run()
    finally:
        lib.sim_profile_enable(False)
    return result, json.loads(lib.sim_profile_take())


# Every way torch sets its float32 matmul precision for CUDA, and whether it means TF32
# there (torch's cuBLAS calls take TF32 exactly then). Tests apply one under the
# fp32_precision_state fixture (tests/conftest.py), which restores torch's state.
FP32_MATMUL_SETTINGS = {
    "legacy allow_tf32": (lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", True), True),
    "legacy allow_tf32 off": (lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", False), False),
    "matmul precision high": (lambda: torch.set_float32_matmul_precision("high"), True),
    "matmul precision highest": (lambda: torch.set_float32_matmul_precision("highest"), False),
    "cuda matmul fp32_precision tf32": (lambda: setattr(torch.backends.cuda.matmul, "fp32_precision", "tf32"), True),
    "cuda matmul fp32_precision ieee": (lambda: setattr(torch.backends.cuda.matmul, "fp32_precision", "ieee"), False),
    "generic fp32_precision tf32": (lambda: (setattr(torch.backends.cuda.matmul, "fp32_precision", "none"),
                                            setattr(torch.backends, "fp32_precision", "tf32")), True),
}
