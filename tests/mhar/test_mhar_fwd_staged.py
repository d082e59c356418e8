"""The MHAR forward's staged kernel (csrc/mhar/mhar_fwd_staged_kernel.cuh): the launcher
takes it for 16-bit sources on the 16-byte path with heads within a warp; it agrees with
the streaming kernel (HEADWISE_MHAR_FWD_STAGED=0) and the reference, and its copies and
shared-memory reads are at the ideal."""

import importlib.util
import math

import pytest
import torch

from headwise import reference
from headwise.testing import profiled_launches, rel_err

from test_mhar_route import make_inputs

# (N, B, T, d, H): heads of kv = d / (8 H) vectors, every layout the staged kernel takes.
SHAPES = [
    pytest.param(9, 2, 5, 4096, 8, id="N9-d4096-H8-kv64-warp-heads"),
    pytest.param(8, 1, 3, 1024, 2, id="N8-d1024-H2-kv64-even-N"),
    pytest.param(9, 1, 3, 1024, 8, id="N9-d1024-H8-kv16-segments"),
    pytest.param(5, 1, 37, 96, 3, id="N5-T37-d96-H3-kv4-partial-item"),
    pytest.param(3, 1, 2, 512, 64, id="N3-d512-H64-kv1"),
    pytest.param(1, 1, 3, 512, 1, id="N1-d512-H1-kv64"),
    # 10 commit groups a position: more than cp.async.wait_group's clamp of 7 newer ones.
    pytest.param(19, 1, 2, 512, 2, id="N19-d512-H2-kv32-ten-groups"),
    # More positions than the 1024 blocks: each block's next position is copied during
    # its current one, across (b, t) rows in the second case.
    pytest.param(2, 1, 1100, 256, 1, id="N2-T1100-d256-kv32-blocks-loop"),
    pytest.param(3, 200, 7, 128, 2, id="N3-B200-T7-d128-kv8-blocks-loop-rows"),
    pytest.param(17, 1, 1030, 16, 1, id="N17-T1030-d16-kv2-nine-groups-blocks-loop"),
    pytest.param(1, 1, 1030, 16, 2, id="N1-T1030-d16-kv1-blocks-loop"),
    # More rows than lanes: rows_r's chunks of 32 rows (a new one at n0 = 32, 64; the last
    # group of 1 row).
    pytest.param(33, 1, 3, 512, 1, id="N33-d512-H1-kv64-two-r-chunks"),
    pytest.param(65, 1, 2, 512, 1, id="N65-d512-H1-kv64-three-r-chunks"),
    # 512 threads: 16 warps' sums a row (rows_r adds all 16, none zero).
    pytest.param(5, 1, 2, 8192, 16, id="N5-d8192-H16-kv64-sixteen-warps"),
    # 72 vectors: the second warp holds 8 (its other lanes and second item absent).
    pytest.param(3, 1, 3, 576, 9, id="N3-d576-H9-kv8-partial-second-warp"),
]


def route(backend, sources, query, norm_weight, h, *, residual=None, gate=None):
    return getattr(torch.ops, backend.ns).mhar_route(sources, query, norm_weight, h, sources.shape[0], 1e-6, residual, gate)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,b,t,d,h", SHAPES)
def test_staged_matches_streaming_and_reference(kernel_backend, monkeypatch, dtype, n, b, t, d, h):
    qscale = min(0.3, 1.5 / math.sqrt(d // h))
    sources, query, norm_weight = make_inputs(n, b, t, d, dtype=dtype, device=kernel_backend.device, qscale=qscale)
    out, weights = route(kernel_backend, sources, query, norm_weight, h)
    monkeypatch.setenv("HEADWISE_MHAR_FWD_STAGED", "0")
    stream_out, stream_weights = route(kernel_backend, sources, query, norm_weight, h)
    cpu_out, cpu_weights = torch.ops.headwise.mhar_route(sources.cpu(), query.cpu(), norm_weight.cpu(), h, n, 1e-6,
                                                         None, None)
    # The same fp32 math as the streaming and CPU kernels in another reduction order (often
    # the streaming kernel's very bits; bf16 warp heads also carry q g to 2^-17 on tensor
    # cores: test_tensor_core_logits_sum_exact_products). A last-bit change of
    # r_n can move an element of u = round(s r) across a rounding boundary of the storage
    # dtype (2^-8 relative in bf16, 2^-11 in fp16), its logit by that times |u q g| and a
    # weight by up to ~2e-4 at these shapes; the outputs round once from fp32 sums.
    assert rel_err(weights, stream_weights) <= 5e-4
    assert rel_err(weights.cpu(), cpu_weights) <= 5e-4
    assert rel_err(out, stream_out) <= 2 ** -7
    assert rel_err(out, reference.mhar_route(sources, query, norm_weight, num_heads=h)) <= 2 ** -7


@pytest.mark.parametrize("qg_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,t,h", [(9, 3, 8), (8, 3, 2), (3, 3, 1), (3, 1030, 1)],
                         ids=["N9-H8", "N8-H2-even", "N3-H1", "N3-T1030-H1-blocks-loop"])
def test_tensor_core_logits_sum_exact_products(kernel_backend, monkeypatch, qg_dtype, n, t, h):
    """bf16 heads of 64 vectors take their logits on tensor cores, q g as bf16 hi + lo parts
    (the 2-row and the odd N's 1-row forms; more positions than blocks in the last case).
    Sources of dyadic values make every row's sum of squares exact, so the staged and
    streaming kernels form the same r and u = round(s r) and differ only in how they sum
    u q g: by order alone (~1e-7) when q and g are bf16 (hi + lo hold q g exactly), by q g's
    2^-17 relative remainder beside it for fp32 q, g."""
    b, d = 1, 512 * h
    gen = torch.Generator().manual_seed(5)
    values = torch.tensor([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0])
    sources = values[torch.randint(0, 6, (n, b, t, d), generator=gen)].to(torch.bfloat16).to(kernel_backend.device)
    query = (torch.randn(d, generator=gen) * 0.06).to(qg_dtype).to(kernel_backend.device)
    norm_weight = (1.0 + 0.1 * torch.randn(d, generator=gen)).to(qg_dtype).to(kernel_backend.device)
    out, weights = route(kernel_backend, sources, query, norm_weight, h)
    monkeypatch.setenv("HEADWISE_MHAR_FWD_STAGED", "0")
    stream_out, stream_weights = route(kernel_backend, sources, query, norm_weight, h)
    assert rel_err(weights, stream_weights) <= (2e-6 if qg_dtype == torch.bfloat16 else 3e-5)
    assert rel_err(out, stream_out) <= 2 ** -7
    if qg_dtype == torch.float32:
        # q g's lo part rounds: the staged kernel ran (the streaming one has no such term).
        assert not torch.equal(weights, stream_weights)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,b,t,d,h", [(4, 2, 5, 1024, 2), (3, 1, 1030, 64, 4)],
                         ids=["kv64", "kv2-blocks-loop"])
@pytest.mark.parametrize("gate_value", [None, 0.0, -0.7])
def test_staged_with_residual_and_gate(kernel_backend, gate_value, n, b, t, d, h, dtype):
    sources, query, norm_weight = make_inputs(n, b, t, d, dtype=dtype, device=kernel_backend.device, qscale=0.05)
    residual = torch.randn(b, t, d, generator=torch.Generator().manual_seed(3)).to(dtype).to(kernel_backend.device)
    gate = None if gate_value is None else torch.tensor(gate_value, device=kernel_backend.device)
    out, _ = route(kernel_backend, sources, query, norm_weight, h, residual=residual, gate=gate)
    want = reference.mhar_route(sources, query, norm_weight, num_heads=h, residual=residual, gate=gate)
    assert rel_err(out.float(), want.float()) <= 2 ** -7


def test_staged_reads_strided_sources_in_place(kernel_backend):
    # Sources whose rows are a view with gaps (a depth buffer's first rows).
    n, b, t, d, h = 5, 2, 3, 512, 1
    full, query, norm_weight = make_inputs(n + 2, b, t + 1, d, dtype=torch.bfloat16, device=kernel_backend.device,
                                           qscale=0.05)
    sources = full[:n, :, 1:]
    out, weights = route(kernel_backend, sources, query, norm_weight, h)
    assert rel_err(weights, reference.mhar_route_weights(sources, query, norm_weight, num_heads=h)) <= 1e-4
    assert rel_err(out, reference.mhar_route(sources, query, norm_weight, num_heads=h)) <= 2 ** -7


@pytest.fixture
def profile_ops():
    if importlib.util.find_spec("headwise._sim_profile") is None:
        pytest.skip("headwise._sim_profile not built")
    from headwise.ops import load_profile_library

    return load_profile_library()


def forward_launches(ops, n, b, t, d, h, dtype=torch.bfloat16):
    sources, query, norm_weight = make_inputs(n, b, t, d, dtype=dtype, qscale=0.05)
    _, records = profiled_launches(lambda: ops.mhar_route(sources, query, norm_weight, num_heads=h))
    return records


@pytest.mark.parametrize("n,b,t,d,h,staged", [
    (9, 1, 4, 4096, 8, True),   # heads of 64 vectors (a warp)
    (9, 1, 4, 2048, 8, True),   # heads of 32 vectors (an item's lanes)
    (9, 1, 4, 4096, 4, False),  # heads of 128 vectors span two warps: streaming
    (5, 1, 4, 96, 3, True),
    (5, 1, 4, 123, 3, False),   # 123 is not a multiple of 8: the scalar layout
])
def test_launcher_takes_the_staged_kernel_where_it_applies(profile_ops, n, b, t, d, h, staged):
    names = [r["kernel"] for r in forward_launches(profile_ops, n, b, t, d, h)]
    assert names == ["mhar_route_fwd_staged" if staged else "mhar_route_fwd"]


def test_staged_takes_the_streaming_kernel_when_rows_do_not_fit(profile_ops, monkeypatch):
    # 13 bf16 rows of d = 4096 (104 KiB) fit H100's budget (112 KiB), not an A100's
    # (half its 163 KiB opt-in, less 1 KiB: 2 CTAs an SM).
    assert forward_launches(profile_ops, 13, 1, 2, 4096, 8)[0]["kernel"] == "mhar_route_fwd_staged"
    monkeypatch.setenv("HEADWISE_SIM_SMEM_OPTIN", "166912")
    assert forward_launches(profile_ops, 13, 1, 2, 4096, 8)[0]["kernel"] == "mhar_route_fwd"
    assert forward_launches(profile_ops, 9, 1, 2, 4096, 8)[0]["kernel"] == "mhar_route_fwd_staged"


def test_staged_memory_metrics(profile_ops):
    # Every source byte is read once (unique = the rows; L2 sectors = unique, since every
    # copy is a whole 16-byte chunk of a warp's 512 contiguous bytes), loads at the ideal
    # sectors per request, shared memory at the ideal wavefronts per request.
    n, b, t, d, h = 9, 1, 8, 4096, 8
    (rec,) = forward_launches(profile_ops, n, b, t, d, h)
    assert rec["kernel"] == "mhar_route_fwd_staged"
    assert rec["global_load_sectors"] <= 1.1 * rec["global_load_sectors_ideal"]
    assert rec["global_store_sectors"] <= 1.1 * rec["global_store_sectors_ideal"]
    assert rec["smem_wavefronts"] <= 1.1 * rec["smem_wavefronts_ideal"]
    source_bytes = n * b * t * d * 2
    assert rec["unique_load_bytes"] <= 1.05 * (source_bytes + 2 * d * 4)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_staged_non_finite_sources_propagate_like_the_streaming_kernel(kernel_backend, monkeypatch, bad):
    # The policy of tests/robustness (README): a non-finite element makes its position's
    # outputs non-finite; other positions are unaffected.
    n, b, t, d, h = 9, 2, 3, 1024, 2
    sources, query, norm_weight = make_inputs(n, b, t, d, dtype=torch.bfloat16, device=kernel_backend.device)
    sources[3, 1, 2, 17] = bad
    out, weights = route(kernel_backend, sources, query, norm_weight, h)
    monkeypatch.setenv("HEADWISE_MHAR_FWD_STAGED", "0")
    stream_out, stream_weights = route(kernel_backend, sources, query, norm_weight, h)
    assert torch.equal(torch.isfinite(out), torch.isfinite(stream_out))
    assert torch.equal(torch.isfinite(weights), torch.isfinite(stream_weights))
    assert not torch.isfinite(out[1, 2]).all() and torch.isfinite(out[0]).all() and torch.isfinite(out[1, :2]).all()
