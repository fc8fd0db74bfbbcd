"""The triton-ascend kernels of ``ascend_mepic.ops.triton_ascend`` (which plans and launches
them): the prefill query-rotation prologue, the prefill and split-decode attention kernels and
their tile helpers. UNTESTED ON HARDWARE.

What differs from the GPU kernel, and why (triton-ascend's migration and performance guides, the
forms vllm-ascend 0.30.0rc2's own Triton kernels use, ``vllm_ascend/ops/triton/``, and what
bishengir-compile places in the unified buffer):

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
* **Split-KV decode.** One query per sequence leaves cores idle when the batch is small, so the
  block table is split into ``num_splits`` ranges (from the core count), each writing a partial
  output and its log2-sum-exp; a combine kernel merges them.

Scores are ``q.k = q1.k1 + q2.k2`` on the rotated halves, online softmax in fp32 with exp2; dots
take fp32 or the input's half dtype with fp32 accumulation. Under an interpreter bf16 dots fall
back to fp32 unless ``half_dots=True`` (Triton's interpreter multiplies bf16's raw bits; the tests
patch it to upcast), fp16 dots run as on the NPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ascend_mepic.ops.triton_common import (
    half_scores,
    log2_sum_exp,
    normalize,
    rotate,
    softmax_step,
)


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
        # A constant zero here (not prefill's loaded one): with it the compiler plans GPT-J decode
        # at head 256 at 78% of UB, with the loaded one at 99.8%.
        acc = tl.zeros([GROUP_P, D_P], tl.float32)
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
