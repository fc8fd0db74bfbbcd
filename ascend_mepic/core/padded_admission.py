"""Admission under private placement (the baselines) and without placement: the padded layout.

Every chunk token has a slot in the request's private blocks, packed with its prompt tokens;
under private placement the worker copies the chunk's KV from the host store into them (a
``HostLoad``) before the forward pass, and overwrites the tokens the policy recomputes.
"""

from __future__ import annotations

from ascend_mepic.core.admission import Admission
from ascend_mepic.core.plan import HostLoad, RequestPlan
from ascend_mepic.core.policies import Placement
from ascend_mepic.core.request_intake import BlockRole, RequestState
from ascend_mepic.vllm_integration.core_types import KVCacheBlock, Request
from ascend_mepic.vllm_integration.kv_cache import (
    block_table,
    cache_private_blocks,
    cached_block,
    get_num_cached_blocks,
    install_block_table,
    num_in_free_queue,
    set_num_cached_blocks,
)


class PaddedAdmission(Admission):
    """Private placement and none: every chunk token in the request's private blocks."""

    def _num_blocks(self, st: RequestState, num_tokens: int) -> int:
        # The table follows the padded layout; vLLM counts in-context tokens.
        return -(-min(st.padded_end(num_tokens), self.max_model_len) // self.block_size)

    def longest_hit(self, request: Request, st: RequestState) -> list[KVCacheBlock]:
        # The leading layout blocks in the prefix cache; the last layout block holds the last
        # prompt token, which is always recomputed. No shared blocks in the padded layout.
        hits: list[KVCacheBlock] = []
        for i in range(min(st.layout.num_blocks - 1, len(request.block_hashes))):
            if st.roles[i] is BlockRole.SHARED:
                break
            block = cached_block(self.block_pool, request.block_hashes[i])
            if block is None:
                break
            hits.append(block)
        return hits

    def hit_tokens(self, st: RequestState, num_hits: int) -> int:
        return st.compact_before[num_hits]  # in-context tokens before the first missed block

    def admit(
        self,
        request: Request,
        st: RequestState,
        hits: list[KVCacheBlock],
        num_blocks: int,
        reserved: int,
    ) -> list[KVCacheBlock] | None:
        """First allocation of a private-placement request: the whole layout at once, or
        nothing (the request keeps waiting). Chunk tokens sit in its private blocks, copied from
        the host store (``HostLoad``) and then overwritten where the policy recomputes them."""
        layout = st.layout
        n_hit = len(hits)
        num_table = max(layout.num_blocks, num_blocks)
        found = self._residency(st)
        if found is None:
            return None
        _, _, residency = found
        need = num_table - n_hit + num_in_free_queue(hits)
        if not self.chunk_cache.make_room(need, reserved):
            self.counters.admissions_deferred += 1
            return None
        self.block_pool.touch(hits)
        table = list(hits) + self.block_pool.get_new_blocks(num_table - n_hit)
        loads = [
            HostLoad(chunk_id, offset, n, table[entry].block_id, slot)
            for entry, chunk_id, offset, n, slot in st.host_runs
            if entry >= n_hit
        ]
        install_block_table(self.tables, request.request_id, table, n_hit)
        self.host_loads.extend(loads)
        self.counters.blocks_loaded += len({x.block_id for x in loads})
        st.plan = RequestPlan(
            request.request_id,
            layout,
            tuple(b.block_id for b in table[: layout.num_blocks]),
            n_hit,
            st.num_in_context - st.compact_before[n_hit],
            (),
            tuple(residency),
        )
        self.counters.count_admission(st, residency)
        self.recent_chunk_blocks.append(
            (
                request.request_id,
                [
                    [b.block_id for b in table[sp.first_block : sp.first_block + sp.num_blocks]]
                    for sp in layout.chunk_spans
                ],
            )
        )
        return table[n_hit:]

    def grow(
        self, request: Request, st: RequestState, num_blocks: int, reserved: int
    ) -> list[KVCacheBlock] | None:
        """Later steps (decode, or the rest of a split prefill): plain private blocks."""
        table = block_table(self.tables, request.request_id)
        missing = num_blocks - len(table)
        if missing <= 0:
            return []
        if not self.chunk_cache.make_room(missing, reserved, st.entries):
            return None
        new_blocks = self.block_pool.get_new_blocks(missing)
        table.extend(new_blocks)
        return new_blocks

    def cache(self, request: Request, st: RequestState, num_computed_tokens: int) -> None:
        """Insert full private blocks into vLLM's prefix cache; canonical blocks stay out."""
        padded_end = st.padded_end(num_computed_tokens)
        rid = request.request_id
        num_cached = get_num_cached_blocks(self.tables, rid)
        num_full = min(padded_end // self.block_size, len(request.block_hashes))
        if num_full <= num_cached:
            return
        # Private-placement baselines do not combine chunk KV with prefix caching (their own
        # systems cannot; CacheBlend's selection even depends on later chunks): only the
        # prompt blocks before the first chunk enter the prefix cache.
        limit = num_full
        if self.settings.policy.placement is Placement.PRIVATE and st.layout.chunk_spans:
            limit = min(num_full, st.layout.chunk_spans[0].first_block)
        mask = [
            i < limit and (i >= len(st.roles) or st.roles[i] is not BlockRole.SHARED)
            for i in range(num_cached, num_full)
        ]
        cache_private_blocks(
            self.block_pool,
            request,
            block_table(self.tables, rid),
            num_cached,
            num_full,
            self.block_size,
            mask,
        )
        set_num_cached_blocks(self.tables, rid, num_full)
