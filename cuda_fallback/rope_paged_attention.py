"""Triton fused-RoPE paged attention over un-rotated (NoPE) KV, scattered queries.

Why: MEPIC stores chunk K without RoPE so one cached copy serves a chunk at any position. The
rotation therefore has to happen when K is read: each K tile is loaded from the paged cache,
rotated in registers at each key's logical position and only then multiplied with the (rotated)
queries. Nothing rotated is ever written back to memory.

Contract (``ascend_mepic.ops.metadata``; ``ascend_mepic.ops.reference`` is the ground truth):
cache ``kv_cache[2, num_blocks, B, Hkv, D]`` (K then V, both un-rotated), queries ``[T, Hq, D]``
un-rotated and grouped by sequence through ``query_start_loc``; each query has a logical position
(where it is rotated) and a padded index (causal order). Key ``(s, j, t)`` is real when
``block_valid_start[s, j] <= t < block_valid_end[s, j]``, is rotated at
``block_first_pos[s, j] + t - block_valid_start[s, j]`` and is seen by the queries of ``s`` whose
padded index is ``>= j * B + t``. ``cos_sin_cache`` is ``[max_pos, D]``, cosines then sines;
neox style rotates the halves ``(x[:D/2], x[D/2:])``, GPT-J style the pairs ``(x[0::2], x[1::2])``.

Kernels (KV is walked in tiles of ``BLOCK_N`` padded key indices, 64 on a GPU: part of a block
when ``B >= BLOCK_N``, several blocks gathered through the block table when ``B < BLOCK_N``, so
block size 16 still gets 64-wide dots; any ``B`` works):

* prefill: grid ``(query tiles, Hkv)``; a tile's ``BLOCK_M`` rows are ``BLOCK_M // GROUP``
  consecutive queries of one sequence times the ``GROUP = Hq // Hkv`` query heads of one KV head
  (``prefill_tiles``: a host map from ``query_start_loc``, heaviest tiles first), so each K/V tile
  is loaded and rotated once per KV head, for all the query heads that read it. It loops over the
  sequence's KV tiles only up to the one holding its largest padded query index (causal
  skipping), with a flash-style online softmax in fp32; the tiles wholly before its smallest
  padded index run a second copy of the loop without the causal compare.
* decode (``max_query_len <= 1``): grid ``(sequences, Hkv, splits)``; the rows of a tile are the
  query heads sharing one KV head (GQA group padded to >= 16 rows for ``tl.dot``), so each K/V
  tile is read once per KV head. With more than one split, each split covers a range of KV tiles
  and a combine kernel merges the partial results by log-sum-exp (flash-decoding), to fill the GPU
  when the batch is small and the context long (splits are chosen from the SM count). Only the
  tile holding the query's own padded index takes the causal compare.

The score is computed on the rotated halves without re-interleaving them:
``q.k = q1.k1 + q2.k2`` where ``(x1, x2)`` are the two rotated half-tiles (neox: the halves;
GPT-J: the even and odd columns, the same code with other column offsets). ``APPLY_ROPE=False``
skips every rotation (the benchmark's baseline). Head dims need not be powers of two: the halves
are padded to a power of two >= 16 with masking (D = 16, 48, 64, 128 are tested). Pad slots are
never loaded (an uninitialised block may hold NaN), and a query that sees no key yields 0.

Dots run on fp32 operands (``input_precision="ieee"``) when Q or the cache is fp32, and by
default under the interpreter (whose ``tl.dot`` on bf16 operands is wrong); on a GPU, fp16/bf16
inputs use their own dtype for the dots (rotated Q/K are rounded back to it, as the torch
reference does) with fp32 accumulation. ``half_dots=True`` runs that GPU path under the
interpreter too (tests only: ``tests/ops/test_triton_half.py``, bf16 through a test-side patch).

The pieces this kernel shares with the triton-ascend kernel (``ascend_mepic.ops.triton_ascend``):
the rotation, the half-tile scores, the online-softmax step, the split-KV combine kernel and the
input checks, are written once in ``ascend_mepic.ops.triton_common``.

Status: tested on CPU under ``TRITON_INTERPRET=1`` (``tests/ops/test_triton.py``; the half dots:
``tests/ops/test_triton_half.py``) and compiled for sm_90a and sm_80 here
(``make test-cuda-compile``: registers, spills, ``cp.async`` per launch). An earlier version, whose
K/V loads sat under a data-dependent branch, ran on one H100 (``tests/gpu/test_gpu_kernels.py``;
timings by ``benchmarks/ops/bench_triton_gpu.py``, docs/results.md); **this version is untested
on a GPU**, as are its GQA-packed prefill rows, the causal-free loop and the KV tile list.
``benchmarks/ops/bench_triton_gpu.py`` times it against SDPA and FlashInfer on one card;
``scripts/gpu_kernels.sh`` runs the GPU tests, the benchmark, Nsight Compute and the launch sweep
in one go. Not run inside vLLM on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from ascend_mepic.ops.metadata import PagedRopeMetadata
from ascend_mepic.ops.rope import RopeSpec
from ascend_mepic.ops.triton_common import (
    INTERPRETED,
    LOG2E,
    check_layout,
    check_tensors,
    combine_kernel,
    half_scores,
    int32,
    launch_strides,
    log2_sum_exp,
    normalize,
    pow2_at_least,
    rotate,
    softmax_step,
    split_buffers,
)


@triton.jit
def _load_halves(
    row_ptr,
    pos,
    row_mask,
    cos_sin_ptr,
    stride_cs,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    IS_NEOX: tl.constexpr,
    APPLY_ROPE: tl.constexpr,
):
    """Load the two rotation half-tiles ``[R, HALF_P]`` of ``R`` rows and rotate them at ``pos``."""
    c = tl.arange(0, HALF_P)
    if IS_NEOX:
        c1 = c
        c2 = c + HALF
    else:
        c1 = 2 * c
        c2 = 2 * c + 1
    mask = row_mask[:, None] & (c < HALF)[None, :]
    x1 = tl.load(row_ptr[:, None] + c1[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row_ptr[:, None] + c2[None, :], mask=mask, other=0.0).to(tl.float32)
    if APPLY_ROPE:
        cs = cos_sin_ptr + pos.to(tl.int64)[:, None] * stride_cs + c[None, :]
        cos = tl.load(cs, mask=mask, other=0.0).to(tl.float32)
        sin = tl.load(cs + HALF, mask=mask, other=0.0).to(tl.float32)
        r1, r2 = rotate(x1, x2, cos, sin)
        return r1, r2
    return x1, x2


@triton.jit
def _attend_tiles(
    q1,
    q2,
    q_idx,
    m_i,
    l_i,
    acc,
    seq,
    nb,
    tiles_row,
    tile_lo,
    tile_hi,
    k_ptr,
    v_ptr,
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    k_off,
    v_off,
    block_tables_ptr,
    first_pos_ptr,
    valid_start_ptr,
    valid_end_ptr,
    stride_bt,
    cos_sin_ptr,
    stride_cs,
    B: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    D: tl.constexpr,
    D_P: tl.constexpr,
    IS_NEOX: tl.constexpr,
    APPLY_ROPE: tl.constexpr,
    DOT_FP32: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """Online softmax of pre-scaled, rotated queries over the KV tiles listed at
    ``tiles_row[tile_lo:tile_hi]`` (``kv_tile_list``: the sequence's tiles that hold a real key,
    ascending, so tiles of padding in a packed table are never visited).

    Tile ``t`` holds the keys of padded index ``t * BLOCK_N + n``: part of one block when
    ``BLOCK_N <= B``, several whole blocks otherwise, so the tile size does not depend on ``B``.
    Within a tile, slots that are not real keys are masked, not branched around, so the loads
    stay asynchronous and pipelined. ``CAUSAL=False`` is for tiles wholly
    before every row's padded index (``_attend_kv`` splits the range at the diagonal): only the
    real-key mask is applied there, not the per-row causal compare.
    """
    n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, D_P)
    meta_row = seq.to(tl.int64) * stride_bt
    for i in range(tile_lo, tile_hi):
        t = tl.load(tiles_row + i)
        idx = t * BLOCK_N + n
        j = idx // B
        slot = idx % B
        in_seq = j < nb
        blk = tl.load(block_tables_ptr + meta_row + j, mask=in_seq, other=0).to(tl.int64)
        first = tl.load(first_pos_ptr + meta_row + j, mask=in_seq, other=0)
        v_start = tl.load(valid_start_ptr + meta_row + j, mask=in_seq, other=0)
        v_end = tl.load(valid_end_ptr + meta_row + j, mask=in_seq, other=0)
        real = in_seq & (slot >= v_start) & (slot < v_end)
        # No branch on ``real`` around the loads: a data-dependent ``if`` there kept every K/V
        # load from being pipelined (0 cp.async in every launch; docs/results.md). A tile with
        # no real key loads nothing (all lanes masked) and adds p = 0, alpha = 1.
        k_rows = k_ptr + blk * stride_kb + slot.to(tl.int64) * stride_ks + k_off
        k1, k2 = _load_halves(
            k_rows, first + slot - v_start, real, cos_sin_ptr, stride_cs,
            HALF, HALF_P, IS_NEOX, APPLY_ROPE,
        )  # fmt: skip
        s = half_scores(q1, q2, k1, k2, DOT_FP32)
        if CAUSAL:
            allowed = real[None, :] & (idx[None, :] <= q_idx[:, None])
        else:
            allowed = real[None, :]
        p, alpha, m_new, l_i = softmax_step(s, allowed, m_i, l_i)
        # Pad slots may hold anything (uninitialised blocks): never load them, 0 * NaN is NaN.
        v_rows = v_ptr + blk * stride_vb + slot.to(tl.int64) * stride_vs + v_off
        v_mask = real[:, None] & (d < D)[None, :]
        v = tl.load(v_rows[:, None] + d[None, :], mask=v_mask, other=0.0)
        acc = acc * alpha[:, None]
        if DOT_FP32:
            acc += tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _attend_kv(
    q1, q2, q_idx, m_i, l_i, acc, seq, nb, tiles_row, tile_lo, free, tile_hi,
    k_ptr, v_ptr, stride_kb, stride_ks, stride_vb, stride_vs, k_off, v_off,
    block_tables_ptr, first_pos_ptr, valid_start_ptr, valid_end_ptr, stride_bt,
    cos_sin_ptr, stride_cs,
    B: tl.constexpr, BLOCK_N: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr,
    D: tl.constexpr, D_P: tl.constexpr, IS_NEOX: tl.constexpr, APPLY_ROPE: tl.constexpr,
    DOT_FP32: tl.constexpr,
):  # fmt: skip
    """The listed tiles ``[tile_lo, tile_hi)`` in two loops split at list position ``free``:
    before it, tiles wholly before every row's padded index (no causal compare); from it on,
    the tiles the diagonal crosses."""
    m_i, l_i, acc = _attend_tiles(
        q1, q2, q_idx, m_i, l_i, acc, seq, nb, tiles_row, tile_lo, free,
        k_ptr, v_ptr, stride_kb, stride_ks, stride_vb, stride_vs, k_off, v_off,
        block_tables_ptr, first_pos_ptr, valid_start_ptr, valid_end_ptr, stride_bt,
        cos_sin_ptr, stride_cs, B, BLOCK_N, HALF, HALF_P, D, D_P, IS_NEOX, APPLY_ROPE, DOT_FP32,
        False,
    )  # fmt: skip
    return _attend_tiles(
        q1, q2, q_idx, m_i, l_i, acc, seq, nb, tiles_row, free, tile_hi,
        k_ptr, v_ptr, stride_kb, stride_ks, stride_vb, stride_vs, k_off, v_off,
        block_tables_ptr, first_pos_ptr, valid_start_ptr, valid_end_ptr, stride_bt,
        cos_sin_ptr, stride_cs, B, BLOCK_N, HALF, HALF_P, D, D_P, IS_NEOX, APPLY_ROPE, DOT_FP32,
        True,
    )  # fmt: skip


@triton.jit
def _prefill_kernel(
    q_ptr,
    out_ptr,
    k_ptr,
    v_ptr,
    cos_sin_ptr,
    tile_seq_ptr,
    tile_row_ptr,
    query_start_loc_ptr,
    query_pos_ptr,
    query_idx_ptr,
    block_tables_ptr,
    num_blocks_ptr,
    first_pos_ptr,
    valid_start_ptr,
    valid_end_ptr,
    kv_tiles_ptr,
    kv_rank_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_cs,
    stride_kt,
    qk_scale,
    GROUP: tl.constexpr,
    B: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    D: tl.constexpr,
    D_P: tl.constexpr,
    IS_NEOX: tl.constexpr,
    APPLY_ROPE: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """``BLOCK_M`` rows of one sequence: ``BLOCK_M // GROUP`` consecutive queries times the
    ``GROUP`` query heads of one KV head (query-major), so each K/V tile is loaded and rotated
    once for every query head that reads it, not once per head."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    row0 = tl.load(tile_row_ptr + tile)
    row_end = tl.load(query_start_loc_ptr + seq + 1)
    r = tl.arange(0, BLOCK_M)
    rows = row0 + r // GROUP
    heads = kv_head * GROUP + r % GROUP
    row_mask = (r < (BLOCK_M // GROUP) * GROUP) & (rows < row_end)
    pos = tl.load(query_pos_ptr + rows, mask=row_mask, other=0)
    q_idx = tl.load(query_idx_ptr + rows, mask=row_mask, other=-1)
    q_rows = q_ptr + rows.to(tl.int64) * stride_qt + heads * stride_qh
    q1, q2 = _load_halves(
        q_rows, pos, row_mask, cos_sin_ptr, stride_cs, HALF, HALF_P, IS_NEOX, APPLY_ROPE
    )
    q1 = q1 * qk_scale
    q2 = q2 * qk_scale
    if not DOT_FP32:
        q1 = q1.to(q_ptr.dtype.element_ty)
        q2 = q2.to(q_ptr.dtype.element_ty)

    nb = tl.load(num_blocks_ptr + seq)
    num_tiles = tl.minimum(tl.cdiv(nb * B, BLOCK_N), tl.max(q_idx, 0) // BLOCK_N + 1)
    # Tiles wholly at or before the tile's smallest padded index need no causal compare.
    lowest = tl.min(tl.where(row_mask, q_idx, 2147483647), 0)
    free = tl.minimum((lowest + 1) // BLOCK_N, num_tiles)
    # Tile numbers -> positions in the sequence's list of tiles holding a real key.
    tiles_row = kv_tiles_ptr + seq.to(tl.int64) * stride_kt
    rank_row = kv_rank_ptr + seq.to(tl.int64) * (stride_kt + 1)
    free = tl.load(rank_row + free)
    num_tiles = tl.load(rank_row + num_tiles)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_P], tl.float32)
    m_i, l_i, acc = _attend_kv(
        q1, q2, q_idx, m_i, l_i, acc, seq, nb, tiles_row, 0, free, num_tiles,
        k_ptr, v_ptr, stride_kb, stride_ks, stride_vb, stride_vs,
        kv_head * stride_kh, kv_head * stride_vh,
        block_tables_ptr, first_pos_ptr, valid_start_ptr, valid_end_ptr, stride_bt,
        cos_sin_ptr, stride_cs, B, BLOCK_N, HALF, HALF_P, D, D_P, IS_NEOX, APPLY_ROPE, DOT_FP32,
    )  # fmt: skip
    out = normalize(acc, l_i)
    d = tl.arange(0, D_P)
    o_rows = out_ptr + rows.to(tl.int64) * stride_ot + heads * stride_oh
    tl.store(
        o_rows[:, None] + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & (d < D)[None, :],
    )


@triton.jit
def _decode_kernel(
    q_ptr,
    out_ptr,
    part_ptr,
    lse_ptr,
    k_ptr,
    v_ptr,
    cos_sin_ptr,
    query_start_loc_ptr,
    query_pos_ptr,
    query_idx_ptr,
    block_tables_ptr,
    num_blocks_ptr,
    first_pos_ptr,
    valid_start_ptr,
    valid_end_ptr,
    kv_tiles_ptr,
    kv_rank_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_cs,
    stride_kt,
    qk_scale,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    B: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    D: tl.constexpr,
    D_P: tl.constexpr,
    IS_NEOX: tl.constexpr,
    APPLY_ROPE: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """The single query of one sequence, all query heads of one KV head, one split of its KV."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(query_start_loc_ptr + seq)
    count = tl.load(query_start_loc_ptr + seq + 1) - row
    g = tl.arange(0, BLOCK_G)
    # Vector masks only: the interpreter mishandles a scalar bool combined with a vector one.
    has_query = (count + tl.zeros([BLOCK_G], tl.int32)) > 0
    row_mask = (g < GROUP) & has_query
    heads = kv_head * GROUP + g
    row_vec = row + tl.zeros([BLOCK_G], tl.int32)
    pos = tl.load(query_pos_ptr + row_vec, mask=has_query, other=0)
    q_idx = tl.load(query_idx_ptr + row_vec, mask=row_mask, other=-1)
    q_rows = q_ptr + row.to(tl.int64) * stride_qt + heads * stride_qh
    q1, q2 = _load_halves(
        q_rows, pos, row_mask, cos_sin_ptr, stride_cs, HALF, HALF_P, IS_NEOX, APPLY_ROPE
    )
    q1 = q1 * qk_scale
    q2 = q2 * qk_scale
    if not DOT_FP32:
        q1 = q1.to(q_ptr.dtype.element_ty)
        q2 = q2.to(q_ptr.dtype.element_ty)

    nb = tl.load(num_blocks_ptr + seq)
    num_tiles = tl.minimum(tl.cdiv(nb * B, BLOCK_N), tl.max(q_idx, 0) // BLOCK_N + 1)
    num_tiles = tl.where(count > 0, num_tiles, 0)
    # Splits share out the listed tiles (those holding a real key), not the tile numbers.
    tiles_row = kv_tiles_ptr + seq.to(tl.int64) * stride_kt
    rank_row = kv_rank_ptr + seq.to(tl.int64) * (stride_kt + 1)
    listed = tl.load(rank_row + num_tiles)
    per_split = tl.cdiv(listed, NUM_SPLITS)
    tile_lo = split * per_split
    tile_hi = tl.minimum(tile_lo + per_split, listed)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D_P], tl.float32)
    # Every tile but the one holding the query's own padded index is wholly before it.
    free = tl.load(rank_row + tl.minimum((tl.max(q_idx, 0) + 1) // BLOCK_N, num_tiles))
    free = tl.minimum(tl.maximum(free, tile_lo), tile_hi)
    m_i, l_i, acc = _attend_kv(
        q1, q2, q_idx, m_i, l_i, acc, seq, nb, tiles_row, tile_lo, free, tile_hi,
        k_ptr, v_ptr, stride_kb, stride_ks, stride_vb, stride_vs,
        kv_head * stride_kh, kv_head * stride_vh,
        block_tables_ptr, first_pos_ptr, valid_start_ptr, valid_end_ptr, stride_bt,
        cos_sin_ptr, stride_cs, B, BLOCK_N, HALF, HALF_P, D, D_P, IS_NEOX, APPLY_ROPE, DOT_FP32,
    )  # fmt: skip
    out = normalize(acc, l_i)
    d = tl.arange(0, D_P)
    mask = row_mask[:, None] & (d < D)[None, :]
    if NUM_SPLITS == 1:
        o_rows = out_ptr + row.to(tl.int64) * stride_ot + heads * stride_oh
        tl.store(o_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # Partials [T, Hq, NUM_SPLITS, D] and their log2-sum-exp [T, Hq, NUM_SPLITS] (fp32).
        slot = (row.to(tl.int64) * (GROUP * tl.num_programs(1)) + heads) * NUM_SPLITS + split
        tl.store(part_ptr + slot[:, None] * D + d[None, :], out, mask=mask)
        tl.store(lse_ptr + slot, log2_sum_exp(m_i, l_i), mask=row_mask)


@dataclass(frozen=True)
class Launch:
    block_m: int  # prefill: queries per tile
    block_n: int  # padded key indices per KV tile
    num_warps: int
    num_stages: int


def launch_config(
    decode: bool, block_size: int, max_query_len: int, head_size: int = 128
) -> Launch:
    """Default tiles and launch for a call, chosen by ``bench_triton_gpu.py --sweep`` on an H100
    (bf16, 32/8 heads, head 128 only; docs/results.md), on the kernel from before its K/V loads
    were pipelined (a data-dependent branch kept them serial, so ``num_stages`` changed nothing
    then): to be swept again on a GPU (issue 49).

    Decode: 2 warps and 3 stages, 1.31-1.36x faster than 4 warps and 2 stages at 8k-32k keys.
    Prefill: 128 x 32 tiles, 1.20-1.49x faster than 64 x 64 at 2k-32k prompts where a tile is part
    of a block (block size >= 64); at block size 16 they were not better (0.93x at 2k), and MEPIC's
    few recomputed rows per chunk would waste most of a 128-row tile, so 64 x 64 stays there.
    Since then a prefill tile's rows hold the KV head's GQA group (a 64-row tile is 16 queries
    of Mistral's 32 / 8 heads), so that trade-off has moved too. The interpreter's cost is per
    tile, not per key, so it takes 128-key tiles.

    Prefill with heads padded to 128 columns or more takes 8 warps: with 4, every such tile
    spilled once its loads were pipelined (4-412 bytes on sm_90a / sm_80; with 8 none do,
    ``make test-cuda-compile``); so do 64 x 64 tiles of 64-column heads, which spilled 4 bytes
    on sm_80 under Triton 3.6 with 4. Decode with heads of 64 columns takes 32-key tiles: with 64,
    Triton 3.6 (the GPU test machine's, torch 2.11's pin) capped it at 168 registers and spilled
    4-12 bytes on sm_90a, where Triton 3.9 (this lock's) did not. Chosen by the compiler's
    report, not yet timed on a GPU.
    """
    if INTERPRETED:
        return Launch(64, 128, 4, 2)
    wide = pow2_at_least(head_size, 16) >= 128
    if decode:  # heads of 64 columns: 32-key tiles (64 spilled 4-12 bytes under Triton 3.6)
        return Launch(64, 64 if wide else 32, 2, 3)
    if block_size >= 64 and max_query_len >= 1024:
        return Launch(128, 32, 8 if wide else 4, 2)
    return Launch(64, 64, 8, 2)


def prefill_queries_per_tile(block_m: int, group: int) -> int:
    """Queries in a prefill tile of ``block_m`` rows when each query brings its ``group`` query
    heads (the rows of one KV head): ``block_m // group``; ``block_m >= group``."""
    if block_m < group:
        raise ValueError(f"a {block_m}-row tile cannot hold a GQA group of {group} heads")
    return block_m // group


def prefill_tiles(
    query_start_loc: torch.Tensor,
    queries_per_tile: int = 16,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefill grid's map tile -> (sequence, first query row), heaviest (last) tiles first.

    ``queries_per_tile`` is ``prefill_queries_per_tile(block_m, group)``. Built on the host (it
    sets the grid size). From a device ``query_start_loc`` this syncs, so a runner should build
    it once per step from its CPU copy and pass it to every layer's call.
    """
    loc = query_start_loc.to("cpu", torch.int64)
    counts = loc[1:] - loc[:-1]
    per_seq = (counts + queries_per_tile - 1) // queries_per_tile
    seqs = torch.repeat_interleave(torch.arange(counts.numel()), per_seq)
    first_tile = torch.cumsum(per_seq, 0) - per_seq
    within = torch.arange(seqs.numel()) - first_tile[seqs]
    rows = loc[seqs] + within * queries_per_tile
    target = query_start_loc.device if device is None else device
    return seqs.flip(0).to(target, torch.int32), rows.flip(0).to(target, torch.int32)


def kv_tile_list(
    num_blocks: torch.Tensor,
    valid_start: torch.Tensor,
    valid_end: torch.Tensor,
    block_size: int,
    block_n: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence, its ``BLOCK_N``-key tiles that hold at least one real key.

    Returns ``tiles [S, T]`` (the tile numbers, ascending, then padding) and ``rank [S, T + 1]``
    (``rank[s, t]``: how many listed tiles come before tile ``t``), with
    ``T = ceil(max_blocks * B / BLOCK_N)``. The kernels turn a range of tile numbers (causal
    bound, diagonal) into a range of list positions through ``rank`` and visit only listed
    tiles: in a packed table a chunk's last block is often mostly padding, and at block size
    128 whole tiles of it hold no key. Device tensor ops only (no host sync), built once per
    step and tile width and shared by every layer.
    """
    s, mb = valid_start.shape
    device = valid_start.device
    slot = torch.arange(block_size, device=device, dtype=torch.int32)
    in_seq = torch.arange(mb, device=device)[None, :] < num_blocks.to(device)[:, None]
    real = (
        (slot >= valid_start[..., None]) & (slot < valid_end[..., None]) & in_seq[..., None]
    ).reshape(s, mb * block_size)
    t = max(1, triton.cdiv(mb * block_size, block_n))
    real = torch.nn.functional.pad(real, (0, t * block_n - mb * block_size))
    listed = real.reshape(s, t, block_n).any(-1)
    rank = torch.zeros(s, t + 1, dtype=torch.int32, device=device)
    rank[:, 1:] = torch.cumsum(listed, 1)
    tiles = torch.zeros(s, t + 1, dtype=torch.int32, device=device)  # last column: a sink
    where = torch.where(listed, rank[:, :-1].long(), t)
    numbers = torch.arange(t, device=device, dtype=torch.int32).expand(s, t)
    tiles.scatter_(1, where, numbers)
    return tiles[:, :t].contiguous(), rank


_SM_COUNT: dict[int, int] = {}


def _num_splits(device: torch.device, programs: int, kv_tiles: int) -> int:
    """Flash-decoding splits: enough programs for ~2 waves, each split >= 4 KV tiles."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    want = min(triton.cdiv(2 * _SM_COUNT[index], max(programs, 1)), max(1, kv_tiles // 4), 64)
    return triton.next_power_of_2(want) if want > 1 else 1


def _validate(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: PagedRopeMetadata, rope: RopeSpec
) -> None:
    check_layout(query, kv_cache)
    _, _, bs, hkv, d = kv_cache.shape
    if query.shape[2] != d or rope.cos_sin_cache.shape[-1] != d:
        raise ValueError(
            f"head dims differ: query {query.shape[2]}, cache {d}, "
            f"cos_sin_cache {rope.cos_sin_cache.shape[-1]}"
        )
    if d % 2:
        raise ValueError(f"head dim {d} must be even for RoPE")
    if query.shape[1] % hkv:
        raise ValueError(f"query heads {query.shape[1]} must be a multiple of KV heads {hkv}")
    if bs != meta.block_size:
        raise ValueError(f"block size differs: cache {bs}, metadata {meta.block_size}")
    check_tensors(query, kv_cache, meta)
    if query.device.type != "cuda" and not INTERPRETED:
        raise RuntimeError(
            f"Triton kernels need CUDA tensors (got {query.device}); set TRITON_INTERPRET=1 "
            "before importing triton to run them on CPU"
        )


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel launch of a call: what ``rope_paged_attention_triton`` runs, and what the
    compile check (``tests/ops/cuda_compile.py``) compiles for a GPU without one."""

    kernel: Any  # a ``triton.JITFunction``
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def __call__(self) -> None:
        self.kernel[self.grid](*self.args, **self.kwargs)


def rope_paged_attention_triton(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: PagedRopeMetadata,
    rope: RopeSpec,
    scale: float,
    **options: Any,
) -> torch.Tensor:
    """Fused-RoPE paged attention; same contract and result as the torch reference.

    ``options`` are ``plan_launches``'s keywords (tile sizes, launch, splits, precomputed
    prefill tiles, ``apply_rope``, ``kernel``, ``half_dots``).
    """
    _validate(query, kv_cache, meta, rope)
    out, launches = plan_launches(query, kv_cache, meta, rope, scale, **options)
    for launch in launches:
        launch()
    return out


def plan_launches(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: PagedRopeMetadata,
    rope: RopeSpec,
    scale: float,
    *,
    apply_rope: bool = True,
    kernel: str | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    tiles: tuple[torch.Tensor, torch.Tensor] | None = None,
    half_dots: bool | None = None,
) -> tuple[torch.Tensor, list[KernelLaunch]]:
    """The output buffer and the launches that fill it, not yet run (no device needed: the
    compile check plans the shipped launches from CPU tensors).

    ``kernel`` forces ``"prefill"`` or ``"decode"`` (default: decode when
    ``meta.max_query_len <= 1``, trusted as given). ``tiles`` is ``prefill_tiles(loc,
    prefill_queries_per_tile(block_m, Hq // Hkv))`` precomputed with the same ``block_m`` (else
    built here once per ``meta``, a host sync). A prefill tile's ``block_m`` rows are queries
    times the GQA group's heads; it is raised to the group size if smaller.
    ``apply_rope=False`` skips all rotation; ``block_m``/``block_n``/``num_splits`` override tile
    sizes and decode splits, ``num_warps``/``num_stages`` the main kernel's launch (benchmarks,
    ``bench_triton_gpu.py --sweep``, and tests). ``half_dots`` (tests) forces the dots of
    fp16/bf16 inputs into their dtype (True: the GPU's path, also under the interpreter) or fp32
    (False); None: fp32 under the interpreter, their dtype on a GPU. fp32 inputs: fp32 dots.
    """
    if kernel not in (None, "prefill", "decode"):
        raise ValueError(f"kernel must be 'prefill' or 'decode', got {kernel!r}")
    device = query.device
    t, hq, d = query.shape
    bs, hkv = kv_cache.shape[2], kv_cache.shape[3]
    out = torch.empty_like(query)
    if t == 0:
        return out, []
    if query.stride(-1) != 1:
        query = query.contiguous()
    if kv_cache.stride(-1) != 1:
        kv_cache = kv_cache.contiguous()  # never for a real cache: vLLM's is contiguous
    k, v = kv_cache[0], kv_cache[1]
    cos_sin = rope.cos_sin_cache.to(device).contiguous()
    loc = int32(meta.query_start_loc, device)
    q_pos = int32(meta.query_positions, device)
    q_idx = int32(meta.query_indices, device)
    tables = int32(meta.block_tables, device)
    nblocks = int32(meta.num_blocks, device)
    first = int32(meta.block_first_pos, device)
    vstart = int32(meta.block_valid_start, device)
    vend = int32(meta.block_valid_end, device)
    if not (tables.shape == first.shape == vstart.shape == vend.shape):
        raise ValueError("block_tables and the per-block metadata must have one shape")

    decode = kernel == "decode" or (kernel is None and meta.max_query_len <= 1)
    cfg = launch_config(decode, bs, meta.max_query_len, d)
    block_m = block_m or cfg.block_m
    block_n = block_n or cfg.block_n
    num_warps = num_warps or cfg.num_warps
    num_stages = num_stages or cfg.num_stages
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n {block_n} must be a power of two >= 16")
    half = d // 2
    common = dict(
        B=bs,
        BLOCK_N=block_n,
        HALF=half,
        HALF_P=pow2_at_least(half, 16),
        D=d,
        D_P=pow2_at_least(d, 16),
        IS_NEOX=bool(rope.is_neox_style),
        APPLY_ROPE=bool(apply_rope),
        DOT_FP32=torch.float32 in (query.dtype, kv_cache.dtype)
        or (INTERPRETED if half_dots is None else not half_dots),
    )
    key = ("triton-kv-tiles", bs, block_n, device)
    kv_tiles = meta.memo.get(key)
    if kv_tiles is None:  # once per step and tile width: every layer shares ``meta``
        kv_tiles = meta.memo[key] = kv_tile_list(nblocks, vstart, vend, bs, block_n)
    strides = (*launch_strides(query, out, k, v, tables, cos_sin), kv_tiles[0].stride(0))
    qk_scale = float(scale) * LOG2E
    group = hq // hkv
    metas = (loc, q_pos, q_idx, tables, nblocks, first, vstart, vend, *kv_tiles)

    if kernel == "decode" and meta.max_query_len > 1:
        raise ValueError(
            f"the decode kernel takes <= 1 query per sequence, not {meta.max_query_len}"
        )
    if decode:
        splits = num_splits or _num_splits(
            device, meta.num_seqs * hkv, triton.cdiv(meta.max_num_blocks * bs, block_n)
        )
        if splits & (splits - 1):
            raise ValueError(f"num_splits {splits} must be a power of two")
        part, lse = split_buffers(out, splits)
        launches = [
            KernelLaunch(
                _decode_kernel,
                (meta.num_seqs, hkv, splits),
                (query, out, part, lse, k, v, cos_sin, *metas, *strides, qk_scale),
                dict(GROUP=group, BLOCK_G=pow2_at_least(group, 16), NUM_SPLITS=splits,
                     **common, num_warps=num_warps, num_stages=num_stages),
            )
        ]  # fmt: skip
        if splits > 1:
            launches.append(
                KernelLaunch(
                    combine_kernel,
                    (t * hq,),  # one program per (query, head)
                    (part, lse, out, t, out.stride(0), out.stride(1)),
                    dict(NUM_HEADS=hq, NUM_SPLITS=splits, D=d, D_P=common["D_P"], num_warps=4),
                )
            )
        return out, launches

    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m {block_m} must be a power of two >= 16")
    block_m = max(block_m, pow2_at_least(group, 16))  # a tile holds at least one query
    per_tile = prefill_queries_per_tile(block_m, group)
    if tiles is None:  # built once per step (it syncs): every layer shares ``meta``
        key = ("triton-prefill-tiles", per_tile, device)
        tiles = meta.memo.get(key)
        if tiles is None:
            tiles = meta.memo[key] = prefill_tiles(meta.query_start_loc, per_tile, device)
    tile_seq, tile_row = (int32(x, device) for x in tiles)
    launch = KernelLaunch(
        _prefill_kernel,
        (tile_seq.numel(), hkv),
        (query, out, k, v, cos_sin, tile_seq, tile_row, *metas, *strides, qk_scale),
        dict(GROUP=group, BLOCK_M=block_m, **common, num_warps=num_warps, num_stages=num_stages),
    )
    return out, [launch]
