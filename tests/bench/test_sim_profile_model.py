"""The H200 estimate model of headwise.bench.sim_profile and the ptxas report parser, on
hand-made inputs (the emulated counts themselves: tests/simt/test_sim_profile.py)."""

import os

import pytest

from headwise.bench import ptxas
from headwise.bench.sim_profile import H200, OPS, ctas_per_sm, estimate

REPORT = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'void headwise::mhar::mhar_route_fwd_kernel<c10::BFloat16, 8, 1, 0>(headwise::mhar::FwdParams)' for 'sm_90'
ptxas info    : Function properties for void headwise::mhar::mhar_route_fwd_kernel<c10::BFloat16, 8, 1, 0>(headwise::mhar::FwdParams)
0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 100 registers, used 1 barriers, 432 bytes cmem[0]
ptxas info    : Compiling entry function 'void headwise::mhar::mhar_route_fwd_kernel<c10::BFloat16, 8, 1, 1>(headwise::mhar::FwdParams)' for 'sm_90'
ptxas info    : Function properties for void headwise::mhar::mhar_route_fwd_kernel<c10::BFloat16, 8, 1, 1>(headwise::mhar::FwdParams)
0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 96 registers, used 1 barriers, 432 bytes cmem[0]
ptxas info    : Compiling entry function 'void headwise::mhar::mhar_route_fwd_kernel<float, 1, 4, 0>(headwise::mhar::FwdParams)' for 'sm_90'
ptxas info    : Function properties for void headwise::mhar::mhar_route_fwd_kernel<float, 1, 4, 0>(headwise::mhar::FwdParams)
112 bytes stack frame, 112 bytes spill stores, 180 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 432 bytes cmem[0]
ptxas info    : Compiling entry function 'void headwise::merge::head_merge_fwd_kernel<c10::BFloat16>(headwise::merge::FwdParams)' for 'sm_90'
ptxas info    : Function properties for void headwise::merge::head_merge_fwd_kernel<c10::BFloat16>(headwise::merge::FwdParams)
0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 58 registers, used 1 barriers, 16384 bytes smem, 400 bytes cmem[0]
ptxas info    : Compiling entry function 'headwise::mhar::mhar_param_grad_reduce_kernel(const float *, int)' for 'sm_90'
ptxas info    : Used 30 registers, used 0 barriers, 400 bytes cmem[0]
"""


def test_ptxas_parse_and_lookup():
    reports = ptxas.parse(REPORT)
    assert [r.name for r in reports] == ["mhar_route_fwd_kernel"] * 3 + ["head_merge_fwd_kernel",
                                                                         "mhar_param_grad_reduce_kernel"]
    spill = reports[2]
    assert (spill.registers, spill.stack, spill.spill_stores, spill.spill_loads) == (64, 112, 112, 180)
    assert reports[3].static_smem == 16384 and reports[3].registers == 58
    # The bf16 instantiation with the most registers; a kernel not templated on the dtype.
    assert ptxas.lookup(reports, "mhar_route_fwd", "bfloat16").registers == 100
    assert ptxas.lookup(reports, "mhar_route_fwd", "float32").registers == 64
    assert ptxas.lookup(reports, "mhar_param_grad_reduce", "bfloat16").registers == 30
    assert ptxas.lookup(reports, "head_merge_bwd_dz", "bfloat16") is None


def test_ptxas_report_per_arch_lists_a_kernel_of_two_units_once(tmp_path):
    # The log of a build whose two translation units both compiled one template kernel, each
    # for sm_80 then sm_90 (nvcc's order per unit): one entry per kernel and arch, every arch kept.
    entry = ("ptxas info    : Compiling entry function '{fn}' for '{sm}'\n"
             "ptxas info    : Function properties for {fn}\n"
             "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
             "ptxas info    : Used {regs} registers, used 1 barriers, 400 bytes cmem[0]\n")
    shared = "void headwise::mhar::mhar_route_bwd_kernel<float, float, 8, 2, 1, true, 0>(headwise::mhar::BwdParams)"
    own = ["void headwise::mhar::mhar_route_fwd_kernel<float, 8, 2, 1>(headwise::mhar::FwdParams)",
           "headwise::mhar::mhar_param_grad_reduce_kernel(const float *, int)"]
    log = "".join(entry.format(fn=fn, sm=sm, regs=regs)
                  for unit in range(2) for sm, regs in (("sm_80", 80), ("sm_90", 90))
                  for fn in (shared, own[unit]))
    paths = ptxas._write_per_arch(log, "test", str(tmp_path))
    assert sorted(os.path.basename(p) for p in paths) == ["ptxas_sm80.txt", "ptxas_sm90.txt"]
    for arch, regs in (("80", 80), ("90", 90)):
        reports = ptxas.load(arch, str(tmp_path))
        assert [r.function for r in reports] == [shared, own[0], own[1]]
        assert {r.arch for r in reports} == {f"sm_{arch}"} and {r.registers for r in reports} == {regs}


def test_ctas_per_sm():
    # 512 threads x 100 registers: 3200 registers per warp (a multiple of 256), 20 warps
    # fit in 65536, a CTA needs 16: one CTA.
    assert ctas_per_sm(512, 100, 0) == 1
    assert ctas_per_sm(512, 64, 0) == 2       # 2048 threads per SM
    assert ctas_per_sm(128, 64, 0) == 8       # registers: 64 warps / 4
    assert ctas_per_sm(128, None, 0) == 16    # threads only
    assert ctas_per_sm(128, 56, 66_800) == 3  # (66800 + 1024 reserved) x 3 <= 228 KiB
    assert ctas_per_sm(32, 16, 0) == H200.max_ctas_per_sm


def record(**kw):
    rec = dict(ctas=10_000, ctas_per_sm=1, bytes_in_flight_per_cta=0.0, unique_bytes=0, l2_sectors=0,
               smem_wavefronts=0, mma=0)
    rec.update(kw)
    return rec


def test_estimate_terms():
    gb = 4.1e9  # 1 ms of HBM at 4.1 TB/s
    # Enough bytes in flight: the HBM term binds.
    e = estimate(record(unique_bytes=gb, bytes_in_flight_per_cta=64 * 1024), 0.0)
    assert e["est_bound"] == "hbm" and e["est_us"] == pytest.approx(1000.0)
    # A quarter of the bytes in flight that the latency needs: four times the HBM time.
    need_per_sm = H200.bytes_in_flight_needed / H200.sms
    e = estimate(record(unique_bytes=gb, bytes_in_flight_per_cta=need_per_sm / 4), 0.0)
    assert e["est_bound"] == "lat" and e["est_us"] == pytest.approx(4000.0)
    assert e["bytes_in_flight_per_sm"] == pytest.approx(need_per_sm / 4)
    # The grid caps the resident CTAs: 33 CTAs of 4 x the per-SM need = the GPU's need.
    e = estimate(record(ctas=33, unique_bytes=gb, bytes_in_flight_per_cta=4 * need_per_sm), 0.0)
    assert e["hbm_share"] == pytest.approx(1.0)
    # FP32 and shared-memory terms.
    e = estimate(record(), 67e9)
    assert e["est_bound"] == "fp32" and e["est_us"] == pytest.approx(1000.0)
    wavefronts = H200.sms * H200.clock_hz * 1e-3
    e = estimate(record(smem_wavefronts=wavefronts), 0.0)
    assert e["est_bound"] == "smem" and e["est_us"] == pytest.approx(1000.0)
    # Round trips: 10,000 CTAs of 2 resident a SM, 100 load rounds each, one L2 latency a round.
    e = estimate(record(ctas_per_sm=2, load_rounds=10_000 * 100), 0.0)
    waves = 10_000 / (2 * H200.sms)
    assert e["est_bound"] == "rtt" and e["est_us"] == pytest.approx(1e6 * waves * 100 * H200.l2_round_trip_s)


@pytest.mark.parametrize("key", list(OPS))
def test_op_specs_fit_exactly(key):
    """As many profiled shapes as basis functions, and the basis is invertible on them."""
    import numpy as np

    spec = OPS[key]
    a = np.array([spec.basis(s) for s in spec.shapes])
    assert a.shape == (len(spec.shapes), len(spec.shapes))
    assert np.linalg.matrix_rank(a) == len(spec.shapes)
    assert set(spec.min_bytes(spec.target)) == set(spec.flops(spec.target))


REQUIRED = ["kernel", "op", "shape", "dtype", "global_load_requests", "global_load_sectors",
            "global_load_sectors_ideal", "global_store_requests", "global_store_sectors",
            "global_store_sectors_ideal", "unique_bytes", "l2_sectors", "smem_requests", "smem_wavefronts", "mma",
            "ldmatrix", "cp_async_bytes", "barriers", "ctas_per_sm", "bytes_in_flight_per_sm", "min_bytes",
            "min_flops", "est_us", "est_bound"]


def test_sim_profile_cli_json(tmp_path, monkeypatch, capsys):
    """The --sim-profile path end to end, on MHAR at tiny shapes (fitted to a small target)."""
    import dataclasses
    import importlib.util
    import json

    from headwise.bench import __main__ as bench_main
    from headwise.bench import sim_profile

    if importlib.util.find_spec("headwise._sim_profile") is None:
        pytest.skip("headwise._sim_profile not built")
    tiny = dataclasses.replace(sim_profile.OPS["mhar"], shapes=[dict(N=3, B=1, T=t, d=64, H=4) for t in (2, 3)],
                               target=dict(N=3, B=2, T=8, d=64, H=4))
    monkeypatch.setitem(sim_profile.OPS, "mhar", tiny)
    out = tmp_path / "p.json"
    assert bench_main.main(["--sim-profile", "mhar", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "ESTIMATE" in text and "mhar_route_fwd_staged" in text
    data = json.loads(out.read_text())
    assert data["gpu_model"]["hbm_bytes_per_s"] == sim_profile.H200.hbm_bytes_per_s
    kernels = {(r["op"], r["kernel"]) for r in data["launches"]}
    # bf16 heads of 2 vectors: the staged kernels (mhar_fwd_staged_kernel.cuh,
    # mhar_bwd_staged_kernel.cuh).
    assert kernels == {("mhar_route fwd", "mhar_route_fwd_staged"), ("mhar_route bwd", "mhar_route_bwd_staged"),
                       ("mhar_route bwd", "mhar_param_grad_reduce")}
    for rec in data["launches"] + data["targets"]:
        assert not [k for k in REQUIRED if k not in rec], rec["kernel"]
        assert rec["est_us"] > 0 and rec["shape"]["d"] == 64
    fwd = next(r for r in data["targets"] if r["kernel"] == "mhar_route_fwd_staged")
    # The fit at B*T = 16 positions: each source row read once, so at least N*B*T*d*2 bytes.
    assert fwd["shape"]["T"] == 8 and fwd["ctas"] == 16
    assert fwd["unique_load_bytes"] >= 3 * 16 * 64 * 2


def test_each_op_marks_before_forward_and_backward():
    # headwise.bench.calibrate times a phase between two take() marks: every run function
    # takes once before its op, then once after each phase, in order (checked on the CPU
    # kernels at the smallest profiled shape).
    from headwise.bench.calibrate import estimates_by_phase
    from headwise.bench.sim_profile import OPS
    from headwise.testing import backend

    for key, spec in OPS.items():
        marks = []

        def take():
            marks.append(len(marks))
            return marks[-1]

        shape = min(spec.shapes, key=lambda s: sorted(s.values()))
        phases = spec.run(backend("cpu"), shape, take, "cpu")
        assert list(phases.values()) == list(range(1, len(marks))), key
    targets = [dict(op="mhar_route fwd", kernel="a", est_us=2.0, est_bound="hbm"),
               dict(op="mhar_route bwd", kernel="b", est_us=3.0, est_bound="lat"),
               dict(op="mhar_route bwd", kernel="c", est_us=4.0, est_bound="hbm")]
    est = estimates_by_phase(targets)
    assert est[("mhar_route", "fwd")][0] == 2.0 and est[("mhar_route", "bwd")][0] == 7.0


def test_issue_term_and_launch_instantiation(tmp_path):
    """The issue term: mma.sync count x instructions per HMMA of the kernel's steady
    K-loop iteration over the calibrated issue rate; LAUNCH_FUNCTIONS picks the exact
    instantiation a launch name runs at the target shapes, in the ptxas and sass reports."""
    from headwise.bench import sass
    from headwise.bench.sim_profile import LAUNCH_FUNCTIONS, launch_report

    rec = {"ctas": 4096, "ctas_per_sm": 2, "bytes_in_flight_per_cta": 1 << 14, "unique_bytes": 0,
           "l2_sectors": 0, "smem_wavefronts": 0, "mma": 1_000_000, "issue_per_hmma": 6.0}
    rate = H200.sms * H200.issue_per_clock_per_sm * H200.clock_hz * H200.issue_efficiency
    est = estimate(rec, 0.0)
    assert est["est_terms_us"]["issue"] == pytest.approx(1e6 * 6.0e6 / rate)
    assert est["est_bound"] == "issue"  # 6 instructions per HMMA outrun the mma ceiling
    assert estimate(dict(rec, issue_per_hmma=None), 0.0)["est_terms_us"]["issue"] == 0.0

    fn = "void headwise::merge::tc::head_merge_fwd_tc_kernel<c10::BFloat16, {}, {}>(headwise::merge::tc::TcFwdParams)"
    reports = [sass.IssueReport(fn.format(w, s), per, 100, 32)
               for w, s, per in ((16, "false", 5.5), (4, "false", 10.5), (16, "true", 6.0))]
    sass.write(reports, ["merge"], "90", "test", str(tmp_path))
    loaded = sass.load("90", str(tmp_path))
    assert sorted(r.issue_per_hmma for r in loaded) == [5.5, 6.0, 10.5]
    assert LAUNCH_FUNCTIONS["head_merge_fwd_tc"] == ("head_merge_fwd_tc_kernel", "16, false")
    pick = launch_report(loaded, "head_merge_fwd_tc", "bfloat16", key=lambda r: r.issue_per_hmma)
    assert pick.issue_per_hmma == 5.5  # the 16-byte copies, not the worst (4-byte) instantiation
    assert launch_report(loaded, "head_merge_stats_tc", "bfloat16", key=lambda r: 0).issue_per_hmma == 6.0
    assert launch_report(loaded, "head_merge_fwd_tc", "float16", key=lambda r: 0) is None
    # A (launch, dtype) entry overrides the launch's: fp32's rowsum runs one head a CTA.
    rows = "void headwise::dcmha::dcmha_attn_bwd_rows<{}, false, 4, {}>(headwise::dcmha::MmaAttnBwdParams)"
    reports = [sass.IssueReport(rows.format(t, h), per, 100, 32)
               for t, h, per in (("c10::BFloat16", 2, 7.0), ("float", 1, 7.5), ("float", 2, 9.0))]
    assert launch_report(reports, "dcmha_attn_bwd_rowsum", "bfloat16", key=lambda r: 0).issue_per_hmma == 7.0
    assert launch_report(reports, "dcmha_attn_bwd_rowsum", "float32", key=lambda r: 0).issue_per_hmma == 7.5


def test_gemm_rows_carry_the_ops_dtype_and_refuse_fp32(monkeypatch):
    import dataclasses

    from headwise.bench import sim_profile as sp

    # qkv is the op whose cuBLAS GEMMs the profile adds analytically.
    rows = sp.gemm_rows("qkv")
    assert rows and all(r["dtype"] == sp.OPS["qkv"].dtype for r in rows)
    monkeypatch.setitem(sp.OPS, "qkv", dataclasses.replace(sp.OPS["qkv"], dtype="float32"))
    with pytest.raises(ValueError, match="16-bit"):
        sp.gemm_rows("qkv")
    assert sp.gemm_rows("dcmha_tf32") == []  # no library GEMM in the fused attention


def test_every_launch_function_is_in_the_committed_tables():
    # LAUNCH_FUNCTIONS names the exact instantiation of each launch; the committed ptxas and
    # SASS tables (bench/) must hold it, or the profile silently loses registers and the
    # issue term when a kernel's template arguments change.
    from headwise.bench import ptxas, sass
    from headwise.bench.sim_profile import LAUNCH_FUNCTIONS, launch_report

    regs, loops = ptxas.load("90"), sass.load("90")
    if not regs or not loops:
        pytest.skip("no bench/ tables in this checkout")
    for key in LAUNCH_FUNCTIONS:
        kernel, dtype = key if isinstance(key, tuple) else (key, "bfloat16")
        assert launch_report(regs, kernel, dtype, key=lambda r: 0) is not None, (kernel, dtype, "ptxas")
        assert launch_report(loops, kernel, dtype, key=lambda r: 0) is not None, (kernel, dtype, "sass")
