"""The routing policies and the request reader, without engines (the indexer is a recording
double that raises on anything it does not model; tests/cluster/test_cluster.py runs the real
Dynamo indexer and real replicas)."""

from __future__ import annotations

import asyncio

import pytest

from ascend_mepic.cluster.cli import parse_replica
from ascend_mepic.cluster.indexer import IndexerError
from ascend_mepic.cluster.policy import BoundedLoad, ChunkAware, PrefixAware, Replica, make_policy
from ascend_mepic.cluster.request_chunks import RequestReader, RoutingView
from ascend_mepic.core.segments import EXTRA_ARGS_KEY


class Residency:
    """Dynamo indexer double: ``overlap`` of token sequences this test says workers hold."""

    def __init__(self, held: dict[tuple[int, ...], dict[int, int]] | None = None) -> None:
        self.held = held or {}
        self.queries: list[tuple[int, ...]] = []
        self.down = False

    async def overlap(self, token_ids):
        if self.down:
            raise IndexerError("indexer away")
        self.queries.append(tuple(token_ids))
        return dict(self.held.get(tuple(token_ids), {}))

    def __getattr__(self, name):
        raise AssertionError(f"the indexer double does not model {name}")


def replicas(n: int = 2) -> list[Replica]:
    return [Replica(i, f"http://r{i}", healthy=True) for i in range(n)]


def choose(policy, view, reps):
    return asyncio.run(policy.choose(view, reps))


A, B, C = tuple(range(100, 164)), tuple(range(200, 264)), tuple(range(300, 364))
PREFIX = (1, 2, 3)


def test_chunk_policy_scores_every_chunk_and_the_prefix():
    reps = replicas(3)
    idx = Residency({A: {2: 64}, B: {2: 32, 1: 64}, C: {1: 64}, PREFIX: {3: 3}})
    policy = ChunkAware(idx)
    d = choose(policy, RoutingView(prompt=PREFIX + A + B, chunks=(A, B), prefix=PREFIX), reps)
    # worker 2 (replica 1) holds 96 chunk tokens, worker 1 (replica 0) 64, worker 3 the prefix
    assert d.replica.index == 1 and d.scores == {2: 96, 1: 64, 3: 3}
    assert set(idx.queries) == {PREFIX, A, B}  # one query per chunk, one for the prefix


def test_prefix_policy_sees_only_the_prompt_from_token_0():
    idx = Residency({PREFIX + A: {2: 32}})
    d = choose(
        PrefixAware(idx), RoutingView(prompt=PREFIX + A, chunks=(A,), prefix=PREFIX), replicas()
    )
    assert d.replica.index == 1 and idx.queries == [PREFIX + A]


def test_affinity_covers_a_chunk_before_its_events_arrive_and_expires():
    reps = replicas()
    policy = ChunkAware(Residency(), affinity_s=60)
    view = RoutingView(prompt=A, chunks=(A,), prefix=())
    first = choose(policy, view, reps).replica
    # the chunk is not indexed yet: the affinity sends it to the same replica
    second = choose(policy, view, reps)
    assert second.replica is first and second.score == len(A)
    policy.forget(first)  # the replica went down: its affinities go with it
    assert choose(policy, view, [r for r in reps if r is not first]).score == 0


def test_bounded_load_keeps_requests_per_replica_even_under_one_hot_chunk():
    reps = replicas()
    policy = ChunkAware(Residency({A: {1: 64}}), BoundedLoad(1.25, window=32))
    picks = [
        choose(policy, RoutingView(prompt=A, chunks=(A,)), reps).replica.index for _ in range(64)
    ]
    # the hot chunk's holder takes at most load_factor times its share of the last 32 decisions
    assert picks.count(0) / len(picks) <= 1.25 / 2 + 1 / 32
    # and requests in flight count: a replica two requests ahead of the least busy takes no more
    reps[0].in_flight, reps[1].in_flight = 3, 0
    diverted = policy.diverted
    d = choose(policy, RoutingView(prompt=A, chunks=(A,)), reps)
    assert d.replica.index == 1 and d.diverted and policy.diverted == diverted + 1
    # every request the holder did not take was diverted from it; none of the holder's were
    assert diverted == picks.count(1)
    # a wider gap keeps it on the holder
    wide = ChunkAware(Residency({A: {1: 64}}), BoundedLoad(queue_gap=3))
    assert not choose(wide, RoutingView(prompt=A, chunks=(A,)), reps).diverted
    # the route command's flags reach the rule
    load = make_policy("round_robin", None, load_factor=1.5, queue_gap=3, window=8).load
    assert (load.load_factor, load.queue_gap, load.recent.maxlen) == (1.5, 3, 8)


def test_an_absent_indexer_routes_on_load_and_is_counted():
    idx = Residency()
    idx.down = True
    policy = ChunkAware(idx)
    d = choose(policy, RoutingView(prompt=A, chunks=(A,)), replicas())
    assert d.score == 0 and policy.indexer_errors == 1


def test_make_policy_and_replica_specs_fail_loudly():
    with pytest.raises(ValueError, match="needs the indexer"):
        make_policy("chunk", None)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("best", Residency())
    with pytest.raises(ValueError, match="load_factor"):
        BoundedLoad(0.5)
    with pytest.raises(ValueError, match="queue_gap"):
        BoundedLoad(queue_gap=-1)
    assert parse_replica("http://h:1=tcp://h:2,tcp://h:3") == (
        "http://h:1",
        "tcp://h:2",
        "tcp://h:3",
    )
    assert parse_replica("http://h:1/") == ("http://h:1", None, None)
    for bad, needle in [("h:1", "http"), ("http://h:1=h:2", "tcp"), ("http://h:1=", "no event")]:
        with pytest.raises(ValueError, match=needle):
            parse_replica(bad)
    with pytest.raises(LookupError):
        choose(ChunkAware(Residency()), RoutingView(), [])


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from ascend_mepic.eval.prepare import prepare_tiny_llama

    return AutoTokenizer.from_pretrained(str(prepare_tiny_llama()))


def test_reader_gives_the_servers_tokens_for_every_completion_form(tokenizer):
    from ascend_mepic.entrypoints.server.text_segments import pieces_segments

    reader = RequestReader(tokenizer)
    doc = "The quiet river runs past the old mill every spring morning."
    pieces = reader.completion(
        {"prompt": ["Docs: ", {"text": doc, "mepic": {"chunk": True}}, " Q?"]}
    )
    want = pieces_segments(
        tokenizer, [("prompt", "Docs: "), ("chunk", doc), ("prompt", " Q?")], None, True
    )
    assert pieces.chunks == (want[1].token_ids,) and pieces.prefix == want[0].token_ids
    marked = reader.completion({"prompt": f"Docs: <<<MEPIC_CHUNK>>>{doc}<<<END_MEPIC_CHUNK>>> Q?"})
    assert marked.chunks == pieces.chunks
    ids = [1, 5, 6, 7, 8, 9]
    tokens = reader.completion(
        {"prompt": ids, "vllm_xargs": {EXTRA_ARGS_KEY: ["prompt", 2, "chunk", 3, "prompt", 1]}}
    )
    assert tokens.chunks == ((6, 7, 8),) and tokens.prefix == (1, 5)
    # what only a replica can resolve, or a malformed request, routes on load alone
    assert (
        reader.completion({"prompt": ["a", {"text": "", "mepic": {"chunk_id": "x"}}, "b"]})
        == RoutingView()
    )
    assert (
        reader.completion({"prompt": ids, "vllm_xargs": {EXTRA_ARGS_KEY: ["chunk", 99]}})
        == RoutingView()
    )
