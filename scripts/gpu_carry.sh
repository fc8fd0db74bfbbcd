#!/usr/bin/env bash
# Carry vLLM 0.30.0's CUDA wheel and its missing packages to a GPU machine without a package
# index, in parts of at most 56 MiB (docs/cuda.md, "Carrying vLLM to a GPU machine without a
# package index"). Here: lock, prepare, plan, rehearse. There: receive, install, check.
# The logic is scripts/gpu_carry.py; this picks its Python: $PYTHON, else this checkout's .venv
# (here), else python3 (the GPU machine's, which holds torch).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="${PYTHON:-}"
if [ -z "$py" ]; then
    case "${1:-}" in
        receive|install|check) py=python3 ;;
        *) if [ -x "$here/../.venv/bin/python" ]; then py="$here/../.venv/bin/python"; else py=python3; fi ;;
    esac
fi
exec "$py" "$here/gpu_carry.py" "$@"
