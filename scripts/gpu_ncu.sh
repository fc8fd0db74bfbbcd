#!/usr/bin/env bash
# Nsight Compute counters of the fused-RoPE Triton kernels beside SDPA (flash), the
# rotate-into-scratch step and FlashInfer's ROPE_LLAMA decode, on a CUDA GPU: DRAM throughput as
# a share of peak, local-memory loads, tensor-pipe activity.
# UNTESTED ON A GPU: written on a machine without one.
#   scripts/gpu_ncu.sh [OUTDIR]        (GPU_PY picks the Python; default python3)
# Writes OUTDIR/ncu.csv (the raw report) and OUTDIR/ncu.md (one row per kernel launch).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${GPU_PY:-python3}
OUTDIR=${1:-results/gpu-kernels}
mkdir -p "$OUTDIR"
NCU=${NCU:-$(command -v ncu || ls -d /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -n 1 || true)}
[ -x "$NCU" ] || { echo "gpu_ncu.sh: no ncu found (set NCU=/path/to/ncu)" >&2; exit 2; }

# Only the metrics this ncu knows (an unknown one fails the whole run); all of them if it cannot
# list its metrics (the run then says which one it lacks).
known=$("$NCU" --query-metrics 2>/dev/null | awk '{print $1}')
metrics=()
for m in gpu__time_duration.sum dram__throughput.avg.pct_of_peak_sustained_elapsed \
    l1tex__t_sectors_pipe_lsu_mem_local_op_ld.sum \
    sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \
    sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active \
    launch__registers_per_thread sm__warps_active.avg.pct_of_peak_sustained_active; do
  if [ -z "$known" ] || grep -qx "${m%%.*}" <<<"$known"; then metrics+=("$m")
  else echo "ncu lacks ${m%%.*}: left out" >&2; fi
done
rename=()
if "$NCU" --help | grep -q -- --print-nvtx-rename; then rename=(--nvtx --print-nvtx-rename kernel); fi

# Only the calls between cudaProfilerStart/Stop (the bench's --profile), each kernel once.
"$NCU" --profile-from-start off "${rename[@]}" --clock-control none --csv --page raw \
  --metrics "$(IFS=,; echo "${metrics[*]}")" --log-file "$OUTDIR/ncu.csv" \
  "$PY" benchmarks/ops/bench_triton_gpu.py --profile --phases decode prefill \
  --contexts ${NCU_CONTEXTS:-8192 32768} --block-sizes ${NCU_BLOCKS:-16 128} >&2
"$PY" benchmarks/ops/ncu_summary.py "$OUTDIR/ncu.csv" | tee "$OUTDIR/ncu.md"
