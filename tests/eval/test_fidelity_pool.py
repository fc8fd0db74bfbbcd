"""``bench fidelity-ref --openings`` (issue 75): requests over a shared document pool whose
openings differ, the sequence-state anchors (``anchor=first``, ``anchor=auto``) and the copies
per document each variant needs, on the tiny model."""

from __future__ import annotations

import json

import pytest
import torch

from ascend_mepic.core.segments import Segment

VARIANTS = ["cacheblend-15", "mepic", "mepic+anchor=prefix", "mepic+anchor=first",
            "mepic+anchor=auto", "mepic+pick=q4"]  # fmt: skip


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from ascend_mepic.eval.prepare import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model("tiny")))


def test_openings_per_scenario(tok):
    """one: a single opening; apps: request i is app i % 4's; chat: one opening per request;
    the documents and questions are the same in every scenario."""
    from ascend_mepic.eval.bench.fidelity_pool import opening, pool_requests
    from ascend_mepic.eval.squad_prompts import SYSTEM_MESSAGE, chat_segments

    by = {s: pool_requests(tok, "multidoc", s, 8, 3) for s in ("one", "apps", "chat")}
    ops = {s: [opening(r.segments) for r in reqs] for s, reqs in by.items()}
    assert len(set(ops["one"])) == 1
    assert len(set(ops["apps"])) == 4 and ops["apps"][:4] == ops["apps"][4:]
    assert len(set(ops["chat"])) == 8
    for a, b in zip(by["one"], by["chat"], strict=True):
        assert a.segments[1:] == b.segments[1:] and a.answers == b.answers
    one = by["one"][0]
    docs = [tok.decode(s.token_ids).strip() for s in one.segments[1:-1]]
    assert list(one.segments) == chat_segments(tok, one.question, docs, SYSTEM_MESSAGE)
    squad = pool_requests(tok, "squad", "chat", 3, 2, articles=2)
    assert len({opening(r.segments) for r in squad}) == 3


def _seg(seed: int, n: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(5, 500, (n,), generator=g).tolist())


def test_plan_and_copies_synthetic():
    """Openings A, B; documents read A:(1, 2), B:(2, 3), A:(3, 1). prefix compiles 2 after A,
    2 and 3 after B, 3 after A; first one per document; auto switches at the second request
    (2 read under B after being compiled after A) and is unanchored from there on."""
    from ascend_mepic.eval.bench.fidelity_pool import (
        _digest,
        identities,
        plan_anchors,
        pool_stats,
    )

    a, b = _seg(1, 6), _seg(2, 7)
    docs = {i: _seg(10 + i, 20) for i in (1, 2, 3)}
    reqs = [
        [Segment.prompt(op), Segment.chunk(docs[x]), Segment.chunk(docs[y]), Segment.prompt((9,))]
        for op, (x, y) in ((a, (1, 2)), (b, (2, 3)), (a, (3, 1)))
    ]
    plans, switch = plan_anchors(reqs, VARIANTS)
    assert switch == 1
    assert plans[1]["mepic+anchor=first"] == [a, b] and plans[2]["mepic+anchor=first"] == [b, a]
    assert plans[0]["mepic+anchor=auto"] == [a, a] and plans[2]["mepic+anchor=auto"] == [(), ()]
    records = [
        {
            "docs": [[_digest(s.token_ids), 20] for s in r[1:-1]],
            "variants": {v: {"identities": ids} for v, ids in identities(r, p).items()},
        }
        for r, p in zip(reqs, plans, strict=True)
    ]
    copies = {v: pool_stats(records, v)["compiles"] for v in VARIANTS}
    assert copies == dict(zip(VARIANTS, (3, 3, 5, 3, 5, 3), strict=True))
    assert pool_stats(records, "mepic+anchor=prefix")["canon_blocks"] == 5 * 2


def test_chunk_anchors_match_the_variants_own():
    """Explicit per-chunk anchors equal to the prefix give anchor=prefix's prefill; a sequence
    anchor without them is refused."""
    from transformers import AutoModelForCausalLM

    from ascend_mepic.eval.policy_reference import PolicyReference
    from ascend_mepic.eval.prepare import resolve_model

    model = AutoModelForCausalLM.from_pretrained(resolve_model("tiny"), dtype=torch.float32)
    ref = PolicyReference(model, 4, dummy_token_id=0, check_layer=0)
    pre = _seg(3, 5)
    segs = [Segment.prompt(pre), Segment.chunk(_seg(4, 20)), Segment.chunk(_seg(5, 20)),
            Segment.prompt(_seg(6, 3))]  # fmt: skip
    want = ref.prefill(segs, "mepic+anchor=prefix").next_logprobs
    got = ref.prefill(segs, "mepic+anchor=first", [pre, pre]).next_logprobs
    assert torch.equal(want, got)
    other = ref.prefill(segs, "mepic+anchor=first", [pre, ()]).next_logprobs
    assert not torch.equal(want, other)
    with pytest.raises(ValueError, match="chunk_anchors"):
        ref.prefill(segs, "mepic+anchor=first")


def test_cli_openings_end_to_end(tmp_path, capsys):
    """Three scenarios on the tiny model: one copy per document everywhere in ``one``; with
    differing openings anchor=prefix compiles more, mepic and anchor=first exactly one."""
    from ascend_mepic.entrypoints.cli import main

    out = tmp_path / "t.json"
    argv = ["bench", "fidelity-ref", "--model", "tiny", "--openings", "one", "apps", "chat",
            "--datasets", "multidoc", "--questions", "6", "--docs", "3", "--max-tokens", "0",
            "--bootstrap", "50", "--variants", *VARIANTS, "--jsonl", str(tmp_path / "t.jsonl"),
            "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "### multidoc, openings chat: 6 requests, 6 distinct openings" in text
    assert "anchor=auto unanchored from request" in text
    tables = json.loads(out.read_text())["tables"]
    copies = {k: {r["variant"]: r["copies"] for r in rows} for k, rows in tables.items()}
    assert set(copies["multidoc/one"].values()) == {1.0}
    for s in ("apps", "chat"):
        c = copies[f"multidoc/{s}"]
        assert c["mepic+anchor=prefix"] > 1.0 and c["mepic+anchor=auto"] > 1.0
        assert c["mepic"] == c["mepic+anchor=first"] == c["cacheblend-15"] == 1.0
    assert main([*argv, "--from-jsonl", str(tmp_path / "t.jsonl")]) == 0
    assert capsys.readouterr().out == text  # the records alone re-render the tables
    recs = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert {r["auto_unanchored"] for r in recs if r["scenario"] == "chat"} == {False, True}
    assert not any(r["auto_unanchored"] for r in recs if r["scenario"] == "one")


def test_sequence_anchor_needs_openings():
    from ascend_mepic.entrypoints.cli import main

    with pytest.raises(SystemExit, match="--openings"):
        main(["bench", "fidelity-ref", "--model", "tiny", "--variants", "mepic+anchor=first"])
