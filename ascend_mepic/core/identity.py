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
import re
import struct
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from blake3 import blake3

logger = logging.getLogger(__name__)

ChunkId = str

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
WEIGHTS_DIGEST_TAG = b"mepic-weights-v2"


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


def _hash_file(path: Path) -> tuple[int, bytes]:
    """(size, BLAKE3 of the content): memory-mapped, hashed on every core (the GIL released)."""
    size = path.stat().st_size
    if size == 0:
        return 0, blake3(b"").digest()
    return size, blake3(max_threads=blake3.AUTO).update_mmap(path).digest()


def _hash_weight_files(files: Sequence[tuple[str, Path]]) -> str:
    """BLAKE3 over every file's name, size and content digest ("v2": v1 was one SHA-256 stream,
    minutes for a 70B model; a changed tag changes every chunk id, so tier entries written under
    v1 are never found, not misread). Files are hashed concurrently, each one multi-threaded."""
    with ThreadPoolExecutor(max_workers=min(4, max(1, len(files)))) as pool:
        digests = list(pool.map(_hash_file, [path for _, path in files]))
    h = blake3(WEIGHTS_DIGEST_TAG)
    for (name, _), (size, digest) in zip(files, digests, strict=True):
        encoded = name.encode()
        h.update(struct.pack("<QQ", len(encoded), size))
        h.update(encoded)
        h.update(digest)
    return h.hexdigest()


def hub_snapshot_commit(root: Path) -> str | None:
    """The commit of a Hugging Face cache snapshot (``models--org--name/snapshots/<commit>``).

    Its files are links to blobs named by their content, fixed by the commit, so the commit
    names the weights without reading them.
    """
    if (
        root.parent.name == "snapshots"
        and root.parent.parent.name.startswith("models--")
        and re.fullmatch(r"[0-9a-f]{40}", root.name)
    ):
        return root.name
    return None


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
    snapshot = _cached_snapshot(model_path, revision)
    if snapshot is not None:
        return _commit_digest(snapshot)
    logger.warning(
        "MEPIC: %s is not a local directory and not in the Hugging Face cache; its chunk "
        "identity relies on the revision (%s) naming the weights, not on their content",
        model_path,
        revision or "none given",
    )
    return hashlib.sha256(f"hub:{model_path}{revision}".encode()).hexdigest()


def _cached_snapshot(repo_id: str, revision: str) -> Path | None:
    """The snapshot of ``repo_id`` at ``revision`` in the local Hugging Face cache, if there."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, "config.json", revision=revision or None)
    except Exception:  # not a repo id, no cache: no commit to reuse
        return None
    if not isinstance(found, str):
        return None
    snapshot = Path(found).absolute().parent
    return snapshot if hub_snapshot_commit(snapshot) else None


def _commit_digest(snapshot: Path) -> str:
    """A snapshot's digest: its repository folder (``models--org--name``) and commit."""
    name = f"{snapshot.parent.parent.name}@{snapshot.name}"
    return hashlib.sha256(WEIGHTS_DIGEST_TAG + b":hub-commit:" + name.encode()).hexdigest()


def weights_digest(model_path: str, revision: str | None = None) -> str:
    """A digest of a model's weights (*.safetensors, *.bin, *.pt, *.gguf and config.json).

    A Hugging Face cache snapshot (``.../models--org--name/snapshots/<commit>``), or a hub id
    whose snapshot is in the local cache, is named by its commit: nothing is read. Another local
    directory is hashed by content once (BLAKE3, in parallel); the digest is cached in memory and
    under ``~/.cache/ascend_mepic/weights-digest/``, keyed by the directory and each file's name,
    size and mtime, so a changed file is hashed again. The model directory itself is never
    written. A hub id not in the cache names the id and ``revision`` only (a warning says so).
    """
    root = Path(model_path)
    if not root.is_dir():
        return _hub_digest(model_path, revision or "")
    if hub_snapshot_commit(root.absolute()):  # a hub snapshot: its commit names the weights
        return _commit_digest(root.absolute())
    root = root.resolve()
    files = _weight_files(root)
    key = hashlib.sha256(WEIGHTS_DIGEST_TAG + str(root).encode())  # v1's cached digests: unused
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
    anchor: Sequence[int] = (),
) -> ChunkId:
    """SHA-256 hex digest of (salt, model fingerprint, block size, tokens[, anchor]).

    ``anchor``: the tokens the chunk is compiled after (``Policy.anchor_tokens``): its canonical
    KV depends on them, so they are part of its identity. Without one the digest is the one
    earlier versions gave, so tier entries of unanchored chunks stay valid.

    Named again for every request that carries the chunk, so recent identities are kept by
    token content: a repeated chunk costs one dict lookup, not a pack and a hash.
    """
    return _cached_identity(
        tuple(token_ids), block_size, model_fingerprint, cache_salt, tuple(anchor)
    )


def _pack_tokens(h: Any, token_ids: tuple[int, ...]) -> None:
    h.update(struct.pack("<Q", len(token_ids)))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))


# Bounded: each entry keeps its chunk's tokens alive.
@functools.lru_cache(maxsize=512)
def _cached_identity(
    token_ids: tuple[int, ...],
    block_size: int,
    model_fingerprint: str,
    cache_salt: str | None,
    anchor: tuple[int, ...],
) -> ChunkId:
    h = hashlib.sha256()
    for part in (b"mepic-chunk-v1", (cache_salt or "").encode(), model_fingerprint.encode()):
        h.update(struct.pack("<Q", len(part)))
        h.update(part)
    h.update(struct.pack("<Q", block_size))
    _pack_tokens(h, token_ids)
    if anchor:
        h.update(b"anchor")
        _pack_tokens(h, anchor)
    return h.hexdigest()
