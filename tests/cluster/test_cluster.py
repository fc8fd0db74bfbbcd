"""Two real ``ascend-mepic serve`` replicas of the tiny model behind ``ascend-mepic route`` with
Dynamo's real indexer, on loopback: chunk-aware routing through the replicas' KV events, then a
replica killed with a request in flight and restarted.

Dynamo's indexer binds its HTTP port on 0.0.0.0 (no option in 1.6.1); the port is a free one
chosen here and lives only for the test.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from ascend_mepic.cluster.indexer import indexer_available
from ascend_mepic.cluster.local import LocalCluster
from ascend_mepic.eval.prepare import prepare_tiny_llama

pytestmark = pytest.mark.skipif(
    not indexer_available(), reason="Dynamo's indexer (the cluster extra) is not installed"
)

BLOCK = 32
DOC_A = (
    "The quiet river runs past the old mill every spring morning, and the miller counts the "
    "sacks of flour while the children watch the water wheel turn slowly in the cold light. "
) * 2
DOC_B = (
    "A red bird follows the lazy dog through the forest; each winter evening the farmer "
    "remembers the ocean, the mountain and the bright city far away beyond the hills. "
) * 2


def body(model: str, doc: str, question: str, **kw) -> dict:
    return {
        "model": model,
        "prompt": ["Docs: ", {"text": doc, "mepic": {"chunk": True}}, f"\nQ: {question}\nA:"],
        "max_tokens": 2,
        "temperature": 0,
        **kw,
    }


def stats(url: str) -> dict:
    return httpx.get(url + "/cluster/stats", timeout=10).json()


def metrics(url: str) -> dict:
    return httpx.get(url + "/v1/mepic/stats", timeout=10).json()["metrics"]


def wait(cond, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}")


def chunk_holders(cluster: LocalCluster, tokens: list[int]) -> dict[int, int]:
    resp = httpx.post(
        cluster.indexer_url + "/query", json={"token_ids": tokens, "model_name": "default"}
    )
    return {int(w): max(r.values()) for w, r in resp.json()["scores"].items() if r}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = str(prepare_tiny_llama())
    serve = [
        "--dtype", "float32", "--enforce-eager", "--block-size", str(BLOCK),
        "--max-model-len", "1024", "--kv-cache-memory-bytes", "64M",
        "--additional-config", json.dumps({"mepic": {}}),
        # two processes per replica, not three: the worker inside the engine core. Each process
        # pays vLLM's imports, and three replica starts are this test's cost. vLLM's CPU platform
        # turns `uni` back into `mp` unless VLLM_ENABLE_V1_MULTIPROCESSING=0, which the API
        # server's AsyncLLM ignores (its engine core is always a process of its own).
        "--distributed-executor-backend", "uni",
    ]  # fmt: skip
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    c = LocalCluster(model, 2, tmp_path_factory.mktemp("cluster"), serve, env, 240)
    try:
        c.start()
        # A loose load bound: with a handful of requests the bound would outweigh residency.
        extra = ["--health-interval-s", "0.2", "--load-factor", "4"]
        c.front_url = c.start_front("chunk", model, BLOCK, extra)
        c.model = model
        yield c
    finally:
        c.stop()


def test_chunk_routing_kill_and_restart(cluster):
    from transformers import AutoTokenizer

    url, model = cluster.front_url, cluster.model
    tok = AutoTokenizer.from_pretrained(model)
    a_tokens = tok.encode(DOC_A, add_special_tokens=False)
    assert len(a_tokens) >= 3 * BLOCK  # the chunk publishes at least three blocks

    # 1. The chunk's first request compiles it on some replica; its BlockStored events reach
    # the indexer, and a later request with the chunk (another question) goes to that replica
    # and hits, whatever the load rule would have preferred.
    first = httpx.post(url + "/v1/completions", json=body(model, DOC_A, "What runs?"), timeout=60)
    assert first.status_code == 200, first.text
    holder = int(first.headers["x-mepic-replica"])
    other = 1 - holder
    wait(lambda: holder + 1 in chunk_holders(cluster, a_tokens), "the chunk's events")
    assert other + 1 not in chunk_holders(cluster, a_tokens)
    before = metrics(cluster.replicas[holder].url)
    again = httpx.post(url + "/v1/completions", json=body(model, DOC_A, "Who counts?"), timeout=60)
    assert again.status_code == 200 and int(again.headers["x-mepic-replica"]) == holder
    assert metrics(cluster.replicas[holder].url)["chunk_hits"] == before["chunk_hits"] + 1

    # 2. Kill the holder with a streamed request in flight to it: that request ends with an
    # error event and is counted; the front drops the replica and the indexer its blocks.
    long = body(model, DOC_A, "Tell me more.", max_tokens=600, ignore_eos=True, stream=True)
    events: list[str] = []
    with httpx.stream("POST", url + "/v1/completions", json=long, timeout=120) as resp:
        assert resp.status_code == 200 and int(resp.headers["x-mepic-replica"]) == holder
        for line in resp.iter_lines():
            if line:
                events.append(line)
            if len(events) == 3:
                cluster.kill(holder)
    assert "replica_failed" in events[-1] and "[DONE]" not in events[-1]
    wait(lambda: not stats(url)["replicas"][holder]["healthy"], "the front to drop the replica")
    assert stats(url)["failed"] == 1 and stats(url)["replicas"][holder]["failed"] == 1
    wait(lambda: holder + 1 not in chunk_holders(cluster, a_tokens), "the indexer to drop it")

    # 3. The rest complete on the survivor, which computes the chunk again and then reuses it.
    for q in ("Where?", "When?", "Why?"):
        r = httpx.post(url + "/v1/completions", json=body(model, DOC_A, q), timeout=60)
        assert r.status_code == 200 and int(r.headers["x-mepic-replica"]) == other
    survivor = metrics(cluster.replicas[other].url)
    assert survivor["chunk_misses"] >= 1 and survivor["chunk_hits"] >= 2
    wait(lambda: other + 1 in chunk_holders(cluster, a_tokens), "the survivor's events")

    # 4. Restarted on the same ports, the replica is registered afresh: no stale residency (its
    # pool is empty, and the indexer dropped what the dead process held); new chunks are
    # routed to it again.
    cluster.start([holder])
    wait(lambda: stats(url)["replicas"][holder]["healthy"], "the front to take it back")
    assert holder + 1 not in chunk_holders(cluster, a_tokens)
    routed = []
    for i in range(4):
        doc = DOC_B + f" Part {i}."
        r = httpx.post(url + "/v1/completions", json=body(model, doc, "Which bird?"), timeout=60)
        assert r.status_code == 200
        routed.append(int(r.headers["x-mepic-replica"]))
    assert holder in routed  # the load rule spreads new chunks over both again
    assert stats(url)["failed"] == 1
