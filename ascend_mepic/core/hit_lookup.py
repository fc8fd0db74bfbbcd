"""Hit lookup: which leading blocks of a request are already in the pool.

Packed layout (shared placement): the request's leading private blocks found in vLLM's prefix
cache under their chained hashes (the chunks between them are named in the hashes; whether they
are resident is the chunk cache's business at admission). Padded layout (private placement): the
leading layout blocks found in the prefix cache.
"""

from __future__ import annotations

from ascend_mepic.core.chunk_cache import ChunkCache
from ascend_mepic.core.kv_settings import KVSettings
from ascend_mepic.core.request_intake import BlockRole, RequestState
from ascend_mepic.vllm_integration.core_types import BlockPool, KVCacheBlock, Request
from ascend_mepic.vllm_integration.kv_cache import cached_block


class HitLookup:
    def __init__(self, settings: KVSettings, block_pool: BlockPool, chunk_cache: ChunkCache):
        self.settings = settings
        self.block_pool = block_pool
        self.chunk_cache = chunk_cache

    def longest_hit(self, request: Request, st: RequestState) -> list[KVCacheBlock]:
        """Leading blocks already in the pool: prefix-cache hits and resident chunk blocks."""
        hits: list[KVCacheBlock] = []
        if st.shared:
            # The last prompt token is always recomputed: at most (n - 1) // B full blocks.
            for block_hash in request.block_hashes[
                : (st.num_in_context - 1) // st.layout.block_size
            ]:
                block = cached_block(self.block_pool, block_hash)
                if block is None:
                    break
                hits.append(block)
            return hits
        # The last layout block holds the last prompt token, which is always recomputed.
        for i in range(st.layout.num_blocks - 1):
            block = self.resident_block(request, st, i)
            if block is None:
                break
            hits.append(block)
        return hits

    def resident_block(self, request: Request, st: RequestState, i: int) -> KVCacheBlock | None:
        if st.roles[i] is BlockRole.SHARED:
            return None  # the padded layout has no shared blocks (private placement)
        if i >= len(request.block_hashes):
            return None
        return cached_block(self.block_pool, request.block_hashes[i])
