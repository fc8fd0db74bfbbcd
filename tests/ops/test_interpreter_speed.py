"""``tests/ops/interpreter_speed.py`` leaves every result bit-identical.

Under each interpreter the tests run (triton-ascend 3.2.0 in ``.venv-ascend``, where
``make test-ascend`` sets ``TRITON_INTERPRET=1``; Triton 3.9.0 in ``.venv``, rerun here in a child
process with the variable set): the kernels' prefill and split-KV decode (triton-ascend's kernel
there, ``cuda_fallback``'s here) and a reduction kernel over rows with -inf, NaN and ties, each
run with the interpreter as shipped and with the speed-ups; the outputs must be equal bit for bit.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import pytest
import torch

from tests.ops import interpreter_speed
from tests.ops.interpreter_subprocess import run_interpreted

ASCEND = interpreter_speed.triton_ascend_version() == "3.2.0"
UPSTREAM = interpreter_speed.upstream_triton_version() == "3.9.0"
IN_PROCESS = (ASCEND or UPSTREAM) and os.environ.get("TRITON_INTERPRET") == "1"
if IN_PROCESS:
    import triton
    import triton.language as tl

    if ASCEND:
        kernels = importlib.import_module("ascend_mepic.ops.triton_ascend")
        attention = kernels.rope_paged_attention_ascend
    else:
        kernels = importlib.import_module("cuda_fallback.rope_paged_attention")
        attention = kernels.rope_paged_attention_triton
    # Triton imported before the variable was set (in this process) cannot interpret.
    IN_PROCESS = kernels.INTERPRETED and type(tl.standard.max).__name__ == "InterpretedFunction"

    @triton.jit
    def _row_extremes(x_ptr, max_ptr, min_ptr, N: tl.constexpr):
        row = tl.program_id(0)
        x = tl.load(x_ptr + row * N + tl.arange(0, N))
        tl.store(max_ptr + row, tl.max(x, 0))
        tl.store(min_ptr + row, tl.min(x, 0))


pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")


def _outputs() -> list[torch.Tensor]:
    from tests.ops.oracle import random_batch

    outs = []
    for seed, decode in ((3, False), (4, True)):
        b = random_batch(seed, 16, 4, 2, num_seqs=2, decode=decode, max_segment=20)
        kwargs = {"num_splits": 2} if decode else {"kernel": "prefill"}
        outs.append(attention(b.query, b.kv_cache, b.meta, b.rope, b.scale, **kwargs))
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(0))
    x[0] = float("-inf")
    x[1, 3] = float("nan")
    x[2, :] = 1.5  # all ties
    x[3, 7] = float("inf")
    hi, lo = torch.empty(5), torch.empty(5)
    _row_extremes[(5,)](x, hi, lo, N=16)
    return [*outs, hi, lo]


@pytest.mark.skipif(not IN_PROCESS, reason="needs triton-ascend 3.2.0 or Triton 3.9.0, "
                    "interpreted from process start")  # fmt: skip
def test_speedups_change_no_result():
    assert interpreter_speed.install()
    fast = _outputs()
    interpreter_speed.uninstall()
    try:
        shipped = _outputs()
    finally:
        assert interpreter_speed.install()
    for a, b in zip(fast, shipped, strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))  # bit for bit, NaN too
    hi, lo = fast[-2:]
    assert hi[0] == lo[0] == float("-inf") and hi[2] == lo[2] == 1.5  # NaN: as shipped
    assert hi[3] == float("inf")


@pytest.mark.skipif(not UPSTREAM or IN_PROCESS, reason="Triton 3.9.0 only; ran in this process")
def test_upstream_interpreter_in_subprocess():
    """Run this file with ``TRITON_INTERPRET=1`` set before anything imports triton."""
    run_interpreted(__file__, timeout=300)
