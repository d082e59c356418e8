"""python -m headwise.bench.launch_balance

How evenly a causal launch's CTAs fill an H200: a processor-sharing list schedule, an
ESTIMATE that no GPU has checked. The emulator's estimate (sim_profile.py) spreads a
launch's work evenly over the SMs; this asks what the CTAs' unequal work and the launch
boundaries cost on top of that.

Model: the grid's CTAs are dispatched in linear block order (x fastest) to the SMs with
free slots (`slots` resident CTAs per SM, from registers and shared memory), breadth
first: an SM gets a second resident CTA only when none has fewer; the
resident CTAs of an SM share it equally, and one CTA alone gets at most `cap` of it (four
warps cannot fill an SM's issue slots). A CTA's work is counted in key tiles. Launches of
one loop run one after another. The time is reported against the balanced bound, all the
work over all the SMs at full rate.

Cases, the DCMHA launches (dcmha_attention_mma_kernel.cuh, dcmha_attention_mma_bwd_kernel.cuh)
at the target shape, B = 8, one group of H = 32 heads, T = 4096 causal, 64-row query tiles,
32-key tiles:
- the statistics sweep (3 CTAs per sm_90 SM):
  unsplit        one launch, a CTA per (query tile, b): tile i holds 2 (i + 1) key tiles
  256-row chunks a launch per 256-row query chunk, a CTA per (256-key split, tile, b)
  one launch     a CTA per (256-key split, tile, b) over all rows (what the launcher did
                 until the sweep stored the chunk's a, b for the partials sweep)
  512 x 256      a launch per 512-row query chunk (the partials' scratch chunk under a
                 256 MiB cap), 256-key splits
  512 x 64       the same with 64-key splits (what the launcher does, per 1024-row chunk
                 under its 512 MiB cap: forward_chunk_rows)
- the partials sweep (2 CTAs per sm_90 SM), a launch per query chunk because its scratch
  bounds the chunk under the cap (SCRATCH_BYTES): 256 rows while it was B G 8 chunk T fp32
  under 256 MiB, 512 rows as B G 4 chunk T words (two bf16 / fp16 partials a word), with
  CTAs of 256-key splits (before) or of one 32-key tile (now), and 1024-row chunks (the
  512 MiB cap);
- the backward's launches per query chunk (its scratch of 8 words a (t, s) under the cap:
  512 rows, backward_chunk_rows; `--backward-chunk 256` for the 256 MiB cap), each
  at its CTAs per SM from the emulator's profile JSON, weighted by the profile's estimate
  of the kernel (which spreads its work evenly): the sweeps (partials, dP', dL') with CTAs
  of 256-key splits (before) or of one key tile (tiles, now), the row kernels (rowsum, dq)
  a CTA per (head, query tile, b), heads fastest, over the band, the rowsum's band cut into 3 key splits
  (now) with their combine after it, the key kernel (dk and dv; two kernels in older
  profiles) a CTA per (head, 64-key tile, b), heads fastest, over the chunk's 32-row query
  steps in its band;
- the forward's launches per query chunk (its scratch of 4 words a (t, s) under the cap:
  1024 rows), weighted by the profile's estimates like the backward's: the statistics sweep in
  64-key splits, the partials sweep a key tile a CTA, the output kernel a CTA per
  (head, query tile, b), heads fastest, over the band.
Last, issue 16's targets at that shape: the forward and backward estimates, evenly spread
and scheduled, against 4x SDPA flash's forward + backward as the H200 measured it
(bench/h200_2026-11-30/targets_dcmha_backward.json) and against a floor of DCFormer's
formulation as `bench.targets` times it (dcformer_floor_ms: the reference math per 128-row
query chunk, compiled; its products in fp32 at the FP32 peak, its score-shaped fp32
tensors outside them at the HBM peak).
"""

from __future__ import annotations

import argparse

from .checkout import BENCH_DIR

SMS = 132
# kScratchBytes (dcmha_attention_mma_kernel.cuh): the launcher's cap on a call's scratch.
SCRATCH_BYTES = 512 << 20
TILE_ROWS = 64  # kTileRows: query rows per CTA, the chunk's granularity
STATS_SPLIT_KEYS = 64  # kStatsSplitKeys: keys per split of the forward's split statistics
FORWARD_PART_WORDS = 4  # kFwdPartWords: the forward's scratch planes (a, b, c, d)
BACKWARD_PART_WORDS = 8  # kBwdPartWords (dcmha_attention_mma_bwd_kernel.cuh)
# The H200's measurement of SDPA flash (plain MHA, the target shape), issue 16's baseline.
FLASH_MEASURED = BENCH_DIR / "h200_2026-11-30" / "targets_dcmha_backward.json"


def chunk_rows(seq: int, row_bytes: int, cap: int = SCRATCH_BYTES) -> int:
    """Rows of a query chunk of a buffer of row_bytes a query row, as the launcher picks them
    (chunk_rows_under_cap, dcmha_launch.h): a multiple of 64 under the cap, at least 64, at
    most T rounded up to 64."""
    tiles = -(-seq // TILE_ROWS)
    return min(tiles, max(1, cap // (row_bytes * TILE_ROWS))) * TILE_ROWS


def forward_chunk_rows(batch: int = 8, heads: int = 32, seq: int = 4096, groups: int = 1, word_bytes: int = 4,
                       cap: int = SCRATCH_BYTES) -> int:
    """The forward's query chunk (launch_mma_attention): its scratch of B G 4 words a (t, s)
    (word_bytes 4, or 8 on the TF32 path) and its split statistics (B H 2 fp32 a 64-key split
    and row) each under the cap."""
    splits = -(-seq // STATS_SPLIT_KEYS)
    return min(chunk_rows(seq, batch * groups * FORWARD_PART_WORDS * seq * word_bytes, cap),
               chunk_rows(seq, batch * heads * 2 * splits * 4, cap))


def backward_chunk_rows(batch: int = 8, seq: int = 4096, groups: int = 1, word_bytes: int = 4,
                        cap: int = SCRATCH_BYTES) -> int:
    """The backward's query chunk (launch_mma_attention_backward): its scratch of B G 8 words
    a (t, s) under the cap."""
    return chunk_rows(seq, batch * groups * BACKWARD_PART_WORDS * seq * word_bytes, cap)


# The launcher's chunks at the target shape (bf16): 1024 forward rows, 512 backward rows.
FORWARD_CHUNK = forward_chunk_rows()
BACKWARD_CHUNK = backward_chunk_rows()


def makespan(works: list[float], slots: int, cap: float, sms: int = SMS) -> float:
    """Finish time of CTAs of the given work (in order) under processor sharing."""
    resident: list[list[float]] = [[] for _ in range(sms)]
    nxt = 0

    def dispatch() -> None:
        # Breadth first, as the hardware's block scheduler spreads a launch: every SM with
        # the fewest resident CTAs gets the next one before any SM gets a second.
        nonlocal nxt
        for level in range(slots):
            for sm in resident:
                if nxt == len(works):
                    return
                if len(sm) <= level:
                    sm.append(works[nxt])
                    nxt += 1

    dispatch()
    t = 0.0
    while any(resident):
        dt = min(min(sm) / min(cap, 1.0 / len(sm)) for sm in resident if sm)
        t += dt
        for sm in resident:
            if not sm:
                continue
            rate = min(cap, 1.0 / len(sm))
            sm[:] = [w - dt * rate for w in sm if w - dt * rate > 1e-9]
        dispatch()
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
        **{f"512 x {keys}": [split_ctas(range(c0, c0 + 512), batch, split_keys=keys) for c0 in range(0, seq, 512)]
           for keys in (256, 64)},
    }


def partials_cases(batch: int = 8, seq: int = 4096) -> dict[str, list[list[int]]]:
    """The launches of the partials sweep per query chunk: 256-, 512- and 1024-row chunks
    with CTAs of 256-key splits (before) or of one 32-key tile (now)."""
    return {f"{rows} rows, {keys} keys": [split_ctas(range(c0, c0 + rows), batch, split_keys=keys)
                                         for c0 in range(0, seq, rows)]
            for rows in (256, 512, 1024) for keys in (256, 32)}


def row_ctas(rows: range, batch: int, heads: int, tile_rows: int = 64, key_tile: int = 32, splits: int = 1,
             heads_per_cta: int = 1, heads_fastest: bool = True) -> list[int]:
    """Key tiles of each non-empty (heads, key split, query tile, b) CTA of a causal row
    kernel over `rows`, in linear block order: heads fastest as the kernels' grids, or
    (heads_fastest=False, the grids before 2026-12-06) key splits, then tiles, then heads.
    Split i of a tile's n key tiles holds n (i + 1) // splits - n i // splits of them, for
    each of the CTA's heads (dcmha_attn_bwd_rows; its empty splits store zeros and are left
    out here)."""
    works = []
    for _ in range(batch):
        per_tile = []
        for q0 in range(rows.start, rows.stop, tile_rows):
            n = (q0 + tile_rows) // key_tile
            per_tile.append([heads_per_cta * w for i in range(splits)
                             if (w := n * (i + 1) // splits - n * i // splits) > 0])
        groups = heads // heads_per_cta
        if heads_fastest:
            works += [w for tile in per_tile for w in tile for _ in range(groups)]
        else:
            works += [w for _ in range(groups) for tile in per_tile for w in tile]
    return works


def key_ctas(rows: range, batch: int, heads: int, seq: int, key_rows: int = 64, step: int = 32,
             heads_fastest: bool = True) -> list[int]:
    """Query steps of each non-empty (head, 64-key tile, b) CTA of a causal key kernel over
    the query rows `rows`, in linear block order: heads fastest as dcmha_attn_bwd_keys's
    grid, or (heads_fastest=False, before 2026-12-06) key tiles fastest. A CTA's steps are
    those of `step` rows from the tile's first key on."""
    works = []
    for _ in range(batch):
        tiles = [-(-n // step) for s0 in range(0, seq, key_rows) if (n := rows.stop - max(rows.start, s0)) > 0]
        works += [w for w in tiles for _ in range(heads)] if heads_fastest else tiles * heads
    return works


# The key kernels: dcmha_attn_bwd_dkv now; dcmha_attn_bwd_dv and _dk in profiles made before
# they were one kernel (a table lists the kernels its profile has).
BACKWARD_KERNELS = ("dcmha_attn_partials", "dcmha_attn_bwd_dpost", "dcmha_attn_bwd_rowsum",
                    "dcmha_attn_bwd_rowsum_combine", "dcmha_attn_bwd_dpre", "dcmha_attn_bwd_dq", "dcmha_attn_bwd_dkv",
                    "dcmha_attn_bwd_dv", "dcmha_attn_bwd_dk")
ROWSUM_KEY_SPLITS = 3  # kRowsumKeySplits (dcmha_attention_mma_bwd_kernel.cuh)
ROWSUM_HEADS = 2  # rowsum_heads(hg) at an even group size


def backward_cases(batch: int = 8, heads: int = 32, seq: int = 4096, chunk: int = BACKWARD_CHUNK) -> dict[str, dict[str, list]]:
    """Per backward kernel, its launches (one per query chunk): "before" with sweep CTAs of
    256-key splits and a rowsum CTA per query tile, "tiles" with sweep CTAs of one key tile,
    "splits" with those and the rowsum's tiles cut into ROWSUM_KEY_SPLITS key splits (its
    combine, a CTA per 128 rows of the chunk and head, then runs; before, the rowsum did it),
    "now" with the rowsum's CTAs of ROWSUM_HEADS heads where they divide `heads` (half the
    CTAs, twice the work each) and the row and key kernels' grids heads fastest (the older
    cases' ran tiles fastest)."""
    chunks = [range(c0, min(c0 + chunk, seq)) for c0 in range(0, seq, chunk)]
    rows = [row_ctas(c, batch, heads, heads_fastest=False) for c in chunks]
    split_rows = [row_ctas(c, batch, heads, splits=ROWSUM_KEY_SPLITS, heads_fastest=False) for c in chunks]
    pair = ROWSUM_HEADS if heads % ROWSUM_HEADS == 0 else 1
    pair_rows = [row_ctas(c, batch, heads, splits=ROWSUM_KEY_SPLITS, heads_per_cta=pair) for c in chunks]
    combine = [[1] * (batch * heads * -(-len(c) // 128)) for c in chunks]
    keys = [key_ctas(c, batch, heads, seq, heads_fastest=False) for c in chunks]
    # Now the row and key kernels run heads fastest.
    rows_now = [row_ctas(c, batch, heads) for c in chunks]
    keys_now = [key_ctas(c, batch, heads, seq) for c in chunks]
    cases = {}
    for name, split, rowsum, dq, key in (("before", 256, rows, rows, keys), ("tiles", 32, rows, rows, keys),
                                         ("splits", 32, split_rows, rows, keys),
                                         ("now", 32, pair_rows, rows_now, keys_now)):
        sweep = [split_ctas(c, batch, split_keys=split) for c in chunks]
        cases[name] = {k: sweep if k.endswith(("partials", "dpost", "dpre")) else rowsum if k.endswith("rowsum")
                       else (combine if name in ("splits", "now") else []) if k.endswith("combine")
                       else dq if k.endswith("dq") else key for k in BACKWARD_KERNELS}
    return cases


def forward_cases(batch: int = 8, heads: int = 32, seq: int = 4096, chunk: int = FORWARD_CHUNK) -> dict[str, list[list[int]]]:
    """Per scheduled forward kernel, its launches (one per query chunk of `chunk` rows): the
    statistics sweep's CTAs of 64-key splits (kStatsSplitKeys), the partials sweep's of one
    32-key tile (kSweepSplitKeys), the output kernel's a CTA per (head, query tile, b) over
    the tile's band (dcmha_attention_mma_kernel.cuh). The weights transpose and the
    statistics combine, whose CTAs are alike, are left to their even estimate."""
    chunks = [range(c0, min(c0 + chunk, seq)) for c0 in range(0, seq, chunk)]
    return {"dcmha_attn_stats": [split_ctas(c, batch, split_keys=64) for c in chunks],
            "dcmha_attn_partials": [split_ctas(c, batch, split_keys=32) for c in chunks],
            "dcmha_attn_output": [row_ctas(c, batch, heads) for c in chunks]}


def span_ratio(launches: list[list[int]], slots: int, cap: float) -> float:
    """Makespan of the launches, one after another, over their balanced time (0 where a
    case does not launch the kernel)."""
    work = sum(sum(w) for w in launches)
    return sum(makespan(w, slots, cap) for w in launches) / (work / SMS) if work else 0.0


def backward_table(estimates: str, chunk: int = BACKWARD_CHUNK) -> list[str]:
    """The backward's kernels at their CTAs per SM (cap 1 / slots and 1), weighted by the
    profile's estimates of them."""
    est = {k: v for k, v in _phase_estimates(estimates, "bwd").items() if k in BACKWARD_KERNELS}
    cases = backward_cases(chunk=chunk)
    lines = [f"{'kernel':<32}{'CTAs/SM':>8}{'est ms':>8}" + "".join(f"{f'{n}, cap {c}':>20}" for n in cases
                                                                   for c in ("1/slots", "1"))]
    totals = [0.0] * (2 * len(cases))
    for k in (k for k in BACKWARD_KERNELS if k in est):
        ms, slots = est[k]
        spans = [span_ratio(cases[n][k], slots, cap) for n in cases for cap in (1 / slots, 1.0)]
        totals = [a + ms * x for a, x in zip(totals, spans)]
        lines.append(f"{k:<32}{slots:>8}{ms:>8.2f}" + "".join(f"{x:>19.2f}x" for x in spans))
    lines.append(f"{'weighted (ms)':<32}{'':>8}{sum(m for m, _ in est.values()):>8.2f}"
                 + "".join(f"{x:>20.1f}" for x in totals))
    return lines


def _phase_estimates(estimates: str, phase: str) -> dict[str, tuple[float, int]]:
    """kernel -> (estimate ms, CTAs per SM) of the profile's dcmha `phase` ("fwd" / "bwd")."""
    import json

    with open(estimates) as f:
        targets = json.load(f)["targets"]
    return {t["kernel"]: (t["est_us"] / 1e3, int(t["ctas_per_sm"])) for t in targets
            if t["op_key"] == "dcmha" and t["phase"] == phase}


def scheduled_ms(est: dict[str, tuple[float, int]], cases: dict[str, list[list[int]]]) -> tuple[float, float, float]:
    """(even, cap 1/slots, cap 1) ms of a phase: each kernel in `cases` at its estimate times its
    launches' span ratio, every other kernel of the phase at its even estimate."""
    even = sum(ms for ms, _ in est.values())
    capped = [even, even]
    for kernel, launches in cases.items():
        if kernel in est:
            ms, slots = est[kernel]
            for i, cap in enumerate((1 / slots, 1.0)):
                capped[i] += ms * (span_ratio(launches, slots, cap) - 1.0)
    return even, capped[0], capped[1]


def forward_table(estimates: str, chunk: int = FORWARD_CHUNK) -> list[str]:
    """The forward's scheduled kernels at their CTAs per SM (cap 1 / slots and 1), weighted
    by the profile's estimates of them."""
    est = _phase_estimates(estimates, "fwd")
    cases = forward_cases(chunk=chunk)
    lines = [f"{'kernel':<32}{'CTAs/SM':>8}{'est ms':>8}{'cap 1/slots':>14}{'cap 1':>10}"]
    for kernel, launches in cases.items():
        if kernel in est:
            ms, slots = est[kernel]
            lines.append(f"{kernel:<32}{slots:>8}{ms:>8.2f}"
                         + "".join(f"{span_ratio(launches, slots, cap):>{w}.2f}x" for w, cap in ((13, 1 / slots), (9, 1.0))))
    even, cap_slots, cap_one = scheduled_ms(est, cases)
    lines.append(f"{'forward, every kernel (ms)':<32}{'':>8}{even:>8.2f}{cap_slots:>14.2f}{cap_one:>10.2f}")
    return lines


def dcformer_floor_ms(batch: int = 8, heads: int = 32, seq: int = 4096, dh: int = 128,
                      fp32_flops_per_s: float = 67e12, hbm_bytes_per_s: float = 4.8e12) -> dict[str, float]:
    """A floor of DCFormer's formulation as `bench.targets` times it (reference.
    dcmha_attention_query_chunks, each chunk's rows compiled), forward + backward. Each
    query chunk forms its rows' scores against every key ([B, H, rows, S], masked, not
    skipped) in fp32, the reference's accumulation dtype, so its products are fp32 GEMMs
    under torch's default float32 matmul precision: six of 2 B H rows S d FLOPs (QK^T,
    P'V; dP' = dO V^T, dV, dQ, dK), T S rows in all, at the FP32 peak. Each is
    compute-bound (~32 FLOPs a byte at dh = 128 against the ridge's ~14), so the score-shaped fp32
    tensors that the products read or write (the logits, P' twice, dP', dL twice) cost them
    nothing more; the passes outside them cost at least 5 reads or writes of such a
    tensor at the HBM peak (the logits read and P' written by the fused compose / softmax /
    compose, dP' read, a saved P' or logits read and dL written by the fused backward).
    One stream's kernels run one after another: the floor is the sum."""
    gemm_flops = 6 * 2 * batch * heads * seq * seq * dh
    score_bytes = 5 * 4 * batch * heads * seq * seq
    gemm_ms, bytes_ms = gemm_flops / fp32_flops_per_s * 1e3, score_bytes / hbm_bytes_per_s * 1e3
    return {"gemm_ms": gemm_ms, "bytes_ms": bytes_ms, "floor_ms": gemm_ms + bytes_ms}


def library_ms(batch: int = 8, heads: int = 32, seq: int = 4096, groups: int = 1, rank: int = 2, elem: int = 2,
               backward_chunk: int = BACKWARD_CHUNK, hbm_bytes_per_s: float = 4.1e12) -> dict[str, float]:
    """HBM time of the ATen ops around the DCMHA tensor-core kernels (dcmha_attention_launch.h,
    dcmha_attention_backward_launch.h), which the emulator's profile does not see: per call
    the weights (w1, w2 [B, T, 4, R, H], g [B, T, 4, H] in the inputs' dtype, `elem` bytes)
    read and written as fp32; the backward also fills the weights table's M and 1 / Z
    planes from the statistics, zeroes its scratch (B G 8 chunk T words) and grads table
    (B H 20 T fp32), and converts the fp32 weight grads to the weights' dtype. (dk, dv need
    no zero-fill and no conversion pass: the key kernel stores the first chunk's share and
    writes the last in q's dtype.)"""
    weights = batch * seq * (2 * 4 * rank * heads + 4 * heads)
    to_fp32 = weights * (elem + 4)
    stats = 2 * batch * heads * seq * 4 * 2
    zeros = batch * groups * 8 * backward_chunk * seq * 4 + batch * heads * 20 * seq * 4
    fwd, bwd = to_fp32, to_fp32 + stats + zeros + weights * (4 + elem)
    return {"fwd_ms": fwd / hbm_bytes_per_s * 1e3, "bwd_ms": bwd / hbm_bytes_per_s * 1e3}


def measured_flash_ms(path: str) -> float | None:
    """SDPA flash forward + backward (plain MHA, the target shape) from a lent GPU's
    `bench.targets dcmha-backward` JSON, or None where there is none."""
    import json
    import os

    if not os.path.exists(path):
        return None
    with open(path) as f:
        rows = json.load(f)["rows"]
    return next((r["baseline_ms"] for r in rows if r["baseline"] == "SDPA flash forward + backward"), None)


def targets_table(estimates: str, forward_chunk: int = FORWARD_CHUNK, backward_chunk: int = BACKWARD_CHUNK,
                  flash_json: str | None = None) -> list[str]:
    """Issue 16's targets at B=8 H=32 T=4096 dh=128 causal: forward + backward (evenly spread;
    scheduled at cap 1 / slots and cap 1) against 4x flash's measured forward + backward and
    against the DCFormer floor. ESTIMATES on both sides but flash's."""
    from headwise.bench.sim_profile import H200

    lib = library_ms(backward_chunk=backward_chunk, hbm_bytes_per_s=H200.hbm_bytes_per_s)
    fwd = [x + lib["fwd_ms"] for x in scheduled_ms(_phase_estimates(estimates, "fwd"), forward_cases(chunk=forward_chunk))]
    bwd = [x + lib["bwd_ms"] for x in scheduled_ms(_phase_estimates(estimates, "bwd"),
                                                   backward_cases(chunk=backward_chunk)["now"])]
    total = [f + b for f, b in zip(fwd, bwd)]
    lines = [f"{'headwise (ESTIMATE, ms)':<40}{'even':>10}{'cap 1/slots':>14}{'cap 1':>10}"
             f"   (ATen ops around the kernels included: fwd {lib['fwd_ms']:.2f}, bwd {lib['bwd_ms']:.2f} ms)"]
    for name, row in (("forward", fwd), ("backward", bwd), ("forward + backward", total)):
        lines.append(f"{name:<40}" + "".join(f"{x:>{w}.2f}" for w, x in zip((10, 14, 10), row)))
    flash = measured_flash_ms(flash_json) if flash_json else None
    if flash is not None:
        lines.append(f"{'4x SDPA flash fwd + bwd (MEASURED x 4)':<40}{4 * flash:>10.2f}"
                     f"   ({flash:.2f} ms measured: {flash_json}); ratio {total[0] / flash:.2f}x / "
                     f"{total[1] / flash:.2f}x / {total[2] / flash:.2f}x of flash (goal 4)")
    dcf = dcformer_floor_ms(fp32_flops_per_s=H200.fp32_flops_per_s)
    lines.append(f"{'DCFormer formulation, floor (ms)':<40}{dcf['floor_ms']:>10.2f}"
                 f"   (fp32 GEMMs {dcf['gemm_ms']:.1f} + score passes outside them {dcf['bytes_ms']:.1f}); headwise at "
                 f"{total[0] / dcf['floor_ms']:.2f}x / {total[1] / dcf['floor_ms']:.2f}x / "
                 f"{total[2] / dcf['floor_ms']:.2f}x of it (goal < 1)")
    return lines


def table(title: str, cases: dict[str, list[list[int]]], configs) -> list[str]:
    width = max(16, *(len(name) + 2 for name in cases))
    lines = [title, f"{'CTAs per SM, cap of one CTA':<30}" + "".join(f"{name:>{width}}" for name in cases)]
    for slots, cap in configs:
        spans = [span_ratio(launches, slots, cap) for launches in cases.values()]
        lines.append(f"{f'{slots}, {cap:.2f}':<30}" + "".join(f"{x:>{width - 1}.2f}x" for x in spans))
    return lines


def main(argv: list[str] | None = None) -> int:
    from headwise.bench.calibrate import DEFAULT_ESTIMATES

    ap = argparse.ArgumentParser(prog="python -m headwise.bench.launch_balance",
                                 description="How evenly the DCMHA launches fill an H200 (an ESTIMATE).")
    ap.add_argument("--estimates", default=str(DEFAULT_ESTIMATES),
                    help="the --sim-profile JSON whose backward kernels' estimates and CTAs per SM weight the table")
    ap.add_argument("--backward-chunk", type=int, default=BACKWARD_CHUNK,
                    help=f"query rows of a backward chunk ({BACKWARD_CHUNK}: the launcher's at the target shape)")
    ap.add_argument("--forward-chunk", type=int, default=FORWARD_CHUNK,
                    help=f"query rows of a forward chunk ({FORWARD_CHUNK}: the launcher's at the target shape)")
    ap.add_argument("--flash-json", default=str(FLASH_MEASURED),
                    help="a lent GPU's `bench.targets dcmha-backward` JSON (SDPA flash's measured time)")
    args = ap.parse_args(argv)
    head = "B=8 H=32 T=4096 causal: makespan / balanced (ESTIMATE, processor sharing)"
    configs = ((3, 1 / 3), (3, 0.5), (3, 1.0), (2, 0.5), (1, 1.0))
    print("\n".join(table(f"DCMHA statistics sweep, {head}", stats_cases(), configs)))
    print()
    print("\n".join(table(f"DCMHA partials sweep per query chunk, {head}", partials_cases(), configs)))
    print()
    print(f"DCMHA backward per {args.backward_chunk}-row query chunk, {head}; weighted by {args.estimates}")
    print("\n".join(backward_table(args.estimates, args.backward_chunk)))
    print()
    print(f"DCMHA forward per {args.forward_chunk}-row query chunk, {head}; weighted by {args.estimates}")
    print("\n".join(forward_table(args.estimates, args.forward_chunk)))
    print()
    print("Issue 16's targets, B=8 H=32 T=4096 dh=128 causal bf16, head_groups=1 (ESTIMATES but the flash row)")
    print("\n".join(targets_table(args.estimates, args.forward_chunk, args.backward_chunk, args.flash_json)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
