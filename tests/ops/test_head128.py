"""Head size 128, the head size of every model in ``tests/engine/test_real_geometry.py``, for
each op implementation against the float64 oracle, in fp32 at 1e-5.

Here: the GQA ratios of those models (4:1 as 8/2: Mistral-7B, Llama-3.1-8B, Qwen3-8B; 7:1 as
7/1: Qwen2.5-7B) at block 16 and 128, prefill (scattered queries) and decode, with their RoPE
bases (1e6; Llama's 500000), for the torch reference, the native CPU kernel, and both Triton
kernels under an interpreter: the CUDA kernel (``cuda_fallback.rope_paged_attention``) under
upstream Triton's, in a subprocess of the main run (as ``tests/ops/test_triton.py``), and the
Ascend kernel (``ascend_mepic.ops.triton_ascend``) under triton-ascend's only, when this file runs
in ``.venv-ascend`` with ``TRITON_INTERPRET=1`` (``scripts/test_ascend.sh
tests/ops/test_head128.py``; its block pointers are not in upstream Triton). The CUDA kernel is
not run there: its interpreter is upstream Triton's, and ``tests/ops/test_triton_ascend.py``
keeps a smaller check of it under triton-ascend's.

Head 128 elsewhere: the Triton kernel in fp32 (``test_triton.py::test_head_dims``) and fp16/bf16
(``test_triton_half.py``); the triton-ascend kernel's fp16/bf16 dots
(``test_ascend_kernel.py::test_half_precision_dots``); the torch_npu composition through its
double (``test_npu_composition.py``, HEAD = 128).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
from dataclasses import replace

import pytest
import torch

from ascend_mepic.ops import RopeSpec
from ascend_mepic.ops.reference import rope_paged_attention_reference
from ascend_mepic.ops.rope import default_cos_sin_cache
from tests.ops.interpreter_subprocess import run_interpreted
from tests.ops.oracle import Batch, dense_oracle, random_batch

HEAD = 128
TOL = 1e-5
HAVE_TRITON = importlib.util.find_spec("triton") is not None


def _is_triton_ascend() -> bool:
    try:
        importlib.metadata.distribution("triton-ascend")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


TRITON_ASCEND = HAVE_TRITON and _is_triton_ascend()
IN_PROCESS = False
if HAVE_TRITON and os.environ.get("TRITON_INTERPRET") == "1":
    import triton

    tri = importlib.import_module("cuda_fallback.rope_paged_attention")
    asc = importlib.import_module("ascend_mepic.ops.triton_ascend")
    # Triton imported before the variable was set (in this process) cannot interpret.
    IN_PROCESS = tri.INTERPRETED and type(triton.language.standard.max).__name__ == (
        "InterpretedFunction"
    )
interpreted = pytest.mark.skipif(
    not IN_PROCESS, reason="needs TRITON_INTERPRET=1 from process start; run in a subprocess"
)
# triton-ascend 3.2.0's interpreter indexes numpy arrays the way numpy 1.25+ deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")

# (block size, (Hq, Hkv), decode, RoPE base): every block x GQA x kernel, bases alternating.
CASES = [
    (16, (8, 2), False, 500000.0),
    (16, (8, 2), True, 1e6),
    (16, (7, 1), False, 1e6),
    (16, (7, 1), True, 500000.0),
    (128, (8, 2), False, 1e6),
    (128, (8, 2), True, 500000.0),
    (128, (7, 1), False, 500000.0),
    (128, (7, 1), True, 1e6),
]
IDS = [f"block{bs}-{hq}x{hkv}-{'decode' if d else 'prefill'}" for bs, (hq, hkv), d, _ in CASES]


def batch(block_size: int, heads: tuple[int, int], decode: bool, base: float, **kw) -> Batch:
    """A random MEPIC batch at head 128, rotated with ``base`` (neox, as all four models)."""
    seed = block_size + 10 * heads[0] + decode
    b = random_batch(seed, block_size, *heads, head=HEAD, decode=decode, **kw)
    rope = RopeSpec.from_cache(default_cos_sin_cache(HEAD, 4096, base), True)
    return replace(b, rope=rope, base=base)


def check(out: torch.Tensor, b: Batch) -> None:
    assert out.dtype == b.query.dtype and out.shape == b.query.shape
    want = dense_oracle(b.query, b.kv_cache, b.meta, b.base, True, b.scale)
    torch.testing.assert_close(out.double(), want, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("block_size, heads, decode, base", CASES, ids=IDS)
def test_reference(block_size, heads, decode, base):
    b = batch(block_size, heads, decode, base)
    check(rope_paged_attention_reference(b.query, b.kv_cache, b.meta, b.rope, b.scale), b)


@pytest.mark.skipif(TRITON_ASCEND, reason="the native CPU kernel is built and tested in .venv")
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("block_size, heads, decode, base", CASES, ids=IDS)
def test_cpu_kernel(block_size, heads, decode, base, splits):
    from ascend_mepic.ops import cpu_kernel

    assert cpu_kernel.load(), "the native CPU kernel did not build; see the logged error"
    b = batch(block_size, heads, decode, base)
    check(cpu_kernel.rope_paged_attention_cpu(b.query, b.kv_cache, b.meta, b.rope, b.scale,
                                              num_splits=splits), b)  # fmt: skip


# Small segments keep the interpreter fast (it runs every program in Python).
MAX_SEGMENT = 40


@interpreted
@pytest.mark.skipif(
    TRITON_ASCEND,
    reason="the CUDA kernel runs under upstream Triton's interpreter in .venv; triton-ascend's "
    "says nothing about CUDA or the NPU (the NPU's kernel is test_triton_ascend_kernel)",
)
@pytest.mark.parametrize("block_size, heads, decode, base", CASES, ids=IDS)
def test_triton(block_size, heads, decode, base):
    b = batch(block_size, heads, decode, base, num_seqs=2, max_segment=MAX_SEGMENT)
    check(tri.rope_paged_attention_triton(b.query, b.kv_cache, b.meta, b.rope, b.scale), b)


@interpreted
@pytest.mark.skipif(
    not TRITON_ASCEND,
    reason="the triton-ascend kernel runs under triton-ascend's interpreter in .venv-ascend "
    "(make test-ascend); its block pointers are not in upstream Triton",
)
@pytest.mark.parametrize("block_size, heads, decode, base", CASES, ids=IDS)
def test_triton_ascend_kernel(block_size, heads, decode, base):
    b = batch(block_size, heads, decode, base, num_seqs=2, max_segment=MAX_SEGMENT)
    kernel = "decode" if decode else "prefill"
    out = asc.rope_paged_attention_ascend(b.query, b.kv_cache, b.meta, b.rope, b.scale,
                                          kernel=kernel)  # fmt: skip
    check(out, b)


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_interpreter_suite_in_subprocess():
    """Run this file with ``TRITON_INTERPRET=1`` set before anything imports triton."""
    if IN_PROCESS:
        pytest.skip("already interpreted in this process")
    # The child skips this test and, under upstream Triton, the triton-ascend kernel's cases.
    run_interpreted(__file__, timeout=900, skipped=1 + (0 if TRITON_ASCEND else len(CASES)))
