"""Torch reference of the op contract; runs on any device and is the CPU serving path.

Vectorized per sequence (a Python loop over sequences, never over tokens): gather the sequence's
KV blocks, drop pad slots, rotate K at each key's logical position, rotate Q, and run
``scaled_dot_product_attention`` with a causal mask in padded-index order and native GQA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ascend_mepic.ops.metadata import PagedRopeMetadata
from ascend_mepic.ops.rope import RopeSpec, apply_rope


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


def rope_paged_attention_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: PagedRopeMetadata,
    rope: RopeSpec,
    scale: float,
) -> torch.Tensor:
    """Attention over un-rotated paged KV with RoPE applied at read time; returns ``[T, Hq, D]``."""
    out = torch.empty_like(query)
    loc = meta.query_start_loc.tolist()
    nblocks = meta.num_blocks.tolist()
    for s in range(meta.num_seqs):
        q0, q1 = loc[s], loc[s + 1]
        if q0 == q1:
            continue
        k, v, kpos, kidx = gather_sequence_keys(kv_cache, meta, s, nblocks[s])
        q = apply_rope(query[q0:q1], meta.query_positions[q0:q1], rope)
        k = apply_rope(k, kpos, rope)
        mask = kidx[None, :] <= meta.query_indices[q0:q1, None]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.to(q.dtype).transpose(0, 1).unsqueeze(0),
            v.to(q.dtype).transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        out[q0:q1] = o.squeeze(0).transpose(0, 1)
    return out
