"""python -m headwise.demo: train small decoders on real text, one per residual variant.

The corpus is the Python standard library's own source files, read as bytes (present on
every machine with Python; nothing is downloaded). Each variant is a
headwise.models.Decoder over the 256 byte values, trained with AdamW on random windows
of the training split and evaluated on a fixed set of windows of the validation split
(the last 5% of the bytes). Writes DIR/demo.json (per variant: steps, final and best
validation loss in nats/byte, tokens/s, peak memory: CUDA allocator peak, or on the CPU
the process's peak resident set during the variant's run) and DIR/loss.png (validation loss
curves; needs matplotlib, otherwise skipped with a note).

Variants (the recursions are in headwise.models.decoder's docstring): residual
(standard), attnres (Attention Residuals: replacement routing over the embedding and the
sublayer outputs, one head), mhar (the same with multi-head routing through the
DepthBuffer), block_attnres (Block AttnRes, 2 blocks), dcmha (standard residual, attention
by headwise.nn.DCMHAttention: dynamically composed heads in the fused two-pass attention
kernel); on request block_mhar (delta routing over block sums on top of the intact
residual stream) and cumulative_mhar (headwise's own earlier formulation, the "attnres"
/ "mhar" rows of the results before 2026-11-30 with routing_heads 1 / n_heads).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .bench.timing import peak_memory, reset_peak_memory, synchronize
from .models import Decoder, DecoderConfig

VARIANTS = {
    "residual": dict(residual="residual"),
    "attnres": dict(residual="attnres"),
    "mhar": dict(residual="mhar"),
    "block_attnres": dict(residual="block_attnres", num_blocks=2),
    "block_mhar": dict(residual="block_mhar", num_blocks=2),
    "cumulative_mhar": dict(residual="cumulative_mhar"),
    "dcmha": dict(residual="residual", attention="dcmha"),
}
DEFAULT_VARIANTS = ("residual", "attnres", "mhar", "block_attnres", "dcmha")


def load_corpus(max_bytes: int) -> torch.Tensor:
    """Up to max_bytes of the standard library's .py files (sorted paths), as uint8."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total < 100_000:
        raise RuntimeError(f"headwise.demo: found only {total} bytes of Python sources under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8)


@dataclass
class Result:
    variant: str
    parameters: int
    steps: int
    final_val_loss: float
    best_val_loss: float
    tokens_per_s: float
    step_ms: float
    peak_memory_mib: Optional[float]
    curve: list = field(default_factory=list)  # [(step, val_loss)]


def progress(prefix: str, step: int, total: int, text: str) -> None:
    width = 24
    filled = int(width * step / total)
    bar = "#" * filled + "-" * (width - filled)
    end = "\n" if step == total else ""
    print(f"\r{prefix:<15} [{bar}] {step:>4}/{total} {text}", end=end, file=sys.stderr, flush=True)


@dataclass
class LMData:
    """The byte-level language-modeling data of a run: the training split (random windows
    of ``seq + 1`` bytes, drawn by ``gen``) and a fixed list of validation batches (evenly
    spaced windows of the validation split, the last 5% of the bytes)."""

    train: torch.Tensor
    val_batches: list
    window: int
    batch: int
    device: torch.device
    gen: torch.Generator

    @classmethod
    def from_corpus(cls, data: torch.Tensor, *, seq: int, batch: int, val_batches: int, seed: int,
                    device: torch.device) -> "LMData":
        split = int(0.95 * len(data))
        train, val = data[:split], data[split:]
        window = seq + 1
        val_starts = torch.linspace(0, len(val) - window - 1, val_batches * batch).long()
        vals = [torch.stack([val[s:s + window] for s in val_starts[i::val_batches]]).long().to(device)
                for i in range(val_batches)]
        return cls(train, vals, window, batch, device, torch.Generator().manual_seed(seed))

    def random_batch(self) -> torch.Tensor:
        starts = torch.randint(0, len(self.train) - self.window, (self.batch,), generator=self.gen)
        return torch.stack([self.train[s:s + self.window] for s in starts]).long().to(self.device)


def lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross entropy of ``batch [B, T + 1]`` (nats / byte)."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def evaluate(model: torch.nn.Module, val_batches: list) -> float:
    """Mean validation loss in eval mode, without gradients (the model is left in train mode)."""
    model.eval()
    with torch.no_grad():
        value = sum(lm_loss(model, b).item() for b in val_batches) / len(val_batches)
    model.train()
    return value


def train_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, lm: LMData, *, steps: int, eval_every: int,
                name: str, extra_loss: Optional[Callable[[int], torch.Tensor]] = None) -> tuple[list, float]:
    """``steps`` AdamW-style steps on random training batches with the demo's schedule (linear
    warm-up over the first 10% of the steps, then cosine, floor 5%; each parameter group's
    base rate is its ``lr`` at the first call), gradient clipping at 1, a progress bar, and a
    validation point every ``eval_every`` steps. ``extra_loss(step)`` (1-based, called
    before the step's forward) is added to the language-modeling loss (e.g. an L0
    penalty). Returns ``(curve [(step, val_loss)], training seconds)``, the curve starting
    with the loss before training at step 0."""
    device = lm.device
    curve = [(0, evaluate(model, lm.val_batches))]
    for group in opt.param_groups:
        group.setdefault("base_lr", group["lr"])
    params = [p for group in opt.param_groups for p in group["params"]]
    train_time = 0.0
    for i in range(1, steps + 1):
        lr_scale = min(1.0, i / max(1, steps // 10)) * 0.5 * (1 + math.cos(math.pi * i / steps))
        for group in opt.param_groups:
            group["lr"] = group["base_lr"] * max(lr_scale, 0.05)
        batch = lm.random_batch()
        synchronize(device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        extra = None if extra_loss is None else extra_loss(i)  # before the forward: it may freeze parameters
        loss = lm_loss(model, batch)
        (loss if extra is None else loss + extra).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        loss_value = loss.item()
        synchronize(device)
        train_time += time.perf_counter() - t0
        if i % eval_every == 0 or i == steps:
            curve.append((i, evaluate(model, lm.val_batches)))
        tok_s = i * lm.batch * (lm.window - 1) / train_time
        progress(name, i, steps, f"loss {loss_value:.3f}  val {curve[-1][1]:.3f}  "
                                 f"{1e3 * train_time / i:.0f} ms/step  {tok_s:,.0f} tok/s")
    return curve, train_time


def train_variant(name: str, data: torch.Tensor, args, device: torch.device) -> Result:
    torch.manual_seed(args.seed)
    reset_peak_memory(device)
    cfg = DecoderConfig(vocab_size=256, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                        **VARIANTS[name])
    model = Decoder(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    lm = LMData.from_corpus(data, seq=args.seq, batch=args.batch, val_batches=args.val_batches, seed=args.seed,
                            device=device)
    curve, train_time = train_steps(model, opt, lm, steps=args.steps, eval_every=args.eval_every, name=name)
    peak = peak_memory(device)
    return Result(name, model.num_parameters(), args.steps, curve[-1][1], min(v for _, v in curve),
                  args.steps * args.batch * args.seq / train_time, 1e3 * train_time / args.steps,
                  None if peak is None else peak / 2**20, curve)


def write_plot(results: list[Result], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for r in results:
        steps, losses = zip(*r.curve)
        ax.plot(steps, losses, marker=".", label=f"{r.variant} (best {r.best_val_loss:.3f})")
    ax.set_xlabel("training step")
    ax.set_ylabel("validation loss (nats / byte)")
    ax.set_title("headwise.demo: byte-level decoders on the Python standard library")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m headwise.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=150, help="training steps per variant")
    p.add_argument("--out", default="demo_out", help="output directory for demo.json and loss.png")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS),
                   help=f"any of {', '.join(VARIANTS)}")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--val-batches", type=int, default=4)
    p.add_argument("--corpus-bytes", type=int, default=4_000_000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for v in args.variants:
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r}; choose from {list(VARIANTS)}")
    if args.steps < 1:
        p.error("--steps must be at least 1")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")

    data = load_corpus(args.corpus_bytes)
    print(f"headwise.demo: {len(data):,} bytes of Python standard-library source; "
          f"d={args.d_model} L={args.layers} H={args.heads} T={args.seq} B={args.batch}, "
          f"{args.steps} steps per variant on {device}", file=sys.stderr)
    results = [train_variant(v, data, args, device) for v in args.variants]

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {
        "corpus": {"source": "Python standard library *.py", "bytes": len(data)},
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "variants")},
        "torch": torch.__version__,
        "variants": {r.variant: asdict(r) for r in results},
    }
    (out / "demo.json").write_text(json.dumps(summary, indent=1))
    plotted = write_plot(results, out / "loss.png")
    print(f"\n{'variant':<15} {'params':>9} {'val loss':>9} {'best':>7} {'ms/step':>8} {'tok/s':>9} {'peak MiB':>9}")
    for r in results:
        peak = "-" if r.peak_memory_mib is None else f"{r.peak_memory_mib:.0f}"
        print(f"{r.variant:<15} {r.parameters:>9,} {r.final_val_loss:>9.3f} {r.best_val_loss:>7.3f} "
              f"{r.step_ms:>8.1f} {r.tokens_per_s:>9,.0f} {peak:>9}")
    print(f"wrote {out / 'demo.json'}" + (f" and {out / 'loss.png'}" if plotted else
                                         " (loss.png skipped: matplotlib is not installed)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
