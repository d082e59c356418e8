"""The two kernel paths of qkv_project's CUDA epilogues (csrc/qkv/qkv_kernel.cuh): the
16-byte path (a group of lanes per head, 16 bytes per lane; rope partners in the lane, a
shuffle away, or through shared memory for partial rotary) and the scalar fallback
(misaligned views, widths that are not whole 16-byte vectors). Which kernel runs and how
its accesses coalesce is read from the emulator's profile library; every path is checked
against headwise.reference at odd shapes, and the backward for bitwise repeatability."""

import importlib.util

import pytest
import torch

import headwise
from headwise import QKVLayout, reference, testing
from headwise.testing import profiled_launches, rel_err

from test_qkv_rope_forms import BF16_TOL, FP32_TOL, forward_backward, make_case

PROFILE_BUILT = importlib.util.find_spec("headwise._sim_profile") is not None
needs_profile = pytest.mark.skipif(not PROFILE_BUILT, reason="headwise._sim_profile not built")


def head_grads(layout, b, s, dtype, device, seed=7, offset=0):
    """Random dq, dk, dv; with `offset` > 0 each is a contiguous view starting `offset`
    elements into a larger buffer (a misaligned data pointer)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(b, layout.num_q_heads, s, layout.head_dim), (b, layout.num_kv_heads, s, layout.head_dim),
              (b, layout.num_kv_heads, s, layout.v_head_dim)]
    out = []
    for sh in shapes:
        g = torch.randn(sh, generator=gen).to(dtype).to(device)
        buf = torch.empty(g.numel() + offset, dtype=dtype, device=device)
        view = buf[offset:].view(sh)
        view.copy_(g)
        out.append(view)
    return out


def run_case(ops, layout, b, s, d_model, *, dtype, grad_offset=0, **case):
    device = getattr(ops, "device", "cpu")  # the profile library's ops run on the CPU
    args, kw = make_case(layout, b, s, d_model, dtype=dtype, device=device, **case)
    grads = head_grads(layout, b, s, dtype, device, offset=grad_offset)
    out, got = forward_backward(ops.qkv_project, args, kw, grads)
    return args, kw, grads, out, got


def check_reference(ops, layout, b, s, d_model, *, dtype, tol, grad_offset=0, **case):
    args, kw, grads, out, got = run_case(ops, layout, b, s, d_model, dtype=dtype, grad_offset=grad_offset, **case)
    want_out, want = forward_backward(reference.qkv_project, args, kw, grads)
    for name, o, e in zip("qkv", out, want_out):
        assert o.dtype == dtype and rel_err(o, e) <= tol, f"{name}: {rel_err(o, e):.3g}"
    for name, g, e in zip(("x", "weight", "bias", "q_norm", "k_norm"), got, want):
        assert rel_err(g, e) <= tol, f"grad {name}: {rel_err(g, e):.3g}"
    return out, got


def epilogue_launches(records):
    return {r["kernel"]: r for r in records if r["kernel"].startswith("qkv_epilogue")}


# (layout, B, S, D_model, rot, style, dtype): every head whole 16-byte vectors and aligned.
VECTOR_CASES = [
    # 128-wide bf16 heads: 16 lanes x 8, two heads per warp; full rotate-half (shuffle).
    pytest.param(QKVLayout(4, 2, 128), 3, 5, 37, 128, "rotate_half", torch.bfloat16, id="bf16-D128-half"),
    # Partial rotary with rot / 2 = 18 not whole vectors: partners through shared memory.
    pytest.param(QKVLayout(4, 2, 128), 2, 37, 37, 36, "rotate_half", torch.bfloat16, id="bf16-D128-rot36-staged"),
    # Interleaved with a vector only partly rotated (elements 16..19 of 16..23).
    pytest.param(QKVLayout(3, 1, 64, 32), 2, 37, 123, 20, "interleaved", torch.bfloat16, id="bf16-D64-rot20-inter"),
    # fp16, one vector per head (G = 1: 128 groups per block).
    pytest.param(QKVLayout(5, 1, 8), 3, 5, 37, 8, "rotate_half", torch.float16, id="fp16-D8-half-G1"),
    # fp32 (4 per lane), 24 vectors -> 32-lane groups, kv_group packing.
    pytest.param(QKVLayout(6, 3, 96, 80, interleave="kv_group"), 1, 37, 37, 96, "rotate_half", torch.float32,
                 id="fp32-D96-kvgroup"),
    pytest.param(QKVLayout(6, 3, 96, 80, interleave="kv_group"), 1, 37, 37, 6, "interleaved", torch.float32,
                 id="fp32-D96-rot6-inter"),
]


@pytest.mark.parametrize("layout,b,s,d_model,rot,style,dtype", VECTOR_CASES)
def test_vector_path_matches_reference(layout, b, s, d_model, rot, style, dtype):
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    check_reference(testing.backend("sim"), layout, b, s, d_model, dtype=dtype, tol=tol, rot=rot, per_row=True,
                    style=style)


@needs_profile
@pytest.mark.parametrize("layout,b,s,d_model,rot,style,dtype", VECTOR_CASES[:3])
def test_vector_path_is_taken_and_coalesced(layout, b, s, d_model, rot, style, dtype):
    from headwise.ops import load_profile_library

    ops = load_profile_library()
    _, records = profiled_launches(lambda: run_case(ops, layout, b, s, d_model, dtype=dtype, rot=rot, per_row=True,
                                           style=style))
    launches = epilogue_launches(records)
    assert set(launches) == {"qkv_epilogue_fwd", "qkv_epilogue_bwd"}, sorted(launches)
    for rec in launches.values():
        # Every global request touches the fewest sectors its bytes allow (rope rows of
        # rot floats at rot * 4-byte strides may straddle one more) ...
        assert rec["global_load_sectors"] <= 1.1 * rec["global_load_sectors_ideal"], rec["kernel"]
        assert rec["global_store_sectors"] == rec["global_store_sectors_ideal"], rec["kernel"]
        # ... and moves 16 bytes per active lane: a head of w elements is w * size / 16
        # lanes, so a warp request carries at least min(32, lanes per head) x 16 bytes.
        lanes = min(32, layout.head_dim * torch.finfo(dtype).bits // 8 // 16)
        assert rec["global_load_bytes"] / rec["global_load_requests"] >= 16 * lanes * 0.99, rec["kernel"]
        # Shared memory (staged norm weights, rope rows) without bank conflicts, except
        # the staged rotate-half partners (rot = 36); the backward's one-off sum of its
        # groups' norm-gradient rows reads them 2-way conflicted, which weighs here (one
        # token per block) and not at model sizes (tens of tokens per block).
        if rot % 16 == 0:
            bound = 1.05 if rec["kernel"] == "qkv_epilogue_fwd" else 1.5
            assert rec["smem_wavefronts"] <= bound * rec["smem_wavefronts_ideal"], rec["kernel"]


# Calls the 16-byte path cannot take: the scalar fallback.
FALLBACK_CASES = [
    # Head width not whole vectors (37), kv width 5.
    pytest.param(QKVLayout(3, 1, 37, 5), 2, 5, 123, 10, 0, torch.bfloat16, id="bf16-D37-odd"),
    # Head offsets not multiples of 8 bf16 (v width 12).
    pytest.param(QKVLayout(6, 3, 16, 12, interleave="kv_group"), 2, 37, 37, 6, 0, torch.bfloat16,
                 id="bf16-Dv12-offsets"),
    # fp32 heads over 32 x 4 elements.
    pytest.param(QKVLayout(2, 1, 256, 128), 1, 5, 37, 256, 0, torch.float32, id="fp32-D256"),
]


@pytest.mark.parametrize("layout,b,s,d_model,rot,grad_offset,dtype", FALLBACK_CASES)
def test_fallback_matches_reference(layout, b, s, d_model, rot, grad_offset, dtype):
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    check_reference(testing.backend("sim"), layout, b, s, d_model, dtype=dtype, tol=tol, rot=rot, per_row=True,
                    style="rotate_half", grad_offset=grad_offset)


@needs_profile
@pytest.mark.parametrize("layout,b,s,d_model,rot,grad_offset,dtype", FALLBACK_CASES[:2])
def test_fallback_is_taken(layout, b, s, d_model, rot, grad_offset, dtype):
    from headwise.ops import load_profile_library

    ops = load_profile_library()
    _, records = profiled_launches(lambda: run_case(ops, layout, b, s, d_model, dtype=dtype, rot=rot, per_row=True,
                                           style="rotate_half", grad_offset=grad_offset))
    assert set(epilogue_launches(records)) == {"qkv_epilogue_fwd_scalar", "qkv_epilogue_bwd_scalar"}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_misaligned_gradient_views_take_the_fallback(dtype):
    """dq / dk / dv views one element into their buffers (not 16-byte aligned): the
    backward runs the scalar kernel (a 16-byte access there would fault on the GPU; the
    emulator traps on it too) and agrees with the aligned call and the reference."""
    sim = testing.backend("sim")
    layout = QKVLayout(4, 2, 64)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    _, aligned = check_reference(sim, layout, 2, 37, 37, dtype=dtype, tol=tol, rot=64, per_row=True,
                                 style="rotate_half")
    _, shifted = check_reference(sim, layout, 2, 37, 37, dtype=dtype, tol=tol, rot=64, per_row=True,
                                 style="rotate_half", grad_offset=1)
    for a, g in zip(aligned, shifted):
        assert rel_err(g, a) <= (1e-5 if dtype == torch.float32 else 2 ** -7)
    if PROFILE_BUILT:
        from headwise.ops import load_profile_library

        ops = load_profile_library()
        _, records = profiled_launches(lambda: run_case(ops, layout, 2, 5, 37, dtype=dtype, rot=64, per_row=True,
                                               style="rotate_half", grad_offset=1))
        assert set(epilogue_launches(records)) == {"qkv_epilogue_fwd", "qkv_epilogue_bwd_scalar"}


def test_rope_does_not_change_the_path():
    """A call with partial rotary takes the same path as the call without rope (the norm
    statistics are summed in one order), so the pass-through dims are bitwise equal, on
    the 16-byte path with staged rotate-half partners too."""
    sim = testing.backend("sim")
    layout = QKVLayout(4, 2, 64)
    for rot, style in ((36, "rotate_half"), (20, "interleaved"), (64, "rotate_half")):
        args, kw = make_case(layout, 2, 5, 37, rot=rot, per_row=True, style=style, dtype=torch.bfloat16)
        q, k, _ = sim.qkv_project(*args, **kw)
        plain = dict(kw)
        plain.pop("rope")
        q0, k0, _ = sim.qkv_project(*args, **plain)
        assert torch.equal(q[..., rot:], q0[..., rot:]) and torch.equal(k[..., rot:], k0[..., rot:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_backward_bitwise_repeatable_over_persistent_blocks(dtype):
    """B*S = 633 tokens > the backward's 528 persistent blocks, so blocks loop over
    tokens and the norm-weight gradient runs every level of its tree: two runs give the
    same bits, and they match the reference."""
    sim = testing.backend("sim")
    layout = QKVLayout(2, 1, 32)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    _, first = check_reference(sim, layout, 3, 211, 5, dtype=dtype, tol=tol, rot=32, per_row=True,
                               style="rotate_half")
    _, second = run_case(sim, layout, 3, 211, 5, dtype=dtype, rot=32, per_row=True, style="rotate_half")[3:]
    for a, b in zip(first, second):
        assert torch.equal(a, b)
