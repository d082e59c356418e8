"""The benchmark's PNG chart: per op, shape and mode, the speedup of headwise over the
eager reference and over torch.compile of it (log scale, 1x marked)."""

from __future__ import annotations

from .timing import Row


def write_png(rows: list[Row], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict = {}
    for r in rows:
        groups.setdefault((r.op, r.shape, r.dtype, r.mode), {})[r.impl] = r.ms
    labels, vs_eager, vs_compile = [], [], []
    for (op, shape, dtype, mode), ms in groups.items():
        if {"eager", "compile", "headwise"} <= ms.keys():
            labels.append(f"{op} {mode}\n{shape} {dtype}")
            vs_eager.append(ms["eager"] / ms["headwise"])
            vs_compile.append(ms["compile"] / ms["headwise"])
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(labels)), 5), dpi=120)
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], vs_eager, width=0.4, label="vs eager reference")
    ax.bar([i + 0.2 for i in x], vs_compile, width=0.4, label="vs torch.compile(reference)")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_ylabel("speedup of headwise (x)")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, fontsize=6)
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
