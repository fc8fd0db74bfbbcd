"""Test-side fix for Triton's CPU interpreter: bf16 ``tl.dot`` on real values, not raw bits.

Both interpreters here (upstream Triton's and triton-ascend 3.2.0's) keep bf16 tensors as numpy
``uint16`` bit patterns and feed them to ``np.matmul`` unchanged, so a bf16 dot multiplies the
integers. ``upcast_bf16_dots`` patches the interpreter builder's ``create_dot`` (for one test,
through pytest's ``monkeypatch``) to widen bf16 operands to fp32 first; bf16 -> fp32 is exact, and
the product then accumulates in fp32 as the hardware's cube/tensor cores do. Kernels' own code is
untouched: this only makes the interpreter able to check their half-precision dot paths. fp16
dots need no patch (numpy computes them in the fp32 accumulator dtype).
"""

from __future__ import annotations

import numpy as np
import pytest


def _widened(handle):
    """An interpreter tensor handle with bf16 data as fp32 (the bits shifted into the top half)."""
    import triton.language as tl
    from triton.runtime import interpreter

    if handle.dtype != tl.bfloat16:
        return handle
    bits = handle.data.astype(np.uint32) << np.uint32(16)
    return interpreter.TensorHandle(bits.view(np.float32), tl.float32)


def upcast_bf16_dots(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the interpreter compute bf16 ``tl.dot`` from the values (undone with monkeypatch)."""
    from triton.runtime import interpreter

    real = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, *args, **kwargs):
        return real(self, _widened(a), _widened(b), d, *args, **kwargs)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


@pytest.fixture
def bf16_dots(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fixture form of ``upcast_bf16_dots``: import it into a test module to use it."""
    upcast_bf16_dots(monkeypatch)
