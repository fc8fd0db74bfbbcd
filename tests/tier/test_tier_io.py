"""The tier's entry format, verification and failure paths against LMCache itself (no engine)."""

from __future__ import annotations

import time

import pytest
import torch

from ascend_mepic.config import MepicConfig
from ascend_mepic.tier.index import (
    TIER_NAMESPACE,
    TierConfig,
    choose_load,
    close_lmcache,
    lmcache_key,
    recompute_share,
)
from ascend_mepic.tier.transfer import save_tokens
from ascend_mepic.tier.worker_io import TierEntryError, WorkerTier, decode_entry, encode_entry

CHUNK = "ab" * 32
OTHER = "cd" * 32


def test_entry_round_trip_and_rejections():
    kv = torch.randn(2, 3, 2, 32, 4, 8)
    blob = encode_entry(CHUNK, kv, 70)
    assert torch.equal(decode_entry(blob, CHUNK, kv.shape, kv.dtype), kv)
    with pytest.raises(TierEntryError, match="chunk identity"):
        decode_entry(blob, OTHER, kv.shape, kv.dtype)
    with pytest.raises(TierEntryError, match="mismatch"):
        decode_entry(blob, CHUNK, (2, 2, 2, 32, 4, 8), kv.dtype)
    with pytest.raises(TierEntryError, match="mismatch"):
        decode_entry(blob, CHUNK, kv.shape, torch.float16)
    bad = blob.clone()
    bad[-1] ^= 0xFF
    with pytest.raises(TierEntryError, match="digest"):
        decode_entry(bad, CHUNK, kv.shape, kv.dtype)
    with pytest.raises(TierEntryError, match="corrupt"):
        decode_entry(blob[:5], CHUNK, kv.shape, kv.dtype)


@pytest.fixture
def tier(tmp_path):
    worker = WorkerTier(TierConfig.parse({"cpu_gib": 0.05}), tmp_path, "tiny")
    yield worker
    worker.close()


def test_worker_tier_put_load_and_failures(tier):
    caches = [torch.zeros(8, 2, 32, 4, 8) for _ in range(2)]  # 2 layers, 8 blocks of 32
    source = [torch.randn(8, 2, 32, 4, 8) for _ in range(2)]
    # 70 canonical tokens stored from slot 20 of block 2 on, through blocks 4 and 7.
    kv = save_tokens(source, [2, 4, 7], 20, 70, 32)
    assert kv.shape == (2, 70, 2, 32)
    tier.put(CHUNK, kv, 70)
    assert tier.dir.marker(CHUNK).exists() and tier.counters["puts"] == 1
    # Loaded elsewhere: from slot 5 of block 5 on, through blocks 1 and 6.
    assert tier.load(CHUNK, caches, [5, 1, 6], 70, 5, 32) == "ok"
    for layer in range(2):
        src = torch.cat([source[layer][2, :, 20:], source[layer][4], source[layer][7, :, :26]], 1)
        dst = torch.cat([caches[layer][5, :, 5:], caches[layer][1], caches[layer][6, :, :11]], 1)
        assert torch.equal(src, dst)
        assert not caches[layer][5, :, :5].any() and not caches[layer][6, :, 11:].any()
    assert tier.load(OTHER, caches, [2], 10, 0, 32) == "miss"
    assert tier.load(CHUNK, caches, [2, 3], 60, 0, 32).startswith("mismatch")  # token count

    tier.put(CHUNK, kv, 70)  # the mismatch dropped the entry; put it again, then corrupt it
    obj = tier.lmcache.get(lmcache_key(CHUNK, TIER_NAMESPACE))
    obj.tensor[-3:] ^= 0x5A
    obj.ref_count_down()
    before = caches[0].clone()
    assert tier.load(CHUNK, caches, [5, 1, 6], 70, 5, 32) == "corrupt: digest"
    assert torch.equal(caches[0], before)  # nothing reached the pool
    assert not tier.dir.marker(CHUNK).exists()  # the scheduler will compile it
    assert tier.counters["fallbacks"] == 3
    assert tier.counters["fallback_corrupt"] == 1 and tier.counters["fallback_miss"] == 1


def test_load_decision():
    assert choose_load(None, 1e-4)  # unmeasured: load
    assert choose_load(1e-6, 1e-4) and not choose_load(2e-4, 1e-4)
    assert recompute_share(1.0, 3.0) == 0.25 and recompute_share(None, 1.0) == 0.0


def test_tier_config_errors():
    assert not TierConfig.parse({}).enabled
    shared = TierConfig.parse({"disk": "/x", "unauthenticated": True})
    assert shared.shared_url == "fs://localhost:0/x"
    with pytest.raises(ValueError, match="unknown MEPIC tier option"):
        TierConfig.parse({"cpu": 1})
    with pytest.raises(ValueError, match="not both"):
        TierConfig.parse({"disk": "/x", "remote": "redis://h:1"})
    with pytest.raises(ValueError, match="tier option 'load': Input should be 'auto', 'always'"):
        TierConfig.parse({"load": "sometimes"})
    with pytest.raises(ValueError, match="host store"):
        MepicConfig.from_additional_config({"mepic": {"policy": "epic-16", "tier": {"cpu_gib": 1}}})
    config = MepicConfig.from_additional_config({"mepic": {"tier": {"cpu_gib": 1}}})
    assert config.tier.enabled and config.tier.cpu_gib == 1


def test_flush_waits_for_puts_to_reach_the_shared_backend(redis_url, tmp_path, tier_key):
    """LMCache writes a put to a remote backend in the background; ``flush`` (run by ``close``)
    returns once the remote holds it, so what a worker put before shutting down reaches the
    other servers. Redis holds its writes for a second here: the put cannot land before."""
    import redis

    _, url = redis_url
    config = TierConfig.parse({"cpu_gib": 0.05, "remote": url, "key_file": tier_key})
    worker = WorkerTier(config, tmp_path, "tiny")
    direct = redis.Redis.from_url(url)
    try:
        assert direct.execute_command("CLIENT", "PAUSE", 1000, "WRITE")
        start = time.monotonic()
        worker.put(CHUNK, torch.randn(2, 70, 2, 32), 70)
        assert worker.counters["puts"] == 1 and direct.dbsize() == 0  # still on its way
        assert worker.flush() == 0
        assert time.monotonic() - start > 0.5
        assert direct.dbsize() > 0  # there when flush returned
    finally:
        close_lmcache(worker.lmcache, timeout_s=0.1)  # LMCache's remote close can block
