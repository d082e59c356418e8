"""Head-merge benchmark: reference.head_merge eager (transpose + contiguous + linear, the
gate and rescale applied to z as a dense mask), torch.compile of it, and
headwise.head_merge; forward and forward+backward, the stats case (against explicit
per-head products, reference.head_merge_stats), and a gated sweep with 0, 2, 4, 6 of 8
heads closed (hard gate with rescale), where headwise's time falls as heads close and the
dense mask's does not."""

from __future__ import annotations

import torch

import headwise
from headwise import reference

from .timing import Row, median_ms, time_modes

# z in the layout attention produces ([B, H, Q, Dv], e.g. scaled_dot_product_attention's
# output): eager must transpose + copy it before the projection; headwise reads it in place.
CPU_SHAPE = dict(b=4, h=8, q=512, dv=64, d=512)
GPU_SHAPE = dict(b=2, h=32, q=4096, dv=128, d=4096)
QUICK_SHAPE = dict(b=1, h=2, q=5, dv=8, d=16)


def _inputs(shape, device, dtype, layout="bhqd"):
    b, h, q, dv, d = (shape[k] for k in ("b", "h", "q", "dv", "d"))
    gen = torch.Generator().manual_seed(0)
    if layout == "bhqd":
        z = torch.randn(b, h, q, dv, generator=gen)
    else:  # a transposed view of token-major [B, Q, H, Dv] memory
        z = torch.randn(b, q, h, dv, generator=gen).transpose(1, 2)
    z = z.to(device=device, dtype=dtype)
    w = (torch.randn(d, h * dv, generator=gen) / (h * dv) ** 0.5).to(device=device, dtype=dtype)
    bias = torch.randn(d, generator=gen).to(device=device, dtype=dtype)
    grad = torch.randn(b, q, d, generator=gen).to(device=device, dtype=dtype)
    return z, w, bias, grad


def _time_impls(op, label, dname, device, repeats, impls, leaves, grad, modes, rows):
    def backward(out):
        (out[0] if isinstance(out, tuple) else out).backward(grad)

    rows += time_modes(op, label, dname, device, repeats, impls, leaves, backward, modes)


def run(device: torch.device, dtype: torch.dtype, repeats: int, shape: dict | None = None) -> list[Row]:
    shape = shape or (GPU_SHAPE if device.type == "cuda" else CPU_SHAPE)
    b, h, q, dv, d = (shape[k] for k in ("b", "h", "q", "dv", "d"))
    dname = str(dtype).replace("torch.", "")
    compiled = torch.compile(reference.head_merge, dynamic=False)
    rows: list[Row] = []

    # 1. The merge, z in attention's [B, H, Q, Dv] layout and as a transposed view.
    for layout in ("bhqd", "bqhd-view"):
        z, w, bias, grad = _inputs(shape, device, dtype, layout)
        leaves = [x.requires_grad_() for x in (z, w, bias)]
        impls = {
            "eager": lambda z=z, w=w, bias=bias: reference.head_merge(z, w, bias),
            "compile": lambda z=z, w=w, bias=bias: compiled(z, w, bias),
            "headwise": lambda z=z, w=w, bias=bias: headwise.head_merge(z, w, bias),
        }
        label = f"B={b} H={h} Q={q} Dv={dv} D={d} z={layout}"
        _time_impls("head_merge", label, dname, device, repeats, impls, leaves, grad, ("fwd", "bwd", "fwd+bwd"), rows)

    # The bare GEMMs the merge contains, on an already concatenated [B*Q, H*Dv] input: the
    # forward's product, and the backward's two (grad input, grad weight). No
    # implementation that runs these FLOPs can beat them; on the CPU eager's composition
    # is them plus one transpose copy (SPEC section 7: the GPU target is within 1.1x).
    x2 = torch.randn(b * q, h * dv, device=device, dtype=dtype)
    w2, g2 = w.detach(), grad.reshape(b * q, d)
    gemm_fwd = lambda: torch.mm(x2, w2.t())  # noqa: E731

    def gemm_bwd():
        torch.mm(g2, w2)
        torch.mm(g2.t(), x2)

    def gemm_fwd_bwd():
        gemm_fwd()
        gemm_bwd()

    label = f"B={b} H={h} Q={q} Dv={dv} D={d}"
    for mode, fn in (("fwd", gemm_fwd), ("bwd", gemm_bwd), ("fwd+bwd", gemm_fwd_bwd)):
        rows.append(Row("merge_gemm", label, dname, mode, "gemm", median_ms(fn, device, repeats=repeats, warmup=3)))

    # 2. Stats: explicit per-head products [B, Q, H, D] vs the merge's own pass.
    z, w, bias, grad = _inputs(shape, device, dtype)
    compiled_stats = torch.compile(
        lambda z, w, bias: reference.head_merge(z, w, bias, return_stats=True), dynamic=False
    )
    impls = {
        "eager": lambda: reference.head_merge(z, w, bias, return_stats=True),
        "compile": lambda: compiled_stats(z, w, bias),
        "headwise": lambda: headwise.head_merge(z, w, bias, return_stats=True),
    }
    _time_impls("merge+stats", f"B={b} H={h} Q={q} Dv={dv} D={d}", dname, device, repeats, impls, [], grad,
                ("fwd",), rows)

    # 3. Gated sweep: k of H heads closed (hard [H] gate, rescale).
    z, w, bias, grad = _inputs(shape, device, dtype)
    for closed in (0, h // 4, h // 2, 3 * h // 4):
        gate = torch.ones(h, device=device)
        gate[:closed] = 0
        impls = {
            "eager": lambda gate=gate: reference.head_merge(z, w, bias, head_gate=gate, rescale=True),
            "compile": lambda gate=gate: compiled(z, w, bias, head_gate=gate, rescale=True),
            "headwise": lambda gate=gate: headwise.head_merge(z, w, bias, head_gate=gate, rescale=True),
        }
        _time_impls("merge gated", f"B={b} H={h} Q={q} Dv={dv} D={d} closed={closed}/{h}", dname, device, repeats,
                    impls, [], grad, ("fwd",), rows)
    return rows
