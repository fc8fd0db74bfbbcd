"""Off-pool canonical chunk KV for private-placement policies (the baselines' chunk store).

EPIC, CacheBlend and CacheTune keep a chunk's precomputed KV outside the device KV pool and copy
it into request-private blocks per request. This store is that place: the worker saves a chunk's
compiled blocks here right after the forward pass that computed them, and copies them into a
request's blocks when the request is first scheduled; the scheduler only asks whether a chunk is
stored (and, for CacheTune, its token scores).

The scheduler and the worker share the store in one process, which vLLM's single-worker ("uni")
executor gives; ``attach_worker`` records that a worker lives here, and private-placement policies
refuse to start without one. The values are opaque to the scheduling path (tensors, on the worker
side). The LMCache tier is meant to implement the same four calls.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from ascend_mepic.identity import ChunkId


@dataclass
class StoredChunk:
    kv: Any  # worker-side tensor [num_layers, num_blocks, *block_shape]
    num_tokens: int
    scores: list[float] | None = None  # CacheTune token scores, when asked for


@dataclass
class StoreStats:
    stored: int = 0
    loads: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0


@dataclass
class HostChunkStore:
    chunks: dict[ChunkId, StoredChunk] = field(default_factory=dict)
    stats: StoreStats = field(default_factory=StoreStats)
    worker_attached: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def put(self, chunk_id: ChunkId, chunk: StoredChunk) -> None:
        with self._lock:
            self.chunks[chunk_id] = chunk
            self.stats.stored += 1
            self.stats.bytes_stored += _nbytes(chunk.kv)

    def get(self, chunk_id: ChunkId) -> StoredChunk | None:
        return self.chunks.get(chunk_id)

    def contains(self, chunk_id: ChunkId) -> bool:
        return chunk_id in self.chunks

    def scores(self, chunk_id: ChunkId) -> list[float] | None:
        chunk = self.chunks.get(chunk_id)
        return chunk.scores if chunk else None

    def record_load(self, chunk: StoredChunk, fraction: float = 1.0) -> None:
        self.stats.loads += 1
        self.stats.bytes_loaded += int(_nbytes(chunk.kv) * fraction)

    def clear(self) -> None:
        with self._lock:
            self.chunks.clear()

    @property
    def num_bytes(self) -> int:
        return sum(_nbytes(c.kv) for c in self.chunks.values())


def _nbytes(kv: Any) -> int:
    return int(kv.numel() * kv.element_size()) if hasattr(kv, "numel") else 0


_STORE = HostChunkStore()


def host_store() -> HostChunkStore:
    """The process's store (shared by the scheduler and an in-process worker)."""
    return _STORE


def attach_worker() -> None:
    _STORE.worker_attached = True
