"""MHAR routing benchmark: reference.mhar_route eager, torch.compile(reference), and
headwise.mhar_route; forward, backward and forward+backward."""

from __future__ import annotations

import torch

import headwise
from headwise import reference

from .timing import Row, time_modes

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
    forwards = {name: (lambda fn=fn: fn(*leaves, num_heads=h)) for name, fn in impls.items()}
    return time_modes("mhar_route", label, dname, device, repeats, forwards, leaves, lambda out: out.backward(grad))
