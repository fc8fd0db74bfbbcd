"""The Triton kernels (``cuda_fallback``) under Triton's CPU interpreter, against the dense oracle.

``TRITON_INTERPRET`` must be set before triton is first imported: it is read when ``triton.jit``
decorates a function, triton's own library functions (``tl.max``, ``tl.sum``...) included, and
triton refuses to mix interpreted and compiled functions. Setting it inside a shared pytest process
would turn every later triton kernel of the session (vLLM's) into an interpreted one, so this
module runs its tests in process only when the variable was set from the start
(``TRITON_INTERPRET=1 pytest tests/ops/test_triton.py``); otherwise they are skipped here and
``test_interpreter_suite_in_subprocess`` runs this file in a fresh process with the variable set.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_mepic.ops import RopeSpec, rope_paged_attention
from ascend_mepic.ops.metadata import PagedRopeMetadata
from ascend_mepic.ops.reference import rope_paged_attention_reference
from tests.ops.interpreter_subprocess import run_interpreted
from tests.ops.oracle import Batch, dense_oracle, nan_outside_real_slots, random_batch

HAVE_TRITON = importlib.util.find_spec("triton") is not None
IN_PROCESS = HAVE_TRITON and os.environ.get("TRITON_INTERPRET") == "1"
if IN_PROCESS:
    import triton

    tri = importlib.import_module("cuda_fallback.rope_paged_attention")
    # Triton imported before the variable was set (in this process) cannot interpret.
    IN_PROCESS = tri.INTERPRETED and type(triton.language.standard.max).__name__ == (
        "InterpretedFunction"
    )
interpreted = pytest.mark.skipif(
    not IN_PROCESS, reason="needs TRITON_INTERPRET=1 from process start; run in a subprocess"
)


# The interpreter runs every program in Python and both kernels pack a KV head's GQA group into
# the rows of a tile, so cost grows with Hkv: both draw groups of 1 to 16 (3 and 6: not powers
# of two; a prefill tile holds block_m // group queries).
prefill_heads = st.sampled_from([(2, 2), (4, 2), (3, 1), (4, 1), (8, 1), (12, 2)])
decode_heads = st.sampled_from([(4, 4), (8, 2), (6, 3), (8, 1), (16, 1)])
# KV tiles may be smaller than a block, a block, or gather several blocks (24: not a power of 2).
block_sizes = st.sampled_from([16, 32, 128, 24])
block_ns = st.sampled_from([None, 16, 32, 64])
# Small segments keep the interpreter fast (at most a few hundred keys per sequence).
MAX_SEGMENT = 40


def run(b: Batch, **kwargs) -> torch.Tensor:
    return tri.rope_paged_attention_triton(b.query, b.kv_cache, b.meta, b.rope, b.scale, **kwargs)


def oracle(b: Batch) -> torch.Tensor:
    return dense_oracle(b.query, b.kv_cache, b.meta, b.base, b.rope.is_neox_style, b.scale)


def reference(b: Batch) -> torch.Tensor:
    return rope_paged_attention_reference(b.query, b.kv_cache, b.meta, b.rope, b.scale)


def check(out: torch.Tensor, b: Batch, tol: float) -> None:
    assert out.dtype == b.query.dtype and out.shape == b.query.shape
    torch.testing.assert_close(out.double(), oracle(b), atol=tol, rtol=tol)
    torch.testing.assert_close(out.double(), reference(b).double(), atol=tol, rtol=tol)


@interpreted
@settings(max_examples=16, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    block_size=block_sizes,
    heads=prefill_heads,
    neox=st.booleans(),
    block_m=st.sampled_from([16, 64]),
    block_n=block_ns,
)
def test_prefill_matches_oracle_fp32(seed, block_size, heads, neox, block_m, block_n):
    """Scattered queries, several sequences, several query tiles and KV tile sizes."""
    b = random_batch(seed, block_size, *heads, neox=neox, max_segment=MAX_SEGMENT)
    check(run(b, kernel="prefill", block_m=block_m, block_n=block_n), b, 1e-5)


@interpreted
@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    block_size=block_sizes,
    heads=decode_heads,
    neox=st.booleans(),
    num_splits=st.sampled_from([1, 2, 4]),
    block_n=block_ns,
)
def test_decode_matches_oracle_fp32(seed, block_size, heads, neox, num_splits, block_n):
    """One query per sequence: the decode kernel (GQA group as rows), with and without splits."""
    b = random_batch(seed, block_size, *heads, neox=neox, decode=True, max_segment=MAX_SEGMENT)
    assert b.meta.max_query_len == 1
    check(run(b, num_splits=num_splits, block_n=block_n), b, 1e-5)


@interpreted
@pytest.mark.parametrize("seed", range(2))
def test_prefill_kernel_on_decode_batch(seed):
    b = random_batch(seed, 16, 4, 2, decode=True, max_segment=MAX_SEGMENT)
    check(run(b, kernel="prefill"), b, 1e-5)


@interpreted
@pytest.mark.parametrize("decode", [False, True])
def test_serving_backend_cache_layout(decode):
    """The CUDA worker's cache: per block and KV head, K rows then V rows (the layout of
    ``ops.layout.block_view``, pinned in tests/ops/test_kv_layout.py; built here by hand so
    this interpreter process does not import vLLM)."""
    b = random_batch(8, 32, 6, 3, decode=decode, max_segment=MAX_SEGMENT)
    _, nb, bs, hkv, d = b.kv_cache.shape
    physical = torch.empty(nb, hkv, 2, bs, d)
    view = physical.permute(2, 0, 3, 1, 4)  # [2, nb, B, Hkv, D]
    view.copy_(b.kv_cache)
    out = tri.rope_paged_attention_triton(b.query, view, b.meta, b.rope, b.scale)
    check(out, b, 1e-5)


@interpreted
@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype, decode):
    b = random_batch(7, 32, 4, 2, dtype=dtype, decode=decode, max_segment=MAX_SEGMENT)
    check(run(b), b, 2e-2)


@interpreted
@pytest.mark.parametrize("head", [16, 48, 64, 128])
@pytest.mark.parametrize("decode", [False, True])
def test_head_dims(head, decode):
    """Power-of-two and padded (48: halves of 24 padded to 32; 16: halves padded to 16) dims."""
    b = random_batch(head, 16, 4, 2, head=head, num_seqs=2, decode=decode, max_segment=30)
    check(run(b), b, 1e-5)


def drop_queries(b: Batch, seq: int) -> Batch:
    """The batch with sequence ``seq`` keeping its KV but asking no query."""
    m = b.meta
    loc = m.query_start_loc.long()
    keep = torch.ones(m.num_queries, dtype=torch.bool)
    keep[loc[seq] : loc[seq + 1]] = False
    counts = loc[1:] - loc[:-1]
    counts[seq] = 0
    new_loc = torch.zeros_like(m.query_start_loc)
    new_loc[1:] = torch.cumsum(counts, 0).to(new_loc.dtype)
    meta = replace(
        m,
        query_start_loc=new_loc,
        query_positions=m.query_positions[keep],
        query_indices=m.query_indices[keep],
        max_query_len=int(counts.max()),
    )
    return replace(b, query=b.query[keep].contiguous(), meta=meta)


@interpreted
@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("seq", [0, 2])
def test_sequences_without_queries_are_skipped(decode, seq):
    b = drop_queries(random_batch(11, 16, 4, 2, decode=decode, max_segment=MAX_SEGMENT), seq)
    check(run(b), b, 1e-5)
    check(run(b, num_splits=2) if decode else run(b, block_m=16), b, 1e-5)


@interpreted
def test_prefill_group_larger_than_block_m():
    """A 32-head GQA group in a 16-row tile: the tile grows to one query's 32 rows."""
    b = random_batch(6, 16, 32, 1, max_segment=MAX_SEGMENT)
    check(run(b, kernel="prefill", block_m=16), b, 1e-5)


@interpreted
def test_precomputed_prefill_tiles():
    b = random_batch(4, 16, 4, 2, max_segment=MAX_SEGMENT)
    tiles = tri.prefill_tiles(b.meta.query_start_loc, tri.prefill_queries_per_tile(16, 2))
    check(run(b, block_m=16, tiles=tiles), b, 1e-5)


@interpreted
def test_prefill_tiles_are_built_once_per_step(monkeypatch):
    """Building the tiles syncs with the device: once per metadata, not once per layer."""
    b = random_batch(5, 16, 4, 2, max_segment=MAX_SEGMENT)
    built = []
    real = tri.prefill_tiles
    monkeypatch.setattr(tri, "prefill_tiles", lambda *a: built.append(a) or real(*a))
    first = run(b, block_m=16)
    torch.testing.assert_close(run(b, block_m=16), first)
    assert len(built) == 1


@interpreted
@pytest.mark.parametrize("decode", [False, True])
def test_pad_slots_are_never_read(decode):
    """Pad slots of allocated blocks may hold garbage (even NaN) without touching the result."""
    b = nan_outside_real_slots(random_batch(5, 32, 4, 2, decode=decode, max_segment=MAX_SEGMENT))
    out = run(b, num_splits=2) if decode else run(b)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, reference(b), atol=1e-5, rtol=1e-5)


@interpreted
@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("neox", [False, True])
def test_apply_rope_false_is_attention_without_rotation(decode, neox):
    """The benchmark's no-RoPE variant equals the reference with an identity rotation."""
    b = random_batch(3, 16, 4, 2, neox=neox, decode=decode, max_segment=MAX_SEGMENT)
    cache = b.rope.cos_sin_cache
    half = cache.shape[1] // 2
    identity = torch.cat((torch.ones(cache.shape[0], half), torch.zeros(cache.shape[0], half)), 1)
    plain = replace(b, rope=RopeSpec.from_cache(identity, neox))
    out = run(b, apply_rope=False)
    torch.testing.assert_close(out, reference(plain), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, run(plain), atol=1e-6, rtol=1e-6)


@interpreted
def test_dispatch_env_reaches_the_kernel(monkeypatch):
    b = random_batch(2, 16, 4, 2, max_segment=MAX_SEGMENT)
    calls = []
    kernel = tri.rope_paged_attention_triton

    def spy(*args, **kwargs):
        calls.append(args)
        return kernel(*args, **kwargs)

    mod = importlib.import_module("cuda_fallback.rope_paged_attention")
    assert mod is tri
    monkeypatch.setattr(mod, "rope_paged_attention_triton", spy)
    monkeypatch.setenv("ASCEND_MEPIC_ATTN_IMPL", "triton")
    out = rope_paged_attention(b.query, b.kv_cache, b.meta, b.rope, b.scale)
    assert len(calls) == 1
    check(out, b, 1e-5)


@interpreted
def test_empty_query_batch():
    b = random_batch(0, 16, 4, 2, num_seqs=1, decode=True)
    empty = drop_queries(b, 0)
    assert run(empty).shape == (0, 4, 32)


@interpreted
def test_rejects_bad_inputs():
    b = random_batch(0, 16, 4, 2, num_seqs=1, max_segment=20)
    with pytest.raises(TypeError, match="dtype"):
        tri.rope_paged_attention_triton(b.query.double(), b.kv_cache, b.meta, b.rope, b.scale)
    with pytest.raises(ValueError, match="block size"):
        meta: PagedRopeMetadata = replace(b.meta, block_size=32)
        tri.rope_paged_attention_triton(b.query, b.kv_cache, meta, b.rope, b.scale)
    with pytest.raises(ValueError, match="head dims"):
        tri.rope_paged_attention_triton(b.query[..., :16], b.kv_cache, b.meta, b.rope, b.scale)
    with pytest.raises(ValueError, match="multiple"):
        tri.rope_paged_attention_triton(b.query[:, :3], b.kv_cache, b.meta, b.rope, b.scale)
    with pytest.raises(ValueError, match="block_n"):
        run(b, block_n=24)
    with pytest.raises(ValueError, match="kernel"):
        run(b, kernel="dense")
    if b.meta.max_query_len > 1:
        with pytest.raises(ValueError, match="decode kernel"):
            run(b, kernel="decode")


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("block_size, block_n", [(16, 64), (128, 32), (24, 16), (32, 32)])
def test_kv_tile_list_holds_exactly_the_tiles_with_a_real_key(block_size, block_n):
    """Plain torch (no interpreter): the list against a per-key count, on padded and packed
    layouts; at block size 128 some tiles of 32 keys hold none and are left out."""
    from cuda_fallback.rope_paged_attention import kv_tile_list

    skipped = 0
    for seed in range(8):
        m = random_batch(seed, block_size, 2, 1, num_seqs=4).meta
        tiles, rank = kv_tile_list(
            m.num_blocks, m.block_valid_start, m.block_valid_end, block_size, block_n
        )
        for s in range(m.num_seqs):
            keys = [0] * tiles.shape[1]
            for j in range(int(m.num_blocks[s])):
                for slot in range(int(m.block_valid_start[s, j]), int(m.block_valid_end[s, j])):
                    keys[(j * block_size + slot) // block_n] += 1
            want = [t for t, n in enumerate(keys) if n]
            assert tiles[s, : len(want)].tolist() == want
            assert rank[s].tolist() == [sum(1 for t in want if t < u) for u in range(len(keys) + 1)]
            skipped += min(len(keys), -(-int(m.num_blocks[s]) * block_size // block_n)) - len(want)
    assert skipped > 0 or block_size <= block_n


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
@pytest.mark.skipif(IN_PROCESS, reason="the tests above ran in this process")
def test_interpreter_suite_in_subprocess():
    """Run this file with ``TRITON_INTERPRET=1`` set before anything imports triton."""
    run_interpreted(__file__, timeout=1200)
