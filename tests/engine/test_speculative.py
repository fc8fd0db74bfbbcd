"""Speculative decoding with MEPIC on (n-gram, a draft model), in the real vLLM engine.

Verification steps put 1 + k query tokens per request after the request's layout (MEPIC's token
map places them like decode tokens), over chunk KV shared with other requests; a rejected
draft's slot is rewritten by the next step's token at the same index. A draft model's batches
are placed by the same token maps, its chunk KV compiled beside the target's. The oracle is
MEPIC without speculation (one run for the module): greedy outputs must be equal token for
token, with the chunks computed (first batch) and reused (the second batch's ``a``).
"""

from __future__ import annotations

import random

import pytest

from ascend_mepic.core.segments import Segment
from ascend_mepic.eval.prepare import prepare_tiny_llama
from tests.engine_host import encode, run_engine

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}  # fmt: skip


@pytest.fixture(scope="module")
def job() -> dict:
    rng = random.Random(11)
    doc = Segment.chunk([rng.randint(5, 500) for _ in range(90)])
    other = Segment.chunk([rng.randint(5, 500) for _ in range(70)])
    a = [Segment.prompt([1, 40, 41]), doc, other, Segment.prompt([60, 61, 62, 63])]
    b = [Segment.prompt([1, 77, 78, 79, 80]), other, doc, Segment.prompt([70, 71])]
    return {
        "model": str(prepare_tiny_llama()),
        "mepic": True,
        "policy": "mepic",
        "block_size": 32,
        "max_tokens": 24,
        "logprobs": 0,
        "batches": [[encode(a)], [encode(b), encode(a)]],
        "log_stats": True,
    }


@pytest.fixture(scope="module")
def plain(job) -> dict:
    return run_engine(job)


def test_ngram_speculation_equals_mepic_without_it(job, plain):
    spec = run_engine({**job, "speculative_config": NGRAM})
    tokens = [[r["tokens"] for r in batch] for batch in plain["batches"]]
    assert [[r["tokens"] for r in batch] for batch in spec["batches"]] == tokens
    counts = spec["spec_decode"]
    # Drafts were verified, some accepted and some rejected (so rejected slots were rewritten).
    assert 0 < counts["num_accepted_tokens"] < counts["num_draft_tokens"]
    assert spec["metrics"]["chunk_hits"] >= 2  # the second batch's a reused both its chunks
    assert not plain["spec_decode"].get("num_drafts")


def test_draft_model_speculation_equals_mepic_without_it(job, plain):
    """The tiny model drafting for itself: greedy drafts from a drafter that attends over the
    same logical context as the target (chunk tokens from the chunks' shared blocks) are the
    target's own tokens, so nearly every draft is accepted; drafter KV at wrong slots or
    positions would show as a low acceptance, never as other outputs."""
    draft = {"method": "draft_model", "model": job["model"], "num_speculative_tokens": 3}
    spec = run_engine({**job, "speculative_config": draft})
    tokens = [[r["tokens"] for r in batch] for batch in plain["batches"]]
    assert [[r["tokens"] for r in batch] for batch in spec["batches"]] == tokens
    counts = spec["spec_decode"]
    acceptance = counts["num_accepted_tokens"] / counts["num_draft_tokens"]
    print(f"draft-model acceptance {acceptance:.3f} ({counts})")
    assert acceptance >= 0.9
    assert spec["metrics"]["chunk_hits"] >= 2  # the second batch's a reused both its chunks
