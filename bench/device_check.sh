#!/usr/bin/env bash
# bench/device_check.sh [RESULTS_DIR]
#
# The one prepared check for a machine with an NVIDIA GPU and no network (SPEC section 6):
# builds headwise in place against that machine's torch (sm_90 + PTX, ptxas reports kept),
# runs the CUDA tests, compute-sanitizer memcheck and racecheck on small cases, the issues'
# acceptance ratios (python -m headwise.bench.targets: merge, DCMHA forward, DCMHA forward +
# backward against flash and DCFormer's compiled query chunks), the compose backward's
# two-row / one-row A/B, the MHAR forward's staged / streaming A/B, the primitive
# self-tests (mma.sync / ldmatrix / cp.async / cluster lane maps against the hardware;
# they passed on the first H200 run) and the sample GEMM,
# the emulator's H200 estimates beside the measured times (python -m headwise.bench.calibrate),
# one ncu report (the merge, MHAR and DCMHA forwards), then the GPU benchmarks. Stages run in that
# order (most valuable first); each has its own time limit, cut further by what is left of one budget for the
# whole script (HEADWISE_CHECK_BUDGET_S, default 530 s; a stage with under 15 s left is
# skipped); a failing stage is reported and the next one still runs.
# RESULTS_DIR (default ./device_results) receives device_check.log (everything printed)
# and device_results.tgz (build.log, ptxas.txt, primitive_tests.xml, cuda_tests.xml,
# targets.json, calibration.json, sanitizer_*.log, ncu.txt, bench_*.json): two files,
# since a lent machine returns at most 8.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-device_results}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
RES="$OUT_DIR/files"
mkdir -p "$RES"
pack() { tar czf "$OUT_DIR/device_results.tgz" -C "$RES" . && rm -rf "$RES"; }
trap pack EXIT
exec > >(tee -a "$OUT_DIR/device_check.log") 2>&1
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
status=0
stage() { echo; echo "=== $1  ($(date +%H:%M:%S), $(( DEADLINE - $(date +%s) )) s left)"; }
fail() { echo "!!! stage failed: $1"; status=1; }
DEADLINE=$(( $(date +%s) + ${HEADWISE_CHECK_BUDGET_S:-530} ))
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
nvcc --version | tail -2
if HEADWISE_FORCE_CUDA=1 HEADWISE_SIM_PROFILE=0 HEADWISE_PTXAS_VERBOSE=1 HEADWISE_CUDA_ARCHS="${HEADWISE_CUDA_ARCHS:-90}" \
   MAX_JOBS=$(nproc) timeout "$(cap 300)" $PY setup.py build_ext --inplace > "$RES/build.log" 2>&1; then
  grep -E "ptxas info|bytes stack frame|spill" "$RES/build.log" > "$RES/ptxas.txt" || true
  echo "ptxas: $(grep -c 'Used' "$RES/ptxas.txt") kernel reports; spills:"
  grep -E "[1-9][0-9]* bytes spill" "$RES/ptxas.txt" || echo "  none"
else
  tail -40 "$RES/build.log"; fail build
  exit 1
fi
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"

PRIMITIVE_TESTS="simt/test_primitives.py gemm/test_sample_gemm.py"
stage "CUDA tests"
cd tests
XDIST=""; $PY -c "import xdist" 2>/dev/null && XDIST="-n 8"
# Without the emulator's launch-limit test: it crashed its xdist worker on the first H200
# run and runs alone under faulthandler below.
run_capped 120 "cuda tests" $PY -m pytest -q -ra $XDIST -k "cuda and not sim_refuses_launches" --junitxml="$RES/cuda_tests.xml" \
  $(for t in $PRIMITIVE_TESTS; do echo "--ignore=$t"; done) .
cd ..

stage "compute-sanitizer memcheck + racecheck (small cases)"
for tool in memcheck racecheck; do
  run_capped 50 "compute-sanitizer $tool" compute-sanitizer --tool "$tool" --error-exitcode 9 \
    $PY bench/sanitize_cases.py > "$RES/sanitizer_$tool.log" 2>&1
  tail -3 "$RES/sanitizer_$tool.log"
done

stage "acceptance ratios of the GPU issues (merge, DCMHA forward)"
run_capped 75 "targets" $PY -m headwise.bench.targets merge dcmha --json "$RES/targets.json"

stage "DCMHA forward + backward at the target shape (bf16: the tensor-core backward) against flash and DCFormer's compiled query chunks"
run_capped 120 "targets dcmha-backward" $PY -m headwise.bench.targets dcmha-backward --json "$RES/targets_dcmha_backward.json"

stage "dcmha_compose backward: the two-row kernel (one CTA per SM) against the one-row kernel (two)"
run_capped 40 "compose bwd rows A/B" $PY -c "
import os, torch, headwise
from headwise.bench.timing import interleaved_median_ms
g = torch.Generator().manual_seed(0)
a = torch.randn(2, 32, 2048, 2048, generator=g).cuda().bfloat16(); dy = torch.randn_like(a)
w = [torch.randn(2, 2048, 4, 2, 32, generator=g).cuda().bfloat16(), torch.randn(2, 2048, 4, 2, 32, generator=g).cuda().bfloat16() * 0.1,
     torch.randn(2, 2048, 4, 32, generator=g).cuda().bfloat16() * 0.1]
def run(rows):
    os.environ['HEADWISE_DCMHA_COMPOSE_BWD_ROWS'] = rows
    return torch.ops.headwise.dcmha_compose_backward(dy, a, *w, 0, 1)
t = interleaved_median_ms({'two rows': (lambda: run('2'), None), 'one row': (lambda: run('1'), None)}, torch.device('cuda'), repeats=10, warmup=2)
print('dcmha_compose backward B=2 H=32 T=S=2048 bf16 (HBM floor est. 395 us):', {k: round(v * 1e3, 1) for k, v in t.items()}, 'us')"

stage "MHAR forward: the staged kernel (rows in shared memory by cp.async) against the streaming one"
run_capped 40 "mhar fwd staged A/B" $PY -c "
import os, torch, headwise
from headwise.bench.timing import interleaved_median_ms
src = torch.randn(9, 2, 4096, 4096, device='cuda', dtype=torch.bfloat16)
q = 0.3 * torch.randn(4096, device='cuda'); g = torch.ones(4096, device='cuda')
def run(flag):
    os.environ['HEADWISE_MHAR_FWD_STAGED'] = flag
    return torch.ops.headwise.mhar_route(src, q, g, 8, 9, 1e-6, None, None)
t = interleaved_median_ms({'staged': (lambda: run('1'), None), 'streaming': (lambda: run('0'), None)}, torch.device('cuda'), repeats=20, warmup=3)
print('mhar_route forward N=9 B=2 T=4096 d=4096 H=8 bf16 (673 MB: 0.140 ms at 4.8 TB/s):', {k: round(v, 3) for k, v in t.items()}, 'ms')"

stage "MHAR backward: the staged kernel (rows, dout, weights in shared memory by cp.async) against mhar_route_bwd_kernel"
run_capped 40 "mhar bwd staged A/B" $PY -c "
import os, torch, headwise
from headwise.bench.timing import interleaved_median_ms
src = torch.randn(9, 2, 4096, 4096, device='cuda', dtype=torch.bfloat16)
q = 0.3 * torch.randn(4096, device='cuda'); g = torch.ones(4096, device='cuda')
_, w = torch.ops.headwise.mhar_route(src, q, g, 8, 9, 1e-6, None, None)
dout = torch.randn(2, 4096, 4096, device='cuda', dtype=torch.bfloat16)
def run(flag):
    os.environ['HEADWISE_MHAR_BWD_STAGED'] = flag
    return torch.ops.headwise.mhar_route_backward(dout, src, q, g, w, None, 8, 9, 1e-6)
t = interleaved_median_ms({'staged': (lambda: run('1'), None), 'unstaged': (lambda: run('0'), None)}, torch.device('cuda'), repeats=20, warmup=3)
print('mhar_route backward N=9 B=2 T=4096 d=4096 H=8 bf16 (1277 MB: 0.266 ms at 4.8 TB/s):', {k: round(v, 3) for k, v in t.items()}, 'ms')
# The tensor-core products (sm_90+: sums by the hardware's tensor core, which may truncate
# where the emulator rounds): the staged gradients' distance from the unstaged kernel's,
# also at N = 65 rows (d = 512, one head: z's sums the longest the staged kernel takes).
from headwise.testing import rel_err
for n, d, h in ((9, 4096, 8), (65, 512, 1)):
    src = torch.randn(n, 2, 4096, d, device='cuda', dtype=torch.bfloat16)
    q = 0.3 * torch.randn(d, device='cuda'); g = torch.ones(d, device='cuda')
    _, w = torch.ops.headwise.mhar_route(src, q, g, h, n, 1e-6, None, None)
    dout = torch.randn(2, 4096, d, device='cuda', dtype=torch.bfloat16)
    got = {}
    for flag in ('1', '0'):
        os.environ['HEADWISE_MHAR_BWD_STAGED'] = flag
        got[flag] = torch.ops.headwise.mhar_route_backward(dout, src, q, g, w, None, h, n, 1e-6)[:3]
    print(f'staged vs unstaged N={n} d={d} H={h}: rel err grad_sources, dq, dg =',
          ', '.join(f'{rel_err(x.float(), y.float()):.2e}' for x, y in zip(got['1'], got['0'])))"

stage "primitive self-tests and sample GEMM on the GPU (lane maps against the hardware)"
cd tests
run_capped 60 "primitive tests" $PY -m pytest -q -ra -k cuda --junitxml="$RES/primitive_tests.xml" \
  $PRIMITIVE_TESTS
run_capped 20 "sample gemm timing" $PY -c "
import torch, headwise
a = torch.randn(4096, 4096, device='cuda', dtype=torch.bfloat16); b = torch.randn_like(a)
for name, f in [('headwise.sample_gemm', lambda: torch.ops.headwise.sample_gemm(a, b)), ('torch.mm', lambda: a @ b.t())]:
    f(); torch.cuda.synchronize(); s, e = torch.cuda.Event(True), torch.cuda.Event(True); s.record()
    for _ in range(20): f()
    e.record(); torch.cuda.synchronize(); ms = s.elapsed_time(e) / 20
    print(f'{name:22s} 4096^3 bf16: {ms:.3f} ms, {2 * 4096**3 / ms / 1e9:.0f} TFLOP/s')"
cd ..

stage "the emulator's launch-limit test alone (it crashed its xdist worker on the first H200 run)"
cd tests
run_capped 30 "emulator launch limits" $PY -X faulthandler -m pytest -q -p no:xdist \
  dcmha/test_dcmha_attention_sim.py -k refuses
cd ..

stage "H200 estimates beside GPU times (calibrates the emulator's estimate)"
# The MHAR estimates of that file are the streaming forward's and the unstaged backward's
# (2026-12-05): time those.
run_capped 90 "calibrate" env HEADWISE_MHAR_FWD_STAGED=0 HEADWISE_MHAR_BWD_STAGED=0 $PY -m headwise.bench.calibrate merge mhar qkv dcmha_compose \
  --estimates bench/sim_profile_h200_2026-12-05_dcmha_tf32.json --json "$RES/calibration.json"

stage "ncu: the merge forward and grad_z, the MHAR forward and backward, the DCMHA forward sweeps and output kernel (one launch each)"
# MHAR measured at 16% of HBM and the DCMHA forward at 6x its estimate with no counters
# read: SpeedOfLight, the memory tables, occupancy and the warp-state (stall) sections
# say what bounds them. The L2 hit rate checks the DCMHA output kernel's heads-fastest grid
# (its heads of a query tile share the scratch partials: bench/RESULTS.md, 2026-12-06).
run_capped 60 "ncu" ncu --clock-control none \
  --kernel-name regex:"head_merge_(fwd|bwd_dz)_tc|mhar_route_(fwd|bwd)|dcmha_attn_sweep|dcmha_attn_output" \
  --launch-count 7 --metrics lts__t_sector_hit_rate.pct \
  --section SpeedOfLight --section MemoryWorkloadAnalysis_Tables --section Occupancy --section WarpStateStats \
  $PY -c "
import torch, headwise
from headwise.bench.targets import _dcmha_inputs
z = torch.randn(4, 32, 4096, 128, device='cuda', dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(4096, 4096, device='cuda', dtype=torch.bfloat16, requires_grad=True)
headwise.head_merge(z, w, None, head_gate=torch.ones(32, device='cuda')).sum().backward()
src = torch.randn(9, 2, 4096, 4096, device='cuda', dtype=torch.bfloat16, requires_grad=True)
query = 0.3 * torch.randn(4096, device='cuda'); norm_weight = torch.ones(4096, device='cuda')
headwise.mhar_route(src, query, norm_weight, num_heads=8).float().sum().backward()
q, k, v, dw, _ = _dcmha_inputs({'b': 1, 'h': 32, 't': 2048, 'dh': 128}, torch.device('cuda'), torch.bfloat16)
with torch.no_grad():
    headwise.dcmha_attention(q, k, v, dw)
torch.cuda.synchronize()" > "$RES/ncu.txt" 2>&1
grep -E "^  [a-z_]+.*\(|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Compute \(SM\)|Issue Slot|Stall|lts__t_sector_hit_rate" "$RES/ncu.txt" | head -80

stage "GPU benchmarks (eager, torch.compile, headwise)"
run_capped 90 "bench merge" $PY -m headwise.bench merge --device cuda --repeats 20 --json "$RES/bench_merge.json"
run_capped 60 "bench mhar" $PY -m headwise.bench mhar --device cuda --repeats 20 --json "$RES/bench_mhar.json"
run_capped 60 "bench qkv" $PY -m headwise.bench qkv --device cuda --repeats 20 --json "$RES/bench_qkv.json"
run_capped 60 "bench dcmha" $PY -m headwise.bench dcmha --device cuda --repeats 3 --json "$RES/bench_dcmha.json"

stage "done (status $status)"
exit $status
