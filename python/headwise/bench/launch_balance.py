"""python -m headwise.bench.launch_balance

How evenly a causal launch's CTAs fill an H200: a processor-sharing list schedule, an
ESTIMATE that no GPU has checked. The emulator's estimate (sim_profile.py) spreads a
launch's work evenly over the SMs; this asks what the CTAs' unequal work and the launch
boundaries cost on top of that.

Model: the grid's CTAs are dispatched in linear block order (x fastest) to whichever SM
has a free slot (`slots` resident CTAs per SM, from registers and shared memory); the
resident CTAs of an SM share it equally, and one CTA alone gets at most `cap` of it (four
warps cannot fill an SM's issue slots). A CTA's work is counted in key tiles. Launches of
one loop run one after another. The time is reported against the balanced bound, all the
work over all the SMs at full rate.

Cases, the DCMHA sweeps (dcmha_attention_mma_kernel.cuh) at the target shape, B = 8, one
group of H = 32 heads, T = 4096 causal, 64-row query tiles, 32-key tiles:
- the statistics sweep (3 CTAs per sm_90 SM):
  unsplit        one launch, a CTA per (query tile, b): tile i holds 2 (i + 1) key tiles
  256-row chunks a launch per 256-row query chunk, a CTA per (256-key split, tile, b)
  one launch     a CTA per (256-key split, tile, b) over all rows (what the launcher does
                 where split_stats fits the scratch cap)
- the partials sweep (2 CTAs per sm_90 SM), a launch per query chunk because its scratch
  (B G 8 chunk T fp32) bounds the chunk: 256 rows under today's 256 MiB cap, larger chunks
  (a larger cap), or 256-row chunks of query tiles paired from both ends of the band
  (tiles 2c, 2c + 1, 62 - 2c, 63 - 2c), whose launches then hold equal work.
"""

from __future__ import annotations

import argparse

SMS = 132


def makespan(works: list[float], slots: int, cap: float, sms: int = SMS) -> float:
    """Finish time of CTAs of the given work (in order) under processor sharing."""
    resident: list[list[float]] = [[] for _ in range(sms)]
    nxt = 0
    for sm in resident:
        while len(sm) < slots and nxt < len(works):
            sm.append(works[nxt])
            nxt += 1
    t = 0.0
    while any(resident):
        dt = min(min(sm) / min(cap, 1.0 / len(sm)) for sm in resident if sm)
        t += dt
        for sm in resident:
            if not sm:
                continue
            rate = min(cap, 1.0 / len(sm))
            sm[:] = [w - dt * rate for w in sm if w - dt * rate > 1e-9]
            while len(sm) < slots and nxt < len(works):
                sm.append(works[nxt])
                nxt += 1
    return t


def split_ctas(rows: range, batch: int, tile_rows: int = 64, split_keys: int = 256, key_tile: int = 32) -> list[int]:
    """Key tiles of each non-empty (split, query tile, b) CTA of a causal sweep over `rows`,
    in linear block order (split fastest, then tile, then b)."""
    works = []
    for _ in range(batch):
        for q0 in range(rows.start, rows.stop, tile_rows):
            hi = q0 + tile_rows
            for s_lo in range(0, hi, split_keys):
                keys = min(hi, s_lo + split_keys) - s_lo
                works.append(-(-keys // key_tile))
    return works


def stats_cases(batch: int = 8, seq: int = 4096, chunk: int = 256) -> dict[str, list[list[int]]]:
    """The launches (each a list of CTA works) of each way to run the statistics sweep."""
    tiles = seq // 64
    return {
        "unsplit": [[2 * (i + 1) for _ in range(batch) for i in range(tiles)]],
        f"{chunk}-row chunks": [split_ctas(range(c0, c0 + chunk), batch) for c0 in range(0, seq, chunk)],
        "one launch": [split_ctas(range(0, seq), batch)],
    }


def partials_cases(batch: int = 8, seq: int = 4096) -> dict[str, list[list[int]]]:
    """The launches of the partials sweep per query chunk: contiguous chunks of 256, 512 and
    1024 rows, and 256-row chunks of tiles paired from both ends of the band."""
    cases = {f"{rows} rows": [split_ctas(range(c0, c0 + rows), batch) for c0 in range(0, seq, rows)]
             for rows in (256, 512, 1024)}
    tiles = seq // 64

    def paired(c: int) -> list[int]:
        picks = (2 * c, 2 * c + 1, tiles - 2 - 2 * c, tiles - 1 - 2 * c)
        return [w for _ in range(batch) for i in picks for w in split_ctas(range(64 * i, 64 * i + 64), 1)]

    cases["256 paired"] = [paired(c) for c in range(tiles // 4)]
    return cases


def table(title: str, cases: dict[str, list[list[int]]], configs) -> list[str]:
    balanced = sum(sum(w) for w in next(iter(cases.values()))) / SMS
    lines = [title, f"{'CTAs per SM, cap of one CTA':<30}" + "".join(f"{name:>16}" for name in cases)]
    for slots, cap in configs:
        spans = [sum(makespan(w, slots, cap) for w in launches) / balanced for launches in cases.values()]
        lines.append(f"{f'{slots}, {cap:.2f}':<30}" + "".join(f"{x:>15.2f}x" for x in spans))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m headwise.bench.launch_balance", description=__doc__.split("\n")[2])
    ap.parse_args(argv)
    head = "B=8 H=32 T=4096 causal: makespan / balanced (ESTIMATE, processor sharing)"
    configs = ((3, 1 / 3), (3, 0.5), (3, 1.0), (2, 0.5), (1, 1.0))
    print("\n".join(table(f"DCMHA statistics sweep, {head}", stats_cases(), configs)))
    print()
    print("\n".join(table(f"DCMHA partials sweep per query chunk, {head}", partials_cases(), configs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
