"""python -m headwise.bench --sim-profile [op ...] [--json FILE]

Memory metrics of the emulated CUDA kernels, per launch, like ncu's (SPEC section 6), and
an H200 time ESTIMATE from them. Nothing here runs on a GPU.

The counts come from headwise._sim_profile, the emulated kernels compiled with every
memory access reported to the emulator (csrc/common/simt/simt_metrics.h says what is
counted). Each op runs at a few small shapes that emulate in seconds, with the dimensions
that set a CTA's work (d, H, Dv, dh, the reduction length) at their target values where
that is cheap; every count is then fitted, exactly, by a polynomial in the dimensions
that set the number of CTAs and the work per CTA (OpSpec.basis) and evaluated at the
op's target shape from GPU_REVIEW.md. bytes_in_flight_per_cta is a per-CTA quantity: it
is taken from the largest profiled shape, not fitted.

The estimate (estimate(), constants in H200 only) is the largest of
  hbm   unique bytes / HBM bandwidth
  l2    every sector of every request x 32 B / L2 bandwidth
  lat   Little's law: the HBM bandwidth scaled by min(1, bytes in flight on the GPU /
        (HBM bandwidth x latency)); bytes in flight = resident CTAs (registers from the
        ptxas report, threads, shared memory; capped by the grid) x the DRAM bytes a
        CTA's threads load per round (simt_metrics.cpp: sectors the launch had not
        loaded before, per round = between barriers, one loop iteration; a later
        iteration is assumed to wait for the earlier one, i.e. no unrolling)
  rtt   round trips: a CTA's load rounds (simt_metrics.cpp: the most of one of its
        threads) one after another, each at least an L2 hit's latency, its resident CTAs
        side by side: load_rounds (summed over CTAs) x latency / resident CTAs. A floor
        for kernels whose every round waits for the one before (synchronous loads, a
        double buffer); a pipeline d copies deep overlaps d rounds, which this does not
        credit (merge: 3 stages, 2 deep)
  smem  shared-memory wavefronts / (SMs x 1 wavefront per clock)
  mma   mma.sync count x FLOPs per mma / mma.sync ceiling
  issue mma.sync count x the SASS instructions per HMMA of the kernel's steady K-loop
        iteration (bench/sass_sm90.txt, python -m headwise.bench.sass) / the SMs' issue
        rate (4 warp instructions per clock per SM, times an efficiency calibrated on the
        H200: see GpuModel.issue_efficiency); kernels with HMMA loops only
  fp32  the kernel's share of the op's minimal FLOPs / FP32 ceiling (for kernels
        without mma; the emulator does not count arithmetic)
Launch overheads and the GEMMs the ops leave to cuBLAS (shown as an analytic row) are
outside the emulator's view.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import time
from typing import Callable

import numpy as np
import torch

from . import ptxas, sass


# ---------------------------------------------------------------------------
# The H200 model: every constant of the estimate.
# ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GpuModel:
    name: str = "H200 SXM"
    sms: int = 132
    clock_hz: float = 1.98e9             # boost clock
    hbm_bytes_per_s: float = 4.1e12      # practical HBM3e bandwidth (GPU_REVIEW.md)
    hbm_latency_s: float = 0.8e-6        # loaded DRAM latency, for Little's law
    l2_round_trip_s: float = 0.2e-6      # an L2 hit's latency, unloaded (~270-300 clocks on sm_90): the rtt floor
    l2_bytes_per_s: float = 10e12        # assumed: published H100 L2 figures span ~5.5-12 TB/s
    mma_flops_per_s: float = 0.65 * 989e12  # mma.sync reaches ~65% of the dense bf16 peak on sm_90
    fp32_flops_per_s: float = 67e12      # FP32 FMA peak
    flops_per_mma: int = 2 * 16 * 8 * 16  # one m16n8k16 mma.sync
    smem_wavefronts_per_clock: int = 1   # per SM: 32 banks x 4 B
    issue_per_clock_per_sm: int = 4      # warp instructions: one per scheduler per clock
    # Share of that issue rate a tensor-core K loop sustains: the H200 run of 2026-11-30
    # measured head_merge_bwd_dz_tc (commit 6ae161b, 7.41 instructions per HMMA in its
    # steady iteration by python -m headwise.bench.sass) at 280 TFLOP/s, i.e. 0.485 of
    # the instructions 4 schedulers x 1.98 GHz x 132 SMs could issue.
    issue_efficiency: float = 0.485
    regs_per_sm: int = 65536
    reg_granule_per_warp: int = 256      # registers are allocated per warp in units of 256
    max_threads_per_sm: int = 2048
    max_ctas_per_sm: int = 32
    smem_per_sm: int = 228 * 1024
    smem_reserved_per_cta: int = 1024

    @property
    def bytes_in_flight_needed(self) -> float:
        """Bytes that must be in flight on the whole GPU to sustain the HBM bandwidth."""
        return self.hbm_bytes_per_s * self.hbm_latency_s


H200 = GpuModel()


def ctas_per_sm(threads: int, registers: int | None, smem_bytes: int, gpu: GpuModel = H200) -> int:
    """Resident CTAs per SM from threads, registers per thread (None: not limiting) and
    shared memory per CTA (static + dynamic)."""
    warps = -(-threads // 32)
    limits = [gpu.max_ctas_per_sm, gpu.max_threads_per_sm // (warps * 32)]
    if registers:
        per_warp = -(-registers * 32 // gpu.reg_granule_per_warp) * gpu.reg_granule_per_warp
        limits.append((gpu.regs_per_sm // per_warp) // warps)
    if smem_bytes:
        limits.append(gpu.smem_per_sm // (smem_bytes + gpu.smem_reserved_per_cta))
    return max(0, min(limits))


def estimate(rec: dict, fp32_flops: float, gpu: GpuModel = H200) -> dict:
    """Time terms (seconds) of one launch record, the binding one, and the inputs they
    used. `rec` needs the count fields, ctas, threads, ctas_per_sm, bytes_in_flight_per_cta."""
    resident = min(rec["ctas"], rec["ctas_per_sm"] * gpu.sms)
    in_flight = resident * rec["bytes_in_flight_per_cta"]
    share = min(1.0, in_flight / gpu.bytes_in_flight_needed) if in_flight > 0 else 1.0
    terms = {
        "hbm": rec["unique_bytes"] / gpu.hbm_bytes_per_s,
        "l2": rec["l2_sectors"] * 32 / gpu.l2_bytes_per_s,
        "lat": rec["unique_bytes"] / (gpu.hbm_bytes_per_s * share),
        "rtt": rec.get("load_rounds", 0) * gpu.l2_round_trip_s / resident if resident > 0 else 0.0,
        "smem": rec["smem_wavefronts"] / (gpu.sms * gpu.smem_wavefronts_per_clock * gpu.clock_hz),
        "mma": rec["mma"] * gpu.flops_per_mma / gpu.mma_flops_per_s,
        "issue": rec["mma"] * (rec.get("issue_per_hmma") or 0.0)
        / (gpu.sms * gpu.issue_per_clock_per_sm * gpu.clock_hz * gpu.issue_efficiency),
        "fp32": (fp32_flops if rec["mma"] == 0 else 0.0) / gpu.fp32_flops_per_s,
    }
    bound = max(terms, key=terms.get)
    return {"est_us": terms[bound] * 1e6, "est_bound": bound, "est_terms_us": {k: v * 1e6 for k, v in terms.items()},
            "bytes_in_flight_per_sm": in_flight / gpu.sms, "hbm_share": share}


# ---------------------------------------------------------------------------
# The ops: shapes, how to run them, their minimal bytes and FLOPs.
# ---------------------------------------------------------------------------
FITTED = ["ctas", "global_load_requests", "global_load_sectors", "global_load_sectors_ideal", "global_load_bytes",
          "global_store_requests", "global_store_sectors", "global_store_sectors_ideal", "global_store_bytes",
          "unique_load_bytes", "unique_store_bytes", "unique_bytes", "l2_sectors", "smem_requests",
          "smem_wavefronts", "smem_wavefronts_ideal", "mma", "ldmatrix", "cp_async_bytes", "barriers", "load_rounds"]
BF16 = 2  # bytes per element of the profiled dtype (bf16 but for OpSpec.dtype = "float32")


@dataclasses.dataclass
class OpSpec:
    name: str
    shapes: list[dict]           # profiled shapes (small)
    target: dict                 # GPU_REVIEW.md shape
    basis: Callable[[dict], list[float]]  # monomials the counts are fitted on (len == len(shapes))
    run: Callable                # run(ops, shape, take, device="cpu") -> {phase: take()'s result}:
    #                              take() is called before the op, after its forward, after its backward
    min_bytes: Callable[[dict], dict]     # shape -> {phase: bytes}
    flops: Callable[[dict], dict]         # shape -> {phase: {kernel: FLOPs}}
    gemm: Callable[[dict], dict] | None = None  # shape -> {phase: (FLOPs, bytes)} of cuBLAS GEMMs
    dtype: str = "bfloat16"      # the inputs' dtype (the ptxas / SASS instantiation looked up)

    def label(self, shape: dict) -> str:
        return " ".join(f"{k}={v}" for k, v in shape.items())


def _gen():
    return torch.Generator().manual_seed(0)


def _randn(gen, *shape, scale=1.0):
    return (scale * torch.randn(*shape, generator=gen)).to(torch.bfloat16)


def _leaf(t, device):
    """An input that takes gradients, on `device` (made on the CPU from the seeded generator,
    so every device sees the same values)."""
    return t.to(device).requires_grad_()


# MHAR (SPEC 4): sources [N, B, T, d], H heads. Per source element the forward does the
# RMS sum of squares, the logit dot product and the weighted sum (3 FMAs = 6 FLOPs); the
# backward's two passes ~6 FMAs (12 FLOPs).
def _mhar_run(ops, s, take, device="cpu"):
    gen = _gen()
    sources = _leaf(_randn(gen, s["N"], s["B"], s["T"], s["d"]), device)
    query = _leaf(0.3 * torch.randn(s["d"], generator=gen), device)
    norm_weight = _leaf(torch.ones(s["d"]), device)
    grad = _randn(gen, s["B"], s["T"], s["d"]).to(device)
    take()
    out = ops.mhar_route(sources, query, norm_weight, num_heads=s["H"])
    fwd = take()
    out.backward(grad)
    return {"fwd": fwd, "bwd": take()}


# Launches that do another launch's products (an alternative kernel of the same phase).
SAME_FLOPS_AS = {"mhar_route_fwd_staged": "mhar_route_fwd", "mhar_route_bwd_staged": "mhar_route_bwd"}


def _mhar_bytes(s):
    n, p, d, h = s["N"], s["B"] * s["T"], s["d"], s["H"]
    return {"fwd": (n * p * d + p * d) * BF16 + n * p * h * 4,
            "bwd": (2 * n * p * d + p * d) * BF16 + n * p * h * 4}


def _mhar_flops(s):
    e = s["N"] * s["B"] * s["T"] * s["d"]
    return {"fwd": {"mhar_route_fwd": 6 * e}, "bwd": {"mhar_route_bwd": 12 * e}}


# QKV projection (SPEC 2), qk-norm + rope + q scale: the GEMM is cuBLAS (at::mm), the
# kernels are its epilogue (split, transpose, norm, rope) and the backward's.
def _qkv_layout(s):
    import headwise

    return headwise.QKVLayout(s["Hq"], s["Hkv"], s["dh"])


def _qkv_run(ops, s, take, device="cpu"):
    from .qkv import rope_tables

    gen = _gen()
    layout = _qkv_layout(s)
    x = _leaf(_randn(gen, s["B"], s["S"], s["D"]), device)
    w = _leaf(_randn(gen, layout.num_rows, s["D"], scale=s["D"] ** -0.5), device)
    qn, kn = (_leaf(_randn(gen, s["dh"], scale=0.1).add(1), device) for _ in range(2))
    rope = tuple(t.to(device=device, dtype=torch.bfloat16) for t in rope_tables(s["S"], s["dh"], "cpu"))
    heads = {"q": s["Hq"], "k": s["Hkv"], "v": s["Hkv"]}
    grads = [torch.randn(s["B"], heads[n], s["S"], s["dh"], generator=gen).to(device=device, dtype=torch.bfloat16)
             for n in ("q", "k", "v")]
    take()
    outs = ops.qkv_project(x, w, None, layout=layout, q_norm=qn, k_norm=kn, rope=rope, scale_q=s["dh"] ** -0.5)
    fwd = take()
    torch.autograd.backward(outs, grads)
    return {"fwd": fwd, "bwd": take()}


def _qkv_n(s):
    return (s["Hq"] + 2 * s["Hkv"]) * s["dh"]


def _qkv_bytes(s):
    m, n, k = s["B"] * s["S"], _qkv_n(s), s["D"]
    # fwd: x and W in, q/k/v out; bwd: dq/dk/dv, x, W in, dx, dW out (the packed GEMM
    # output kept for the norm's backward is read once more).
    return {"fwd": (m * k + n * k + m * n) * BF16, "bwd": (3 * m * n + 2 * m * k + 2 * n * k) * BF16}


def _qkv_flops(s):
    m, n = s["B"] * s["S"], _qkv_n(s)
    # Epilogue per element: norm (sum of squares, scale) and rope: ~6 FLOPs; backward ~12.
    return {"fwd": {"qkv_epilogue_fwd": 6 * m * n}, "bwd": {"qkv_epilogue_bwd": 12 * m * n}}


def _qkv_gemm(s):
    m, n, k = s["B"] * s["S"], _qkv_n(s), s["D"]
    one = (2 * m * n * k, (m * k + n * k + m * n) * BF16)
    return {"fwd": [one], "bwd": [one, one]}  # dx = dP W, dW = dP^T x


# Head merge (SPEC 3): z [B, H, Q, Dv] head-major, W_O [D, H*Dv], bias; "stats" also
# returns the per-head norms. fwd: 2*B*Q*H*Dv*D FLOPs (stats: the per-head products are the
# same FMAs); bwd: dZ and dW, twice that.
def _merge_tensors(s, gen, device):
    z = _leaf(_randn(gen, s["B"], s["H"], s["Q"], s["Dv"]), device)
    w = _leaf(_randn(gen, s["D"], s["H"] * s["Dv"], scale=(s["H"] * s["Dv"]) ** -0.5), device)
    bias = _leaf(_randn(gen, s["D"], scale=0.1), device)
    return z, w, bias


def _merge_run(ops, s, take, device="cpu"):
    gen = _gen()
    z, w, bias = _merge_tensors(s, gen, device)
    grad = _randn(gen, s["B"], s["Q"], s["D"]).to(device)
    gate = _gate_rows(s, device)
    take()
    y = ops.head_merge(z, w, bias)
    fwd = take()
    y.backward(grad)
    bwd = take()
    ops.head_merge(z.detach(), w.detach(), bias.detach(), return_stats=True)
    stats = take()
    # Learned per-row gates (the L0 head-removal path): the forward skips closed heads, the
    # backward adds the gate gradient dL/dg[b,h] = <Z[b,h], dY W_h> (head_merge_gate_grad).
    z.grad = w.grad = bias.grad = None
    ops.head_merge(z, w, bias, head_gate=gate).backward(grad)
    return {"fwd": fwd, "bwd": bwd, "stats": stats, "gated": take()}


def _gate_rows(s, device):
    """[B, H] differentiable gates in (0, 1], every fourth head closed (exactly 0)."""
    g = torch.linspace(0.25, 1.0, s["H"]).repeat(s["B"], 1)
    g[:, ::4] = 0.0
    return _leaf(g, device)


def _merge_bytes(s):
    bq, k, d = s["B"] * s["Q"], s["H"] * s["Dv"], s["D"]
    io = (bq * k + d * k + bq * d + d) * BF16
    bwd = (2 * bq * d + 2 * bq * k + 2 * d * k + d) * BF16
    # gated: forward + backward of the open 3/4 of the heads, plus the gates and their gradient.
    open_k = k - (s["H"] + 3) // 4 * s["Dv"]
    gated = (bq * open_k + d * open_k + bq * d + d) * BF16 + (2 * bq * d + 2 * bq * open_k + 2 * d * open_k + d) * BF16
    return {"fwd": io, "stats": io + 2 * bq * s["H"] * 4, "bwd": bwd, "gated": gated + 2 * s["B"] * s["H"] * 4}


def _merge_flops(s):
    f = 2 * s["B"] * s["Q"] * s["H"] * s["Dv"] * s["D"]
    fo = f * (s["H"] - (s["H"] + 3) // 4) // s["H"]  # the open heads of _gate_rows
    # bf16: the tensor-core kernels (merge_tc_kernel.cuh); stats still take the SIMT forward.
    tc = {"head_merge_fwd_tc": f}, {"head_merge_bwd_dz_tc": f, "head_merge_bwd_dw_tc": f}
    return {"fwd": tc[0], "stats": {"head_merge_fwd": f}, "bwd": tc[1],
            "gated": {"head_merge_fwd_tc": fo, "head_merge_bwd_dz_tc": fo, "head_merge_bwd_dw_tc": fo}}


# DCMHA (SPEC 5), R = 2. One compose is ~10 FMAs (20 FLOPs) per (t, s, head): 2 sides x R
# projections and 2 x R + gate terms into the output. Causal attention does, per kept
# (t, s, head), 2*dh (QK^T) + 2*dv (PV) + 2 composes; its backward ~2.5x the matmul part
# plus two compose backwards.
COMPOSE_FLOPS = 20


def _dcmha_weights(s, gen, device):
    import headwise

    b, t, h = s["B"], s["T"], s["H"]
    w1 = torch.randn(b, t, 4, 2, h, generator=gen)
    w1 = w1 * torch.rsqrt(w1.square().mean(-1, keepdim=True) + 1e-6)
    w2 = 0.1 * torch.randn(b, t, 4, 2, h, generator=gen) / h
    g = 0.1 * torch.randn(b, t, 4, h, generator=gen)
    return headwise.DCMHAWeights(*(_leaf(x.to(torch.bfloat16), device) for x in (w1, w2, g)))


def _compose_run(ops, s, take, device="cpu"):
    gen = _gen()
    a = _leaf(_randn(gen, s["B"], s["H"], s["T"], s["T"]), device)
    weights = _dcmha_weights(s, gen, device)
    grad = _randn(gen, s["B"], s["H"], s["T"], s["T"]).to(device)
    take()
    out = ops.dcmha_compose(a, weights, "pre")
    fwd = take()
    out.backward(grad)
    return {"fwd": fwd, "bwd": take()}


def _attention_run(ops, s, take, device="cpu", dtype=torch.bfloat16):
    import headwise

    gen = _gen()
    q, k, v = (_leaf(_randn(gen, s["B"], s["H"], s["T"], s["dh"]).to(dtype), device) for _ in range(3))
    weights = headwise.DCMHAWeights(*(_leaf(x.detach().to(dtype), device) for x in _dcmha_weights(s, gen, device)))
    grad = _randn(gen, s["B"], s["H"], s["T"], s["dh"]).to(device=device, dtype=dtype)
    take()
    out = ops.dcmha_attention(q, k, v, weights)
    fwd = take()
    out.backward(grad)
    return {"fwd": fwd, "bwd": take()}


def _attention_tf32_run(ops, s, take, device="cpu"):
    """fp32 inputs with TF32 allowed: the tensor-core kernels at T = float, forward and
    backward, on _attention_run's values."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        return _attention_run(ops, s, take, device, dtype=torch.float32)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def _weights_bytes(s):
    return s["B"] * s["T"] * 4 * (2 * 2 + 1) * s["H"] * BF16  # W1, W2 [B, T, 4, R, H], G [B, T, 4, H]


def _compose_bytes(s):
    a = s["B"] * s["H"] * s["T"] * s["T"] * BF16
    return {"fwd": 2 * a + _weights_bytes(s), "bwd": 3 * a + 2 * _weights_bytes(s)}


def _compose_flops(s):
    e = s["B"] * s["H"] * s["T"] * s["T"]
    return {"fwd": {"dcmha_compose_fwd": COMPOSE_FLOPS * e},
            "bwd": {"dcmha_compose_bwd": 2 * COMPOSE_FLOPS * e}}


def _attention_bytes(s, elem=BF16):
    qkv = s["B"] * s["H"] * s["T"] * s["dh"] * elem
    stats = 2 * s["B"] * s["H"] * s["T"] * 4
    return {"fwd": 4 * qkv + _weights_bytes(s) + stats, "bwd": 8 * qkv + 2 * _weights_bytes(s) + stats}


def _attention_flops(s):
    pairs = s["B"] * s["H"] * s["T"] * (s["T"] + 1) // 2
    # bf16 (tensor-core kernels, whose FP32 term the model drops): the compose arithmetic
    # of each kernel; the forward's QK^T and PV, the backward's five products on mma.
    return {"fwd": {"dcmha_attn_weights_t": 0, "dcmha_attn_stats": pairs * COMPOSE_FLOPS, "dcmha_attn_stats_combine": 0,
                    "dcmha_attn_partials": pairs * COMPOSE_FLOPS, "dcmha_attn_output": pairs * 4 * s["dh"]},
            "bwd": {"dcmha_attn_weights_t": 0, "dcmha_attn_partials": pairs * COMPOSE_FLOPS,
                    "dcmha_attn_bwd_dpost": pairs * 4, "dcmha_attn_bwd_rowsum": pairs * COMPOSE_FLOPS,
                    "dcmha_attn_bwd_rowsum_combine": 0,
                    "dcmha_attn_bwd_dpre": pairs * COMPOSE_FLOPS, "dcmha_attn_bwd_dq": pairs * 2 * s["dh"],
                    "dcmha_attn_bwd_dkv": pairs * 4 * s["dh"]}}


def _bt(s):
    return s["B"] * s["T"]


OPS: dict[str, OpSpec] = {
    "mhar": OpSpec(
        "mhar_route",
        # B*T >= 1024: the forward's grid is min(B*T, 1024) CTAs (kFwdMaxBlocks), each
        # loading q and g once; the backward's is one CTA per 16-position segment
        # (kBwdSegment), each writing one row of parameter-gradient partials: both
        # linear in B*T from here on.
        shapes=[dict(N=9, B=1, T=T, d=4096, H=8) for T in (1024, 2048)],
        target=dict(N=9, B=2, T=4096, d=4096, H=8),
        basis=lambda s: [1.0, _bt(s)],
        run=_mhar_run, min_bytes=_mhar_bytes, flops=_mhar_flops),
    "qkv": OpSpec(
        "qkv_project",
        # B*S >= 528: the backward's grid is min(B*S, 528) CTAs (kBwdVecBlocks). D does
        # not enter the kernels (the GEMMs are cuBLAS), so it is small here.
        shapes=[dict(B=1, S=S, D=64, Hq=32, Hkv=32, dh=128) for S in (1024, 2048)],
        target=dict(B=4, S=4096, D=4096, Hq=32, Hkv=32, dh=128),
        basis=lambda s: [1.0, s["B"] * s["S"]],
        run=_qkv_run, min_bytes=_qkv_bytes, flops=_qkv_flops, gemm=_qkv_gemm),
    "merge": OpSpec(
        "head_merge",
        # Q and D multiples of the tensor-core forward's 128 x 128 tile (its CTA count is
        # then linear in Q and D); D in (256, 512): the bias gradient's finalize grid is
        # ceil(D / 256) CTAs.
        shapes=[dict(B=1, H=32, Q=Q, Dv=128, D=D) for Q in (128, 256) for D in (256, 512)],
        target=dict(B=4, H=32, Q=4096, Dv=128, D=4096),
        basis=lambda s: [1.0, s["B"] * s["Q"], s["D"], s["B"] * s["Q"] * s["D"]],
        run=_merge_run, min_bytes=_merge_bytes, flops=_merge_flops),
    "dcmha_compose": OpSpec(
        "dcmha_compose",
        # T a multiple of 128: the tile kernels' grid is ceil(T / 128)^2 B CTAs (128 columns x
        # 128 rows each, kComposeColumns / kComposeRows), and their gradient partials are
        # ceil(T / 128) x [B T, 5H]: exactly the basis below from here on.
        shapes=[dict(B=1, H=32, T=T) for T in (128, 256, 384)],
        target=dict(B=8, H=32, T=4096),
        basis=lambda s: [s["B"], s["B"] * s["T"], s["B"] * s["T"] ** 2],
        run=_compose_run, min_bytes=_compose_bytes, flops=_compose_flops),
    "dcmha": OpSpec(
        "dcmha_attention",
        # T >= 64: full 64-row query tiles; every kernel's work is linear in the heads
        # (per-head tiles, rank-2 compose), so the fit scales with B*H; H = 32 in one group,
        # as at the target, because the sweeps' shared memory (so their CTAs per SM) grows
        # with the group's heads.
        shapes=[dict(B=1, H=32, T=T, dh=128) for T in (64, 128, 192)],
        target=dict(B=8, H=32, T=4096, dh=128),
        basis=lambda s: [s["B"] * s["H"], s["B"] * s["H"] * s["T"], s["B"] * s["H"] * s["T"] ** 2],
        run=_attention_run, min_bytes=_attention_bytes, flops=_attention_flops),
}
# dcmha's shapes with fp32 inputs under allow_tf32 (the kernels at T = float), under its own
# name: calibrate and the tables key phases by it.
OPS["dcmha_tf32"] = dataclasses.replace(OPS["dcmha"], name="dcmha_attention tf32", run=_attention_tf32_run,
                                        min_bytes=lambda s: _attention_bytes(s, elem=4), dtype="float32")


# ---------------------------------------------------------------------------
# Profiling, fitting, estimating.
# ---------------------------------------------------------------------------
def _resolve_lines(records: list[dict]) -> None:
    """Name the source line of each worst call site (addr2line on the profile library)."""
    addr2line = shutil.which("addr2line")
    by_module: dict[str, set[int]] = {}
    for r in records:
        for ln in r["lines"]:
            by_module.setdefault(ln["module"], set()).add(ln["offset"])
    names: dict[tuple[str, int], str] = {}
    for module, offsets in by_module.items():
        if not addr2line or not module:
            continue
        offsets = sorted(offsets)
        out = subprocess.run([addr2line, "-a", "-i", "-f", "-C", "-e", module, *map(hex, offsets)],
                             capture_output=True, text=True).stdout.splitlines()
        # addr2line -a -f -i prints: address, then (function, file:line) pairs, innermost first.
        frames: list[list[tuple[str, str]]] = []
        cur: list[tuple[str, str]] = []
        it = iter(out)
        for line in it:
            if line.startswith("0x"):
                cur = []
                frames.append(cur)
            else:
                cur.append((line, next(it, "??:0")))
        for off, fr in zip(offsets, frames):
            # The innermost frame in headwise's own sources (not torch's or libstdc++'s headers).
            mine = [(fn, loc) for fn, loc in fr if "/csrc/" in loc] or fr
            fn, loc = mine[0] if mine else ("??", "??:0")
            names[(module, off)] = f"{loc.split('/csrc/')[-1].split(' ')[0]} ({fn.split('(')[0]})"
    for r in records:
        for ln in r["lines"]:
            ln["source"] = names.get((ln["module"], ln["offset"]), hex(ln["offset"]))


def profile_op(key: str, ops, lib) -> list[dict]:
    """Launch records of op `key` at each profiled shape, tagged with op, phase, shape."""
    spec = OPS[key]
    records = []
    for shape in spec.shapes:
        lib.sim_profile_take()  # drop anything recorded before
        phases = spec.run(ops, shape, lambda: json.loads(lib.sim_profile_take()))
        for phase, launches in phases.items():
            for launch in launches:
                launch.update(op=f"{spec.name} {phase}", op_key=key, phase=phase, shape=dict(shape), dtype=spec.dtype)
                records.append(launch)
    _resolve_lines(records)
    return records


# Launches whose name is not their CUDA function's, or whose instantiation the name fixes
# at the aligned target shapes (16-byte copies; dh, dv = 128): the function and its
# template arguments after the dtype.
LAUNCH_FUNCTIONS = {
    "head_merge_fwd_tc": ("head_merge_fwd_tc_kernel", "16, false"),
    "head_merge_stats_tc": ("head_merge_fwd_tc_kernel", "16, true"),
    "head_merge_bwd_dz_tc": ("head_merge_bwd_dz_tc_kernel", "16"),
    "head_merge_bwd_dw_tc": ("head_merge_bwd_dw_tc_kernel", "16"),
    "dcmha_attn_stats": ("dcmha_attn_sweep", "false"),
    "dcmha_attn_partials": ("dcmha_attn_sweep", "true"),
    "dcmha_attn_output": ("dcmha_attn_output", "16"),
    # The backward's sweeps and key kernel at the target: two buffers of their streamed tiles.
    "dcmha_attn_bwd_dpost": ("dcmha_attn_bwd_sweep", "false, 2"),
    "dcmha_attn_bwd_dpre": ("dcmha_attn_bwd_sweep", "true, 2"),
    "dcmha_attn_bwd_rowsum": ("dcmha_attn_bwd_rows", "false, 4, 2"),
    "dcmha_attn_bwd_dq": ("dcmha_attn_bwd_rows", "true, 16, 1"),
    "dcmha_attn_bwd_dkv": ("dcmha_attn_bwd_keys", "8, 2"),
    # fp32 (TF32) takes one head a rowsum CTA (rowsum_heads).
    ("dcmha_attn_bwd_rowsum", "float32"): ("dcmha_attn_bwd_rows", "false, 4, 1"),
}


def launch_report(reports: list, kernel: str, dtype: str, key):
    """The report (ptxas or sass) of a launch: its exact instantiation where
    LAUNCH_FUNCTIONS names it, else ptxas.lookup's choice by `key`."""
    if kernel in LAUNCH_FUNCTIONS:
        fn, args = LAUNCH_FUNCTIONS.get((kernel, dtype)) or LAUNCH_FUNCTIONS[kernel]
        want = f"::{fn}<{ptxas.CPP_DTYPES.get(dtype, dtype)}, {args}>("
        return next((r for r in reports if want in r.function), None)
    return ptxas.lookup(reports, kernel, dtype, key=key)


def _finish(rec: dict, spec: OpSpec, shape: dict, reports, issue_reports=None) -> dict:
    """Add occupancy, the op's minimal bytes/FLOPs and the estimate to a launch record."""
    threads = rec["block"][0] * rec["block"][1] * rec["block"][2]
    rep = launch_report(reports, rec["kernel"], rec["dtype"], key=lambda r: r.registers)
    rec["registers"] = rep.registers if rep else None
    rec["spill_bytes"] = (rep.spill_stores + rep.spill_loads) if rep else None
    rec["static_smem_bytes"] = rep.static_smem if rep else None
    loop = launch_report(issue_reports or [], rec["kernel"], rec["dtype"], key=lambda r: r.issue_per_hmma)
    rec["issue_per_hmma"] = loop.issue_per_hmma if loop else None
    rec["threads"] = threads
    rec["ctas_per_sm"] = ctas_per_sm(threads, rec["registers"], rec["dynamic_smem_bytes"] + (rec["static_smem_bytes"] or 0))
    rec["min_bytes"] = spec.min_bytes(shape)[rec["phase"]]
    flops = spec.flops(shape)[rec["phase"]]
    rec["min_flops"] = sum(flops.values())
    rec.update(estimate(rec, flops.get(rec["kernel"], flops.get(SAME_FLOPS_AS.get(rec["kernel"]), 0))))
    return rec


def fit_target(key: str, records: list[dict], reports, issue_reports=None) -> list[dict]:
    """Launch records at the op's target shape: every count in FITTED fitted exactly on the
    op's basis over the profiled shapes, evaluated at the target."""
    spec = OPS[key]
    runs = [[r for r in records if r["shape"] == s] for s in spec.shapes]
    names = [[(r["phase"], r["kernel"]) for r in run] for run in runs]
    if any(n != names[0] for n in names):
        raise RuntimeError(f"{spec.name}: the profiled shapes launch different kernels: {names}")
    a = np.array([spec.basis(s) for s in spec.shapes], dtype=np.float64)
    at = np.array(spec.basis(spec.target), dtype=np.float64)
    out = []
    for i, (phase, kernel) in enumerate(names[0]):
        base = runs[-1][i]
        rec = {k: v for k, v in base.items() if k not in FITTED}
        for field in FITTED:
            y = np.array([run[i][field] for run in runs], dtype=np.float64)
            coef = np.linalg.solve(a, y)
            rec[field] = max(0.0, float(at @ coef))
        rec["ctas"] = round(rec["ctas"])
        rec["shape"] = dict(spec.target)
        rec["scaled_from"] = [dict(s) for s in spec.shapes]
        # Per-request ratios describe the access pattern, not the size: measured at the
        # largest profiled shape, not fitted.
        rec["ratios"] = ratios(base)
        out.append(_finish(rec, spec, spec.target, reports, issue_reports))
    return out


def gemm_rows(key: str) -> list[dict]:
    """Analytic rows for the cuBLAS GEMMs an op runs (not emulated): max(bytes / HBM,
    FLOPs / mma ceiling), at the 16-bit tensor-core ceiling (the ops with GEMMs profile
    bf16 / fp16 inputs; an fp32 op would need its TF32 or FP32 ceiling here)."""
    spec = OPS[key]
    if spec.gemm is None:
        return []
    if spec.dtype not in ("bfloat16", "float16"):
        raise ValueError(f"{key}: analytic GEMM rows are for 16-bit inputs, not {spec.dtype}")
    rows = []
    for phase, gemms in spec.gemm(spec.target).items():
        for flops, nbytes in gemms:
            t = {"hbm": nbytes / H200.hbm_bytes_per_s, "mma": flops / H200.mma_flops_per_s}
            bound = max(t, key=t.get)
            rows.append({"kernel": "cuBLAS GEMM (analytic)", "op": f"{spec.name} {phase}", "op_key": key, "phase": phase,
                         "shape": dict(spec.target), "dtype": spec.dtype, "min_bytes": nbytes, "min_flops": flops,
                         "est_us": t[bound] * 1e6, "est_bound": bound})
    return rows


def _ratio(n, d):
    return n / d if d else float("nan")


def ratios(rec: dict) -> dict:
    """Sectors (wavefronts) per request, measured and ideal, of a launch record."""
    out = {}
    for kind in ("load", "store"):
        out[f"{kind}_sectors_per_request"] = _ratio(rec[f"global_{kind}_sectors"], rec[f"global_{kind}_requests"])
        out[f"{kind}_sectors_per_request_ideal"] = _ratio(rec[f"global_{kind}_sectors_ideal"],
                                                          rec[f"global_{kind}_requests"])
    out["smem_wavefronts_per_request"] = _ratio(rec["smem_wavefronts"], rec["smem_requests"])
    out["smem_wavefronts_per_request_ideal"] = _ratio(rec["smem_wavefronts_ideal"], rec["smem_requests"])
    return out


def format_tables(targets: list[dict], gpu: GpuModel = H200) -> str:
    const = ", ".join(f"{f.name}={getattr(gpu, f.name):g}" for f in dataclasses.fields(gpu) if f.name != "name")
    lines = [f"H200 ESTIMATE from emulated memory counts (no GPU measured). Model constants ({gpu.name}): {const}; "
             f"bytes in flight needed = {gpu.bytes_in_flight_needed / 1e6:.2f} MB "
             f"({gpu.bytes_in_flight_needed / gpu.sms / 1024:.1f} KiB per SM)", ""]
    head = (f"{'kernel':<27} {'CTAs':>8} {'ld sec/req':>10} {'(ideal)':>7} {'st sec/req':>10} {'(ideal)':>7} "
            f"{'smem wf/req':>11} {'(ideal)':>7} {'uniq MB':>9} {'L2 MB':>10} {'regs':>5} {'CTA/SM':>6} "
            f"{'KiB fly/SM':>10} {'est us':>10} {'bound':>5}")
    by_op: dict[str, list[dict]] = {}
    for r in targets:
        by_op.setdefault(r["op"], []).append(r)
    for op, rows in by_op.items():
        spec = OPS[rows[0]["op_key"]]
        total = sum(r["est_us"] for r in rows)
        minb, minf = rows[0]["min_bytes"], rows[0]["min_flops"]
        floor_us = minb / gpu.hbm_bytes_per_s * 1e6
        dtype = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(spec.dtype, spec.dtype)
        lines += [f"{op}  {spec.label(rows[0]['shape'])}  {dtype}   min bytes {minb / 1e6:.1f} MB, min FLOPs "
                  f"{minf / 1e9:.1f} G; HBM floor {floor_us:.1f} us; estimate {total:.1f} us "
                  f"({100 * floor_us / total:.0f}% of HBM)", head]
        for r in rows:
            if "ctas" not in r:  # analytic GEMM row
                lines.append(f"{r['kernel']:<27} {'':>96} {r['est_us']:>10.1f} {r['est_bound']:>5}")
                continue
            q = r["ratios"]
            lines.append(
                f"{r['kernel']:<27} {r['ctas']:>8} {q['load_sectors_per_request']:>10.2f} "
                f"{q['load_sectors_per_request_ideal']:>7.2f} {q['store_sectors_per_request']:>10.2f} "
                f"{q['store_sectors_per_request_ideal']:>7.2f} {q['smem_wavefronts_per_request']:>11.2f} "
                f"{q['smem_wavefronts_per_request_ideal']:>7.2f} {r['unique_bytes'] / 1e6:>9.1f} "
                f"{r['l2_sectors'] * 32 / 1e6:>10.1f} {r['registers'] or '?':>5} {r['ctas_per_sm']:>6} "
                f"{r['bytes_in_flight_per_sm'] / 1024:>10.1f} {r['est_us']:>10.1f} {r['est_bound']:>5}")
        lines.append("")
    lines.append("Per-request ratios measured at the largest profiled shape; counts, MB and times fitted to the "
                 "shape shown (python/headwise/bench/sim_profile.py). L2 MB counts every sector of every request "
                 "(no L1 hits).")
    return "\n".join(lines)


def format_worst_lines(records: list[dict], per_kernel: int = 3) -> str:
    """Per kernel, the source lines with the most sectors (wavefronts) above the ideal at
    the largest profiled shape (call sites of one line summed)."""
    lines = ["Worst access lines (largest profiled shape; excess = sectors or wavefronts above the ideal):"]
    seen = set()
    for r in reversed(records):
        if (r["op"], r["kernel"]) in seen:
            continue
        seen.add((r["op"], r["kernel"]))
        merged: dict[tuple, list[int]] = {}
        for ln in r["lines"]:
            unit = "sectors" if ln["space"] == "global" else "wavefronts"
            m = merged.setdefault((ln["space"], ln["access"], ln["source"], unit), [0, 0, 0])
            m[0] += ln["requests"]
            m[1] += ln[unit]
            m[2] += ln[unit + "_ideal"]
        worst = sorted(merged.items(), key=lambda kv: kv[1][2] - kv[1][1])[:per_kernel]
        for (space, access, source, unit), (req, got, ideal) in worst:
            if got > ideal:
                lines.append(f"  {r['op']:<24} {r['kernel']:<27} {space:<6} {access:<5} {source:<58} {req:>8} req "
                             f"{got / req:>6.2f} {unit}/req (ideal {ideal / req:.2f})")
    return "\n".join(lines)


def main(op_keys: list[str], json_path: str | None) -> int:
    from ..ops import load_profile_library

    ops = load_profile_library()
    lib = torch.ops.headwise_sim_profile
    reports = ptxas.load("90")
    issue_reports = sass.load("90")
    lib.sim_profile_enable(True)
    try:
        measured, targets = [], []
        for key in op_keys:
            start = time.perf_counter()
            recs = profile_op(key, ops, lib)
            print(f"profiled {key} at {len(OPS[key].shapes)} shapes in {time.perf_counter() - start:.0f} s", flush=True)
            for rec in recs:
                _finish(rec, OPS[key], rec["shape"], reports, issue_reports)
            measured += recs
            targets += fit_target(key, recs, reports, issue_reports) + gemm_rows(key)
    finally:
        lib.sim_profile_enable(False)
    if not reports:
        print("note: no bench/ptxas_sm90.txt (python -m headwise.bench.ptxas): registers do not limit CTAs/SM below")
    print(format_tables(targets))
    print(format_worst_lines(measured))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"note": "est_* fields are H200 ESTIMATES from emulated memory counts, not measurements",
                       "gpu_model": dataclasses.asdict(H200), "launches": measured, "targets": targets}, f, indent=1)
        print(f"wrote {json_path}")
    return 0
