"""python -m headwise.prune: the two head-removal methods of ``seeds/000_*`` on a small
decoder, from scores and gates to a physically pruned model.

1. Trains the demo's byte-level decoder (``headwise.demo``: the Python standard library's
   source as the corpus, the same training loop) with the standard residual stream, or
   reuses the checkpoint DIR/base.pt that an earlier run with the same settings saved.
2. (a) Score-threshold masks (Sandoval-Segura et al.): collects AHON and circuit-based
   scores of every head over training batches from the head merge's statistics, and for
   each score (layer-normalized, as the paper's AHON (LN), and raw) closes the heads
   below the q-quantile of the model's scores, q = 0 ... 0.75, measuring the validation
   loss of the hard-masked model (no rescale). A random ranking is the baseline.
3. (b) Learned gates (Shim et al.): a ``HeadGate`` (BinConcrete, init 2, rescale) per
   layer, trained with the model under the L0 penalty ``lambda * sum_h sigmoid(pi_h)``
   with the warm-up / freeze schedule (``L0Schedule``) scaled to the run: warm-up over
   the first 20% of the gate steps, gates frozen after 80%. Reports the sparsity
   (heads with ``pi <= 0``) and the validation loss of the deterministic gates.
4. (c) Prunes the gated model physically (``prune_model_heads``, rescale folded into
   W_O; the GQA rule shows the mask asked for and the mask pruned), checks that its
   logits equal the masked model's, and times a training step (forward, backward, AdamW)
   of the masked model against the pruned one, interleaved, median of the repeats.

Writes DIR/prune.json (everything measured) and DIR/prune.png (validation loss against
the fraction of heads removed, one line per score, with the gate result as a point; the
step times). ``--quick`` is a seconds-long smoke run of the same path (for the tests).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch

from . import demo
from .bench.timing import interleaved_median_ms
from .head_gating import add_head_gates, attention_layers, clear_head_gates, gate_masks, set_head_masks
from .head_pruning import AllHeadsClosedError, prune_model_heads
from .head_scores import collect_head_scores, quantile_masks
from .models import Decoder, DecoderConfig
from .nn.head_gate import L0Schedule

FRACTIONS = (0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75)
SCORES = (("ahon", True), ("circuit", True), ("ahon", False), ("circuit", False))
QUICK = dict(steps=2, gate_steps=3, d_model=32, layers=2, heads=4, kv_heads=2, seq=16, batch=2, val_batches=1,
             score_batches=1, eval_every=3, corpus_bytes=200_000, timing_repeats=2, threads=1)


def score_label(kind: str, layer_normalized: bool) -> str:
    return {"ahon": "AHON", "circuit": "circuit"}[kind] + (" (LN)" if layer_normalized else "")


def base_model(args, lm: demo.LMData, out: Path, device: torch.device) -> tuple[Decoder, dict]:
    """The trained base decoder: DIR/base.pt when its settings match, else trained and saved."""
    cfg = DecoderConfig(vocab_size=256, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                        n_kv_heads=args.kv_heads, residual="residual")
    settings = {"config": asdict(cfg), "steps": args.steps, "lr": args.lr, "seed": args.seed, "seq": args.seq,
                "batch": args.batch, "corpus_bytes": args.corpus_bytes}
    path = out / "base.pt"
    torch.manual_seed(args.seed)
    model = Decoder(cfg).to(device)
    if path.exists() and not args.retrain:
        saved = torch.load(path, map_location=device, weights_only=True)
        if saved.get("settings") == settings:
            model.load_state_dict(saved["state_dict"])
            print(f"headwise.prune: reusing the base model of {path}", file=sys.stderr)
            return model, {**saved["result"], "reused": True}
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    curve, seconds = demo.train_steps(model, opt, lm, steps=args.steps, eval_every=args.eval_every, name="base")
    result = {"steps": args.steps, "val_loss": curve[-1][1], "curve": curve, "train_seconds": seconds,
              "parameters": model.num_parameters()}
    torch.save({"settings": settings, "state_dict": model.state_dict(), "result": result}, path)
    return model, {**result, "reused": False}


def mask_sweep(model: Decoder, lm: demo.LMData, args) -> dict:
    """(a): scores, then the validation loss of each quantile mask, per score."""
    batches = [lm.random_batch()[:, :-1] for _ in range(args.score_batches)]
    scores = collect_head_scores(model, batches)
    random_scores = torch.rand(scores.ahon.shape, generator=torch.Generator().manual_seed(args.seed))
    tables = {score_label(k, ln): scores.get(k, layer_normalized=ln) for k, ln in SCORES}
    tables["random"] = random_scores
    lines = {}
    for label, table in tables.items():
        points = []
        for q in FRACTIONS:
            masks = quantile_masks(table, q)
            set_head_masks(model, masks, rescale=False)
            points.append({"quantile": q, "removed": 1.0 - masks.mean().item(),
                           "val_loss": demo.evaluate(model, lm.val_batches)})
        clear_head_gates(model)
        lines[label] = points
        print(f"  {label:<14} " + "  ".join(f"{p['removed']:.2f}:{p['val_loss']:.3f}" for p in points),
              file=sys.stderr)
    return {"score_tokens": scores.tokens, "scores": {k: v.tolist() for k, v in tables.items()}, "lines": lines}


def gate_training(model: Decoder, lm: demo.LMData, args) -> dict:
    """(b): HeadGates under the L0 penalty and schedule, trained with the model."""
    gates = add_head_gates(model, init=2.0, generator=torch.Generator().manual_seed(args.seed))
    gate_params = [g.pi for g in gates]
    gate_ids = {id(p) for p in gate_params}
    opt = torch.optim.AdamW([
        {"params": [p for p in model.parameters() if id(p) not in gate_ids], "lr": args.lr * args.finetune_lr_scale},
        {"params": gate_params, "lr": args.gate_lr, "weight_decay": 0.0},
    ], lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    warmup, freeze = max(1, args.gate_steps // 5), max(1, (4 * args.gate_steps) // 5)
    schedule = L0Schedule(args.l0_lambda, warmup_steps=warmup, freeze_after=freeze)
    expected = []

    def penalty(step: int) -> torch.Tensor:
        value = schedule.penalty(step - 1, gates)
        expected.append(sum(g.expected_l0().item() for g in gates))
        return value

    curve, seconds = demo.train_steps(model, opt, lm, steps=args.gate_steps, eval_every=args.eval_every,
                                      name="gates", extra_loss=penalty)
    masks = gate_masks(model)
    total = sum(m.numel() for m in masks)
    closed = sum(int((m == 0).sum()) for m in masks)
    return {"schedule": {"lambda": args.l0_lambda, "warmup_steps": warmup, "freeze_after": freeze,
                         "gate_lr": args.gate_lr},
            "steps": args.gate_steps, "val_loss": curve[-1][1], "curve": curve, "train_seconds": seconds,
            "expected_open_heads": expected, "sparsity": closed / total, "heads_closed": closed, "heads": total,
            "pi": [g.pi.detach().tolist() for g in gates], "masks": [m.tolist() for m in masks]}


def prune_and_time(model: Decoder, lm: demo.LMData, args, device: torch.device) -> dict:
    """(c): the gated model as a fixed mask (rescale) against its physically pruned copy."""
    priority = [layer.head_gate.pi.detach() for layer in attention_layers(model)]  # the gate logits
    masks = gate_masks(model)
    set_head_masks(model, masks, rescale=True)
    masked = model
    pruned = copy.deepcopy(model)
    try:
        report = prune_model_heads(pruned, masks, rescale=True, priority=priority)
    except AllHeadsClosedError as err:
        return {"refused": str(err)}
    set_head_masks(masked, report.pruned, rescale=True)  # the masked model the pruning is equal to
    tokens = lm.val_batches[0][:, :-1]
    with torch.no_grad():
        a, b = masked(tokens), pruned(tokens)
    max_diff = (a - b).abs().max().item() / a.abs().max().item()
    result = {"asked_masks": [m.tolist() for m in report.asked], "pruned_masks": [m.tolist() for m in report.pruned],
              "heads_pruned": sum(int((m == 0).sum()) for m in report.pruned),
              "logits_rel_diff": max_diff,
              "val_loss_masked": demo.evaluate(masked, lm.val_batches),
              "val_loss_pruned": demo.evaluate(pruned, lm.val_batches),
              "parameters_masked": sum(p.numel() for p in masked.parameters()),
              "parameters_pruned": sum(p.numel() for p in pruned.parameters())}
    unmasked = copy.deepcopy(masked)
    clear_head_gates(unmasked)
    result["val_loss_unmasked"] = demo.evaluate(unmasked, lm.val_batches)  # after the gate run, every head open
    steps = {}
    for name, m in (("unmasked", unmasked), ("masked", masked), ("pruned", pruned)):
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
        fixed = lm.random_batch()

        def step(m=m, opt=opt, fixed=fixed) -> None:
            opt.zero_grad(set_to_none=True)
            demo.lm_loss(m, fixed).backward()
            opt.step()

        steps[name] = (step, None)
    times = interleaved_median_ms(steps, device, repeats=args.timing_repeats, warmup=2)
    result["step_ms"] = times
    result["speedup_pruned_vs_masked"] = times["masked"] / times["pruned"]
    return result


def write_plot(summary: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.5), dpi=120, gridspec_kw={"width_ratios": [2.2, 1]})
    for label, points in summary["masks"]["lines"].items():
        ax.plot([p["removed"] for p in points], [p["val_loss"] for p in points], marker=".",
                linestyle=":" if label == "random" else "-", label=label)
    gates = summary["gates"]
    ax.plot([gates["sparsity"]], [gates["val_loss"]], marker="*", markersize=12, linestyle="none", color="black",
            label=f"L0 gates ({gates['steps']} more training steps, rescaled)")
    if "val_loss_unmasked" in summary["pruning"]:
        ax.plot([0.0], [summary["pruning"]["val_loss_unmasked"]], marker="*", markersize=12, linestyle="none",
                markerfacecolor="none", color="black", label="same run, every head open")
    ax.set_xlabel("fraction of heads removed (quantile mask, no rescale, no retraining)")
    ax.set_ylabel("validation loss (nats / byte)")
    ax.set_title("score-threshold masks vs learned gates")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    timing = summary["pruning"].get("step_ms")
    if timing:
        names = list(timing)
        bx.bar(names, [timing[n] for n in names], color=["grey", "tab:orange", "tab:green"])
        bx.set_ylabel("training step (ms, median)")
        bx.set_title(f"gates closed {gates['heads_closed']}/{gates['heads']} heads, "
                     f"{summary['pruning']['heads_pruned']} pruned (GQA rule)",
                     fontsize=9)
    else:
        bx.text(0.5, 0.5, "pruning refused:\n" + summary["pruning"].get("refused", ""), ha="center", va="center",
                wrap=True, fontsize=8)
        bx.set_axis_off()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m headwise.prune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="prune_out", help="output directory (prune.json, prune.png, base.pt)")
    p.add_argument("--quick", action="store_true", help="a tiny smoke run of every stage (seconds)")
    p.add_argument("--retrain", action="store_true", help="train the base model even if DIR/base.pt matches")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--steps", type=int, default=300, help="training steps of the base model")
    p.add_argument("--gate-steps", type=int, default=150, help="training steps with the L0 gates")
    p.add_argument("--l0-lambda", type=float, default=0.02, help="L0 weight after the warm-up")
    p.add_argument("--gate-lr", type=float, default=0.05, help="learning rate of the gate logits pi")
    p.add_argument("--finetune-lr-scale", type=float, default=0.3,
                   help="the model's learning rate while the gates train, as a fraction of --lr")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--val-batches", type=int, default=4)
    p.add_argument("--score-batches", type=int, default=8, help="training batches the scores are collected over")
    p.add_argument("--timing-repeats", type=int, default=15)
    p.add_argument("--corpus-bytes", type=int, default=4_000_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    for name in ("steps", "gate_steps", "score_batches", "timing_repeats", "val_batches", "eval_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be at least 1")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(args.threads or threads)
        args.threads = torch.get_num_threads()
        return run(args, device)
    finally:
        torch.set_num_threads(threads)


def run(args, device: torch.device) -> int:
    """The study with parsed arguments (module docstring); returns the exit status."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    data = demo.load_corpus(args.corpus_bytes)
    lm = demo.LMData.from_corpus(data, seq=args.seq, batch=args.batch, val_batches=args.val_batches, seed=args.seed,
                                 device=device)
    print(f"headwise.prune: {len(data):,} bytes; d={args.d_model} L={args.layers} H={args.heads} "
          f"H_kv={args.kv_heads} T={args.seq} B={args.batch} on {device}", file=sys.stderr)
    model, base = base_model(args, lm, out, device)
    # Each stage draws its training batches from its own seed, so that a run reusing the
    # base checkpoint measures exactly what the run that trained it did.
    lm.gen.manual_seed(args.seed + 1)
    print("(a) validation loss per fraction of heads removed:", file=sys.stderr)
    masks = mask_sweep(model, lm, args)
    lm.gen.manual_seed(args.seed + 2)
    print("(b) L0 gates:", file=sys.stderr)
    gates = gate_training(model, lm, args)
    lm.gen.manual_seed(args.seed + 3)
    print("(c) pruning and step timing:", file=sys.stderr)
    pruning = prune_and_time(model, lm, args, device)
    summary = {
        "corpus": {"source": "Python standard library *.py", "bytes": len(data)},
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "torch": torch.__version__,
        "base": base, "masks": masks, "gates": gates, "pruning": pruning,
    }
    (out / "prune.json").write_text(json.dumps(summary, indent=1))
    plotted = write_plot(summary, out / "prune.png")
    print(f"\nbase: val loss {base['val_loss']:.3f}")
    for label, points in masks["lines"].items():
        print(f"{label:<14} " + "  ".join(f"{p['removed']:.2f}->{p['val_loss']:.3f}" for p in points))
    print(f"L0 gates: {gates['heads_closed']}/{gates['heads']} heads closed (sparsity {gates['sparsity']:.2f}), "
          f"val loss {gates['val_loss']:.3f}")
    if "refused" in pruning:
        print(f"pruning refused: {pruning['refused']}")
    else:
        t = pruning["step_ms"]
        for i, (asked, done) in enumerate(zip(pruning["asked_masks"], pruning["pruned_masks"])):
            print(f"layer {i}: mask asked {''.join(str(int(v)) for v in asked)}  "
                  f"pruned {''.join(str(int(v)) for v in done)}")
        print(f"pruned {pruning['heads_pruned']} heads (GQA rule; asked {gates['heads_closed']}); pruned == masked: "
              f"logits rel diff "
              f"{pruning['logits_rel_diff']:.2e}; val loss every head open {pruning['val_loss_unmasked']:.3f}, masked "
              f"{pruning['val_loss_masked']:.3f}, pruned {pruning['val_loss_pruned']:.3f}; training step "
              f"unmasked {t['unmasked']:.1f} ms, masked {t['masked']:.1f} ms, pruned {t['pruned']:.1f} ms "
              f"({pruning['speedup_pruned_vs_masked']:.2f}x)")
    print(f"wrote {out / 'prune.json'}" + (f" and {out / 'prune.png'}" if plotted else
                                          " (prune.png skipped: matplotlib is not installed)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
