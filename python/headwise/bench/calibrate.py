"""python -m headwise.bench.calibrate [op ...] [--estimates F] [--json OUT] [--max-est-ms MS] [--repeats N]

On a CUDA device: times each op of the emulator's profile table (headwise.bench.sim_profile)
at the shape its H200 estimate is for, with the same inputs, and prints the ESTIMATE from
the emulated memory counts (``bench/sim_profile_h200_2026-12-05_dcmha_tf32.json``, written by
``python -m headwise.bench --sim-profile --json ...``) beside the measured time, per op and
phase. One lent GPU session thus calibrates the estimate's constants (HBM and L2 bandwidth,
latency, the mma.sync ceiling): measured / estimate per bound tells which constant is off.
Ops whose estimate exceeds ``--max-est-ms`` are skipped (today's DCMHA kernels take seconds);
``op ...`` (keys of sim_profile.OPS: mhar, qkv, merge, dcmha_compose, dcmha, dcmha_tf32) picks and
orders the ops. The JSON is rewritten after every op, so a run stopped by a time limit
keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

from .checkout import BENCH_DIR
from .sim_profile import OPS

DEFAULT_ESTIMATES = BENCH_DIR / "sim_profile_h200_2026-12-05_dcmha_tf32.json"


def estimates_by_phase(targets: list[dict]) -> dict:
    """{(op name, phase): (sum of the kernels' est_us, [(kernel, est_us, est_bound)])}."""
    out = defaultdict(lambda: [0.0, []])
    for rec in targets:
        name, phase = rec["op"].rsplit(" ", 1)
        entry = out[(name, phase)]
        entry[0] += rec["est_us"]
        entry[1].append((rec["kernel"], rec["est_us"], rec["est_bound"]))
    return {k: tuple(v) for k, v in out.items()}


def time_phases(spec, ops, device, repeats: int) -> dict:
    """Median milliseconds of each phase of spec.run at spec.target (one warm-up run)."""
    def run_once():
        marks = []

        def take():
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            marks.append(event)
            return len(marks) - 1

        phases = spec.run(ops, spec.target, take, device)
        torch.cuda.synchronize()
        return {phase: marks[i - 1].elapsed_time(marks[i]) for phase, i in phases.items()}

    run_once()
    runs = [run_once() for _ in range(repeats)]
    return {phase: statistics.median(r[phase] for r in runs) for phase in runs[0]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m headwise.bench.calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ops", nargs="*", default=None, help=f"ops to time, in this order (default: {', '.join(OPS)})")
    p.add_argument("--estimates", default=str(DEFAULT_ESTIMATES), help="the --sim-profile JSON (its 'targets')")
    p.add_argument("--json", metavar="OUT", help="also write the rows as JSON")
    p.add_argument("--max-est-ms", type=float, default=1000.0, help="skip an op whose estimate is longer")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    unknown = [o for o in args.ops or [] if o not in OPS]
    if unknown:
        p.error(f"unknown op(s) {unknown}; choose from {list(OPS)}")
    if not torch.cuda.is_available():
        p.error("needs a CUDA device: it measures what the estimates predict")
    estimates = estimates_by_phase(json.loads(Path(args.estimates).read_text())["targets"])
    import headwise

    ops, device, rows = headwise.ops.DEFAULT_OPS, torch.device("cuda"), []
    print(f"{'op':<28} {'shape':<34} {'H200 est. ms':>12} {'measured ms':>12} {'meas/est':>9}  est. bound")
    for spec in (OPS[o] for o in (args.ops or OPS)):
        phases = {ph: est for (name, ph), est in estimates.items() if name == spec.name}
        shape = spec.label(spec.target)
        total_ms = sum(est_us for est_us, _ in phases.values()) / 1e3
        if not phases or total_ms > args.max_est_ms:
            print(f"{spec.name:<28} {shape:<34} skipped: estimated {total_ms:.0f} ms > --max-est-ms")
            continue
        measured = time_phases(spec, ops, device, args.repeats)
        for phase, ms in measured.items():
            est_us, kernels = phases.get(phase, (float("nan"), []))
            bound = max(kernels, key=lambda k: k[1])[2] if kernels else "-"
            print(f"{spec.name + ' ' + phase:<28} {shape:<34} {est_us / 1e3:>12.3f} {ms:>12.3f} "
                  f"{ms / (est_us / 1e3):>9.2f}  {bound}")
            rows.append(dict(op=spec.name, phase=phase, shape=spec.target, est_ms=est_us / 1e3, measured_ms=ms,
                             kernels=[dict(kernel=k, est_us=u, est_bound=b) for k, u, b in kernels]))
        torch.cuda.empty_cache()
        if args.json:
            Path(args.json).write_text(json.dumps({"note": "est_ms: H200 ESTIMATES from emulated counts; "
                                                   "measured_ms: this GPU", "device": torch.cuda.get_device_name(),
                                                   "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
