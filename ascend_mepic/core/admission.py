"""Admission and allocation of MEPIC requests (Algorithm 1), in vLLM's one BlockPool.

A request's first allocation covers its whole layout at once, or nothing (it keeps waiting).

Shared placement (the packed layout):

* the request's private blocks hold its private stream (prompt tokens and each chunk's first
  tokens, then decode), packed: prefix-cache hits, then new blocks;
* each chunk's canonical tokens are the ``ChunkCache``'s, packed with other chunks' in shared
  blocks; a first-time chunk is placed by the chunk arena (plus scratch blocks for its private
  tokens during the compile) and becomes READY when the next step starts;
* the table lists, in logical order, one entry per private run and per canonical block, so a
  private block may be listed more than once (one reference per listing).

Private placement (the baselines): every chunk token has a slot in the request's private blocks,
packed with its prompt tokens; the worker copies the chunk's KV from the host store into them (a
``HostLoad``) before the forward pass.

Idle chunks are evicted (whole, least recently released first) only when the free blocks do not
suffice. Later steps (decode, the rest of a split prefill) grow the table with private blocks. The
table lives in vLLM's own single-type manager, so ``get_blocks`` and ``free`` work unchanged.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
from vllm.v1.request import Request

from ascend_mepic.core.chunk_cache import ChunkCache, ChunkEntry, ChunkState
from ascend_mepic.core.counters import MepicCounters
from ascend_mepic.core.identity import ChunkId
from ascend_mepic.core.kv_settings import KVSettings
from ascend_mepic.core.plan import (
    ChunkCompile,
    ChunkMove,
    HostLoad,
    RequestPlan,
    Residency,
    SequencePlacement,
)
from ascend_mepic.core.policies import Placement
from ascend_mepic.core.request_intake import BlockRole, RequestState
from ascend_mepic.core.segments import BlockKind, Segment, SegmentKind, build_packed_layout
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
        self.moves: list[ChunkMove] = []  # chunk relocations of this step
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
        if st.shared:
            return self._allocate_packed(
                request,
                st,
                total_computed,
                num_new_tokens + num_lookahead_tokens,
                new_computed_blocks,
                delay_cache_blocks,
                reserved_blocks,
                has_scheduled_reqs,
            )
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

    # ------------------------------------------------------------ packed layout (shared placement)

    def _allocate_packed(
        self,
        request: Request,
        st: RequestState,
        total_computed: int,
        num_new_tokens: int,
        new_computed_blocks: KVCacheBlocks | None,
        delay_cache_blocks: bool,
        reserved_blocks: int,
        has_scheduled_reqs: bool,
    ) -> list[KVCacheBlock] | None:
        # vLLM counts the private stream (in-context tokens, then decode): it is dense, so private
        # blocks follow vLLM's own arithmetic.
        num_private = -(-(total_computed + num_new_tokens) // self.block_size)
        if not st.allocated:
            hits = list(new_computed_blocks.blocks[0]) if new_computed_blocks else []
            headroom = reserved_blocks + (self.watermark_blocks if has_scheduled_reqs else 0)
            new_blocks = self.admit_packed(request, st, hits, num_private, headroom)
        else:
            new_blocks = self.grow_packed(request, st, num_private, reserved_blocks)
        if new_blocks is not None and not delay_cache_blocks:
            self.cache_packed(request, st, min(total_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def admit_packed(
        self,
        request: Request,
        st: RequestState,
        hits: list[KVCacheBlock],
        num_private: int,
        reserved: int,
    ) -> list[KVCacheBlock] | None:
        """First allocation of a packed request: private blocks, chunk placement, the table."""
        layout, bs = st.layout, self.block_size
        n_hit = len(hits)
        num_private = max(num_private, layout.num_private_blocks)
        found = self._residency(st)
        if found is None:
            return None
        reused, new_chunks, residency = found
        firsts = [layout.spans[segs[0]] for segs in new_chunks.values()]
        compile_tokens = sum(sp.num_tokens for sp in firsts)
        if not self.room.fits(compile_tokens, len(new_chunks)):
            self.counters.admissions_deferred += 1  # this step's batch is full
            self.room.defer(compile_tokens, len(new_chunks))  # room is kept in the next step
            return None
        need = (
            num_private
            - n_hit
            + self.chunk_cache.arena.new_blocks_bound(
                sum(sp.num_tokens - sp.private_tokens for sp in firsts)
            )
            + sum(-(-sp.private_tokens // bs) for sp in firsts)  # compile scratch
            + num_in_free_queue(hits)
        )
        protect = list(reused.values())
        free = self.block_pool.get_num_free_blocks() - reserved
        if need > free and need > free + self.chunk_cache.lru.evictable_blocks(protect):
            self.counters.admissions_deferred += 1
            return None
        if need > free:
            self.chunk_cache.evict_until_free(need + reserved, protect)

        self.block_pool.touch(hits)
        self._move_idle_chunks(request, st, reused, free - need)
        for entry in reused.values():
            self.chunk_cache.acquire(entry)
            st.entries.append(entry)
        compiles = self._create_packed_chunks(request, st, new_chunks, reused)
        st.private_blocks = hits + self.block_pool.get_new_blocks(num_private - n_hit)
        offsets = [
            reused[sp.segment].offset if sp.segment in reused else 0 for sp in layout.chunk_spans
        ]
        st.set_packed_layout(build_packed_layout(layout.segments, bs, st.private_tokens, offsets))
        layout = st.layout
        table = self._packed_table(st, reused)
        install_block_table(self.tables, request.request_id, table, 0)
        set_num_cached_blocks(self.tables, request.request_id, n_hit)
        st.placement = SequencePlacement(
            segment_lengths=tuple((kind, n) for kind, n in layout.segment_lengths()),
            num_in_context=st.num_in_context,
            packing=tuple(zip(st.private_tokens, offsets, strict=True)),
        )
        st.plan = RequestPlan(
            request.request_id,
            layout,
            tuple([b.block_id for b in table[: layout.num_blocks]]),
            n_hit,
            st.num_in_context - min(st.num_in_context, n_hit * bs),
            tuple(compiles),
            tuple(residency),
        )
        self.counters.count_admission(st, residency)
        self.recent_chunk_blocks.append(
            (
                request.request_id,
                [  # each chunk's canonical blocks, as the table lists them
                    [b.block_id for b in reused[sp.segment].blocks[: sp.num_shared]]
                    if sp.num_shared
                    else []
                    for sp in layout.chunk_spans
                ],
            )
        )
        if st.pin:
            for entry in st.entries:
                self.chunk_cache.pin(entry)
        self.room.add_compiles(request.request_id, compiles)
        return table

    def _move_idle_chunks(
        self, request: Request, st: RequestState, reused: dict[int, ChunkEntry], spare: int
    ) -> None:
        """Move idle chunks this request uses again next to the chunks in use, when that costs
        no extra blocks (``ChunkCache.worth_moving``) and the free blocks allow it without
        evicting. The old blocks are held (as scratch) until the step that copies them ran."""
        seen: set[int] = set()
        for entry in reused.values():
            # In use (most reused chunks) or not ready: never moved (``worth_moving``).
            if entry.refs or entry.state is not ChunkState.READY or id(entry) in seen:
                continue
            seen.add(id(entry))
            cost = self.chunk_cache.arena.new_blocks_bound(entry.num_canonical)
            if cost > spare or not self.chunk_cache.worth_moving(entry, request.cache_salt):
                continue
            spare -= cost
            old_blocks, old_offset = self.chunk_cache.move(entry, request.cache_salt)
            st.scratch.extend(old_blocks)
            self.moves.append(
                ChunkMove(
                    entry.chunk_id,
                    entry.num_canonical,
                    tuple(b.block_id for b in old_blocks),
                    old_offset,
                    tuple(entry.block_ids),
                    entry.offset,
                )
            )

    def take_moves(self) -> list[ChunkMove]:
        """Chunk relocations issued in this step, once."""
        out, self.moves = self.moves, []
        return out

    def _packed_table(self, st: RequestState, reused: dict[int, ChunkEntry]) -> list[KVCacheBlock]:
        """The table in logical order, one entry per private run and per canonical block, then
        the private blocks past the prompt; one reference per listing.

        Built per segment from the layout's spans (slices of the private blocks and of each
        chunk's canonical blocks), as ``Layout.blocks`` lists them, without building the entries.
        """
        layout, bs, private = st.layout, self.block_size, st.private_blocks
        table: list[KVCacheBlock] = []
        touch: list[KVCacheBlock] = []
        stream = 0  # private-stream tokens listed so far
        last_private = False  # does the last entry end where the stream does?
        for sp in layout.spans:
            chunk = sp.kind is SegmentKind.CHUNK
            k = sp.private_tokens if chunk else sp.num_tokens
            if k:
                first, last = stream // bs, (stream + k - 1) // bs
                if stream % bs and last_private:
                    first += 1  # the run goes on in the last entry's block
                elif stream % bs:
                    touch.append(private[first])  # listed before a chunk interrupted the run
                table += private[first : last + 1]
                stream += k
                last_private = True
            if chunk and sp.num_shared:
                canonical = reused[sp.segment].blocks[: sp.num_shared]
                table += canonical
                touch += canonical
                last_private = False
        table += private[layout.num_private_blocks :]
        self.block_pool.touch(touch)
        return table

    def _create_packed_chunks(
        self,
        request: Request,
        st: RequestState,
        new_chunks: dict[ChunkId, list[int]],
        reused: dict[int, ChunkEntry],
    ) -> list[ChunkCompile]:
        """Place each first-time chunk in the arena, with scratch blocks for its private tokens
        during the compile; every occurrence acquires it. Returns the compiles."""
        bs = self.block_size
        compiles: list[ChunkCompile] = []
        for chunk_id, segs in new_chunks.items():
            span = st.layout.spans[segs[0]]
            k = span.private_tokens
            entry = self.chunk_cache.create(
                chunk_id, span.num_tokens, span.num_tokens - k, request.request_id,
                tenant=request.cache_salt,
            )  # fmt: skip
            scratch = self.block_pool.get_new_blocks(-(-k // bs))
            st.scratch.extend(scratch)
            tokens = st.layout.chunk_tokens(span)
            alone = build_packed_layout(
                [Segment.chunk(tokens)], bs, [k], [entry.offset], allow_trailing_chunk=True
            )
            block_ids = tuple(
                entry.blocks[spec.shared_index].block_id
                if spec.kind is BlockKind.CHUNK_SHARED
                else scratch[spec.private_block].block_id
                for spec in alone.blocks
            )
            compiles.append(
                ChunkCompile(
                    chunk_id, tokens, 0, block_ids, (k, entry.offset), num_scratch=len(scratch)
                )
            )
            for seg in segs:
                self.chunk_cache.acquire(entry)
                st.entries.append(entry)
                reused[seg] = entry
        return compiles

    def grow_packed(
        self, request: Request, st: RequestState, num_private: int, reserved: int
    ) -> list[KVCacheBlock] | None:
        """Later steps (decode, or the rest of a split prefill): more private blocks, appended
        to the private stream and to the table."""
        missing = num_private - len(st.private_blocks)
        if missing <= 0:
            return []
        if not self._make_room(missing, reserved, st.entries):
            return None
        new_blocks = self.block_pool.get_new_blocks(missing)
        st.private_blocks.extend(new_blocks)
        block_table(self.tables, request.request_id).extend(new_blocks)
        return new_blocks

    def _make_room(self, need: int, reserved: int, protect: list[ChunkEntry]) -> bool:
        """``need`` free blocks beside ``reserved``, evicting idle chunks (not ``protect``) if
        that suffices; False (nothing evicted) if it cannot."""
        free = self.block_pool.get_num_free_blocks() - reserved
        if need <= free:
            return True
        if need > free + self.chunk_cache.lru.evictable_blocks(protect):
            return False
        self.chunk_cache.evict_until_free(need + reserved, protect)
        return True

    def cache_packed(self, request: Request, st: RequestState, num_tokens: int) -> None:
        """Insert the full private blocks of the prompt into vLLM's prefix cache (canonical
        blocks belong to the chunk cache and never get a request's hash)."""
        rid = request.request_id
        num_cached = get_num_cached_blocks(self.tables, rid)
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        if num_full <= num_cached:
            return
        cache_private_blocks(
            self.block_pool,
            request,
            st.private_blocks,
            num_cached,
            num_full,
            self.block_size,
            None,  # every private block (a packed table's shared blocks are not in this list)
        )
        set_num_cached_blocks(self.tables, rid, num_full)

    # ------------------------------------------------------------ private placement

    def admit(
        self,
        request: Request,
        st: RequestState,
        hits: list[KVCacheBlock],
        num_need_slot: int,
        reserved: int,
    ) -> list[KVCacheBlock] | None:
        """First allocation of a private-placement request: the whole layout at once, or
        nothing (the request keeps waiting). Chunk tokens sit in its private blocks, copied from
        the host store (``HostLoad``) and then overwritten where the policy recomputes them."""
        layout, bs = st.layout, self.block_size
        n_hit = len(hits)
        num_table = max(layout.num_blocks, -(-num_need_slot // bs))
        found = self._residency(st)
        if found is None:
            return None
        _, _, residency = found
        need = num_table - n_hit + num_in_free_queue(hits)
        free = self.block_pool.get_num_free_blocks() - reserved
        if need > free and need > free + self.chunk_cache.lru.evictable_blocks():
            self.counters.admissions_deferred += 1
            return None
        if need > free:
            self.chunk_cache.evict_until_free(need + reserved)
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

    def grow(
        self, request: Request, st: RequestState, num_need_slot: int, reserved: int
    ) -> list[KVCacheBlock] | None:
        """Later steps (decode, or the rest of a split prefill): plain private blocks."""
        table = block_table(self.tables, request.request_id)
        missing = -(-num_need_slot // self.block_size) - len(table)
        if missing <= 0:
            return []
        if not self._make_room(missing, reserved, st.entries):
            return None
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
        st.entries, st.scratch, st.plan, st.private_blocks = [], [], None, []
