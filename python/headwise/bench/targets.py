"""python -m headwise.bench.targets {merge,dcmha,dcmha-backward} [--json FILE] [--quick] [--device D]

The acceptance ratios of the GPU issues, measured (one lent GPU session runs this through
bench/device_check.sh). Each line prints as soon as it is measured: the time of headwise,
the time of what the issue compares it with, their ratio and the goal.

merge  (B*Q=16384, H=32, Dv=128, D=4096 bf16; issue "head merge at cuBLAS speed"):
  plain head-major Z against eager's composition (transpose copy + cuBLAS), goal 1.1;
  token-major Z (a transposed view) against the one cuBLAS call on it, goal 1.02;
  the hand kernel (an all-open [H] gate) against cuBLAS on the same FLOPs, goal 1.6 (sm_90);
  with stats against the hand kernel without them, goal 1.15;
  k of H heads closed against all open, goal (H-k)/H + 0.05;
  forward + backward of the plain merge against eager's, goal 1.2.
dcmha  (B=8, H=32, T=4096, dh=128 causal bf16, head_groups=1; issue "DCMHA on tensor cores"):
  headwise's forward against F.scaled_dot_product_attention's flash backend on plain MHA of
  the same shape (goal: forward + backward within 4x; the forward ratio is printed too).
dcmha-backward: headwise's forward + backward at that shape (bf16: the tensor-core
  backward; est. ~0.3 s), the median of 3 runs after one warm-up, against flash's forward +
  backward (goal 4x) and against DCFormer's formulation (reference.dcmha_attention_query_chunks:
  query chunks of 128, torch.compile of each chunk's rows; goal: faster, 1x).

Times are medians of interleaved rounds (bench.timing); --quick runs tiny shapes on any
device to check the harness and measures nothing.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

import headwise
from headwise import DCMHAWeights, reference

from .dcmha import _weights
from .timing import interleaved_median_ms, synchronize

MERGE_SHAPE = dict(b=4, h=32, q=4096, dv=128, d=4096)
MERGE_QUICK = dict(b=1, h=4, q=37, dv=16, d=24)
DCMHA_SHAPE = dict(b=8, h=32, t=4096, dh=128)
DCMHA_QUICK = dict(b=1, h=4, t=37, dh=16)


class Report:
    """Prints each ratio as it is measured and collects the rows for --json."""

    def __init__(self):
        self.rows = []

    def ratio(self, name: str, ms: float, base_name: str, base_ms: float, goal: float | None):
        r = ms / base_ms
        verdict = "-" if goal is None else ("meets" if r <= goal else "MISSES")
        print(f"{name:<44} {ms:>10.3f} ms  vs {base_name:<34} {base_ms:>10.3f} ms  "
              f"ratio {r:6.3f}  goal {'-' if goal is None else f'{goal:.3f}':>6}  {verdict}", flush=True)
        self.rows.append(dict(target=name, ms=ms, baseline=base_name, baseline_ms=base_ms, ratio=r, goal=goal))


def _timed(calls: dict, device, repeats: int, warmup: int = 3) -> dict[str, float]:
    return interleaved_median_ms({k: (fn, None) for k, fn in calls.items()}, device, repeats=repeats, warmup=warmup)


def _train_step(leaves, forward, grad):
    """A call that clears the leaves' gradients, then runs forward() and its backward."""
    def run():
        for x in leaves:
            x.grad = None
        forward().backward(grad)
    return run


def merge_targets(rep: Report, device, dtype, repeats: int, shape: dict) -> None:
    b, h, q, dv, d = (shape[k] for k in ("b", "h", "q", "dv", "d"))
    gen = torch.Generator().manual_seed(0)
    z_hm = torch.randn(b, h, q, dv, generator=gen).to(device, dtype)  # head-major (SDPA's output)
    z_tm = torch.randn(b, q, h, dv, generator=gen).to(device, dtype).transpose(1, 2)  # token-major view
    w = (torch.randn(d, h * dv, generator=gen) / (h * dv) ** 0.5).to(device, dtype)
    bias = torch.randn(d, generator=gen).to(device, dtype)
    x2 = torch.randn(b * q, h * dv, generator=gen).to(device, dtype)
    ones = torch.ones(h, device=device)
    label = f"B={b} Q={q} H={h} Dv={dv} D={d}"
    print(f"-- merge {label} {dtype}", flush=True)
    with torch.no_grad():
        t = _timed({
            # eager's composition in the storage dtype: the concatenation copy, then cuBLAS
            # (reference.head_merge is the fp32-accumulating oracle, not a speed baseline)
            "eager": lambda: F.linear(z_hm.transpose(1, 2).reshape(b * q, h * dv), w, bias),
            "plain": lambda: headwise.head_merge(z_hm, w, bias),
            "linear_tm": lambda: F.linear(z_tm.transpose(1, 2).reshape(b * q, h * dv), w, bias),
            "plain_tm": lambda: headwise.head_merge(z_tm, w, bias),
            "gemm": lambda: torch.mm(x2, w.t()),
            "hand": lambda: headwise.head_merge(z_hm, w, bias, head_gate=ones),
            "stats": lambda: headwise.head_merge(z_hm, w, bias, return_stats=True),
        }, device, repeats)
    rep.ratio("merge plain, head-major Z", t["plain"], "eager (copy + cuBLAS)", t["eager"], 1.1)
    rep.ratio("merge plain, token-major Z", t["plain_tm"], "cuBLAS on the view (F.linear)", t["linear_tm"], 1.02)
    rep.ratio("merge hand kernel (open [H] gate)", t["hand"], "cuBLAS mm, same FLOPs", t["gemm"], 1.6)
    rep.ratio("merge with stats (no gate)", t["stats"], "hand kernel without stats", t["hand"], 1.15)
    gates = {}
    for k in (h // 4, h // 2, 3 * h // 4):
        g = torch.ones(h, device=device)
        g[:k] = 0
        gates[k] = g
    gates["open"] = ones
    with torch.no_grad():
        t_closed = _timed({k: (lambda g=g: headwise.head_merge(z_hm, w, bias, head_gate=g, rescale=True))
                           for k, g in gates.items()}, device, repeats)
    for k in (h // 4, h // 2, 3 * h // 4):
        rep.ratio(f"merge {k}/{h} heads closed", t_closed[k], "all open (hand kernel)", t_closed["open"],
                  (h - k) / h + 0.05)
    # Forward + backward of the plain merge (z, w, bias all require grad).
    grad = torch.randn(b, q, d, generator=gen).to(device, dtype)
    zl, wl, bl = leaves = [x.detach().clone().requires_grad_() for x in (z_hm, w, bias)]
    eager = _train_step(leaves, lambda: F.linear(zl.transpose(1, 2).reshape(b, q, h * dv), wl, bl), grad)
    fused = _train_step(leaves, lambda: headwise.head_merge(zl, wl, bl), grad)
    t = _timed({"eager": eager, "headwise": fused}, device, repeats)
    rep.ratio("merge plain forward + backward", t["headwise"], "eager forward + backward", t["eager"], 1.2)


def _dcmha_inputs(shape, device, dtype):
    b, h, t, dh = (shape[k] for k in ("b", "h", "t", "dh"))
    gen = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(b, h, t, dh, generator=gen).to(device, dtype) for _ in range(4))
    return q, k, v, DCMHAWeights(*_weights(b, t, h, gen, device, dtype)), grad


def _flash(q, k, v):
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def dcmha_targets(rep: Report, device, dtype, repeats: int, shape: dict) -> None:
    q, k, v, w, _ = _dcmha_inputs(shape, device, dtype)
    label = " ".join(f"{n}={shape[n]}" for n in ("b", "h", "t", "dh"))
    print(f"-- dcmha {label} causal {dtype}", flush=True)
    with torch.no_grad():
        t = _timed({"flash": lambda: _flash(q, k, v), "dcmha": lambda: headwise.dcmha_attention(q, k, v, w)},
                   device, repeats, warmup=1)
    rep.ratio("dcmha forward", t["dcmha"], "SDPA flash forward (plain MHA)", t["flash"], None)


def dcmha_backward_targets(rep: Report, device, dtype, repeats: int, shape: dict) -> None:
    q, k, v, w, grad = _dcmha_inputs(shape, device, dtype)
    leaves = [x.requires_grad_() for x in (q, k, v, *w)]
    flash = _train_step(leaves, lambda: _flash(*leaves[:3]), grad)
    t_flash = _timed({"flash": flash}, device, max(repeats, 3), warmup=2)["flash"]
    dcmha = _train_step(leaves, lambda: headwise.dcmha_attention(*leaves[:3], DCMHAWeights(*leaves[3:])), grad)
    synchronize(device)
    t_dcmha = _timed({"dcmha": dcmha}, device, 3, warmup=1)["dcmha"]
    rep.ratio("dcmha forward + backward", t_dcmha, "SDPA flash forward + backward", t_flash, 4.0)
    # DCFormer's formulation: the reference math per query chunk of 128 rows, each chunk's
    # rows compiled (one graph: every chunk has the same shapes when 128 divides T).
    chunk = min(128, shape["t"])
    rows = torch.compile(reference.dcmha_attention_rows, dynamic=False)
    dcformer = _train_step(leaves, lambda: reference.dcmha_attention_query_chunks(
        *leaves[:3], DCMHAWeights(*leaves[3:]), chunk=chunk, rows_fn=rows), grad)
    try:
        t_dcf = _timed({"dcformer": dcformer}, device, 3, warmup=1)["dcformer"]
    except torch.OutOfMemoryError:  # the saved [B, H, 128, S] tensors of every chunk
        print(f"DCFormer formulation (query chunks of {chunk}, compiled): out of memory", flush=True)
        return
    rep.ratio("dcmha forward + backward", t_dcmha, f"DCFormer (query chunks of {chunk}, compiled)", t_dcf, 1.0)


TARGETS = {"merge": (merge_targets, MERGE_SHAPE, MERGE_QUICK),
           "dcmha": (dcmha_targets, DCMHA_SHAPE, DCMHA_QUICK),
           "dcmha-backward": (dcmha_backward_targets, DCMHA_SHAPE, DCMHA_QUICK)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m headwise.bench.targets", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("targets", nargs="+", choices=list(TARGETS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="tiny shapes: check the harness, measure nothing")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16
    rep = Report()
    for name in args.targets:
        fn, shape, quick = TARGETS[name]
        fn(rep, device, dtype, args.repeats, quick if args.quick else shape)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        machine = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "torch": torch.__version__, "rows": rep.rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
