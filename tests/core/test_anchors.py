"""``chunk_anchor``: copies per document when requests open differently (issue 75), on the real
KV manager and BlockPool (no model). The review's traffic: 6 documents, 24 requests of 3 each,
in sequence, opening with one system prompt, one of 4 apps' system prompts, or each its own
earlier chat turn."""

import dataclasses

import pytest
from vllm.v1.request import RequestStatus

from ascend_mepic.config import MepicConfig
from ascend_mepic.core.anchors import AnchorChooser
from ascend_mepic.core.kv_manager import MepicKVCacheManager
from ascend_mepic.core.segments import Segment
from ascend_mepic.eval.kvsim import make_request
from tests.core.test_kv_manager import canonical_ids, mepic_manager

B = 16
DOCS = [Segment.chunk(range(1000 * d, 1000 * d + 50)) for d in range(6)]
SYSTEM = list(range(100, 130))


def opening(scenario: str, i: int) -> Segment:
    if scenario == "one":
        return Segment.prompt(SYSTEM)
    if scenario == "apps":  # each app its own system prompt
        return Segment.prompt([*SYSTEM[:4], 200 + i % 4, *SYSTEM[5:]])
    return Segment.prompt([*SYSTEM, 500 + i, 501 + i, 502 + i])  # an earlier turn of its own


def manager(anchor: str) -> MepicKVCacheManager:
    policy = MepicConfig.from_options({}).parsed_policy
    if anchor != "default":
        policy = dataclasses.replace(policy, anchor=anchor)
    return mepic_manager(1024, policy=policy)


def serve(anchor: str, scenario: str) -> tuple[int, int, int, dict]:
    """Compiles, hits and resident chunks after the 24 requests, one at a time; the metrics."""
    m = manager(anchor)
    for i in range(24):
        docs = [DOCS[i % 6], DOCS[(i + 1) % 6], DOCS[(i + 3) % 6]]
        req = make_request(f"r{i}", [opening(scenario, i), *docs, Segment.prompt([7, 8])], B)
        assert m.track(req)
        blocks, hit, _ = m.get_computed_blocks(req)
        assert m.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None
        m.take_step_plan(i, [req.request_id])
        m.new_step_starts()
        req.status = RequestStatus.FINISHED_STOPPED
        m.free(req)
    metrics = m.metrics()
    return metrics["chunk_misses"], metrics["chunk_hits"], metrics["resident_chunks"], metrics


def test_the_default_is_first():
    assert MepicConfig.from_options({}).chunk_anchor == "first"


@pytest.mark.parametrize(
    ("scenario", "prefix"),
    [
        # compiles, hits, resident under `prefix`: a copy per opening and document
        ("one", (6, 66, 6)),
        ("apps", (24, 48, 24)),
        ("chat", (72, 0, 72)),
    ],
)
def test_copies_per_document_by_opening(scenario, prefix):
    """The default compiles each document once, after the first request's opening, whatever
    opens the later requests; ``prefix`` keeps a copy per opening, ``none`` one unanchored."""
    assert serve("prefix", scenario)[:3] == prefix
    compiles, hits, resident, metrics = serve("default", scenario)
    assert (compiles, hits, resident) == (6, 66, 6)
    assert metrics["chunk_anchor_tokens"] == len(opening(scenario, 0).token_ids)
    assert serve("none", scenario)[:3] == (6, 66, 6)


def test_every_request_reads_the_copy_compiled_after_the_first_opening():
    """Requests with other openings, other questions and the document elsewhere read the same
    physical blocks of it, compiled after the first request's opening; a request with no
    opening before the engine has its anchor compiles unanchored."""
    m = manager("default")
    bare = make_request("bare", [DOCS[1], Segment.prompt([7])], B)
    assert m.track(bare)
    blocks, hit, _ = m.get_computed_blocks(bare)
    assert m.allocate_slots(bare, bare.num_tokens - hit, hit, blocks) is not None
    (compile_,) = m.get_plan("bare").compiles
    assert compile_.anchor_tokens == ()
    reqs = [
        make_request("a", [opening("chat", 0), DOCS[0], DOCS[2], Segment.prompt([7])], B),
        make_request("b", [opening("apps", 1), DOCS[2], DOCS[0], Segment.prompt([8, 9])], B),
        make_request("c", [DOCS[0], Segment.prompt([5])], B),
    ]
    for req in reqs:
        assert m.track(req)
        blocks, hit, _ = m.get_computed_blocks(req)
        assert m.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None
    first = tuple(opening("chat", 0).token_ids)
    (c0, c2) = m.get_plan("a").compiles
    assert c0.anchor_tokens == c2.anchor_tokens == first
    assert not m.get_plan("b").compiles and not m.get_plan("c").compiles
    assert canonical_ids(m, "a", 1) == canonical_ids(m, "b", 2) == canonical_ids(m, "c", 0)
    assert canonical_ids(m, "a", 2) == canonical_ids(m, "b", 1)
    assert m.metrics()["chunk_anchor_tokens"] == len(first)


def test_the_chooser_fixes_the_first_opening_and_prefix_and_none_follow_the_request():
    policy = dataclasses.replace(MepicConfig.from_options({}).parsed_policy, anchor="first")
    chooser = AnchorChooser(policy)
    assert chooser.choose([DOCS[0], Segment.prompt([7])]).tokens == ()  # no opening yet
    first = [opening("apps", 0), DOCS[0], Segment.prompt([7])]
    assert chooser.peek(first).tokens == ()
    assert chooser.choose(first).tokens == tuple(first[0].token_ids)
    for i in range(1, 4):
        assert chooser.choose([opening("apps", i), DOCS[i]]).tokens == chooser.engine_anchor
    assert chooser.choose([DOCS[0]]).tokens == chooser.engine_anchor
    for mode in ("prefix", "none"):
        fixed = AnchorChooser(dataclasses.replace(policy, anchor=mode))
        for i in range(3):
            seg = opening("apps", i)
            got = fixed.choose([seg, DOCS[0]]).tokens
            assert got == (tuple(seg.token_ids) if mode == "prefix" else ())
