"""Off-pool canonical chunk KV for private-placement policies (the baselines' chunk store).

EPIC, CacheBlend and CacheTune keep a chunk's precomputed KV outside the device KV pool and copy
it into request-private blocks per request. This store is that place: the worker saves a chunk's
compiled blocks here right after the forward pass that computed them, and copies them into a
request's blocks when the request is first scheduled; the scheduler only asks whether a chunk is
stored (and, for CacheTune, its token scores).

vLLM's CPU engine runs its worker in another process than the scheduler, so a stored chunk is also
a file in a host-memory directory (``/dev/shm`` where it exists): ``<chunk id>.json`` (token count
and scores) then ``<chunk id>.pt`` (the KV), each written to a temporary name and renamed, so the
``.pt`` file appearing is the commit. Each process keeps what it read in memory. The directory is
per engine instance and removed when the engine process exits. The LMCache tier is meant to
implement the same calls.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ascend_mepic.core.identity import ChunkId


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
    root: Path
    chunks: dict[ChunkId, StoredChunk] = field(default_factory=dict)
    stats: StoreStats = field(default_factory=StoreStats)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _path(self, chunk_id: ChunkId, suffix: str) -> Path:
        return self.root / f"{chunk_id}{suffix}"

    def put(self, chunk_id: ChunkId, chunk: StoredChunk) -> None:
        import torch

        with self._lock:
            self.chunks[chunk_id] = chunk
            self.stats.stored += 1
            self.stats.bytes_stored += _nbytes(chunk.kv)
        meta = {"num_tokens": chunk.num_tokens, "scores": chunk.scores}
        _atomic_write(self._path(chunk_id, ".json"), lambda f: f.write(json.dumps(meta).encode()))
        _atomic_write(self._path(chunk_id, ".pt"), lambda f: torch.save(chunk.kv, f))

    def contains(self, chunk_id: ChunkId) -> bool:
        return chunk_id in self.chunks or self._path(chunk_id, ".pt").exists()

    def get(self, chunk_id: ChunkId) -> StoredChunk | None:
        chunk = self.chunks.get(chunk_id)
        if chunk is not None or not self.contains(chunk_id):
            return chunk
        import torch

        meta = json.loads(self._path(chunk_id, ".json").read_text())
        kv = torch.load(self._path(chunk_id, ".pt"), map_location="cpu", weights_only=True)
        chunk = StoredChunk(kv, meta["num_tokens"], meta["scores"])
        self.chunks[chunk_id] = chunk
        return chunk

    def scores(self, chunk_id: ChunkId) -> list[float] | None:
        chunk = self.chunks.get(chunk_id)
        if chunk is not None:
            return chunk.scores
        path = self._path(chunk_id, ".json")
        return json.loads(path.read_text())["scores"] if path.exists() else None

    def record_load(self, chunk: StoredChunk, fraction: float = 1.0) -> None:
        self.stats.loads += 1
        self.stats.bytes_loaded += int(_nbytes(chunk.kv) * fraction)

    def num_chunks(self) -> int:
        return len(list(self.root.glob("*.pt")))


def _atomic_write(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _nbytes(kv: Any) -> int:
    return int(kv.numel() * kv.element_size()) if hasattr(kv, "numel") else 0


def default_root(instance_id: str) -> Path:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"ascend_mepic-store-{os.getuid()}-{instance_id}"


_STORES: dict[Path, HostChunkStore] = {}
_OWNED: set[Path] = set()


def host_store(root: str | Path, owner: bool = False) -> HostChunkStore:
    """The store at ``root`` (one object per process); ``owner`` removes it at process exit.

    Ownership is registered even when the store object already exists: with an in-process
    engine the worker (non-owner) opens it before the scheduler (owner) does.
    """
    path = Path(root)
    store = _STORES.get(path)
    if store is None:
        path.mkdir(parents=True, exist_ok=True)
        store = _STORES[path] = HostChunkStore(path)
    if owner and path not in _OWNED:
        _OWNED.add(path)
        atexit.register(shutil.rmtree, path, True)
    return store
