"""An independent dense oracle for fused-RoPE paged attention, and random batches for it.

The oracle shares no code with the implementations: it walks block tables in Python, rotates
with complex multiplication from the RoPE base (not the cos/sin cache), builds a dense mask and
does softmax attention in float64.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import torch

from ascend_mepic.core.segments import (
    Layout,
    Segment,
    SegmentKind,
    build_layout,
    build_packed_layout,
)
from ascend_mepic.ops import RopeSpec, SequenceSpec, build_metadata, write_kv
from ascend_mepic.ops.metadata import PagedRopeMetadata
from ascend_mepic.ops.rope import default_cos_sin_cache


def rotate_complex(x: torch.Tensor, pos: torch.Tensor, base: float, neox: bool) -> torch.Tensor:
    """RoPE as complex rotation: x [N, H, D] float64, pos [N]."""
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = pos.double()[:, None] * inv[None, :]
    rot = torch.polar(torch.ones_like(angle), angle)[:, None, :]
    if neox:
        z = torch.complex(x[..., : d // 2], x[..., d // 2 :]) * rot
        return torch.cat((z.real, z.imag), dim=-1)
    z = torch.complex(x[..., 0::2], x[..., 1::2]) * rot
    return torch.stack((z.real, z.imag), dim=-1).flatten(-2)


def dense_oracle(
    query,
    kv_cache,
    meta: PagedRopeMetadata,
    base: float,
    neox: bool,
    scale: float,
    tile_rows: int | None = None,
) -> torch.Tensor:
    """Attention in float64. ``tile_rows``: sequences with at least that many query rows
    (queries x GQA group; the CPU kernel's AMX paths take them) get their scores from what the
    AMX paths feed the tiles, the rotated and scaled queries and the rotated keys rounded to
    bfloat16: at large scores the paths' error is that rounding's, which the oracle then
    shares."""
    out = torch.zeros(query.shape, dtype=torch.float64)
    bs = meta.block_size
    hq, hkv = query.shape[1], kv_cache.shape[3]
    group = hq // hkv
    loc = meta.query_start_loc.tolist()
    for s in range(meta.num_seqs):
        keys, vals, kpos, kidx = [], [], [], []
        for j in range(int(meta.num_blocks[s])):
            blk = int(meta.block_tables[s, j])
            vs, ve = int(meta.block_valid_start[s, j]), int(meta.block_valid_end[s, j])
            for t in range(vs, ve):
                keys.append(kv_cache[0, blk, t].double())
                vals.append(kv_cache[1, blk, t].double())
                kpos.append(int(meta.block_first_pos[s, j]) + t - vs)
                kidx.append(j * bs + t)
        if loc[s] == loc[s + 1]:
            continue
        k = rotate_complex(torch.stack(keys), torch.tensor(kpos), base, neox)
        v = torch.stack(vals)
        rows = slice(loc[s], loc[s + 1])
        q = rotate_complex(query[rows].double(), meta.query_positions[rows], base, neox)
        if tile_rows is not None and (loc[s + 1] - loc[s]) * group >= tile_rows:
            k = k.to(torch.bfloat16).double()
            q = (q * scale).to(torch.bfloat16).double() / scale
        allowed = torch.tensor(kidx)[None, :] <= meta.query_indices[rows, None].long()
        for h in range(hq):
            scores = (q[:, h] @ k[:, h // group].T) * scale
            scores = scores.masked_fill(~allowed, float("-inf"))
            out[rows, h] = torch.softmax(scores, dim=-1) @ v[:, h // group]
    return out


@dataclass
class Batch:
    query: torch.Tensor
    kv_cache: torch.Tensor
    meta: PagedRopeMetadata
    rope: RopeSpec
    base: float
    scale: float
    # The same keys written pre-rotated, for the equivalence test.
    rotated_cache: torch.Tensor


def _random_layout(segs: list[Segment], block_size: int, rng: random.Random) -> Layout:
    if rng.random() < 0.5:
        return build_layout(segs, block_size)
    private, offsets, fill = [], [], rng.randrange(block_size)
    for seg in segs:
        if seg.kind is SegmentKind.CHUNK:
            n = len(seg.token_ids)
            k = rng.choice([0, min(n, 16), rng.randint(0, n)])
            private.append(k)
            offsets.append(fill)
            fill = (fill + n - k) % block_size
    return build_packed_layout(segs, block_size, private, offsets)


def _table(layout: Layout, ids: list[int]) -> list[int]:
    """Physical blocks per table entry: one per private block (however often listed) and, for
    the packed layout, chunks packed back to back (a chunk's last block is the next's first)."""
    if not layout.packed:
        return [ids.pop() for _ in range(layout.num_blocks)]
    private = [ids.pop() for _ in range(layout.num_private_blocks)]
    table, arena, last = [], [], None
    for span in layout.spans:
        if span.num_shared == 0:
            continue
        first = layout.blocks[span.shared_first]
        reuse = last is not None and first.valid_start > 0
        blocks = ([last] if reuse else []) + [
            ids.pop() for _ in range(span.num_shared - (1 if reuse else 0))
        ]
        arena.append(blocks)
        end = layout.blocks[span.shared_first + span.num_shared - 1].valid_end
        last = blocks[-1] if end < layout.block_size else None
    chunk = iter(arena)
    current: list[int] = []
    for spec in layout.blocks:
        if spec.private_block >= 0:
            table.append(private[spec.private_block])
        else:
            if spec.shared_index == 0:
                current = next(chunk)
            table.append(current[spec.shared_index])
    return table


def random_batch(
    seed: int,
    block_size: int,
    hq: int,
    hkv: int,
    head: int = 32,
    num_seqs: int = 3,
    neox: bool = True,
    dtype: torch.dtype = torch.float32,
    decode: bool = False,
    max_segment: int = 90,
) -> Batch:
    """Random MEPIC layouts, scattered queries: the padded layout (front-padded chunks,
    back-padded prompts) or the packed one (a private block listed once per run, chunks' canonical
    tokens packed back to back, so one block may serve two chunks with disjoint ranges)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    base = rng.choice([10000.0, 500000.0])
    specs, layouts = [], []
    for _ in range(num_seqs):
        segs = []
        for _ in range(rng.randint(0, 3)):
            kind = rng.choice([Segment.prompt, Segment.chunk])
            segs.append(kind(range(1, rng.randint(2, max_segment))))
        segs.append(Segment.prompt(range(1, rng.randint(2, max_segment))))
        if rng.random() < 0.3:  # a compile: a chunk computed alone as its own sequence
            n = rng.randint(2, max_segment)
            segs = [Segment.chunk(range(n)), Segment.prompt([1])]
        layouts.append(_random_layout(segs, block_size, rng))
    total_blocks = sum(layout.num_blocks for layout in layouts) + 4
    ids = list(range(1, total_blocks + 1))
    rng.shuffle(ids)
    kv_cache = torch.randn(2, total_blocks + 1, block_size, hkv, head, generator=gen).to(dtype)
    cos_sin = default_cos_sin_cache(head, 4096, base)
    rope = RopeSpec.from_cache(cos_sin, neox)
    rotated = kv_cache.clone()
    for layout in layouts:
        table = _table(layout, ids)
        positions = layout.slot_positions()
        real = [i for i, p in enumerate(positions) if p >= 0]
        if decode:
            q_idx = [real[-1]]
        else:
            q_idx = sorted(rng.sample(real, rng.randint(1, len(real))))
        specs.append(
            SequenceSpec(
                block_ids=table,
                block_first_pos=[b.first_position for b in layout.blocks],
                block_valid_start=[b.valid_start for b in layout.blocks],
                block_valid_end=[b.valid_end for b in layout.blocks],
                query_indices=q_idx,
                query_positions=[positions[i] for i in q_idx],
            )
        )
        slots = torch.tensor([table[i // block_size] * block_size + i % block_size for i in real])
        pos = torch.tensor([positions[i] for i in real])
        k = kv_cache[0].view(-1, hkv, head)[slots]
        v = kv_cache[1].view(-1, hkv, head)[slots]
        kr = rotate_complex(k.double(), pos, base, neox).to(dtype)
        write_kv(kr, v, rotated, slots)
    meta = build_metadata(specs, block_size)
    query = torch.randn(meta.num_queries, hq, head, generator=gen).to(dtype)
    return Batch(query, kv_cache, meta, rope, base, head**-0.5, rotated)


def nan_outside_real_slots(b: Batch) -> Batch:
    """Every slot no sequence owns as a real key (pads, unused blocks) set to NaN: vLLM's blocks
    are not zeroed, so a kernel must never read them."""
    m = b.meta
    real = torch.zeros(b.kv_cache.shape[1:3], dtype=torch.bool)
    for s in range(m.num_seqs):
        for j in range(int(m.num_blocks[s])):
            blk = int(m.block_tables[s, j])
            real[blk, int(m.block_valid_start[s, j]) : int(m.block_valid_end[s, j])] = True
    cache = b.kv_cache.clone()
    cache[:, ~real] = float("nan")
    return replace(b, kv_cache=cache)
