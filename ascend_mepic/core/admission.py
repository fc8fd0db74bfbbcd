"""Admission and allocation of MEPIC requests (Algorithm 1), in vLLM's one BlockPool.

A request's first allocation covers its whole layout at once, or nothing (it keeps waiting).
Two placements, two classes, chosen once from the policy by the KV manager:

* shared placement (MEPIC): ``PackedAdmission`` (packed_admission.py), the packed layout, chunks'
  canonical blocks referenced from the chunk cache;
* private placement (the baselines) and none: ``PaddedAdmission`` (padded_admission.py), the
  padded layout, every chunk token in the request's private blocks.

Here is what both share: room-making (idle chunks are evicted, whole, least recently released
first, only when the free blocks do not suffice), each chunk occurrence's residency, the
step's host loads and chunk moves, and release. Later steps (decode, the rest of a split prefill)
grow the table with private blocks. The table lives in vLLM's own single-type manager, so
``get_blocks`` and ``free`` work unchanged.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable

from vllm.v1.core.kv_cache_manager import KVCacheBlocks

from ascend_mepic.core.chunk_cache import ChunkCache, ChunkEntry, ChunkState
from ascend_mepic.core.counters import MepicCounters
from ascend_mepic.core.identity import ChunkId
from ascend_mepic.core.kv_settings import KVSettings
from ascend_mepic.core.plan import ChunkMove, HostLoad, Residency
from ascend_mepic.core.policies import Placement
from ascend_mepic.core.request_intake import RequestState
from ascend_mepic.core.step_room import StepRoom
from ascend_mepic.vllm_integration.core_types import (
    BlockPool,
    KVCacheBlock,
    Request,
    SingleTypeKVCacheManager,
)


class Admission(ABC):
    """Allocates, grows, prefix-caches and releases the block tables of MEPIC requests; one
    subclass per placement."""

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
        """``KVCacheManager.allocate_slots`` for a tracked request: its new blocks, or None. The
        first allocation admits the whole layout, later ones grow it, as the placement does."""
        total_computed = request.num_computed_tokens + num_new_computed_tokens
        num_blocks = self._num_blocks(st, total_computed + num_new_tokens + num_lookahead_tokens)
        if not st.allocated:
            hits = list(new_computed_blocks.blocks[0]) if new_computed_blocks else []
            # As vLLM does, keep a watermark free when admitting beside running requests.
            headroom = reserved_blocks + (self.watermark_blocks if has_scheduled_reqs else 0)
            new_blocks = self.admit(request, st, hits, num_blocks, headroom)
        else:
            new_blocks = self.grow(request, st, num_blocks, reserved_blocks)
        if new_blocks is not None and not delay_cache_blocks:
            self.cache(request, st, min(total_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    @abstractmethod
    def _num_blocks(self, st: RequestState, num_tokens: int) -> int:
        """The blocks the request's private table needs for its first ``num_tokens`` tokens
        (as vLLM counts them)."""

    @abstractmethod
    def longest_hit(self, request: Request, st: RequestState) -> list[KVCacheBlock]:
        """``KVCacheManager.get_computed_blocks`` for a tracked request: its leading blocks
        already in vLLM's prefix cache (the last prompt token is always recomputed)."""

    @abstractmethod
    def hit_tokens(self, st: RequestState, num_hits: int) -> int:
        """The in-context tokens the first ``num_hits`` prefix-cache hits hold (what
        ``get_computed_blocks`` reports as computed)."""

    @abstractmethod
    def admit(
        self,
        request: Request,
        st: RequestState,
        hits: list[KVCacheBlock],
        num_blocks: int,
        reserved: int,
    ) -> list[KVCacheBlock] | None:
        """First allocation: the whole layout at once (``hits`` are its leading prefix-cache
        hits), or nothing (None: the request keeps waiting)."""

    @abstractmethod
    def grow(
        self, request: Request, st: RequestState, num_blocks: int, reserved: int
    ) -> list[KVCacheBlock] | None:
        """Later steps (decode, or the rest of a split prefill): more private blocks, or None."""

    @abstractmethod
    def cache(self, request: Request, st: RequestState, num_computed_tokens: int) -> None:
        """``KVCacheManager.cache_blocks``: the request's full private blocks up to its first
        ``num_computed_tokens`` (as vLLM counts them) into vLLM's prefix cache."""

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

    def take_moves(self) -> list[ChunkMove]:
        """Chunk relocations issued in this step, once."""
        out, self.moves = self.moves, []
        return out

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
