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
from ascend_mepic.core.kv_settings import KVSettings
from ascend_mepic.core.segments import Segment
from ascend_mepic.eval.kvsim import SIM_MODEL, build_manager, kv_cache_config, make_request
from ascend_mepic.vllm_integration.core_types import sha256_cbor

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
    m = build_manager("mepic", 8, B)  # hashing set up as kvsim does
    return MepicKVCacheManager(
        kv_cache_config(1024, B),
        hash_fn=sha256_cbor,
        model_fingerprint=SIM_MODEL,
        enable_caching=True,
        settings=KVSettings(policy=policy),
        max_model_len=m.max_model_len,
        scheduler_block_size=B,
        hash_block_size=B,
    )


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


def test_the_default_is_auto():
    assert MepicConfig.from_options({}).chunk_anchor == "auto"


@pytest.mark.parametrize(
    ("scenario", "prefix", "auto"),
    [
        # compiles, hits, resident: `prefix` multiplies copies with openings; `auto` anchors
        # while one opening reads each document, then compiles each document once unanchored
        # (the 3 anchored compiles of the first request are the switch's cost)
        ("one", (6, 66, 6), (6, 66, 6)),
        ("apps", (24, 48, 24), (9, 63, 6)),
        ("chat", (72, 0, 72), (9, 63, 6)),
    ],
)
def test_copies_per_document_by_opening(scenario, prefix, auto):
    assert serve("prefix", scenario)[:3] == prefix
    compiles, hits, resident, metrics = serve("default", scenario)
    assert (compiles, hits, resident) == auto
    assert metrics["chunk_anchor_switches"] == (scenario != "one")
    assert metrics["chunk_anchored"] == (scenario == "one")
    assert serve("none", scenario)[:3] == (6, 66, 6)


def test_a_request_keeps_the_anchor_it_was_inspected_with():
    """The switch may fall between a request's intake and its compile: the compile still runs
    after the anchor its chunk identities name, so no identity ever holds KV of another."""
    m = manager("default")
    a = make_request("a", [opening("chat", 0), DOCS[0], Segment.prompt([7])], B)
    b = make_request("b", [opening("chat", 1), DOCS[0], Segment.prompt([7])], B)
    assert m.track(a)  # anchored: the first opening of DOCS[0]
    assert m.track(b)  # a second opening of DOCS[0]: the switch, b unanchored
    assert m.metrics()["chunk_anchor_switches"] == 1
    for req, lead in ((a, len(SYSTEM) + 3), (b, 0)):
        blocks, hit, _ = m.get_computed_blocks(req)
        assert m.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None
        (compile_,) = m.get_plan(req.request_id).compiles
        assert len(compile_.anchor_tokens) == lead
    entries = list(m.chunk_cache.entries.values())
    assert sorted(len(e.anchor) for e in entries) == [0, len(SYSTEM) + 3]


def test_the_chooser_forgets_no_decision_once_switched():
    """After the switch every request is unanchored, whatever its opening; ``prefix`` and
    ``none`` decide nothing."""
    policy = dataclasses.replace(MepicConfig.from_options({}).parsed_policy, anchor="auto")
    chooser = AnchorChooser(policy, B, SIM_MODEL)
    first = [opening("apps", 0), DOCS[0], Segment.prompt([7])]
    assert chooser.choose(first, None).tokens == tuple(first[0].token_ids)
    assert chooser.choose(first, "tenant-b").tokens  # another tenant: another document
    assert chooser.choose([opening("apps", 1), DOCS[1]], None).tokens  # another document
    assert chooser.choose([opening("apps", 1), DOCS[0]], None).tokens == ()
    assert chooser.choose(first, None).tokens == () and chooser.switches == 1
    for mode in ("prefix", "none"):
        fixed = AnchorChooser(dataclasses.replace(policy, anchor=mode), B, SIM_MODEL)
        for i in range(3):
            got = fixed.choose([opening("apps", i), DOCS[0]], None).tokens
            assert bool(got) == (mode == "prefix")
