"""Issue 65's variants in the policy reference, against tests/hf_oracle.py's independent
computation on the tiny model: compile anchors, private tokens chosen by the question's
attention, APE's temperature; canonical chunk KV the same for every request; the fidelity
harness's bootstrap summary and its argument errors."""

from __future__ import annotations

import pytest
import torch

from ascend_mepic.core.segments import Segment
from ascend_mepic.eval.policy_reference import PolicyReference, parse_variant
from tests.hf_oracle import MepicOracle

B = 4
TOL = 1e-4
FIXED = [1, 7, 9, 11]


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM

    from ascend_mepic.eval.prepare import resolve_model

    return AutoModelForCausalLM.from_pretrained(resolve_model("tiny"), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ref(tiny):
    return PolicyReference(tiny, B, dummy_token_id=0, check_layer=0, fixed_anchor=FIXED)


@pytest.fixture(scope="module")
def oracle(tiny):
    return MepicOracle(tiny)


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 500, (n,), generator=g).tolist()


def _req(prefix: int, chunks: list[int], question: int, mid: int | None = None) -> list[Segment]:
    """Prefix prompt, chunks (by seed, 11 tokens), optional middle prompt, the question."""
    segs = [Segment.prompt(_tokens(5, prefix))]
    for i, c in enumerate(chunks):
        segs.append(Segment.chunk(_tokens(11, c)))
        if mid is not None and i == 0:
            segs.append(Segment.prompt(_tokens(2, mid)))
    return [*segs, Segment.prompt(_tokens(4, question))]


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_parse_variant():
    v = parse_variant("mepic+anchor=prefix+pick=q4")
    assert (v.k, v.anchor, v.pick, v.temperature, v.lse_scale) == (16, "prefix", 4, 1.0, 1.0)
    assert parse_variant("mepic-8+pick=q").pick == 0
    assert parse_variant("naive+anchor=fixed").k == 0
    v = parse_variant("mepic+T=0.9+S=1.1")
    assert (v.temperature, v.lse_scale) == (0.9, 1.1)
    for bad in (
        "mepic",
        "mepic+anchor=bos",
        "naive+pick=q",
        "mepic-4+pick=q4",
        "epic-16+T=1",
        "mepic+T=0",
        "mepic+T=1+T=2",
        "mepic+pick=x",
        "cacheblend-15+anchor=prefix",
    ):
        with pytest.raises(ValueError):
            parse_variant(bad)


def test_options_at_identity_equal_the_policy(ref):
    segs = _req(1, [2, 3], 4, mid=5)
    for base in ("naive", "mepic-2"):
        got = ref.prefill(segs, f"{base}+T=1").next_logprobs
        assert torch.equal(got, ref.prefill(segs, base).next_logprobs)


@pytest.mark.parametrize("anchor", ["prefix", "fixed"])
def test_anchor_matches_oracle(ref, oracle, anchor):
    segs = _req(1, [2, 3], 4, mid=5)
    ids = segs[0].token_ids if anchor == "prefix" else FIXED
    got = ref.prefill(segs, f"mepic-2+anchor={anchor}").next_logprobs
    want = oracle.variant_logprobs(segs, lambda c, n: [0, 1], list(ids))
    assert _diff(got, want) < TOL
    assert _diff(got, ref.prefill(segs, "mepic-2").next_logprobs) > 1e-3  # it changes things


def test_prefix_anchor_makes_the_first_chunk_exact(ref):
    """Compiled after the request's own prefix, a lone chunk's KV is full recompute's."""
    segs = _req(1, [2], 4)
    got = ref.prefill(segs, "naive+anchor=prefix").next_logprobs
    assert _diff(got, ref.prefill(segs, "full").next_logprobs) < 1e-5  # float32 rounding
    assert _diff(ref.prefill(segs, "naive").next_logprobs, got) > 1e-3


@pytest.mark.parametrize(
    "variant", ["mepic-3+pick=q", "mepic-3+pick=q1", "mepic-3+anchor=prefix+pick=q1"]
)
def test_question_attention_pick_matches_oracle(ref, oracle, variant):
    segs = _req(1, [2, 3], 4, mid=5)
    v = parse_variant(variant)
    anchor = list(segs[0].token_ids) if v.anchor else []
    scores, probe = ref.question_attention(segs, v.anchor)
    want = oracle.question_attention(segs, anchor)
    assert torch.allclose(scores, want, atol=1e-7, rtol=1e-5)
    assert probe == 2 + 4  # the middle prompt and the question: prompt rows after chunk 0
    starts = [5, 5 + 11 + 2]
    chosen = []
    for s in starts:
        local = want[s : s + 11]
        rest = torch.argsort(-local[v.pick :], stable=True)[: v.k - v.pick] + v.pick
        chosen.append(sorted([*range(v.pick), *rest.tolist()]))
    state = ref.prefill(segs, variant)
    assert state.recomputed == 6 and state.probe_tokens == 6
    assert all(set(range(v.pick)) <= set(c) for c in chosen)
    got = state.next_logprobs
    assert _diff(got, oracle.variant_logprobs(segs, lambda c, n: chosen[c], anchor)) < TOL


def test_pick_differs_from_first_k(ref):
    segs = _req(1, [2, 3], 4)
    a = ref.prefill(segs, "mepic-3+pick=q")
    b = ref.prefill(segs, "mepic-3")
    assert a.recomputed == b.recomputed == 6 and a.canonical_runs >= 2
    assert _diff(a.next_logprobs, b.next_logprobs) > 1e-6


def test_ape_temperature_changes_only_rows_after_the_chunks(ref):
    segs = _req(1, [2, 3], 4, mid=5)
    plain, ape = ref.prefill(segs, "mepic-2"), ref.prefill(segs, "mepic-2+T=0.5+S=1.2")
    after = 5 + 11 + 2 + 11  # the question's first position
    for k1, k2 in zip(plain.keys[1:], ape.keys[1:], strict=True):
        assert torch.equal(k1[:after], k2[:after])  # KV before the question untouched
    assert _diff(plain.next_logprobs, ape.next_logprobs) > 1e-4


@pytest.mark.parametrize("anchor", ["prefix", "fixed"])
def test_canonical_kv_is_shared_and_untouched(tiny, ref, anchor):
    """Two requests with the same chunk at different positions, different questions (and, for
    the middle prompt, different context before it) read byte-identical canonical KV, the same
    a fresh reference compiles, unchanged by their prefills."""
    policy = f"mepic-2+anchor={anchor}+pick=q1"
    one = _req(1, [2, 3], 4)  # chunk 3 second
    two = _req(1, [3, 7, 8], 9, mid=6)  # chunk 3 first, other chunks and question
    p1, p2 = ref.canonical_parts(one, policy), ref.canonical_parts(two, policy)
    (key1, kv1), (key2, kv2) = p1[2], p2[1]
    assert key1 == key2
    before = [(k.clone(), v.clone()) for k, v in kv1]
    fresh = PolicyReference(tiny, B, fixed_anchor=FIXED).canonical_parts(two, policy)[1][1]
    for (k1, v1), (k2, v2), (k3, v3) in zip(kv1, kv2, fresh, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
        assert torch.equal(k1, k3) and torch.equal(v1, v3)
    ref.prefill(one, policy)
    ref.prefill(two, policy)
    for (k0, v0), (k1, v1) in zip(before, ref.canonical_parts(two, policy)[1][1], strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    # Another prefix: its own entry under anchor=prefix, the same one under anchor=fixed.
    other = _req(10, [3], 4)
    key3, kv3 = ref.canonical_parts(other, policy)[1]
    assert (key3 == key1) == (anchor == "fixed")
    assert torch.equal(kv3[-1][0], kv1[-1][0]) == (anchor == "fixed")  # layer 0: no context


def test_bootstrap_summary():
    from ascend_mepic.eval.bench.fidelity_ref import summarize, verdicts

    def rec(kl_a: float, kl_b: float) -> dict:
        base = {
            "agree": 1.0,
            "f1": None,
            "recomputed": 4,
            "private_tokens": 20,
            "blocks16": 2,
            "blocks128": 1,
            "probe_tokens": 0,
            "wall_s": 0.1,
            "canonical_runs": None,
        }
        return {
            "variants": {
                "mepic": {**base, "kl": kl_a, "kl20": kl_a},
                "x": {**base, "kl": kl_b, "kl20": kl_b},
            }
        }

    recs = [rec(0.1 + 0.01 * i, 0.05 + 0.01 * i) for i in range(20)]
    rows = summarize(recs, ["mepic", "x"], "mepic", 500)
    base, x = rows
    assert base["kl_diff"] == [0.0, 0.0, 0.0] and base["f1"] is None
    mean, lo, hi = x["kl_diff"]
    assert mean == pytest.approx(-0.05) and lo <= mean <= hi < 0
    assert verdicts({"a": rows, "b": rows}, "mepic", None)[0].startswith("x: beats mepic")
    costly = [dict(r, blocks16=3) if r["variant"] == "x" else r for r in rows]
    assert verdicts({"a": rows, "b": costly}, "mepic", None)[0].startswith("no variant")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--variants", "mepic+anchor=bos"], "unknown option"),
        (["--variants", "full"], "full is the reference"),
        (["--baseline", "mepic-x"], "unknown policy"),
        (["--datasets", "trivia"], "unknown dataset"),
        (["--questions", "0"], "--questions"),
    ],
)
def test_cli_argument_errors(argv, message):
    from ascend_mepic.entrypoints.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "fidelity-ref", "--model", "tiny", *argv])
    assert message in str(e.value)


def test_multidoc_set_is_deterministic_and_reuses_documents():
    from transformers import AutoTokenizer

    from ascend_mepic.eval.multidoc import chunk_lengths, multidoc_requests
    from ascend_mepic.eval.prepare import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model("tiny")))
    a, b = multidoc_requests(tok, 12, 4, seed=3), multidoc_requests(tok, 12, 4, seed=3)
    assert a == b and a != multidoc_requests(tok, 12, 4, seed=4)
    assert all(len(r.segments) == 6 for r in a) and len(chunk_lengths(a)) == 48
    chunks = [s.token_ids for r in a for s in r.segments if s.kind.value == "chunk"]
    assert len(set(chunks)) < len(chunks)  # a hot pool: documents recur across requests
    assert all(r.answers[0] for r in a)


def test_cli_end_to_end_on_tiny(tmp_path, capsys):
    """Both sets, two variants, one request each; the records re-render alone."""
    from ascend_mepic.entrypoints.cli import main

    jsonl = tmp_path / "r.jsonl"
    argv = ["bench", "fidelity-ref", "--model", "tiny", "--questions", "1", "--max-tokens", "2",
            "--variants", "mepic", "mepic+anchor=prefix+pick=q4", "--bootstrap", "50"]  # fmt: skip
    assert main([*argv, "--jsonl", str(jsonl)]) == 0
    out = capsys.readouterr().out
    assert "### squad: 1 requests" in out and "### multidoc: 1 requests" in out
    assert "| mepic+anchor=prefix+pick=q4 |" in out
    assert main([*argv, "--from-jsonl", str(jsonl)]) == 0
    assert capsys.readouterr().out == out
