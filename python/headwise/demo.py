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
from typing import Optional

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


def train_variant(name: str, data: torch.Tensor, args, device: torch.device) -> Result:
    torch.manual_seed(args.seed)
    reset_peak_memory(device)
    cfg = DecoderConfig(vocab_size=256, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                        **VARIANTS[name])
    model = Decoder(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    split = int(0.95 * len(data))
    train, val = data[:split], data[split:]
    gen = torch.Generator().manual_seed(args.seed)
    window = args.seq + 1
    val_starts = torch.linspace(0, len(val) - window - 1, args.val_batches * args.batch).long()
    val_batches = [torch.stack([val[s:s + window] for s in val_starts[i::args.val_batches]]).long().to(device)
                   for i in range(args.val_batches)]

    def loss_of(batch):
        logits = model(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))

    def evaluate():
        model.eval()
        with torch.no_grad():
            value = sum(loss_of(b).item() for b in val_batches) / len(val_batches)
        model.train()
        return value

    def step(batch):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    def batch_at_random():
        starts = torch.randint(0, len(train) - window, (args.batch,), generator=gen)
        return torch.stack([train[s:s + window] for s in starts]).long().to(device)

    curve = [(0, evaluate())]
    train_time, loss = 0.0, float("nan")
    for i in range(1, args.steps + 1):
        lr_scale = min(1.0, i / max(1, args.steps // 10)) * 0.5 * (1 + math.cos(math.pi * i / args.steps))
        for group in opt.param_groups:
            group["lr"] = args.lr * max(lr_scale, 0.05)
        batch = batch_at_random()
        synchronize(device)
        t0 = time.perf_counter()
        loss = step(batch).item()
        synchronize(device)
        train_time += time.perf_counter() - t0
        if i % args.eval_every == 0 or i == args.steps:
            curve.append((i, evaluate()))
        tok_s = i * args.batch * args.seq / train_time
        progress(name, i, args.steps, f"loss {loss:.3f}  val {curve[-1][1]:.3f}  "
                                      f"{1e3 * train_time / i:.0f} ms/step  {tok_s:,.0f} tok/s")
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
