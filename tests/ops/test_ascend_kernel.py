"""The triton-ascend kernel (``cuda_fallback.rope_paged_attention_ascend``) under an interpreter.

Runs in ``make test-ascend``'s environment, under triton-ascend's interpreter
(``TRITON_INTERPRET=1`` from process start); elsewhere it is skipped (``TRITON_INTERPRET`` must be
set before triton is imported, see ``tests/ops/test_triton.py``). Checked against the dense
oracle and the torch reference; nothing here says the kernel compiles or runs on an NPU.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_mepic.ops.reference import rope_paged_attention_reference
from tests.ops.oracle import Batch, dense_oracle, random_batch

if importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "needs triton with TRITON_INTERPRET=1 from process start (make test-ascend)",
        allow_module_level=True,
    )
asc = importlib.import_module("cuda_fallback.rope_paged_attention_ascend")
if not asc.INTERPRETED:
    pytest.skip("triton was imported before TRITON_INTERPRET was set", allow_module_level=True)

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0")
MAX_SEGMENT = 40


def run(b: Batch, **kwargs) -> torch.Tensor:
    return asc.rope_paged_attention_ascend(b.query, b.kv_cache, b.meta, b.rope, b.scale, **kwargs)


def check(out: torch.Tensor, b: Batch, tol: float) -> None:
    assert out.dtype == b.query.dtype and out.shape == b.query.shape
    want = dense_oracle(b.query, b.kv_cache, b.meta, b.base, b.rope.is_neox_style, b.scale)
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    ref = rope_paged_attention_reference(b.query, b.kv_cache, b.meta, b.rope, b.scale)
    torch.testing.assert_close(out.double(), ref.double(), atol=tol, rtol=tol)


@settings(max_examples=6, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    block_size=st.sampled_from([16, 32, 128]),
    heads=st.sampled_from([(2, 2), (4, 2), (3, 1), (8, 1)]),
    neox=st.booleans(),
)
def test_prefill_matches_oracle_fp32(seed, block_size, heads, neox):
    """Held-out random batches: padded and packed tables, scattered queries, GQA."""
    b = random_batch(seed, block_size, *heads, neox=neox, max_segment=MAX_SEGMENT)
    check(run(b, kernel="prefill"), b, 1e-5)


@settings(max_examples=6, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    block_size=st.sampled_from([16, 64, 128]),
    heads=st.sampled_from([(4, 4), (8, 2), (6, 3), (16, 1)]),
    neox=st.booleans(),
    splits=st.sampled_from([1, 2, 4]),
)
def test_split_kv_decode_matches_oracle_fp32(seed, block_size, heads, neox, splits):
    b = random_batch(seed, block_size, *heads, neox=neox, decode=True, max_segment=MAX_SEGMENT)
    check(run(b, num_splits=splits), b, 1e-5)


@pytest.mark.parametrize("cores", [1, 2, 7])
def test_persistent_grid_covers_all_work(cores):
    """Fewer programs than work items: each program loops; the result does not change."""
    b = random_batch(11, 128, 4, 2, num_seqs=4, max_segment=MAX_SEGMENT)
    check(run(b, kernel="prefill", cores=cores, block_q=2), b, 1e-5)


@pytest.mark.parametrize("block_n", [16, 32, 128])
def test_sub_tiles_of_a_block(block_n):
    b = random_batch(5, 128, 4, 1, neox=False, num_seqs=2, max_segment=MAX_SEGMENT)
    check(run(b, kernel="prefill", block_n=block_n), b, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    b = random_batch(7, 128, 4, 2, num_seqs=2, dtype=dtype, max_segment=24)
    check(run(b), b, 2e-2)


def test_unsupported_block_size_raises_before_launch():
    b = random_batch(3, 24, 2, 2, max_segment=20)
    with pytest.raises(ValueError, match="block size 24"):
        run(b)


def test_decode_split_choice_fills_the_cores():
    assert asc.decode_splits(20, 1, 2, 64) == 16  # 2 work items, 20 cores: 10 -> 16
    assert asc.decode_splits(20, 64, 8, 64) == 1
    assert asc.decode_splits(20, 1, 1, 3) == 1  # too few entries to split
