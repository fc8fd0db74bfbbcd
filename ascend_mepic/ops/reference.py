"""Torch reference of the op contract; runs on any device and is the CPU serving path.

Per step, once for every layer: each sequence's real key slots (pad slots dropped), their
logical positions' cos/sin, and the causal mask in padded-index order. Single-query sequences
that see every key (decode) form one padded batch, planned with array operations over all of
them and run as one SDPA per layer; the other sequences (prefill) are planned and run one by one.
Per layer: gather K/V, rotate K and Q, ``scaled_dot_product_attention`` with native GQA.
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


def _sequence_plan(
    meta: PagedRopeMetadata, rope: RopeSpec, s: int, q0: int, q1: int, n: int, device
) -> _SequencePlan:
    """One sequence's keys, cos/sin and mask (sequences outside the decode batch)."""
    bs = meta.block_size
    slot = torch.arange(bs, device=device)
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
    return _SequencePlan(
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


@dataclass(frozen=True)
class _DecodeBatch:
    """Single-query sequences that see all their keys, padded to one length: one SDPA per layer
    instead of one per sequence (decode steps of many requests)."""

    rows: torch.Tensor  # [N] query row of each sequence
    blocks: torch.Tensor  # [N, L] block id of each key (padding: the sequence's first key)
    offsets: torch.Tensor  # [N, L]
    key_cos: torch.Tensor  # [N, L, 1, D/2]
    key_sin: torch.Tensor
    query_cos: torch.Tensor  # [N, 1, D/2]
    query_sin: torch.Tensor
    mask: torch.Tensor | None  # [N, 1, 1, L] bool (None: no padding)


def _decode_batch(
    meta: PagedRopeMetadata, rope: RopeSpec, device: torch.device
) -> tuple[_DecodeBatch | None, torch.Tensor]:
    """The decode batch (at least two single-query sequences that see every key of theirs),
    built with array operations over all of them, and which sequences it holds ``[S]``."""
    bs = meta.block_size
    held = torch.zeros(meta.num_seqs, dtype=torch.bool, device=device)
    loc = meta.query_start_loc.long()
    seqs = ((loc[1:] - loc[:-1]) == 1).nonzero().squeeze(1)
    if len(seqs) < 2:
        return None, held
    nblocks = meta.num_blocks[seqs].long()
    width = int(nblocks.max())
    entry = torch.arange(width, device=device)
    slot = torch.arange(bs, device=device)
    start = meta.block_valid_start[seqs, :width, None].long()
    listed = (entry[None, :] < nblocks[:, None])[:, :, None]
    real = (listed & (slot >= start) & (slot < meta.block_valid_end[seqs, :width, None])).flatten(1)
    rows = loc[seqs]
    later = torch.arange(width * bs, device=device)[None, :] > meta.query_indices[rows, None]
    lengths = real.sum(1)
    batched = ~(real & later).any(1) & (lengths > 0)
    if int(batched.sum()) < 2:
        return None, held
    seqs, real, lengths, rows = seqs[batched], real[batched], lengths[batched], rows[batched]
    longest = int(lengths.max())
    # Each sequence's real keys in padded order, padded with its first key.
    owner, index = real.nonzero(as_tuple=True)
    order = (real.cumsum(1) - 1)[owner, index]
    keys = index[torch.cumsum(lengths, 0) - lengths][:, None].repeat(1, longest)
    keys[owner, order] = index
    entries = keys // bs
    offsets = keys % bs
    blocks = meta.block_tables[seqs].long().gather(1, entries)
    first = meta.block_first_pos[seqs].long().gather(1, entries)
    pos = first + offsets - meta.block_valid_start[seqs].long().gather(1, entries)
    kcos, ksin = _cos_sin(rope, pos.flatten())
    qcos, qsin = _cos_sin(rope, meta.query_positions[rows])
    mask = None
    if bool((lengths < longest).any()):
        mask = (torch.arange(longest, device=device)[None, :] < lengths[:, None])[:, None, None]
    held[seqs] = True
    shape = (len(seqs), longest, *kcos.shape[1:])
    batch = _DecodeBatch(
        rows, blocks, offsets, kcos.reshape(shape), ksin.reshape(shape), qcos, qsin, mask
    )
    return batch, held


def _step_plans(
    meta: PagedRopeMetadata, rope: RopeSpec, device: torch.device
) -> tuple[_DecodeBatch | None, list[_SequencePlan]]:
    """What every layer of a step needs, once per step: the decode batch, and a plan for each
    other sequence with queries (prefill: the only per-sequence Python work)."""
    if "reference_step" in meta.memo:
        return meta.memo["reference_step"]
    batch, held = _decode_batch(meta, rope, device)
    loc = meta.query_start_loc
    alone = ((loc[1:] > loc[:-1]) & ~held).nonzero().squeeze(1).tolist()
    bounds, nblocks = loc.tolist(), meta.num_blocks.tolist()
    plans = [
        _sequence_plan(meta, rope, s, bounds[s], bounds[s + 1], nblocks[s], device) for s in alone
    ]
    meta.memo["reference_step"] = (batch, plans)
    return batch, plans


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
    batch, plans = _step_plans(meta, rope, query.device)
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
