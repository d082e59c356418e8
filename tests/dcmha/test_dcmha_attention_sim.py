"""The CUDA kernels of the fused DCMHA attention (forward and backward), run by the SIMT
emulator (torch.ops.headwise_sim), against the materializing reference."""

import re

import pytest
import torch

import headwise
from headwise import DCMHAWeights, reference
from headwise.testing import FP32_MATMUL_SETTINGS, rel_err

from dcmha_helpers import make_weights

SIM = headwise.testing.backend("sim")
# (B, H, T, dh, dv, kwargs): odd T, every H the CUDA kernels take up to 32, head groups,
# windows, tiles beyond one block.
CASES = [
    (1, 2, 3, 4, 4, {}),
    (2, 4, 5, 8, 6, {}),
    (1, 8, 37, 16, 16, {}),
    (1, 16, 37, 8, 8, dict(head_groups=4)),
    (1, 32, 5, 4, 4, {}),
    (1, 3, 123, 16, 8, dict(window=70)),
    (1, 4, 150, 8, 8, {}),
    (1, 4, 37, 8, 8, dict(causal=False, window=5)),
]


@pytest.mark.parametrize("b,h,t,dh,dv,kw", CASES + [(1, 4, 37, 8, 8, dict(window=1))])
def test_sim_forward_matches_reference(b, h, t, dh, dv, kw):
    gen = torch.Generator().manual_seed(t + h)
    q, k = torch.randn(b, h, t, dh, generator=gen), torch.randn(b, h, t, dh, generator=gen)
    v = torch.randn(b, h, t, dv, generator=gen)
    w = make_weights(b, t, h, seed=h)
    got = SIM.dcmha_attention(q, k, v, w, **kw)
    want = reference.dcmha_attention(q, k, v, w, **kw)
    assert rel_err(got, want) <= 5e-6
    # The row statistics agree with the CPU kernel's.
    args = (q, k, v, *w, kw.get("causal", True), kw.get("window", 0), dh ** -0.5, kw.get("head_groups", 1))
    _, stats_sim = torch.ops.headwise_sim.dcmha_attention(*args)
    _, stats_cpu = torch.ops.headwise.dcmha_attention(*args)
    assert rel_err(stats_sim, stats_cpu) <= 5e-6


def test_sim_forward_bf16_and_zero_weights():
    q, k, v = (torch.randn(1, 4, 37, 16) for _ in range(3))
    w = DCMHAWeights.zeros(1, 37, 4)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert rel_err(SIM.dcmha_attention(q, k, v, w), sdpa) <= 1e-6
    wb = DCMHAWeights(*(x.bfloat16() for x in make_weights(1, 37, 4)))
    got = SIM.dcmha_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), wb)
    want = reference.dcmha_attention(q.double(), k.double(), v.double(), DCMHAWeights(*(x.double() for x in wb)))
    assert got.dtype == torch.bfloat16 and rel_err(got, want) <= 2e-2


def test_sim_forward_opcheck_schema_and_fake():
    q, k, v = (torch.randn(1, 4, 5, 8) for _ in range(3))
    w = make_weights(1, 5, 4)
    q.requires_grad_()
    for args in ((True, 0, 0.35, 1), (True, 2, 0.35, 2), (False, 0, 1.0, 1)):
        torch.library.opcheck(torch.ops.headwise_sim.dcmha_attention, (q, k, v, *w, *args))


def test_sim_rejects_too_many_heads():
    # Every DCMHA entry of the CUDA kernels takes at most 32 heads, and says so by name.
    x = torch.randn(1, 33, 3, 4)
    a = torch.randn(1, 33, 3, 3)
    w = tuple(make_weights(1, 3, 33))
    stats = torch.zeros(2, 1, 33, 3)
    calls = {
        "dcmha_compose": ("compose", lambda: torch.ops.headwise_sim.dcmha_compose(a, *w, 0, 1)),
        "dcmha_compose_backward": ("compose", lambda: torch.ops.headwise_sim.dcmha_compose_backward(a, a, *w, 0, 1)),
        "dcmha_attention": ("attention", lambda: torch.ops.headwise_sim.dcmha_attention(x, x, x, *w, True, 0, 0.5, 1)),
        "dcmha_attention_backward": ("attention", lambda: torch.ops.headwise_sim.dcmha_attention_backward(
            x, x, x, x, *w, stats, True, 0, 0.5, 1)),
    }
    for op, (kernel, call) in calls.items():
        message = f"headwise.{op}: H = 33 exceeds the most heads of the CUDA {kernel} kernel (32)"
        with pytest.raises(ValueError, match=re.escape(message)):
            call()



NAMES = ["out", "grad q", "grad k", "grad v", "grad w1", "grad w2", "grad g"]


@pytest.mark.parametrize("b,h,t,dh,dv,kw", CASES + [(1, 4, 37, 8, 8, dict(causal=False))])
def test_sim_backward_matches_reference(b, h, t, dh, dv, kw):
    gen = torch.Generator().manual_seed(t + h)
    q, k = torch.randn(b, h, t, dh, generator=gen), torch.randn(b, h, t, dh, generator=gen)
    v = torch.randn(b, h, t, dv, generator=gen)
    w = make_weights(b, t, h, seed=h)
    grad = torch.randn(b, h, t, dv, generator=gen)

    def run(fn):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, *w)]
        out = fn(*leaves[:3], DCMHAWeights(*leaves[3:]), **kw)
        out.backward(grad)
        return [out.detach()] + [x.grad for x in leaves]

    for name, x, y in zip(NAMES, run(SIM.dcmha_attention), run(reference.dcmha_attention)):
        err = rel_err(x, y)
        assert err <= 1e-5, f"{name}: relative error {err:.3g}"


def test_sim_backward_deterministic():
    q, k, v = (torch.randn(1, 4, 70, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    w = make_weights(1, 70, 4)

    def run():
        leaves = [x.clone().requires_grad_() for x in (q, k, v, *w)]
        SIM.dcmha_attention(*leaves[:3], DCMHAWeights(*leaves[3:]), window=33).square().sum().backward()
        return [x.grad for x in leaves]

    for x, y in zip(run(), run()):
        assert torch.equal(x, y)


def test_sim_refuses_launches_cuda_cannot_make():
    # B goes on grid y, which CUDA caps at 65535 blocks.
    b = 65536
    q, k, v = (torch.zeros(b, 1, 1, 2) for _ in range(3))
    with pytest.raises(ValueError, match=r"kernel 'dcmha_attention_fwd' needs a grid of \(1, 65536, 1\) blocks, "
                                         r"beyond CUDA's limits \(2147483647, 65535, 65535\)"):
        SIM.dcmha_attention(q, k, v, DCMHAWeights.zeros(b, 1, 1))
    # Shared memory per block: (H*dh + 10*H + 2*H*128 + H*dv) floats = 241064 bytes at
    # H = 1, dh = dv = 30000, over the emulated device's (sm_90's) opt-in limit.
    q, k, v = (torch.zeros(1, 1, 1, 30000) for _ in range(3))
    with pytest.raises(ValueError, match=r"headwise\.dcmha_attention: needs 241064 bytes of dynamic shared memory "
                                         r"per block, more than this device's limit of 232448 bytes"):
        SIM.dcmha_attention(q, k, v, DCMHAWeights.zeros(1, 1, 1))


# The bf16 / fp16 forward runs on the tensor-core kernels (dcmha_attention_mma_kernel.cuh):
# odd T, dh / dv not multiples of 16 (padded in the kernel) or of 8 (no 16-byte copies),
# head groups, windows, causal off, several query and key tiles: the SIMT kernels' cases
# and more.
MMA_CASES = CASES + [
    (1, 4, 70, 64, 64, {}),
    (1, 2, 67, 37, 5, dict(causal=False)),
    (1, 2, 130, 24, 40, dict(window=1)),
    (1, 32, 9, 8, 8, dict(head_groups=32)),
    (2, 8, 1, 8, 8, {}),
    (1, 6, 65, 16, 16, dict(head_groups=3, window=7, scale=0.9)),
    # Rows whose key band spans several 64-key splits (the statistics combine), causal or not.
    (1, 2, 300, 8, 8, dict(causal=False)),
    (1, 3, 290, 16, 8, dict(window=260)),
]
MMA_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
STATS_TOL = {torch.bfloat16: 5e-3, torch.float16: 6e-4}


def _mma_inputs(b, h, t, dh, dv, dtype):
    gen = torch.Generator().manual_seed(t + h)
    q, k = torch.randn(b, h, t, dh, generator=gen), torch.randn(b, h, t, dh, generator=gen)
    v = torch.randn(b, h, t, dv, generator=gen)
    w = make_weights(b, t, h, seed=h)
    return [x.to(dtype) for x in (q, k, v)], DCMHAWeights(*(x.to(dtype) for x in w))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,h,t,dh,dv,kw", MMA_CASES)
def test_sim_tensor_core_forward_matches_reference(b, h, t, dh, dv, kw, dtype):
    (q, k, v), w = _mma_inputs(b, h, t, dh, dv, dtype)
    got = SIM.dcmha_attention(q, k, v, w, **kw)
    want = reference.dcmha_attention(q.double(), k.double(), v.double(), DCMHAWeights(*(x.double() for x in w)), **kw)
    assert got.dtype == dtype
    assert rel_err(got.double(), want) <= MMA_TOL[dtype]
    # The row statistics (fp32 on both sides) agree with the CPU kernel's on the same values
    # to the rounding of the rank partials a, b: the tensor-core kernels form every logit from
    # a, b as the scratch holds them, in the inputs' dtype (largest over these cases: 2.4e-3
    # bf16, 3.0e-4 fp16), so that M and Z are the statistics of the logits they use.
    rest = (kw.get("causal", True), kw.get("window", 0), dh ** -0.5, kw.get("head_groups", 1))
    _, stats_sim = torch.ops.headwise_sim.dcmha_attention(q, k, v, *w, *rest)
    _, stats_cpu = torch.ops.headwise.dcmha_attention(*(x.float() for x in (q, k, v, *w)), *rest)
    assert rel_err(stats_sim, stats_cpu) <= STATS_TOL[dtype]


@pytest.mark.parametrize("t,kw", [(150, dict(window=90)), (300, dict(causal=False))], ids=["T150-window", "T300-full"])
def test_sim_tensor_core_forward_query_chunks(monkeypatch, t, kw):
    # A scratch cap of 1 byte gives 64-row query chunks: T = 150 runs three chunks, T = 300
    # five, whose rows span several 64-key splits (the statistics sweep's split_stats are
    # chunk-relative), with the same per-tile arithmetic as one chunk: bitwise equal outputs.
    (q, k, v), w = _mma_inputs(1, 4, t, 16, 16, torch.bfloat16)
    whole = SIM.dcmha_attention(q, k, v, w, **kw)
    monkeypatch.setenv("HEADWISE_DCMHA_SCRATCH_BYTES", "1")
    chunked = SIM.dcmha_attention(q, k, v, w, **kw)
    assert torch.equal(whole, chunked)
    assert torch.equal(chunked, SIM.dcmha_attention(q, k, v, w, **kw))


@pytest.mark.parametrize("optin,dh,tensor_cores", [(101376, 64, True), (101376, 200, False), (166912, 200, True)],
                         ids=["sm86_99KiB-dh64", "sm86_99KiB-dh200", "sm80_163KiB-dh200"])
def test_sim_tensor_core_forward_where_its_smem_fits(monkeypatch, optin, dh, tensor_cores):
    # 32 heads in one group: the sweeps stream each head's weights with its tiles, so their
    # shared memory is 2 stages of Q, K and one head's weights plus 0.5 KiB of statistics a
    # head: 48 KiB at dh = 64 (the 99 KiB parts take the tensor cores), 102 KiB at dh = 200
    # (sm_80's 163 KiB do; a 99 KiB part, the emulated limit lowered by
    # HEADWISE_SIM_SMEM_OPTIN, takes the SIMT kernel instead of failing).
    import importlib.util

    if importlib.util.find_spec("headwise._sim_profile") is None:
        pytest.skip("headwise._sim_profile not built")
    from headwise.ops import load_profile_library
    from headwise.testing import profiled_launches

    ops = load_profile_library()
    (q, k, v), w = _mma_inputs(1, 32, 5, dh, 8, torch.bfloat16)
    monkeypatch.setenv("HEADWISE_SIM_SMEM_OPTIN", str(optin))
    got, recs = profiled_launches(lambda: ops.dcmha_attention(q, k, v, w))
    want = reference.dcmha_attention(q.double(), k.double(), v.double(), DCMHAWeights(*(x.double() for x in w)))
    assert rel_err(got.double(), want) <= MMA_TOL[torch.bfloat16]
    names = {r["kernel"] for r in recs}
    if tensor_cores:
        assert {"dcmha_attn_stats", "dcmha_attn_partials", "dcmha_attn_output"} <= names, names
        assert "dcmha_attention_fwd" not in names
    else:
        assert names == {"dcmha_attention_fwd"}, names


def test_sim_tensor_core_forward_misaligned_view():
    # A view 2 elements into its storage is not 16-byte aligned: the element-copy path.
    (q, k, v), w = _mma_inputs(1, 2, 40, 16, 16, torch.float16)
    flat = torch.cat([torch.zeros(2, dtype=q.dtype), q.flatten()])
    q_off = flat[2:].view(q.shape)
    assert q_off.data_ptr() % 16 != 0
    assert torch.equal(SIM.dcmha_attention(q_off, k, v, w), SIM.dcmha_attention(q, k, v, w))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sim_backward_after_tensor_core_forward(dtype):
    # The backward kernels read the statistics the tensor-core forward saved.
    (q, k, v), w = _mma_inputs(1, 4, 37, 8, 8, dtype)
    grad = torch.randn(1, 4, 37, 8, generator=torch.Generator().manual_seed(5)).to(dtype)

    def run(fn, cast):
        leaves = [cast(x).clone().requires_grad_() for x in (q, k, v, *w)]
        out = fn(*leaves[:3], DCMHAWeights(*leaves[3:]), window=20)
        out.backward(cast(grad))
        return [out.detach()] + [x.grad for x in leaves]

    for name, x, y in zip(NAMES, run(SIM.dcmha_attention, lambda x: x), run(reference.dcmha_attention, torch.Tensor.double)):
        err = rel_err(x.double(), y)
        assert err <= 3e-2, f"{name}: relative error {err:.3g}"


def test_sim_tensor_core_scratch_is_bounded_by_the_query_chunk(monkeypatch):
    # With 64-row query chunks the largest allocation of the forward is the partials
    # scratch B * G * 4 * 64 * T words (a, b, c, d, both ranks of each a word of two bf16 / fp16):
    # linear in T (the default cap bounds it by 256 MiB).
    b, h, t, d = 1, 4, 256, 8
    (q, k, v), w = _mma_inputs(b, h, t, d, d, torch.bfloat16)
    monkeypatch.setenv("HEADWISE_DCMHA_SCRATCH_BYTES", "1")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        SIM.dcmha_attention(q, k, v, w)
    allocs = [e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0]
    assert allocs, "the profiler saw no allocation"
    assert max(allocs) <= b * 4 * 64 * t * 4, max(allocs)


# The bf16 / fp16 backward runs on the tensor-core kernels (dcmha_attention_mma_bwd_kernel.cuh):
# dS, dP' and P' are rounded to the input dtype for the dq / dk / dv products, as in flash
# attention's backward.
MMA_BWD_TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
TC_BACKWARD_KERNELS = {"dcmha_attn_partials", "dcmha_attn_bwd_dpost", "dcmha_attn_bwd_rowsum",
                       "dcmha_attn_bwd_rowsum_combine", "dcmha_attn_bwd_dpre", "dcmha_attn_bwd_dq", "dcmha_attn_bwd_dkv",
                       "dcmha_attn_grads_untranspose"}
TC_BACKWARD_NO_MMA = {"dcmha_attn_bwd_rowsum_combine", "dcmha_attn_grads_untranspose"}


def _forward_backward(fn, q, k, v, w, grad, kw):
    leaves = [x.clone().requires_grad_() for x in (q, k, v, *w)]
    out = fn(*leaves[:3], DCMHAWeights(*leaves[3:]), **kw)
    out.backward(grad)
    return [out.detach()] + [x.grad for x in leaves]


def _mma_backward_case(ops_fn, b, h, t, dh, dv, kw, dtype):
    (q, k, v), w = _mma_inputs(b, h, t, dh, dv, dtype)
    grad = torch.randn(b, h, t, dv, generator=torch.Generator().manual_seed(7)).to(dtype)
    got = _forward_backward(ops_fn, q, k, v, w, grad, kw)
    want = _forward_backward(reference.dcmha_attention, *(x.double() for x in (q, k, v)),
                             DCMHAWeights(*(x.double() for x in w)), grad.double(), kw)
    return got, want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
# dh 48: the key kernel's dk halves of 4 and 2 n8 tiles (dv 24, padded to 32: 2 and 2).
@pytest.mark.parametrize("b,h,t,dh,dv,kw", MMA_CASES + [(1, 2, 67, 128, 128, {}), (1, 2, 37, 48, 24, {})])
def test_sim_tensor_core_backward_matches_reference(b, h, t, dh, dv, kw, dtype):
    got, want = _mma_backward_case(SIM.dcmha_attention, b, h, t, dh, dv, kw, dtype)
    for name, x, y in zip(NAMES[1:], got[1:], want[1:]):
        err = rel_err(x.double(), y)
        assert err <= MMA_BWD_TOL[dtype], f"{name}: relative error {err:.3g}"
    assert [x.dtype for x in got[1:4]] == [dtype] * 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("b,h,t,dh,dv,kw", [(1, 2, 67, 128, 128, {}), (2, 4, 150, 64, 64, {}),
                                            (1, 2, 200, 32, 32, {})])
def test_sim_tensor_core_error_is_within_a_small_factor_of_the_eager_reference(b, h, t, dh, dv, kw, dtype):
    # The rank partials live in the scratch as the inputs' 16-bit dtype (pack_part); P', dL
    # are rounded to it for the products. Against fp64 every output and gradient stays
    # within 4x of the error of the fp32-accumulating eager reference run on the same
    # bf16 / fp16 inputs, which is the rounding of their dtype (measured here: at most 2.6x,
    # the weight grads; with fp32 partials they were at 1.0x, the rest at up to 3x).
    got, want = _mma_backward_case(SIM.dcmha_attention, b, h, t, dh, dv, kw, dtype)
    eager, _ = _mma_backward_case(reference.dcmha_attention, b, h, t, dh, dv, kw, dtype)
    for name, x, e, y in zip(NAMES, got, eager, want):
        err, floor = rel_err(x.double(), y), rel_err(e.double(), y)
        assert err <= 4 * floor, f"{name}: {err:.3g} against the eager reference's {floor:.3g}"


@pytest.mark.parametrize("dtype,tf32", [(torch.bfloat16, False), (torch.float32, True), (torch.float32, False)],
                         ids=["bf16", "fp32-tf32", "fp32-highest"])
def test_sim_backward_runs_on_mma_with_coalesced_accesses(dtype, tf32):
    """The bf16 backward, and the fp32 one with TF32 allowed, take the tensor-core kernels
    (not the SIMT ones), each of their product kernels issues mma.sync, and every kernel's
    global loads and stores are within 1.1x of the ideal sectors per request; fp32 at full
    precision takes the SIMT pair."""
    import importlib.util

    if importlib.util.find_spec("headwise._sim_profile") is None:
        pytest.skip("headwise._sim_profile not built")
    from headwise.ops import load_profile_library
    from headwise.testing import profiled_launches

    ops = load_profile_library()
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        (got, want), recs = profiled_launches(
            lambda: _mma_backward_case(ops.dcmha_attention, 1, 2, 128, 64, 64, {}, dtype))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    tol = MMA_BWD_TOL[dtype] if dtype != torch.float32 else TF32_TOL if tf32 else 1e-5
    for name, x, y in zip(NAMES[1:], got[1:], want[1:]):
        assert rel_err(x.double(), y) <= tol, name
    names = {r["kernel"] for r in recs}
    simt = {"dcmha_attention_bwd_query", "dcmha_attention_bwd_key"}
    if dtype == torch.float32 and not tf32:
        assert simt <= names and not names & TC_BACKWARD_KERNELS, names
        return
    assert TC_BACKWARD_KERNELS <= names and not names & simt, names
    for r in recs:
        if r["kernel"] in TC_BACKWARD_KERNELS - TC_BACKWARD_NO_MMA:
            assert r["mma"] > 0, r["kernel"]
        if r["kernel"] in TC_BACKWARD_KERNELS:
            for kind in ("global_load_sectors", "global_store_sectors"):
                assert r[kind] <= 1.1 * r[kind + "_ideal"], (r["kernel"], kind, r[kind], r[kind + "_ideal"])


@pytest.mark.parametrize("case", [(1, 4, 150, 16, 16, dict(window=90), torch.bfloat16),
                                  (2, 4, 131, 8, 8, dict(causal=False, head_groups=2), torch.bfloat16),
                                  (1, 2, 129, 24, 40, dict(causal=False, window=40), torch.bfloat16),
                                  (1, 4, 150, 16, 16, dict(window=90), torch.float32)], ids=str)
def test_sim_tensor_core_backward_query_chunks(allow_tf32, monkeypatch, case):
    # 64-row query chunks (a scratch cap of 1 byte): dk, dv and the key-slot grads become
    # sums over the chunks (another order than one chunk's), the rest is the same
    # arithmetic; both agree with the reference and each is bitwise repeatable. fp32 under
    # TF32 (the tensor-core path at T = float).
    tol = TF32_TOL if case[-1] == torch.float32 else MMA_BWD_TOL[case[-1]]
    whole, want = _mma_backward_case(SIM.dcmha_attention, *case)
    monkeypatch.setenv("HEADWISE_DCMHA_SCRATCH_BYTES", "1")
    chunked, _ = _mma_backward_case(SIM.dcmha_attention, *case)
    again, _ = _mma_backward_case(SIM.dcmha_attention, *case)
    for name, x, y, z, r in zip(NAMES, whole, chunked, again, want):
        assert torch.equal(y, z), name
        assert rel_err(y.double(), r) <= tol, name
        if name in ("out", "grad q"):
            assert torch.equal(x, y), name


def test_sim_tensor_core_grids_hold_only_the_chunks_key_band(monkeypatch):
    """Per 64-row query chunk, the sweeps' grids (a CTA per 32-key block) and the key
    kernels' (a CTA per 64-key tile) start at the chunk's first key and end at its last:
    causal with a window, the blocks outside the band are not launched. The rowsum runs
    3 key splits of the chunk's query tile, its combine a CTA per 128 rows."""
    import importlib.util

    if importlib.util.find_spec("headwise._sim_profile") is None:
        pytest.skip("headwise._sim_profile not built")
    from headwise.ops import load_profile_library
    from headwise.testing import profiled_launches

    t, window = 200, 70
    monkeypatch.setenv("HEADWISE_DCMHA_SCRATCH_BYTES", "1")
    ops = load_profile_library()
    (got, want), recs = profiled_launches(
        lambda: _mma_backward_case(ops.dcmha_attention, 1, 2, t, 16, 16, dict(window=window), torch.bfloat16))
    for name, x, y in zip(NAMES, got, want):
        assert rel_err(x.double(), y) <= MMA_BWD_TOL[torch.bfloat16], name

    def blocks(keys):
        out = []
        for c0 in range(0, t, 64):
            lo, hi = max(0, c0 - window + 1), min(t, c0 + 64)
            out.append(-(-hi // keys) - lo // keys)
        return out

    # The sweeps' key blocks are grid x; the row and key kernels run heads on x (heads
    # fastest), their query or key tiles on y.
    grids = {}
    for r in recs:
        grids.setdefault(r["kernel"], []).append(r["grid"])
    x, y = (lambda k: [g[0] for g in grids[k]]), (lambda k: [g[1] for g in grids[k]])
    assert x("dcmha_attn_partials") == blocks(32) * 2  # the forward's, then the backward's
    assert x("dcmha_attn_bwd_dpost") == x("dcmha_attn_bwd_dpre") == blocks(32)
    assert y("dcmha_attn_bwd_dkv") == blocks(64) and x("dcmha_attn_bwd_dkv") == [2] * len(blocks(64))
    assert y("dcmha_attn_bwd_rowsum") == [3] * len(blocks(32)) and x("dcmha_attn_bwd_rowsum") == [1] * len(blocks(32))
    assert x("dcmha_attn_bwd_rowsum_combine") == y("dcmha_attn_bwd_dq") == [1] * len(blocks(32))
    assert x("dcmha_attn_bwd_dq") == x("dcmha_attn_output") == [2] * len(blocks(32))
    assert blocks(32)[-1] < -(-t // 32) and blocks(64)[-1] < -(-t // 64)  # the window cut the last chunk's


@pytest.mark.parametrize("optin", [101376, 166912], ids=["sm86_99KiB", "sm80_163KiB"])
def test_sim_tensor_core_backward_falls_back_where_it_does_not_fit(monkeypatch, optin):
    # dh = 200 (padded beyond the 128 the warp accumulators hold) takes the SIMT backward.
    dh, dv = 200, 8
    monkeypatch.setenv("HEADWISE_SIM_SMEM_OPTIN", str(optin))
    got, want = _mma_backward_case(SIM.dcmha_attention, 1, 2, 5, dh, dv, {}, torch.bfloat16)
    for name, x, y in zip(NAMES[1:], got[1:], want[1:]):
        assert rel_err(x.double(), y) <= MMA_BWD_TOL[torch.bfloat16], name


@pytest.mark.parametrize("optin,dtype", [(166912, torch.float32), (101376, torch.bfloat16)],
                         ids=["sm80_163KiB-fp32_tf32", "sm86_99KiB-bf16"])
def test_sim_tensor_core_backward_with_one_buffer_where_two_do_not_fit(monkeypatch, optin, dtype):
    # At dh = dv = 128 the dL' sweep and the key kernel keep one buffer of their streamed
    # tiles where two do not fit (fp32's 207 / 183 KiB over sm_80's 163; bf16's 111 / 109 KiB
    # over 99, where the rowsum also takes one head a CTA): the tensor-core backward still
    # runs, within the limit, with the bits of the double-buffered kernels (the same
    # products in the same order; only when the next tile loads differs).
    import importlib.util

    if importlib.util.find_spec("headwise._sim_profile") is None:
        pytest.skip("headwise._sim_profile not built")
    from headwise.ops import load_profile_library
    from headwise.testing import profiled_launches

    ops = load_profile_library()
    (q, k, v), w = _mma_inputs(1, 2, 67, 128, 128, dtype)
    grad = torch.randn(1, 2, 67, 128, generator=torch.Generator().manual_seed(7)).to(dtype)
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        two, recs_two = profiled_launches(lambda: _forward_backward(ops.dcmha_attention, q, k, v, w, grad, {}))
        monkeypatch.setenv("HEADWISE_SIM_SMEM_OPTIN", str(optin))
        one, recs = profiled_launches(lambda: _forward_backward(ops.dcmha_attention, q, k, v, w, grad, {}))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    smem = {r["kernel"]: r["dynamic_smem_bytes"] for r in recs}
    smem_two = {r["kernel"]: r["dynamic_smem_bytes"] for r in recs_two}
    assert {"dcmha_attn_bwd_dpre", "dcmha_attn_bwd_dkv", "dcmha_attn_bwd_rowsum"} <= set(smem), sorted(smem)
    assert max(smem.values()) <= optin
    assert smem["dcmha_attn_bwd_dpre"] < smem_two["dcmha_attn_bwd_dpre"] > optin
    assert smem["dcmha_attn_bwd_dkv"] < smem_two["dcmha_attn_bwd_dkv"] > optin
    for name, x, y in zip(NAMES, one, two):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["simt", "tensor_cores"])
@pytest.mark.parametrize("causal", [True, False])
def test_sim_window_of_at_least_t_is_no_window(dtype, causal):
    # window >= T keeps every pair, as None does; a window near 2^31 must not overflow the
    # kernels' int arithmetic (s + W) into an empty band.
    (q, k, v), w = _mma_inputs(1, 2, 70, 8, 8, dtype)
    grad = torch.randn(1, 2, 70, 8, generator=torch.Generator().manual_seed(3)).to(dtype)
    none = _forward_backward(SIM.dcmha_attention, q, k, v, w, grad, dict(causal=causal))
    for window in (70, 2**31 - 1, 2**40):
        got = _forward_backward(SIM.dcmha_attention, q, k, v, w, grad, dict(causal=causal, window=window))
        for name, x, y in zip(NAMES, got, none):
            assert torch.equal(x, y), (window, name)


def test_sim_tensor_core_backward_opcheck():
    # The backward op on the tensor-core path (bf16): schema, fake tensor and the
    # dispatcher's checks, like the forward's opcheck above.
    (q, k, v), w = _mma_inputs(1, 4, 37, 16, 8, torch.bfloat16)
    _, stats = torch.ops.headwise_sim.dcmha_attention(q, k, v, *w, True, 0, 0.25, 2)
    grad = torch.randn(1, 4, 37, 8).bfloat16()
    torch.library.opcheck(torch.ops.headwise_sim.dcmha_attention_backward,
                          (grad, q, k, v, *w, stats, True, 0, 0.25, 2))


# fp32 inputs take the tensor-core forward as TF32 where torch allows TF32 matmuls
# (torch.backends.cuda.matmul.allow_tf32, which the launcher reads as the head merge's does);
# the tensor core drops the low 13 mantissa bits of QK^T's and P'V's operands, and the rank
# partials stay fp32 (64-bit scratch words). At full precision (torch's default) fp32 keeps
# the SIMT kernel. Largest errors over these cases against fp64: output 3.4e-3, gradients
# 3.2e-3 (the tensor-core backward at T = float; 2.4e-3 from the SIMT backward reading q, k, v
# truncated as the forward's tensor cores did), row statistics against the CPU kernel's 1.2e-3.
TF32_TOL = 5e-3
TF32_STATS_TOL = 2e-3
TC_FORWARD_KERNELS = {"dcmha_attn_stats", "dcmha_attn_partials", "dcmha_attn_output"}


@pytest.fixture
def allow_tf32():
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.mark.parametrize("b,h,t,dh,dv,kw", MMA_CASES + [(1, 2, 67, 128, 128, {})])
def test_sim_tf32_forward_matches_reference(allow_tf32, b, h, t, dh, dv, kw):
    (q, k, v), w = _mma_inputs(b, h, t, dh, dv, torch.float32)
    got = SIM.dcmha_attention(q, k, v, w, **kw)
    want = reference.dcmha_attention(q.double(), k.double(), v.double(), DCMHAWeights(*(x.double() for x in w)), **kw)
    assert got.dtype == torch.float32
    assert rel_err(got.double(), want) <= TF32_TOL
    rest = (kw.get("causal", True), kw.get("window", 0), kw.get("scale", dh ** -0.5), kw.get("head_groups", 1))
    _, stats_sim = torch.ops.headwise_sim.dcmha_attention(q, k, v, *w, *rest)
    _, stats_cpu = torch.ops.headwise.dcmha_attention(q, k, v, *w, *rest)
    assert rel_err(stats_sim, stats_cpu) <= TF32_STATS_TOL


@pytest.mark.parametrize("tf32", [False, True], ids=["highest", "tf32"])
def test_sim_fp32_forward_takes_tensor_cores_only_where_torch_allows_tf32(tf32):
    """With TF32 allowed the fp32 forward runs the tensor-core kernels, each product kernel
    issuing mma.sync, global loads and stores within 1.1x of the ideal sectors a request and
    shared memory within 1.1x of the ideal wavefronts a request (V's scalar reads in P'V
    included); otherwise the SIMT kernel at full precision."""
    import importlib.util

    if importlib.util.find_spec("headwise._sim_profile") is None:
        pytest.skip("headwise._sim_profile not built")
    from headwise.ops import load_profile_library
    from headwise.testing import profiled_launches

    ops = load_profile_library()
    (q, k, v), w = _mma_inputs(1, 2, 128, 64, 64, torch.float32)
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        got, recs = profiled_launches(lambda: ops.dcmha_attention(q, k, v, w))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    want = reference.dcmha_attention(q.double(), k.double(), v.double(), DCMHAWeights(*(x.double() for x in w)))
    names = {r["kernel"] for r in recs}
    if not tf32:
        assert names == {"dcmha_attention_fwd"}, names
        assert rel_err(got.double(), want) <= 1e-5
        return
    assert rel_err(got.double(), want) <= TF32_TOL
    assert TC_FORWARD_KERNELS <= names and "dcmha_attention_fwd" not in names, names
    for r in recs:
        if r["kernel"] in TC_FORWARD_KERNELS:
            assert r["mma"] > 0, r["kernel"]
            for kind in ("global_load_sectors", "global_store_sectors", "smem_wavefronts"):
                assert r[kind] <= 1.1 * r[kind + "_ideal"], (r["kernel"], kind, r[kind], r[kind + "_ideal"])


def test_sim_tf32_forward_query_chunks_and_misaligned_view(allow_tf32, monkeypatch):
    # 64-row query chunks (a scratch cap of 1 byte) give the same bits as one chunk; a view
    # 1 float into its storage (not 16-byte aligned) takes the element copies, same bits.
    (q, k, v), w = _mma_inputs(1, 4, 150, 16, 16, torch.float32)
    whole = SIM.dcmha_attention(q, k, v, w, window=90)
    flat = torch.cat([torch.zeros(1), q.flatten()])
    q_off = flat[1:].view(q.shape)
    assert q_off.data_ptr() % 16 != 0
    assert torch.equal(SIM.dcmha_attention(q_off, k, v, w, window=90), whole)
    monkeypatch.setenv("HEADWISE_DCMHA_SCRATCH_BYTES", "1")
    assert torch.equal(SIM.dcmha_attention(q, k, v, w, window=90), whole)


@pytest.mark.parametrize("b,h,t,dh,dv,kw", MMA_CASES + [(1, 2, 67, 128, 128, {}), (1, 2, 37, 48, 24, {})])
def test_sim_tf32_backward_matches_reference(allow_tf32, b, h, t, dh, dv, kw):
    # After a TF32 forward the fp32 backward runs the tensor-core kernels at T = float.
    got, want = _mma_backward_case(SIM.dcmha_attention, b, h, t, dh, dv, kw, torch.float32)
    for name, x, y in zip(NAMES, got, want):
        err = rel_err(x.double(), y)
        assert err <= TF32_TOL, f"{name}: relative error {err:.3g}"
    assert [x.dtype for x in got[1:4]] == [torch.float32] * 3


def test_sim_tf32_backward_where_the_tensor_cores_do_not_fit(allow_tf32):
    # dh = 136 (padded to 144, over the 128 the warp accumulators hold) after a TF32
    # forward on the tensor cores: the SIMT backward runs, reading q, k, v truncated to TF32
    # as the forward's tensor cores did (from the full-precision inputs its gradients were
    # off by 3-5e-2).
    import importlib.util

    if importlib.util.find_spec("headwise._sim_profile") is None:
        pytest.skip("headwise._sim_profile not built")
    from headwise.ops import load_profile_library
    from headwise.testing import profiled_launches

    ops = load_profile_library()
    (got, want), recs = profiled_launches(
        lambda: _mma_backward_case(ops.dcmha_attention, 1, 2, 67, 136, 120, {}, torch.float32))
    names = {r["kernel"] for r in recs}
    assert {"dcmha_attn_output", "dcmha_attention_bwd_query"} <= names and "dcmha_attn_bwd_dpre" not in names
    for name, x, y in zip(NAMES, got, want):
        err = rel_err(x.double(), y)
        assert err <= TF32_TOL, f"{name}: relative error {err:.3g}"


@pytest.mark.parametrize("forward_tf32", [True, False], ids=["tf32-forward", "full-forward"])
def test_sim_backward_refuses_a_tf32_setting_changed_since_the_forward(forward_tf32):
    # fp32 takes TF32 tensor cores or full precision by torch's setting, and the backward must
    # take the forward's path (its logits are those the saved statistics normalize): a setting
    # changed between the passes is a named error, not gradients off by TF32's rounding.
    (q, k, v), w = _mma_inputs(1, 4, 37, 16, 8, torch.float32)
    grad = torch.randn(1, 4, 37, 8, generator=torch.Generator().manual_seed(7))
    previous = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = forward_tf32
        out = SIM.dcmha_attention(*(x.requires_grad_() for x in (q, k, v)), w)
        torch.backends.cuda.matmul.allow_tf32 = not forward_tf32
        with pytest.raises(RuntimeError, match="float32 matmul precision for CUDA changed"):
            out.backward(grad)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def test_sim_bf16_reads_no_tf32_setting():
    # Only fp32 reads torch's TF32 setting: bf16 runs forward and backward under the new API's
    # setting, whose legacy reading (allow_tf32) raises in torch.
    (q, k, v), w = _mma_inputs(1, 2, 37, 16, 8, torch.bfloat16)
    previous = torch.backends.cuda.matmul.fp32_precision
    try:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        with pytest.raises(RuntimeError, match="mix of the legacy and new APIs"):
            torch.backends.cuda.matmul.allow_tf32
        out = SIM.dcmha_attention(*(x.requires_grad_() for x in (q, k, v)), w)
        out.backward(torch.ones_like(out))
    finally:
        torch.backends.cuda.matmul.fp32_precision = previous
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in (q, k, v))


@pytest.mark.parametrize("setting", sorted(FP32_MATMUL_SETTINGS))
def test_sim_fp32_follows_every_way_torch_sets_its_matmul_precision(fp32_precision_state, setting):
    # The launcher reads the setting as torch's cuBLAS calls read it, so fp32 takes TF32
    # tensor cores under each API that selects TF32 (the legacy getter, which raises after
    # the newer API was used, is not read), forward and backward, with the same bits as
    # under allow_tf32; the others keep full precision.
    (q, k, v), w = _mma_inputs(1, 2, 37, 16, 8, torch.float32)
    grad = torch.randn(1, 2, 37, 8, generator=torch.Generator().manual_seed(5))

    def run():
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = SIM.dcmha_attention(*leaves, w)
        out.backward(grad)
        return [out.detach()] + [x.grad for x in leaves]

    apply, tf32 = FP32_MATMUL_SETTINGS[setting]
    torch.backends.cuda.matmul.allow_tf32 = not tf32
    other = run()
    torch.backends.cuda.matmul.allow_tf32 = tf32
    want = run()
    assert not torch.equal(other[0], want[0])
    fp32_precision_state()  # the state the test began in (torch's default, as a process starts)
    apply()
    got = run()
    assert all(torch.equal(a, b) for a, b in zip(got, want)), setting
