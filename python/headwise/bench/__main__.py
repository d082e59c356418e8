"""python -m headwise.bench [op ...] [--device cpu|cuda] [--dtype ...] [--repeats N] [--json FILE]
                           [--png FILE] [--quick] [--profile [--trace FILE]]
python -m headwise.bench --sim-profile [op ...] [--json FILE]

Prints, per op and mode, the median time of the eager reference, of torch.compile of the
reference, and of headwise, with the speedups of headwise over both, the bytes saved for
backward and the peak memory of the step (see bench.timing.peak_bytes).

--quick runs each benchmark at a tiny shape (a smoke test of the harness, not a
measurement). --profile runs every measurement a fixed small number of times (the
benchmark's warmup runs, then 3 timed) under
torch.profiler, writing a Chrome trace (--trace); on CUDA also between
cudaProfilerStart/Stop with NVTX ranges per aten op, for
`nsys profile --capture-range=cudaProfilerApi python -m headwise.bench --profile ...`.
headwise's own ranges (headwise::<op>) and kernel names are always present.

--sim-profile runs no timing: it counts the emulated CUDA kernels' memory accesses
(global sectors per request, unique bytes, shared-memory wavefronts, barriers, ...) and
prints an H200 estimate from them (headwise.bench.sim_profile); ops: mhar, qkv, merge,
dcmha_compose, dcmha.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import platform
import sys

import torch

from . import chart, dcmha, merge, mhar, model, qkv, sim_profile

# name -> module with run(device, dtype, repeats, shape=None) -> list[Row] and QUICK_SHAPE
BENCHMARKS = {"mhar": mhar, "qkv": qkv, "merge": merge, "dcmha": dcmha, "model": model}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _mib(n):
    return "-" if n is None else f"{n / 2**20:.1f}"


def format_table(rows) -> str:
    lines = []
    groups = {}
    for r in rows:
        groups.setdefault((r.op, r.shape, r.dtype, r.mode), {})[r.impl] = r
    header = f"{'op':<12} {'mode':<8} {'eager ms':>10} {'compile ms':>11} {'headwise ms':>12} " \
             f"{'vs eager':>9} {'vs compile':>11} {'saved MiB (eager/compile/hw)':>30} {'peak MiB (eager/compile/hw)':>28}"
    shape_seen = None
    for (op, shape, dtype, mode), impls in groups.items():
        if not {"eager", "compile", "headwise"} <= impls.keys():  # a baseline row (e.g. the bare GEMM)
            lines += [f"{op:<12} {mode:<8} {r.impl} {r.ms:.3f} ms" for r in impls.values()]
            continue
        if shape_seen != (op, shape, dtype):
            lines += ["", f"{op}  {shape}  {dtype}", header]
            shape_seen = (op, shape, dtype)
        e, c, h = impls["eager"], impls["compile"], impls["headwise"]
        saved = "/".join(_mib(x.saved_bytes) for x in (e, c, h)) if h.saved_bytes is not None else "-"
        peak = "/".join(_mib(x.peak_bytes) for x in (e, c, h)) if h.peak_bytes is not None else "-"
        lines.append(
            f"{op:<12} {mode:<8} {e.ms:>10.3f} {c.ms:>11.3f} {h.ms:>12.3f} "
            f"{e.ms / h.ms:>8.2f}x {c.ms / h.ms:>10.2f}x {saved:>30} {peak:>28}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m headwise.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ops", nargs="*", default=None, help=f"ops to run: {', '.join(BENCHMARKS)} "
                   f"(with --sim-profile: {', '.join(sim_profile.OPS)})")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="default: fp32 on CPU, bf16 on CUDA")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per measurement (median)")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    p.add_argument("--png", metavar="FILE", help="also draw the speedups as a PNG chart (needs matplotlib)")
    p.add_argument("--quick", action="store_true", help="tiny shapes: check the harness, measure nothing")
    p.add_argument("--profile", action="store_true", help="few fixed iterations under the profilers")
    p.add_argument("--trace", metavar="FILE", default="headwise_trace.json",
                   help="Chrome trace written by --profile (default: %(default)s)")
    p.add_argument("--sim-profile", action="store_true",
                   help="emulated memory metrics and an H200 estimate instead of timings")
    args = p.parse_args(argv)
    if args.sim_profile:
        ops = args.ops or list(sim_profile.OPS)
        unknown = [o for o in ops if o not in sim_profile.OPS]
        if unknown:
            p.error(f"unknown op(s) {unknown}; --sim-profile knows {list(sim_profile.OPS)}")
        return sim_profile.main(ops, args.json)
    args.ops = args.ops or list(BENCHMARKS)
    unknown = [o for o in args.ops if o not in BENCHMARKS]
    if unknown:
        p.error(f"unknown op(s) {unknown}; choose from {list(BENCHMARKS)}")
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    repeats = 3 if args.profile else (args.repeats or (50 if device.type == "cuda" else 15))

    rows = []
    with contextlib.ExitStack() as stack:
        if args.profile:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
                stack.enter_context(torch.cuda.profiler.profile())
                stack.enter_context(torch.autograd.profiler.emit_nvtx())
            prof = stack.enter_context(torch.profiler.profile(activities=activities))
        for op in args.ops:
            bench = BENCHMARKS[op]
            rows += bench.run(device, dtype, repeats, shape=bench.QUICK_SHAPE if args.quick else None)
    if args.profile:
        prof.export_chrome_trace(args.trace)
        print(f"wrote the profiler trace {args.trace}")
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    print(f"headwise bench  {stamp}  torch {torch.__version__}  {machine}  "
          f"(median of {repeats} runs)")
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": stamp, "torch": torch.__version__, "machine": machine,
                       "command": " ".join(["python -m headwise.bench"] + (argv or sys.argv[1:])),
                       "rows": [dataclasses.asdict(r) for r in rows]}, f, indent=1)
    if args.png:
        chart.write_png(rows, args.png, f"headwise {stamp}, {machine}, torch {torch.__version__}")
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
