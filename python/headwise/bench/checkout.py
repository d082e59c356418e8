"""The source checkout the bench tools read and write: csrc/ (the kernels that ptxas and
sass compile) and bench/ (the committed reports, estimates and GPU measurements)."""

from __future__ import annotations

from pathlib import Path


def checkout_root(package_file: str = __file__, cwd: Path | None = None) -> Path:
    """The checkout holding csrc/ and bench/: the one this package lies in when it runs in
    place (python/headwise/bench/, three levels below it), else the current directory or the
    nearest one above it that holds both (an installed package in site-packages has
    neither, and runs from a clone, as .ci/run and device_check.sh do), else the current
    directory (the tools then name the file they miss)."""
    cwd = Path.cwd() if cwd is None else cwd
    for d in (Path(package_file).resolve().parents[3], cwd, *cwd.parents):
        if (d / "csrc").is_dir() and (d / "bench").is_dir():
            return d
    return cwd


ROOT = checkout_root()
BENCH_DIR = ROOT / "bench"
