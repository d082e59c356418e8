"""Typed wrappers of the headwise ops, with fake (meta) kernels and autograd.

Each op is registered for two libraries with identical schemas: ``headwise`` (CPU and
CUDA kernels) and ``headwise_sim`` (the CUDA kernels run by the SIMT emulator on CPU
tensors). :class:`Ops` binds the public functions to one of them; the module-level
functions use ``headwise``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

LIBRARIES = ("headwise", "headwise_sim")
# The profile library: the ops of headwise_sim, with kernels that count their memory
# accesses (python -m headwise.bench --sim-profile). Loaded only by load_profile_library().
PROFILE_LIBRARY = "headwise_sim_profile"
_registered: set[str] = set()


def weights_dtype(sources: torch.Tensor) -> torch.dtype:
    """dtype of the routing weights (and of a DepthBuffer's gradient accumulator)."""
    return torch.float64 if sources.dtype == torch.float64 else torch.float32


class HeadMergeStats(NamedTuple):
    """Per-head statistics of :func:`head_merge` (``return_stats=True``), float32
    ``[B, Q, H]`` each, from the merge's own pass. ``z_norm``: the row L2 norm of the
    pre-projection head output ``Z[b,h,q,:]`` (the AHON score's input); ``out_norm``: the
    row L2 norm of its projected contribution ``Z[b,h,q,:] @ W_O(h)^T`` (the circuit-based
    score's input). Both are ungated (neither the gate nor the rescale is applied) and 0
    for a head whose gate is exactly 0 for that batch row."""

    z_norm: torch.Tensor
    out_norm: torch.Tensor


def _layout_like(z: torch.Tensor) -> torch.Tensor:
    """An empty tensor in z's layout: the rule of the kernels (csrc/merge/merge_args.h)."""
    return torch.empty_like(z)


def _register_merge(ns: str) -> None:
    merge = f"{ns}::head_merge"

    @torch.library.register_fake(merge)
    def _(z, weight_o, bias, head_gate, rescale, return_stats):
        b, h, q, dv = z.shape
        out = z.new_empty((b, q, weight_o.shape[0]))
        stats_shape = (b, q, h) if return_stats else (0,)
        return out, z.new_empty(stats_shape, dtype=torch.float32), z.new_empty(stats_shape, dtype=torch.float32)

    @torch.library.register_fake(f"{ns}::head_merge_backward")
    def _(grad_out, z, weight_o, head_gate, rescale, bias_grad, gate_grad):
        grad_bias = z.new_empty((weight_o.shape[0],) if bias_grad else (0,))
        if gate_grad and head_gate is not None:
            grad_gate = head_gate.new_empty(head_gate.shape)
        else:
            grad_gate = z.new_empty((0,))
        return _layout_like(z), weight_o.new_empty(weight_o.shape), grad_bias, grad_gate

    def setup_context(ctx, inputs, output):
        z, weight_o, bias, head_gate, rescale, return_stats = inputs
        ctx.save_for_backward(z, weight_o, head_gate)
        ctx.rescale = rescale
        ctx.has_bias = bias is not None
        _, z_norm, out_norm = output
        ctx.mark_non_differentiable(z_norm, out_norm)

    def backward(ctx, grad_out, _grad_z_norm, _grad_out_norm):
        z, weight_o, head_gate = ctx.saved_tensors
        need = ctx.needs_input_grad
        bias_grad = ctx.has_bias and need[2]
        gate_grad = head_gate is not None and need[3]
        grad_z, grad_w, grad_b, grad_g = getattr(torch.ops, ns).head_merge_backward(
            grad_out.to(z.dtype).contiguous(), z, weight_o, head_gate, ctx.rescale, bias_grad, gate_grad
        )
        return (
            grad_z if need[0] else None,
            grad_w if need[1] else None,
            grad_b if bias_grad else None,
            grad_g if gate_grad else None,
            None,
            None,
        )

    torch.library.register_autograd(merge, backward, setup_context=setup_context)


def _register(ns: str) -> None:
    route = f"{ns}::mhar_route"
    route_backward = f"{ns}::mhar_route_backward"

    @torch.library.register_fake(route)
    def _(sources, query, norm_weight, num_heads, num_sources, eps, residual, gate):
        _, b, t, d = sources.shape
        torch._check(d % num_heads == 0, lambda: f"num_heads ({num_heads}) must divide d ({d})")
        out = sources.new_empty((b, t, d))
        weights = sources.new_empty((num_sources, b, t, num_heads), dtype=weights_dtype(sources))
        return out, weights

    @torch.library.register_fake(route_backward)
    def _(grad_out, sources, query, norm_weight, weights, gate, num_heads, num_sources, eps):
        return (
            torch.empty(sources.shape, dtype=sources.dtype, device=sources.device),
            query.new_empty(query.shape),
            norm_weight.new_empty(norm_weight.shape),
            gate.new_empty(gate.shape) if gate is not None else weights.new_empty(()),
        )

    @torch.library.register_fake(f"{ns}::mhar_route_backward_into")
    def _(grad_out, sources, query, norm_weight, weights, grad_sources, num_heads, num_sources, eps, accumulate):
        return query.new_empty(query.shape), norm_weight.new_empty(norm_weight.shape)

    def setup_context(ctx, inputs, output):
        sources, query, norm_weight, num_heads, num_sources, eps, residual, gate = inputs
        _, weights = output
        ctx.save_for_backward(sources, query, norm_weight, weights, gate)
        ctx.num_heads, ctx.num_sources, ctx.eps = num_heads, num_sources, eps
        ctx.has_residual = residual is not None
        ctx.mark_non_differentiable(weights)

    def backward(ctx, grad_out, _grad_weights):
        sources, query, norm_weight, weights, gate = ctx.saved_tensors
        grad_out = grad_out.to(sources.dtype).contiguous()
        grad_sources, grad_query, grad_norm, grad_gate = getattr(torch.ops, ns).mhar_route_backward(
            grad_out, sources, query, norm_weight, weights, gate, ctx.num_heads, ctx.num_sources, ctx.eps
        )
        grad_residual = grad_out if ctx.has_residual else None
        grad_gate = grad_gate if gate is not None else None
        return grad_sources, grad_query, grad_norm, None, None, None, grad_residual, grad_gate

    torch.library.register_autograd(route, backward, setup_context=setup_context)


def _register_qkv(ns: str) -> None:
    """Fake kernels and autograd of qkv_project (SPEC section 2) for library ``ns``."""
    project = f"{ns}::qkv_project"

    @torch.library.register_fake(project)
    def _(x, weight, bias, head_offsets, hq, hkv, d, dv, q_norm, k_norm, norm_eps, rope_cos, rope_sin, scale_q,
          rope_style=0):
        b, s, _ = x.shape
        torch._check(weight.shape[0] == hq * d + hkv * (d + dv), lambda: "weight rows must match the layout")
        q = x.new_empty((b, hq, s, d))
        k = x.new_empty((b, hkv, s, d))
        v = x.new_empty((b, hkv, s, dv))
        packed = x.new_empty((b * s, weight.shape[0])) if (q_norm is not None or k_norm is not None) else x.new_empty((0,))
        return q, k, v, packed

    @torch.library.register_fake(f"{ns}::qkv_project_backward")
    def _(grad_q, grad_k, grad_v, x, weight, bias, packed, head_offsets, hq, hkv, d, dv, q_norm, k_norm,
          norm_eps, rope_cos, rope_sin, scale_q, rope_style=0):
        empty = x.new_empty((0,))
        return (
            x.new_empty(x.shape),
            weight.new_empty(weight.shape),
            bias.new_empty(bias.shape) if bias is not None else empty,
            q_norm.new_empty(q_norm.shape) if q_norm is not None else empty,
            k_norm.new_empty(k_norm.shape) if k_norm is not None else empty,
        )

    def setup_context(ctx, inputs, output):
        x, weight, bias, head_offsets, hq, hkv, d, dv, q_norm, k_norm, norm_eps, cos, sin, scale_q = inputs[:14]
        rope_style = inputs[14] if len(inputs) > 14 else 0
        packed = output[3]
        # Saved: the inputs, and the bias-free product only when a norm needs its statistic.
        ctx.save_for_backward(x, weight, bias, q_norm, k_norm, cos, sin, packed)
        ctx.args = (head_offsets, hq, hkv, d, dv)
        ctx.norm_eps, ctx.scale_q, ctx.rope_style, ctx.num_inputs = norm_eps, scale_q, rope_style, len(inputs)
        ctx.mark_non_differentiable(packed)

    def backward(ctx, grad_q, grad_k, grad_v, _grad_packed):
        x, weight, bias, q_norm, k_norm, cos, sin, packed = ctx.saved_tensors
        head_offsets, hq, hkv, d, dv = ctx.args
        b, s, _ = x.shape

        def grad_or_zeros(g, shape):
            return torch.zeros(shape, dtype=x.dtype, device=x.device) if g is None else g.to(x.dtype)

        grad_q = grad_or_zeros(grad_q, (b, hq, s, d))
        grad_k = grad_or_zeros(grad_k, (b, hkv, s, d))
        grad_v = grad_or_zeros(grad_v, (b, hkv, s, dv))
        gx, gw, gb, gqn, gkn = getattr(torch.ops, ns).qkv_project_backward(
            grad_q, grad_k, grad_v, x, weight, bias, packed, head_offsets, hq, hkv, d, dv, q_norm, k_norm,
            ctx.norm_eps, cos, sin, ctx.scale_q, ctx.rope_style,
        )
        grads = (
            gx, gw, gb if bias is not None else None, None, None, None, None, None,
            gqn if q_norm is not None else None, gkn if k_norm is not None else None, None, None, None, None,
        )
        return grads + (None,) * (ctx.num_inputs - len(grads))

    torch.library.register_autograd(project, backward, setup_context=setup_context)


def _register_dcmha(ns: str) -> None:
    """Fake kernels and autograd of the DCMHA ops (SPEC section 5) for library ``ns``."""
    compose = f"{ns}::dcmha_compose"
    attention = f"{ns}::dcmha_attention"

    @torch.library.register_fake(compose)
    def _(a, w1, w2, g, slot, head_groups):
        return a.new_empty(a.shape)

    @torch.library.register_fake(f"{ns}::dcmha_compose_backward")
    def _(grad, a, w1, w2, g, slot, head_groups):
        return a.new_empty(a.shape), w1.new_empty(w1.shape), w2.new_empty(w2.shape), g.new_empty(g.shape)

    def compose_setup(ctx, inputs, output):
        a, w1, w2, g, slot, head_groups = inputs
        ctx.save_for_backward(a, w1, w2, g)
        ctx.args = (slot, head_groups)

    def compose_backward(ctx, grad):
        a, w1, w2, g = ctx.saved_tensors
        da, dw1, dw2, dg = getattr(torch.ops, ns).dcmha_compose_backward(grad.contiguous(), a, w1, w2, g, *ctx.args)
        return da, dw1, dw2, dg, None, None

    torch.library.register_autograd(compose, compose_backward, setup_context=compose_setup)

    @torch.library.register_fake(attention)
    def _(q, k, v, w1, w2, g, causal, window, scale, head_groups):
        b, h, t, _ = q.shape
        stats_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        return q.new_empty((b, h, t, v.shape[-1])), q.new_empty((2, b, h, t), dtype=stats_dtype)

    @torch.library.register_fake(f"{ns}::dcmha_attention_backward")
    def _(grad_out, q, k, v, w1, w2, g, stats, causal, window, scale, head_groups):
        return tuple(x.new_empty(x.shape) for x in (q, k, v, w1, w2, g))

    def attention_setup(ctx, inputs, output):
        q, k, v, w1, w2, g, causal, window, scale, head_groups = inputs
        _, stats = output
        # Saved: the inputs and the [2, B, H, T] row statistics; never a [B, H, T, T] tensor.
        ctx.save_for_backward(q, k, v, w1, w2, g, stats)
        ctx.args = (causal, window, scale, head_groups)
        ctx.mark_non_differentiable(stats)
        # fp32: torch's float32 matmul setting as the forward ran. The backward op reads the
        # setting again to take the forward's path (TF32 tensor cores or full precision), whose
        # logits the saved statistics normalize; a setting changed in between is an error.
        ctx.fp32_precision = _cuda_fp32_matmul_precision() if q.dtype == torch.float32 else None

    def attention_backward(ctx, grad_out, _grad_stats):
        q, k, v, w1, w2, g, stats = ctx.saved_tensors
        if ctx.fp32_precision is not None and _cuda_fp32_matmul_precision() != ctx.fp32_precision:
            raise RuntimeError(
                "headwise.dcmha_attention: torch's float32 matmul precision for CUDA changed between the forward "
                f"({ctx.fp32_precision!r}) and the backward ({_cuda_fp32_matmul_precision()!r}); fp32 takes TF32 "
                "tensor cores or full precision by it, and both passes must take the same")
        grads = getattr(torch.ops, ns).dcmha_attention_backward(
            grad_out.to(q.dtype).contiguous(), q, k, v, w1, w2, g, stats, *ctx.args
        )
        return (*grads, None, None, None, None)

    torch.library.register_autograd(attention, attention_backward, setup_context=attention_setup)


def _cuda_fp32_matmul_precision() -> Optional[str]:
    """torch.backends.cuda.matmul.fp32_precision ("tf32", "ieee", "none": what
    allow_tf32 and set_float32_matmul_precision set too), None on a torch without it. Read
    through the new API: the legacy allow_tf32 raises once only the new one was set."""
    return getattr(torch.backends.cuda.matmul, "fp32_precision", None)


def dcmha_weights(x: torch.Tensor, dw1: torch.Tensor, qkw: torch.Tensor, dd: torch.Tensor):
    """The dynamic compose weights of DCMHA (SPEC section 5): a :class:`headwise.DCMHAWeights`
    ``(w1 [B, T, 4, R, H] normalized over heads, w2 [B, T, 4, R, H], g [B, T, 4, H])``.

    ``x [B, T, D]`` (the attention input after its norm), ``dw1 [D, 4, Kh]``,
    ``qkw [4, Kh, 2R, H]``, ``dd [D, 4H]``. This is a composite of torch ops on purpose:
    it is two small GEMMs (``D x 4Kh`` and ``D x 4H``, which BLAS / cuBLAS already run at
    peak), a batched ``Kh x 2RH`` contraction per slot, gelu, tanh and an RMS over H, all
    O(B T D H) work with O(B T H) outputs, with autograd for free; the head-axis work
    that needs a kernel is the O(B H T^2) compose inside attention. Accumulates in fp32
    (fp64 for fp64) and returns x's dtype. Differentiable in every argument.
    """
    from .dcmha import RANK, DCMHAWeights

    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise ValueError("headwise.dcmha_weights: x must be a 3-D tensor [B, T, D]")
    b, t, d = x.shape
    if dw1.dim() != 3 or dw1.shape[0] != d or dw1.shape[1] != 4:
        raise ValueError(f"headwise.dcmha_weights: dw1 must be [D={d}, 4, Kh], got {list(dw1.shape)}")
    kh = dw1.shape[2]
    if qkw.dim() != 4 or tuple(qkw.shape[:3]) != (4, kh, 2 * RANK):
        raise ValueError(f"headwise.dcmha_weights: qkw must be [4, Kh={kh}, {2 * RANK}, H], got {list(qkw.shape)}")
    h = qkw.shape[3]
    if tuple(dd.shape) != (d, 4 * h):
        raise ValueError(f"headwise.dcmha_weights: dd must be [D={d}, 4H={4 * h}], got {list(dd.shape)}")
    acc = torch.promote_types(x.dtype, torch.float32)
    x2 = x.reshape(b * t, d).to(acc)
    hid = torch.nn.functional.gelu((x2 @ dw1.to(acc).reshape(d, 4 * kh)).view(b * t, 4, kh))
    # Per slot c: [BT, Kh] @ [Kh, 2R H] as one batched GEMM over the 4 slots.
    w = torch.bmm(hid.transpose(0, 1), qkw.to(acc).reshape(4, kh, 2 * RANK * h)).transpose(0, 1)
    w = w.reshape(b, t, 4, 2 * RANK, h)
    w1, w2 = w[..., :RANK, :], w[..., RANK:, :]
    w1 = w1 * torch.rsqrt(w1.square().mean(dim=-1, keepdim=True) + 1e-6)
    g = torch.tanh(x2 @ dd.to(acc)).view(b, t, 4, h)
    return DCMHAWeights(w1.to(x.dtype).contiguous(), w2.to(x.dtype).contiguous(), g.to(x.dtype))


ROPE_STYLES = {"rotate_half": 0, "interleaved": 1}


def _rope_args(rope, op, rope_style="rotate_half"):
    """``(cos, sin, style)`` for the op schema; ``style`` is the int of ``ROPE_STYLES``."""
    if rope_style not in ROPE_STYLES:
        raise ValueError(f"headwise.{op}: rope_style must be one of {sorted(ROPE_STYLES)} "
                         f"(rotate_half: Llama/Qwen/GPT-NeoX pairs (p, p + R/2); interleaved: GPT-J pairs "
                         f"(2p, 2p + 1)), got {rope_style!r}")
    if rope is None:
        return None, None, 0
    if not isinstance(rope, (tuple, list)) or len(rope) != 2:
        raise ValueError(f"headwise.{op}: rope must be a (cos, sin) pair of [S, rotary_dim] or "
                         "[B, S, rotary_dim] tensors")
    return rope[0], rope[1], ROPE_STYLES[rope_style]


def _check_layout(layout, op):
    from .qkv_layout import QKVLayout

    if not isinstance(layout, QKVLayout):
        raise ValueError(f"headwise.{op}: layout must be a headwise.QKVLayout, got {type(layout).__name__}")


def _check_x(x, op):
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        got = f"shape {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"headwise.{op}: x must be a 3-D tensor [B, S, D_model], got {got}")


def _autocast_gemm_inputs(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]):
    """Autocast policy of the projection ops (qkv_project, q_project, kv_project,
    head_merge): like nn.Linear, inside an autocast region for x's device the GEMM
    operands (x or z, the weight, the bias) are cast to the autocast dtype, so outputs
    come out in that dtype; the small parameters (norm weights, rope tables, head gates)
    stay as given (fp32 is accepted)."""
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return x, weight, bias
    dtype = torch.get_autocast_dtype(device)
    return x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


def _autocast_attention_inputs(device: torch.device, *tensors: torch.Tensor):
    """Autocast policy of the DCMHA kernels (dcmha_compose, dcmha_attention): like
    ``F.scaled_dot_product_attention``, inside an autocast region for the inputs' device
    the inputs (a or q, k, v) and the dynamic weights (w1, w2, g; the kernels take them in
    the inputs' dtype) are cast to the autocast dtype; the kernels keep softmax
    statistics and accumulation in fp32. fp64 tensors are not cast (as autocast does not
    cast them)."""
    if not torch.is_autocast_enabled(device.type):
        return tensors
    dtype = torch.get_autocast_dtype(device.type)
    return tuple(t.to(dtype) if t.dtype in (torch.float32, torch.float16, torch.bfloat16) else t for t in tensors)


class Ops:
    """The public functions of headwise bound to one op library (``headwise`` or
    ``headwise_sim``); see :func:`headwise.testing.backend`."""

    def __init__(self, ns: str = "headwise"):
        if ns not in _registered:
            raise ValueError(f"unknown op library {ns!r}; expected one of {sorted(_registered)}"
                             + ("" if ns != PROFILE_LIBRARY else " (call headwise.ops.load_profile_library())"))
        self.ns = ns
        self._lib = getattr(torch.ops, ns)

    def __deepcopy__(self, memo) -> "Ops":
        """Shared, not copied: an Ops is an immutable binding to an op library (so that
        ``copy.deepcopy`` of a module holding one works; the op namespace cannot be copied)."""
        return self

    def mhar_route(
        self,
        sources: torch.Tensor,
        query: torch.Tensor,
        norm_weight: torch.Tensor,
        *,
        num_heads: int,
        num_sources: Optional[int] = None,
        eps: float = 1e-6,
        residual: Optional[torch.Tensor] = None,
        gate: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """MHAR depth routing (SPEC section 4): ``out [B, T, d]`` in the sources' dtype.

        ``sources [N_max, B, T, d]`` (rows ``[0, num_sources)`` are read, default all),
        ``query [d]`` and ``norm_weight [d]`` (float32 or the sources' dtype), ``d``
        divisible by ``num_heads``. With ``residual [B, T, d]`` and a one-element ``gate``
        (float32 or the sources' dtype) the output is ``residual + gate * mix`` (the delta
        modes; each is optional). Saves only the routing weights ``[N, B, T, H]`` (fp32)
        for backward; the gate's gradient ``<dout, mix>`` comes out of the backward's
        first pass.
        """
        if not isinstance(sources, torch.Tensor) or sources.dim() != 4:
            raise ValueError(
                "headwise.mhar_route: sources must be a 4-D tensor [N, B, T, d], got "
                + (f"shape {list(sources.shape)}" if isinstance(sources, torch.Tensor) else type(sources).__name__)
            )
        n = sources.shape[0] if num_sources is None else int(num_sources)
        out, _ = self._lib.mhar_route(sources, query, norm_weight, int(num_heads), n, float(eps), residual, gate)
        return out

    def qkv_project(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor] = None,
        *,
        layout,
        q_norm: Optional[torch.Tensor] = None,
        k_norm: Optional[torch.Tensor] = None,
        norm_eps: float = 1e-6,
        rope=None,
        scale_q: Optional[float] = None,
        rope_style: str = "rotate_half",
    ):
        """Fused QKV projection (SPEC section 2): ``(q [B, Hq, S, D], k [B, Hkv, S, D],
        v [B, Hkv, S, Dv])``, head-major and contiguous, in x's dtype.

        ``x [B, S, D_model]``, ``weight [N_total, D_model]`` packed by ``layout`` (a
        :class:`headwise.QKVLayout`), ``bias [N_total]``. Epilogue, in order: bias;
        per-head RMSNorm of q / k with weights ``q_norm`` / ``k_norm`` ``[D]`` (fp32
        statistic, Qwen3 rounding); RoPE ``rope=(cos, sin)`` on q and k; ``scale_q``
        multiplies q. Differentiable in x, weight, bias, q_norm and k_norm (not in the
        rope tables).

        Rope tables: each ``[S, R]`` (shared by the batch) or ``[B, S, R]`` (per batch row,
        as Hugging Face passes them for per-row position ids: left-padded generation,
        packed documents), float32 or x's dtype, ``R`` even and ``<= D``. ``R < D`` is
        partial rotary (GPT-NeoX / Pythia / Phi ``rotary_pct``): the leading ``R`` dims of
        each q/k head rotate, the rest pass through. ``rope_style="rotate_half"`` pairs
        element ``p`` with ``p + R/2`` (Llama, Qwen, GPT-NeoX); ``"interleaved"`` pairs
        ``2p`` with ``2p + 1`` (GPT-J); either way, for a pair ``(lo, hi)``,
        ``out[lo] = y[lo] cos[lo] - y[hi] sin[lo]`` and ``out[hi] = y[hi] cos[hi] +
        y[lo] sin[hi]`` (tables indexed by the output element, e.g. GPT-J's
        repeat-interleaved ones).
        """
        _check_layout(layout, "qkv_project")
        _check_x(x, "qkv_project")
        cos, sin, style = _rope_args(rope, "qkv_project", rope_style)
        x, weight, bias = _autocast_gemm_inputs(x, weight, bias)
        q, k, v, _ = self._lib.qkv_project(
            x, weight, bias, list(layout.head_offsets()), layout.num_q_heads, layout.num_kv_heads,
            layout.head_dim, layout.v_head_dim, q_norm, k_norm, float(norm_eps), cos, sin,
            1.0 if scale_q is None else float(scale_q), style,
        )
        return q, k, v

    def q_project(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor] = None,
        *,
        layout,
        q_norm: Optional[torch.Tensor] = None,
        norm_eps: float = 1e-6,
        rope=None,
        scale_q: Optional[float] = None,
        rope_style: str = "rotate_half",
    ) -> torch.Tensor:
        """The target-side query of a cross-attention: ``weight [Hq*D, D_model]`` holds
        the layout's Q rows (``layout.split(...)[0]``). Returns ``q [B, Hq, S, D]``
        with the epilogue of :meth:`qkv_project` (same rope forms)."""
        _check_layout(layout, "q_project")
        _check_x(x, "q_project")
        cos, sin, style = _rope_args(rope, "q_project", rope_style)
        x, weight, bias = _autocast_gemm_inputs(x, weight, bias)
        q, _, _, _ = self._lib.qkv_project(
            x, weight, bias, list(layout.head_offsets(("q",))), layout.num_q_heads, 0,
            layout.head_dim, layout.v_head_dim, q_norm, None, float(norm_eps), cos, sin,
            1.0 if scale_q is None else float(scale_q), style,
        )
        return q

    def kv_project(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor] = None,
        *,
        layout,
        k_norm: Optional[torch.Tensor] = None,
        norm_eps: float = 1e-6,
        rope=None,
        rope_style: str = "rotate_half",
    ):
        """The source-side fused K/V of a cross-attention: ``weight`` holds the
        layout's K and V rows in packing order (``fused[layout.rows(("k", "v"))]``).
        Returns ``k [B, Hkv, S, D]``, ``v [B, Hkv, S, Dv]`` (rope forms of :meth:`qkv_project`)."""
        _check_layout(layout, "kv_project")
        _check_x(x, "kv_project")
        cos, sin, style = _rope_args(rope, "kv_project", rope_style)
        x, weight, bias = _autocast_gemm_inputs(x, weight, bias)
        _, k, v, _ = self._lib.qkv_project(
            x, weight, bias, list(layout.head_offsets(("k", "v"))), 0, layout.num_kv_heads,
            layout.head_dim, layout.v_head_dim, None, k_norm, float(norm_eps), cos, sin, 1.0, style,
        )
        return k, v
    def head_merge(
        self,
        z: torch.Tensor,
        weight_o: torch.Tensor,
        bias: Optional[torch.Tensor] = None,
        *,
        head_gate: Optional[torch.Tensor] = None,
        rescale: bool = False,
        return_stats: bool = False,
    ):
        """Head merge with the W_O block sum (SPEC section 3).

        ``z [B, H, Q, Dv]`` with any strides whose last dim is stride-1 (a transposed view
        of ``[B, Q, H, Dv]`` memory is read in place, never copied); ``weight_o [D, H*Dv]``
        (nn.Linear orientation: head h owns input columns ``[h*Dv, (h+1)*Dv)``);
        ``bias [D]``; ``head_gate`` ``[H]`` or ``[B, H]`` (float32 or z's dtype).

        Returns ``y [B, Q, D] = s[b] * sum_h g[b,h] Z[b,h] @ W_h^T + bias`` in z's dtype,
        with ``s[b] = min(H, H / sum_h g[b,h])`` when ``rescale`` (an all-closed row gives
        the bias alone) and 1 otherwise. A gate of exactly 0 skips that head's work for
        that batch row. Gradients flow to z (in z's layout), weight_o, bias and head_gate
        (non-binary gates are differentiable, through s as well). With
        ``return_stats=True`` returns ``(y, HeadMergeStats(z_norm, out_norm))``.
        """
        z, weight_o, bias = _autocast_gemm_inputs(z, weight_o, bias)
        out, z_norm, out_norm = self._lib.head_merge(z, weight_o, bias, head_gate, bool(rescale), bool(return_stats))
        if return_stats:
            return out, HeadMergeStats(z_norm, out_norm)
        return out

    def dcmha_weights(self, x, dw1, qkw, dd):
        """See :func:`headwise.ops.dcmha_weights` (a composite of torch ops, any backend)."""
        return dcmha_weights(x, dw1, qkw, dd)

    def dcmha_compose(self, a: torch.Tensor, weights, slot: str = "pre", *, head_groups: int = 1) -> torch.Tensor:
        """DCMHA compose (SPEC section 5) of a materialized ``a [B, H, T, T]``: for slot
        "pre" the slots c = (pre, query), (pre, key); for "post" c = (post, query),
        (post, key). ``weights``: a :class:`headwise.DCMHAWeights` in a's dtype.
        ``head_groups=g`` composes only within each group of H / g consecutive heads.
        Differentiable in a and every weight; never forms a ``[B, T, S, H, H]`` tensor.
        Under autocast, a and the weights are cast to the autocast dtype."""
        from .dcmha import check_weights, slot_index

        w = check_weights(weights, "dcmha_compose")
        if isinstance(a, torch.Tensor):
            a, *w = _autocast_attention_inputs(a.device, a, *w)
        return self._lib.dcmha_compose(a, w[0], w[1], w[2], slot_index(slot), int(head_groups))

    def dcmha_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, weights, *, causal: bool = True,
                        window: Optional[int] = None, scale: Optional[float] = None,
                        head_groups: int = 1) -> torch.Tensor:
        """Fused DCMHA attention (SPEC section 5): ``O [B, H, T, dv]``.

        ``q, k [B, H, T, dh]``, ``v [B, H, T, dv]``, ``weights`` a
        :class:`headwise.DCMHAWeights` in q's dtype. Logits ``q k^T * scale`` (default
        1/sqrt(dh)) are pre-composed, masked (causal; ``window=W``: the W keys
        ``t - W < s <= t``), softmaxed per head in fp32 (a fully masked row gives 0),
        post-composed and applied to v. Two passes over key tiles (row max/sum, then
        normalize + post-compose + P'V); saves only the inputs and ``[2, B, H, T]`` row
        statistics; never allocates ``[B, H, T, T]``. Differentiable in q, k, v and the
        weights. Under autocast (like ``F.scaled_dot_product_attention``), q, k, v and
        the weights are cast to the autocast dtype. On CUDA, fp32 follows torch's float32
        matmul precision as ``torch.matmul`` does: with TF32 allowed
        (``torch.backends.cuda.matmul.allow_tf32``, or a precision of "high") the products
        run on TF32 tensor cores, forward and backward; otherwise at full precision. Keep
        that setting between a forward and its backward (a change raises)."""
        from .dcmha import check_weights

        w = check_weights(weights, "dcmha_attention")
        if not isinstance(q, torch.Tensor) or q.dim() != 4:
            raise ValueError("headwise.dcmha_attention: q must be a 4-D tensor [B, H, T, dh]")
        if window is not None and int(window) < 1:
            raise ValueError(f"headwise.dcmha_attention: window must be None or at least 1, got {window}")
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        if isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor):
            q, k, v, *w = _autocast_attention_inputs(q.device, q, k, v, *w)
        else:
            w = list(w)
        out, _ = self._lib.dcmha_attention(q, k, v, w[0], w[1], w[2], bool(causal),
                                           0 if window is None else int(window), scale, int(head_groups))
        return out


def _register_sample_gemm(ns: str) -> None:
    """The sample tensor-core GEMM (csrc/gemm): c [M, N] = a [M, K] @ b [N, K]^T."""

    @torch.library.register_fake(f"{ns}::sample_gemm")
    def _(a, b):
        return a.new_empty((a.shape[0], b.shape[0]))


def _register_library(ns: str) -> None:
    """Fake kernels and autograd for the ops of library ``ns``."""
    _register(ns)
    _register_qkv(ns)
    _register_merge(ns)
    _register_dcmha(ns)
    _register_sample_gemm(ns)
    _registered.add(ns)


for _ns in LIBRARIES:
    _register_library(_ns)


def load_profile_library() -> "Ops":
    """Load headwise._sim_profile (built by setup.py unless HEADWISE_SIM_PROFILE=0) and
    return the public functions bound to it. Its ops run the emulated kernels with every
    memory access counted: slower than headwise_sim, for the profiler only."""
    if PROFILE_LIBRARY not in _registered:
        from . import _sim_profile  # noqa: F401  (registers torch.ops.headwise_sim_profile)

        _register_library(PROFILE_LIBRARY)
    return Ops(PROFILE_LIBRARY)

DEFAULT_OPS = Ops("headwise")  # what modules use when no backend is given
mhar_route = DEFAULT_OPS.mhar_route
qkv_project = DEFAULT_OPS.qkv_project
q_project = DEFAULT_OPS.q_project
kv_project = DEFAULT_OPS.kv_project
head_merge = DEFAULT_OPS.head_merge
dcmha_compose = DEFAULT_OPS.dcmha_compose
dcmha_attention = DEFAULT_OPS.dcmha_attention
