"""Chunk identity covers the model's weights, not just its path (no engine)."""

from __future__ import annotations

import logging
import os
import secrets
import time

import pytest
import torch

from ascend_mepic.core import identity
from ascend_mepic.core.identity import chunk_identity, model_fingerprint, weights_digest
from ascend_mepic.tier.index import CPU_BACKEND, SHARED_BACKEND, TierConfig, TierIndex
from ascend_mepic.tier.transfer import save_tokens
from ascend_mepic.tier.worker_io import WorkerTier

TOKENS = list(range(100, 170))
BLOCK = 16
CONFIG = '{"architectures": ["LlamaForCausalLM"], "hidden_size": 64}'


@pytest.fixture(autouse=True)
def digest_cache(tmp_path, monkeypatch):
    """A private disk cache and empty in-process caches for every test."""
    cache = tmp_path / "xdg-cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    identity._cached_weights_digest.cache_clear()
    identity._hub_digest.cache_clear()
    yield cache / "ascend_mepic" / "weights-digest"
    identity._cached_weights_digest.cache_clear()
    identity._hub_digest.cache_clear()


def make_model(path, weights: bytes, config: str = CONFIG):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(config)
    (path / "model.safetensors").write_bytes(weights)
    (path / "tokenizer.json").write_text("{}")  # not part of the weights
    return path


def fingerprint(path) -> str:
    return model_fingerprint(str(path), "torch.bfloat16", None, weights=weights_digest(str(path)))


def test_fingerprint_is_backward_compatible():
    assert model_fingerprint("m", "float32") == "m@local:float32"
    assert model_fingerprint("m", "float32", "v1") == "m@v1:float32"
    assert model_fingerprint("m", "float32", weights="ab" * 32) == "m@local:float32#" + "ab" * 32


def test_different_weights_give_different_digests_and_chunk_ids(tmp_path):
    a = make_model(tmp_path / "a", b"\x01" * 4096)
    b = make_model(tmp_path / "b", b"\x02" * 4096)
    same = make_model(tmp_path / "same", b"\x01" * 4096)
    da, db, ds = weights_digest(str(a)), weights_digest(str(b)), weights_digest(str(same))
    assert len(da) == 64 and da != db
    assert da == ds  # same names, sizes and bytes: same weights wherever they live
    assert chunk_identity(TOKENS, BLOCK, fingerprint(a)) != chunk_identity(
        TOKENS, BLOCK, fingerprint(b)
    )
    # the tokenizer (or any non-weight file) does not change the identity
    (same / "tokenizer.json").write_text('{"changed": true}')
    identity._cached_weights_digest.cache_clear()
    assert weights_digest(str(same)) == da
    # config.json does
    (same / "config.json").write_text(CONFIG.replace("64", "128"))
    assert weights_digest(str(same)) != da


def test_weight_file_kinds_and_subdirectories_count(tmp_path):
    base = make_model(tmp_path / "m", b"w")
    digest = weights_digest(str(base))
    for name in ("pytorch_model.bin", "extra.pt", "q.gguf", "sub/part.safetensors"):
        (base / name).parent.mkdir(exist_ok=True)
        (base / name).write_bytes(b"x")
        new = weights_digest(str(base))
        assert new != digest, name
        digest = new


def test_editing_a_weight_file_invalidates_the_cache(tmp_path, digest_cache):
    model = make_model(tmp_path / "m", b"\x01" * 4096)
    before = weights_digest(str(model))
    assert weights_digest(str(model)) == before
    (model / "model.safetensors").write_bytes(b"\x01" * 4095 + b"\x09")  # same size, new bytes
    st = (model / "model.safetensors").stat()
    os.utime(model / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    after = weights_digest(str(model))
    assert after != before
    (model / "model.safetensors").write_bytes(b"\x01" * 4096 + b"more")  # size changes too
    assert weights_digest(str(model)) not in (before, after)
    assert len(list(digest_cache.glob("*.json"))) == 3  # one entry per stat key


def test_disk_cache_is_used_and_model_dir_untouched(tmp_path, digest_cache, monkeypatch):
    model = make_model(tmp_path / "m", os.urandom(3 << 20))  # > one 1 MiB read
    listing = sorted(p.name for p in model.iterdir())
    calls = []
    real = identity._hash_weight_files

    def counting(files):
        calls.append([name for name, _ in files])
        return real(files)

    monkeypatch.setattr(identity, "_hash_weight_files", counting)
    first = weights_digest(str(model))
    assert calls == [["config.json", "model.safetensors"]]
    assert len(list(digest_cache.glob("*.json"))) == 1
    assert weights_digest(str(model)) == first and len(calls) == 1  # in-process cache
    identity._cached_weights_digest.cache_clear()  # a new process: only the disk cache is left
    assert weights_digest(str(model)) == first and len(calls) == 1
    assert sorted(p.name for p in model.iterdir()) == listing


def test_unwritable_cache_still_digests(tmp_path, monkeypatch):
    model = make_model(tmp_path / "m", b"w")
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # mkdir under a file fails
    digest = weights_digest(str(model))
    identity._cached_weights_digest.cache_clear()
    assert weights_digest(str(model)) == digest


def test_hub_ids_are_not_resolved(caplog):
    with caplog.at_level(logging.WARNING, logger="ascend_mepic.core.identity"):
        d1 = weights_digest("org/model-does-not-exist-locally", "abc123")
    assert "relies on the revision" in caplog.text
    assert d1 == weights_digest("org/model-does-not-exist-locally", "abc123")
    assert d1 != weights_digest("org/model-does-not-exist-locally", "def456")
    assert d1 != weights_digest("org/other-model", "abc123")


def _wait_for(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_tier_misses_a_chunk_stored_under_other_weights(tmp_path):
    """Two servers, one shared disk tier, the same model path but different weights behind it."""
    model = make_model(tmp_path / "models" / "llama", b"\x01" * 4096)
    id_a = chunk_identity(TOKENS, BLOCK, fingerprint(model))
    (model / "model.safetensors").write_bytes(b"\x02" * 4096 + b"!")  # re-deployed weights
    id_b = chunk_identity(TOKENS, BLOCK, fingerprint(model))
    assert id_a != id_b

    key = tmp_path / "tier.key"  # the key both servers share
    key.write_text(secrets.token_hex(32))
    key.chmod(0o600)
    config = TierConfig.parse(
        {"cpu_gib": 0.05, "disk": str(tmp_path / "shared"), "key_file": str(key)}
    )
    kv = torch.randn(2, len(TOKENS), 2, 4 * 8)  # 2 layers, the chunk's canonical tokens
    writer = WorkerTier(config, tmp_path / "server-a", str(model))
    reader_index = TierIndex(config, tmp_path / "server-b", str(model))
    reader = WorkerTier(config, tmp_path / "server-b", str(model))
    try:
        writer.put(id_a, kv, len(TOKENS))
        assert writer.counters["puts"] == 1
        # server A's scheduler sees its own chunk; server B's finds it in the shared backend
        writer_index = TierIndex(config, tmp_path / "server-a", str(model))
        try:
            assert writer_index.where(id_a) == CPU_BACKEND
            assert writer_index.where(id_b) is None
        finally:
            writer_index.close()
        assert _wait_for(lambda: reader_index.where(id_a) == SHARED_BACKEND)
        # under weights B the same tokens and path name another chunk: the tier misses it
        assert reader_index.where(id_b) is None
        caches = [torch.zeros(8, 2, 16, 4, 8) for _ in range(2)]
        blocks = -(-len(TOKENS) // 16)
        assert reader.load(id_b, caches, list(range(blocks)), len(TOKENS), 0, 16) == "miss"
        assert all(not c.any() for c in caches)  # nothing reached the pool
        # weights A still load (the miss was the identity, not a broken tier)
        order = [3, 1, 4, 0, 6, 2, 5, 7][:blocks]
        assert reader.load(id_a, caches, order, len(TOKENS), 0, 16) == "ok"
        assert torch.equal(save_tokens(caches, order, 0, len(TOKENS), 16), kv)
    finally:
        reader.close()
        reader_index.close()
        writer.close()


def _v1_digest(files) -> str:
    """The digest before v2: one SHA-256 stream over names, sizes and contents."""
    import hashlib
    import struct

    h = hashlib.sha256(b"mepic-weights-v1")
    for name, path in files:
        data = path.read_bytes()
        h.update(struct.pack("<QQ", len(name.encode()), len(data)))
        h.update(name.encode())
        h.update(data)
    return h.hexdigest()


def test_weights_are_hashed_with_blake3_and_v1_identities_are_never_reused(tmp_path, monkeypatch):
    """v2 (BLAKE3, files in parallel) gives other digests than v1 (SHA-256), so chunk ids and
    tier entries made under v1 are not found, rather than misread; a v1 digest cached on disk
    under the same stat key is not used either."""
    model = make_model(tmp_path / "m", os.urandom(1 << 20))
    (model / "model-2.safetensors").write_bytes(b"")  # an empty file hashes too
    v1 = _v1_digest(identity._weight_files(model.resolve()))
    hashed = []
    real = identity._hash_file
    monkeypatch.setattr(identity, "_hash_file", lambda p: hashed.append(p.name) or real(p))
    v2 = weights_digest(str(model))
    assert v2 != v1 and len(v2) == 64
    assert sorted(hashed) == ["config.json", "model-2.safetensors", "model.safetensors"]
    v1_id = chunk_identity(TOKENS, BLOCK, model_fingerprint(str(model), "bf16", weights=v1))
    assert chunk_identity(TOKENS, BLOCK, model_fingerprint(str(model), "bf16", weights=v2)) != v1_id


def test_a_hub_snapshot_is_named_by_its_commit_without_reading_the_weights(tmp_path, monkeypatch):
    import huggingface_hub.constants

    hub = tmp_path / "hub"
    commits = ["a" * 40, "b" * 40]
    for commit in commits:
        make_model(hub / "models--org--m" / "snapshots" / commit, b"\x01" * 64)
    (hub / "models--org--m" / "refs").mkdir()
    (hub / "models--org--m" / "refs" / "main").write_text(commits[1])

    def refuse(_files):
        raise AssertionError("a hub snapshot's weights were read")

    monkeypatch.setattr(identity, "_hash_weight_files", refuse)
    snap = [weights_digest(str(hub / "models--org--m" / "snapshots" / c)) for c in commits]
    assert snap[0] != snap[1]
    # a hub id whose snapshot is in the local cache (what vLLM loads) gets the same digest
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    assert weights_digest("org/m") == snap[1]
    assert weights_digest("org/m", commits[0]) == snap[0]
