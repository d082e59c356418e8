"""The instruction mix of the CUDA kernels' hot loops, from the SASS that ptxas emits:
how many instructions a warp issues per mma.sync (HMMA) in one steady-state iteration.

    python -m headwise.bench.sass --family merge [--family F ...] [--arch 90] [--kernel REGEX]
        compiles csrc/<family>/*_cuda.cu to cubins for sm_<arch> with setup.py's flags
        (the same nvcc command as headwise.bench.ptxas), disassembles them with cuobjdump
        (CUDA's, or the `nvidia-cuda-cuobjdump` wheel's) and prints, per kernel whose
        demangled name matches REGEX, its hot loops (a backward branch and the addresses
        it spans) with the instruction classes of one steady iteration.
    ... --out-dir bench
        also writes those families' HMMA loops into bench/sass_sm<arch>.txt, which the
        emulator's H200 estimate reads for its issue term (headwise.bench.sim_profile).
    python -m headwise.bench.sass --cubin F [--kernel REGEX] [--all-loops]
        the same for a cubin made elsewhere.

Why: the first H200 run showed a kernel issue-bound where every memory and tensor term
of the estimate said otherwise (the merge's tensor-core forward: 76 TFLOP/s against the
sample GEMM's 343, its K loop rescanning the gates). A scheduler issues at most one warp
instruction per clock, so a K loop's instructions per HMMA bound its tensor throughput:
`issue_per_hmma` is that number for one steady iteration, `issue_bound_share` the share
of the estimate's mma ceiling that the calibrated issue rate leaves (1.0: issue is not
the limit; constants in headwise.bench.sim_profile.GpuModel).

The steady iteration (hot_path) of a K loop is the path from the loop head to its
backward branch through every ldmatrix and HMMA of the body that issues at least one
copy, shortest among those: a branch taken rarely (a head change, a scan over the gates,
the pipeline's drain) is off it, of a whole-slice copy path and a bounded (zero-fill) one
the shorter, whole one is on it, and an inner loop's body counts once. Where the shortest
such path is a rare one (a K loop's last slice skipping the advance of its copy
sources), the count is a few instructions low. In a loop without HMMA it is the shortest
path through the most ldmatrix, HMMA, cp.async and shared stores. A static count: no latency or dual-issue model,
predicated-off instructions included. Loops are found from backward branches (`BRA` to
a lower address), so a loop the compiler unrolled fully is part of its parent.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

from . import ptxas

DEFAULT_DIR = ptxas.DEFAULT_DIR

# Instruction classes counted per loop: (name, regex on the opcode with its modifiers).
CLASSES = [
    ("hmma", r"^HMMA\."),
    ("ldsm", r"^LDSM"),
    ("ldgsts", r"^LDGSTS"),
    ("ldg", r"^LDG(?!STS|DEPBAR)"),
    ("stg", r"^(STG|RED|ATOM)"),
    ("lds", r"^LDS(?!M)"),
    ("sts", r"^STS"),
    ("bar", r"^(BAR|DEPBAR|LDGDEPBAR|WARPSYNC)"),
    ("shfl", r"^SHFL"),
    ("branch", r"^(BRA|BRX|JMP|EXIT|RET|CALL)"),
]

_FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)")
_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
# BRA [.modifiers] [!]P<n>, target: the optional predicate operand makes it conditional too.
_BRANCH_TARGET = re.compile(r"\bBRA\b(?:\.\w+)*\s+(!?U?P\w+,\s*)?(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))")


@dataclasses.dataclass
class Loop:
    start: int          # address of the loop head (the backward branch's target)
    end: int            # address of the backward branch
    instructions: int   # every instruction of the body, cold branches included
    counts: dict
    path: int = 0       # instructions of one steady-state iteration (hot_path)
    path_counts: dict = dataclasses.field(default_factory=dict)  # the classes on that path

    @property
    def issue_per_hmma(self) -> float | None:
        """Instructions per HMMA of one steady-state iteration (hot_path: a branch taken
        rarely, such as a head change every few slices, is off it)."""
        return self.path / self.path_counts["hmma"] if self.path_counts.get("hmma") else None

    @property
    def issue_bound_share(self) -> float | None:
        """Fraction of the estimate's mma ceiling this loop's issue allows at the model's
        issue rate (1.0: issue is not the limit)."""
        from .sim_profile import H200

        per = self.issue_per_hmma
        if per is None:
            return None
        hmma_per_s = H200.mma_flops_per_s / H200.flops_per_mma
        issue_per_s = H200.sms * H200.issue_per_clock_per_sm * H200.clock_hz * H200.issue_efficiency
        return min(1.0, issue_per_s / (per * hmma_per_s))


@dataclasses.dataclass
class Function:
    name: str            # demangled
    instructions: list   # (address, text)
    loops: list

    def hot_loop(self, cls: str = "hmma") -> Loop | None:
        """The innermost loop with the most instructions of class `cls` (the smallest span
        among those with the maximal count)."""
        cands = [lp for lp in self.loops if lp.counts.get(cls)]
        if not cands:
            return None
        top = max(lp.counts[cls] for lp in cands)
        return min((lp for lp in cands if lp.counts[cls] == top), key=lambda lp: lp.end - lp.start)


def classify(text: str) -> str | None:
    op = text.split()[0] if not text.startswith("@") else text.split()[1]
    for name, pat in CLASSES:
        if re.match(pat, op):
            return name
    return None


def _is_branch(text: str) -> tuple[bool, bool, int | None]:
    """(is a branch, is predicated, absolute target or None)."""
    parts = text.split()
    pred = parts[0].startswith("@")
    op = parts[1] if pred else parts[0]
    if not op.startswith("BRA"):
        return False, pred, None
    m = _BRANCH_TARGET.search(text)
    conditional = (pred and not parts[0].startswith("@PT")) or bool(m and m.group(1) and "PT" not in m.group(1))
    return True, conditional, int(m.group(2), 16) if m and m.group(2) else None


# Instruction classes of a K loop's compute, which every iteration issues (a tile's MMAs
# sit under a causal or bounds test that only the edge tiles fail), and of its operand
# copies, which every iteration but the pipeline's last few issues (under `if (kt <
# k_tiles)`), as a whole-slice fast path or as a bounded path with more instructions.
COMPUTE = ("hmma", "ldsm")
COPIES = ("ldgsts", "sts")


def hot_path(body: list) -> list:
    """The instructions of one steady-state iteration of a loop body (address order, the
    head first, the backward branch last). In a loop with HMMA: the shortest path from the
    head to the back branch among those through the most COMPUTE instructions that issue
    at least one copy, so a branch taken rarely (a head change every few slices, an inner
    scan over the gates) is off it, and of a whole-slice copy path and a bounded one (zero
    fill, fewer rows) the shorter, whole one is taken. In any other loop (MHAR's stages,
    the epilogues): the shortest among those through the most COMPUTE and COPIES
    instructions. Forward branches inside the body may be taken or not when predicated,
    always when not; an inner loop's backward branch is not taken (its body counts once)."""
    index = {a: i for i, (a, _) in enumerate(body)}
    inf = float("inf")
    n = len(body)
    has_hmma = any(classify(t) == "hmma" for _, t in body)
    weighted = COMPUTE if has_hmma else COMPUTE + COPIES
    cost = [1 - 10_000 * (classify(t) in weighted) for _, t in body]
    copy = [has_hmma and classify(t) in COPIES for _, t in body]
    # Shortest paths over (instruction, a copy issued on the way) states.
    dist = [[inf, inf] for _ in range(n)]
    prev = [[None, None] for _ in range(n)]
    dist[0][int(copy[0])] = cost[0]
    for i, (addr, text) in enumerate(body):
        if i == n - 1:
            continue
        branch, pred, target = _is_branch(text)
        succ = []
        if branch and target is not None and target > addr and target in index:
            succ.append(index[target])
            if pred:
                succ.append(i + 1)
        elif not (branch and not pred) and not re.match(r"^(EXIT|RET)", text):
            succ.append(i + 1)  # falls through (a predicated EXIT may too; an unpredicated one ends the path)
        for c in (0, 1):
            if dist[i][c] == inf:
                continue
            for j in succ:
                cj = c | int(copy[j])
                if dist[i][c] + cost[j] < dist[j][cj]:
                    dist[j][cj], prev[j][cj] = dist[i][c] + cost[j], (i, c)
    end = n - 1
    state = 1 if has_hmma and dist[end][1] < inf else 0
    if dist[end][state] == inf:
        return body
    out, node = [], (end, state)
    while node is not None:
        out.append(body[node[0]])
        node = prev[node[0]][node[1]]
    return out[::-1]


def count(instrs: list) -> dict:
    out = {name: 0 for name, _ in CLASSES}
    for _, text in instrs:
        c = classify(text)
        if c:
            out[c] += 1
    return out


def parse(sass: str) -> list[Function]:
    """Functions of `cuobjdump -sass` output with their loops."""
    funcs: list[tuple[str, list]] = []
    for line in sass.splitlines():
        m = _FUNCTION.match(line)
        if m:
            funcs.append((m.group(1), []))
            continue
        m = _INSTR.match(line)
        if m and funcs:
            funcs[-1][1].append((int(m.group(1), 16), m.group(2)))
    names = _demangle([f for f, _ in funcs])
    out = []
    for (mangled, instrs), name in zip(funcs, names):
        loops = []
        for addr, text in instrs:
            m = _BRANCH_TARGET.search(text)
            if not m or m.group(2) is None:
                continue
            target = int(m.group(2), 16)
            if target <= addr:
                body = [(a, t) for a, t in instrs if target <= a <= addr]
                path = hot_path(body)
                loops.append(Loop(target, addr, len(body), count(body), len(path), count(path)))
        out.append(Function(name, instrs, loops))
    return out


def _demangle(names: list[str]) -> list[str]:
    cxxfilt = shutil.which("c++filt")
    if not cxxfilt or not names:
        return names
    run = subprocess.run([cxxfilt], input="\n".join(names) + "\n", capture_output=True, text=True, check=True)
    return run.stdout.splitlines()


def find_cuobjdump() -> str:
    """cuobjdump from CUDA_HOME / PATH, else from the nvidia-cuda-cuobjdump wheel."""
    cands = []
    if os.environ.get("CUDA_HOME"):
        cands.append(os.path.join(os.environ["CUDA_HOME"], "bin", "cuobjdump"))
    if shutil.which("cuobjdump"):
        cands.append(shutil.which("cuobjdump"))
    purelib = sysconfig.get_paths()["purelib"]
    cands += [os.path.join(purelib, "nvidia", v, "bin", "cuobjdump") for v in ("cu13", "cuda_cuobjdump", "cu12")]
    for c in cands:
        if os.path.exists(c):
            return c
    sys.exit("headwise.bench.sass: cuobjdump not found (CUDA's bin, or `pip install nvidia-cuda-cuobjdump`)")


def compile_cubins(family: str, arch: str, out_dir: str) -> list[str]:
    """csrc/<family>/*_cuda.cu (one translation unit per entry) -> one cubin each for
    sm_<arch> in out_dir (<source>_sm<arch>.cubin), with headwise.bench.ptxas's flags."""
    sources = [s for s in ptxas.cuda_sources() if os.path.basename(os.path.dirname(s)) == family]
    if not sources:
        sys.exit(f"headwise.bench.sass: no csrc/{family}/*_cuda.cu")
    cubins = []
    for source in sources:
        out = os.path.join(out_dir, f"{os.path.splitext(os.path.basename(source))[0]}_sm{arch}.cubin")
        nvcc, flags = ptxas.nvcc_command([arch], ["-cubin", "-o", out])
        print(f"nvcc sm_{arch} -cubin {os.path.relpath(source, ptxas.REPO)}", flush=True)
        run = subprocess.run([nvcc, *flags, source], capture_output=True, text=True)
        if run.returncode != 0:
            sys.exit(f"headwise.bench.sass: nvcc failed on {source}:\n{run.stderr[-4000:]}")
        cubins.append(out)
    return cubins


def unique_functions(funcs: list[Function]) -> list[Function]:
    """funcs without repeats: a template kernel instantiated by two translation units of a
    family (e.g. the fp32 MHAR backward of both backward entries) is the same SASS."""
    seen, out = set(), []
    for f in funcs:
        if f.name not in seen:
            seen.add(f.name)
            out.append(f)
    return out


def disassemble(cubin: str) -> list[Function]:
    run = subprocess.run([find_cuobjdump(), "-sass", cubin], capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"headwise.bench.sass: cuobjdump failed:\n{run.stderr[-2000:]}")
    return parse(run.stdout)


@dataclasses.dataclass
class IssueReport:
    """One kernel instantiation's HMMA hot loop: what sim_profile's issue term reads."""
    function: str          # demangled
    issue_per_hmma: float
    steady: int            # instructions of one steady iteration
    hmma: int

    @property
    def name(self) -> str:
        return ptxas.kernel_name(self.function)


def issue_reports(funcs: list[Function]) -> list[IssueReport]:
    out = []
    for f in funcs:
        lp = f.hot_loop("hmma")
        if lp and lp.issue_per_hmma:
            out.append(IssueReport(f.name, lp.issue_per_hmma, lp.path, lp.path_counts["hmma"]))
    return out


def _path(arch: str, directory: str) -> str:
    return os.path.join(directory, f"sass_sm{arch}.txt")


def load(arch: str = "90", directory: str = DEFAULT_DIR) -> list[IssueReport]:
    """bench/sass_sm<arch>.txt: per kernel instantiation with an HMMA loop, its steady
    iteration's instructions per HMMA."""
    path = _path(arch, directory)
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            per, steady, hmma, function = line.rstrip("\n").split("\t")
            out.append(IssueReport(function, float(per), int(steady), int(hmma)))
    return out


def write(reports: list[IssueReport], families: list[str], arch: str, command: str, directory: str) -> str:
    """Replaces the named families' entries of bench/sass_sm<arch>.txt (kept: the others)."""
    keep = [r for r in load(arch, directory) if not any(f"headwise::{fam}::" in r.function for fam in families)]
    path = _path(arch, directory)
    made = []  # the earlier "made by" lines, for the entries kept
    if keep and os.path.exists(path):
        with open(path) as f:
            made = [ln for ln in f if ln.startswith("# made by")]
    with open(path, "w") as f:
        f.write(f"# steady-state K-loop instructions per HMMA, sm_{arch} SASS (python -m headwise.bench.sass)\n")
        f.writelines(made)
        f.write(f"# made by: {command} (families {', '.join(families)})\n")
        f.write("# issue_per_hmma\tinstructions of one steady iteration\tHMMA in it\tkernel\n")
        for r in sorted(keep + reports, key=lambda r: r.function):
            f.write(f"{r.issue_per_hmma:.3f}\t{r.steady}\t{r.hmma}\t{r.function}\n")
    return path


def report(funcs: list[Function], kernel: str | None, all_loops: bool = False) -> str:
    pat = re.compile(kernel) if kernel else None
    cols = [name for name, _ in CLASSES if name != "branch"]
    lines = []
    for f in funcs:
        if pat and not pat.search(f.name):
            continue
        lines.append(f"{f.name[:200]}\n  {len(f.instructions)} instructions, {len(f.loops)} loops")
        loops = f.loops if all_loops else [lp for lp in (f.hot_loop("hmma"), f.hot_loop("ldg"),
                                                          f.hot_loop("ldgsts")) if lp]
        seen = set()
        for lp in sorted(loops, key=lambda lp: lp.start):
            if (lp.start, lp.end) in seen:
                continue
            seen.add((lp.start, lp.end))
            mix = " ".join(f"{c}={lp.path_counts[c]}" for c in cols if lp.path_counts[c])
            per = lp.issue_per_hmma
            tail = f"  issue/hmma={per:.2f} (share of mma ceiling by issue: {lp.issue_bound_share:.2f})" if per else ""
            lines.append(f"  loop [{lp.start:#x}, {lp.end:#x}] {lp.instructions} instr, steady iteration "
                         f"{lp.path}: {mix}{tail}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m headwise.bench.sass", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", action="append",
                   help="csrc/FAMILY/*_cuda.cu (merge, dcmha, mhar, qkv, gemm; repeatable)")
    p.add_argument("--cubin", help="an existing cubin instead of compiling a family")
    p.add_argument("--arch", default="90")
    p.add_argument("--kernel", help="regex on the demangled kernel name")
    p.add_argument("--all-loops", action="store_true", help="every loop, not only the hot ones")
    p.add_argument("--keep", metavar="DIR", help="keep the compiled cubins in DIR (<source>_sm<arch>.cubin)")
    p.add_argument("--out-dir", help="write the families' HMMA loops into OUT_DIR/sass_sm<arch>.txt "
                   "(what the emulator's estimate reads: --out-dir bench)")
    args = p.parse_args(argv)
    if not (args.family or args.cubin):
        p.error("give --family or --cubin")
    command = " ".join(["python -m headwise.bench.sass"] + (argv if argv is not None else sys.argv[1:]))
    funcs = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.cubin:
            funcs = disassemble(args.cubin)
        if args.keep:
            os.makedirs(args.keep, exist_ok=True)
        for fam in args.family or []:
            for cubin in compile_cubins(fam, args.arch, args.keep or tmp):
                funcs += disassemble(cubin)
    funcs = unique_functions(funcs)
    print(report(funcs, args.kernel, args.all_loops))
    if args.out_dir and args.family:
        print(f"wrote {write(issue_reports(funcs), args.family, args.arch, command, args.out_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
