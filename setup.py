"""Build of headwise: the op library (headwise._C: CPU kernels, plus CUDA kernels when
built with CUDA) and the emulated library (headwise._sim: the CUDA kernels compiled for
the CPU against the SIMT emulator of csrc/common/simt).

Install with `pip install --no-build-isolation .` into an environment that has torch.

Environment switches (SPEC section 1):
  HEADWISE_FORCE_CUDA=1   compile the CUDA kernels or fail (needs nvcc and a CUDA torch)
  HEADWISE_FORCE_CPU=1    CPU kernels only
  HEADWISE_CUDA_ARCHS     semicolon/comma list of SM versions (e.g. "80;90;100"); default:
                          TORCH_CUDA_ARCH_LIST when set, else the visible GPUs, else "8.0;9.0";
                          PTX of the newest is always added
  HEADWISE_WERROR=1       treat warnings in headwise's sources as errors
  HEADWISE_PTXAS_VERBOSE=1  print ptxas register/spill reports
  HEADWISE_SANITIZE=1     CPU kernels and emulator with -fsanitize=address,undefined (implies
                          FORCE_CPU; run with libasan preloaded, see `make sanitize`)
  HEADWISE_SIM_PROFILE=0  skip the profile library headwise._sim_profile (the emulated
                          kernels instrumented to count memory accesses, for
                          `python -m headwise.bench --sim-profile`; built by default)
  MAX_JOBS                parallel compile jobs (read by torch's ninja build)
Without either FORCE switch, the CUDA kernels are built when nvcc is found and torch is
a CUDA build.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def _find_cuda_home() -> str | None:
    """CUDA_HOME if set, else the toolkit that owns nvcc (following wrapper scripts)."""
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    candidates = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = os.path.realpath(nvcc)
        candidates.append(os.path.dirname(os.path.dirname(real)))
        # A wrapper script such as `exec /usr/local/cuda-13.0/bin/nvcc "$@"`.
        try:
            with open(real, "r", errors="ignore") as f:
                m = re.search(r"(/\S+)/bin/nvcc", f.read(4096))
            if m:
                candidates.insert(0, m.group(1))
        except OSError:
            pass
    candidates += ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for c in candidates:
        if os.path.exists(os.path.join(c, "bin", "nvcc")) and os.path.isdir(os.path.join(c, "include")):
            return c
    return None


if not _flag("HEADWISE_FORCE_CPU"):
    _cuda_home = _find_cuda_home()
    if _cuda_home:
        os.environ["CUDA_HOME"] = _cuda_home  # read by torch.utils.cpp_extension at import

import torch  # noqa: E402
from torch.utils.cpp_extension import (  # noqa: E402
    CUDA_HOME,
    BuildExtension,
    CppExtension,
    CUDAExtension,
    include_paths,
)


def _want_cuda() -> bool:
    if _flag("HEADWISE_FORCE_CPU") or _flag("HEADWISE_SANITIZE"):
        return False
    have = CUDA_HOME is not None and torch.version.cuda is not None
    if _flag("HEADWISE_FORCE_CUDA"):
        if not have:
            sys.exit(
                "headwise: HEADWISE_FORCE_CUDA=1 but "
                + ("nvcc was not found (set CUDA_HOME)" if CUDA_HOME is None else "torch is a CPU-only build")
            )
        return True
    return have


DEFAULT_CUDA_ARCHS = "8.0;9.0"


def _cuda_arch_list() -> tuple[list[str], str]:
    """SM versions to compile for ("80", "90a", ...) and where the list came from:
    HEADWISE_CUDA_ARCHS, else TORCH_CUDA_ARCH_LIST, else the visible GPUs, else
    DEFAULT_CUDA_ARCHS. Entries look like "9.0", "90", "sm_90", "9.0a" or "8.6+PTX" (the
    "+PTX" is dropped: PTX of the newest is always added)."""
    for var in ("HEADWISE_CUDA_ARCHS", "TORCH_CUDA_ARCH_LIST"):
        if os.environ.get(var, "").strip():
            text, origin = os.environ[var], var
            break
    else:
        gpus = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}) \
            if torch.cuda.is_available() else []
        text, origin = (";".join(f"{major}.{minor}" for major, minor in gpus), "the visible GPUs") if gpus \
            else (DEFAULT_CUDA_ARCHS, "the default")
    archs = []
    for entry in re.split(r"[;, ]+", text.strip()):
        a = entry.replace("+PTX", "").replace("sm_", "").replace(".", "")
        if not re.fullmatch(r"\d{2,3}[af]?", a):
            sys.exit(f"headwise: {origin} entry {entry!r} is not an SM version such as 9.0, 90 or sm_90")
        if a not in archs:
            archs.append(a)
    return archs, origin


def _cuda_archs() -> list[str]:
    archs, origin = _cuda_arch_list()
    print(f"headwise: CUDA architectures {';'.join(archs)} (from {origin}) + PTX of the newest")
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    newest = max(archs, key=lambda a: int(re.sub(r"\D", "", a)))
    flags.append(f"-gencode=arch=compute_{newest},code=compute_{newest}")  # PTX for newer GPUs
    return flags


def _extra_cuda_includes() -> list[str]:
    """cuBLAS/cuSPARSE/... headers from torch's nvidia-* wheels when CUDA_HOME lacks them."""
    if CUDA_HOME and os.path.exists(os.path.join(CUDA_HOME, "include", "cublas_v2.h")):
        return []
    found = []
    for site in sys.path:
        for pattern in ("nvidia/cu*/include", "nvidia/*/include"):
            for d in sorted(glob.glob(os.path.join(site, pattern))):
                if os.path.isdir(d) and d not in found:
                    found.append(d)
    return found


def _sources(*patterns: str) -> list[str]:
    out = []
    for p in patterns:
        out += sorted(glob.glob(os.path.join("csrc", p)))
    return out


def extensions():
    with_cuda = _want_cuda()
    # -Wno-psabi: the CPU kernels pass 64-byte vectors between always-inlined helpers
    # (csrc/common/cpu_simd.h); GCC notes that such signatures would change the ABI, which
    # never applies to them.
    warn = ["-Wall", "-Wextra", "-Wno-psabi"] + (["-Werror"] if _flag("HEADWISE_WERROR") else [])
    # torch's headers as system headers: warnings are reported for headwise's own code only.
    system = [f for p in include_paths() for f in ("-isystem", p)]
    # -fopenmp: at::parallel_for (CPU kernels; the emulator's block scheduler in
    # csrc/register_sim.cpp) is an inline template, parallel only where the calling code
    # is compiled with OpenMP (torch's OpenMP backend); without it, it runs serially.
    cxx = ["-O3", "-std=c++20", "-DHEADWISE_PYTHON_MODULE", "-fopenmp"] + system + warn
    openmp_link = ["-fopenmp"]
    if _flag("HEADWISE_SANITIZE"):
        # UB aborts (no recovery), so a sanitizer finding fails the test run.
        sanitize = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer"]
        # -fno-var-tracking-assignments: the unrolled emulated kernels exceed GCC's variable
        # tracking limit, and GCC then tracks them twice (the MHAR emulated kernels, then one
        # file: 307 s with the flag, over 10 min without, ~30 min in a CI run); the reports
        # keep their file:line.
        cxx = [f for f in cxx if f != "-O3"] + ["-O1", "-g", "-fno-var-tracking-assignments"] + sanitize
        openmp_link = openmp_link + sanitize
    cpu_sources = ["csrc/registration.cpp"] + _sources("*/*_cpu.cpp")
    # The emulated library: the emulator, its self-test kernels, and every *_sim.cpp.
    emulator = ["csrc/register_sim.cpp", "csrc/common/simt/simt_runtime.cpp", "csrc/common/simt/simt_metrics.cpp"]
    sim_kernels = _sources("*/*_sim.cpp")
    sim_sources = emulator + ["csrc/common/simt/simt_selftest.cpp"] + sim_kernels

    if with_cuda:
        nvcc = [
            "-O3",
            "-std=c++20",
            "-lineinfo",
            "--expt-relaxed-constexpr",
            "-DHEADWISE_PYTHON_MODULE",
            "-DHEADWISE_WITH_NVTX",
        ] + system + _cuda_archs()
        if _flag("HEADWISE_WERROR"):
            nvcc += ["-Werror=all-warnings", "-Xcompiler=-Wall,-Wextra,-Werror"]
        if _flag("HEADWISE_PTXAS_VERBOSE"):
            nvcc += ["-Xptxas=-v"]
        op_lib = CUDAExtension(
            "headwise._C",
            cpu_sources + ["csrc/register_cuda.cu"] + _sources("*/*_cuda.cu"),
            include_dirs=_extra_cuda_includes(),
            extra_compile_args={"cxx": cxx + ["-DHEADWISE_WITH_NVTX"], "nvcc": nvcc},
            extra_link_args=openmp_link,
        )
    else:
        op_lib = CppExtension("headwise._C", cpu_sources, extra_compile_args={"cxx": cxx},
                              extra_link_args=openmp_link)
    # Kernel sources carry `#pragma unroll` for nvcc, which the host compiler does not know.
    sim_cxx = cxx + ["-Wno-unknown-pragmas"]
    sim_lib = CppExtension("headwise._sim", sim_sources, extra_compile_args={"cxx": sim_cxx},
                           extra_link_args=openmp_link)
    libs = [op_lib, sim_lib]
    # The profile library: the same emulated kernels, counting their memory accesses
    # (csrc/common/simt/simt_metrics.h). Its emulator sources are compiled as usual, its
    # kernel sources (instrumented_sources, see BuildExtensionWithInstrumentation) with
    # PROFILE_INSTRUMENTATION. Not with HEADWISE_SANITIZE: the two instrumentations clash.
    if os.environ.get("HEADWISE_SIM_PROFILE", "1") != "0" and not _flag("HEADWISE_SANITIZE"):
        profile_cxx = sim_cxx + ["-DHW_SIM_PROFILE"]
        profile_lib = CppExtension("headwise._sim_profile", emulator, extra_compile_args={"cxx": profile_cxx},
                                   extra_link_args=openmp_link)
        profile_lib.instrumented_sources = sim_kernels + ["csrc/common/simt/simt_metrics_selftest.cpp"]
        profile_lib.depends = list(profile_lib.depends) + profile_lib.instrumented_sources
        libs.append(profile_lib)
    print(f"headwise: building {'CPU + CUDA' if with_cuda else 'CPU'} op library and the emulated librar"
          + ("ies (plain and profile)" if len(libs) == 3 else "y"))
    return libs


# g++ calls __asan_{load,store}*_noabort (defined by csrc/common/simt/simt_metrics.cpp)
# before every memory access, and nothing else: no shadow memory, no stack or global
# redzones. -g1: line tables, to name the source line of an access. -fno-gnu-unique: a
# kernel template's `__shared__` (static thread_local) variable would otherwise be an
# STB_GNU_UNIQUE symbol, which the dynamic linker binds to headwise._sim's copy when both
# libraries are loaded; it must be this library's, where the metrics look for shared memory.
PROFILE_INSTRUMENTATION = [
    "-fsanitize=kernel-address",
    "--param", "asan-instrumentation-with-call-threshold=0",
    "--param", "asan-stack=0",
    "--param", "asan-globals=0",
    "-g1",
    "-fno-gnu-unique",
]


class BuildExtensionWithInstrumentation(BuildExtension):
    """torch's BuildExtension, plus per-source flags for an extension that has
    `instrumented_sources`: those are compiled with PROFILE_INSTRUMENTATION into a folder of
    their own and linked in; the extension's other sources are compiled without it, into
    another folder (the profile library shares source files with headwise._sim, built with
    other flags)."""

    def build_extension(self, ext):
        instrumented = getattr(ext, "instrumented_sources", None)
        if not instrumented:
            return super().build_extension(ext)
        args = ext.extra_compile_args
        cxx = list(args["cxx"] if isinstance(args, dict) else args) + PROFILE_INSTRUMENTATION
        ext.extra_objects = self.compiler.compile(
            instrumented, output_dir=os.path.join(self.build_temp, ext.name + ".instrumented"),
            macros=ext.define_macros, include_dirs=ext.include_dirs, debug=self.debug,
            extra_postargs={"cxx": cxx} if isinstance(args, dict) else cxx, depends=ext.depends)
        build_temp = self.build_temp
        self.build_temp = os.path.join(build_temp, ext.name)
        try:
            return super().build_extension(ext)
        finally:
            self.build_temp = build_temp


setup(
    name="headwise",
    version="0.1.0",
    description="Fused CUDA/CPU kernels for the head axis of attention (PyTorch extension)",
    package_dir={"": "python"},
    packages=find_packages("python"),
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildExtensionWithInstrumentation},
    python_requires=">=3.9",
    install_requires=["torch>=2.4", "numpy"],
    extras_require={"test": ["pytest", "hypothesis"], "integration": ["transformers"]},
)
