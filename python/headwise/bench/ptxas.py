"""ptxas -v reports of the CUDA kernels: registers, static shared memory, stack and spills
per kernel instantiation, for the occupancy term of the emulator's H200 estimate
(headwise.bench.sim_profile) and for review (SPEC section 6: no register spills).

    python -m headwise.bench.ptxas [--arch 90 ...] [--out-dir bench]
        compiles every csrc/*/*_cuda.cu with `nvcc -Xptxas -v` for the archs (one nvcc call
        per file, warnings as errors, the object discarded) and writes
        OUT_DIR/ptxas_sm<arch>.txt per arch: ptxas's report with the kernel names demangled.
    python -m headwise.bench.ptxas --family merge --arch 80 --arch 90 --out-dir /tmp/p
        the same for the named op families only (csrc/merge/ here), for a quick check.
    python -m headwise.bench.ptxas --from-log BUILD_LOG [--out-dir bench]
        the same report taken from the output of a build with HEADWISE_PTXAS_VERBOSE=1
        (.ci/run keeps the CI build's report this way), one file per arch found.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import re
import shutil
import subprocess
import sys

from . import checkout

REPO = str(checkout.ROOT)
DEFAULT_DIR = str(checkout.BENCH_DIR)
# C++ spellings of the kernel dtypes, as they appear in demangled template arguments.
CPP_DTYPES = {"bfloat16": "c10::BFloat16", "float16": "c10::Half", "float32": "float"}

_ENTRY = re.compile(r"ptxas info\s*: Compiling entry function '(.+)' for '(sm_\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"ptxas info\s*: Used (\d+) registers(?:.*?, (\d+) bytes smem)?")


@dataclasses.dataclass
class KernelReport:
    function: str  # demangled, e.g. void headwise::mhar::mhar_route_fwd_kernel<c10::BFloat16, 8, 1, 0>(...)
    arch: str      # sm_90
    registers: int = 0
    static_smem: int = 0
    stack: int = 0
    spill_stores: int = 0
    spill_loads: int = 0

    @property
    def name(self) -> str:
        return kernel_name(self.function)


def kernel_name(function: str) -> str:
    """Unqualified function name without template arguments of a demangled signature."""
    head = function.split("(", 1)[0]
    depth, out = 0, ""
    for ch in head:  # drop <...>, which may nest
        depth += ch == "<"
        if depth == 0:
            out += ch
        depth -= ch == ">"
    return out.split()[-1].split("::")[-1]


def parse(text: str) -> list[KernelReport]:
    """Kernel reports of ptxas -v output (entries in the order ptxas printed them)."""
    out: list[KernelReport] = []
    current = None
    for line in text.splitlines():
        m = _ENTRY.search(line)
        if m:
            current = KernelReport(m.group(1), m.group(2))
            out.append(current)
            continue
        if current is None:
            continue
        m = _FRAME.search(line)
        if m:
            current.stack, current.spill_stores, current.spill_loads = map(int, m.groups())
            continue
        m = _USED.search(line)
        if m:
            current.registers = int(m.group(1))
            current.static_smem = int(m.group(2) or 0)
    return out


def load(arch: str = "90", directory: str = DEFAULT_DIR) -> list[KernelReport]:
    path = os.path.join(directory, f"ptxas_sm{arch}.txt")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return parse(f.read())


def lookup(reports: list, kernel: str, dtype: str, key=lambda r: r.registers):
    """The report of launch name `kernel` (the CUDA function `kernel` or `kernel_kernel`)
    for `dtype`: among its instantiations for that dtype (all, if it is not a template on
    the dtype), the one with the largest `key` (most registers; the emulator does not say
    which instantiation a launch used). Reports: anything with .function and .name."""
    mine = [r for r in reports if r.name in (kernel, kernel + "_kernel")]
    cpp = CPP_DTYPES.get(dtype, dtype)
    typed = [r for r in mine if cpp in r.function]
    pick = typed or [r for r in mine if not any(t in r.function for t in CPP_DTYPES.values() if t != "float")]
    return max(pick, key=key, default=None)


def _demangle(text: str) -> str:
    cxxfilt = shutil.which("c++filt")
    if not cxxfilt:
        return text
    return subprocess.run([cxxfilt], input=text, capture_output=True, text=True, check=True).stdout


def _keep(text: str) -> str:
    """ptxas's lines only (and the stack/spill lines that follow 'Function properties')."""
    lines = [ln.strip() for ln in text.splitlines() if "ptxas" in ln or _FRAME.search(ln)]
    return "\n".join(lines) + "\n"


def _write(arch: str, body: str, command: str, directory: str) -> str:
    path = os.path.join(directory, f"ptxas_sm{arch}.txt")
    os.makedirs(directory, exist_ok=True)
    with open(path, "w") as f:
        f.write(f"# ptxas -v report for sm_{arch}, made by: {command}\n")
        f.write(body)
    return path


def cuda_sources() -> list[str]:
    """Every csrc/*/*_cuda.cu, sorted."""
    return sorted(glob.glob(os.path.join(REPO, "csrc", "*", "*_cuda.cu")))


def nvcc_command(archs: list[str], output: list[str]) -> tuple[str, list[str]]:
    """nvcc and setup.py's flags for the CUDA kernels (warnings as errors included), for
    `archs`, with `output` (e.g. ["-c", "-o", os.devnull]) and the include paths."""
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    cuda_home = os.environ.get("CUDA_HOME")
    nvcc = os.path.join(cuda_home, "bin", "nvcc") if cuda_home else shutil.which("nvcc")
    if not nvcc or not os.path.exists(nvcc):
        sys.exit("headwise.bench: nvcc not found (put it on PATH or set CUDA_HOME)")
    cuda_home = cuda_home or os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    flags = ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-Werror=all-warnings",
             "-Xcompiler=-Wall,-Wextra,-Werror", *output]
    flags += [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    includes = include_paths() + [sysconfig.get_paths()["include"]]
    if not os.path.exists(os.path.join(cuda_home, "include", "cublas_v2.h")):
        # As setup.py does: ATen's CUDA headers need cuBLAS headers, from torch's nvidia-* wheels.
        includes += sorted(glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "*", "include")))
    flags += [f for p in includes for f in ("-isystem", p)]
    return nvcc, flags


def _nvcc_report(archs: list[str], families: list[str] | None = None) -> str:
    """ptxas -v output of every csrc/*/*_cuda.cu compiled for `archs` in one nvcc call per
    file, with setup.py's flags for the CUDA kernels (warnings as errors included)."""
    nvcc, flags = nvcc_command(archs, ["-Xptxas=-v", "-c", "-o", os.devnull])
    text = ""
    for source in cuda_sources():
        if families and os.path.basename(os.path.dirname(source)) not in families:
            continue
        print(f"nvcc {' '.join('sm_' + a for a in archs)} {os.path.relpath(source, REPO)}", flush=True)
        run = subprocess.run([nvcc, *flags, source], capture_output=True, text=True)
        if run.returncode != 0:
            sys.exit(f"headwise.bench.ptxas: nvcc failed on {source}:\n{run.stderr[-4000:]}")
        text += run.stdout + run.stderr
    return text


def _write_per_arch(text: str, command: str, directory: str) -> list[str]:
    """One report file per arch found in ptxas output `text`."""
    text = _demangle(_keep(text))
    paths = []
    for sm in sorted({r.arch for r in parse(text)}):
        # Each entry's block: its entry line and what follows up to the next entry.
        # A template kernel instantiated by two translation units of a family (e.g. the fp32
        # MHAR backward of both backward entries) is compiled twice: reported once.
        body, keep, seen = [], False, set()
        for line in text.splitlines():
            m = _ENTRY.search(line)
            if m:
                keep = m.group(2) == sm and m.group(1) not in seen
                if keep:
                    seen.add(m.group(1))
            if keep:
                body.append(line)
        paths.append(_write(sm[3:], "\n".join(body) + "\n", command, directory))
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m headwise.bench.ptxas", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", action="append", help="SM version (repeatable; default 90)")
    p.add_argument("--from-log", metavar="BUILD_LOG", help="take the report from a verbose build's output")
    p.add_argument("--family", action="append",
                   help="only csrc/FAMILY/*_cuda.cu (repeatable; default every family), for a quick check")
    p.add_argument("--out-dir", default=DEFAULT_DIR)
    args = p.parse_args(argv)
    command = " ".join(["python -m headwise.bench.ptxas"] + (argv if argv is not None else sys.argv[1:]))
    if args.from_log:
        with open(args.from_log, errors="replace") as f:
            text = f.read()
    else:
        text = _nvcc_report(args.arch or ["90"], args.family)
    paths = _write_per_arch(text, command, args.out_dir)
    if not paths:
        sys.exit("headwise.bench.ptxas: no ptxas report found" +
                 (f" in {args.from_log} (build with HEADWISE_PTXAS_VERBOSE=1)" if args.from_log else ""))
    for path in paths:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
