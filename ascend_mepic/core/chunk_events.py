"""Chunk residency as vLLM KV events: what a KV-event indexer (a router's) learns of chunks.

vLLM publishes ``KVCacheManager.take_events()`` through its event publisher when
``--kv-events-config`` is on. Its prefix-cache events name blocks chained from token 0 of a
prompt, so a chunk in the middle of a prompt never shows up in them. ``ChunkEvents`` publishes
each resident chunk as its own chain, anchored at the root, in vLLM's own event types:

* ``BlockStored`` when a chunk's canonical KV becomes ready (its compile ran, its tier load was
  verified): one block per full ``block_size`` tokens of the chunk's tokens (a tail shorter than
  a block is not published), ``parent_block_hash`` None, so an indexer walking a chunk's tokens
  from the root finds it; the block hashes are derived from the chunk identity and the block
  index (the identity already names model, block size, tenant and anchor); each block's
  ``extra_keys`` are ``("mepic-chunk", cache salt, anchor digest)``, strings only ("" for no
  salt or no anchor: Dynamo's indexer drops a whole batch with a None in an extra key);
* ``BlockRemoved`` of the same hashes when the chunk is evicted;
* ``AllBlocksCleared`` is vLLM's own, on a successful prefix-cache reset (after the idle chunks'
  removals).

Hits, moves inside the pool, pins, and chunks dropped before they were ready publish nothing.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from ascend_mepic.core.chunk_cache import ChunkEntry
from ascend_mepic.vllm_integration.core_types import (
    BlockHash,
    BlockPool,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    maybe_convert_block_hash,
)
from ascend_mepic.vllm_integration.kv_cache import GROUP, queue_kv_events

EXTRA_KEY_TAG = "mepic-chunk"


def anchor_digest(anchor: Sequence[int]) -> str:
    """SHA-256 hex of the anchor's tokens ("" without an anchor)."""
    if not anchor:
        return ""
    return hashlib.sha256(struct.pack(f"<{len(anchor)}q", *anchor)).hexdigest()


def chunk_block_hashes(chunk_id: str, num_blocks: int) -> list[ExternalBlockHash]:
    """The published hash of each of a chunk's blocks: SHA-256 of (identity, block index), as
    vLLM publishes its own (bytes, or 64-bit ints under ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``,
    vLLM's default)."""
    return [
        maybe_convert_block_hash(
            BlockHash(
                hashlib.sha256(
                    b"mepic-chunk-block" + chunk_id.encode() + struct.pack("<Q", i)
                ).digest()
            )
        )
        for i in range(num_blocks)
    ]


class ChunkEvents:
    """Turns chunk residency changes into vLLM KV events in the block pool's event queue."""

    def __init__(self, block_pool: BlockPool, block_size: int) -> None:
        self.block_pool = block_pool
        self.block_size = block_size

    @property
    def enabled(self) -> bool:
        return bool(self.block_pool.enable_kv_cache_events)

    def _hashes(self, entry: ChunkEntry) -> list[ExternalBlockHash]:
        return chunk_block_hashes(entry.chunk_id, len(entry.token_ids) // self.block_size)

    def stored(self, entry: ChunkEntry) -> None:
        """The chunk's canonical KV is ready."""
        if not self.enabled:
            return
        hashes = self._hashes(entry)
        if not hashes:
            return
        # Strings only: Dynamo 1.6.1's decoder (ExtraKeyItem) rejects None, and then drops the
        # whole batch, vLLM's own prefix events in it included.
        key = (EXTRA_KEY_TAG, entry.tenant or "", anchor_digest(entry.anchor))
        event = BlockStored(
            block_hashes=hashes,
            parent_block_hash=None,
            token_ids=list(entry.token_ids[: len(hashes) * self.block_size]),
            block_size=self.block_size,
            lora_id=None,
            medium=self.block_pool.medium,
            lora_name=None,
            extra_keys=[key] * len(hashes),
            group_idx=GROUP,
        )
        queue_kv_events(self.block_pool, [event])

    def removed(self, entry: ChunkEntry) -> None:
        """A ready chunk left the pool."""
        if not self.enabled:
            return
        hashes = self._hashes(entry)
        if hashes:
            event = BlockRemoved(
                block_hashes=hashes, medium=self.block_pool.medium, group_idx=GROUP
            )
            queue_kv_events(self.block_pool, [event])
