"""Rerun a Triton test file in a child process with ``TRITON_INTERPRET=1`` from its start.

The interpreter is chosen when ``triton.jit`` decorates a kernel, so a file whose kernels were
imported in a non-interpreted process (``make test``'s main run) reruns itself here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(test_file: str, timeout: int, skipped: int = 1) -> None:
    """Run ``test_file`` interpreted; fail unless it passed with exactly ``skipped`` skips (by
    default one: the test that called this, which skips itself in the child), so the others
    really ran."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
        cwd=ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    summary = proc.stdout.strip().splitlines()[-1:] if proc.stdout else []
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert summary and "passed" in summary[0] and f" {skipped} skipped" in summary[0], summary
