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


def interleaved_median_ms(
    calls: dict[str, tuple[Callable[[], None], Optional[Callable[[], None]]]],
    device: torch.device,
    *,
    repeats: int,
    warmup: int,
) -> dict[str, float]:
    """Median wall time in milliseconds of each ``name -> (fn, setup)``, timed in
    interleaved rounds (every fn once per round, the starting one rotating), so that the
    machine's drift over a run (frequency, other load) affects every implementation
    alike and their ratios stay meaningful; ``setup()`` runs untimed before each call."""
    names = list(calls)
    for name in names:
        fn, setup = calls[name]
        for _ in range(warmup):
            if setup is not None:
                setup()
            fn()
    synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            fn, setup = calls[name]
            if setup is not None:
                setup()
            synchronize(device)
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(ts) for name, ts in times.items()}


def median_ms(
    fn: Callable[[], None],
    device: torch.device,
    *,
    repeats: int,
    warmup: int,
    setup: Optional[Callable[[], None]] = None,
) -> float:
    """Median wall time of ``fn()`` in milliseconds; ``setup()`` runs untimed before each call."""
    return interleaved_median_ms({"fn": (fn, setup)}, device, repeats=repeats, warmup=warmup)["fn"]


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
    leaves' gradients are cleared before every timed backward. Within a mode the
    implementations are timed in interleaved rounds, so their ratios do not carry the
    machine's drift between them."""
    calls: dict[str, dict] = {mode: {} for mode in MODES if mode in modes}
    memory: dict[str, tuple] = {}
    for impl, forward in impls.items():
        def clear():
            for x in leaves:
                x.grad = None

        def fwd_only(forward=forward):
            with torch.no_grad():
                forward()

        def fwd_bwd(forward=forward):
            backward(forward())

        state: dict = {}

        def make_graph(forward=forward, state=state):
            clear()
            state["out"] = forward()

        def bwd_only(state=state):
            backward(state.pop("out"))

        if "fwd" in calls:
            calls["fwd"][impl] = (fwd_only, None)
        if "bwd" in calls:
            calls["bwd"][impl] = (bwd_only, make_graph)
        if "fwd+bwd" in calls:
            calls["fwd+bwd"][impl] = (fwd_bwd, clear)
        memory[impl] = (forward, fwd_only, fwd_bwd, clear)
    # Each mode's implementations are timed in interleaved rounds (interleaved_median_ms).
    times = {mode: interleaved_median_ms(c, device, repeats=repeats, warmup=warmup) for mode, c in calls.items()}
    rows = []
    for impl, (forward, fwd_only, fwd_bwd, clear) in memory.items():
        if "fwd" in calls:
            rows.append(Row(op, label, dtype, "fwd", impl, times["fwd"][impl], peak_bytes=peak_bytes(fwd_only, device)))
        if "bwd" in calls:
            rows.append(Row(op, label, dtype, "bwd", impl, times["bwd"][impl]))
        if "fwd+bwd" in calls:
            clear()
            saved = saved_bytes(forward, leaves)
            clear()
            rows.append(Row(op, label, dtype, "fwd+bwd", impl, times["fwd+bwd"][impl], saved_bytes=saved,
                            peak_bytes=peak_bytes(fwd_bwd, device)))
        clear()
    return rows
