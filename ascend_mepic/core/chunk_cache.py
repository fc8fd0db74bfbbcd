"""The chunk cache coordinator, the chunk arena and the chunk LRU, on vLLM's own BlockPool.

A resident chunk's canonical tokens (all but the few its requests compute in context) live in
the same BlockPool as vLLM's prefix cache, packed back to back with other chunks' by the
``ChunkArena``: a chunk starts where the previous one ended, so one block may hold the tail of
one chunk and the head of the next. Reference counting has two layers, both on vLLM's
``KVCacheBlock.ref_cnt``:

* residency: a resident chunk holds one reference on each block it touches, so a block never
  enters vLLM's free queue while any chunk in it is resident, even with no request using it; it
  is freed when the last chunk using it is evicted;
* use: every request whose block table lists a block holds one more reference per listing
  (taken with ``BlockPool.touch``, dropped by vLLM's ordinary ``free`` of the request's blocks).

``ChunkEntry.refs`` counts the requests (occurrences) using the chunk. A chunk whose ``refs`` drops
to zero stays resident and moves to the ``ChunkLRU``; under memory pressure whole chunks are
evicted from it, least recently released first, by dropping their residency reference.
"""

from __future__ import annotations

import enum
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ascend_mepic.core.identity import ChunkId
from ascend_mepic.vllm_integration.core_types import BlockPool, KVCacheBlock

if TYPE_CHECKING:
    from ascend_mepic.core.chunk_events import ChunkEvents


class ChunkState(str, enum.Enum):
    PENDING = "pending"  # blocks allocated, compile scheduled in the current step
    READY = "ready"  # canonical KV computed
    LOADING = "loading"  # blocks allocated, KV being loaded from the tier (unusable until READY)


@dataclass(eq=False)
class ChunkEntry:
    chunk_id: ChunkId
    num_tokens: int
    blocks: list[KVCacheBlock]
    offset: int = 0  # slot of the first canonical token in ``blocks[0]``
    num_canonical: int = 0  # canonical tokens stored (the chunk's tokens after its private ones)
    state: ChunkState = ChunkState.PENDING
    owner: str | None = None  # request that compiles it while PENDING
    refs: int = 0
    pinned: bool = False
    tenant: str | None = None  # the cache salt (tenants never share a block)
    token_ids: tuple[int, ...] = ()  # the chunk's tokens (all of them), for its KV events
    anchor: tuple[int, ...] = ()  # the tokens it is compiled after (``Policy.anchor_tokens``)

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]


class ChunkArena:
    """Packs chunks' canonical tokens back to back into shared blocks.

    The *open* block is the last block placed, with its free tail; the next chunk starts there.
    Each chunk takes one residency reference on every block it touches. Once every chunk in the
    open block is gone the block is free again and the next chunk starts a new one. Tenants
    (cache salts) never share a block: each has its own open block.
    """

    def __init__(self, block_pool: BlockPool, block_size: int) -> None:
        self.block_pool = block_pool
        self.block_size = block_size
        self.open_blocks: dict[str | None, tuple[KVCacheBlock, int]] = {}  # tenant -> (block, fill)

    @property
    def open(self) -> KVCacheBlock | None:
        """The default tenant's open block (for tests and operators)."""
        found = self.open_blocks.get(None)
        return found[0] if found else None

    def new_blocks_bound(self, num_tokens: int) -> int:
        """New blocks that placing ``num_tokens`` canonical tokens takes, at most, whatever
        happens to the open block before (an eviction may free it)."""
        return -(-num_tokens // self.block_size)

    def place(self, num_tokens: int, tenant: str | None) -> tuple[list[KVCacheBlock], int]:
        """Blocks for ``num_tokens`` canonical tokens and the slot they start at in the first."""
        bs = self.block_size
        self.forget_freed()
        found = self.open_blocks.pop(tenant, None)
        if found is not None:
            blocks, offset = [found[0]], found[1]
            self.block_pool.touch([found[0]])
            rest = num_tokens - (bs - offset)
        else:
            blocks, offset, rest = [], 0, num_tokens
        if rest > 0:
            blocks.extend(self.block_pool.get_new_blocks(-(-rest // bs)))
        end = (offset + num_tokens) % bs
        if end:
            self.open_blocks[tenant] = (blocks[-1], end)
        return blocks, offset

    def forget_freed(self) -> None:
        """An open block whose chunks were all evicted is free again: forget it at once, before
        the pool hands it to anyone else."""
        for tenant, (block, _) in list(self.open_blocks.items()):
            if block.ref_cnt == 0:
                del self.open_blocks[tenant]


class ChunkLRU:
    """Resident chunks with zero references and no pin, least recently released first."""

    def __init__(self) -> None:
        self._idle: OrderedDict[ChunkId, ChunkEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._idle)

    def __contains__(self, entry: ChunkEntry) -> bool:
        return self._idle.get(entry.chunk_id) is entry

    def add(self, entry: ChunkEntry) -> None:
        assert entry.refs == 0 and not entry.pinned and entry not in self
        self._idle[entry.chunk_id] = entry

    def discard(self, entry: ChunkEntry) -> None:
        if entry in self:
            del self._idle[entry.chunk_id]

    def oldest_first(self) -> Iterable[ChunkEntry]:
        return list(self._idle.values())

    def evictable_blocks(self, protect: Iterable[ChunkEntry] = ()) -> int:
        """Blocks evicting every idle chunk but ``protect`` would free: those no live chunk,
        pinned chunk or request also holds (packed chunks share blocks)."""
        protected = set(protect)
        holders: Counter[int] = Counter()
        blocks: dict[int, KVCacheBlock] = {}
        for entry in self._idle.values():
            if entry not in protected:
                for block in entry.blocks:
                    holders[block.block_id] += 1
                    blocks[block.block_id] = block
        return sum(1 for bid, n in holders.items() if blocks[bid].ref_cnt == n)


@dataclass
class ChunkCacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    evicted_blocks: int = 0
    dropped_pending: int = 0
    moves: int = 0


class ChunkCache:
    """Chunk identity -> resident canonical blocks, reference counts and whole-chunk eviction."""

    def __init__(self, block_pool: BlockPool, block_size: int) -> None:
        self.block_pool = block_pool
        self.arena = ChunkArena(block_pool, block_size)
        self.residents: Counter[int] = Counter()  # block id -> chunks stored in it
        self.entries: dict[ChunkId, ChunkEntry] = {}
        self.lru = ChunkLRU()
        self.stats = ChunkCacheStats()
        self._pending: list[ChunkEntry] = []
        # Block id -> pinned chunks stored in it: read at every request's arrival, so kept as
        # chunks are pinned, unpinned, moved or dropped rather than counted over every chunk;
        # the same per tenant, for the per-salt pin quota.
        self._pinned: Counter[int] = Counter()
        self._pinned_by_tenant: dict[str | None, Counter[int]] = {}
        # Pin requests admitted but not yet pinned: request id -> (tenant, blocks at most), so
        # two registrations in flight together cannot both pass the quota.
        self._pin_reserved: dict[str, tuple[str | None, int]] = {}
        # Residency as vLLM KV events (set by the KV manager): a chunk ready, a chunk evicted.
        self.events: ChunkEvents | None = None

    def lookup(self, chunk_id: ChunkId) -> ChunkEntry | None:
        return self.entries.get(chunk_id)

    def _place(
        self,
        chunk_id: ChunkId,
        num_tokens: int,
        num_canonical: int,
        tenant: str | None,
        token_ids: tuple[int, ...],
        anchor: tuple[int, ...],
    ) -> ChunkEntry:
        assert chunk_id not in self.entries and 0 < num_canonical <= num_tokens
        blocks, offset = self.arena.place(num_canonical, tenant)
        self.residents.update(b.block_id for b in blocks)
        entry = ChunkEntry(
            chunk_id, num_tokens, blocks, offset, num_canonical, tenant=tenant,
            token_ids=token_ids, anchor=anchor,
        )  # fmt: skip
        self.entries[chunk_id] = entry
        return entry

    def create(
        self,
        chunk_id: ChunkId,
        num_tokens: int,
        num_canonical: int,
        owner: str,
        tenant: str | None = None,
        token_ids: tuple[int, ...] = (),
        anchor: tuple[int, ...] = (),
    ) -> ChunkEntry:
        """Place a first-time chunk's canonical tokens; its blocks carry the residency reference.
        ``token_ids`` (the chunk's) and ``anchor`` name it in its KV events."""
        entry = self._place(chunk_id, num_tokens, num_canonical, tenant, token_ids, anchor)
        entry.owner = owner
        self._pending.append(entry)
        return entry

    def create_loading(
        self,
        chunk_id: ChunkId,
        num_tokens: int,
        num_canonical: int,
        tenant: str | None = None,
        token_ids: tuple[int, ...] = (),
        anchor: tuple[int, ...] = (),
    ) -> ChunkEntry:
        """Place a chunk the worker loads from the tier this step."""
        entry = self._place(chunk_id, num_tokens, num_canonical, tenant, token_ids, anchor)
        entry.state = ChunkState.LOADING
        return entry

    def _free(self, entry: ChunkEntry) -> None:
        if entry.pinned:  # a pinned chunk dropped before its compile ran, or a failed load
            self._count_pinned(entry, -1)
        self._unrecord(entry.blocks)
        self.block_pool.free_blocks(entry.blocks)
        self.arena.forget_freed()

    def _unrecord(self, blocks: list[KVCacheBlock]) -> None:
        self.residents.subtract(b.block_id for b in blocks)
        for b in blocks:
            if self.residents[b.block_id] <= 0:
                del self.residents[b.block_id]

    def in_use(self, block: KVCacheBlock) -> bool:
        """Whether a request lists this block (beyond the chunks stored in it)."""
        return block.ref_cnt > self.residents.get(block.block_id, 0)

    def worth_moving(self, entry: ChunkEntry, tenant: str | None) -> bool:
        """Should an idle chunk about to be used again move to the tenant's open block?

        Used in place, each of its blocks that nobody uses now (its neighbours are idle too)
        becomes a used block carrying idle data; moved, it takes new blocks packed after the
        chunks placed last, which are usually in use. Move when that costs no more blocks: live
        chunks then gather, and idle ones are left in blocks nobody uses.
        """
        if entry.refs or entry.state is not ChunkState.READY:
            return False
        bs = self.arena.block_size
        self.arena.forget_freed()
        found = self.arena.open_blocks.get(tenant)
        if found is not None and any(b is found[0] for b in entry.blocks):
            return False  # it was placed last: it is already where a move would put it
        benefit = sum(1 for b in entry.blocks if not self.in_use(b))
        if found is None:
            cost = -(-entry.num_canonical // bs)
        else:
            block, fill = found
            cost = -(-(fill + entry.num_canonical) // bs) - (1 if self.in_use(block) else 0)
        return benefit >= cost

    def move(self, entry: ChunkEntry, tenant: str | None) -> tuple[list[KVCacheBlock], int]:
        """Place an idle chunk anew; returns its old (blocks, offset). The caller holds the old
        blocks' residency references until the worker has copied the KV, then frees them."""
        assert entry.refs == 0 and entry.state is ChunkState.READY
        old = (entry.blocks, entry.offset)
        self._unrecord(entry.blocks)
        if entry.pinned:
            self._count_pinned(entry, -1)
        entry.blocks, entry.offset = self.arena.place(entry.num_canonical, tenant)
        self.residents.update(b.block_id for b in entry.blocks)
        if entry.pinned:
            self._count_pinned(entry, 1)
        self.stats.moves += 1
        return old

    def finish_loading(self, entry: ChunkEntry, ok: bool) -> None:
        """A verified load makes the chunk resident (idle until used); a failed one is dropped."""
        assert entry.state is ChunkState.LOADING and entry.refs == 0
        if ok:
            entry.state = ChunkState.READY
            if not entry.pinned:
                self.lru.add(entry)
            if self.events is not None:
                self.events.stored(entry)
            return
        del self.entries[entry.chunk_id]
        self._free(entry)

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
            if self.events is not None:
                self.events.stored(entry)
        return done

    def drop_pending(self, owner: str) -> None:
        """The request that was to compile these chunks left before its step ran: forget them."""
        for entry in [e for e in self._pending if e.owner == owner]:
            self._pending.remove(entry)
            del self.entries[entry.chunk_id]
            self.stats.dropped_pending += 1
            self._free(entry)

    def pin(self, entry: ChunkEntry) -> None:
        self.lru.discard(entry)
        if not entry.pinned:
            self._count_pinned(entry, 1)
        entry.pinned = True

    def unpin(self, entry: ChunkEntry) -> None:
        if not entry.pinned:
            return
        self._count_pinned(entry, -1)
        entry.pinned = False
        if entry.refs == 0:
            self.lru.add(entry)

    def unpin_all(self, chunk_ids: Iterable[ChunkId]) -> int:
        """Unpin each resident, pinned chunk of ``chunk_ids``; returns how many were."""
        count = 0
        for chunk_id in chunk_ids:
            entry = self.entries.get(chunk_id)
            if entry is not None and entry.pinned:
                self.unpin(entry)
                count += 1
        return count

    def evict(self, entry: ChunkEntry) -> None:
        assert entry.refs == 0 and not entry.pinned
        self.lru.discard(entry)
        del self.entries[entry.chunk_id]
        self.stats.evictions += 1
        if self.events is not None and entry.state is ChunkState.READY:
            self.events.removed(entry)
        before = self.block_pool.get_num_free_blocks()
        self._free(entry)
        self.stats.evicted_blocks += self.block_pool.get_num_free_blocks() - before

    def make_room(self, need: int, reserved: int, protect: Iterable[ChunkEntry] = ()) -> bool:
        """``need`` free blocks beside ``reserved``, evicting idle chunks (not ``protect``) if
        that suffices; False, with nothing evicted, if even evicting every idle chunk would not:
        an admission then waits rather than evicting chunks for nothing."""
        protect = list(protect)
        free = self.block_pool.get_num_free_blocks() - reserved
        if need <= free:
            return True
        if need > free + self.lru.evictable_blocks(protect):
            return False
        self.evict_until_free(need + reserved, protect)
        return True

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
        """Distinct canonical blocks of chunks in use (or pinned) if ``referenced``; else the
        blocks only idle chunks hold (a block shared with a live chunk counts as live)."""
        live = {b.block_id for e in self.entries.values() if e not in self.lru for b in e.blocks}
        if referenced:
            return len(live)
        idle = {b.block_id for e in self.lru.oldest_first() for b in e.blocks}
        return len(idle - live)

    def _count_pinned(self, entry: ChunkEntry, delta: int) -> None:
        tenant = self._pinned_by_tenant.setdefault(entry.tenant, Counter())
        for pinned in (self._pinned, tenant):
            for b in entry.blocks:
                n = pinned[b.block_id] + delta
                if n:
                    pinned[b.block_id] = n
                else:
                    del pinned[b.block_id]
        if not tenant:
            del self._pinned_by_tenant[entry.tenant]

    def num_pinned_blocks(self, tenant: str | None = None, *, all_tenants: bool = True) -> int:
        """Distinct blocks holding a pinned chunk, of every tenant or of ``tenant`` (kept up to
        date, not counted here)."""
        if all_tenants:
            return len(self._pinned)
        return len(self._pinned_by_tenant.get(tenant, ()))

    def max_tenant_pinned_blocks(self) -> int:
        """The pinned blocks of the tenant that pins the most."""
        return max((len(c) for c in self._pinned_by_tenant.values()), default=0)

    def pin_growth(self, chunks: list[tuple[ChunkId, int]]) -> int:
        """Blocks, at most, that pinning these (identity, canonical tokens) chunks adds to the
        pinned ones: a resident chunk's blocks not pinned yet; a new chunk's whole placement
        (its blocks, plus the open block it may start in)."""
        seen: set[int] = set()
        need = 0
        for chunk_id, num_canonical in chunks:
            entry = self.entries.get(chunk_id)
            if entry is None:
                need += self.arena.new_blocks_bound(num_canonical) + 1
                continue
            fresh = {b.block_id for b in entry.blocks} - set(self._pinned) - seen
            seen |= fresh
            need += len(fresh)
        return need

    def reserve_pins(self, request_id: str, tenant: str | None, num_blocks: int) -> None:
        self._pin_reserved[request_id] = (tenant, num_blocks)

    def release_pins(self, request_id: str) -> None:
        self._pin_reserved.pop(request_id, None)

    def reserved_pins(self, tenant: str | None = None, *, all_tenants: bool = True) -> int:
        """Blocks reserved by pin requests admitted but not yet pinned."""
        return sum(n for t, n in self._pin_reserved.values() if all_tenants or t == tenant)

    def slot_utilisation(self) -> float:
        """Canonical tokens stored / slots of the blocks holding them (1.0: no padding)."""
        blocks = {b.block_id for e in self.entries.values() for b in e.blocks}
        tokens = sum(e.num_canonical for e in self.entries.values())
        return tokens / (len(blocks) * self.arena.block_size) if blocks else 0.0

    @property
    def pending(self) -> list[ChunkEntry]:
        return list(self._pending)
