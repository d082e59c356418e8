#!/usr/bin/env bash
# bench/device_check.sh [RESULTS_DIR]
#
# The one prepared check for a machine with an NVIDIA GPU and no network (SPEC section 6):
# builds headwise in place against that machine's torch (sm_90 + PTX, ptxas reports kept),
# runs the primitive self-tests (mma.sync / ldmatrix / cp.async / cluster lane maps: the
# only check of the emulator's fragment maps against real hardware) and the sample GEMM,
# the other CUDA tests, compute-sanitizer memcheck and racecheck on small cases, the
# emulator's H200 estimates beside the measured times (python -m headwise.bench.calibrate),
# then the GPU benchmarks. Each stage has its own time limit, cut further by what is left of one
# 9-minute budget for the whole script (a stage with under 15 s left is skipped); a
# failing stage is reported and the next one still runs. Everything lands in
# RESULTS_DIR (default ./device_results): device_check.log, build.log, ptxas.txt,
# primitive_tests.xml, cuda_tests.xml, sanitizer_*.log, calibration.json,
# bench_{mhar,qkv,merge,dcmha}.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-device_results}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
exec > >(tee -a "$OUT_DIR/device_check.log") 2>&1
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
status=0
stage() { echo; echo "=== $1  ($(date +%H:%M:%S))"; }
fail() { echo "!!! stage failed: $1"; status=1; }
DEADLINE=$(( $(date +%s) + ${HEADWISE_CHECK_BUDGET_S:-540} ))
# cap N: the stage's limit, at most what is left of the budget (0: skip the stage).
cap() { local left=$(( DEADLINE - $(date +%s) )); (( left < 15 )) && { echo 0; return; }; echo $(( $1 < left ? $1 : left )); }
run_capped() {  # run_capped LIMIT_S NAME CMD...: runs CMD under the capped limit
  local limit; limit=$(cap "$1"); local name=$2; shift 2
  if (( limit == 0 )); then echo "--- skipped (budget spent): $name"; status=1; return; fi
  timeout "$limit" "$@" || fail "$name"
}

stage "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || fail nvidia-smi
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" || fail torch

stage "build (sm_90 + PTX, in place)"
rm -rf build python/headwise/_C*.so python/headwise/_sim*.so
if HEADWISE_FORCE_CUDA=1 HEADWISE_SIM_PROFILE=0 HEADWISE_PTXAS_VERBOSE=1 HEADWISE_CUDA_ARCHS="${HEADWISE_CUDA_ARCHS:-90}" \
   MAX_JOBS=$(nproc) timeout "$(cap 240)" $PY setup.py build_ext --inplace > "$OUT_DIR/build.log" 2>&1; then
  grep -E "ptxas info|bytes stack frame|spill" "$OUT_DIR/build.log" > "$OUT_DIR/ptxas.txt" || true
  echo "ptxas: $(grep -c 'Used' "$OUT_DIR/ptxas.txt") kernel reports; spills:"
  grep -E "[1-9][0-9]* bytes spill" "$OUT_DIR/ptxas.txt" || echo "  none"
else
  tail -40 "$OUT_DIR/build.log"; fail build
  exit 1
fi
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"

PRIMITIVE_TESTS="simt/test_primitives.py gemm/test_sample_gemm.py"
stage "primitive self-tests and sample GEMM on the GPU (lane maps against the hardware)"
cd tests
run_capped 60 "primitive tests" $PY -m pytest -q -ra -k cuda --junitxml="$OUT_DIR/primitive_tests.xml" \
  $PRIMITIVE_TESTS
run_capped 20 "sample gemm timing" $PY -c "
import torch, headwise
a = torch.randn(4096, 4096, device='cuda', dtype=torch.bfloat16); b = torch.randn_like(a)
for name, f in [('headwise.sample_gemm', lambda: torch.ops.headwise.sample_gemm(a, b)), ('torch.mm', lambda: a @ b.t())]:
    f(); torch.cuda.synchronize(); s, e = torch.cuda.Event(True), torch.cuda.Event(True); s.record()
    for _ in range(20): f()
    e.record(); torch.cuda.synchronize(); ms = s.elapsed_time(e) / 20
    print(f'{name:22s} 4096^3 bf16: {ms:.3f} ms, {2 * 4096**3 / ms / 1e9:.0f} TFLOP/s')"

stage "CUDA tests"
run_capped 120 "cuda tests" $PY -m pytest -q -ra -k cuda --junitxml="$OUT_DIR/cuda_tests.xml" \
  $(for t in $PRIMITIVE_TESTS; do echo "--ignore=$t"; done) .
cd ..

stage "compute-sanitizer memcheck + racecheck (small cases)"
for tool in memcheck racecheck; do
  run_capped 60 "compute-sanitizer $tool" compute-sanitizer --tool "$tool" --error-exitcode 9 \
    $PY bench/sanitize_cases.py > "$OUT_DIR/sanitizer_$tool.log" 2>&1
  tail -3 "$OUT_DIR/sanitizer_$tool.log"
done

stage "H200 estimates beside GPU times (calibrates the emulator's estimate)"
run_capped 90 "calibrate" $PY -m headwise.bench.calibrate --json "$OUT_DIR/calibration.json"

stage "GPU benchmarks"
run_capped 90 "bench mhar" $PY -m headwise.bench mhar --device cuda --json "$OUT_DIR/bench_mhar.json"
run_capped 45 "bench qkv" $PY -m headwise.bench qkv --device cuda --json "$OUT_DIR/bench_qkv.json"
run_capped 60 "bench merge" $PY -m headwise.bench merge --device cuda --json "$OUT_DIR/bench_merge.json"
run_capped 60 "bench dcmha" $PY -m headwise.bench dcmha --device cuda --json "$OUT_DIR/bench_dcmha.json"

stage "done (status $status)"
exit $status
