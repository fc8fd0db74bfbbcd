"""The CPU kernel's AMX paths on CPUs without AMX, through the AMX emulation build.

The AMX paths (bfloat16 prefill on packed tiles, decode of GQA groups wider than the vector
tile) run only where the CPU has AMX, so on every other machine ``test_cpu_kernel.py`` skips
their cases. The emulation build (``-DMEPIC_AMX_EMULATE``: the tile instructions done in scalar
code, everything around them native; see the kernel source) runs them on any CPU with
AVX512-BF16. Here it is built into a temporary folder, loaded in a fresh process in place of
the prebuilt library, and the whole of ``test_cpu_kernel.py`` runs against it with the AMX paths
on: every AMX case runs (none skipped) and passes. It checks the paths' results, not their speed;
on an AMX machine ``test_cpu_kernel.py`` runs the same cases on the hardware as well.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ascend_mepic.ops import cpu_kernel
from tests.ops.amx_emulation import DEFINE, can_emulate

ROOT = Path(__file__).resolve().parents[2]

RUN = r"""
import sys
from pathlib import Path
from ascend_mepic.ops import cpu_kernel
assert cpu_kernel.load(Path(sys.argv[1])), "the emulation build did not load"
assert cpu_kernel.set_amx(True), cpu_kernel.isa()
assert "AMX emulated" in cpu_kernel.isa(), cpu_kernel.isa()
import pytest
sys.exit(pytest.main(["-q", "-rs", "-p", "no:cacheprovider", "tests/ops/test_cpu_kernel.py"]))
"""


def emulation_build(directory: Path) -> Path:
    """Compile the avx512 variant with the AMX emulation into ``directory``."""
    output = directory / "ascend_mepic_cpu_avx512_amx_emulated.so"
    command = cpu_kernel._compile_command("avx512", output, defines=(DEFINE,))
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return output


def test_amx_paths_match_the_oracle_under_emulation(tmp_path):
    ok, why = can_emulate()
    if not ok:
        pytest.skip(why)
    library = emulation_build(tmp_path)
    env = dict(os.environ)
    env.pop(cpu_kernel.ISA_ENV, None)
    done = subprocess.run(
        [sys.executable, "-c", RUN, str(library)], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    report = done.stdout[-6000:]
    assert done.returncode == 0, report + done.stderr[-3000:]
    assert "no AMX path" not in report, report  # every AMX case ran
    assert " passed" in report and " failed" not in report, report
