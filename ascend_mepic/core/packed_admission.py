"""Admission under shared placement (MEPIC): the packed layout.

* the request's private blocks hold its private stream (prompt tokens and each chunk's first
  tokens, then decode), packed: prefix-cache hits, then new blocks;
* each chunk's canonical tokens are the ``ChunkCache``'s, packed with other chunks' in shared
  blocks; a first-time chunk is placed by the chunk arena (plus scratch blocks for its private
  tokens during the compile) and becomes READY when the next step starts; an idle chunk used
  again may move next to the chunks in use (a ``ChunkMove``);
* the table lists, in logical order, one entry per private run and per canonical block, so a
  private block may be listed more than once (one reference per listing).
"""

from __future__ import annotations

from ascend_mepic.core.admission import Admission
from ascend_mepic.core.chunk_cache import ChunkEntry, ChunkState
from ascend_mepic.core.identity import ChunkId
from ascend_mepic.core.plan import ChunkCompile, ChunkMove, RequestPlan, SequencePlacement
from ascend_mepic.core.request_intake import RequestState
from ascend_mepic.core.segments import BlockKind, Segment, SegmentKind, build_packed_layout
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


class PackedAdmission(Admission):
    """Shared placement: canonical chunk blocks referenced from the chunk cache."""

    def _num_blocks(self, st: RequestState, num_tokens: int) -> int:
        # vLLM counts the private stream (in-context tokens, then decode): it is dense, so private
        # blocks follow vLLM's own arithmetic.
        return -(-num_tokens // self.block_size)

    def longest_hit(self, request: Request, st: RequestState) -> list[KVCacheBlock]:
        # The leading private blocks under their chained hashes (the chunks between them are
        # named in the hashes; whether they are resident is settled at admission). The last
        # prompt token is always recomputed: at most (n - 1) // B full blocks.
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[: (st.num_in_context - 1) // st.layout.block_size]:
            block = cached_block(self.block_pool, block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def hit_tokens(self, st: RequestState, num_hits: int) -> int:
        return num_hits * self.block_size  # hits are full blocks of the dense private stream

    def admit(
        self,
        request: Request,
        st: RequestState,
        hits: list[KVCacheBlock],
        num_blocks: int,
        reserved: int,
    ) -> list[KVCacheBlock] | None:
        """First allocation of a packed request: private blocks, chunk placement, the table."""
        layout, bs = st.layout, self.block_size
        n_hit = len(hits)
        num_private = max(num_blocks, layout.num_private_blocks)
        found = self._residency(st)
        if found is None:
            return None
        reused, new_chunks, residency = found
        firsts = [layout.spans[segs[0]] for segs in new_chunks.values()]
        lead = len(st.anchor)
        compile_tokens = sum(lead + sp.num_tokens for sp in firsts)
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
            + sum(-(-(lead + sp.private_tokens) // bs) for sp in firsts)  # compile scratch
            + num_in_free_queue(hits)
        )
        protect = list(reused.values())
        free = self.block_pool.get_num_free_blocks() - reserved
        if not self.chunk_cache.make_room(need, reserved, protect):
            self.counters.admissions_deferred += 1
            return None

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
        st.placement = SequencePlacement(layout, st.num_in_context)
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
            self.chunk_cache.release_pins(request.request_id)  # now counted as pinned
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
        anchor = st.anchor
        lead = [Segment.prompt(anchor)] if anchor else []
        compiles: list[ChunkCompile] = []
        for chunk_id, segs in new_chunks.items():
            span = st.layout.spans[segs[0]]
            k = span.private_tokens
            tokens = st.layout.chunk_tokens(span)
            entry = self.chunk_cache.create(
                chunk_id, span.num_tokens, span.num_tokens - k, request.request_id,
                tenant=request.cache_salt, token_ids=tokens, anchor=anchor,
            )  # fmt: skip
            scratch = self.block_pool.get_new_blocks(-(-(len(anchor) + k) // bs))
            st.scratch.extend(scratch)
            # The anchor (a prompt segment) and the chunk's private tokens form the compile's
            # private stream, in scratch; its canonical tokens go where the arena placed them.
            alone = build_packed_layout(
                [*lead, Segment.chunk(tokens)], bs, [k], [entry.offset], allow_trailing_chunk=True
            )
            block_ids = tuple(
                entry.blocks[spec.shared_index].block_id
                if spec.kind is BlockKind.CHUNK_SHARED
                else scratch[spec.private_block].block_id
                for spec in alone.blocks
            )
            compiles.append(
                ChunkCompile(
                    chunk_id,
                    tokens,
                    block_ids,
                    alone,
                    (k, entry.offset),
                    num_scratch=len(scratch),
                    anchor_tokens=anchor,
                )  # fmt: skip
            )
            for seg in segs:
                self.chunk_cache.acquire(entry)
                st.entries.append(entry)
                reused[seg] = entry
        return compiles

    def grow(
        self, request: Request, st: RequestState, num_blocks: int, reserved: int
    ) -> list[KVCacheBlock] | None:
        """Later steps (decode, or the rest of a split prefill): more private blocks, appended
        to the private stream and to the table."""
        missing = num_blocks - len(st.private_blocks)
        if missing <= 0:
            return []
        if not self.chunk_cache.make_room(missing, reserved, st.entries):
            return None
        new_blocks = self.block_pool.get_new_blocks(missing)
        st.private_blocks.extend(new_blocks)
        block_table(self.tables, request.request_id).extend(new_blocks)
        return new_blocks

    def cache(self, request: Request, st: RequestState, num_computed_tokens: int) -> None:
        """Insert the full private blocks of the prompt into vLLM's prefix cache (canonical
        blocks belong to the chunk cache and never get a request's hash)."""
        rid = request.request_id
        num_cached = get_num_cached_blocks(self.tables, rid)
        num_full = min(num_computed_tokens // self.block_size, len(request.block_hashes))
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
