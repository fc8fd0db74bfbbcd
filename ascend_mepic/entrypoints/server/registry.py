"""Chunks registered through ``POST /v1/chunks``, counted by holder, in the API server process.

A registered chunk is pinned in the engine and named by a content id, which prompts reference as
``<<<MEPIC_CHUNK_REF:id>>>``. The registry keeps the pin state and the holder count in step.
"""

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

from ascend_mepic.entrypoints.server.text_segments import CHUNK_REF_CLOSE, CHUNK_REF_OPEN


@dataclass(frozen=True)
class RegisteredChunk:
    id: str
    token_ids: tuple[int, ...]
    cache_salt: str | None
    created: float
    # The prompt before the chunk in the requests that use it: under ``chunk_anchor: prefix``
    # the chunk is compiled, and pinned, after it (under ``first``, if it is the engine's first).
    prefix: tuple[int, ...] = ()


def chunk_ref_id(
    token_ids: Sequence[int], cache_salt: str | None, prefix: Sequence[int] = ()
) -> str:
    """Registry id of a chunk: a hash of (salt, tokens[, prefix]), so tenants' ids never collide
    and, under ``chunk_anchor: prefix``, a chunk registered for another prefix (another anchored
    chunk) is another entry (the caller passes no prefix otherwise)."""
    h = hashlib.sha256(b"ascend-mepic-chunk-ref-v1\0")
    h.update(b"\0" if cache_salt is None else b"\1" + cache_salt.encode() + b"\0")
    h.update(",".join(map(str, token_ids)).encode())
    if prefix:
        h.update(b"\0prefix:" + ",".join(map(str, prefix)).encode())
    return h.hexdigest()[:32]


def chunk_ref(chunk_id: str) -> str:
    """The text that stands for a registered chunk inside a prompt."""
    return f"{CHUNK_REF_OPEN}{chunk_id}{CHUNK_REF_CLOSE}"


class ChunkRegistry:
    """Registered chunks by id, each with a count of its registrations (holders).

    A chunk's id comes from its content, so clients registering the same document share one
    entry: every registration adds a holder and every delete drops one; the entry leaves the
    registry (and the engine unpins the chunk) only when the last holder deletes it. Register and
    release of one id are serialized by a per-id lock held across the engine's pin/unpin call, so
    the engine's pin state always matches the registry; other ids are not held up.
    """

    def __init__(self) -> None:
        self._chunks: dict[str, RegisteredChunk] = {}
        self._holders: dict[str, int] = {}
        self._locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}  # lock, [users]

    def get(self, chunk_id: str) -> RegisteredChunk | None:
        return self._chunks.get(chunk_id)

    def values(self) -> list[RegisteredChunk]:
        return list(self._chunks.values())

    def holders(self, chunk_id: str) -> int:
        return self._holders.get(chunk_id, 0)

    def __contains__(self, chunk_id: object) -> bool:
        return chunk_id in self._chunks

    def __len__(self) -> int:
        return len(self._chunks)

    @contextlib.asynccontextmanager
    async def _locked(self, chunk_id: str) -> AsyncIterator[None]:
        lock, users = self._locks.setdefault(chunk_id, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if users[0] == 0:
                del self._locks[chunk_id]

    async def register(
        self, chunk: RegisteredChunk, pin: Callable[[RegisteredChunk], Awaitable[None]]
    ) -> tuple[RegisteredChunk, int]:
        """Add a holder of ``chunk``, pinning it first when it has none; (entry, holders).

        Only the first holder pins (the chunk stays pinned while held); if pinning fails
        nothing is registered.
        """
        async with self._locked(chunk.id):
            current = self._chunks.get(chunk.id)
            if current is None:
                await pin(chunk)
                current = self._chunks[chunk.id] = chunk
            self._holders[chunk.id] = self._holders.get(chunk.id, 0) + 1
            return current, self._holders[chunk.id]

    async def release(
        self, chunk_id: str, unpin: Callable[[RegisteredChunk], Awaitable[None]]
    ) -> tuple[RegisteredChunk, int] | None:
        """Drop a holder of ``chunk_id``; (entry, holders left), or None if it is not registered.

        The last holder's release unpins the chunk and only then removes it: if unpinning fails
        the chunk stays registered with its holder, so the delete can be retried.
        """
        async with self._locked(chunk_id):
            chunk = self._chunks.get(chunk_id)
            if chunk is None:
                return None
            left = self._holders[chunk_id] - 1
            if left == 0:
                await unpin(chunk)
                del self._chunks[chunk_id], self._holders[chunk_id]
            else:
                self._holders[chunk_id] = left
            return chunk, left
