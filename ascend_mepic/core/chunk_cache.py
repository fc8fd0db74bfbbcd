"""The chunk cache coordinator and the chunk LRU, on top of vLLM's own BlockPool.

A resident chunk owns its canonical blocks (every block of the chunk after the first) inside the
same BlockPool as vLLM's prefix cache. Reference counting has two layers, both on vLLM's
``KVCacheBlock.ref_cnt``:

* residency: a resident chunk holds one reference on each of its blocks, so they never enter
  vLLM's free queue while the chunk is resident, even with no request using it;
* use: every request whose block table contains the chunk holds one more reference per block
  (taken with ``BlockPool.touch``, dropped by vLLM's ordinary ``free`` of the request's blocks).

``ChunkEntry.refs`` counts the requests (occurrences) using the chunk. A chunk whose ``refs`` drops
to zero stays resident and moves to the ``ChunkLRU``; under memory pressure whole chunks are
evicted from it, least recently released first, by dropping their residency reference.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from ascend_mepic.core.identity import ChunkId


class ChunkState(str, enum.Enum):
    PENDING = "pending"  # blocks allocated, compile scheduled in the current step
    READY = "ready"  # canonical KV computed
    LOADING = "loading"  # blocks allocated, KV being loaded from the tier (unusable until READY)


@dataclass(eq=False)
class ChunkEntry:
    chunk_id: ChunkId
    num_tokens: int
    blocks: list[KVCacheBlock]
    state: ChunkState = ChunkState.PENDING
    owner: str | None = None  # request that compiles it while PENDING
    refs: int = 0
    pinned: bool = False

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]


class ChunkLRU:
    """Resident chunks with zero references and no pin, least recently released first."""

    def __init__(self) -> None:
        self._idle: OrderedDict[ChunkId, ChunkEntry] = OrderedDict()
        self.num_blocks = 0

    def __len__(self) -> int:
        return len(self._idle)

    def __contains__(self, entry: ChunkEntry) -> bool:
        return self._idle.get(entry.chunk_id) is entry

    def add(self, entry: ChunkEntry) -> None:
        assert entry.refs == 0 and not entry.pinned and entry not in self
        self._idle[entry.chunk_id] = entry
        self.num_blocks += len(entry.blocks)

    def discard(self, entry: ChunkEntry) -> None:
        if entry in self:
            del self._idle[entry.chunk_id]
            self.num_blocks -= len(entry.blocks)

    def oldest_first(self) -> Iterable[ChunkEntry]:
        return list(self._idle.values())

    def evictable_blocks(self, protect: Iterable[ChunkEntry] = ()) -> int:
        return self.num_blocks - sum(len(e.blocks) for e in set(protect) if e in self)


@dataclass
class ChunkCacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    evicted_blocks: int = 0
    dropped_pending: int = 0


class ChunkCache:
    """Chunk identity -> resident canonical blocks, reference counts and whole-chunk eviction."""

    def __init__(self, block_pool: BlockPool) -> None:
        self.block_pool = block_pool
        self.entries: dict[ChunkId, ChunkEntry] = {}
        self.lru = ChunkLRU()
        self.stats = ChunkCacheStats()
        self._pending: list[ChunkEntry] = []

    def lookup(self, chunk_id: ChunkId) -> ChunkEntry | None:
        return self.entries.get(chunk_id)

    def create(self, chunk_id: ChunkId, num_tokens: int, num_blocks: int, owner: str) -> ChunkEntry:
        """Allocate canonical blocks for a first-time chunk; they carry the residency reference."""
        assert chunk_id not in self.entries
        entry = ChunkEntry(chunk_id, num_tokens, self.block_pool.get_new_blocks(num_blocks))
        entry.owner = owner
        self.entries[chunk_id] = entry
        self._pending.append(entry)
        return entry

    def create_loading(self, chunk_id: ChunkId, num_tokens: int, num_blocks: int) -> ChunkEntry:
        """Allocate canonical blocks for a chunk the worker loads from the tier this step."""
        assert chunk_id not in self.entries
        entry = ChunkEntry(chunk_id, num_tokens, self.block_pool.get_new_blocks(num_blocks))
        entry.state = ChunkState.LOADING
        self.entries[chunk_id] = entry
        return entry

    def finish_loading(self, entry: ChunkEntry, ok: bool) -> None:
        """A verified load makes the chunk resident (idle until used); a failed one is dropped."""
        assert entry.state is ChunkState.LOADING and entry.refs == 0
        if ok:
            entry.state = ChunkState.READY
            if not entry.pinned:
                self.lru.add(entry)
            return
        del self.entries[entry.chunk_id]
        self.block_pool.free_blocks(entry.blocks)

    def acquire(self, entry: ChunkEntry) -> None:
        """One more request uses the chunk (the caller touches the blocks themselves)."""
        self.lru.discard(entry)
        entry.refs += 1

    def release(self, entry: ChunkEntry) -> None:
        assert entry.refs > 0, f"chunk {entry.chunk_id[:12]} released more often than acquired"
        entry.refs -= 1
        if entry.refs == 0 and not entry.pinned and self.entries.get(entry.chunk_id) is entry:
            self.lru.add(entry)

    def commit_pending(self) -> list[ChunkEntry]:
        """Mark every chunk compiled in the previous step READY (its KV is now in the cache)."""
        done, self._pending = self._pending, []
        for entry in done:
            entry.state = ChunkState.READY
            entry.owner = None
        return done

    def drop_pending(self, owner: str) -> None:
        """The request that was to compile these chunks left before its step ran: forget them."""
        for entry in [e for e in self._pending if e.owner == owner]:
            self._pending.remove(entry)
            del self.entries[entry.chunk_id]
            self.stats.dropped_pending += 1
            self.block_pool.free_blocks(entry.blocks)

    def pin(self, entry: ChunkEntry) -> None:
        self.lru.discard(entry)
        entry.pinned = True

    def unpin(self, entry: ChunkEntry) -> None:
        if not entry.pinned:
            return
        entry.pinned = False
        if entry.refs == 0:
            self.lru.add(entry)

    def evict(self, entry: ChunkEntry) -> None:
        assert entry.refs == 0 and not entry.pinned
        self.lru.discard(entry)
        del self.entries[entry.chunk_id]
        self.stats.evictions += 1
        self.stats.evicted_blocks += len(entry.blocks)
        self.block_pool.free_blocks(entry.blocks)

    def evict_until_free(self, num_free: int, protect: Iterable[ChunkEntry] = ()) -> None:
        """Evict whole idle chunks, oldest first, until the pool has ``num_free`` free blocks."""
        protected = set(protect)
        for entry in self.lru.oldest_first():
            if self.block_pool.get_num_free_blocks() >= num_free:
                return
            if entry not in protected:
                self.evict(entry)

    def evict_all_idle(self) -> None:
        for entry in self.lru.oldest_first():
            self.evict(entry)

    def num_blocks(self, referenced: bool) -> int:
        """Canonical blocks of chunks in use (or pinned) if ``referenced``, else of idle ones."""
        idle = self.lru.num_blocks
        return sum(len(e.blocks) for e in self.entries.values()) - idle if referenced else idle

    def num_pinned_blocks(self) -> int:
        return sum(len(e.blocks) for e in self.entries.values() if e.pinned)

    @property
    def pending(self) -> list[ChunkEntry]:
        return list(self._pending)
