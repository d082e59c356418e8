"""Timing and memory measurement shared by the op benchmarks."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(
    fn: Callable[[], None],
    device: torch.device,
    *,
    repeats: int,
    warmup: int,
    setup: Optional[Callable[[], None]] = None,
) -> float:
    """Median wall time of ``fn()`` in milliseconds; ``setup()`` runs untimed before each call."""
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        synchronize(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def saved_bytes(run_forward: Callable[[], torch.Tensor], inputs: list[torch.Tensor]) -> int:
    """Bytes that autograd saves for backward beyond the inputs' own storage."""
    input_storages = {x.untyped_storage().data_ptr() for x in inputs}
    seen: dict[int, int] = {}

    def pack(x: torch.Tensor):
        storage = x.untyped_storage()
        if storage.data_ptr() not in input_storages:
            seen[storage.data_ptr()] = storage.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = run_forward()
    del out
    return sum(seen.values())


def _proc_status_bytes(key: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak_memory(device: torch.device) -> bool:
    """Start a new peak-memory window (CUDA allocator peak; CPU: the process's VmHWM);
    False where the CPU window cannot be reset (no /proc/self/clear_refs)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def peak_memory(device: torch.device) -> Optional[int]:
    """Peak memory since reset_peak_memory: CUDA allocated bytes, or (CPU, Linux) the
    process's peak resident set, which includes the interpreter and libraries."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _proc_status_bytes("VmHWM:")


def peak_bytes(fn: Callable[[], None], device: torch.device) -> Optional[int]:
    """Peak memory during ``fn()`` above what was in use before. CUDA: the caching
    allocator's peak. CPU (Linux only, else None): the growth of the process's peak
    resident set (VmHWM, reset through /proc/self/clear_refs) over its resident set
    before the call: it counts every allocation, tensors or not."""
    synchronize(device)
    if not reset_peak_memory(device):
        return None
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else _proc_status_bytes("VmRSS:")
    fn()
    synchronize(device)
    peak = peak_memory(device)
    return None if base is None or peak is None else max(0, peak - base)


@dataclass
class Row:
    op: str
    shape: str
    dtype: str
    mode: str  # fwd | bwd | fwd+bwd
    impl: str  # eager | compile | headwise
    ms: float
    saved_bytes: Optional[int] = None
    peak_bytes: Optional[int] = None


MODES = ("fwd", "bwd", "fwd+bwd")


def time_modes(op: str, label: str, dtype: str, device: torch.device, repeats: int,
               impls: dict[str, Callable[[], object]], leaves: list[torch.Tensor],
               backward: Callable[[object], None], modes=MODES, warmup: int = 3) -> list[Row]:
    """Rows for each implementation and mode: ``impls`` maps a name (eager, compile,
    headwise) to ``forward()``, which returns the op's outputs; ``backward(outputs)``
    runs their backward. ``fwd`` runs under no_grad; ``bwd`` times the backward of a
    graph built untimed; ``fwd+bwd`` also reports the bytes saved for backward. The
    leaves' gradients are cleared before every timed backward."""
    rows = []
    for impl, forward in impls.items():
        def clear():
            for x in leaves:
                x.grad = None

        def fwd_only(forward=forward):
            with torch.no_grad():
                forward()

        def fwd_bwd(forward=forward):
            backward(forward())

        state = {}

        def make_graph(forward=forward):
            clear()
            state["out"] = forward()

        def bwd_only():
            backward(state.pop("out"))

        if "fwd" in modes:
            rows.append(Row(op, label, dtype, "fwd", impl, median_ms(fwd_only, device, repeats=repeats, warmup=warmup),
                            peak_bytes=peak_bytes(fwd_only, device)))
        if "bwd" in modes:
            rows.append(Row(op, label, dtype, "bwd", impl,
                            median_ms(bwd_only, device, repeats=repeats, warmup=warmup, setup=make_graph)))
        if "fwd+bwd" in modes:
            saved = saved_bytes(forward, leaves)
            rows.append(Row(op, label, dtype, "fwd+bwd", impl,
                            median_ms(fwd_bwd, device, repeats=repeats, warmup=warmup, setup=clear),
                            saved_bytes=saved, peak_bytes=peak_bytes(fwd_bwd, device)))
        clear()
    return rows
