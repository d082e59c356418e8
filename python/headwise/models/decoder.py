"""A Qwen3-style decoder with a choice of residual stream (SPEC section 4).

Pre-norm RMSNorm blocks, grouped-query attention with per-head q/k RMSNorm and rotary
embeddings (rotate-half, theta 1e4), SwiGLU MLPs; with attention="dcmha" each attention
sublayer is a headwise.nn.DCMHAttention instead (fused QKV with the same per-head q/k
RMSNorm and rotary embedding in its epilogue, dynamically composed heads, fused two-pass
attention, head merge; full heads). Sublayers s = 0 .. 2L-1 alternate attention and MLP; f_s(.) is
sublayer s applied to its pre-norm, route_s is routing site s (a headwise.nn.MHARRouter,
zero-initialized query: a uniform average of its sources). The residual stream is one of:

  "residual"       h_0 = e, h_{s+1} = h_s + f_s(norm(h_s)); logits from h_2L.
  Replacement routing (no additive stream; Attention Residuals, Kimi, "Full AttnRes", and
  Multi-Head Attention Residuals, the authors' `full_mh`):
  "attnres"        v_0 = e, x_s = route_s(v_0..v_s), v_{s+1} = f_s(norm(x_s)), s < 2L;
                   logits from x_2L = route_2L(v_0..v_2L); one routing head.
  "mhar"           the same with `routing_heads` heads (default n_kv_heads, the MHAR
                   paper's H = KV rule).
  "block_attnres"  Block AttnRes (Kimi; with routing_heads > 1 the authors' `block_mh`):
                   x_s = route_s(B_0, B_1..B_c, P_s), v_{s+1} = f_s(norm(x_s)), where
                   B_0 = e, B_b = the sum of the sublayer outputs of block b (blocks of
                   ceil(L / num_blocks) layers, the last one possibly shorter) for the
                   blocks completed before site s, and P_s = the sum of the current
                   block's outputs so far, left out while it is empty; logits from x_2L.
  Delta routing (the residual stream intact; the authors' `delta_mh`, for converting a
  trained residual model):
  "delta_mhar", "block_mhar"
                   h_0 = e, x_s = h_s + alpha_s * route_s([null_s; D_1..D_m]),
                   h_{s+1} = h_s + f_s(norm(x_s)); logits from h_2L (2L sites, no final
                   one). D_1 = e and D_2..D_m are the sums of the sublayer outputs of the
                   blocks completed before site s, each block's own outputs only (blocks
                   of one layer for "delta_mhar", of ceil(L / num_blocks) layers for
                   "block_mhar"). null_s and alpha_s start at zero, so at step 0 a
                   delta-mode model computes exactly the standard residual model.
  headwise's own variant, kept so that results before 2026-11-30 stay reproducible (it
  is no paper's model):
  "cumulative_mhar"  h_0 = e, x_s = route_s(h_0..h_s), h_{s+1} = x_s + f_s(norm(x_s));
                   logits from x_2L (routing over cumulative states with an additive
                   stream; `routing_heads` default n_heads; routing_heads=1 is the
                   formulation that was called "attnres" before).

The kernel adds the residual stream and applies the gate of the delta modes in one pass.
`routing_impl="buffer"` keeps the sources of "attnres"/"mhar"/"cumulative_mhar" in a
headwise.DepthBuffer (each of v_0..v_2L written once, in place, fused accumulating
backward); `"per_call"` stacks them for every call. The block and delta modes always
route per call (a partial block's source changes between sites; their stacks are short).
`reference_forward` computes the same function with headwise.reference as the router.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .. import reference
from ..depth_buffer import DepthBuffer
from ..head_gating import GATED_ATTENTION, merge_heads
from ..nn import DCMHAttention, MHARRouter
from ..ops import DEFAULT_OPS, Ops

REPLACEMENT_RESIDUALS = ("attnres", "mhar")
BLOCK_RESIDUALS = ("block_attnres", "block_mhar")  # the modes that take num_blocks
DELTA_RESIDUALS = ("delta_mhar", "block_mhar")
RESIDUALS = ("residual", *REPLACEMENT_RESIDUALS, "block_attnres", *DELTA_RESIDUALS, "cumulative_mhar")
ROUTING_IMPLS = ("buffer", "per_call")
ATTENTIONS = ("mha", "dcmha")


@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: Optional[int] = None
    residual: str = "mhar"
    routing_heads: Optional[int] = None  # default: see routing_heads_resolved
    routing_impl: str = "buffer"
    attention: str = "mha"
    num_blocks: Optional[int] = None
    rope_theta: float = 1e4
    norm_eps: float = 1e-6

    def __post_init__(self):
        kv = self.n_kv_heads or self.n_heads
        block_mode = self.residual in BLOCK_RESIDUALS
        heads = self.routing_heads_resolved
        heads_ok = isinstance(heads, int) and heads >= 1
        checks = [
            (self.residual in RESIDUALS, f"residual must be one of {RESIDUALS}, got {self.residual!r}"),
            (self.routing_impl in ROUTING_IMPLS, f"routing_impl must be one of {ROUTING_IMPLS}, got {self.routing_impl!r}"),
            (self.attention in ATTENTIONS, f"attention must be one of {ATTENTIONS}, got {self.attention!r}"),
            (not block_mode or (isinstance(self.num_blocks, int) and self.num_blocks >= 1),
             f"residual={self.residual!r} needs num_blocks >= 1, got {self.num_blocks!r}"),
            (block_mode or self.num_blocks is None,
             f"num_blocks applies to residual in {BLOCK_RESIDUALS} only, got num_blocks={self.num_blocks!r} "
             f"with residual={self.residual!r}"),
            (self.residual != "attnres" or self.routing_heads in (None, 1),
             f"residual='attnres' has one routing head (use 'mhar' for more), got routing_heads={self.routing_heads!r}"),
            (heads_ok, f"routing_heads must be a positive int, got {self.routing_heads!r}"),
            (self.d_model % self.n_heads == 0, f"n_heads ({self.n_heads}) must divide d_model ({self.d_model})"),
            (self.n_heads % kv == 0, f"n_kv_heads ({kv}) must divide n_heads ({self.n_heads})"),
            (self.attention != "dcmha" or kv == self.n_heads,
             f"attention='dcmha' composes full heads: n_kv_heads ({kv}) must equal n_heads ({self.n_heads})"),
            ((self.d_model // self.n_heads) % 2 == 0, "the head dim must be even for rotary embeddings"),
            (not heads_ok or self.d_model % heads == 0,
             f"routing_heads ({heads}) must divide d_model ({self.d_model})"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"DecoderConfig: {message}")

    @property
    def routing_heads_resolved(self) -> int:
        """routing_heads, else the mode's default: 1 for "attnres" and "block_attnres",
        n_heads for "cumulative_mhar" (its default before 2026-11-30), n_kv_heads otherwise."""
        if self.routing_heads is not None:
            return self.routing_heads
        if self.residual in ("attnres", "block_attnres"):
            return 1
        if self.residual == "cumulative_mhar":
            return self.n_heads
        return self.n_kv_heads or self.n_heads

    @property
    def layers_per_block(self) -> int:
        """Block modes: ceil(n_layers / num_blocks) layers per block; "delta_mhar": 1."""
        if self.residual in BLOCK_RESIDUALS:
            return -(-self.n_layers // self.num_blocks)
        return 1

    @property
    def routing_sites(self) -> int:
        """2L sites for the delta modes (no final routing), 2L + 1 for the other routed modes."""
        if self.residual == "residual":
            return 0
        return 2 * self.n_layers + (0 if self.residual in DELTA_RESIDUALS else 1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [B, H, T, D] with cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """GQA self-attention with q/k RMSNorm and RoPE; the heads are merged by
    ``head_merge`` (``o_proj.weight [d, H * head_dim]`` is W_O in the merge's layout, the
    state dict is nn.Linear's), through the layer's ``head_gate`` and ``head_stats_sink``
    slots (``headwise.head_gating``: learned gates, hard masks, per-head statistics).
    ``n_heads`` / ``n_kv`` are this layer's head counts (``headwise.prune_model_heads``
    lowers them)."""

    def __init__(self, cfg: DecoderConfig, *, ops: Optional[Ops] = None):
        super().__init__()
        self.n_heads, self.n_kv = cfg.n_heads, cfg.n_kv_heads or cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.ops = DEFAULT_OPS if ops is None else ops
        self.q_proj = nn.Linear(cfg.d_model, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.d_model, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps)
        self.head_gate: Optional[nn.Module] = None
        self.head_stats_sink = None
        setattr(self, GATED_ATTENTION, True)

    def forward(self, x, cos, sin, use_reference: bool = False):
        """``use_reference``: the merge by ``headwise.reference.head_merge`` (the oracle)."""
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        if self.n_kv != self.n_heads:
            k = k.repeat_interleave(self.n_heads // self.n_kv, dim=1)
            v = v.repeat_interleave(self.n_heads // self.n_kv, dim=1)
        z = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, head_dim]
        merge = reference.head_merge if use_reference else self.ops.head_merge
        return merge_heads(self, merge, z, self.o_proj.weight, self.o_proj.bias)


class SwiGLU(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        hidden = 8 * ((8 * d // 3 + 7) // 8)
        self.gate = nn.Linear(d, hidden, bias=False)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class BlockSums:
    """The block-aggregated sources of the block and delta modes, kept as sublayer outputs
    arrive: `completed` = [e, B_1, B_2, ...] (the embedding is block 0, B_b the sum of
    block b's sublayer outputs) and `partial` = the sum of the current block's outputs so
    far (None while the block is empty). A block is `sublayers_per_block` consecutive
    sublayers; the last block ends at the last sublayer whatever its length."""

    def __init__(self, embedding: torch.Tensor, sublayers_per_block: int, sublayers: int):
        self.completed = [embedding]
        self.partial: Optional[torch.Tensor] = None
        self._per_block, self._sublayers, self._seen = sublayers_per_block, sublayers, 0

    def add(self, output: torch.Tensor) -> None:
        """Fold in the output of the next sublayer."""
        self.partial = output if self.partial is None else self.partial + output
        self._seen += 1
        if self._seen % self._per_block == 0 or self._seen == self._sublayers:
            self.completed.append(self.partial)
            self.partial = None

    def with_partial(self) -> list:
        return self.completed + ([] if self.partial is None else [self.partial])


class Decoder(nn.Module):
    """`Decoder(cfg)(tokens [B, T]) -> logits [B, T, vocab]`; see the module docstring."""

    def __init__(self, cfg: DecoderConfig, *, ops: Optional[Ops] = None):
        super().__init__()
        self.cfg = cfg
        self._ops = ops or DEFAULT_OPS
        d = cfg.d_model
        self.embed = nn.Embedding(cfg.vocab_size, d)
        # Sublayer s: attention for even s, MLP for odd s, each with its pre-norm.
        self.sublayers = nn.ModuleList()
        self.norms = nn.ModuleList()
        for _ in range(cfg.n_layers):
            self.sublayers.append(DCMHAttention(d, cfg.n_heads, qk_norm=True, norm_eps=cfg.norm_eps, ops=self._ops)
                                  if cfg.attention == "dcmha" else Attention(cfg, ops=self._ops))
            self.norms.append(RMSNorm(d, cfg.norm_eps))
            self.sublayers.append(SwiGLU(d))
            self.norms.append(RMSNorm(d, cfg.norm_eps))
        self.final_norm = RMSNorm(d, cfg.norm_eps)
        self.lm_head = nn.Linear(d, cfg.vocab_size, bias=False)
        delta = cfg.residual in DELTA_RESIDUALS
        self.routers = nn.ModuleList(
            MHARRouter(d, cfg.routing_heads_resolved, delta=delta, eps=cfg.norm_eps, ops=self._ops)
            for _ in range(cfg.routing_sites))
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def _rope(self, t: int, device, dtype):
        half = self.cfg.d_model // self.cfg.n_heads // 2
        inv = 1.0 / (self.cfg.rope_theta ** (torch.arange(half, device=device, dtype=torch.float32) / half))
        angles = torch.outer(torch.arange(t, device=device, dtype=torch.float32), inv)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def _sublayer(self, s: int, x, cos, sin, use_reference: bool = False):
        """f_s(norm_s(x)): sublayer s on its pre-norm of the site's input x."""
        sub, h = self.sublayers[s], self.norms[s](x)
        if isinstance(sub, DCMHAttention):
            return sub.reference_forward(h, rope=(cos, sin)) if use_reference else sub(h, rope=(cos, sin))
        if s % 2 == 0:
            return sub(h, cos, sin, use_reference)
        return sub(h)

    def _route(self, s: int, sources: list, use_reference: bool, residual: Optional[torch.Tensor] = None):
        """Routing site s over a per-call stack of `sources` (delta routers: the deltas,
        with the residual stream added by the kernel)."""
        router = self.routers[s]
        if not use_reference:
            if router.delta:
                return router(sources, residual=residual)
            return router(torch.stack(sources))
        stacked = router.delta_sources(sources) if router.delta else torch.stack(sources)
        return reference.mhar_route(stacked, router.query, router.norm_weight, num_heads=router.num_heads,
                                    eps=router.eps, residual=residual, gate=router.gate if router.delta else None)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._run(tokens, use_reference=False)

    def reference_forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """The same model with headwise.reference as the router (the whole-model oracle)."""
        return self._run(tokens, use_reference=True)

    def _run(self, tokens, use_reference: bool):
        residual = self.cfg.residual
        e = self.embed(tokens)
        cos, sin = self._rope(tokens.shape[1], e.device, e.dtype)
        if residual == "residual":
            final = self._run_residual(e, cos, sin, use_reference)
        elif residual in DELTA_RESIDUALS:
            final = self._run_delta(e, cos, sin, use_reference)
        elif residual == "block_attnres":
            final = self._run_block_replacement(e, cos, sin, use_reference)
        else:
            final = self._run_source_list(e, cos, sin, use_reference)
        return self.lm_head(self.final_norm(final))

    def _run_residual(self, h, cos, sin, use_reference: bool):
        for s in range(2 * self.cfg.n_layers):
            h = h + self._sublayer(s, h, cos, sin, use_reference)
        return h

    def _run_source_list(self, e, cos, sin, use_reference: bool):
        """"attnres"/"mhar": sources v_0 = e, v_{s+1} = f_s; "cumulative_mhar": h_0 = e,
        h_{s+1} = x_s + f_s. Site s routes over the first s + 1 sources; returns x_2L."""
        steps, heads = 2 * self.cfg.n_layers, self.cfg.routing_heads_resolved
        additive = self.cfg.residual == "cumulative_mhar"
        buf = None
        if self.cfg.routing_impl == "buffer" and not use_reference:
            buf = DepthBuffer(steps + 1, *e.shape, dtype=e.dtype, device=e.device, ops=self._ops)
        sources, source = [], e
        for s in range(steps + 1):
            router = self.routers[s]
            if buf is not None:
                buf.write(s, source)
                x = buf.route(s, source, router.query, router.norm_weight, num_heads=heads, eps=router.eps)
            else:
                sources.append(source)
                x = self._route(s, sources, use_reference)
            if s == steps:
                return x
            f = self._sublayer(s, x, cos, sin, use_reference)
            source = x + f if additive else f

    def _run_block_replacement(self, e, cos, sin, use_reference: bool):
        """"block_attnres": site s routes over [e, B_1..B_c, P_s]; returns x_2L."""
        steps = 2 * self.cfg.n_layers
        blocks = BlockSums(e, 2 * self.cfg.layers_per_block, steps)
        for s in range(steps + 1):
            x = self._route(s, blocks.with_partial(), use_reference)
            if s == steps:
                return x
            blocks.add(self._sublayer(s, x, cos, sin, use_reference))

    def _run_delta(self, e, cos, sin, use_reference: bool):
        """The delta modes: site s routes over [null_s; e, B_1..B_c] on top of h_s; returns h_2L."""
        steps = 2 * self.cfg.n_layers
        blocks = BlockSums(e, 2 * self.cfg.layers_per_block, steps)
        h = e
        for s in range(steps):
            x = self._route(s, blocks.completed, use_reference, residual=h)
            f = self._sublayer(s, x, cos, sin, use_reference)
            h = h + f
            blocks.add(f)
        return h

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def extra_repr(self) -> str:
        return f"{self.cfg}"
