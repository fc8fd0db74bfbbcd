"""Hit lookup: which leading layout blocks of a request are already in the pool.

A MEPIC request's hit is walked block by block along its layout: private blocks (prompt blocks and
chunk first blocks) come from vLLM's prefix cache under the layout-keyed hashes, shared blocks from
the chunk cache (a resident chunk's canonical blocks), until the first block that is in neither.
"""

from __future__ import annotations

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.request import Request

from ascend_mepic.core.chunk_cache import ChunkCache, ChunkEntry
from ascend_mepic.core.kv_settings import KVSettings
from ascend_mepic.core.request_intake import BlockRole, RequestState
from ascend_mepic.vllm_integration.kv_cache import cached_block


def canonical_block(
    st: RequestState, entry: ChunkEntry, i: int, keeps_first_block: bool
) -> KVCacheBlock:
    """The canonical pool block of layout block ``i`` (a chunk block) in ``entry``."""
    span = st.layout.spans[st.layout.blocks[i].segment]
    return entry.blocks[i - span.first_block - (0 if keeps_first_block else 1)]


class HitLookup:
    def __init__(self, settings: KVSettings, block_pool: BlockPool, chunk_cache: ChunkCache):
        self.settings = settings
        self.block_pool = block_pool
        self.chunk_cache = chunk_cache

    def longest_hit(self, request: Request, st: RequestState) -> list[KVCacheBlock]:
        """Leading blocks already in the pool: prefix-cache hits and resident chunk blocks."""
        hits: list[KVCacheBlock] = []
        # The last layout block holds the last prompt token, which is always recomputed.
        for i in range(st.layout.num_blocks - 1):
            block = self.resident_block(request, st, i)
            if block is None:
                break
            hits.append(block)
        return hits

    def resident_block(self, request: Request, st: RequestState, i: int) -> KVCacheBlock | None:
        if st.roles[i] is BlockRole.SHARED:
            spec = st.layout.blocks[i]
            entry = self.chunk_cache.lookup(st.chunk_ids[spec.segment] or "")
            if entry is None:
                return None
            return canonical_block(st, entry, i, self.settings.policy.keeps_first_block)
        if i >= len(request.block_hashes):
            return None
        return cached_block(self.block_pool, request.block_hashes[i])
