"""python -m headwise.bench [op ...] [--device cpu|cuda] [--dtype ...] [--repeats N] [--json FILE]

Prints, per op and mode, the median time of the eager reference, of torch.compile of the
reference, and of headwise, with the speedups of headwise over both, the bytes saved for
backward and the peak memory of the step (see bench.timing.peak_bytes).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import sys

import torch

from . import merge, mhar, model

BENCHMARKS = {"mhar": mhar.run, "merge": merge.run, "model": model.run}
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
    p.add_argument("ops", nargs="*", default=list(BENCHMARKS), help=f"ops to run: {', '.join(BENCHMARKS)}")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="default: fp32 on CPU, bf16 on CUDA")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per measurement (median)")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = p.parse_args(argv)
    unknown = [o for o in args.ops if o not in BENCHMARKS]
    if unknown:
        p.error(f"unknown op(s) {unknown}; choose from {list(BENCHMARKS)}")
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    repeats = args.repeats or (50 if device.type == "cuda" else 15)

    rows = []
    for op in args.ops:
        rows += BENCHMARKS[op](device, dtype, repeats)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
