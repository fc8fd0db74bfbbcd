"""FROZEN BASELINE, for benchmarks only: the CUDA Triton kernels as they were before issue 49.

This is ``cuda_fallback/rope_paged_attention.py`` at commit 3f78b9a, whose kernels are the ones
timed on an H100 (docs/results.md): K/V loads under a data-dependent branch (never pipelined),
one query head per prefill program, every tile causally masked, empty tiles visited. Kept so that
``bench_triton_gpu.py`` can time old and new on the same card in one run (issue 49, deliverable
5). Not imported by the package; not maintained; delete once that comparison is recorded.
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
def _attend_kv(
    q1,
    q2,
    q_idx,
    m_i,
    l_i,
    acc,
    seq,
    nb,
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
):
    """Online softmax of pre-scaled, rotated queries over KV tiles ``[tile_lo, tile_hi)``.

    Tile ``t`` holds the keys of padded index ``t * BLOCK_N + n``: part of one block when
    ``BLOCK_N <= B``, several whole blocks otherwise, so the tile size does not depend on ``B``.
    Tiles without a real key are skipped (packed tables have entries with short valid ranges).
    """
    n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, D_P)
    meta_row = seq.to(tl.int64) * stride_bt
    for t in range(tile_lo, tile_hi):
        idx = t * BLOCK_N + n
        j = idx // B
        slot = idx % B
        in_seq = j < nb
        blk = tl.load(block_tables_ptr + meta_row + j, mask=in_seq, other=0).to(tl.int64)
        first = tl.load(first_pos_ptr + meta_row + j, mask=in_seq, other=0)
        v_start = tl.load(valid_start_ptr + meta_row + j, mask=in_seq, other=0)
        v_end = tl.load(valid_end_ptr + meta_row + j, mask=in_seq, other=0)
        real = in_seq & (slot >= v_start) & (slot < v_end)
        # Skip a tile with no real key (a short run of a packed table's entry): no loads, no
        # dots. The decode path gets the same skip, so it stays one pass over the real keys.
        if tl.max(real.to(tl.int32), 0) > 0:
            k_rows = k_ptr + blk * stride_kb + slot.to(tl.int64) * stride_ks + k_off
            k1, k2 = _load_halves(
                k_rows, first + slot - v_start, real, cos_sin_ptr, stride_cs,
                HALF, HALF_P, IS_NEOX, APPLY_ROPE,
            )  # fmt: skip
            s = half_scores(q1, q2, k1, k2, DOT_FP32)
            allowed = real[None, :] & (idx[None, :] <= q_idx[:, None])
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
    """One tile of ``BLOCK_M`` queries of one sequence, one query head."""
    tile = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    row0 = tl.load(tile_row_ptr + tile)
    row_end = tl.load(query_start_loc_ptr + seq + 1)
    rows = row0 + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    pos = tl.load(query_pos_ptr + rows, mask=row_mask, other=0)
    q_idx = tl.load(query_idx_ptr + rows, mask=row_mask, other=-1)
    q_rows = q_ptr + rows.to(tl.int64) * stride_qt + head * stride_qh
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
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_P], tl.float32)
    m_i, l_i, acc = _attend_kv(
        q1, q2, q_idx, m_i, l_i, acc, seq, nb, 0, num_tiles,
        k_ptr, v_ptr, stride_kb, stride_ks, stride_vb, stride_vs,
        (head // GROUP) * stride_kh, (head // GROUP) * stride_vh,
        block_tables_ptr, first_pos_ptr, valid_start_ptr, valid_end_ptr, stride_bt,
        cos_sin_ptr, stride_cs, B, BLOCK_N, HALF, HALF_P, D, D_P, IS_NEOX, APPLY_ROPE, DOT_FP32,
    )  # fmt: skip
    out = normalize(acc, l_i)
    d = tl.arange(0, D_P)
    o_rows = out_ptr + rows.to(tl.int64) * stride_ot + head * stride_oh
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
    per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * per_split
    tile_hi = tl.minimum(tile_lo + per_split, num_tiles)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D_P], tl.float32)
    m_i, l_i, acc = _attend_kv(
        q1, q2, q_idx, m_i, l_i, acc, seq, nb, tile_lo, tile_hi,
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


def launch_config(decode: bool, block_size: int, max_query_len: int) -> Launch:
    """Default tiles and launch for a call, chosen by ``bench_triton_gpu.py --sweep`` on an H100
    (bf16, 32/8 heads, head 128 only; docs/results.md).

    Decode: 2 warps and 3 stages, 1.31-1.36x faster than 4 warps and 2 stages at 8k-32k keys.
    Prefill: 128 x 32 tiles, 1.20-1.49x faster than 64 x 64 at 2k-32k prompts where a tile is part
    of a block (block size >= 64); at block size 16 they were not better (0.93x at 2k), and MEPIC's
    few recomputed rows per chunk would waste most of a 128-row tile, so 64 x 64 stays there. The
    interpreter's cost is per tile, not per key, so it takes 128-key tiles.
    """
    if INTERPRETED:
        return Launch(64, 128, 4, 2)
    if decode:
        return Launch(64, 64, 2, 3)
    if block_size >= 64 and max_query_len >= 1024:
        return Launch(128, 32, 4, 2)
    return Launch(64, 64, 4, 2)


def prefill_tiles(
    query_start_loc: torch.Tensor, block_m: int = 64, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefill grid's map tile -> (sequence, first query row), heaviest (last) tiles first.

    Built on the host (it sets the grid size). From a device ``query_start_loc`` this syncs, so a
    runner should build it once per step from its CPU copy and pass it to every layer's call.
    """
    loc = query_start_loc.to("cpu", torch.int64)
    counts = loc[1:] - loc[:-1]
    per_seq = (counts + block_m - 1) // block_m
    seqs = torch.repeat_interleave(torch.arange(counts.numel()), per_seq)
    first_tile = torch.cumsum(per_seq, 0) - per_seq
    within = torch.arange(seqs.numel()) - first_tile[seqs]
    rows = loc[seqs] + within * block_m
    target = query_start_loc.device if device is None else device
    return seqs.flip(0).to(target, torch.int32), rows.flip(0).to(target, torch.int32)


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
    ``meta.max_query_len <= 1``, trusted as given). ``tiles`` is ``prefill_tiles(loc, block_m)``
    precomputed with the same ``block_m`` (else built here once per ``meta``, a host sync).
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
    cfg = launch_config(decode, bs, meta.max_query_len)
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
    strides = launch_strides(query, out, k, v, tables, cos_sin)
    qk_scale = float(scale) * LOG2E
    group = hq // hkv
    metas = (loc, q_pos, q_idx, tables, nblocks, first, vstart, vend)

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
    if tiles is None:  # built once per step (it syncs): every layer shares ``meta``
        key = ("triton-prefill-tiles", block_m, device)
        tiles = meta.memo.get(key)
        if tiles is None:
            tiles = meta.memo[key] = prefill_tiles(meta.query_start_loc, block_m, device)
    tile_seq, tile_row = (int32(x, device) for x in tiles)
    launch = KernelLaunch(
        _prefill_kernel,
        (tile_seq.numel(), hq),
        (query, out, k, v, cos_sin, tile_seq, tile_row, *metas, *strides, qk_scale),
        dict(GROUP=group, BLOCK_M=block_m, **common, num_warps=num_warps, num_stages=num_stages),
    )
    return out, [launch]
