"""Chunk identity: which cached KV a chunk may share.

Two chunk occurrences may share canonical KV only if everything that determines that KV is equal:
the tokens, the model (weights and dtype), the block size (it fixes the front padding and therefore
which tokens land in the shared blocks) and the tenant's cache salt. The identity is a SHA-256 over
exactly those, so it is independent of where the chunk sits in a prompt.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ChunkId = str


def model_fingerprint(model: str, dtype: str, revision: str | None = None) -> str:
    """A stable name for 'these weights in this dtype' (KV differs across either)."""
    return f"{model}@{revision or 'local'}:{dtype}"


def chunk_identity(
    token_ids: Sequence[int],
    block_size: int,
    model_fingerprint: str,
    cache_salt: str | None = None,
) -> ChunkId:
    """SHA-256 hex digest of (salt, model fingerprint, block size, tokens)."""
    h = hashlib.sha256()
    for part in (b"mepic-chunk-v1", (cache_salt or "").encode(), model_fingerprint.encode()):
        h.update(struct.pack("<Q", len(part)))
        h.update(part)
    h.update(struct.pack("<QQ", block_size, len(token_ids)))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.hexdigest()
