"""Fused read-time RoPE attention for Ascend 910B, composed from documented torch_npu ops.

UNTESTED ON HARDWARE: this path has never run on an Ascend 910B; it is checked only against a torch
test double of the documented torch_npu semantics.

Per sequence (a host loop over sequences, never over tokens): gather the sequence's K/V blocks
from the NoPE cache with ``index_select``, rotate K at each slot's logical position and Q at its
own with ``torch_npu.npu_rotary_mul``, and run ``torch_npu.npu_fused_infer_attention_score`` with a
boolean mask that hides pad slots and keys after the query in padded order. Pads are masked, not
dropped (and zeroed, since they may hold NaN): the key length stays ``num_blocks * block_size``
(16-aligned, as the op prefers) and no data-dependent shape or host sync is needed per sequence.

Assumed torch_npu semantics (op-plugin docs ``torch_npu-npu_rotary_mul.md`` and
``torch_npu-npu_fused_infer_attention_score.md``, Atlas A2 = 910B):

``npu_rotary_mul(input, r1, r2, rotary_mode="half") -> Tensor``
    ``output = r1 * input + r2 * rotate(input)`` with ``rotate`` = ``cat(-x2, x1)`` of the two
    halves ("half", neox) or the pairwise ``(-x_odd, x_even)`` interleave ("interleave", GPT-J).
    ``input``, ``r1``, ``r2`` are 4-D, float16/bfloat16/float32, same shape as ``input`` out.
    We use layout BSND ``[1, S, N, D]`` with ``r1 = cos``, ``r2 = sin`` as ``[1, S, 1, D]`` (1S1D,
    the one form both modes accept); cos/sin are the half-width cache values repeated twice
    (``cat(c, c)``) for "half" and pairwise (``repeat_interleave(2)``) for "interleave". GPT-J
    uses the documented ``rotary_mode="interleave"`` (present in current torch_npu; older
    releases had only "half"). Limits: D even and < 896, B*N < 1000.

``npu_fused_infer_attention_score(query, key, value, *, atten_mask, num_heads, scale,
input_layout, num_key_value_heads, sparse_mode, inner_precise, ...) -> (attention_out,
softmax_lse)``
    softmax(scale * Q K^T, masked) V. Layout "BSND": query ``[B, Q_S, num_heads, D]``, key/value
    ``[B, KV_S, num_key_value_heads, D]`` (GQA: query head h reads KV head
    ``h // (num_heads / num_key_value_heads)``, ratio <= 64); ``attention_out`` has the query's
    shape and dtype. Q/K/V must be contiguous float16/bfloat16 (no float32 on A2; D 16-aligned,
    <= 512; N <= 256). ``atten_mask`` is bool, **True = masked out** (1 means "does not take
    part"); with ``sparse_mode=0`` it is the full matrix, here ``[1, 1, Q_S, KV_S]`` (documented
    for Q_S > 1 as (B, 1, Q_S, KV_S) and for Q_S == 1 as (B, 1, 1, KV_S)). ``inner_precise=2``
    (high precision with invalid-row correction, advised for custom masks when Q_S > 1); Q_S == 1
    accepts only 0/1, so decode passes 0. ``softmax_lse`` is a placeholder unless
    ``softmax_lse_flag``; it is ignored. The keyword is ``scale`` (older releases: ``scale_value``).

Float32 queries are rotated in float32 and attended in ``FIA_FALLBACK_DTYPE`` (bfloat16), since the
fused op takes only half precision on A2; the result is cast back.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Protocol

import torch

from ascend_mepic.ops.metadata import PagedRopeMetadata
from ascend_mepic.ops.rope import RopeSpec

# Dtypes npu_fused_infer_attention_score takes for query/key/value on Atlas A2 (910B).
FIA_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
FIA_FALLBACK_DTYPE = torch.bfloat16
FIA_MAX_GQA_RATIO = 64
FIA_MAX_HEADS = 256
FIA_MAX_HEAD_DIM = 512


class NpuUnavailableError(ImportError):
    """torch_npu (and the CANN toolkit behind it) is not usable in this process."""


class NpuOps(Protocol):
    """The two torch_npu entry points this module calls (torch_npu itself, or a test double)."""

    def npu_rotary_mul(
        self, input: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = ...
    ) -> torch.Tensor: ...

    def npu_fused_infer_attention_score(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def _torch_npu() -> ModuleType:
    """Import torch_npu lazily, so that this module imports on machines without CANN."""
    try:
        import torch_npu
    except (ImportError, OSError) as exc:
        raise NpuUnavailableError(
            "the Ascend attention path (ASCEND_MEPIC_ATTN_IMPL=npu) needs torch_npu with the CANN "
            f"toolkit on an Ascend NPU (910B); importing torch_npu failed: {type(exc).__name__}: "
            f"{exc}. Elsewhere use ASCEND_MEPIC_ATTN_IMPL=reference or triton."
        ) from exc
    return torch_npu


def get_npu_ops() -> NpuOps:
    """The torch_npu implementation; tests replace this function with one returning a double."""
    return _torch_npu()  # type: ignore[return-value]


def check_npu_supported(num_heads: int, num_kv_heads: int, head_size: int) -> None:
    """Reject shapes outside the documented limits before launching anything on the device."""
    problems = []
    if num_heads % num_kv_heads or num_heads // num_kv_heads > FIA_MAX_GQA_RATIO:
        problems.append(
            f"query heads {num_heads} must be a multiple of KV heads {num_kv_heads} "
            f"with ratio <= {FIA_MAX_GQA_RATIO}"
        )
    if num_heads > FIA_MAX_HEADS:
        problems.append(f"query heads {num_heads} > {FIA_MAX_HEADS}")
    if head_size % 16 or head_size > FIA_MAX_HEAD_DIM:
        problems.append(f"head size {head_size} must be a multiple of 16 and <= {FIA_MAX_HEAD_DIM}")
    if problems:
        raise ValueError("unsupported by the torch_npu composition: " + "; ".join(problems))


def _cos_sin(
    cache: torch.Tensor, positions: torch.Tensor, neox: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-width cos/sin ``[1, S, 1, D]`` (1S1D) in the layout ``rotary_mode`` expects."""
    cos, sin = cache.index_select(0, positions.long()).chunk(2, dim=-1)
    if neox:
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    else:
        cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    return cos[None, :, None, :].contiguous(), sin[None, :, None, :].contiguous()


def _rotate(
    ops: NpuOps, x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor, neox: bool
) -> torch.Tensor:
    """Rotate BSND ``x`` ``[1, S, N, D]`` at ``positions`` ``[S]`` in float32."""
    cos, sin = _cos_sin(cache, positions, neox)
    mode = "half" if neox else "interleave"
    return ops.npu_rotary_mul(x.float().contiguous(), cos, sin, rotary_mode=mode)


def rope_paged_attention_npu(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: PagedRopeMetadata,
    rope: RopeSpec,
    scale: float,
) -> torch.Tensor:
    """Attention over un-rotated paged KV with RoPE fused at read time; returns ``[T, Hq, D]``."""
    ops = get_npu_ops()
    _, hq, d = query.shape
    _, _, bs, hkv, _ = kv_cache.shape
    check_npu_supported(hq, hkv, d)
    attn_dtype = query.dtype if query.dtype in FIA_DTYPES else FIA_FALLBACK_DTYPE
    device = kv_cache.device
    cache = rope.cos_sin_cache.to(device=device, dtype=torch.float32)
    neox = rope.is_neox_style
    max_pos = rope.max_position - 1
    slot = torch.arange(bs, device=device, dtype=torch.int32)
    out = torch.empty_like(query)
    loc = meta.query_start_loc.tolist()
    nblocks = meta.num_blocks.tolist()
    for s in range(meta.num_seqs):
        q0, q1, nb = loc[s], loc[s + 1], nblocks[s]
        if q0 == q1:
            continue
        ids = meta.block_tables[s, :nb].long()
        start = meta.block_valid_start[s, :nb, None]
        real = ((slot >= start) & (slot < meta.block_valid_end[s, :nb, None])).flatten()
        # Pad slots may hold anything, NaN included (never-written blocks); a masked score still
        # multiplies its V by 0, and 0 * NaN is NaN, so zero them in the gathered copy.
        keep = real.view(1, nb * bs, 1, 1)
        k = torch.where(keep, kv_cache[0].index_select(0, ids).reshape(1, nb * bs, hkv, d), 0)
        v = torch.where(keep, kv_cache[1].index_select(0, ids).reshape(1, nb * bs, hkv, d), 0)
        # Pad slots get a clamped in-range position; the mask hides them anyway.
        kpos = (meta.block_first_pos[s, :nb, None] + slot - start).flatten().clamp(0, max_pos)
        k = _rotate(ops, k, kpos, cache, neox).to(attn_dtype).contiguous()
        q = _rotate(ops, query[None, q0:q1], meta.query_positions[q0:q1], cache, neox)
        q = q.to(attn_dtype).contiguous()
        kidx = torch.arange(nb * bs, device=device)
        masked = ~real[None, :] | (kidx[None, :] > meta.query_indices[q0:q1, None].long())
        attn, _ = ops.npu_fused_infer_attention_score(
            q,
            k,
            v.to(attn_dtype).contiguous(),
            atten_mask=masked[None, None].contiguous(),
            num_heads=hq,
            num_key_value_heads=hkv,
            scale=scale,
            input_layout="BSND",
            sparse_mode=0,
            inner_precise=2 if q1 - q0 > 1 else 0,
        )
        out[q0:q1] = attn[0].to(query.dtype)
    return out
