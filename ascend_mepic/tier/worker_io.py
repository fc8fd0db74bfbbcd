"""Worker side of the LMCache chunk tier: offload canonical chunk KV, load and verify it back.

An entry is one self-describing byte blob in LMCache: an 8-byte header length, a JSON header
(format, chunk identity, dtype, shape, token count) and the payload (the chunk's canonical tokens
of every layer, ``[num_layers, num_tokens, 2, Hkv * D]``, as ``kv_transfer.save_tokens`` cuts
them, wherever the chunk arena placed them). With a tier key (``sealing.py``) the payload is
sealed: AES-256-GCM under the key, the length and header (which names the key and the nonce) as
associated data, the tag after the ciphertext; without one (a private CPU tier, or the
``unauthenticated`` opt-out) the header carries an unkeyed BLAKE2b digest of the plain payload.

A load checks the tag (or the digest), identity, shape and dtype before a single byte reaches
the KV pool; anything else (a miss, a mismatch, an entry no key of this server vouches for, a
backend error) is reported to the scheduler as a failed load, which compiles the chunk instead.
Nothing here raises into the engine: a full tier or a dead remote costs a warning and a counter,
never a request.

Loads run synchronously before the forward pass that first needs them (on CPU nothing overlaps
with compute; layer-wise overlap would need a device stream and is not implemented).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import struct
import time
from collections import Counter, deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ascend_mepic.core.identity import ChunkId
from ascend_mepic.tier import transfer as kv_transfer
from ascend_mepic.tier.index import (
    CPU_BACKEND,
    SHARED_BACKEND,
    TIER_NAMESPACE,
    TierConfig,
    TierDir,
    close_lmcache,
    lmcache_key,
    open_lmcache,
)
from ascend_mepic.tier.sealing import NONCE_BYTES, TAG_BYTES, Keyring, TierKey, UnauthenticatedEntry

logger = logging.getLogger(__name__)

ENTRY_FORMAT = 2  # 2: token-major canonical tokens (1 was whole padded blocks), BLAKE2b digest
SEALED_FORMAT = 3  # ENTRY_FORMAT's payload sealed with AES-256-GCM under a tier key
UNAUTHENTICATED = "unauthenticated"  # the reason (and counter) of an entry no key vouches for
_EMA = 0.3  # weight of the newest cost sample


class TierEntryError(ValueError):
    """A tier entry that must not be used (reason in the message)."""


def _digest(payload: torch.Tensor) -> str:
    return hashlib.blake2b(payload.numpy().data, digest_size=16).hexdigest()


def encode_entry(
    chunk_id: ChunkId, kv: torch.Tensor, num_tokens: int, key: TierKey | None = None
) -> torch.Tensor:
    """The entry of a chunk's KV: sealed under ``key``, or with a digest if None."""
    payload = kv.contiguous().view(torch.uint8).reshape(-1)
    fields: dict[str, Any] = {
        "format": ENTRY_FORMAT if key is None else SEALED_FORMAT,
        "chunk_id": chunk_id,
        "dtype": str(kv.dtype).removeprefix("torch."),
        "shape": list(kv.shape),
        "num_tokens": num_tokens,
    }
    if key is None:
        fields["digest"] = _digest(payload)
    else:
        nonce = key.new_nonce()
        fields.update(key_id=key.key_id, nonce=nonce.hex())
    header = json.dumps(fields).encode()
    header += b" " * (-(8 + len(header)) % 16)  # the payload starts 16-byte aligned
    head = struct.pack("<Q", len(header)) + header
    body = payload.numel() + (0 if key is None else TAG_BYTES)
    blob = torch.empty(len(head) + body, dtype=torch.uint8)
    blob[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    if key is None:
        blob[len(head) :] = payload
    else:
        key.seal_into(nonce, payload.numpy(), head, blob[len(head) :].numpy())
    return blob


def _open(raw: torch.Tensor, head: int, header: dict[str, Any], keyring: Keyring) -> torch.Tensor:
    """The plain payload of a sealed entry (TierEntryError "unauthenticated: ..." if no key of
    ``keyring`` vouches for it)."""
    if header.get("format") != SEALED_FORMAT:
        raise TierEntryError(f"{UNAUTHENTICATED}: not sealed (format {header.get('format')})")
    key = keyring.find(str(header.get("key_id")))
    if key is None:
        raise TierEntryError(f"{UNAUTHENTICATED}: sealed under another key")
    try:
        nonce = bytes.fromhex(str(header.get("nonce")))
    except ValueError:
        nonce = b""
    sealed = raw[head:]
    if len(nonce) != NONCE_BYTES or sealed.numel() < TAG_BYTES:
        raise TierEntryError(f"{UNAUTHENTICATED}: malformed seal")
    plain = torch.empty(sealed.numel() - TAG_BYTES, dtype=torch.uint8)
    try:
        key.open_into(nonce, sealed.numpy(), raw[:head].numpy().tobytes(), plain.numpy())
    except UnauthenticatedEntry as e:
        raise TierEntryError(f"{UNAUTHENTICATED}: {e}") from None
    return plain


def decode_entry(
    blob: torch.Tensor,
    chunk_id: ChunkId,
    shape: Sequence[int],
    dtype: torch.dtype,
    keyring: Keyring | None = None,
) -> torch.Tensor:
    """The entry's KV, after checking it is exactly what was asked for (TierEntryError if not).

    With a ``keyring`` only an entry sealed under one of its keys is opened, and the checks
    read the header the tag vouches for; without one only an unsealed entry is read."""
    raw = blob.reshape(-1)
    if raw.numel() < 8:
        raise TierEntryError("corrupt: truncated header")
    (n,) = struct.unpack("<Q", bytes(raw[:8].tolist()))
    if n > raw.numel() - 8:
        raise TierEntryError("corrupt: header length")
    try:
        header = json.loads(raw[8 : 8 + n].numpy().tobytes())
    except ValueError as e:
        raise TierEntryError("corrupt: header") from e
    if not isinstance(header, dict):
        raise TierEntryError("corrupt: header")
    if keyring is not None:
        payload = _open(raw, 8 + n, header, keyring)
    elif header.get("format") == SEALED_FORMAT:
        # a keyless server cannot vouch for it either: refused, and left for the peers with a key
        raise TierEntryError(f"{UNAUTHENTICATED}: sealed under a tier key, this server has none")
    else:
        payload = raw[8 + n :]
    if header.get("format") not in (ENTRY_FORMAT, SEALED_FORMAT):
        raise TierEntryError(f"mismatch: format {header.get('format')}")
    if header.get("chunk_id") != chunk_id:
        raise TierEntryError("mismatch: chunk identity")
    if header.get("dtype") != str(dtype).removeprefix("torch.") or header.get("shape") != list(
        shape
    ):
        raise TierEntryError(f"mismatch: {header.get('dtype')} {header.get('shape')}")
    if keyring is None and _digest(payload) != header.get("digest"):
        raise TierEntryError("corrupt: digest")
    if payload.numel() != math.prod(shape) * dtype.itemsize:
        raise TierEntryError("corrupt: payload size")
    return payload.view(dtype).reshape(tuple(shape))


class WorkerTier:
    """Puts and verified loads of chunk KV through LMCache, with the costs ``auto`` needs."""

    def __init__(self, config: TierConfig, root: Path, model_name: str) -> None:
        self.config = config
        self.dir = TierDir(root)
        self.keyring = config.keyring(warn=True)
        self.lmcache = open_lmcache(config, model_name, True)
        self.counters: Counter[str] = Counter()
        self._refusal_logged = False  # refused entries are logged once, then only counted
        self.load_cost: dict[str, float] = {}  # backend -> seconds per token (EMA)
        self.compute_cost: float | None = None  # seconds per computed token (EMA)
        # Keys of the latest puts: LMCache writes them to a shared backend in the background,
        # and ``close`` waits for those still on their way.
        self._recent_puts: deque[Any] = deque(maxlen=256)

    @staticmethod
    def _ema(old: float | None, new: float) -> float:
        return new if old is None else (1 - _EMA) * old + _EMA * new

    def put(self, chunk_id: ChunkId, kv: torch.Tensor, num_tokens: int) -> None:
        from lmcache.v1.memory_management import MemoryFormat

        try:
            sealer = self.keyring.sealer if self.keyring is not None else None
            blob = encode_entry(chunk_id, kv, num_tokens, sealer)
            size = torch.Size([blob.numel()])
            obj = self.lmcache.allocate(size, torch.uint8, MemoryFormat.KV_2LTD)
            if obj is None:
                raise RuntimeError("LMCache CPU backend is full")
            obj.tensor.copy_(blob)
            key = lmcache_key(chunk_id, TIER_NAMESPACE)
            self.lmcache.batched_put([key], [obj])
        except Exception as e:
            logger.warning("MEPIC tier: could not offload chunk %s: %s", chunk_id[:12], e)
            self.counters["put_failures"] += 1
            return
        self.dir.marker(chunk_id).touch()
        if self.config.shared_url:
            self._recent_puts.append(key)
        self.counters["puts"] += 1
        self.counters["bytes_stored"] += int(blob.numel())
        if CPU_BACKEND not in self.load_cost:  # calibrate the CPU tier's transfer cost once
            self._calibrate(chunk_id, kv, num_tokens)

    def _calibrate(self, chunk_id: ChunkId, kv: torch.Tensor, num_tokens: int) -> None:
        key = lmcache_key(chunk_id, TIER_NAMESPACE)
        start = time.perf_counter()
        obj = self.lmcache.get(key, location=CPU_BACKEND)
        if obj is None:
            return
        try:
            decode_entry(obj.tensor, chunk_id, kv.shape, kv.dtype, self.keyring).clone()
        except TierEntryError as e:  # another entry under the key: loads will tell
            logger.debug("MEPIC tier: no calibration on chunk %s: %s", chunk_id[:12], e)
            return
        finally:
            obj.ref_count_down()
        self.load_cost[CPU_BACKEND] = (time.perf_counter() - start) / max(1, num_tokens)

    def load(
        self,
        chunk_id: ChunkId,
        caches: Sequence[torch.Tensor],
        block_ids: Sequence[int],
        num_tokens: int,
        offset: int,
        block_size: int,
    ) -> str:
        """Copy a chunk's canonical tokens from the tier into ``block_ids`` from slot ``offset``
        on: "ok" or a reason."""
        key = lmcache_key(chunk_id, TIER_NAMESPACE)
        width = caches[0].numel() // (caches[0].shape[0] * 2 * block_size)
        shape = (len(caches), num_tokens, 2, width)
        start = time.perf_counter()
        try:
            backend = self.lmcache.contains(key)
            obj = self.lmcache.get(key, location=backend) if backend else None
            if obj is None:
                raise TierEntryError("miss")
            try:
                kv = decode_entry(obj.tensor, chunk_id, shape, caches[0].dtype, self.keyring)
                kv_transfer.load_tokens(caches, kv, block_ids, offset, block_size)
                nbytes = int(obj.tensor.numel())
            finally:
                obj.ref_count_down()
        except Exception as e:
            reason = str(e) if isinstance(e, TierEntryError) else f"error: {e}"
            kind = reason.split(":", 1)[0]
            self.counters[f"fallback_{kind}"] += 1
            self.counters["fallbacks"] += 1
            if kind == UNAUTHENTICATED:
                self._refused(chunk_id, key, reason)
            else:
                logger.warning(
                    "MEPIC tier: chunk %s not loaded (%s); compiling it instead",
                    chunk_id[:12], reason,
                )  # fmt: skip
                self._forget(chunk_id, key)
            return reason
        cost = (time.perf_counter() - start) / max(1, num_tokens)
        self.load_cost[backend] = self._ema(self.load_cost.get(backend), cost)
        self.counters["loads"] += 1
        self.counters[f"loads_{backend}"] += 1
        self.counters["bytes_loaded"] += nbytes
        return "ok"

    def _refused(self, chunk_id: ChunkId, key: Any, reason: str) -> None:
        """An entry no key of this server vouches for: logged once, counted always. It stays in
        the shared backend (a server given the wrong key must not delete its peers' entries),
        where the compile's put replaces it with this server's sealed entry; it leaves the CPU
        backend (which keeps a copy of what it fetched, and ignores a put of a key it holds)."""
        self.dir.marker(chunk_id).unlink(missing_ok=True)
        try:
            self.lmcache.remove(key, locations=[CPU_BACKEND])
        except Exception as e:
            logger.debug("MEPIC tier: could not drop %s from the CPU tier: %s", chunk_id[:12], e)
        log = logger.debug if self._refusal_logged else logger.warning
        self._refusal_logged = True
        log(
            "MEPIC tier: refused chunk %s (%s): forged, altered, sealed under a key this server "
            "does not hold, or unsealed; compiling it instead. Further refusals are counted "
            "(tier_worker_fallback_unauthenticated), not logged: check that every server "
            "sharing the tier holds the same tier key",
            chunk_id[:12], reason,
        )  # fmt: skip

    def _forget(self, chunk_id: ChunkId, key: Any) -> None:
        self.dir.marker(chunk_id).unlink(missing_ok=True)
        try:
            self.lmcache.remove(key)
        except Exception as e:  # remote backends may not support removal
            logger.debug("MEPIC tier: could not remove %s: %s", chunk_id[:12], e)

    def note_compute(self, seconds: float, tokens: int) -> None:
        self.compute_cost = self._ema(self.compute_cost, seconds / tokens)

    def publish(self) -> None:
        """Costs and counters for the scheduler (auto decision, metrics)."""
        self.dir.write_worker(
            {
                "time": time.time(),
                "load_s_per_token": self.load_cost,
                "compute_s_per_token": self.compute_cost,
                "counters": dict(self.counters),
            }
        )

    def flush(self, timeout_s: float = 10.0) -> int:
        """Wait up to ``timeout_s`` for the latest puts to reach the shared backend; returns how
        many had not (a dead remote answers "absent": its wait lasts the whole timeout).

        Why: LMCache writes a put to a remote or disk backend in the background. A server
        stopped right after a request would otherwise drop the chunks it just computed, and the
        other servers on that backend would compute them again."""
        deadline = time.monotonic() + timeout_s
        pending = list(self._recent_puts)
        while pending and time.monotonic() < deadline:
            pending = [key for key in pending if not self._in_shared(key)]
            if pending:
                time.sleep(0.05)
        if pending:
            logger.warning(
                "MEPIC tier: %d chunk puts had not reached %s after %.0f s",
                len(pending), self.config.shared_url, timeout_s,
            )  # fmt: skip
        self._recent_puts.clear()
        return len(pending)

    def close(self) -> None:
        """Flush the latest puts to the shared backend, then close LMCache."""
        self.flush()
        close_lmcache(self.lmcache)

    def _in_shared(self, key: Any) -> bool:
        return bool(self.lmcache.contains(key, search_range=[SHARED_BACKEND]))
