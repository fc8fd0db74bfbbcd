"""Chunk identity: which cached KV a chunk may share.

Two chunk occurrences may share canonical KV only if everything that determines that KV is equal:
the tokens, the model (weights and dtype), the block size (it fixes the front padding and therefore
which tokens land in the shared blocks) and the tenant's cache salt. The identity is a SHA-256 over
exactly those, so it is independent of where the chunk sits in a prompt.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import struct
import tempfile
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

ChunkId = str

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
_READ_BYTES = 1 << 20


def model_fingerprint(
    model: str, dtype: str, revision: str | None = None, weights: str | None = None
) -> str:
    """A stable name for 'these weights in this dtype' (KV differs across either).

    ``weights`` is :func:`weights_digest` of the model: without it two servers that load different
    weights under the same path (and share a tier) would take each other's chunk KV.
    """
    name = f"{model}@{revision or 'local'}:{dtype}"
    return f"{name}#{weights}" if weights else name


def _weight_files(root: Path) -> list[tuple[str, Path]]:
    """(relative name, path) of the files that fix the weights, sorted; hidden dirs skipped."""
    found = []
    for path in root.rglob("*"):
        rel = path.relative_to(root)
        if any(part.startswith(".") for part in rel.parts):
            continue
        if (path.suffix in WEIGHT_SUFFIXES or rel.as_posix() == "config.json") and path.is_file():
            found.append((rel.as_posix(), path))
    return sorted(found)


def _digest_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "ascend_mepic" / "weights-digest"


def _hash_weight_files(files: Sequence[tuple[str, Path]]) -> str:
    """SHA-256 over every file's name, size and full content (streamed)."""
    h = hashlib.sha256(b"mepic-weights-v1")
    for name, path in files:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            encoded = name.encode()
            h.update(struct.pack("<QQ", len(encoded), size))
            h.update(encoded)
            while chunk := f.read(_READ_BYTES):
                h.update(chunk)
    return h.hexdigest()


@functools.lru_cache(maxsize=64)
def _cached_weights_digest(root: str, key: str, files: tuple[tuple[str, str], ...]) -> str:
    """The digest of ``files`` whose stat ``key`` is given: disk cache, else hash and store."""
    cache = _digest_cache_dir() / f"{key}.json"
    try:
        entry = json.loads(cache.read_text())
        if entry.get("path") == root and isinstance(entry.get("digest"), str):
            return entry["digest"]
    except (OSError, ValueError):
        pass
    logger.info("MEPIC: hashing the weights of %s (%d files) for chunk identity", root, len(files))
    digest = _hash_weight_files([(name, Path(path)) for name, path in files])
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache.parent, prefix=".tmp-")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"path": root, "digest": digest}, f)
        os.replace(tmp, cache)
    except OSError as e:  # a read-only home: hash again next start
        logger.warning("MEPIC: could not cache the weights digest in %s: %s", cache.parent, e)
    return digest


@functools.lru_cache(maxsize=64)
def _hub_digest(model_path: str, revision: str) -> str:
    logger.warning(
        "MEPIC: %s is not a local directory; its chunk identity relies on the revision (%s) "
        "naming the weights, not on their content",
        model_path,
        revision or "none given",
    )
    return hashlib.sha256(f"hub:{model_path}{revision}".encode()).hexdigest()


def weights_digest(model_path: str, revision: str | None = None) -> str:
    """SHA-256 of a model's weights (*.safetensors, *.bin, *.pt, *.gguf and config.json).

    A local directory is hashed by content once; the digest is cached in memory and under
    ``~/.cache/ascend_mepic/weights-digest/``, keyed by the directory and each file's name, size
    and mtime, so a changed file is hashed again. The model directory itself is never written.
    Anything else (a hub id) is not resolved: its digest names the id and ``revision`` only.
    """
    root = Path(model_path)
    if not root.is_dir():
        return _hub_digest(model_path, revision or "")
    root = root.resolve()
    files = _weight_files(root)
    key = hashlib.sha256(str(root).encode())
    for name, path in files:
        st = path.stat()
        key.update(json.dumps([name, st.st_size, st.st_mtime_ns]).encode())
    return _cached_weights_digest(
        str(root), key.hexdigest(), tuple((name, str(path)) for name, path in files)
    )


def chunk_identity(
    token_ids: Sequence[int],
    block_size: int,
    model_fingerprint: str,
    cache_salt: str | None = None,
) -> ChunkId:
    """SHA-256 hex digest of (salt, model fingerprint, block size, tokens).

    Named again for every request that carries the chunk, so recent identities are kept by
    token content: a repeated chunk costs one dict lookup, not a pack and a hash.
    """
    return _cached_identity(tuple(token_ids), block_size, model_fingerprint, cache_salt)


# Bounded: each entry keeps its chunk's tokens alive.
@functools.lru_cache(maxsize=512)
def _cached_identity(
    token_ids: tuple[int, ...], block_size: int, model_fingerprint: str, cache_salt: str | None
) -> ChunkId:
    h = hashlib.sha256()
    for part in (b"mepic-chunk-v1", (cache_salt or "").encode(), model_fingerprint.encode()):
        h.update(struct.pack("<Q", len(part)))
        h.update(part)
    h.update(struct.pack("<QQ", block_size, len(token_ids)))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.hexdigest()
