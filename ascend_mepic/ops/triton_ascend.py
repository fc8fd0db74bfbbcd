"""Fused-RoPE paged attention written for triton-ascend (Ascend 910B): the NPU's default kernel
for the shapes torch_npu's fused attention does not take.

UNTESTED ON HARDWARE: this kernel has never run on an Ascend NPU (no NPU and no CANN toolkit on
the machines it was built on). What is checked: every launch the worker can make goes through
triton-ascend 3.2's own compiler stages ``ttir`` and ``ttadapter`` (``triton-adapter-opt``) for a
910B3 target (``tests/ops/test_ascend_compile.py``); the last stage, CANN's ``bishengir-compile``
to an NPU binary, is not run (``tests/ops/ascend_compile.CANN_ONLY_CHECKS`` lists what it could
still reject). Numerics are checked under triton-ascend's CPU interpreter
(``tests/ops/test_ascend_kernel.py``) against the dense float64 oracle. The kernel needs
triton-ascend: its tiles are block pointers, which upstream Triton removed (there the module
imports, for the launch planning and the UB estimate, but ``rope_paged_attention_ascend`` refuses
to run).

Same contract as the CUDA kernel ``cuda_fallback.rope_paged_attention``
(``ascend_mepic.ops.metadata``): K and V un-rotated in ``[2, num_blocks, B, Hkv, D]``
(vllm-ascend's ``(2, num_blocks, 128, kv_heads, head)``), scattered un-rotated queries, per-entry
valid ranges and positions. The arithmetic both kernels share (rotation, scores, online softmax,
the split-KV combine kernel) and their common input checks are written once, in
``ascend_mepic.ops.triton_common``. What differs from the GPU kernel, and why (triton-ascend's
migration and performance guides, and the forms vllm-ascend 0.30.0rc2's own Triton kernels use,
``vllm_ascend/ops/triton/``):

* **Persistent grid.** Programs are bound to AI cores and a grid larger than the core count runs
  in batches, so the grid is the core count (``num_cores``) and each program loops over work items
  ``w = pid, pid + cores, ...``. The number of work items is read from a device tensor.
* **Every tile is a 2-D, unit-inner-stride tile at a scalar base** (``_load_tile``: a 2-D block
  pointer, vllm-ascend's idiom). No 3-D box, no stride-2 load, no gather in the hot loop:
  - K and V: a block-table entry's block id, first position and valid range are scalars; its
    sub-tiles start at the first valid slot (``[row0, row0 + BLOCK_N)`` cut at ``valid_end``), so
    one upper bound masks them and the cos/sin rows of their positions are consecutive rows of
    the table, loaded as a tile too.
  - Rotation pairs: NeoX halves are two column-offset tiles; GPT-J pairs are whole rows split
    with ``tl.split`` (as vllm-ascend's RoPE kernel does).
  - Decode: one query per sequence; its position and index are scalar loads, its cos/sin one
    contiguous row broadcast over the ``GROUP`` heads (rows ``stride_qh`` apart). The review
    found that a gather of per-query cos/sin rows with one query per tile aborts
    ``triton-adapter-opt`` (``BlockPtrAnalysis``: ``addptrRes.hasOneUse()``).
  - Prefill: a small kernel (``_rope_q_kernel``, the decode's query prologue per (query, KV head))
    first writes the rotated, pre-scaled queries in ``[Hkv, T * GROUP, D]`` order, so a tile of
    (query, head) rows of one KV head is one 2-D tile; the output is written in the same order
    and put back in ``[T, Hq, D]`` by one copy.
* **K rotated once per page and KV head.** A prefill work item is (sequence, KV head, run of
  consecutive query rows). Its first tile to reach an entry rotates that entry's K and writes the
  rotated halves, in the dot dtype, to the program's own scratch (``[cores, max_keys, D]`` in
  HBM); later tiles of the item read them back. A program reads back only what it wrote itself;
  whether triton-ascend orders that HBM store before the later load without an explicit barrier
  is not verified on hardware.
* **GQA rows.** Rows are the query heads sharing a KV head, so K/V are read once per KV head and
  ``tl.dot`` gets >= 16 rows (prefill: ``ROWS`` (query, head) rows; decode: the group padded).
* **Masks in fp32.** Integer vector compares drop to scalar code on A2; the valid-range and causal
  masks compare float32 copies of slot and query indices (exact below 2**24).
* **UB budget.** A2's unified buffer is 192 KiB per vector core. ``ub_bytes`` is what BiSheng
  IR's compiler (``bishengir-compile`` 1.2.0, the stage after ``ttadapter``) places in it for one
  attention launch, fitted to its final HIVM and stated as an upper bound over the fit's tiles;
  ``choose_tiles`` picks the most rows, then the widest ``BLOCK_N``, under ``UB_BUDGET`` (85%:
  room for a later compiler's extra temporary). ``tests/ops/test_ascend_compile.py`` holds every
  launch to that budget on the compiler's own figure.
* **Split-KV decode.** One query per sequence leaves cores idle when the batch is small, so the
  block table is split into ``num_splits`` ranges (from the core count), each writing a partial
  output and its log2-sum-exp; a combine kernel merges them.

Scores are ``q.k = q1.k1 + q2.k2`` on the rotated halves, online softmax in fp32 with exp2; dots
take fp32 or the input's half dtype with fp32 accumulation. Under an interpreter bf16 dots fall
back to fp32 unless ``half_dots=True`` (Triton's interpreter multiplies bf16's raw bits; the tests
patch it to upcast), fp16 dots run as on the NPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from ascend_mepic import ops
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

logger = logging.getLogger(__name__)

# Programs launched under the interpreter: fewer than the work items, so the persistent loop runs.
INTERPRETER_CORES = 3
# 910B3's AI-core count (triton-ascend's tutorials assume 20); used when the driver cannot say.
DEFAULT_NPU_CORES = 20


# A2 (910B) unified buffer per vector core, and the share a launch may fill in the compiler's
# plan (the rest: what another CANN build or a later pass may add).
UB_BYTES = 192 * 1024
UB_FRACTION = 0.85
UB_BUDGET = int(UB_BYTES * UB_FRACTION)
# Candidate tile sizes, preferred first (rows: BLOCK_Q * GROUP_P; keys per sub-tile).
ROW_CHOICES = (32, 16)
BLOCK_N_CHOICES = (64, 32, 16)
# bishengir-compile 1.2.0's UB plan of an attention launch (final HIVM, highest placed end), per
# (decode, NeoX rotation): bytes = a * rows * D_P + b * BLOCK_N * D_P + c * rows * BLOCK_N + d.
# Least squares (tests/ops/fit_ascend_ub.py) over a tile grid (heads 64/128/256, float16 and
# float32, cos/sin in the model dtype, rows 16/32, BLOCK_N 16/32/64; the points placed under 86%
# of UB: above that the compiler drops multi-buffering and its figure saturates), each fit then
# scaled by its largest under-statement (1.01-1.14), so it bounds its points from above (within
# 8% for prefill, 26% for decode). ``a`` then lowered by 4: one fp32 accumulator less since the
# accumulator's zero is no longer a constant the compiler hoists and keeps live (-16 KiB at head
# 256). Element dtypes barely move it (the compiler keeps fp32 copies of the half tiles): they
# are not terms. The compile test checks that it bounds every shipped launch's plan.
UB_FIT: dict[tuple[bool, bool], tuple[float, float, float, int]] = {
    (False, True): (17.64, 16.75, 21.96, 3974),  # prefill, NeoX
    (False, False): (17.2, 19.47, 21.12, 3529),  # prefill, GPT-J
    (True, True): (12.19, 7.65, 6.7, 6962),  # decode, NeoX
    (True, False): (-2.65, 35.09, -60.6, 58888),  # decode, GPT-J (rows are 16: not separable)
}


def ub_bytes(rows: int, block_n: int, head: int, *, decode: bool, neox: bool) -> int:
    """UB bytes the compiler plans for one attention launch with these tiles (``UB_FIT``)."""
    a, b, c, d = UB_FIT[(decode, neox)]
    d_p = pow2_at_least(head, 16)
    return int(a * rows * d_p + b * block_n * d_p + c * rows * block_n + d)


def dots_in_fp32(q_dtype: torch.dtype, kv_dtype: torch.dtype, half_dots: bool | None) -> bool:
    """fp32 dots when an input is fp32, or (unless forced) bf16 under an interpreter."""
    if torch.float32 in (q_dtype, kv_dtype):
        return True
    if half_dots is None:
        return INTERPRETED and torch.bfloat16 in (q_dtype, kv_dtype)
    return not half_dots


def choose_tiles(
    head: int, group: int, block_size: int, decode: bool = False, neox: bool = True
) -> tuple[int, int]:
    """``(block_q, block_n)`` the launcher uses: the most rows, then the widest sub-tile, whose
    ``ub_bytes`` fits ``UB_BUDGET`` (smallest tiles if nothing does). Decode has one query:
    ``block_q`` is 1 and its rows are the group padded to 16."""
    group_p = pow2_at_least(group, 1)
    if decode:
        row_choices = (pow2_at_least(group, 16),)
    else:
        row_choices = tuple(r for r in ROW_CHOICES if r >= group_p) or (group_p,)
    widths = [n for n in BLOCK_N_CHOICES if n <= block_size and block_size % n == 0] or [16]
    for rows in row_choices:
        for block_n in widths:
            if ub_bytes(rows, block_n, head, decode=decode, neox=neox) <= UB_BUDGET:
                return (1 if decode else max(1, rows // group_p)), block_n
    rows = row_choices[-1]
    return (1 if decode else max(1, rows // group_p)), widths[-1]


@triton.jit
def _i64(x):
    """``x`` as an int64 scalar (a loop index is a Python int under the interpreter)."""
    return tl.zeros([], tl.int64) + x


@triton.jit
def _tile_block_ptr(base, n_rows, row0, stride_row, n_cols, ROWS: tl.constexpr,
                    COLS: tl.constexpr):  # fmt: skip
    """The 2-D block pointer of ``_load_tile``'s tile (triton-ascend's idiom; vllm-ascend's
    kernels use this form)."""
    return tl.make_block_ptr(
        base,
        shape=(n_rows, n_cols),
        strides=(stride_row, 1),
        offsets=(row0, 0),
        block_shape=(ROWS, COLS),
        order=(1, 0),
    )


@triton.jit
def _load_tile(
    base,
    n_rows,
    row0,
    stride_row,
    n_cols,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    """Rows ``[row0, row0 + ROWS)`` x columns ``[0, COLS)`` of a row-major 2-D region with unit
    column stride, zero past ``n_rows`` rows and ``n_cols`` columns, through a 2-D block pointer.
    """
    ptr = _tile_block_ptr(base, n_rows, row0, stride_row, n_cols, ROWS, COLS)
    return tl.load(ptr, boundary_check=(0, 1), padding_option="zero")


@triton.jit
def _store_tile(
    base,
    x,
    n_rows,
    row0,
    stride_row,
    n_cols,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    """Store ``x`` ``[ROWS, COLS]`` where ``_load_tile`` would load it (in range only)."""
    ptr = _tile_block_ptr(base, n_rows, row0, stride_row, n_cols, ROWS, COLS)
    tl.store(ptr, x, boundary_check=(0, 1))


@triton.jit
def _load_pairs(
    base,
    n_rows,
    row0,
    stride_row,
    ROWS: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    D: tl.constexpr,
    D_P: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    """The rotation pairs of ``ROWS`` head rows as two fp32 halves ``[ROWS, HALF_P]``: column
    ``c`` of each is pair ``c`` (NeoX: columns ``c`` and ``c + HALF``; GPT-J: ``2c`` and
    ``2c + 1``). NeoX loads each half as its own unit-stride tile; GPT-J loads whole rows and
    splits them with ``tl.split`` (no stride-2 load; as vllm-ascend's RoPE kernel does)."""
    if IS_NEOX:
        x1 = _load_tile(base, n_rows, row0, stride_row, HALF, ROWS, HALF_P)
        x2 = _load_tile(base + HALF, n_rows, row0, stride_row, HALF, ROWS, HALF_P)
    else:
        x = _load_tile(base, n_rows, row0, stride_row, D, ROWS, D_P)
        x1, x2 = tl.split(tl.reshape(x, (ROWS, HALF_P, 2)))
    return x1.to(tl.float32), x2.to(tl.float32)


@triton.jit
def _attend_entry(
    q1,
    q2,
    q_idx_f,
    m_i,
    l_i,
    acc,
    j,
    reuse,
    meta_row,
    k_head_ptr,
    v_head_ptr,
    scratch_ptr,
    stride_kb,
    stride_ks,
    stride_vb,
    stride_vs,
    block_tables_ptr,
    first_pos_ptr,
    valid_start_ptr,
    valid_end_ptr,
    cos_sin_ptr,
    stride_cs,
    B: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    D: tl.constexpr,
    D_P: tl.constexpr,
    IS_NEOX: tl.constexpr,
    DOT_FP32: tl.constexpr,
    SCRATCH: tl.constexpr,
):
    """Online softmax of the rows over block-table entry ``j``'s valid sub-tiles.

    ``reuse`` (a runtime flag): read the rotated K back from the scratch rows ``j * B + slot``
    (no raw K, no cos/sin); else rotate K and, if ``SCRATCH`` is 1, write it there (the two
    rotated halves side by side). One call site for both (not a loop each): bishengir-compile
    plans each loop's temporaries apart, and the second loop's copies of the ``[rows, D]``
    accumulator put head 256 at 98.9% of the unified buffer (83.5% with one loop; the compile
    test's table). The sub-tile loop's bounds cover ``[valid_start, valid_end)``, so an empty entry
    costs no iteration. Every tile is a 2-D unit-stride tile at a scalar base: K and V rows of
    the page, and the cos/sin rows of their positions, which are consecutive.
    """
    n = tl.arange(0, BLOCK_N)
    blk = tl.load(block_tables_ptr + meta_row + j).to(tl.int64)
    first = tl.load(first_pos_ptr + meta_row + j)
    v_start = tl.load(valid_start_ptr + meta_row + j)
    v_end = tl.load(valid_end_ptr + meta_row + j)
    v_end_f = v_end.to(tl.float32)
    for row0 in range(v_start, v_end, BLOCK_N):
        # Sub-tiles start at the first valid slot, so every tile is rows [row0, row0 + BLOCK_N)
        # cut at v_end: one upper bound, and the cos/sin rows (positions first + row - v_start)
        # never fall before the table.
        rows_left = v_end - row0
        slot_f = (row0 + n).to(tl.float32)
        real = slot_f < v_end_f
        s_tile = scratch_ptr + _i64(j * B + row0) * D
        if reuse:
            k1 = _load_tile(s_tile, rows_left, 0, D, HALF, BLOCK_N, HALF_P)
            k2 = _load_tile(s_tile + HALF, rows_left, 0, D, HALF, BLOCK_N, HALF_P)
        else:
            k_tile = k_head_ptr + blk * stride_kb + _i64(row0) * stride_ks
            x1, x2 = _load_pairs(
                k_tile, rows_left, 0, stride_ks, BLOCK_N, HALF, HALF_P, D, D_P, IS_NEOX
            )
            cs_tile = cos_sin_ptr + _i64(first - v_start + row0) * stride_cs
            cos = _load_tile(cs_tile, rows_left, 0, stride_cs, HALF, BLOCK_N, HALF_P)
            sin = _load_tile(cs_tile + HALF, rows_left, 0, stride_cs, HALF, BLOCK_N, HALF_P)
            k1, k2 = rotate(x1, x2, cos.to(tl.float32), sin.to(tl.float32))
            if not DOT_FP32:
                k1 = k1.to(q1.dtype)
                k2 = k2.to(q2.dtype)
            if SCRATCH == 1:
                _store_tile(s_tile, k1, rows_left, 0, D, HALF, BLOCK_N, HALF_P)
                _store_tile(s_tile + HALF, k2, rows_left, 0, D, HALF, BLOCK_N, HALF_P)
        s = half_scores(q1, q2, k1, k2, DOT_FP32)  # K is in the dot dtype already
        key_idx_f = slot_f + j * B
        allowed = real[None, :] & (key_idx_f[None, :] <= q_idx_f[:, None])
        p, alpha, m_new, l_i = softmax_step(s, allowed, m_i, l_i)
        # Rows past v_end load as zero: an uninitialised slot may hold NaN (0 * NaN = NaN).
        v_tile = v_head_ptr + blk * stride_vb + _i64(row0) * stride_vs
        v = _load_tile(v_tile, rows_left, 0, stride_vs, D, BLOCK_N, D_P)
        acc = acc * alpha[:, None]
        if DOT_FP32:
            acc += tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(p.to(q1.dtype), v.to(q1.dtype))
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _rotated_q(
    q_row_ptr,
    n_heads,
    pos,
    cos_sin_ptr,
    stride_qh,
    stride_cs,
    qk_scale,
    GROUP_P: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    D: tl.constexpr,
    D_P: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    """One query's ``n_heads`` consecutive heads (rows ``stride_qh`` apart) rotated at ``pos``
    and pre-scaled, as two fp32 halves ``[GROUP_P, HALF_P]``. The position is one scalar and its
    cos/sin row one contiguous load, broadcast over the heads (vllm-ascend's RoPE kernel's form)."""
    x1, x2 = _load_pairs(q_row_ptr, n_heads, 0, stride_qh, GROUP_P, HALF, HALF_P, D, D_P, IS_NEOX)
    c = tl.arange(0, HALF_P)
    cs = cos_sin_ptr + pos.to(tl.int64) * stride_cs
    cos = tl.load(cs + c, mask=c < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cs + HALF + c, mask=c < HALF, other=0.0).to(tl.float32)[None, :]
    r1, r2 = rotate(x1, x2, cos, sin)
    return r1 * qk_scale, r2 * qk_scale


@triton.jit
def _rope_q_kernel(
    q_ptr,
    qr_ptr,
    cos_sin_ptr,
    query_pos_ptr,
    num_rows,
    stride_qt,
    stride_qh,
    stride_cs,
    qk_scale,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    D: tl.constexpr,
    D_P: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    """Persistent: work item = (query, KV head). Rotates and pre-scales the KV head's ``GROUP``
    query heads and writes them, rotated halves side by side, in the dot dtype, to
    ``qr[kv_head, query * GROUP + g]`` (``[Hkv, T * GROUP, D]``): the prefill kernel then reads
    each tile of (query, head) rows as one 2-D unit-stride tile."""
    for w in range(tl.program_id(0), num_rows * NUM_KV_HEADS, tl.num_programs(0)):
        row = w // NUM_KV_HEADS
        kv_head = w % NUM_KV_HEADS
        pos = tl.load(query_pos_ptr + row)
        q_row = q_ptr + _i64(row) * stride_qt + (kv_head * GROUP) * stride_qh
        q1, q2 = _rotated_q(
            q_row, GROUP, pos, cos_sin_ptr, stride_qh, stride_cs, qk_scale,
            GROUP_P, HALF, HALF_P, D, D_P, IS_NEOX,
        )  # fmt: skip
        dst = qr_ptr + _i64((kv_head * num_rows + row) * GROUP) * D
        ty = qr_ptr.dtype.element_ty
        _store_tile(dst, q1.to(ty), GROUP, 0, D, HALF, GROUP_P, HALF_P)
        _store_tile(dst + HALF, q2.to(ty), GROUP, 0, D, HALF, GROUP_P, HALF_P)


@triton.jit
def _prefill_kernel(
    qr_ptr,
    out_ptr,
    k_ptr,
    v_ptr,
    cos_sin_ptr,
    scratch_ptr,
    num_items_ptr,
    item_seq_ptr,
    item_row_lo_ptr,
    item_row_hi_ptr,
    row_q_idx_ptr,
    block_tables_ptr,
    num_blocks_ptr,
    first_pos_ptr,
    valid_start_ptr,
    valid_end_ptr,
    num_rows,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_cs,
    stride_scratch,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    B: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    D: tl.constexpr,
    D_P: tl.constexpr,
    IS_NEOX: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Persistent: work item ``w`` = (run of queries ``w // Hkv``, KV head ``w % Hkv``).

    Rows are (query, head) pairs of the KV head, ``ROWS`` per tile, read from the rotated queries
    ``qr`` (``_rope_q_kernel``) and written to ``out`` in the same ``[Hkv, T * GROUP, D]`` order.
    The run's tiles go in row order; entries ``[0, done)`` were rotated by an earlier tile of the
    run and are read from this program's scratch, entries ``[done, hi)`` are rotated and written
    (one loop over ``[0, hi)``, see ``_attend_entry``).
    """
    pid = tl.program_id(0)
    scratch = scratch_ptr + pid.to(tl.int64) * stride_scratch
    r = tl.arange(0, ROWS)
    num_work = tl.load(num_items_ptr) * NUM_KV_HEADS
    for w in range(pid, num_work, tl.num_programs(0)):
        item = w // NUM_KV_HEADS
        kv_head = w % NUM_KV_HEADS
        seq = tl.load(item_seq_ptr + item)
        f_lo = tl.load(item_row_lo_ptr + item) * GROUP
        f_hi = tl.load(item_row_hi_ptr + item) * GROUP
        nb = tl.load(num_blocks_ptr + seq)
        meta_row = seq.to(tl.int64) * stride_bt
        k_head = k_ptr + kv_head * stride_kh
        v_head = v_ptr + kv_head * stride_vh
        head_rows = _i64(kv_head * num_rows * GROUP) * D
        q_head = qr_ptr + head_rows
        o_head = out_ptr + head_rows
        done = nb * 0
        for f0 in range(f_lo, f_hi, ROWS):
            q1 = _load_tile(q_head, f_hi, f0, D, HALF, ROWS, HALF_P)
            q2 = _load_tile(q_head + HALF, f_hi, f0, D, HALF, ROWS, HALF_P)
            q_idx = tl.load(row_q_idx_ptr + f0 + r, mask=f0 + r < f_hi, other=-1)
            q_idx_f = q_idx.to(tl.float32)
            # Entries wholly after the tile's last query are never visited.
            hi = tl.minimum(nb, tl.max(q_idx, 0) // B + 1)
            m_i = tl.full([ROWS], float("-inf"), tl.float32)
            l_i = tl.zeros([ROWS], tl.float32)
            # A zero from a loaded value, not a constant: bishengir-compile hoists a constant
            # [ROWS, D] fill out of every loop and keeps it live (16 KiB of UB at head 256).
            acc = tl.zeros([ROWS, D_P], tl.float32) + (q_idx_f * 0.0)[:, None]
            for j in range(0, hi):
                m_i, l_i, acc = _attend_entry(
                    q1, q2, q_idx_f, m_i, l_i, acc, j, j < done, meta_row, k_head, v_head,
                    scratch, stride_kb, stride_ks, stride_vb, stride_vs,
                    block_tables_ptr, first_pos_ptr, valid_start_ptr, valid_end_ptr,
                    cos_sin_ptr, stride_cs, B, BLOCK_N, HALF, HALF_P, D, D_P, IS_NEOX, DOT_FP32, 1,
                )  # fmt: skip
            done = tl.maximum(done, hi)
            out = normalize(acc, l_i)
            ty = out_ptr.dtype.element_ty
            _store_tile(o_head, out.to(ty), f_hi, f0, D, D, ROWS, D_P)


@triton.jit
def _decode_kernel(
    q_ptr,
    out_ptr,
    part_ptr,
    lse_ptr,
    k_ptr,
    v_ptr,
    cos_sin_ptr,
    num_seqs,
    query_start_loc_ptr,
    query_pos_ptr,
    query_idx_ptr,
    block_tables_ptr,
    num_blocks_ptr,
    first_pos_ptr,
    valid_start_ptr,
    valid_end_ptr,
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
    qk_scale,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    B: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    D: tl.constexpr,
    D_P: tl.constexpr,
    IS_NEOX: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Persistent: work item = (sequence, KV head, split); rows = the GROUP heads of its query
    (padded to ``GROUP_P`` >= 16 rows for ``tl.dot``). Each page is seen once per work item. The
    query's position and index are scalar loads (a sequence has at most one query here)."""
    g = tl.arange(0, GROUP_P)
    num_work = num_seqs * NUM_KV_HEADS * NUM_SPLITS
    for w in range(tl.program_id(0), num_work, tl.num_programs(0)):
        split = w % NUM_SPLITS
        kv_head = (w // NUM_SPLITS) % NUM_KV_HEADS
        seq = w // (NUM_SPLITS * NUM_KV_HEADS)
        head0 = kv_head * GROUP
        row = tl.load(query_start_loc_ptr + seq)
        has_query = row < tl.load(query_start_loc_ptr + seq + 1)
        pos = tl.load(query_pos_ptr + row, mask=has_query, other=0)
        q_idx = tl.load(query_idx_ptr + row, mask=has_query, other=-1)
        n_heads = tl.where(has_query, GROUP, 0)
        q_row = q_ptr + row.to(tl.int64) * stride_qt + head0 * stride_qh
        q1, q2 = _rotated_q(
            q_row, n_heads, pos, cos_sin_ptr, stride_qh, stride_cs, qk_scale,
            GROUP_P, HALF, HALF_P, D, D_P, IS_NEOX,
        )  # fmt: skip
        if not DOT_FP32:
            q1 = q1.to(q_ptr.dtype.element_ty)
            q2 = q2.to(q_ptr.dtype.element_ty)
        q_idx_f = tl.zeros([GROUP_P], tl.float32) + q_idx.to(tl.float32)
        # Entries up to the query's own; none without a query (no negative integer division:
        # C truncation on the NPU, floor in the interpreter).
        nb = tl.where(q_idx >= 0, tl.minimum(tl.load(num_blocks_ptr + seq), q_idx // B + 1), 0)
        per_split = tl.cdiv(nb, NUM_SPLITS)
        lo = tl.minimum(split * per_split, nb)
        hi = tl.minimum(lo + per_split, nb)
        m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_P], tl.float32)
        acc = tl.zeros([GROUP_P, D_P], tl.float32) + (q_idx_f * 0.0)[:, None]  # see prefill
        for j in range(lo, hi):
            m_i, l_i, acc = _attend_entry(
                q1, q2, q_idx_f, m_i, l_i, acc, j, False, seq.to(tl.int64) * stride_bt,
                k_ptr + kv_head * stride_kh, v_ptr + kv_head * stride_vh, k_ptr,
                stride_kb, stride_ks, stride_vb, stride_vs,
                block_tables_ptr, first_pos_ptr, valid_start_ptr, valid_end_ptr,
                cos_sin_ptr, stride_cs, B, BLOCK_N, HALF, HALF_P, D, D_P, IS_NEOX, DOT_FP32, 0,
            )  # fmt: skip
        out = normalize(acc, l_i)
        if NUM_SPLITS == 1:
            o_row = out_ptr + row.to(tl.int64) * stride_ot + head0 * stride_oh
            ty = out_ptr.dtype.element_ty
            _store_tile(o_row, out.to(ty), n_heads, 0, stride_oh, D, GROUP_P, D_P)
        else:
            # Partials [T, Hq, NUM_SPLITS, D] and their log2-sum-exp [T, Hq, NUM_SPLITS] (fp32).
            part = (row.to(tl.int64) * (GROUP * NUM_KV_HEADS) + head0) * NUM_SPLITS + split
            _store_tile(part_ptr + part * D, out, n_heads, 0, NUM_SPLITS * D, D, GROUP_P, D_P)
            lse = log2_sum_exp(m_i, l_i)
            tl.store(lse_ptr + part + g * NUM_SPLITS, lse, mask=g < n_heads)


def prefill_items(
    query_start_loc: torch.Tensor, block_q: int, cores: int, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prefill work items (sequence, first row, end row): runs of consecutive query tiles.

    A run rotates each page it reaches once, so runs are as long as possible: one per sequence
    when ``sequences * num_kv_heads`` covers the cores, else sequences are cut into runs of equal
    tile counts until it does. Longest sequences' last runs (the most keys) come first. Built on
    the host from a CPU ``query_start_loc`` (this syncs on a device one).
    """
    loc = query_start_loc.to("cpu", torch.int64).tolist()
    tiles = [-(-(hi - lo) // block_q) for lo, hi in zip(loc, loc[1:], strict=False)]
    want = -(-cores // max(num_kv_heads, 1))
    busy = sum(1 for t in tiles if t)
    per_run = max(tiles, default=0) if busy >= want else max(1, -(-sum(tiles) // want))
    items = []
    for s, (lo, hi) in enumerate(zip(loc, loc[1:], strict=False)):
        for first in range(lo, hi, per_run * block_q):
            items.append((hi - lo, first, s, min(hi, first + per_run * block_q)))
    items.sort(reverse=True)
    cols = list(zip(*items, strict=True)) if items else [(), (), (), ()]
    return tuple(torch.tensor(c, dtype=torch.int32) for c in (cols[2], cols[1], cols[3]))


_CORES: dict[tuple[str, int], int] = {}


def num_cores(device: torch.device, kind: str = "num_aicore") -> int:
    """Programs to launch: the NPU's AI-core count (``tl.dot`` kernels run on the cube cores).

    Read from triton-ascend's driver (the property names vllm-ascend's ``triton_utils`` reads,
    UNVERIFIED here); interpreted kernels use ``INTERPRETER_CORES``.
    """
    if INTERPRETED or device.type != "npu":
        return INTERPRETER_CORES
    key = (kind, device.index or 0)
    if key not in _CORES:
        try:
            props = triton.runtime.driver.active.utils.get_device_properties(device.index or 0)
            _CORES[key] = int(props[kind])
        except (AttributeError, KeyError, TypeError, RuntimeError) as exc:
            logger.warning(
                "triton-ascend did not report %s (%s); assuming %d cores", kind, exc,
                DEFAULT_NPU_CORES,
            )  # fmt: skip
            _CORES[key] = DEFAULT_NPU_CORES
    return _CORES[key]


def decode_splits(cores: int, num_seqs: int, num_kv_heads: int, max_entries: int) -> int:
    """Splits per (sequence, KV head): enough work items to cover the cores, >= 2 entries each."""
    want = min(-(-cores // max(num_seqs * num_kv_heads, 1)), max(1, max_entries // 2), 32)
    return pow2_at_least(want, 1)


def check_supported(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: PagedRopeMetadata, rope: RopeSpec
) -> None:
    """Shapes and dtypes this kernel takes, and triton-ascend (the kernel's block pointers are
    not in upstream Triton); anything else raises before a launch."""
    check_layout(query, kv_cache)
    _, _, bs, hkv, d = kv_cache.shape
    if query.shape[2] != d or rope.cos_sin_cache.shape[-1] != d or d % 2:
        raise ValueError(
            f"head dims must agree and be even: query {query.shape[2]}, cache {d}, "
            f"cos_sin_cache {rope.cos_sin_cache.shape[-1]}"
        )
    if query.shape[1] % hkv:
        raise ValueError(f"query heads {query.shape[1]} must be a multiple of KV heads {hkv}")
    if bs != meta.block_size or bs < 16 or bs & (bs - 1) and bs % 64:
        raise ValueError(
            f"block size {bs} (metadata {meta.block_size}) must be a power of two >= 16 or a "
            "multiple of 64 (Ascend: 128)"
        )
    check_tensors(query, kv_cache, meta)
    if not ops.have_triton_ascend():
        raise RuntimeError(
            "the triton-ascend kernel needs triton-ascend (pip install triton-ascend==3.2.2; see "
            f"docs/ascend.md), not upstream Triton (triton {triton.__version__} here): its tiles "
            "are block pointers (tl.make_block_ptr), which upstream Triton removed"
        )
    if query.device.type != "npu" and not INTERPRETED:
        raise RuntimeError(
            f"the triton-ascend kernel needs NPU tensors (got {query.device}); set "
            "TRITON_INTERPRET=1 before importing triton to run it on CPU"
        )


@dataclass(frozen=True)
class Launch:
    """One kernel launch: ``kernel[grid](*args, **kwargs)``."""

    kernel: Any  # a triton JITFunction
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class LaunchPlan:
    """A call's launches, in order, the tensor they fill and what to run after them."""

    out: torch.Tensor
    launches: list[Launch]
    finish: Callable[[], None] | None = None


def _step_tensors(meta: PagedRopeMetadata, device: torch.device):
    """The metadata as device int32 tensors, built once per step (memoised on the metadata,
    which every layer of the step shares)."""
    key = ("ascend-triton", str(device))
    if key not in meta.memo:
        meta.memo[key] = tuple(int32(t, device) for t in meta.tensors())
    return meta.memo[key]


_PREFILL_SCRATCH: dict[tuple[str, int, torch.dtype], torch.Tensor] = {}


def reserve_prefill_scratch(
    device: torch.device, cores: int, max_keys: int, head: int, dtype: torch.dtype
) -> torch.Tensor:
    """Allocate the prefill kernel's rotated-K scratch (``[cores, max_keys, head]``) now.

    Why: vLLM sizes the KV cache from what its profiling run leaves, and that run skips
    attention, so a scratch allocated at the first prefill would be memory vLLM never counted
    (20 cores x 32k keys x head 128 in bfloat16 is 168 MB). The NPU runner calls this before the
    profiling run (``MepicNPUModelRunner.profile_run``) with ``max_keys`` covering a whole
    block-table row (``core.request_limits.table_width``); every step then takes views of it."""
    key = (str(device), head, dtype)
    have = _PREFILL_SCRATCH.get(key)
    if have is None or have.shape[0] < cores or have.shape[1] < max_keys:
        _PREFILL_SCRATCH.pop(key, None)
        have = _PREFILL_SCRATCH[key] = torch.empty(
            cores, max_keys, head, device=device, dtype=dtype
        )
        logger.info(
            "MEPIC triton-ascend prefill scratch (untested on hardware): %d cores x %d keys x "
            "%d (%s), %.1f MB on %s",
            cores, max_keys, head, dtype, have.numel() * have.element_size() / 1e6, device,
        )  # fmt: skip
    return have


def prefill_scratch(
    device: torch.device, cores: int, max_keys: int, head: int, dtype: torch.dtype
) -> torch.Tensor:
    """A ``[cores, max_keys, head]`` view of the reserved scratch; where none was reserved or it
    is too small (a table wider than the reserved row), a new one, with a warning on an NPU
    (then vLLM's memory profile did not count it)."""
    have = _PREFILL_SCRATCH.get((str(device), head, dtype))
    if have is None or have.shape[0] < cores or have.shape[1] < max_keys:
        if device.type == "npu":
            logger.warning(
                "MEPIC triton-ascend prefill: no reserved scratch for %d cores x %d keys x %d "
                "(%s); allocating one outside vLLM's memory profile", cores, max_keys, head, dtype,
            )  # fmt: skip
        have = reserve_prefill_scratch(device, cores, max_keys, head, dtype)
    return have[:cores, :max_keys]


def _prefill_step(
    meta: PagedRopeMetadata,
    device: torch.device,
    block_q: int,
    cores: int,
    hkv: int,
    group: int,
    head: int,
    dtype: torch.dtype,
):
    """The prefill work items, each row's query index (``[T * group]``: rows are (query, head)
    pairs) and the per-program rotated-K scratch, once per step."""
    key = ("ascend-triton-prefill", str(device), block_q, cores, hkv, group, head, dtype)
    if key not in meta.memo:
        seqs, lo, hi = prefill_items(meta.query_start_loc, block_q, cores, hkv)
        num_items = torch.tensor([seqs.numel()], dtype=torch.int32, device=device)
        row_q_idx = int32(meta.query_indices, device).repeat_interleave(group)
        max_keys = max(1, meta.max_num_blocks * meta.block_size)
        scratch = prefill_scratch(device, cores, max_keys, head, dtype)
        meta.memo[key] = (
            num_items, seqs.to(device), lo.to(device), hi.to(device), row_q_idx, scratch
        )  # fmt: skip
    return meta.memo[key]


def plan_launches(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: PagedRopeMetadata,
    rope: RopeSpec,
    scale: float,
    *,
    kernel: str | None = None,
    cores: int | None = None,
    block_q: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
    half_dots: bool | None = None,
) -> LaunchPlan:
    """The launches ``rope_paged_attention_ascend`` makes for these inputs, without running them:
    the compile test (``tests/ops/test_ascend_compile.py``) compiles exactly these, and the UB
    test reads their tiles.

    ``kernel`` forces ``"prefill"`` or ``"decode"`` (default: decode when every sequence has at
    most one query). ``cores``, ``block_q`` (queries per tile), ``block_n`` (keys per sub-tile)
    and ``num_splits`` override the launch choices (tests and benchmarks; the defaults come from
    ``choose_tiles``, within ``UB_BUDGET``). ``half_dots`` forces half-precision (True) or fp32
    (False) dots for fp16/bf16 inputs (default: see ``dots_in_fp32``).
    """
    if kernel not in (None, "prefill", "decode"):
        raise ValueError(f"kernel must be 'prefill' or 'decode', got {kernel!r}")
    device = query.device
    t, hq, d = query.shape
    bs, hkv = kv_cache.shape[2], kv_cache.shape[3]
    out = torch.empty_like(query)
    if t == 0:
        return LaunchPlan(out, [])
    if query.stride(-1) != 1:
        query = query.contiguous()
    k, v = kv_cache[0], kv_cache[1]
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("the KV cache's head dimension must be contiguous")
    decode = kernel == "decode" or (kernel is None and meta.max_query_len <= 1)
    if decode and meta.max_query_len > 1:
        raise ValueError(
            f"the decode kernel takes <= 1 query per sequence, not {meta.max_query_len}"
        )
    group = hq // hkv
    group_p = pow2_at_least(group, 1)
    dot_fp32 = dots_in_fp32(query.dtype, kv_cache.dtype, half_dots)
    cos_sin = rope.cos_sin_cache.to(device).contiguous()
    auto_q, auto_n = choose_tiles(d, group, bs, decode, bool(rope.is_neox_style))
    block_n = block_n or auto_n
    if block_n < 16 or block_n & (block_n - 1) or bs % block_n:
        raise ValueError(f"block_n {block_n} must be a power of two >= 16 dividing {bs}")
    block_q = block_q or auto_q
    if block_q & (block_q - 1):
        raise ValueError(f"block_q {block_q} must be a power of two")
    # tl.dot takes >= 16 rows (triton-ascend checks it even under its interpreter).
    block_q = max(block_q, 16 // group_p)
    cores = cores or num_cores(device)
    tables = _step_tensors(meta, device)
    half = d // 2
    common = dict(
        NUM_KV_HEADS=hkv,
        GROUP=group,
        GROUP_P=group_p,
        B=bs,
        BLOCK_N=block_n,
        HALF=half,
        HALF_P=pow2_at_least(half, 16),
        D=d,
        D_P=pow2_at_least(d, 16),
        IS_NEOX=bool(rope.is_neox_style),
        DOT_FP32=dot_fp32,
    )
    strides = launch_strides(query, out, k, v, tables[3], cos_sin)
    qk_scale = float(scale) * LOG2E

    if decode:
        splits = num_splits or decode_splits(cores, meta.num_seqs, hkv, meta.max_num_blocks)
        if splits & (splits - 1):
            raise ValueError(f"num_splits {splits} must be a power of two")
        part, lse = split_buffers(out, splits)
        work = meta.num_seqs * hkv * splits
        launches = [Launch(
            _decode_kernel, (min(cores, work),),
            (query, out, part, lse, k, v, cos_sin, meta.num_seqs, *tables, *strides, qk_scale),
            dict(NUM_SPLITS=splits, **{**common, "GROUP_P": pow2_at_least(group, 16)}),
        )]  # fmt: skip
        if splits > 1:
            launches.append(Launch(
                combine_kernel, (min(cores * 2, t * hq),),
                (part, lse, out, t, out.stride(0), out.stride(1)),
                dict(NUM_HEADS=hq, NUM_SPLITS=splits, D=d, D_P=common["D_P"]),
            ))  # fmt: skip
        return LaunchPlan(out, launches)

    dot_dtype = torch.float32 if dot_fp32 else query.dtype
    num_items, seqs, lo, hi, row_q_idx, scratch = _prefill_step(
        meta, device, block_q, cores, hkv, group, d, dot_dtype
    )
    # Rotated, pre-scaled queries and the output in (KV head, query, head) row order.
    q_rot = torch.empty(hkv, t * group, d, device=device, dtype=dot_dtype)
    out_rows = torch.empty(hkv, t * group, d, device=device, dtype=query.dtype)
    rope_q = {k: common[k] for k in ("NUM_KV_HEADS", "GROUP", "HALF", "HALF_P", "D", "D_P",
                                     "IS_NEOX")}  # fmt: skip
    launches = [
        Launch(
            _rope_q_kernel, (min(cores * 2, t * hkv),),
            (query, q_rot, cos_sin, tables[1], t, query.stride(0), query.stride(1),
             cos_sin.stride(0), qk_scale),
            dict(GROUP_P=pow2_at_least(group, 1), **rope_q),
        ),
        Launch(
            _prefill_kernel, (cores,),
            (q_rot, out_rows, k, v, cos_sin, scratch, num_items, seqs, lo, hi, row_q_idx,
             *tables[3:], t, *strides[4:], scratch.stride(0)),
            dict(ROWS=block_q * group_p, **{k: v for k, v in common.items() if k != "GROUP_P"}),
        ),
    ]  # fmt: skip

    def finish() -> None:
        out.copy_(out_rows.view(hkv, t, group, d).transpose(0, 1).reshape(t, hq, d))

    return LaunchPlan(out, launches, finish)


def rope_paged_attention_ascend(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: PagedRopeMetadata,
    rope: RopeSpec,
    scale: float,
    **launch_options,
) -> torch.Tensor:
    """Fused-RoPE paged attention for Ascend; same contract and result as the torch reference.

    ``launch_options`` (``kernel``, ``cores``, ``block_q``, ``block_n``, ``num_splits``,
    ``half_dots``) override the launch choices: see ``plan_launches``.
    """
    check_supported(query, kv_cache, meta, rope)
    plan = plan_launches(query, kv_cache, meta, rope, scale, **launch_options)
    for launch in plan.launches:
        launch.kernel[launch.grid](*launch.args, **launch.kwargs)
    if plan.finish is not None:
        plan.finish()
    return plan.out
