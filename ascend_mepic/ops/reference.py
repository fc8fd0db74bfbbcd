"""Torch reference of the op contract; runs on any device and is the CPU serving path.

Vectorized per sequence (a Python loop over sequences, never over tokens): gather the sequence's
KV blocks, drop pad slots, rotate K at each key's logical position, rotate Q, and run
``scaled_dot_product_attention`` with a causal mask in padded-index order and native GQA.
Single-query sequences that see every key (decode) are batched into one padded SDPA per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ascend_mepic.ops.metadata import PagedRopeMetadata
from ascend_mepic.ops.rope import RopeSpec


def write_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store un-rotated K and V ``[N, Hkv, D]`` at flat slots ``block * B + offset`` (< 0: skip)."""
    block_size = kv_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[0][blocks, offsets] = key[keep].to(kv_cache.dtype)
    kv_cache[1][blocks, offsets] = value[keep].to(kv_cache.dtype)


def gather_sequence_keys(
    kv_cache: torch.Tensor, meta: PagedRopeMetadata, seq: int, num_blocks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Real keys of one sequence: (K, V) ``[L, Hkv, D]``, their positions and padded indices."""
    bs = meta.block_size
    ids = meta.block_tables[seq, :num_blocks].long()
    _, _, _, hkv, d = kv_cache.shape
    k = kv_cache[0].index_select(0, ids).reshape(num_blocks * bs, hkv, d)
    v = kv_cache[1].index_select(0, ids).reshape(num_blocks * bs, hkv, d)
    slot = torch.arange(bs, device=kv_cache.device)
    start = meta.block_valid_start[seq, :num_blocks, None]
    end = meta.block_valid_end[seq, :num_blocks, None]
    real = ((slot >= start) & (slot < end)).flatten()
    pos = (meta.block_first_pos[seq, :num_blocks, None] + slot - start).flatten()
    index = torch.arange(num_blocks * bs, device=kv_cache.device)
    keep = real.nonzero().squeeze(1)
    return k[keep], v[keep], pos[keep], index[keep]


@dataclass(frozen=True)
class _SequencePlan:
    """What every layer of a step needs for one sequence; computed once per step."""

    q_rows: slice
    blocks: torch.Tensor  # [L] block id of each real key
    offsets: torch.Tensor  # [L] slot of each real key
    key_cos: torch.Tensor  # [L, 1, D/2] float32
    key_sin: torch.Tensor
    query_cos: torch.Tensor  # [Tq, 1, D/2]
    query_sin: torch.Tensor
    mask: torch.Tensor | None  # [Tq, L] bool, True = attend; None: attend to every key
    is_causal: bool  # the mask is exactly SDPA's causal mask (a plain prefill from 0)


def _cos_sin(rope: RopeSpec, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = rope.cos_sin_cache.index_select(0, positions.long()).float().chunk(2, dim=-1)
    return cos[:, None, :], sin[:, None, :]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    xf = x.float()
    if neox:  # written into one output, with fused multiply-adds: the decode hot path
        half = x.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        out = torch.empty_like(xf)
        lo, hi = out[..., :half], out[..., half:]
        torch.mul(x1, cos, out=lo).addcmul_(x2, sin, value=-1)
        torch.mul(x2, cos, out=hi).addcmul_(x1, sin)
        return out.to(x.dtype)
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return out.to(x.dtype)


def _plans(meta: PagedRopeMetadata, rope: RopeSpec, device: torch.device) -> list[_SequencePlan]:
    if "reference_plans" in meta.memo:
        return meta.memo["reference_plans"]
    bs = meta.block_size
    loc = meta.query_start_loc.tolist()
    nblocks = meta.num_blocks.tolist()
    slot = torch.arange(bs, device=device)
    plans = []
    for s in range(meta.num_seqs):
        q0, q1 = loc[s], loc[s + 1]
        if q0 == q1:
            continue
        n = nblocks[s]
        start = meta.block_valid_start[s, :n, None]
        real = ((slot >= start) & (slot < meta.block_valid_end[s, :n, None])).flatten()
        keep = real.nonzero().squeeze(1)
        pos = (meta.block_first_pos[s, :n, None] + slot - start).flatten()[keep]
        kcos, ksin = _cos_sin(rope, pos)
        qcos, qsin = _cos_sin(rope, meta.query_positions[q0:q1])
        mask: torch.Tensor | None = keep[None, :] <= meta.query_indices[q0:q1, None]
        # SDPA is much faster without an explicit mask: use none when every key is visible
        # (decode), its own causal mask when the queries are exactly the keys in order.
        is_causal = False
        if bool(mask.all()):
            mask = None
        elif q1 - q0 == len(keep) and torch.equal(mask, torch.ones_like(mask).tril()):
            mask, is_causal = None, True
        plans.append(
            _SequencePlan(
                slice(q0, q1),
                meta.block_tables[s, :n].long()[keep // bs],
                keep % bs,
                kcos,
                ksin,
                qcos,
                qsin,
                mask,
                is_causal,
            )
        )
    meta.memo["reference_plans"] = plans
    return plans


@dataclass(frozen=True)
class _DecodeBatch:
    """Single-query sequences that see all their keys, padded to one length: one SDPA per layer
    instead of one per sequence (decode steps of many requests)."""

    rows: torch.Tensor  # [N] query row of each sequence
    blocks: torch.Tensor  # [N, L] block id of each key (padding: any valid slot)
    offsets: torch.Tensor  # [N, L]
    key_cos: torch.Tensor  # [N, L, 1, D/2]
    key_sin: torch.Tensor
    query_cos: torch.Tensor  # [N, 1, D/2]
    query_sin: torch.Tensor
    mask: torch.Tensor | None  # [N, 1, 1, L] bool (None: no padding)


def _split_decode(
    meta: PagedRopeMetadata, plans: list[_SequencePlan]
) -> tuple[_DecodeBatch | None, list[_SequencePlan]]:
    """Batch the plans of single-query sequences without a mask; the rest run one by one."""
    if "reference_decode" in meta.memo:
        return meta.memo["reference_decode"]
    single: list[_SequencePlan] = []
    rest: list[_SequencePlan] = []
    for p in plans:
        (single if p.q_rows.stop - p.q_rows.start == 1 and p.mask is None else rest).append(p)
    if len(single) < 2:
        meta.memo["reference_decode"] = (None, plans)
        return None, plans
    lengths = [len(p.blocks) for p in single]
    longest = max(lengths)

    def pad(x: torch.Tensor) -> torch.Tensor:
        fill = x[:1].expand(longest - len(x), *x.shape[1:])
        return torch.cat((x, fill)) if len(x) < longest else x

    batch = _DecodeBatch(
        rows=torch.tensor([p.q_rows.start for p in single], device=single[0].blocks.device),
        blocks=torch.stack([pad(p.blocks) for p in single]),
        offsets=torch.stack([pad(p.offsets) for p in single]),
        key_cos=torch.stack([pad(p.key_cos) for p in single]),
        key_sin=torch.stack([pad(p.key_sin) for p in single]),
        query_cos=torch.cat([p.query_cos for p in single]),
        query_sin=torch.cat([p.query_sin for p in single]),
        mask=None
        if min(lengths) == longest
        else (
            torch.arange(longest, device=single[0].blocks.device)[None, :]
            < torch.tensor(lengths, device=single[0].blocks.device)[:, None]
        )[:, None, None, :],
    )
    meta.memo["reference_decode"] = (batch, rest)
    return batch, rest


def rope_paged_attention_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: PagedRopeMetadata,
    rope: RopeSpec,
    scale: float,
) -> torch.Tensor:
    """Attention over un-rotated paged KV with RoPE applied at read time; returns ``[T, Hq, D]``.

    Per step (memoized on ``meta``): each sequence's real key slots, their positions' cos/sin and
    the causal mask. Per layer: gather K/V, rotate, SDPA with native GQA.
    """
    out = torch.empty_like(query)
    neox = rope.is_neox_style
    batch, plans = _split_decode(meta, _plans(meta, rope, query.device))
    if batch is not None:
        k = _rotate(kv_cache[0][batch.blocks, batch.offsets], batch.key_cos, batch.key_sin, neox)
        v = kv_cache[1][batch.blocks, batch.offsets]
        q = _rotate(query[batch.rows], batch.query_cos, batch.query_sin, neox)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [N, Hq, 1, D]
            k.to(q.dtype).transpose(1, 2),  # [N, Hkv, L, D]
            v.to(q.dtype).transpose(1, 2),
            attn_mask=batch.mask,
            scale=scale,
            enable_gqa=True,
        )
        out[batch.rows] = o.squeeze(2)
    for plan in plans:
        k = kv_cache[0][plan.blocks, plan.offsets]
        v = kv_cache[1][plan.blocks, plan.offsets]
        q = _rotate(query[plan.q_rows], plan.query_cos, plan.query_sin, neox)
        k = _rotate(k, plan.key_cos, plan.key_sin, neox)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.to(q.dtype).transpose(0, 1).unsqueeze(0),
            v.to(q.dtype).transpose(0, 1).unsqueeze(0),
            attn_mask=plan.mask,
            is_causal=plan.is_causal,
            scale=scale,
            enable_gqa=True,
        )
        out[plan.q_rows] = o.squeeze(0).transpose(0, 1)
    return out
