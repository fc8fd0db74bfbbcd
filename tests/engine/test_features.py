"""vLLM serving features that run with MEPIC on (docs/features.md), in one real engine.

The engine turns on what is set at start-up (chunked prefill off, priority scheduling) and
serves one RAG request (two chunks) as a MEPIC request, with n = 2, under a structured-output
choice and at two priorities; and as a plain prompt with prompt logprobs (prompt logprobs are
refused for MEPIC requests: a chunk's shared tokens are never computed in the request's
context). Greedy: every variant's tokens equal the reference's (the first request, which
compiled the chunks; the later ones reuse them).
"""

from __future__ import annotations

import random

import pytest

from ascend_mepic.core.segments import Segment
from ascend_mepic.eval.prepare import prepare_tiny_llama
from tests.engine_host import encode, run_engine


@pytest.fixture(scope="module")
def result() -> dict:
    rng = random.Random(5)
    doc = Segment.chunk([rng.randint(5, 500) for _ in range(60)])
    other = Segment.chunk([rng.randint(5, 500) for _ in range(50)])
    request = [Segment.prompt([1, 40, 41]), doc, other, Segment.prompt([60, 61, 62])]
    return run_engine(
        {
            "model": str(prepare_tiny_llama()),
            "mepic": True,
            "block_size": 32,
            "max_tokens": 6,
            "batches": [[encode(request)]],
            "features": True,
            "choices": ["yes", "no"],
            "enable_chunked_prefill": False,
            "scheduling_policy": "priority",
        }
    )


def test_n_greater_than_one_reuses_chunks(result):
    assert result["n2"] == [result["reference"], result["reference"]]
    assert result["metrics"]["chunk_hits"] >= 2


def test_structured_output_choice(result):
    assert result["choice"] in ("yes", "no")


def test_priority_scheduling_and_chunked_prefill_off(result):
    assert result["priority"] == [result["reference"], result["reference"]]


def test_prompt_logprobs_on_a_plain_request(result):
    assert result["prompt_logprobs"] == 116  # every prompt token (the first as None)
