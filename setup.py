"""Build of headwise: the op library (headwise._C: CPU kernels, plus CUDA kernels when
built with CUDA) and the emulated library (headwise._sim: the CUDA kernels compiled for
the CPU against the SIMT emulator of csrc/common/simt).

Install with `pip install --no-build-isolation .` into an environment that has torch.

Environment switches (SPEC section 1):
  HEADWISE_FORCE_CUDA=1   compile the CUDA kernels or fail (needs nvcc and a CUDA torch)
  HEADWISE_FORCE_CPU=1    CPU kernels only
  HEADWISE_CUDA_ARCHS     semicolon/comma list of SM versions, default "90" (sm_90 + PTX)
  HEADWISE_WERROR=1       treat warnings in headwise's sources as errors
  HEADWISE_PTXAS_VERBOSE=1  print ptxas register/spill reports
  HEADWISE_SANITIZE=1     CPU kernels and emulator with -fsanitize=address,undefined (implies
                          FORCE_CPU; run with libasan preloaded, see `make sanitize`)
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


def _cuda_archs() -> list[str]:
    archs = [a for a in re.split(r"[;, ]+", os.environ.get("HEADWISE_CUDA_ARCHS", "90")) if a]
    flags = []
    for a in archs:
        a = a.replace("sm_", "").replace(".", "")
        flags.append(f"-gencode=arch=compute_{a},code=sm_{a}")
    newest = max(archs, key=lambda a: int(re.sub(r"\D", "", a)))
    newest = newest.replace("sm_", "").replace(".", "")
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
        cxx = [f for f in cxx if f != "-O3"] + ["-O1", "-g"] + sanitize
        openmp_link = openmp_link + sanitize
    cpu_sources = ["csrc/registration.cpp"] + _sources("*/*_cpu.cpp")
    # The emulated library: the emulator, its self-test kernels, and every *_sim.cpp.
    sim_sources = ["csrc/register_sim.cpp"] + _sources("common/simt/*.cpp", "*/*_sim.cpp")

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
    sim_lib = CppExtension("headwise._sim", sim_sources,
                           extra_compile_args={"cxx": cxx + ["-Wno-unknown-pragmas"]},
                           extra_link_args=openmp_link)
    print(f"headwise: building {'CPU + CUDA' if with_cuda else 'CPU'} op library and the emulated library")
    return [op_lib, sim_lib]


setup(
    name="headwise",
    version="0.1.0",
    description="Fused CUDA/CPU kernels for the head axis of attention (PyTorch extension)",
    package_dir={"": "python"},
    packages=find_packages("python"),
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildExtension},
    python_requires=">=3.9",
    install_requires=["torch>=2.4", "numpy"],
    extras_require={"test": ["pytest", "hypothesis"], "integration": ["transformers"]},
)
