"""Tier keys: the deployment secret that seals and authenticates the chunk tier's entries.

Chunk identities are computable from public data (tokens, model, salt), so an unkeyed digest only
catches a flipped byte: whoever can write a shared tier (a Redis, a disk folder) could store
forged KV under a chunk's key, and whoever can read it reads every tenant's KV. Servers sharing
a tier therefore share a secret: each entry's payload is sealed with AES-256-GCM under it, the
entry's header (format, chunk identity, dtype, shape, token count, key id, nonce) being the
associated data. Without the key one can neither read an entry nor write one a server accepts.

A key is 32 random bytes written as 64 hex characters. Keys come from a file (``tier.key_file``,
one key a line) and/or an environment variable (``tier.key_env``, the variable's *name*; keys
separated by whitespace), never from the config itself, which vLLM logs. The first key seals new
entries; every key listed opens them. Rotation: put the new key first, keep the old one second
while old entries matter, then remove it. An entry names its key by id (a short hash of the key),
so a reader picks the right key without trying each.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported when a key is made: every process reads the config, few seal
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

logger = logging.getLogger(__name__)

NONCE_BYTES = 12  # 96-bit random nonce per entry
TAG_BYTES = 16
MAKE_KEY = (
    "python -c 'import secrets; print(secrets.token_hex(32))' > tier.key && chmod 600 tier.key"
)
_KEY = re.compile(r"[0-9a-fA-F]{64}")
_KEY_FORMAT = "expected 64 hex characters (32 random bytes), one key per line"


class UnauthenticatedEntry(ValueError):
    """An entry no key of this server vouches for (forged, another key's, or altered)."""


def key_id(secret: bytes) -> str:
    """The id an entry names its key by: a short, domain-separated hash of the key."""
    return hashlib.sha256(b"ascend-mepic tier key id\0" + secret).hexdigest()[:16]


@dataclass(frozen=True)
class TierKey:
    """One 256-bit key: seals entries (AES-256-GCM) and opens those sealed under it."""

    key_id: str
    aead: AESGCM = field(repr=False, compare=False)

    @classmethod
    def from_hex(cls, text: str) -> TierKey:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        secret = bytes.fromhex(text)
        return cls(key_id(secret), AESGCM(secret))

    @staticmethod
    def new_nonce() -> bytes:
        return os.urandom(NONCE_BYTES)

    def seal_into(self, nonce: bytes, plain: Any, aad: bytes, out: Any) -> None:
        """Encrypt ``plain`` into ``out`` (``len(plain) + TAG_BYTES`` bytes, the tag last)."""
        self.aead.encrypt_into(nonce, plain, aad, out)

    def open_into(self, nonce: bytes, sealed: Any, aad: bytes, out: Any) -> None:
        """Decrypt ``sealed`` into ``out``; UnauthenticatedEntry if the tag does not verify
        (``out`` then holds garbage the caller must drop)."""
        from cryptography.exceptions import InvalidTag

        try:
            self.aead.decrypt_into(nonce, sealed, aad, out)
        except InvalidTag:
            raise UnauthenticatedEntry("tag does not verify") from None


@dataclass(frozen=True)
class Keyring:
    """The keys a server holds: the first seals, all of them open."""

    keys: tuple[TierKey, ...]

    def __post_init__(self) -> None:
        if not self.keys:
            raise ValueError("a tier keyring needs at least one key")

    @property
    def sealer(self) -> TierKey:
        return self.keys[0]

    def find(self, kid: str) -> TierKey | None:
        return next((k for k in self.keys if k.key_id == kid), None)

    @classmethod
    def load(cls, key_file: str = "", key_env: str = "", warn: bool = False) -> Keyring | None:
        """The keys of ``key_file`` then ``key_env`` (None if neither is given). ValueError
        naming the source for a missing, unreadable, empty or malformed one; ``warn``: log a
        key file that group or others may read."""
        texts: list[str] = []
        if key_file:
            texts += _file_keys(Path(key_file).expanduser(), warn)
        if key_env:
            texts += _env_keys(key_env)
        if not texts:
            return None
        unique = list(dict.fromkeys(t.lower() for t in texts))  # keep order, drop repeats
        return cls(tuple(TierKey.from_hex(t) for t in unique))


def _file_keys(path: Path, warn: bool) -> list[str]:
    where = f"tier.key_file {str(path)!r}"
    try:
        text = path.read_text(encoding="ascii")
        mode = path.stat().st_mode
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) else "not ASCII text"
        raise ValueError(f"{where}: cannot read it ({reason}); make one with: {MAKE_KEY}") from None
    if warn and mode & 0o077:
        logger.warning(
            "MEPIC %s: group or others may access it (mode %o); `chmod 600` it: whoever reads "
            "the key can read and forge the tier's entries",
            where, mode & 0o777,
        )  # fmt: skip
    keys = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if not _KEY.fullmatch(line):
            raise ValueError(
                f"{where}, line {number}: not a key: {_KEY_FORMAT}; make one with: {MAKE_KEY}"
            )
        keys.append(line)
    if not keys:
        raise ValueError(f"{where}: holds no key: {_KEY_FORMAT}; make one with: {MAKE_KEY}")
    return keys


def _env_keys(name: str) -> list[str]:
    where = f"tier.key_env: the environment variable {name!r}"
    value = os.environ.get(name)
    if value is None:
        raise ValueError(f"{where} is not set (key_env names the variable that holds the key)")
    keys = value.replace(",", " ").split()
    if not keys:
        raise ValueError(f"{where} holds no key: {_KEY_FORMAT}")
    for number, text in enumerate(keys, 1):
        if not _KEY.fullmatch(text):
            raise ValueError(f"{where}, key {number}: not a key: {_KEY_FORMAT}")
    return keys
