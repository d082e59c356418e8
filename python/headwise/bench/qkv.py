"""Fused QKV projection benchmark: reference.qkv_project eager (linear + split + view +
transpose + qk-norm + rope + contiguous), torch.compile(reference), and
headwise.qkv_project; forward, backward and forward+backward, at a Qwen3-like shape
(GQA, qk-norm, rope, q scale)."""

from __future__ import annotations

import torch

import headwise
from headwise import reference

from .timing import Row, median_ms, time_modes

CPU_SHAPE = dict(b=2, s=512, d_model=1024, hq=16, hkv=8, d=64)
GPU_SHAPE = dict(b=4, s=4096, d_model=4096, hq=32, hkv=8, d=128)
QUICK_SHAPE = dict(b=1, s=5, d_model=32, hq=4, hkv=2, d=8)


def rope_tables(seq: int, dim: int, device, base: float = 1e6):
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    ang = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


def run(device: torch.device, dtype: torch.dtype, repeats: int, shape: dict | None = None) -> list[Row]:
    shape = shape or (GPU_SHAPE if device.type == "cuda" else CPU_SHAPE)
    b, s, dm, hq, hkv, d = (shape[k] for k in ("b", "s", "d_model", "hq", "hkv", "d"))
    layout = headwise.QKVLayout(hq, hkv, d)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(b, s, dm, generator=gen).to(device=device, dtype=dtype)
    weight = (torch.randn(layout.num_rows, dm, generator=gen) / dm**0.5).to(device=device, dtype=dtype)
    q_norm = (1 + 0.1 * torch.randn(d, generator=gen)).to(device=device, dtype=dtype)
    k_norm = (1 + 0.1 * torch.randn(d, generator=gen)).to(device=device, dtype=dtype)
    rope = rope_tables(s, d, device)
    grads = [torch.randn(b, h, s, d, generator=gen).to(device=device, dtype=dtype) for h in (hq, hkv, hkv)]
    leaves = [t.requires_grad_() for t in (x, weight, q_norm, k_norm)]
    kw = dict(layout=layout, rope=rope, scale_q=d**-0.5)

    def eager(x, w, qn, kn):
        return reference.qkv_project(x, w, None, q_norm=qn, k_norm=kn, **kw)

    def fused(x, w, qn, kn):
        return headwise.qkv_project(x, w, None, q_norm=qn, k_norm=kn, **kw)

    impls = {"eager": eager, "compile": torch.compile(eager, dynamic=False), "headwise": fused}
    label = f"B={b} S={s} D_model={dm} Hq={hq} Hkv={hkv} D={d} qk-norm rope"
    dname = str(dtype).replace("torch.", "")
    forwards = {name: (lambda fn=fn: fn(*leaves)) for name, fn in impls.items()}
    rows = time_modes("qkv_project", label, dname, device, repeats, forwards, leaves,
                      lambda outs: torch.autograd.backward(outs, grads))
    # The bare GEMM the op contains (SPEC section 7: the GPU target is within 1.1x of it).
    x2, w2 = x.detach().reshape(b * s, dm), weight.detach()
    gemm = lambda: torch.mm(x2, w2.t())  # noqa: E731
    ms = median_ms(gemm, device, repeats=repeats, warmup=3)
    rows.append(Row("qkv_gemm", label, dname, "fwd", "gemm", ms))
    return rows
