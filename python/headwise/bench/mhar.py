"""MHAR routing benchmark: reference.mhar_route eager, torch.compile(reference), and
headwise.mhar_route; forward, backward and forward+backward."""

from __future__ import annotations

import torch

import headwise
from headwise import reference

from .timing import Row, median_ms, peak_bytes, saved_bytes

CPU_SHAPE = dict(n=9, b=2, t=512, d=1024, h=8)
GPU_SHAPE = dict(n=9, b=2, t=4096, d=4096, h=8)
QUICK_SHAPE = dict(n=3, b=1, t=5, d=64, h=4)


def run(device: torch.device, dtype: torch.dtype, repeats: int, shape: dict | None = None) -> list[Row]:
    shape = shape or (GPU_SHAPE if device.type == "cuda" else CPU_SHAPE)
    n, b, t, d, h = (shape[k] for k in ("n", "b", "t", "d", "h"))
    gen = torch.Generator().manual_seed(0)
    sources = torch.randn(n, b, t, d, generator=gen).to(device=device, dtype=dtype)
    query = (0.3 * torch.randn(d, generator=gen)).to(device)
    norm_weight = torch.ones(d, device=device)
    grad = torch.randn(b, t, d, generator=gen).to(device=device, dtype=dtype)
    leaves = [x.requires_grad_() for x in (sources, query, norm_weight)]

    compiled = torch.compile(reference.mhar_route, dynamic=False)
    impls = {
        "eager": reference.mhar_route,
        "compile": compiled,
        "headwise": headwise.mhar_route,
    }
    label = f"N={n} B={b} T={t} d={d} H={h}"
    dname = str(dtype).replace("torch.", "")
    rows = []
    warmup = 3
    for impl, fn in impls.items():
        forward = lambda fn=fn: fn(*leaves, num_heads=h)  # noqa: E731

        def clear():
            for x in leaves:
                x.grad = None

        def fwd_only(forward=forward):
            with torch.no_grad():
                forward()

        def fwd_bwd(forward=forward):
            forward().backward(grad)

        state = {}

        def make_graph(forward=forward):
            clear()
            state["out"] = forward()

        def bwd_only():
            state.pop("out").backward(grad)

        saved = saved_bytes(forward, leaves)
        rows.append(Row("mhar_route", label, dname, "fwd", impl,
                        median_ms(fwd_only, device, repeats=repeats, warmup=warmup),
                        peak_bytes=peak_bytes(fwd_only, device)))
        rows.append(Row("mhar_route", label, dname, "bwd", impl,
                        median_ms(bwd_only, device, repeats=repeats, warmup=warmup, setup=make_graph)))
        rows.append(Row("mhar_route", label, dname, "fwd+bwd", impl,
                        median_ms(fwd_bwd, device, repeats=repeats, warmup=warmup, setup=clear),
                        saved_bytes=saved, peak_bytes=peak_bytes(fwd_bwd, device)))
        clear()
    return rows
