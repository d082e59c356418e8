"""Whole-model training step: headwise.models.Decoder with residual "residual" | "attnres"
| "mhar" | "block_attnres" | "block_mhar", its reference_forward (routing by
headwise.reference, per-call stacks) eager and under torch.compile, against the model
routed by headwise (DepthBuffer for attnres/mhar, per call for the block modes). One step = forward, cross-entropy, backward.
Reports the median step time, the bytes autograd saves for backward, and the peak memory
of a step (CUDA: allocator peak; CPU: growth of the process's peak resident set)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models import Decoder, DecoderConfig
from .timing import Row, median_ms, peak_bytes, saved_bytes

CPU_SHAPE = dict(vocab=256, d=512, layers=6, heads=8, kv=4, b=2, t=256)
GPU_SHAPE = dict(vocab=32000, d=2048, layers=16, heads=16, kv=8, b=2, t=4096)
QUICK_SHAPE = dict(vocab=61, d=32, layers=1, heads=2, kv=1, b=1, t=8)
VARIANTS = {"residual": {}, "attnres": {}, "mhar": {}, "block_attnres": dict(num_blocks=2),
            "block_mhar": dict(num_blocks=2)}


def _randomize_routers(model: Decoder) -> None:
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for router in model.routers:
            router.query.copy_(0.3 * torch.randn(router.query.shape, generator=gen))
            if router.delta:
                router.gate.fill_(0.5)


def run(device: torch.device, dtype: torch.dtype, repeats: int, shape: dict | None = None) -> list[Row]:
    shape = shape or (GPU_SHAPE if device.type == "cuda" else CPU_SHAPE)
    dname = str(dtype).replace("torch.", "")
    tokens = torch.randint(0, shape["vocab"], (shape["b"], shape["t"] + 1),
                           generator=torch.Generator().manual_seed(0)).to(device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    rows = []
    for residual, extra in VARIANTS.items():
        torch.manual_seed(0)
        cfg = DecoderConfig(vocab_size=shape["vocab"], d_model=shape["d"], n_layers=shape["layers"],
                            n_heads=shape["heads"], n_kv_heads=shape["kv"], residual=residual, **extra)
        model = Decoder(cfg).to(device=device, dtype=dtype)
        _randomize_routers(model)
        params = list(model.parameters())
        impls = {"eager": model.reference_forward,
                 "compile": torch.compile(model.reference_forward, dynamic=False),
                 "headwise": model.forward}
        label = (f"{residual} L={shape['layers']} d={shape['d']} H={shape['heads']} "
                 f"B={shape['b']} T={shape['t']}")
        for impl, forward in impls.items():
            def loss(forward=forward):
                logits = forward(inputs)
                return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

            def step(loss=loss):
                for p in params:
                    p.grad = None
                loss().backward()

            ms = median_ms(step, device, repeats=repeats, warmup=2)
            rows.append(Row("decoder", label, dname, "fwd+bwd", impl, ms,
                            saved_bytes=saved_bytes(loss, params), peak_bytes=peak_bytes(step, device)))
    return rows
