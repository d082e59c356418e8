"""The MHAR backward's staged kernel (csrc/mhar/mhar_bwd_staged_kernel.cuh): the launcher
takes it for 16-bit sources on the 16-byte path with heads within a warp; it agrees with
mhar_route_bwd_kernel (HEADWISE_MHAR_BWD_STAGED=0), the CPU kernel and the reference,
stores and accumulates into a DepthBuffer's fp32 buffer, and its copies and shared-memory
reads are at the ideal."""

import importlib.util
import math

import pytest
import torch

from headwise import reference
from headwise.testing import profiled_launches, rel_err

from test_mhar_fwd_staged import SHAPES
from test_mhar_route import make_inputs

EPS = 1e-6

# Beyond the forward's shapes: more segments (16 positions each) than the 1024 blocks, so
# a block's next position is the first of its next segment.
BWD_SHAPES = SHAPES + [
    pytest.param(2, 1, 16400, 16, 2, id="N2-T16400-d16-kv1-segments-loop"),
    pytest.param(3, 3, 5471, 64, 1, id="N3-B3-T5471-d64-kv8-segments-loop-rows"),
    # More rows than lanes: the head step's and the r step's second pass over n.
    pytest.param(33, 1, 3, 1024, 2, id="N33-d1024-H2-kv64"),
    pytest.param(35, 1, 3, 64, 8, id="N35-d64-H8-kv1"),
    # A partial last warp whose absent items' heads lie past H (kv = 1, 2).
    pytest.param(3, 1, 5, 520, 65, id="N3-d520-H65-kv1-partial-warp"),
    pytest.param(4, 1, 5, 528, 33, id="N4-d528-H33-kv2-partial-warp"),
]


def ops_of(backend):
    return getattr(torch.ops, backend.ns)


def backward_inputs(n, b, t, d, h, dtype, device, seed=0):
    qscale = min(0.3, 1.5 / math.sqrt(d // h))
    sources, query, norm_weight = make_inputs(n, b, t, d, dtype=dtype, device=device, seed=seed, qscale=qscale)
    weights = reference.mhar_route_weights(sources, query, norm_weight, num_heads=h).float().contiguous()
    grad_out = torch.randn(b, t, d, generator=torch.Generator().manual_seed(seed + 7)).to(dtype).to(device)
    return grad_out, sources, query, norm_weight, weights


def backward(lib, grad_out, sources, query, norm_weight, weights, h, gate=None):
    return lib.mhar_route_backward(grad_out, sources, query, norm_weight, weights, gate, h, sources.shape[0], EPS)


def assert_grads_close(got, want, tol_sources, tol_params):
    # grad_sources, grad_query, grad_norm_weight (and the gate's, where there is one).
    assert rel_err(got[0], want[0]) <= tol_sources
    assert rel_err(got[1], want[1]) <= tol_params
    assert rel_err(got[2], want[2]) <= tol_params
    if want[3] is not None:
        assert rel_err(got[3], want[3]) <= tol_params


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,b,t,d,h", BWD_SHAPES)
def test_staged_backward_matches_unstaged_and_cpu(kernel_backend, monkeypatch, dtype, n, b, t, d, h):
    args = backward_inputs(n, b, t, d, h, dtype, kernel_backend.device)
    lib = ops_of(kernel_backend)
    staged = backward(lib, *args, h)
    monkeypatch.setenv("HEADWISE_MHAR_BWD_STAGED", "0")
    unstaged = backward(lib, *args, h)
    cpu = backward(torch.ops.headwise, *[x.cpu() for x in args], h)
    # The same fp32 math in other reduction orders (a, b, S_h, c_n: warp butterflies where
    # mhar_route_bwd_kernel adds warp sums in smem). grad_sources rounds once to the storage
    # dtype from fp32 (2^-8 relative in bf16); a last-bit change of r_n can move an element
    # of u = round(s r) across a rounding boundary, which moves z (dq, dg) by that times dl.
    for other in (unstaged, cpu):
        assert_grads_close([x.cpu() if x is not None else None for x in staged], other, 2 ** -9, 2e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gate_value", [0.0, -0.7, 1.3])
@pytest.mark.parametrize("n,b,t,d,h", [(4, 2, 5, 1024, 2), (3, 1, 70, 64, 4), (2, 1, 16400, 16, 2)],
                         ids=["kv64", "kv2-segments", "kv1-segments-loop"])
def test_staged_backward_with_gate_matches_cpu(kernel_backend, gate_value, n, b, t, d, h, dtype):
    # The gate scales dl and the dout term, and its gradient is sum_h S_h over positions
    # (per-segment partials, then the fixed-order reduction).
    args = backward_inputs(n, b, t, d, h, dtype, kernel_backend.device)
    gate = torch.tensor(gate_value, device=kernel_backend.device)
    got = backward(ops_of(kernel_backend), *args, h, gate=gate)
    want = backward(torch.ops.headwise, *[x.cpu() for x in args], h, gate=gate.cpu())
    assert_grads_close([x.cpu() for x in got], want, 2 ** -7, 2e-4)


@pytest.mark.parametrize("n,b,t,d,h", [(5, 2, 3, 1024, 2), (4, 1, 37, 96, 3), (2, 1, 16400, 16, 2)],
                         ids=["kv64", "kv4-partial-item", "kv1-segments-loop"])
def test_staged_backward_into_stores_then_accumulates(kernel_backend, n, b, t, d, h):
    # A DepthBuffer's fp32 buffer (G = float): rows [0, N) stored, then added to; the rows
    # above N untouched.
    grad_out, sources, query, norm_weight, weights = backward_inputs(n + 2, b, t, d, h, torch.bfloat16,
                                                                     kernel_backend.device)
    weights = weights[:n].contiguous()
    lib = ops_of(kernel_backend)
    buf = torch.full((n + 2, b, t, d), 7.0, device=kernel_backend.device)
    gq, gg = lib.mhar_route_backward_into(grad_out, sources, query, norm_weight, weights, buf, h, n, EPS, False)
    ds, gq_ref, gg_ref, _ = lib.mhar_route_backward(grad_out, sources, query, norm_weight, weights, None, h, n, EPS)
    assert torch.equal(buf[n:], torch.full_like(buf[n:], 7.0))
    if d // h == 512:
        # bf16 heads of 64 vectors: the plain backward takes pass 1's sums on tensor cores,
        # the fp32 buffer's form the SIMT sums, so the two agree to those sums' rounding.
        assert (buf[:n].to(torch.bfloat16).float() - ds[:n].float()).abs().max() <= 2 ** -8 * ds.float().abs().max()
        assert rel_err(gq, gq_ref) <= 2e-5 and rel_err(gg, gg_ref) <= 2e-5
    else:
        # The same fp32 values: ds is them rounded to bf16.
        assert torch.equal(buf[:n].to(torch.bfloat16), ds[:n])
        assert torch.equal(gq, gq_ref) and torch.equal(gg, gg_ref)
    first = buf.clone()
    lib.mhar_route_backward_into(grad_out, sources, query, norm_weight, weights, buf, h, n, EPS, True)
    assert torch.equal(buf[:n], first[:n] + first[:n]) and torch.equal(buf[n:], first[n:])


@pytest.mark.parametrize("n,b,t,d,h", [(9, 2, 5, 1024, 2), (3, 1, 7, 4096, 8)], ids=["N9-kv64", "N3-d4096-H8"])
def test_tensor_core_products_keep_grad_sources_to_fp32_rounding(kernel_backend, monkeypatch, n, b, t, d, h):
    # bf16 heads of 512 elements: pass 2 takes gate w dout and dl u on tensor cores (the
    # emulator and sm_90+), gate w as 3 bf16 parts (exact products) and dl as 2. Into a
    # DepthBuffer's fp32 rows, ds then differs from mhar_route_bwd_kernel's by fp32
    # rounding (a 2-part gate w gave ~3e-6), dq and dg by dl's 2^-16.
    grad_out, sources, query, norm_weight, weights = backward_inputs(n, b, t, d, h, torch.bfloat16,
                                                                     kernel_backend.device)
    lib = ops_of(kernel_backend)
    got = {}
    for staged in ("1", "0"):
        monkeypatch.setenv("HEADWISE_MHAR_BWD_STAGED", staged)
        buf = torch.zeros(n, b, t, d, device=kernel_backend.device)
        gq, gg = lib.mhar_route_backward_into(grad_out, sources, query, norm_weight, weights, buf, h, n, EPS, False)
        got[staged] = (buf.cpu(), gq.cpu(), gg.cpu())
    assert rel_err(got["1"][0], got["0"][0]) <= 1e-6
    assert rel_err(got["1"][1], got["0"][1]) <= 2e-5 and rel_err(got["1"][2], got["0"][2]) <= 2e-5


def test_staged_backward_is_bitwise_deterministic(kernel_backend):
    args = backward_inputs(9, 2, 40, 1024, 2, torch.bfloat16, kernel_backend.device)
    lib = ops_of(kernel_backend)
    first = backward(lib, *args, 2)
    second = backward(lib, *args, 2)
    assert all(torch.equal(x, y) for x, y in zip(first, second) if x is not None)


def test_staged_backward_reads_strided_sources_in_place(kernel_backend):
    # Sources whose rows are a view with gaps (a depth buffer's first rows).
    n, b, t, d, h = 5, 2, 3, 512, 1
    full, query, norm_weight = make_inputs(n + 2, b, t + 1, d, dtype=torch.bfloat16, device=kernel_backend.device,
                                           qscale=0.05)
    sources = full[:n, :, 1:]
    weights = reference.mhar_route_weights(sources, query, norm_weight, num_heads=h).float().contiguous()
    grad_out = torch.randn(b, t, d).to(torch.bfloat16).to(kernel_backend.device)
    got = backward(ops_of(kernel_backend), grad_out, sources, query, norm_weight, weights, h)
    want = backward(torch.ops.headwise, grad_out.cpu(), sources.contiguous().cpu(), query.cpu(), norm_weight.cpu(),
                    weights.cpu(), h)
    assert_grads_close([x.cpu() if x is not None else None for x in got], want, 2 ** -7, 2e-4)


@pytest.fixture
def profile_ops():
    if importlib.util.find_spec("headwise._sim_profile") is None:
        pytest.skip("headwise._sim_profile not built")
    from headwise.ops import load_profile_library

    load_profile_library()
    return torch.ops.headwise_sim_profile


def backward_launches(lib, n, b, t, d, h, dtype=torch.bfloat16):
    args = backward_inputs(n, b, t, d, h, dtype, "cpu")
    _, records = profiled_launches(lambda: backward(lib, *args, h))
    return records


@pytest.mark.parametrize("n,b,t,d,h,dtype,staged", [
    (9, 1, 4, 4096, 8, torch.bfloat16, True),   # heads of 64 vectors (a warp)
    (9, 1, 4, 2048, 8, torch.float16, True),    # heads of 32 vectors (an item's lanes)
    (9, 1, 4, 4096, 4, torch.bfloat16, False),  # heads of 128 vectors span two warps
    (5, 1, 4, 96, 3, torch.bfloat16, True),
    (5, 1, 4, 123, 3, torch.bfloat16, False),   # 123 is not a multiple of 8: the scalar layout
    (5, 1, 4, 96, 3, torch.float32, False),     # fp32 sources
])
def test_launcher_takes_the_staged_backward_where_it_applies(profile_ops, n, b, t, d, h, dtype, staged):
    names = [r["kernel"] for r in backward_launches(profile_ops, n, b, t, d, h, dtype)]
    assert names == ["mhar_route_bwd_staged" if staged else "mhar_route_bwd", "mhar_param_grad_reduce"]


def test_staged_backward_takes_the_other_kernel_when_rows_do_not_fit(profile_ops, monkeypatch):
    # bf16, d = 4096: N rows, dout and q g take (N + 3) 8 KiB. 10 rows (109 KiB) fit an
    # H100's budget (112 KiB), 11 do not; on an A100 (half its 163 KiB opt-in, less 1 KiB:
    # 2 CTAs an SM) 6 rows fit and 7 do not.
    assert backward_launches(profile_ops, 10, 1, 2, 4096, 8)[0]["kernel"] == "mhar_route_bwd_staged"
    assert backward_launches(profile_ops, 11, 1, 2, 4096, 8)[0]["kernel"] == "mhar_route_bwd"
    monkeypatch.setenv("HEADWISE_SIM_SMEM_OPTIN", "166912")
    assert backward_launches(profile_ops, 7, 1, 2, 4096, 8)[0]["kernel"] == "mhar_route_bwd"
    assert backward_launches(profile_ops, 6, 1, 2, 4096, 8)[0]["kernel"] == "mhar_route_bwd_staged"


def test_staged_backward_memory_metrics(profile_ops):
    # Every source and dout byte is read once (each copy a whole 16-byte chunk of a warp's
    # 512 contiguous bytes), loads and stores at the ideal sectors per request, shared
    # memory at the ideal wavefronts per request.
    n, b, t, d, h = 9, 1, 8, 4096, 8
    rec = backward_launches(profile_ops, n, b, t, d, h)[0]
    assert rec["kernel"] == "mhar_route_bwd_staged"
    assert rec["global_load_sectors"] <= 1.1 * rec["global_load_sectors_ideal"]
    assert rec["global_store_sectors"] <= 1.1 * rec["global_store_sectors_ideal"]
    assert rec["smem_wavefronts"] <= 1.1 * rec["smem_wavefronts_ideal"]
    read_bytes = (n + 1) * b * t * d * 2 + n * b * t * h * 4
    assert rec["unique_load_bytes"] <= 1.05 * (read_bytes + 2 * d * 4)


@pytest.mark.parametrize("n,b,t,d,h,gate_value", [
    (9, 2, 5, 1024, 2, None),
    (33, 1, 3, 1024, 2, -0.7),  # more rows than lanes
    (3, 1, 7, 4096, 8, 1.3),
], ids=["N9-kv64", "N33-kv64-gate", "N3-d4096-H8-gate"])
def test_sm80_simt_products_match_unstaged_and_cpu(profile_ops, monkeypatch, n, b, t, d, h, gate_value):
    # bf16 heads of 64 vectors: sm_80 compiles pass 2's products in the SIMT form, the
    # emulator (like sm_90) the tensor-core form unless HEADWISE_SIM_MHAR_BWD_SIMT_PRODUCTS=1.
    # Both take pass 1's 2-row groups on tensor cores: a warp's group 28 mma, pass 2's
    # tensor-core form 20 a row.
    args = backward_inputs(n, b, t, d, h, torch.bfloat16, "cpu")
    gate = None if gate_value is None else torch.tensor(gate_value)
    run = lambda: backward(profile_ops, *args, h, gate=gate)
    _, tensor_form = profiled_launches(run)
    monkeypatch.setenv("HEADWISE_SIM_MHAR_BWD_SIMT_PRODUCTS", "1")
    got, simt_form = profiled_launches(run)
    assert tensor_form[0]["kernel"] == simt_form[0]["kernel"] == "mhar_route_bwd_staged"
    warp_positions = b * t * (d // 512)
    assert simt_form[0]["mma"] == warp_positions * (n // 2) * 28
    assert tensor_form[0]["mma"] == warp_positions * ((n // 2) * 28 + n * 20)
    # Into a DepthBuffer's fp32 rows (G = float), stored then accumulated.
    buf = torch.zeros(n, b, t, d)
    gq, gg = profile_ops.mhar_route_backward_into(*args, buf, h, n, EPS, False)
    profile_ops.mhar_route_backward_into(*args, buf, h, n, EPS, True)
    monkeypatch.setenv("HEADWISE_MHAR_BWD_STAGED", "0")
    unstaged = backward(profile_ops, *args, h, gate=gate)
    cpu = backward(torch.ops.headwise, *args, h, gate=gate)
    for other in (unstaged, cpu):
        assert_grads_close(got, other, 2 ** -9, 2e-4)
    buf_ref = torch.zeros(n, b, t, d)
    gq_ref, gg_ref = profile_ops.mhar_route_backward_into(*args, buf_ref, h, n, EPS, False)
    profile_ops.mhar_route_backward_into(*args, buf_ref, h, n, EPS, True)
    assert rel_err(buf, buf_ref) <= 1e-6
    assert rel_err(gq, gq_ref) <= 2e-4 and rel_err(gg, gg_ref) <= 2e-4


@pytest.mark.parametrize("n,b,t,d,h", [(9, 2, 5, 1024, 2), (4, 1, 7, 4096, 8), (33, 1, 3, 512, 1)],
                         ids=["N9-kv64", "N4-d4096-H8", "N33-d512-H1"])
def test_tensor_core_pass1_matches_unstaged(kernel_backend, monkeypatch, n, b, t, d, h):
    # bf16 heads of 64 vectors with bf16 grad_sources: pass 1's a, b and sums of squares of
    # each 2-row group on tensor cores on every arch (an odd N's last row in the SIMT form),
    # q g as two bf16 parts (fp32 query and norm weight here: 16 of q g's 24 bits). The
    # gradients stay within bf16 rounding of mhar_route_bwd_kernel's, the parameters'
    # within fp32 sums.
    args = backward_inputs(n, b, t, d, h, torch.bfloat16, kernel_backend.device)
    lib = ops_of(kernel_backend)
    got = [x.cpu() for x in backward(lib, *args, h) if x is not None]
    monkeypatch.setenv("HEADWISE_MHAR_BWD_STAGED", "0")
    want = [x.cpu() for x in backward(lib, *args, h) if x is not None]
    ds, ds_ref = got[0].float(), want[0].float()
    assert (ds - ds_ref).abs().max() <= 2 ** -8 * ds_ref.abs().max()
    assert (ds != ds_ref).float().mean() <= 0.01
    assert rel_err(got[1], want[1]) <= 2e-5 and rel_err(got[2], want[2]) <= 2e-5


def test_tensor_core_pass1_runs_where_grad_sources_is_bf16(profile_ops):
    # A warp's 2-row group takes 12 m16n8k16 and 16 m16n8k8 in pass 1 (pass1_pair_shares),
    # a row 20 m16n8k8 in pass 2 (sm_90's form); into a DepthBuffer's fp32 rows pass 1 keeps
    # the SIMT sums.
    n, b, t, d, h = 9, 1, 3, 1024, 2
    args = backward_inputs(n, b, t, d, h, torch.bfloat16, "cpu")
    _, bf16_out = profiled_launches(lambda: backward(profile_ops, *args, h))
    buf = torch.zeros(n, b, t, d)
    _, fp32_out = profiled_launches(lambda: profile_ops.mhar_route_backward_into(*args, buf, h, n, EPS, False))
    assert bf16_out[0]["kernel"] == fp32_out[0]["kernel"] == "mhar_route_bwd_staged"
    groups = n // 2
    assert bf16_out[0]["mma"] * (n * 20) == fp32_out[0]["mma"] * (n * 20 + groups * 28)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_staged_backward_non_finite_sources_propagate_like_the_unstaged_kernel(kernel_backend, monkeypatch, bad):
    # The policy of tests/robustness (README): a non-finite element makes its position's
    # gradients non-finite; other positions' grad_sources are unaffected.
    n, b, t, d, h = 9, 2, 3, 1024, 2
    grad_out, sources, query, norm_weight, weights = backward_inputs(n, b, t, d, h, torch.bfloat16, kernel_backend.device)
    sources[3, 1, 2, 17] = bad
    lib = ops_of(kernel_backend)
    got = backward(lib, grad_out, sources, query, norm_weight, weights, h)
    monkeypatch.setenv("HEADWISE_MHAR_BWD_STAGED", "0")
    want = backward(lib, grad_out, sources, query, norm_weight, weights, h)
    for x, y in zip(got[:3], want[:3]):
        assert torch.equal(torch.isfinite(x), torch.isfinite(y))
    assert not torch.isfinite(got[0][:, 1, 2]).all() and torch.isfinite(got[0][:, 0]).all()
