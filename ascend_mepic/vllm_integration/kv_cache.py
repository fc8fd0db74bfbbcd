"""The vLLM KV-cache internals MEPIC's KV manager touches (vLLM 0.30.0), each with why.

``MepicKVCacheManager`` subclasses vLLM's ``KVCacheManager`` and keeps every block in vLLM's one
``BlockPool``. vLLM builds a request's block table as "prefix-cache hit, then new blocks"; a MEPIC
table follows the request's padded layout instead and interleaves prefix-cache hits, canonical
chunk blocks shared with other requests and new private blocks. So ``ascend_mepic.core`` writes
that table into vLLM's own bookkeeping (where ``get_blocks``, ``free`` and the scheduler read it)
and reads a few ``BlockPool`` details; everything it touches below the documented API is here.
Only full-attention models with a single KV cache group are supported (checked by the manager),
so every helper works on KV cache group 0.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import BlockHash, KVCacheBlock
from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
from vllm.v1.request import Request

GROUP = 0  # MEPIC's only KV cache group


def request_tables(manager: KVCacheManager) -> SingleTypeKVCacheManager:
    """The single-type manager that holds every request's block table.

    Why: vLLM keeps the tables in ``coordinator.single_type_managers[g].req_to_blocks`` (and the
    prefix-cached count in ``num_cached_block``); ``get_blocks``, ``free`` and
    ``pop_blocks_for_free`` read them there, so MEPIC stores its tables in the same place.
    """
    return manager.coordinator.single_type_managers[GROUP]


def table_block_size(tables: SingleTypeKVCacheManager) -> int:
    """The block size tables are laid out in (the spec's, times the decode-context-parallel size).

    Why: MEPIC pads every segment to this block size; the single-type manager holds the value
    vLLM actually allocates with (``KVCacheManager`` has no public accessor for it).
    """
    return tables.block_size


def block_table(tables: SingleTypeKVCacheManager, request_id: str) -> list[KVCacheBlock]:
    """A request's block table, for appending; created empty if missing (as vLLM's own does).

    Why: a MEPIC request's later blocks (decode, or the rest of a split prefill) are appended
    by MEPIC rather than by ``allocate_new_blocks``, which sizes the table from vLLM's in-context
    token count, not from the padded layout.
    """
    return tables.req_to_blocks[request_id]


def install_block_table(
    tables: SingleTypeKVCacheManager,
    request_id: str,
    blocks: list[KVCacheBlock],
    num_cached_blocks: int,
) -> None:
    """Set a request's whole block table and how many leading blocks are already prefix-cached.

    Why: vLLM's ``save_new_computed_blocks`` / ``allocate_new_blocks`` assume the table is a
    prefix-cache hit followed by new blocks; a MEPIC table is laid out block by block (hits,
    shared canonical chunk blocks, new private blocks), so it is written whole. ``num_cached_block``
    tells ``cache_full_blocks`` where the request's uncached blocks start.
    """
    tables.req_to_blocks[request_id] = blocks
    tables.num_cached_block[request_id] = num_cached_blocks


def get_num_cached_blocks(tables: SingleTypeKVCacheManager, request_id: str) -> int:
    """How many of a request's leading blocks are in the prefix cache (0 if none recorded).

    Why: MEPIC inserts its private blocks into the prefix cache itself (``cache_private_blocks``)
    and resumes from vLLM's own count, which its ``free`` also clears.
    """
    return tables.num_cached_block.get(request_id, 0)


def set_num_cached_blocks(tables: SingleTypeKVCacheManager, request_id: str, num: int) -> None:
    """Record how many of a request's leading blocks are in the prefix cache.

    Why: the counterpart of ``get_num_cached_blocks``, updated as vLLM's ``cache_blocks`` would.
    """
    tables.num_cached_block[request_id] = num


def cached_block(block_pool: BlockPool, block_hash: BlockHash) -> KVCacheBlock | None:
    """The prefix-cached block with this hash, if any.

    Why: MEPIC's hit lookup walks the layout block by block, taking shared blocks from the chunk
    cache and private ones from vLLM's prefix cache, instead of one longest-prefix search over a
    single hash chain (``find_longest_cache_hit``); ``get_cached_block`` is the per-block lookup.
    """
    cached = block_pool.get_cached_block(block_hash, [GROUP])
    return cached[0] if cached else None


def cache_private_blocks(
    block_pool: BlockPool,
    request: Request,
    blocks: list[KVCacheBlock],
    num_cached_blocks: int,
    num_full_blocks: int,
    block_size: int,
    private: list[bool] | None,
) -> None:
    """Insert a request's full blocks ``[num_cached_blocks, num_full_blocks)`` into the prefix
    cache, only those marked ``private`` (None: every one of them).

    Why: a request's table also holds canonical chunk blocks that belong to the chunk cache and
    to other requests; they must never get this request's hash. ``cache_full_blocks`` skips the
    blocks its ``block_mask`` leaves out (vLLM 0.30.0).
    """
    block_pool.cache_full_blocks(
        request=request,
        blocks=blocks,
        num_cached_blocks=num_cached_blocks,
        num_full_blocks=num_full_blocks,
        block_size=block_size,
        kv_cache_group_id=GROUP,
        block_mask=private,
    )


def set_block_hashes(request: Request, block_hashes: list[BlockHash]) -> None:
    """Replace a request's prefix-cache block hashes.

    Why: vLLM hashes a request's prompt tokens as they are (``Request.block_hashes``, extended by
    its block hasher); MEPIC's hashes cover the padded layout with a layout key per block. Call
    after ``scheduler.set_prompt``, which drops the hasher so vLLM never extends them (decode
    blocks of a MEPIC request are not prefix-cached).
    """
    request.block_hashes = block_hashes


def num_usable_blocks(block_pool: BlockPool) -> int:
    """Blocks requests and chunks can hold: all but vLLM's null block.

    Why: ``BlockPool`` reserves block 0 as the null block, counted in ``num_gpu_blocks`` but
    never handed out.
    """
    return block_pool.num_gpu_blocks - 1


def num_in_free_queue(blocks: Iterable[KVCacheBlock]) -> int:
    """How many of these (prefix-cache hit) blocks sit in vLLM's free queue.

    Why: a cached block nobody references (``ref_cnt == 0``) is still a free block; touching it
    for a hit takes it out of the free queue, so admission counts it against the free blocks,
    as vLLM's own ``allocate_slots`` does.
    """
    return sum(1 for b in blocks if b.ref_cnt == 0)


def num_cached_free_blocks(block_pool: BlockPool) -> int:
    """Free blocks that still hold a prefix-cache entry (reusable cache, not empty space).

    Why: ``BlockPool`` reports only the number of free blocks; MEPIC's block categories tell
    cached free blocks from empty ones by scanning ``BlockPool.blocks`` (null block excluded).
    """
    return sum(
        1
        for b in block_pool.blocks
        if b.ref_cnt == 0 and b.block_hash is not None and not b.is_null
    )


def queue_kv_events(block_pool: BlockPool, events: Iterable[Any]) -> None:
    """Queue KV events beside the block pool's own, in order.

    Why: vLLM's scheduler publishes ``KVCacheManager.take_events()``, which takes
    ``BlockPool.kv_event_queue`` (and annotates each event's cache spec); MEPIC's chunk events
    go in the same queue so they keep their order with vLLM's prefix events (a chunk's
    ``BlockRemoved`` before the ``AllBlocksCleared`` of a reset). Only when events are on:
    ``take_events`` never empties the queue otherwise.
    """
    if block_pool.enable_kv_cache_events:
        block_pool.kv_event_queue.extend(events)
