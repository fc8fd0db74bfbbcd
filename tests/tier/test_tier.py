"""The LMCache chunk tier in the real engine: offload, evict, reload, restart, corruption, salts,
and two engines sharing a Redis server.

Tiny random Llama (2 layers), float32, greedy, block size 128 (vllm-ascend's; the reload test
runs at 16 too). Each engine run evicts every idle
chunk from the KV pool between its batches (``reset_between_batches``), so the second and third
batch find their chunks only in the tier. Every run's tokens and logprobs must equal a run without
the tier: loading must be invisible in the outputs, and so must every failure path.
"""

from __future__ import annotations

import random
import re
import time

import pytest

from ascend_mepic.core.segments import Segment
from ascend_mepic.eval.prepare import prepare_tiny_llama
from tests.engine_host import encode, run_engine


@pytest.fixture(scope="module")
def model() -> str:
    return str(prepare_tiny_llama())


@pytest.fixture(scope="module")
def prompts() -> tuple[list[Segment], list[Segment]]:
    rng = random.Random(11)
    doc = Segment.chunk([rng.randint(5, 500) for _ in range(90)])  # 74 canonical tokens
    other = Segment.chunk([rng.randint(5, 500) for _ in range(70)])  # 54 canonical tokens
    a = [Segment.prompt([1, 40, 41]), doc, other, Segment.prompt([60, 61, 62, 63])]
    b = [Segment.prompt([1, 77, 78, 79, 80]), other, doc, Segment.prompt([70, 71])]
    return a, b


def _run(
    model: str, prompts, tier: dict | None, salts=(None, None, None), block_size: int = 128
) -> dict:
    a, b = prompts
    batches = [[{**encode(p), "salt": s}] for p, s in zip((a, b, a), salts, strict=True)]
    result = run_engine(
        {
            "model": model,
            "mepic": True,
            "policy": "mepic",
            # a and b (other prefixes) share chunks: unanchored compiles.
            "options": {"chunk_anchor": "none", **({"tier": tier} if tier else {})},
            "block_size": block_size,
            "max_tokens": 4,
            "logprobs": 3,
            "batches": batches,
            "reset_between_batches": True,
        }
    )
    return result


def _same_outputs(got: dict, want: dict) -> None:
    for batch_got, batch_want in zip(got["batches"], want["batches"], strict=True):
        for g, w in zip(batch_got, batch_want, strict=True):
            assert g["tokens"] == w["tokens"]
            for lg, lw in zip(g["logprobs"], w["logprobs"], strict=True):
                assert lg.keys() == lw.keys()
                for t in lg:
                    assert abs(lg[t] - lw[t]) < 1e-5


@pytest.fixture(scope="module")
def untiered(model, prompts) -> dict:
    return _run(model, prompts, None)


@pytest.mark.parametrize("block_size", [128, 16])
def test_cpu_tier_reloads_evicted_chunks(model, prompts, untiered, block_size):
    got = _run(model, prompts, {"cpu_gib": 0.1, "load": "always"}, block_size=block_size)
    _same_outputs(got, untiered if block_size == 128 else _run(model, prompts, None, block_size=16))
    m = got["metrics"]
    assert m["chunk_misses"] == 2  # compiled once, in the first batch
    assert m["chunk_evictions"] >= 4  # evicted after every batch
    assert m["tier_loads"] == 4 and m["tier_fallbacks"] == 0
    assert m["tier_worker_puts"] == 2 and m["tier_worker_loads_LocalCPUBackend"] == 4
    assert m["tier_worker_bytes_loaded"] == 2 * m["tier_worker_bytes_stored"]
    assert untiered["metrics"]["chunk_misses"] == 6  # without the tier: compiled every time


def test_disk_tier_survives_restart_and_rejects_altered_entries(
    model, prompts, untiered, tmp_path, tier_key
):
    tier = {"cpu_gib": 0.1, "disk": str(tmp_path / "tier"), "load": "always", "key_file": tier_key}
    first = _run(model, prompts, tier)
    _same_outputs(first, untiered)
    assert first["metrics"]["tier_worker_puts"] == 2
    assert (tmp_path / "tier").stat().st_mode & 0o777 == 0o700  # the server made it: private

    restarted = _run(model, prompts, tier)  # a new engine process: warm restart
    _same_outputs(restarted, untiered)
    m = restarted["metrics"]
    assert m["chunk_misses"] == 0 and m["tier_loads"] == 6 and m["tier_fallbacks"] == 0
    assert m["tier_worker_loads_RemoteBackend"] == 2  # from disk, then from the CPU tier

    files = sorted(p for p in (tmp_path / "tier").rglob("*") if p.is_file())
    assert len(files) == 2
    for path in files:  # flip sealed payload bytes, keep the size: the tag no longer verifies
        data = bytearray(path.read_bytes())
        data[-100:] = bytes(255 - x for x in data[-100:])
        path.write_bytes(bytes(data))
    corrupted = _run(model, prompts, tier)
    _same_outputs(corrupted, untiered)
    m = corrupted["metrics"]
    assert m["tier_fallbacks"] == 2 and m["tier_worker_fallback_unauthenticated"] == 2
    assert m["chunk_misses"] >= 2  # compiled instead, then served from the fresh entries


def test_salts_isolate_in_the_tier(model, prompts, tmp_path):
    tier = {"cpu_gib": 0.1, "disk": str(tmp_path / "tier"), "load": "always"}
    tier["unauthenticated"] = True  # about salts, not keys
    got = _run(model, prompts, tier, salts=("tenant-a", "tenant-b", "tenant-b"))
    m = got["metrics"]
    # tenant-b never loads tenant-a's chunks: it compiles them, then reloads its own.
    assert m["chunk_misses"] == 4 and m["tier_loads"] == 2
    assert m["tier_worker_puts"] == 4


def test_two_engines_share_redis_and_survive_its_death(
    model, prompts, untiered, redis_url, tier_key
):
    proc, url = redis_url
    tier = {"cpu_gib": 0.1, "remote": url, "load": "always", "key_file": tier_key}
    first = _run(model, prompts, tier)
    _same_outputs(first, untiered)
    second = _run(model, prompts, tier)  # another engine process: loads what the first put
    _same_outputs(second, untiered)
    assert second["metrics"]["chunk_misses"] == 0
    assert second["metrics"]["tier_worker_loads_RemoteBackend"] == 2

    proc.kill()
    proc.wait()
    dead = _run(model, prompts, tier)  # the remote is gone: serve on, from compute and CPU
    _same_outputs(dead, untiered)
    assert dead["metrics"]["chunk_misses"] == 2


def _wait_for_redis_entries(url: str, timeout_s: float = 30.0) -> None:
    """LMCache writes a put to Redis in the background, and vLLM's shutdown kills the engine
    within a second: this test is about sharing, so it stops the first server only once its
    chunk reached Redis."""
    import redis

    client = redis.Redis.from_url(url)
    deadline = time.time() + timeout_s
    while client.dbsize() == 0:
        assert time.time() < deadline, "the first server's chunk never reached Redis"
        time.sleep(0.1)


def test_two_servers_share_chunks_through_redis(model, redis_url, tmp_path, tier_key):
    """Two ``ascend-mepic serve`` processes on one Redis: the second loads the first's chunk.

    The second runs two API servers (``--api-server-count 2``: vLLM's manager, prometheus'
    multiprocess mode); MEPIC's metrics still reach ``/metrics`` (its stat-logger plugin)."""
    import json

    import httpx

    from tests.entrypoints.test_server import DOCS, fresh_stats, launch_server, marked

    _, url = redis_url
    tier = {"cpu_gib": 0.1, "remote": url, "load": "always", "key_file": tier_key}
    config = {"mepic": {"tier": tier}}
    args = ["--additional-config", json.dumps(config)]
    prompt = marked(DOCS[0] + " " + DOCS[1], "What does the farmer remember?")
    texts, stats = [], []
    for i in range(2):
        api_servers = ["--api-server-count", "2"] if i == 1 else []
        server, stop = launch_server(model, tmp_path / f"server{i}", args + api_servers)
        try:
            with httpx.Client(base_url=server, timeout=120) as client:
                body = {"prompt": prompt, "max_tokens": 6, "temperature": 0.0}
                r = client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                texts.append(r.json()["choices"][0]["text"])
                stats.append(fresh_stats(client)["metrics"])
                metrics = client.get("/metrics").text
            if i == 0:
                _wait_for_redis_entries(url)
        finally:
            stop()
    assert texts[0] == texts[1]
    assert stats[0]["chunk_misses"] == 1 and stats[0]["tier_worker_puts"] == 1
    tier_counts = {k: v for k, v in stats[1].items() if k.startswith(("tier", "chunk"))}
    assert stats[1]["chunk_misses"] == 0 and stats[1]["tier_loads"] == 1, tier_counts
    assert stats[1]["tier_worker_loads_RemoteBackend"] == 1
    # the second server's /metrics, from either of its API servers (the last scrape's)
    assert re.search(r"^ascend_mepic_tier_loads_total 1\.0$", metrics, re.M), metrics[-3000:]
    assert re.search(r"^ascend_mepic_chunk_misses_total 0\.0$", metrics, re.M)
