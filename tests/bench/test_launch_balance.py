"""The launch-balance model of python -m headwise.bench.launch_balance."""

import pytest

from headwise.bench import launch_balance as lb


def test_equal_ctas_that_fill_every_slot_take_the_balanced_time():
    works = [1.0] * (lb.SMS * 3)
    assert lb.makespan(works, slots=3, cap=1 / 3) == pytest.approx(3.0)


def test_a_lone_cta_runs_at_its_cap():
    assert lb.makespan([10.0], slots=3, cap=0.5) == pytest.approx(20.0)
    # Two waves of one CTA per SM: the second wave starts when the first ends.
    assert lb.makespan([1.0] * (2 * lb.SMS), slots=1, cap=1.0) == pytest.approx(2.0)


def test_the_statistics_layouts_do_the_same_work_in_bounded_ctas():
    cases = lb.stats_cases(batch=2, seq=1024, chunk=256)
    totals = {name: sum(sum(w) for w in launches) for name, launches in cases.items()}
    assert len(set(totals.values())) == 1, totals
    assert totals["unsplit"] == 2 * sum(2 * (i + 1) for i in range(16))
    assert max(cases["unsplit"][0]) == 32
    assert max(max(w) for w in cases["256-row chunks"]) == 8
    assert max(cases["one launch"][0]) == 8
    assert len(cases["256-row chunks"]) == 4


def test_a_launch_is_spread_over_the_sms_before_any_gets_a_second_cta():
    # One CTA per SM, each alone at full rate; filling SMs first would run three at a
    # third of an SM each.
    assert lb.makespan([1.0] * lb.SMS, slots=3, cap=1.0) == pytest.approx(1.0)


def test_the_partials_layouts_do_the_same_work_and_key_tile_ctas_hold_one_tile():
    cases = lb.partials_cases(batch=1, seq=1024)
    totals = {name: sum(sum(w) for w in launches) for name, launches in cases.items()}
    assert len(set(totals.values())) == 1, totals
    assert [len(launches) for launches in cases.values()] == [4, 4, 2, 2, 1, 1]
    assert max(max(w) for w in cases["256 rows, 32 keys"]) == 1
    assert max(max(w) for w in cases["256 rows, 256 keys"]) == 8


def test_the_backward_cases_count_each_kernels_work_alike_before_and_now():
    batch, heads, seq = 2, 3, 512
    cases = lb.backward_cases(batch=batch, heads=heads, seq=seq, chunk=128)
    tiles = seq // 64
    for kernel in lb.BACKWARD_KERNELS:
        before, key_tiles, splits, now = (sum(sum(w) for w in cases[n][kernel])
                                          for n in ("before", "tiles", "splits", "now"))
        assert before == key_tiles == (0 if kernel.endswith("combine") else now), kernel
        assert splits == now, kernel
        assert len(cases["now"][kernel]) == seq // 128
    # A sweep's key tiles of a causal band: 2 (i + 1) per query tile i and b (heads looped
    # inside the CTA); a row kernel's the same per head; the now-sweeps hold one tile a CTA.
    band = batch * sum(2 * (i + 1) for i in range(tiles))
    assert sum(sum(w) for w in cases["now"]["dcmha_attn_bwd_dpre"]) == band
    assert max(max(w) for w in cases["now"]["dcmha_attn_bwd_dpre"]) == 1
    assert sum(sum(w) for w in cases["now"]["dcmha_attn_bwd_rowsum"]) == heads * band
    # The rowsum's key splits: a tile's 2 (i + 1) key tiles in 3 runs; the combine a CTA
    # per (128 rows, head, b) of each chunk.
    assert sorted(cases["now"]["dcmha_attn_bwd_rowsum"][0]) == sorted([1, 1, 1, 1, 2] * batch * heads)
    assert cases["now"]["dcmha_attn_bwd_rowsum_combine"] == [[1] * batch * heads] * (seq // 128)
    # An odd head count keeps a head a rowsum CTA; an even one pairs them: half the CTAs,
    # each the work of two.
    assert ([sorted(w) for w in cases["now"]["dcmha_attn_bwd_rowsum"]]
            == [sorted(w) for w in cases["splits"]["dcmha_attn_bwd_rowsum"]])
    paired = lb.backward_cases(batch=batch, heads=4, seq=seq, chunk=128)
    assert sorted(paired["now"]["dcmha_attn_bwd_rowsum"][0]) == sorted([2, 2, 2, 2, 4] * batch * 2)
    assert (sum(sum(w) for w in paired["now"]["dcmha_attn_bwd_rowsum"])
            == sum(sum(w) for w in paired["splits"]["dcmha_attn_bwd_rowsum"]))
    # A key kernel's 32-row query steps: per 64-key tile j the rows t >= 64 j of each chunk.
    steps = sum(-(-(c0 + 128 - max(c0, 64 * j)) // 32) for c0 in range(0, seq, 128) for j in range(tiles)
                if c0 + 128 > 64 * j)
    assert sum(sum(w) for w in cases["now"]["dcmha_attn_bwd_dkv"]) == batch * heads * steps


def test_the_forward_cases_hold_a_causal_band_per_chunk():
    batch, heads, seq = 2, 3, 1024
    cases = lb.forward_cases(batch=batch, heads=heads, seq=seq, chunk=512)
    band = batch * sum(2 * (i + 1) for i in range(seq // 64))
    assert sum(sum(w) for w in cases["dcmha_attn_stats"]) == band
    assert sum(sum(w) for w in cases["dcmha_attn_partials"]) == band
    assert sum(sum(w) for w in cases["dcmha_attn_output"]) == heads * band
    assert [len(launches) for launches in cases.values()] == [2, 2, 2]
    # 64-key splits hold at most 2 key tiles, the partials' CTAs one; the output's last
    # query tile holds its whole band.
    assert max(max(w) for w in cases["dcmha_attn_stats"]) == 2
    assert max(max(w) for w in cases["dcmha_attn_partials"]) == 1
    assert max(max(w) for w in cases["dcmha_attn_output"]) == seq // 32


def test_a_phase_of_uniform_launches_that_fill_the_gpu_takes_its_even_time():
    est = {"k": (2.0, 3), "untimed": (0.5, 8)}
    even, cap_slots, cap_one = lb.scheduled_ms(est, {"k": [[1] * (3 * lb.SMS)]})
    assert even == pytest.approx(2.5)
    assert cap_slots == pytest.approx(2.5)
    # One wave of one CTA per slot at cap 1: three share an SM, the same time.
    assert cap_one == pytest.approx(2.5)
    # A lone CTA at a cap of 1/3 takes 3 SM-times of its work where the even spread counts
    # 1/132 of one: the schedule adds what the even estimate leaves out.
    _, lone, _ = lb.scheduled_ms({"k": (1.0, 3)}, {"k": [[1]]})
    assert lone == pytest.approx(3 * lb.SMS)


def test_the_dcformer_floor_is_the_fp32_products_at_peak_plus_the_passes_outside_them():
    f = lb.dcformer_floor_ms(batch=8, heads=32, seq=4096, dh=128, fp32_flops_per_s=67e12, hbm_bytes_per_s=4.8e12)
    # Six products against all S keys (masked, not skipped): 6.6 TFLOP at 67 TFLOP/s; five
    # passes over the [B, H, T, S] fp32 scores outside them at 4.8 TB/s.
    assert f["gemm_ms"] == pytest.approx(98.5, abs=0.1)
    assert f["bytes_ms"] == pytest.approx(17.9, abs=0.1)
    assert f["floor_ms"] == pytest.approx(f["gemm_ms"] + f["bytes_ms"])
    # Every query row meets every key: quadratic in T, linear in B and H, the products
    # linear in d.
    g = lb.dcformer_floor_ms(batch=4, heads=32, seq=8192, dh=64)
    h = lb.dcformer_floor_ms(batch=8, heads=32, seq=4096, dh=128)
    assert g["bytes_ms"] == pytest.approx(2 * h["bytes_ms"])
    assert g["gemm_ms"] == pytest.approx(h["gemm_ms"])


def test_the_library_ops_leave_dk_and_dv_to_the_key_kernel():
    base = lb.library_ms(batch=8, heads=32, seq=4096)
    # Linear in B; the backward's scratch zero-fill grows with its chunk, the forward not.
    assert lb.library_ms(batch=16, heads=32, seq=4096)["bwd_ms"] == pytest.approx(2 * base["bwd_ms"])
    wider = lb.library_ms(batch=8, heads=32, seq=4096, backward_chunk=2 * lb.BACKWARD_CHUNK)
    assert wider["fwd_ms"] == base["fwd_ms"] and wider["bwd_ms"] > base["bwd_ms"]
    # No pass over the [B, H, T, d] fp32 dk / dv sums (1.07 GB at the target: 0.26 ms to zero
    # them, 0.39 ms to convert them): the whole backward's ATen traffic, the 512 MiB scratch's
    # zero-fill (0.13 ms) included, is under 0.25 ms.
    assert base["bwd_ms"] < 0.25


def test_the_targets_table_reads_the_profile_and_the_measured_flash_time(tmp_path):
    import json

    from headwise.bench.calibrate import DEFAULT_ESTIMATES

    flash = tmp_path / "targets.json"
    flash.write_text(json.dumps({"rows": [{"target": "dcmha forward + backward", "ms": 1.0,
                                           "baseline": "SDPA flash forward + backward", "baseline_ms": 10.0}]}))
    lines = lb.targets_table(str(DEFAULT_ESTIMATES), flash_json=str(flash))
    text = "\n".join(lines)
    assert "4x SDPA flash fwd + bwd (MEASURED x 4)" in text and "40.00" in text
    assert "DCFormer formulation, floor" in text
    total = next(ln for ln in lines if ln.startswith("forward + backward")).split()[-3:]
    fwd = next(ln for ln in lines if ln.startswith("forward ") and "+" not in ln).split()[-3:]
    bwd = next(ln for ln in lines if ln.startswith("backward")).split()[-3:]
    assert [float(t) for t in total] == pytest.approx([float(a) + float(b) for a, b in zip(fwd, bwd)], abs=0.011)
    assert lb.measured_flash_ms(str(tmp_path / "absent.json")) is None


def test_the_chunks_are_the_launchers_under_its_scratch_cap():
    # At the target (B = 8, one group of H = 32, T = 4096): the forward's 4 words a (t, s)
    # take 512 KiB a query row, so 1024 rows under 512 MiB; the backward's 8 words 512 rows;
    # the TF32 path's 64-bit words half of each.
    assert (lb.FORWARD_CHUNK, lb.BACKWARD_CHUNK) == (1024, 512)
    assert lb.forward_chunk_rows(word_bytes=8) == 512 and lb.backward_chunk_rows(word_bytes=8) == 256
    # A multiple of 64 rows, at least 64 however large a row, at most T rounded up to 64.
    assert lb.chunk_rows(seq=4096, row_bytes=1 << 40) == 64
    assert lb.chunk_rows(seq=150, row_bytes=1) == 192
    assert lb.backward_chunk_rows(batch=8, seq=4096, cap=1) == 64
    # The forward's split statistics (B H 2 fp32 a 64-key split and row) bound it too: at
    # H = 1024 in one group they take 512 KiB a row, the scratch 64 KiB.
    assert lb.chunk_rows(4096, 4 * 4096 * 4) == 4096
    assert lb.forward_chunk_rows(batch=1, heads=1024, seq=4096, groups=1) == 1024


def test_the_scratch_cap_is_the_kernels():
    # SCRATCH_BYTES and the sizes of the chunk formulas mirror the kernels' constants, which
    # the launcher reads (dcmha_launch.h).
    import re

    from headwise.bench.checkout import ROOT

    header = ROOT / "csrc" / "dcmha" / "dcmha_attention_mma_kernel.cuh"
    if not header.exists():
        pytest.skip("no csrc/ in this checkout")
    fwd, bwd = header.read_text(), header.with_name("dcmha_attention_mma_bwd_kernel.cuh").read_text()
    m = re.search(r"constexpr int64_t kScratchBytes = int64_t\((\d+)\) << (\d+);", fwd)
    assert m, "kScratchBytes not found"
    assert int(m.group(1)) << int(m.group(2)) == lb.SCRATCH_BYTES
    for text, name, value in ((fwd, "kTileRows", lb.TILE_ROWS), (fwd, "kStatsSplitKeys", lb.STATS_SPLIT_KEYS),
                              (fwd, "kFwdPartWords", lb.FORWARD_PART_WORDS),
                              (bwd, "kBwdPartFields", 2 * lb.BACKWARD_PART_WORDS)):
        m = re.search(rf"constexpr int {name} = (\d+);", text)
        assert m and int(m.group(1)) == value, name
    assert "constexpr int kBwdPartWords = kBwdPartFields / 2;" in bwd


def test_the_row_and_key_grids_now_run_heads_fastest():
    # The heads of a tile are adjacent in block order (they share its scratch words); the
    # grids before ran every tile of a head first.
    assert lb.row_ctas(range(0, 128), batch=1, heads=3) == [2, 2, 2, 4, 4, 4]
    assert lb.row_ctas(range(0, 128), batch=1, heads=3, heads_fastest=False) == [2, 4, 2, 4, 2, 4]
    assert lb.key_ctas(range(0, 128), batch=1, heads=2, seq=128) == [4, 4, 2, 2]
    assert lb.key_ctas(range(0, 128), batch=1, heads=2, seq=128, heads_fastest=False) == [4, 2, 4, 2]
    now, before = lb.backward_cases(batch=1, heads=3, seq=256, chunk=128)["now"], lb.backward_cases(
        batch=1, heads=3, seq=256, chunk=128)["splits"]
    assert now["dcmha_attn_bwd_dkv"] == [lb.key_ctas(range(c, c + 128), 1, 3, 256) for c in (0, 128)]
    assert before["dcmha_attn_bwd_dq"] == [lb.row_ctas(range(c, c + 128), 1, 3, heads_fastest=False) for c in (0, 128)]
