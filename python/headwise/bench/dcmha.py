"""DCMHA attention benchmark: the materializing reference.dcmha_attention eager, its
torch.compile, and the fused headwise.dcmha_attention; forward, backward and
forward+backward, with bytes saved for backward and peak memory. The dynamic weights
are inputs (leaves), so the rows time attention with composition only."""

from __future__ import annotations

import torch

import headwise
from headwise import DCMHAWeights, reference

from .timing import Row, time_modes

CPU_SHAPE = dict(b=1, h=8, t=1024, dh=64)
GPU_SHAPE = dict(b=2, h=16, t=4096, dh=128)
QUICK_SHAPE = dict(b=1, h=4, t=37, dh=8)


def _weights(b, t, h, gen, device, dtype):
    w1 = torch.randn(b, t, 4, 2, h, generator=gen)
    w1 = w1 * torch.rsqrt(w1.square().mean(-1, keepdim=True) + 1e-6)
    w2 = 0.1 * torch.randn(b, t, 4, 2, h, generator=gen) / h
    g = 0.1 * torch.randn(b, t, 4, h, generator=gen)
    return [x.to(device=device, dtype=dtype) for x in (w1, w2, g)]


def run(device: torch.device, dtype: torch.dtype, repeats: int, shape: dict | None = None) -> list[Row]:
    shape = shape or (GPU_SHAPE if device.type == "cuda" else CPU_SHAPE)
    b, h, t, dh = (shape[k] for k in ("b", "h", "t", "dh"))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, t, dh, generator=gen).to(device=device, dtype=dtype) for _ in range(3))
    w = _weights(b, t, h, gen, device, dtype)
    grad = torch.randn(b, h, t, dh, generator=gen).to(device=device, dtype=dtype)
    leaves = [x.requires_grad_() for x in (q, k, v, *w)]

    def ref(q, k, v, w1, w2, g):
        return reference.dcmha_attention(q, k, v, DCMHAWeights(w1, w2, g))

    def fused(q, k, v, w1, w2, g):
        return headwise.dcmha_attention(q, k, v, DCMHAWeights(w1, w2, g))

    impls = {"eager": ref, "compile": torch.compile(ref, dynamic=False), "headwise": fused}
    label = f"B={b} H={h} T={t} dh={dh} causal"
    dname = str(dtype).replace("torch.", "")
    forwards = {name: (lambda fn=fn: fn(*leaves)) for name, fn in impls.items()}
    return time_modes("dcmha_attention", label, dname, device, repeats, forwards, leaves,
                      lambda out: out.backward(grad), warmup=2)
