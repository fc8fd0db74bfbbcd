#!/usr/bin/env bash
# The CUDA Triton kernels on a GPU, in one go: correctness against the float64 oracle, the
# shipped kernels against SDPA (flash) and FlashInfer with the kernels' targets per row, Nsight
# Compute counters, the launch sweep. Needs CUDA torch and Triton only (no vLLM); FlashInfer's
# row appears when `flashinfer` imports (its first call JIT-builds its kernel with nvcc).
# UNTESTED ON A GPU: written without one.
#   scripts/gpu_kernels.sh [STEP...]   STEP: tests bench ncu flashinfer sweep
#   (default: tests bench ncu sweep; `flashinfer`: the decode rows alone, FlashInfer's beside them)
# Results go to OUTDIR (default results/gpu-kernels): tests.log, bench.md, ncu.md, ncu.csv,
# flashinfer.md, sweep.md; send them back with `nvidia-smi -L`. Each step has a time limit in
# seconds (TESTS_S, BENCH_S, NCU_S, FI_S, SWEEP_S) so a hung step cannot hold the others; a step
# that fails or runs out is reported and the next runs. WORKERS: pytest-xdist workers for tests.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${GPU_PY:-python3}
OUTDIR=${OUTDIR:-results/gpu-kernels}
mkdir -p "$OUTDIR"
steps=("$@"); [ ${#steps[@]} -gt 0 ] || steps=(tests bench ncu sweep)
status=0
note() { echo "== gpu_kernels.sh: $*" >&2; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv >&2 || true
for step in "${steps[@]}"; do
  start=$SECONDS
  case $step in
    tests) timeout "${TESTS_S:-600}" "$PY" -m pytest -q -rs -m gpu -n "${WORKERS:-8}" \
             -p no:cacheprovider tests/gpu/test_gpu_kernels.py >"$OUTDIR/tests.log" 2>&1
           rc=$?; tail -n 5 "$OUTDIR/tests.log" >&2 ;;
    bench) timeout "${BENCH_S:-600}" "$PY" benchmarks/ops/bench_triton_gpu.py \
             --contexts ${CONTEXTS:-2048 8192 32768} --block-sizes 16 128 >"$OUTDIR/bench.md"
           rc=$?; cat "$OUTDIR/bench.md" ;;
    flashinfer) timeout "${FI_S:-600}" "$PY" benchmarks/ops/bench_triton_gpu.py --phases decode \
             --contexts 8192 32768 --block-sizes 16 128 >"$OUTDIR/flashinfer.md"
           rc=$?; cat "$OUTDIR/flashinfer.md" ;;
    ncu)   timeout "${NCU_S:-600}" scripts/gpu_ncu.sh "$OUTDIR"; rc=$? ;;
    sweep) timeout "${SWEEP_S:-1200}" "$PY" benchmarks/ops/bench_triton_gpu.py --sweep \
             --contexts 8192 32768 --block-sizes 16 128 --repeat 10 >"$OUTDIR/sweep.md"
           rc=$?; tail -n 40 "$OUTDIR/sweep.md" ;;
    *) note "unknown step $step (tests bench ncu flashinfer sweep)"; exit 2 ;;
  esac
  note "$step: exit $rc after $((SECONDS - start)) s"
  [ $rc -eq 0 ] || status=$rc
done
exit $status
