"""Tier keys: sealed entries, what a server refuses, rotation, and the keyless shared tier's
refusal (no engine: entry codecs and WorkerTiers on a real LMCache disk backend in tmp folders)."""

from __future__ import annotations

import json
import logging
import secrets
import struct
import time

import pytest
import torch

from ascend_mepic.config import MepicConfig
from ascend_mepic.tier.index import TierConfig, TierDir
from ascend_mepic.tier.sealing import TAG_BYTES, Keyring, TierKey
from ascend_mepic.tier.worker_io import (
    SEALED_FORMAT,
    TierEntryError,
    WorkerTier,
    decode_entry,
    encode_entry,
)
from tests.tier.conftest import write_key_file

CHUNK = "ab" * 32
OTHER = "cd" * 32
KEY_A, KEY_B = secrets.token_hex(32), secrets.token_hex(32)


def _ring(*keys: str) -> Keyring:
    return Keyring(tuple(TierKey.from_hex(k) for k in keys))


def _header(blob: torch.Tensor) -> tuple[int, dict]:
    (n,) = struct.unpack("<Q", bytes(blob[:8].tolist()))
    return 8 + n, json.loads(blob[8 : 8 + n].numpy().tobytes())


def _entry(header: dict, body: torch.Tensor) -> torch.Tensor:
    """An entry with ``header`` (padded as the codec pads) and ``body``, as a forger makes it."""
    raw = json.dumps(header).encode()
    raw += b" " * (-(8 + len(raw)) % 16)
    head = torch.frombuffer(bytearray(struct.pack("<Q", len(raw)) + raw), dtype=torch.uint8)
    return torch.cat([head, body.reshape(-1)])


def test_a_sealed_entry_opens_only_under_its_key_and_hides_the_kv():
    kv = torch.randn(2, 70, 2, 32)
    ring = _ring(KEY_A)
    blob = encode_entry(CHUNK, kv, 70, ring.sealer)
    head, header = _header(blob)
    assert header["format"] == SEALED_FORMAT and header["key_id"] == ring.sealer.key_id
    assert "digest" not in header and blob.numel() == head + kv.numel() * 4 + TAG_BYTES
    plain = kv.view(torch.uint8).reshape(-1)
    assert not torch.equal(blob[head : head + plain.numel()], plain)  # a reader learns nothing
    assert torch.equal(decode_entry(blob, CHUNK, kv.shape, kv.dtype, ring), kv)
    # two seals of one chunk differ (a fresh nonce each)
    assert not torch.equal(encode_entry(CHUNK, kv, 70, ring.sealer), blob)

    def refused(entry: torch.Tensor, keyring: Keyring | None = ring) -> str:
        with pytest.raises(TierEntryError) as e:
            decode_entry(entry, CHUNK, kv.shape, kv.dtype, keyring)
        return str(e.value)

    assert refused(blob, _ring(KEY_B)) == "unauthenticated: sealed under another key"
    assert refused(blob, None).startswith("unauthenticated: sealed under a tier key, this")
    altered = blob.clone()
    altered[-TAG_BYTES - 5] ^= 1
    assert refused(altered) == "unauthenticated: tag does not verify"
    # the header is bound: one changed field (same length) fails the tag too
    swapped = _entry({**header, "num_tokens": 71}, blob[head:])
    assert refused(swapped) == "unauthenticated: tag does not verify"
    # another chunk's valid entry stored under this chunk's key: authentic, but not this chunk
    other = encode_entry(OTHER, kv, 70, ring.sealer)
    assert refused(other) == "mismatch: chunk identity"


def test_forged_entries_are_refused():
    """A forger who can write the tier but lacks the key: an unsealed entry with a correct
    digest, a payload swapped under a recomputed digest, or its own seal naming our key id."""
    kv, forged_kv = torch.randn(2, 70, 2, 32), torch.zeros(2, 70, 2, 32)
    ring = _ring(KEY_A)

    def refused(entry: torch.Tensor) -> str:
        with pytest.raises(TierEntryError) as e:
            decode_entry(entry, CHUNK, kv.shape, kv.dtype, ring)
        return str(e.value)

    assert refused(encode_entry(CHUNK, forged_kv, 70)) == "unauthenticated: not sealed (format 2)"
    sealed = encode_entry(CHUNK, kv, 70, ring.sealer)
    head, header = _header(sealed)
    swapped = _entry(header, torch.cat([forged_kv.view(torch.uint8).reshape(-1), sealed[-16:]]))
    assert refused(swapped) == "unauthenticated: tag does not verify"
    own = encode_entry(CHUNK, forged_kv, 70, TierKey.from_hex(KEY_B))
    own_head, own_header = _header(own)
    impostor = _entry({**own_header, "key_id": ring.sealer.key_id}, own[own_head:])
    assert refused(impostor) == "unauthenticated: tag does not verify"
    assert refused(_entry({**header, "nonce": "00"}, sealed[head:])).endswith("malformed seal")


def test_key_files_and_variables(tmp_path, monkeypatch, caplog):
    path = tmp_path / "tier.key"
    path.write_text(f"# new key first\n{KEY_B}\n\n{KEY_A.upper()}  # the old one\n{KEY_B}\n")
    path.chmod(0o600)
    with caplog.at_level(logging.WARNING):
        ring = Keyring.load(str(path), warn=True)
    assert ring is not None and [k.key_id for k in ring.keys] == [
        _ring(KEY_B).sealer.key_id,
        _ring(KEY_A).sealer.key_id,
    ]  # the first seals, both open, the repeat dropped
    assert not caplog.records
    path.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        Keyring.load(str(path), warn=True)
    assert "chmod 600" in caplog.text and "644" in caplog.text
    assert KEY_A not in caplog.text and KEY_B not in caplog.text

    monkeypatch.setenv("MEPIC_TEST_TIER_KEY", KEY_A)
    both = Keyring.load(str(path), "MEPIC_TEST_TIER_KEY")
    assert both is not None and both.sealer.key_id == ring.sealer.key_id  # the file's first
    assert Keyring.load() is None

    def error(**kwargs: str) -> str:
        with pytest.raises(ValueError) as e:
            Keyring.load(**kwargs)
        assert KEY_A not in str(e.value)
        return str(e.value)

    (tmp_path / "bad.key").write_text(f"{KEY_A}\n{KEY_A[:-2]}\n")
    message = error(key_file=str(tmp_path / "bad.key"))
    assert "bad.key" in message and "line 2" in message and "64 hex characters" in message
    assert "secrets.token_hex(32)" in message
    (tmp_path / "empty.key").write_text("# nothing yet\n")
    assert "holds no key" in error(key_file=str(tmp_path / "empty.key"))
    assert "cannot read it" in error(key_file=str(tmp_path / "missing.key"))
    assert "is not set" in error(key_env="MEPIC_TEST_NO_SUCH_VARIABLE")
    monkeypatch.setenv("MEPIC_TEST_TIER_KEY", "secret")
    assert "not a key" in error(key_env="MEPIC_TEST_TIER_KEY")


def test_a_shared_tier_without_a_key_refuses_to_start(tmp_path):
    key = write_key_file(tmp_path / "tier.key")
    for shared in ({"disk": "/x"}, {"remote": "redis://h:1"}, {"lmcache": {"remote_url": "x"}}):
        with pytest.raises(ValueError) as e:
            TierConfig.parse(shared)
        assert "secrets.token_hex(32)" in str(e.value) and "key_file" in str(e.value)
        assert '"unauthenticated": true' in str(e.value)
        assert TierConfig.parse({**shared, "unauthenticated": True}).keyring() is None
        assert TierConfig.parse({**shared, "key_file": key}).keyring() is not None
    with pytest.raises(ValueError, match="needs a key"):  # the server's own parse says so too
        MepicConfig.from_additional_config({"mepic": {"tier": {"remote": "redis://h:1"}}})
    with pytest.raises(ValueError, match="not both"):
        TierConfig.parse({"disk": "/x", "key_file": key, "unauthenticated": True})
    with pytest.raises(ValueError, match="tier.key_file .*missing.key.*cannot read"):
        TierConfig.parse({"disk": "/x", "key_file": str(tmp_path / "missing.key")})
    assert TierConfig.parse({"cpu_gib": 1}).keyring() is None  # a private CPU tier: no key


def test_the_remote_url_reads_its_password_from_the_environment(monkeypatch):
    monkeypatch.setenv("MEPIC_TEST_REDIS_PASSWORD", "s3cret")
    url = "rediss://mepic:${MEPIC_TEST_REDIS_PASSWORD}@10.0.0.5:6379"
    config = TierConfig.parse({"remote": url, "unauthenticated": True})
    assert config.remote == url  # what vLLM logs: the placeholder
    assert config.lmcache_dict(True)["remote_url"] == "rediss://mepic:s3cret@10.0.0.5:6379"


def test_tier_directories_the_server_makes_are_private(tmp_path):
    assert TierDir(tmp_path / "store" / "tier").root.stat().st_mode & 0o777 == 0o700
    (tmp_path / "operator").mkdir(mode=0o750)
    (tmp_path / "operator").chmod(0o750)
    TierDir(tmp_path / "operator")  # one that exists keeps the operator's mode
    assert (tmp_path / "operator").stat().st_mode & 0o777 == 0o750


def _tier(tmp_path, name: str, key_file: str | None) -> WorkerTier:
    """A server's worker tier on the disk tier ``tmp_path / "shared"``."""
    auth = {"key_file": key_file} if key_file else {"unauthenticated": True}
    config = TierConfig.parse({"cpu_gib": 0.05, "disk": str(tmp_path / "shared"), **auth})
    return WorkerTier(config, tmp_path / name, "tiny")


def _caches() -> list[torch.Tensor]:
    return [torch.zeros(4, 2, 32, 4, 8) for _ in range(2)]  # 2 layers, 4 blocks of 32 tokens


def test_servers_share_sealed_entries_and_refuse_the_others(tmp_path, caplog):
    """Servers on one disk tier: the same key shares, another key or a keyless forger's entry is
    refused (counted, logged once, left in place, nothing reaches the pool), and rotation."""
    old = write_key_file(tmp_path / "old.key", KEY_A)
    new = write_key_file(tmp_path / "new.key", KEY_B)
    wrong = write_key_file(tmp_path / "wrong.key")
    rotating = write_key_file(tmp_path / "rotating.key", KEY_B, KEY_A)
    kv, kv2 = torch.randn(2, 70, 2, 32), torch.randn(2, 70, 2, 32)
    tiers = {}
    try:
        for name, key in (("a", old), ("b", old), ("c", wrong), ("d", rotating), ("e", new)):
            tiers[name] = _tier(tmp_path, name, key)
        tiers["forger"] = _tier(tmp_path, "forger", None)
        assert (tmp_path / "shared").stat().st_mode & 0o777 == 0o700
        a, b, c, d, e = (tiers[n] for n in "abcde")
        a.put(CHUNK, kv, 70)
        assert a.flush() == 0
        caches = _caches()
        assert b.load(CHUNK, caches, [1, 2, 3], 70, 0, 32) == "ok"  # same key: shared
        assert b.counters["loads_RemoteBackend"] == 1
        assert torch.equal(caches[0][1, :, :, :].transpose(0, 1).reshape(32, 2, 32), kv[0, :32])

        # another key: nothing loads, nothing reaches the pool, the entry stays for its peers
        caches = _caches()
        with caplog.at_level(logging.WARNING, logger="ascend_mepic.tier.worker_io"):
            assert c.load(CHUNK, caches, [1, 2, 3], 70, 0, 32).startswith("unauthenticated")
            tiers["forger"].put(OTHER, torch.zeros(2, 70, 2, 32), 70)  # unsealed, digest fine
            assert tiers["forger"].flush() == 0
            unsealed = c.load(OTHER, caches, [1, 2, 3], 70, 0, 32)
        assert unsealed == "unauthenticated: not sealed (format 2)"
        assert not any(t.any() for t in caches)
        assert c.counters["fallback_unauthenticated"] == 2 and c.counters["loads"] == 0
        refusals = [r for r in caplog.records if "refused chunk" in r.getMessage()]
        assert len(refusals) == 1  # logged once, then counted
        assert b.load(CHUNK, _caches(), [1, 2, 3], 70, 0, 32) == "ok"  # still there for b

        # rotation: new key first, old second: reads the old entries, seals with the new key
        assert d.load(CHUNK, _caches(), [1, 2, 3], 70, 0, 32) == "ok"
        d.put(OTHER, kv2, 70)  # replaces the forger's entry
        assert d.flush() == 0  # sees the key exist: the forger's, until d's write lands
        deadline = time.monotonic() + 30
        while (got := e.load(OTHER, _caches(), [1, 2, 3], 70, 0, 32)) != "ok":
            assert got.startswith("unauthenticated")  # the forger's, or d's half written
            assert time.monotonic() < deadline, "d's entry never replaced the forger's"
            time.sleep(0.05)
        other_key = a.load(OTHER, _caches(), [1, 2, 3], 70, 0, 32)
        assert other_key == "unauthenticated: sealed under another key"
        assert d.keyring is not None and d.keyring.sealer.key_id == e.keyring.sealer.key_id

        # c compiles what it refused: its put replaces the refused copy its CPU tier fetched
        c.put(CHUNK, kv, 70)
        assert c.load(CHUNK, _caches(), [1, 2, 3], 70, 0, 32) == "ok"
    finally:
        for tier in tiers.values():
            tier.close()
