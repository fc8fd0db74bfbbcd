"""The CUDA Triton kernels' fp16/bf16 ``tl.dot`` path under Triton's CPU interpreter.

``rope_paged_attention_triton`` runs fp32 dots under the interpreter by default, so
``tests/ops/test_triton.py`` never executes the half-precision dots a GPU runs (rotated Q/K and
the softmax weights rounded to the input dtype, fp32 accumulation). Here ``half_dots=True`` runs
that path and its results are checked against the float64 oracle. bf16 goes through
``tests/ops/interpreter_dots.py``'s patch (the interpreter multiplies bf16 bit patterns as
integers); fp16 needs none. As in ``test_triton.py``, the kernels must be imported in a process
that had ``TRITON_INTERPRET=1`` from its start: without it these tests skip and
``test_half_suite_in_subprocess`` reruns this file in a fresh, interpreted process.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import os

import pytest
import torch

from tests.ops.interpreter_dots import bf16_dots as bf16_dots  # the fixture
from tests.ops.interpreter_subprocess import run_interpreted
from tests.ops.oracle import Batch, dense_oracle, random_batch

HAVE_TRITON = importlib.util.find_spec("triton") is not None
IN_PROCESS = HAVE_TRITON and os.environ.get("TRITON_INTERPRET") == "1"
if IN_PROCESS:
    import triton

    tri = importlib.import_module("cuda_fallback.rope_paged_attention")
    IN_PROCESS = tri.INTERPRETED and type(triton.language.standard.max).__name__ == (
        "InterpretedFunction"
    )
interpreted = pytest.mark.skipif(
    not IN_PROCESS, reason="needs TRITON_INTERPRET=1 from process start; run in a subprocess"
)

# (head, block size, (Hq, Hkv), kernel). The full product head {64, 128} x block {16, 128} x
# GQA {1, 2, 4, 8} x {prefill, decode} x {fp16, bf16} is 64 interpreted cases (minutes); these 8
# rows cover every pair of values of head, block, GQA and kernel (each GQA group meets each value
# of the other three; ``test_cases_cover_every_pair`` checks it), and each row runs in both dtypes,
# so every pair of the five factors runs. The KV tile is 32 keys, so each sequence spans several
# tiles and the online softmax rescales half-precision partial results.
CASES = [
    (64, 16, (2, 2), "prefill"),
    (128, 128, (2, 2), "decode"),
    (64, 128, (4, 2), "decode"),
    (128, 16, (4, 2), "prefill"),
    (128, 16, (4, 1), "decode"),
    (64, 128, (4, 1), "prefill"),
    (128, 128, (8, 1), "prefill"),
    (64, 16, (8, 1), "decode"),
]
DTYPES = (torch.float16, torch.bfloat16)
BLOCK_N = 32


def tolerance(dtype: torch.dtype) -> float:
    """atol = rtol = 8 eps of the dtype (fp16 7.8e-3, bf16 6.3e-2).

    The oracle gets the same fp16/bf16 Q, K and V, exactly widened to float64; the kernel adds
    roundings to the dtype (relative error eps/2 each) of the rotated, scaled Q and K tiles, of
    the softmax weights before the PV dot, and of the output. Scores are O(1) here (unit normal
    data, scale D^-1/2), so each weight is off by about eps and the output, a weighted mean of
    unit-scale V rows, by a few eps (measured over ``CASES``: at most 1.1 eps in fp16, 2.9 eps
    in bf16); 8 eps leaves a margin for other seeds (the triton-ascend kernel's half-dot tests
    use the same bound).
    """
    return 8 * torch.finfo(dtype).eps


def batch(head: int, block_size: int, heads: tuple[int, int], kernel: str, dtype) -> Batch:
    """Two sequences of short segments (the interpreter's cost grows with keys and queries)."""
    seed, decode = head + block_size + heads[0], kernel == "decode"
    return random_batch(
        seed,
        block_size,
        *heads,
        head=head,
        num_seqs=2,
        neox=not decode,
        dtype=dtype,
        decode=decode,
        max_segment=24,
    )


def run(b: Batch, kernel: str, **kwargs) -> torch.Tensor:
    return tri.rope_paged_attention_triton(
        b.query, b.kv_cache, b.meta, b.rope, b.scale, kernel=kernel, block_n=BLOCK_N, **kwargs
    )


def test_cases_cover_every_pair():
    """Every pair of values of two of head, block, GQA and kernel is in ``CASES``."""
    rows = [(head, bs, hq // hkv, kernel) for head, bs, (hq, hkv), kernel in CASES]
    values = [{64, 128}, {16, 128}, {1, 2, 4, 8}, {"prefill", "decode"}]
    for i, j in itertools.combinations(range(4), 2):
        seen = {(row[i], row[j]) for row in rows}
        assert seen == set(itertools.product(values[i], values[j])), (i, j)


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head, block_size, heads, kernel", CASES)
def test_half_dots_match_oracle(bf16_dots, dtype, head, block_size, heads, kernel):
    """The fp16/bf16 dot path (no forced fp32) against the float64 oracle."""
    b = batch(head, block_size, heads, kernel, dtype)
    splits = {"num_splits": 2} if kernel == "decode" and block_size == 16 else {}
    out = run(b, kernel, half_dots=True, **splits)
    assert out.dtype == dtype and out.shape == b.query.shape
    want = dense_oracle(b.query, b.kv_cache, b.meta, b.base, b.rope.is_neox_style, b.scale)
    tol = tolerance(dtype)
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    # The half path really ran: it rounds differently from the fp32 dots.
    assert not torch.equal(out, run(b, kernel, half_dots=False, **splits))


@interpreted
def test_default_keeps_fp32_dots_under_the_interpreter():
    """Without ``half_dots`` the interpreter still runs fp32 dots (``test_triton.py``'s path)."""
    b = batch(64, 16, (2, 2), "prefill", torch.float16)
    torch.testing.assert_close(
        run(b, "prefill"), run(b, "prefill", half_dots=False), atol=0, rtol=0
    )


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
@pytest.mark.skipif(IN_PROCESS, reason="the tests above ran in this process")
def test_half_suite_in_subprocess():
    """Run this file with ``TRITON_INTERPRET=1`` set before anything imports triton."""
    run_interpreted(__file__, timeout=600)
