"""Admission and allocation of MEPIC requests (Algorithm 1), in vLLM's one BlockPool.

A request's first allocation covers its whole layout at once, or nothing (it keeps waiting):

* private blocks (prompt blocks and every chunk's first block) are prefix-cache hits or new blocks;
* a chunk's blocks after the first are the chunk's canonical blocks, shared through the
  ``ChunkCache``; a first-time chunk gets new canonical blocks plus a scratch block for its
  compile, and becomes READY when the next step starts (its compile ran in this one);
* under private placement every chunk block is a new private block the worker fills from the host
  store (a ``HostLoad``).

Idle chunks are evicted (whole, least recently released first) only when the free blocks do not
suffice. Later steps (decode, the rest of a split prefill) grow the table with private blocks. The
table lives in vLLM's own single-type manager, so ``get_blocks`` and ``free`` work unchanged.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
from vllm.v1.request import Request

from ascend_mepic.core.chunk_cache import ChunkCache, ChunkEntry, ChunkState
from ascend_mepic.core.hit_lookup import canonical_block
from ascend_mepic.core.identity import ChunkId
from ascend_mepic.core.kv_accounting import MepicCounters
from ascend_mepic.core.kv_settings import KVSettings
from ascend_mepic.core.plan import ChunkCompile, HostLoad, RequestPlan, Residency
from ascend_mepic.core.policies import Placement
from ascend_mepic.core.request_intake import BlockRole, RequestState
from ascend_mepic.core.step_room import StepRoom
from ascend_mepic.vllm_integration.kv_cache import (
    block_table,
    cache_private_blocks,
    get_num_cached_blocks,
    install_block_table,
    num_in_free_queue,
    set_num_cached_blocks,
)


class Admission:
    """Allocates, grows, prefix-caches and releases the block tables of MEPIC requests."""

    def __init__(
        self,
        *,
        settings: KVSettings,
        room: StepRoom,
        counters: MepicCounters,
        block_pool: BlockPool,
        chunk_cache: ChunkCache,
        tables: SingleTypeKVCacheManager,
        block_size: int,
        max_model_len: int,
        watermark_blocks: int,
    ) -> None:
        self.settings = settings
        self.room = room
        self.counters = counters
        self.block_pool = block_pool
        self.chunk_cache = chunk_cache
        self.tables = tables
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.watermark_blocks = watermark_blocks
        self.host_loads: list[HostLoad] = []  # host-store copies into this step's new blocks
        # Recent admissions' chunk block ids, for operators and tests (bounded).
        self.recent_chunk_blocks: deque[tuple[str, list[list[int]]]] = deque(maxlen=1024)

    def allocate(
        self,
        request: Request,
        st: RequestState,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        new_computed_blocks: KVCacheBlocks | None,
        num_lookahead_tokens: int,
        delay_cache_blocks: bool,
        reserved_blocks: int,
        has_scheduled_reqs: bool,
    ) -> list[KVCacheBlock] | None:
        """``KVCacheManager.allocate_slots`` for a tracked request: its new blocks, or None."""
        total_computed = request.num_computed_tokens + num_new_computed_tokens
        # Everything below works in the padded layout; vLLM counts in-context tokens.
        num_need_slot = min(
            st.padded_end(total_computed + num_new_tokens + num_lookahead_tokens),
            self.max_model_len,
        )
        if not st.allocated:
            hits = list(new_computed_blocks.blocks[0]) if new_computed_blocks else []
            # As vLLM does, keep a watermark free when admitting beside running requests.
            headroom = reserved_blocks + (self.watermark_blocks if has_scheduled_reqs else 0)
            new_blocks = self.admit(request, st, hits, num_need_slot, headroom)
        else:
            new_blocks = self.grow(request, st, num_need_slot, reserved_blocks)
        if new_blocks is None:
            return None
        if not delay_cache_blocks:
            num_to_cache = min(total_computed + num_new_tokens, request.num_tokens)
            self.cache_private(request, st, st.padded_end(num_to_cache))
        return new_blocks

    def admit(
        self,
        request: Request,
        st: RequestState,
        hits: list[KVCacheBlock],
        num_need_slot: int,
        reserved: int,
    ) -> list[KVCacheBlock] | None:
        """First allocation: the whole layout at once, or nothing (the request keeps waiting)."""
        layout, bs = st.layout, self.block_size
        n_hit = len(hits)
        num_table = max(layout.num_blocks, -(-num_need_slot // bs))
        found = self._residency(st)
        if found is None:
            return None
        reused, new_chunks, residency = found
        new_chunk_blocks = sum(
            layout.spans[segs[0]].num_blocks for segs in new_chunks.values()
        )  # canonical blocks plus one scratch block each (naive: all canonical, no scratch)
        num_new_private = sum(
            1
            for i in range(n_hit, num_table)
            if i >= len(st.roles) or st.roles[i] is not BlockRole.SHARED
        )
        compile_tokens = sum(layout.spans[segs[0]].num_tokens for segs in new_chunks.values())
        if not self.room.fits(compile_tokens, len(new_chunks)):
            self.counters.admissions_deferred += 1  # this step's compile room is used up
            return None
        need = num_new_private + new_chunk_blocks + num_in_free_queue(hits)
        protect = list(reused.values())
        free = self.block_pool.get_num_free_blocks() - reserved
        if need > free + self.chunk_cache.lru.evictable_blocks(protect):
            self.counters.admissions_deferred += 1
            return None
        if need > free:
            self.chunk_cache.evict_until_free(need + reserved, protect)

        # Hit blocks and reused chunk blocks first, so new allocations cannot take them.
        self.block_pool.touch(hits)
        for entry in reused.values():
            self.chunk_cache.acquire(entry)
            st.entries.append(entry)
        compiles = self._create_chunks(request, st, new_chunks, reused)
        table = self._build_table(request, st, hits, num_table, reused)

        compute = tuple(
            i for i in range(n_hit, layout.num_blocks) if st.roles[i] is not BlockRole.SHARED
        )
        st.plan = RequestPlan(
            request.request_id,
            layout,
            tuple(b.block_id for b in table[: layout.num_blocks]),
            n_hit,
            compute,
            tuple(compiles),
            tuple(residency),
        )
        self.counters.count_admission(st, residency, self.settings.policy)
        self.recent_chunk_blocks.append(
            (
                request.request_id,
                [
                    [b.block_id for b in table[sp.first_block : sp.first_block + sp.num_blocks]]
                    for sp in layout.chunk_spans
                ],
            )
        )
        if st.pin:
            for entry in st.entries:
                self.chunk_cache.pin(entry)
        self.room.add_compiles(request.request_id, compiles)
        return table[n_hit:]

    def _residency(
        self, st: RequestState
    ) -> tuple[dict[int, ChunkEntry], dict[ChunkId, list[int]], list[Residency]] | None:
        """Residency of each chunk occurrence, deciding what must be allocated.

        Returns (chunk segment -> resident entry, first-time chunk -> its segments, residency per
        occurrence); None if a chunk is still loading from the tier (usable once verified).
        """
        reused: dict[int, ChunkEntry] = {}
        new_chunks: dict[ChunkId, list[int]] = {}
        residency: list[Residency] = []
        private = self.settings.policy.placement is Placement.PRIVATE
        for span in st.layout.chunk_spans:
            chunk_id = st.chunk_ids[span.segment]
            if chunk_id is None:
                residency.append(Residency.SINGLE_BLOCK)
                continue
            if private:
                residency.append(Residency.HOST)
                continue
            entry = self.chunk_cache.lookup(chunk_id)
            if entry is not None and entry.state is ChunkState.LOADING:
                self.counters.admissions_deferred += 1  # usable once the load is verified
                return None
            if entry is not None:
                reused[span.segment] = entry
                residency.append(
                    Residency.RESIDENT if entry.state is ChunkState.READY else Residency.IN_FLIGHT
                )
            else:
                first = chunk_id not in new_chunks
                new_chunks.setdefault(chunk_id, []).append(span.segment)
                residency.append(Residency.COMPILE if first else Residency.IN_FLIGHT)
        return reused, new_chunks, residency

    def _create_chunks(
        self,
        request: Request,
        st: RequestState,
        new_chunks: dict[ChunkId, list[int]],
        reused: dict[int, ChunkEntry],
    ) -> list[ChunkCompile]:
        """Canonical blocks (and a compile scratch block) for each first-time chunk; every
        occurrence acquires it and is added to ``reused``. Returns the compiles."""
        layout = st.layout
        keep_first = self.settings.policy.keeps_first_block
        compiles: list[ChunkCompile] = []
        for chunk_id, segs in new_chunks.items():
            span = layout.spans[segs[0]]
            entry = self.chunk_cache.create(
                chunk_id,
                span.num_tokens,
                span.num_blocks - (0 if keep_first else 1),
                request.request_id,
            )
            scratch = [] if keep_first else self.block_pool.get_new_blocks(1)
            st.scratch.extend(scratch)
            compiles.append(
                ChunkCompile(
                    chunk_id,
                    layout.chunk_tokens(span),
                    span.pad,
                    (*(b.block_id for b in scratch), *entry.block_ids),
                )
            )
            for _ in segs:
                self.chunk_cache.acquire(entry)
                st.entries.append(entry)
            for seg in segs:
                reused[seg] = entry
        return compiles

    def _build_table(
        self,
        request: Request,
        st: RequestState,
        hits: list[KVCacheBlock],
        num_table: int,
        reused: dict[int, ChunkEntry],
    ) -> list[KVCacheBlock]:
        """The request's table in layout order: hits, then shared canonical blocks (touched) and
        new private blocks; installed in vLLM's bookkeeping. Queues host loads for LOAD blocks."""
        layout, n_hit = st.layout, len(hits)
        private = self.settings.policy.placement is Placement.PRIVATE
        keep_first = self.settings.policy.keeps_first_block
        table = list(hits)
        shared_touch: list[KVCacheBlock] = []
        loads: list[list[Any]] = []
        for i in range(n_hit, num_table):
            role = st.roles[i] if i < len(st.roles) else BlockRole.PRIVATE
            if role is BlockRole.SHARED:
                entry = reused[layout.blocks[i].segment]
                block = canonical_block(st, entry, i, keep_first)
                shared_touch.append(block)
                table.append(block)
                continue
            block = self.block_pool.get_new_blocks(1)[0]
            table.append(block)
            if role is BlockRole.LOAD:
                span = layout.spans[layout.blocks[i].segment]
                offset = i - span.first_block if private else 0
                loads.append([st.chunk_ids[span.segment], offset, block.block_id])
        self.block_pool.touch(shared_touch)
        install_block_table(self.tables, request.request_id, table, n_hit)
        self.host_loads.extend(HostLoad(c, offset, block) for c, offset, block in loads)
        self.counters.blocks_loaded += len(loads)
        return table

    def grow(
        self, request: Request, st: RequestState, num_need_slot: int, reserved: int
    ) -> list[KVCacheBlock] | None:
        """Later steps (decode, or the rest of a split prefill): plain private blocks."""
        table = block_table(self.tables, request.request_id)
        missing = -(-num_need_slot // self.block_size) - len(table)
        if missing <= 0:
            return []
        free = self.block_pool.get_num_free_blocks() - reserved
        if missing > free + self.chunk_cache.lru.evictable_blocks(st.entries):
            return None
        if missing > free:
            self.chunk_cache.evict_until_free(missing + reserved, st.entries)
        new_blocks = self.block_pool.get_new_blocks(missing)
        table.extend(new_blocks)
        return new_blocks

    def cache_private(self, request: Request, st: RequestState, padded_end: int) -> None:
        """Insert full private blocks into vLLM's prefix cache; canonical blocks stay out."""
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

    def take_host_loads(self) -> list[HostLoad]:
        """Host-store copies into private blocks allocated in this step, once."""
        out, self.host_loads = self.host_loads, []
        return out

    def commit_compiled(self) -> None:
        """The step ran: its compiles are in the cache (READY); a chunk whose only user already
        left becomes idle."""
        for entry in self.chunk_cache.commit_pending():
            if entry.refs == 0 and not entry.pinned:  # its only user already left
                self.chunk_cache.lru.add(entry)

    def free_scratch(self, states: Iterable[RequestState]) -> None:
        """The step ran: compile scratch blocks are free again."""
        for st in states:
            if st.scratch:
                self.block_pool.free_blocks(st.scratch)
                st.scratch = []

    def release(self, request_id: str, st: RequestState) -> None:
        """A request leaves the pool (finished or preempted): drop its uncompiled chunks, its
        chunk references and its scratch; vLLM frees its table."""
        if not st.allocated:
            return
        self.chunk_cache.drop_pending(request_id)
        for entry in st.entries:
            self.chunk_cache.release(entry)
        if st.scratch:
            self.block_pool.free_blocks(st.scratch)
        st.entries, st.scratch, st.plan = [], [], None
