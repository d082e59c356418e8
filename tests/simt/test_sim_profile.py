"""Memory metrics of the profile library headwise._sim_profile (csrc/common/simt/
simt_metrics.h) on kernels with known access patterns (csrc/common/simt/
simt_metrics_selftest.cpp), and the profile library's ops against headwise_sim's."""

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from headwise.testing import backend, profiled_launches as launches
from headwise.ops import load_profile_library

BUILT = importlib.util.find_spec("headwise._sim_profile") is not None  # not with HEADWISE_SIM_PROFILE=0
PROFILE_OPS = load_profile_library() if BUILT else None
pytestmark = pytest.mark.skipif(not BUILT, reason="headwise._sim_profile not built")

SECTOR = 32


def test_not_loaded_by_default():
    code = "import sys, headwise; print('headwise._sim_profile' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_nothing_recorded_while_disabled():
    torch.ops.headwise_sim_profile.sim_profile_take()
    torch.ops.headwise_sim_profile_test.copy(torch.arange(256.0))
    assert json.loads(torch.ops.headwise_sim_profile.sim_profile_take()) == []


def test_coalesced_copy_is_4_sectors_per_request():
    n = 4096
    x = torch.arange(n, dtype=torch.float32)
    out, (rec,) = launches(lambda: torch.ops.headwise_sim_profile_test.copy(x))
    assert torch.equal(out, x)
    warps = n // 32
    assert rec["kernel"] == "metrics_copy" and rec["ctas"] == n // 256
    for kind in ("load", "store"):
        assert rec[f"global_{kind}_requests"] == warps
        assert rec[f"global_{kind}_sectors"] == 4 * warps
        assert rec[f"global_{kind}_sectors_ideal"] == 4 * warps
        assert rec[f"unique_{kind}_bytes"] == 4 * n
    assert rec["unique_bytes"] == 8 * n
    assert rec["l2_sectors"] == 8 * warps
    assert rec["smem_requests"] == 0 and rec["barriers"] == 0
    assert rec["mma"] == 0 and rec["ldmatrix"] == 0 and rec["cp_async_bytes"] == 0
    # One load per thread, all in flight together: 256 threads x 4 bytes.
    assert rec["bytes_in_flight_per_cta"] == 256 * 4
    # ... in one round trip per CTA.
    assert rec["load_rounds"] == rec["ctas"]


def test_vector_copy_is_16_sectors_per_request():
    """8 bf16 per lane through common/vec.cuh: one 16-byte access per lane, as on the GPU
    (not 8 two-byte accesses, as g++'s split struct copy would be)."""
    n = 8 * 1024
    x = torch.randn(n).bfloat16()
    out, (rec,) = launches(lambda: torch.ops.headwise_sim_profile_test.copy_vec8(x))
    assert torch.equal(out, x)
    warps = n // 8 // 32
    for kind in ("load", "store"):
        assert rec[f"global_{kind}_requests"] == warps
        assert rec[f"global_{kind}_sectors"] == rec[f"global_{kind}_sectors_ideal"] == 16 * warps


def test_strided_copy_touches_a_sector_per_lane():
    stride, n_out = 32, 1024
    x = torch.arange(stride * n_out, dtype=torch.float32)
    out, (rec,) = launches(lambda: torch.ops.headwise_sim_profile_test.copy(x, stride))
    assert torch.equal(out, x[::stride])
    warps = n_out // 32
    assert rec["global_load_requests"] == warps
    assert rec["global_load_sectors"] == 32 * warps
    assert rec["global_load_sectors_ideal"] == 4 * warps
    assert rec["unique_load_bytes"] == SECTOR * n_out
    assert rec["global_store_sectors"] == 4 * warps
    worst = rec["lines"][0]
    assert (worst["space"], worst["access"]) == ("global", "load")
    assert worst["sectors"] == 32 * worst["requests"] and worst["sectors_ideal"] == 4 * worst["requests"]


@pytest.mark.parametrize("dynamic_smem", [False, True], ids=["static_smem", "dynamic_smem"])
@pytest.mark.parametrize("padded,wavefronts", [(False, 32), (True, 1)], ids=["pitch32", "pitch33"])
def test_transpose_bank_conflicts(padded, wavefronts, dynamic_smem):
    tiles = 3
    x = torch.randn(32 * tiles, 32)
    out, (rec,) = launches(lambda: torch.ops.headwise_sim_profile_test.transpose(x, padded, dynamic_smem))
    assert torch.equal(out, x.view(tiles, 32, 32).transpose(1, 2).reshape(32 * tiles, 32))
    warps = 32 * tiles
    assert rec["barriers"] == tiles
    assert rec["global_load_sectors"] == 4 * rec["global_load_requests"] == 4 * warps
    assert rec["global_store_sectors"] == 4 * rec["global_store_requests"] == 4 * warps
    # Per warp: one conflict-free row store, one column read of `wavefronts` wavefronts.
    assert rec["smem_requests"] == 2 * warps
    assert rec["smem_wavefronts"] == (1 + wavefronts) * warps
    shared = {ln["access"]: ln for ln in rec["lines"] if ln["space"] == "shared"}
    assert shared["load"]["wavefronts"] == wavefronts * shared["load"]["requests"] == wavefronts * warps
    assert shared["load"]["wavefronts_ideal"] == warps
    assert shared["store"]["wavefronts"] == shared["store"]["requests"] == warps


def test_profiled_ops_compute_what_headwise_sim_computes():
    gen = torch.Generator().manual_seed(0)
    sources = torch.randn(3, 1, 5, 64, generator=gen)
    query, norm = torch.randn(64, generator=gen), torch.ones(64)
    sim = backend("sim").mhar_route(sources, query, norm, num_heads=4)
    prof, recs = launches(lambda: PROFILE_OPS.mhar_route(sources, query, norm, num_heads=4))
    assert torch.equal(prof, sim)
    assert [r["kernel"] for r in recs] == ["mhar_route_fwd"]
    # Every source row is read once: at least its bytes are unique loads.
    assert recs[0]["unique_load_bytes"] >= sources.numel() * 4
    assert recs[0]["barriers"] > 0


def test_template_kernel_static_shared_is_shared():
    """head_merge's tile kernels are templates with static __shared__ tiles, which both
    emulated libraries instantiate: the profile library must count its own copies as
    shared memory (setup.py: -fno-gnu-unique), with headwise._sim loaded too."""
    z = torch.randn(1, 2, 32, 8)
    w = torch.randn(64, 16)
    y, recs = launches(lambda: PROFILE_OPS.head_merge(z, w))
    assert torch.equal(y, backend("sim").head_merge(z, w))
    (rec,) = [r for r in recs if r["kernel"] == "head_merge_fwd"]
    assert rec["smem_requests"] > 0
    # The only global stores are the output's (the tiles' stores are shared).
    assert rec["global_store_bytes"] == y.numel() * y.element_size()


def test_sample_gemm_counts_one_mma_per_warp_instruction():
    # The tensor-core primitives note their work once per warp instruction
    # (csrc/common/simt/primitives.h): a 128 x 128 x 64 GEMM, exactly one 128 x 128 CTA tile
    # of sample_gemm, is (128/16) (128/8) (64/16) = 512 m16n8k16 MMAs, and every A and B
    # element reaches shared memory through cp.async (2 x 128 x 64 bf16 = 32 KiB).
    a = torch.randn(128, 64, dtype=torch.bfloat16)
    b = torch.randn(128, 64, dtype=torch.bfloat16)
    out, recs = launches(lambda: torch.ops.headwise_sim_profile.sample_gemm(a, b))
    torch.testing.assert_close(out.float(), a.float() @ b.float().T, rtol=1e-2, atol=1e-2)
    (rec,) = [r for r in recs if r["mma"] > 0]
    assert rec["mma"] == 512
    assert rec["ldmatrix"] > 0 and rec["cp_async_bytes"] == 2 * 128 * 64 * 2
