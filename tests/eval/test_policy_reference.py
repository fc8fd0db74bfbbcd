"""The transformers policy reference, SQuAD metrics and chat prompts.

The reference is checked against things it does not share code with: the HF model's own forward
(full recompute, greedy generation) and tests/hf_oracle.py's MEPIC oracle, plus the identities the
policy definitions imply (mepic-16 == mepic, cacheblend-100 == cachetune-100 == full, epic-K on a
single chunk == naive).
"""

from __future__ import annotations

import pytest
import torch

from ascend_mepic.core.segments import Segment
from ascend_mepic.eval.policy_reference import PolicyReference, cachetune_scores, parse_policy
from ascend_mepic.eval.squad_metrics import (
    bootstrap_mean,
    exact_match,
    f1,
    normalize_answer,
    paired_bootstrap,
)
from tests.hf_oracle import MepicOracle, first_block, first_k

B = 4
TOL = 1e-4


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM

    from ascend_mepic.eval.prepare import resolve_model

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(resolve_model("tiny"), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ref(tiny):
    # Check layer 0: the tiny model has 2 layers, so CacheBlend's selection must act at layer 1.
    return PolicyReference(tiny, B, dummy_token_id=0, check_layer=0)


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 500, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def segs() -> list[Segment]:
    """Prompt, a 3-block chunk (first block 3 real tokens), a single-block chunk, a prompt, a
    3-block chunk with a 1-token first block, and the question."""
    return [
        Segment.prompt(_tokens(5, 1)),
        Segment.chunk(_tokens(11, 2)),
        Segment.chunk(_tokens(3, 3)),
        Segment.prompt(_tokens(2, 4)),
        Segment.chunk(_tokens(9, 5)),
        Segment.prompt(_tokens(4, 6)),
    ]


def _flat(segments: list[Segment]) -> list[int]:
    return [t for s in segments for t in s.token_ids]


def _hf_logprobs(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0]
    return torch.log_softmax(logits.double(), dim=-1)


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# -- policy names ------------------------------------------------------------------------------


def test_parse_policy():
    assert parse_policy("full") == ("full", None)
    assert parse_policy("mepic") == ("mepic", None)
    assert parse_policy("MEPIC-4") == ("mepic", 4)
    assert parse_policy("epic-16") == ("epic", 16)
    assert parse_policy("legolink-0") == ("legolink", 0)
    assert parse_policy("cacheblend-15") == ("cacheblend", 15)
    assert parse_policy("cachetune-100") == ("cachetune", 100)
    for bad in (
        "prefix",
        "epic",
        "naive-3",
        "legolink-2",
        "cacheblend-0",
        "cachetune-101",
        "mepic-0",
        "full-1",
        "",
        "blend-15",
    ):
        with pytest.raises(ValueError):
            parse_policy(bad)


# -- the reference against independent computations --------------------------------------------


def test_full_equals_hf_forward(ref, tiny, segs):
    cont = [7, 8, 9]
    want = _hf_logprobs(tiny, _flat(segs) + cont)[-1 - len(cont) :]
    assert _maxdiff(ref.logprobs(segs, "full", cont), want) < TOL


def test_full_generate_equals_hf_greedy(ref, tiny, segs):
    prompt = torch.tensor([_flat(segs)])
    with torch.no_grad():
        want = tiny.generate(prompt, max_new_tokens=6, do_sample=False)[0, prompt.shape[1] :]
    assert ref.generate(segs, "full", 6) == want.tolist()


def test_mepic_equals_oracle(ref, tiny, segs):
    oracle = MepicOracle(tiny)
    got = ref.logprobs(segs, "mepic-block")[0]
    assert _maxdiff(got, oracle.next_token_logprobs(segs, first_block(B))) < TOL
    assert _maxdiff(got, ref.logprobs(segs, "full")[0]) > 1e-3  # the comparison can fail
    got = ref.logprobs(segs, "mepic-2")[0]
    assert _maxdiff(got, oracle.next_token_logprobs(segs, first_k(2))) < TOL
    assert _maxdiff(ref.logprobs(segs, "mepic")[0], ref.logprobs(segs, "mepic-16")[0]) < 1e-12


def test_recomputed_counts(ref, segs):
    # chunks of 11, 3 and 9 tokens; B = 4: first blocks hold 3, 3 (single block) and 1 tokens
    assert ref.recomputed_tokens(segs, "mepic-block") == (7, (23 - 7) / 34)
    assert ref.recomputed_tokens(segs, "mepic")[0] == 23  # every chunk has at most 16 tokens
    assert ref.recomputed_tokens(segs, "mepic-2")[0] == 2 + 2 + 2
    assert ref.recomputed_tokens(segs, "naive") == (0, 23 / 34)
    assert ref.recomputed_tokens(segs, "legolink-0")[0] == 0
    assert ref.recomputed_tokens(segs, "full") == (23, 0.0)
    assert ref.recomputed_tokens(segs, "epic-2")[0] == 0 + 2 + 2  # never chunk 0
    assert ref.recomputed_tokens(segs, "cacheblend-30")[0] == 7  # ceil(0.3 * 23)
    assert ref.recomputed_tokens(segs, "cachetune-30")[0] == 4 + 1 + 3  # ceil(0.3 * L) per chunk


def test_epic_never_recomputes_first_chunk(ref, segs):
    single = [segs[0], segs[1], segs[5]]
    assert ref.recomputed_tokens(single, "epic-16")[0] == 0
    assert _maxdiff(ref.logprobs(single, "epic-16")[0], ref.logprobs(single, "naive")[0]) < 1e-12


def test_naive_and_legolink_differ(ref, segs):
    full = ref.logprobs(segs, "full")[0]
    naive = ref.logprobs(segs, "naive")[0]
    assert _maxdiff(naive, full) > 1e-3
    assert _maxdiff(ref.logprobs(segs, "legolink-0")[0], naive) > 1e-3


@pytest.mark.parametrize("policy", ["cacheblend-100", "cachetune-100"])
def test_full_ratio_equals_full(ref, segs, policy):
    cont = [11, 12]
    assert _maxdiff(ref.logprobs(segs, policy, cont), ref.logprobs(segs, "full", cont)) < 1e-9


@pytest.mark.parametrize("policy", ["cacheblend-30", "cachetune-30"])
def test_partial_ratio_differs_from_full(ref, segs, policy):
    assert _maxdiff(ref.logprobs(segs, policy)[0], ref.logprobs(segs, "full")[0]) > 1e-4


def test_continuation_is_fresh_prompt(ref, segs):
    """Teacher-forced continuation tokens behave exactly like extra question tokens."""
    cont = [21, 22, 23]
    longer = [*segs[:-1], Segment.prompt(segs[-1].token_ids + tuple(cont))]
    for policy in ("mepic-2", "cacheblend-30", "legolink-0"):
        got = ref.logprobs(segs, policy, cont)[-1]
        assert _maxdiff(got, ref.logprobs(longer, policy)[0]) < 1e-6, policy


def test_greedy_batch_matches_single(ref, segs):
    states = [ref.prefill(segs, p) for p in ("full", "naive", "mepic")]
    assert ref.greedy_batch(states, 5, None) == [ref.greedy(s, 5, None) for s in states]


def test_cachetune_scores():
    const = torch.ones(6, 2, 3)
    assert torch.allclose(cachetune_scores([(const, 2 * const)] * 2), torch.ones(6, dtype=float))
    g = torch.Generator().manual_seed(0)
    kv = [(torch.randn(9, 2, 4, generator=g), torch.randn(9, 2, 4, generator=g))]
    s = cachetune_scores(kv)
    assert s.shape == (9,) and abs(s.mean().item() - 1.0) < 1e-9  # one layer: mean-normalized


def test_rejects_bad_requests(ref, segs):
    with pytest.raises(ValueError):
        ref.prefill(segs[:-1], "mepic")  # ends with a chunk
    with pytest.raises(ValueError):
        PolicyReference(ref.model, B).prefill(segs, "legolink-0")  # no dummy token


# -- SQuAD metrics -----------------------------------------------------------------------------


def test_normalization_and_scores():
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert normalize_answer("an Apple, a day") == "apple day"
    assert exact_match("the Denver Broncos", ["Denver Broncos"]) == 1.0
    assert exact_match("Broncos", ["Denver Broncos"]) == 0.0
    assert f1("Denver Broncos", ["Broncos"]) == pytest.approx(2 / 3)
    assert f1("Denver", ["Carolina Panthers", "Denver Broncos"]) == pytest.approx(2 / 3)
    assert f1("", ["x"]) == 0.0 and f1("the", ["a"]) == 1.0  # both normalize to empty
    assert f1("x", []) == 0.0


def test_bootstrap_deterministic():
    a = [0.0, 1.0, 0.5, 0.25, 1.0, 0.0]
    b = [1.0, 1.0, 0.5, 0.75, 1.0, 0.5]
    d1 = paired_bootstrap(a, b, n=500, seed=3)
    assert d1 == paired_bootstrap(a, b, n=500, seed=3)
    assert d1.mean == pytest.approx(sum(b) / 6 - sum(a) / 6)
    assert d1.low <= d1.mean <= d1.high and d1.low >= 0.0
    m = bootstrap_mean(a, n=500, seed=1)
    assert m.low <= m.mean <= m.high
    with pytest.raises(ValueError):
        paired_bootstrap(a, b[:-1])


# -- chat prompts ------------------------------------------------------------------------------


def test_squad_chat_requests_shape():
    from transformers import AutoTokenizer

    from ascend_mepic.core.segments import SegmentKind
    from ascend_mepic.eval.prepare import resolve_model
    from ascend_mepic.eval.squad_prompts import chat_segments, squad_chat_requests, template_ids
    from ascend_mepic.eval.trace import squad_requests

    tok = AutoTokenizer.from_pretrained(str(resolve_model("smollm2")))
    reqs = squad_chat_requests(tok, 5, num_paragraphs=3, seed=1)
    assert len(reqs) == 5
    for (q, segs), (q2, paragraphs) in zip(reqs, squad_requests(5, 3, 1), strict=True):
        assert q == q2
        kinds = [s.kind for s in segs]
        assert kinds == [SegmentKind.PROMPT] + [SegmentKind.CHUNK] * 3 + [SegmentKind.PROMPT]
        assert segs[0].token_ids[0] == tok.bos_token_id  # the template opens with <|im_start|>
        assert _flat(segs) == template_ids(tok, q.question, paragraphs)
        assert tok.decode(list(segs[-1].token_ids)).endswith("<|im_start|>assistant\n")
    # a paragraph has the same chunk tokens wherever it appears
    one = chat_segments(tok, "Who?", ["Alpha beta.", "Gamma delta. "])
    two = chat_segments(tok, "Where else?", ["Gamma delta.", "Alpha beta.", "Other."])
    assert one[1] == two[2] and one[2] == two[1]
