"""The CPU kernel's scratch writes, checked by a guard build.

A write past a scratch buffer usually lands in the allocation's slack or a neighbour and passes
every oracle test: the AMX prefill of an 18-row item once wrote past rows sized for 4-row tiles,
and only the engine's worker crashed (d23da8b). The guard build (``-DMEPIC_CPU_GUARD``) sizes
every buffer exactly, puts a pattern after it and fails the call that overwrites it; here it
runs every path (float32 and bfloat16, AMX on and off, decode with and without splits,
prefill, narrow calls before wide ones) against the float64 oracle, in a fresh process. On a
CPU without AMX the guard build also emulates it (``-DMEPIC_AMX_EMULATE``) where it can.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ascend_mepic.ops import cpu_kernel
from tests.ops.amx_emulation import DEFINE, can_emulate, has_amx

ROOT = Path(__file__).resolve().parents[2]

SWEEP = r"""
import json, sys, torch
from pathlib import Path
from ascend_mepic.ops import cpu_kernel
from tests.ops.oracle import dense_oracle, random_batch
assert cpu_kernel.load(Path(sys.argv[1])), "the guard build did not load"
assert "guard build" in cpu_kernel.isa(), cpu_kernel.isa()
assert torch.ops.ascend_mepic.guard_selftest(), "the guard missed a deliberate overflow"
torch.set_num_threads(2)
calls = 0
DTYPES = ((torch.float32, torch.float32, 1e-4), (torch.float32, torch.bfloat16, 2e-2),
          (torch.bfloat16, torch.bfloat16, 2e-2))
amx_runs = cpu_kernel.set_amx(True)
for amx in (True, False):
    cpu_kernel.set_amx(amx)
    for seed in range(3):
        for qdt, cdt, tol in DTYPES:
            # Narrow calls first (decode, small groups), then wider ones: the scratch grows.
            # Short prompts (max_segment 12): the widest item of a call has rows that are not
            # whole AMX tiles, the case whose overflow only the engine had caught.
            for decode, (hq, hkv), head, block, seqs, longest in (
                (True, (4, 2), 32, 16, 3, 90), (True, (9, 3), 64, 128, 3, 90),
                (False, (4, 2), 32, 16, 4, 90), (False, (4, 2), 32, 16, 4, 12),
                (True, (32, 8), 128, 16, 3, 90), (False, (9, 3), 64, 24, 3, 12),
                (True, (16, 1), 64, 24, 2, 90), (False, (32, 8), 128, 16, 2, 90),
                (False, (16, 1), 64, 128, 2, 90), (False, (8, 2), 64, 16, 3, 12),
            ):
                b = random_batch(seed * 97 + head + hq, block, hq, hkv, head=head, dtype=qdt,
                                 decode=decode, num_seqs=seqs, neox=seed != 1,
                                 max_segment=longest)
                cache = b.kv_cache.to(cdt)
                want = dense_oracle(b.query, cache.to(qdt), b.meta, b.base,
                                    b.rope.is_neox_style, b.scale)
                for splits in ((None, 1, 3) if decode else (None,)):
                    out = cpu_kernel.rope_paged_attention_cpu(
                        b.query, cache, b.meta, b.rope, b.scale, num_splits=splits)
                    calls += 1
                    err = (out.double() - want).abs().max().item()
                    assert err <= tol * (1 + want.abs().max().item()), (qdt, cdt, decode, hq, err)
print(json.dumps({"calls": calls, "amx": amx_runs}))
"""


@pytest.fixture(scope="module")
def guard_library(tmp_path_factory) -> tuple[Path, bool]:
    """The guard build and whether it emulates AMX: without AMX it does where it can, so the
    AMX paths' buffers are checked on every machine that can run those paths at all."""
    variant, why = cpu_kernel.choose_variant()
    if variant is None:
        pytest.skip(f"no kernel variant runs on this CPU ({why})")
    emulated = variant == "avx512" and not has_amx() and can_emulate()[0]
    output = tmp_path_factory.mktemp("guard") / f"ascend_mepic_cpu_{variant}_guard.so"
    defines = ("MEPIC_CPU_GUARD", *((DEFINE,) if emulated else ()))
    command = cpu_kernel._compile_command(variant, output, defines=defines)
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return output, emulated


def test_every_path_stays_inside_its_buffers(guard_library):
    library, emulated = guard_library
    env = dict(os.environ)
    env.pop(cpu_kernel.ISA_ENV, None)
    done = subprocess.run(
        [sys.executable, "-c", SWEEP, str(library)], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["calls"] == 2 * 3 * 3 * (4 * 3 + 6), result
    if emulated:
        assert result["amx"], "the emulation build did not take the AMX paths"
