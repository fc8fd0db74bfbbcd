"""Chunk KV moving between the pool and storage outside it: the host store and the off-device tier.

* ``HostStoreStaging``: policies that copy chunk KV into private blocks (private placement) need
  every chunk of a request in the host store before the request is tracked. A
  missing chunk is compiled once into temporary blocks the worker saves from after the forward.
* ``TierTransfers``: with the LMCache tier configured, a chunk missing from the pool but in the
  tier is loaded (when loading beats compiling) into new canonical blocks, and a compile's
  canonical KV may be written through to the tier.

Both issue extra sequences of the step, within the step's compile room.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from ascend_mepic.core.chunk_cache import ChunkCache, ChunkState
from ascend_mepic.core.counters import MepicCounters
from ascend_mepic.core.identity import ChunkId
from ascend_mepic.core.kv_settings import KVSettings
from ascend_mepic.core.plan import ChunkCompile, TierLoad
from ascend_mepic.core.segments import Layout, Segment, build_layout
from ascend_mepic.core.step_room import StepRoom
from ascend_mepic.vllm_integration.core_types import BlockPool, KVCacheBlock, Request

logger = logging.getLogger(__name__)


class HostStoreStaging:
    """Stores the chunks a loading policy copies from, before their requests are tracked."""

    def __init__(
        self,
        settings: KVSettings,
        room: StepRoom,
        counters: MepicCounters,
        block_pool: BlockPool,
        chunk_cache: ChunkCache,
        watermark_blocks: int,
    ) -> None:
        self.settings = settings
        self.room = room
        self.counters = counters
        self.block_pool = block_pool
        self.chunk_cache = chunk_cache
        self.watermark_blocks = watermark_blocks
        # Host-store compiles in flight: chunk -> temporary blocks, freed once the step ran.
        self.pending: dict[ChunkId, list[KVCacheBlock]] = {}

    def chunks_stored(self, chunk_ids: dict[int, ChunkId | None]) -> bool:
        """Whether every chunk a loading policy copies from is in the host store."""
        store = self.settings.store
        return all(c is None or store.contains(c) for c in chunk_ids.values())

    def stage(self, request: Request, layout: Layout, chunk_ids: dict[int, ChunkId | None]) -> bool:
        """Make sure the chunks a loading policy copies from are in the host store.

        ``layout`` and ``chunk_ids`` are the request's ``inspect`` result (computed once at
        arrival). Issues the missing chunks' compiles (within this step's compile room, into
        temporary blocks the worker saves from after the forward pass); True once all are stored.
        """
        policy, store = self.settings.policy, self.settings.store
        ready = True
        for span in layout.chunk_spans:
            chunk_id = chunk_ids[span.segment]
            if chunk_id is None or store.contains(chunk_id):
                continue
            ready = False
            if chunk_id in self.pending:
                continue
            tokens = layout.chunk_tokens(span)
            # The store keeps the chunk's padded layout (front pad, whole blocks), whatever
            # layout the request uses; loads copy its tokens to wherever the request keeps them.
            num_blocks = -(-len(tokens) // layout.block_size)
            dummy = (self.settings.dummy_token_id,) * policy.dummy_tokens
            table_len = num_blocks + (1 if dummy else 0)
            if not self.room.fits(len(tokens) + len(dummy), 1):
                self.counters.admissions_deferred += 1
                self.room.defer(len(tokens) + len(dummy), 1)  # room is kept in the next step
                continue
            if not self.chunk_cache.make_room(table_len, self.watermark_blocks):
                self.counters.admissions_deferred += 1
                continue
            blocks = self.block_pool.get_new_blocks(table_len)
            self.pending[chunk_id] = blocks
            alone = [Segment.prompt(dummy)] if dummy else []
            alone.append(Segment.chunk(tokens))
            compile_ = ChunkCompile(
                chunk_id,
                tokens,
                tuple(b.block_id for b in blocks),
                build_layout(alone, layout.block_size, allow_trailing_chunk=True),
                dummy_tokens=dummy,
                store_blocks=num_blocks,
                store_scores=policy.needs_scores,
            )
            self.room.add_compiles(request.request_id, [compile_])
            self.counters.tokens_computed += len(tokens) + len(dummy)
            self.counters.chunk_misses += 1
        return ready

    def step_finished(self) -> None:
        """The step ran: the worker saved the pending compiles, their blocks are free again."""
        for blocks in self.pending.values():
            self.block_pool.free_blocks(blocks)
        self.pending = {}

    def num_blocks(self) -> int:
        return sum(len(b) for b in self.pending.values())


class TierTransfers:
    """Load-or-compute decisions, loads and write-through puts for the off-device tier."""

    def __init__(
        self,
        settings: KVSettings,
        room: StepRoom,
        counters: MepicCounters,
        block_pool: BlockPool,
        chunk_cache: ChunkCache,
        watermark_blocks: int,
    ) -> None:
        self.settings = settings
        self.room = room
        self.counters = counters
        self.block_pool = block_pool
        self.chunk_cache = chunk_cache
        self.watermark_blocks = watermark_blocks
        self.step_loads: list[TierLoad] = []
        self.in_flight: dict[str, tuple[TierLoad, KVCacheBlock]] = {}  # io id -> load, scratch
        self._load_seq = 0

    def wanted(self, chunk_ids: dict[int, ChunkId | None], count: bool = False) -> bool:
        """Must a request wait for tier loads? (a chunk of it is loading, or is missing from
        the pool but in the tier, where loading beats compiling). ``count``: record decisions."""
        tier = self.settings.tier
        if tier is None:
            return False
        wanted = False
        for chunk_id in {c for c in chunk_ids.values() if c is not None}:
            entry = self.chunk_cache.lookup(chunk_id)
            if entry is not None:
                wanted |= entry.state is ChunkState.LOADING
                continue
            backend = tier.where(chunk_id)
            if backend is None:
                continue
            load = tier.should_load(backend)
            wanted |= load
            if count:
                if load:
                    self.counters.tier_decided_load += 1
                else:
                    self.counters.tier_decided_compute += 1
        return wanted

    def stage_loads(
        self,
        layout: Layout,
        chunk_ids: dict[int, ChunkId | None],
        tenant: str | None = None,
        anchor: tuple[int, ...] = (),
    ) -> None:
        """Issue loads for a staged request's chunks that are in the tier but not in the pool.

        Each load places the chunk's canonical tokens in the chunk arena (state LOADING: no
        request may use them) and takes a scratch block for its 1-token carrier sequence, within
        this step's sequence room and free blocks; a load that does not fit waits for a later
        step. ``layout`` is packed (the tier serves shared placement).
        """
        tier = self.settings.tier
        assert tier is not None
        for span in layout.chunk_spans:
            chunk_id = chunk_ids[span.segment]
            if chunk_id is None or self.chunk_cache.lookup(chunk_id) is not None:
                continue
            backend = tier.where(chunk_id)
            if backend is None or not tier.should_load(backend):
                continue
            num_canonical = span.num_tokens - span.private_tokens
            need = self.chunk_cache.arena.new_blocks_bound(num_canonical) + 1
            if not self.room.fits(1, 1):
                self.counters.admissions_deferred += 1
                self.room.defer(1, 1)  # room is kept in the next step
                continue
            if not self.chunk_cache.make_room(need, self.watermark_blocks):
                self.counters.admissions_deferred += 1
                continue
            entry = self.chunk_cache.create_loading(
                chunk_id, span.num_tokens, num_canonical, tenant,
                token_ids=layout.chunk_tokens(span), anchor=anchor,
            )  # fmt: skip
            scratch = self.block_pool.get_new_blocks(1)[0]
            self._load_seq += 1
            load = TierLoad(
                f"mepic-load-{self._load_seq}-{chunk_id[:16]}",
                chunk_id,
                tuple(entry.block_ids),
                num_canonical,
                scratch.block_id,
                offset=entry.offset,
            )
            self.step_loads.append(load)
            self.in_flight[load.io_id] = (load, scratch)
            self.room.use(1, 1)
            self.counters.tier_loads_issued += 1

    def take_step_loads(self) -> list[TierLoad]:
        out, self.step_loads = self.step_loads, []
        return out

    def step_finished(self, scheduled_ids: Iterable[str]) -> None:
        """Loads that ran in the finished step: verified ones become resident, others are
        dropped (their chunk is compiled by the next request that needs it)."""
        tier = self.settings.tier
        assert tier is not None
        for io_id in [i for i in scheduled_ids if i in self.in_flight]:
            load, scratch = self.in_flight.pop(io_id)
            outcome = tier.dir.take_result(io_id) or {}
            result = outcome.get(load.chunk_id, "error: no result from the worker")
            self.block_pool.free_blocks([scratch])
            entry = self.chunk_cache.lookup(load.chunk_id)
            assert entry is not None and entry.state is ChunkState.LOADING
            self.chunk_cache.finish_loading(entry, ok=result == "ok")
            if result == "ok":
                self.counters.tier_loads += 1
            else:
                tier.failed.add(load.chunk_id)
                self.counters.tier_fallbacks += 1
                # the worker logs refused (unauthenticated) entries once; the rest per chunk
                log = logger.debug if result.startswith("unauthenticated") else logger.warning
                log("MEPIC tier load of %s failed: %s", load.chunk_id[:12], result)

    def wants_offload(self, chunk_id: ChunkId) -> bool:
        """Should this compile's canonical KV go to the tier (write-through on compile)?"""
        tier = self.settings.tier
        if tier is None or tier.config.offload != "compile":
            return False
        if tier.where(chunk_id) is not None:
            return False  # already there (compiled because compiling was cheaper)
        tier.failed.discard(chunk_id)  # a bad entry is replaced by this fresh one
        self.counters.tier_puts_issued += 1
        return True

    def num_blocks(self) -> int:
        """Scratch blocks of loads in flight (their canonical blocks are the chunk cache's)."""
        return len(self.in_flight)
