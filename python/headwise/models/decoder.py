"""A Qwen3-style decoder with a choice of residual stream (SPEC section 4).

Pre-norm RMSNorm blocks, grouped-query attention with per-head q/k RMSNorm and rotary
embeddings (rotate-half, theta 1e4), SwiGLU MLPs; with attention="dcmha" each attention
sublayer is a headwise.nn.DCMHAttention instead (fused QKV with the rotary embedding in
its epilogue, dynamically composed heads, fused two-pass attention, head merge; full
heads, no q/k norm). The residual stream is one of:
  "residual"  h_{s+1} = h_s + f_s(norm(h_s))                       (the standard stream)
  "attnres"   x_s = route_s(h_0..h_s) with one routing head (Attention Residuals)
  "mhar"      x_s = route_s(h_0..h_s) with `routing_heads` heads  (Multi-Head AttnRes)
  "delta_mhar", "block_mhar" (the delta modes, for converting a trained residual model)
              x_s = h_s + alpha_s * route_s([null_s; D_1..D_m])
where for the routed streams h_{s+1} = x_s + f_s(norm(x_s)) over the 2L sublayers
(attention, MLP, attention, ...), and a final routing x_{2L} comes before the last norm.
Routers start with zero queries: a uniform average of their sources.

Delta modes. The deltas are delta_0 = h_0 (the embedding) and delta_{j+1} = f_j (what
sublayer j added). They are aggregated in consecutive blocks of `block` deltas: routing
site s has seen delta_0..delta_s, and its sources D_1..D_m are the sums of the complete
blocks among them and of the current partial block, m = ceil((s + 1) / block). In
"delta_mhar" block = 1 (every delta its own source); in "block_mhar" block =
ceil((2L + 1) / num_blocks), so a site never reads more than num_blocks deltas. The null
source null_s [d] and the scalar gate alpha_s start at zero: at step 0 a delta-mode model
computes exactly the standard residual model with the same weights. The kernel adds the
residual stream h_s and applies the gate; delta modes always route per call (their
per-call stacks are short), whatever `routing_impl` says.

`routing_impl="buffer"` keeps the states of "attnres"/"mhar" in a headwise.DepthBuffer (in
place, fused accumulating backward); `"per_call"` stacks them for every call.
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
from ..nn import DCMHAttention, MHARRouter
from ..ops import DEFAULT_OPS, Ops

RESIDUALS = ("residual", "attnres", "mhar", "block_mhar", "delta_mhar")
DELTA_RESIDUALS = ("block_mhar", "delta_mhar")
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
    routing_heads: Optional[int] = None  # "mhar": default n_heads; "attnres" is always 1
    routing_impl: str = "buffer"
    attention: str = "mha"
    num_blocks: Optional[int] = None
    rope_theta: float = 1e4
    norm_eps: float = 1e-6

    def __post_init__(self):
        kv = self.n_kv_heads or self.n_heads
        checks = [
            (self.residual in RESIDUALS, f"residual must be one of {RESIDUALS}, got {self.residual!r}"),
            (self.routing_impl in ROUTING_IMPLS, f"routing_impl must be one of {ROUTING_IMPLS}, got {self.routing_impl!r}"),
            (self.attention in ATTENTIONS, f"attention must be one of {ATTENTIONS}, got {self.attention!r}"),
            (self.residual != "block_mhar" or (isinstance(self.num_blocks, int) and self.num_blocks >= 1),
             f"residual='block_mhar' needs num_blocks >= 1, got {self.num_blocks!r}"),
            (self.residual == "block_mhar" or self.num_blocks is None,
             f"num_blocks applies to residual='block_mhar' only, got num_blocks={self.num_blocks!r} "
             f"with residual={self.residual!r}"),
            (self.d_model % self.n_heads == 0, f"n_heads ({self.n_heads}) must divide d_model ({self.d_model})"),
            (self.n_heads % kv == 0, f"n_kv_heads ({kv}) must divide n_heads ({self.n_heads})"),
            (self.attention != "dcmha" or kv == self.n_heads,
             f"attention='dcmha' composes full heads: n_kv_heads ({kv}) must equal n_heads ({self.n_heads})"),
            ((self.d_model // self.n_heads) % 2 == 0, "the head dim must be even for rotary embeddings"),
            (self.d_model % self.routing_heads_resolved == 0,
             f"routing_heads ({self.routing_heads_resolved}) must divide d_model ({self.d_model})"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"DecoderConfig: {message}")

    @property
    def routing_heads_resolved(self) -> int:
        if self.residual == "attnres":
            return 1
        return self.routing_heads or self.n_heads

    @property
    def deltas_per_block(self) -> int:
        """Delta modes: how many consecutive deltas one source aggregates."""
        if self.residual == "block_mhar":
            return -(-(2 * self.n_layers + 1) // self.num_blocks)
        return 1


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
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.n_heads, self.n_kv = cfg.n_heads, cfg.n_kv_heads or cfg.n_heads
        self.head_dim = cfg.d_model // cfg.n_heads
        self.q_proj = nn.Linear(cfg.d_model, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.d_model, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        if self.n_kv != self.n_heads:
            k = k.repeat_interleave(self.n_heads // self.n_kv, dim=1)
            v = v.repeat_interleave(self.n_heads // self.n_kv, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        hidden = 8 * ((8 * d // 3 + 7) // 8)
        self.gate = nn.Linear(d, hidden, bias=False)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


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
            self.sublayers.append(DCMHAttention(d, cfg.n_heads, ops=self._ops) if cfg.attention == "dcmha"
                                  else Attention(cfg))
            self.norms.append(RMSNorm(d, cfg.norm_eps))
            self.sublayers.append(SwiGLU(d))
            self.norms.append(RMSNorm(d, cfg.norm_eps))
        self.final_norm = RMSNorm(d, cfg.norm_eps)
        self.lm_head = nn.Linear(d, cfg.vocab_size, bias=False)
        self.routers = nn.ModuleList()
        if cfg.residual != "residual":
            delta = cfg.residual in DELTA_RESIDUALS
            self.routers.extend(MHARRouter(d, cfg.routing_heads_resolved, delta=delta, eps=cfg.norm_eps,
                                           ops=self._ops)
                                for _ in range(2 * cfg.n_layers + 1))
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
        sub, h = self.sublayers[s], self.norms[s](x)
        if isinstance(sub, DCMHAttention):
            return sub.reference_forward(h, rope=(cos, sin)) if use_reference else sub(h, rope=(cos, sin))
        if s % 2 == 0:
            return sub(h, cos, sin)
        return sub(h)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._run(tokens, use_reference=False)

    def reference_forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """The same model with headwise.reference as the router (the whole-model oracle)."""
        return self._run(tokens, use_reference=True)

    def _run(self, tokens, use_reference: bool):
        cfg = self.cfg
        h = self.embed(tokens)
        cos, sin = self._rope(tokens.shape[1], h.device, h.dtype)
        steps = 2 * cfg.n_layers
        if cfg.residual == "residual":
            for s in range(steps):
                h = h + self._sublayer(s, h, cos, sin, use_reference)
            return self.lm_head(self.final_norm(h))
        if cfg.residual in DELTA_RESIDUALS:
            return self.lm_head(self.final_norm(self._run_delta(h, cos, sin, use_reference)))
        heads = cfg.routing_heads_resolved
        buf = None
        if cfg.routing_impl == "buffer" and not use_reference:
            buf = DepthBuffer(steps + 1, *h.shape, dtype=h.dtype, device=h.device, ops=self._ops)
        states = []
        for s in range(steps + 1):
            router = self.routers[s]
            if buf is not None:
                buf.write(s, h)
                x = buf.route(s, h, router.query, router.norm_weight, num_heads=heads, eps=router.eps)
            else:
                states.append(h)
                stacked = torch.stack(states)
                if use_reference:
                    x = reference.mhar_route(stacked, router.query, router.norm_weight, num_heads=heads,
                                             eps=router.eps)
                else:
                    x = router(stacked)
            if s < steps:
                h = x + self._sublayer(s, x, cos, sin, use_reference)
        return self.lm_head(self.final_norm(x))

    def _run_delta(self, h, cos, sin, use_reference: bool):
        """The delta modes (module docstring); returns x_{2L}."""
        steps, block = 2 * self.cfg.n_layers, self.cfg.deltas_per_block
        blocks, partial, in_partial = [], h, 1  # delta_0 = h_0 opens the first block
        for s in range(steps + 1):
            router = self.routers[s]
            deltas = blocks + [partial]
            if use_reference:
                x = reference.mhar_route(router.delta_sources(deltas), router.query, router.norm_weight,
                                         num_heads=router.num_heads, eps=router.eps, residual=h, gate=router.gate)
            else:
                x = router(deltas, residual=h)
            if s == steps:
                return x
            f = self._sublayer(s, x, cos, sin, use_reference)
            h = x + f
            if in_partial == block:
                blocks.append(partial)
                partial, in_partial = f, 1
            else:
                partial, in_partial = partial + f, in_partial + 1

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def extra_repr(self) -> str:
        return f"{self.cfg}"

