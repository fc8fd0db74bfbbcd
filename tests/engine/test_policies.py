"""The PIC policy family in the real vLLM engine against the transformers reference of each policy.

Tiny random Llama (2 layers), float32, greedy, block size 32. Every policy runs in its own engine
process over the same requests: cold (chunks computed), then warm and batched (chunks reused),
so each comparison also checks that outputs do not depend on cache state. CacheBlend uses check
layer 0 here, so the tiny model has a layer after it where unselected tokens skip compute.
"""

from __future__ import annotations

import random

import pytest
import torch

from ascend_mepic.core.policies import Placement, parse_policy, top_fraction
from ascend_mepic.core.segments import Segment
from ascend_mepic.eval.prepare import prepare_tiny_llama
from tests.engine_host import encode, run_engine

B = 32
POLICIES = [
    "naive",
    "mepic",
    "mepic-8",
    "mepic-16",
    "mepic-block",
    "epic-16",
    "legolink-0",
    "cachetune-15",
    "cacheblend-15",
]


@pytest.fixture(scope="module")
def model() -> str:
    return str(prepare_tiny_llama())


@pytest.fixture(scope="module")
def requests() -> tuple[list[Segment], list[Segment]]:
    rng = random.Random(11)
    doc = Segment.chunk([rng.randint(5, 500) for _ in range(90)])  # 3 blocks, 26 in the first
    other = Segment.chunk([rng.randint(5, 500) for _ in range(70)])
    a = [Segment.prompt([1, 40, 41]), doc, other, Segment.prompt([60, 61, 62, 63])]
    b = [Segment.prompt([1, 77, 78, 79, 80]), other, doc, Segment.prompt([70, 71])]
    return a, b


@pytest.fixture(scope="module")
def runs(model, requests) -> dict[str, dict]:
    a, b = requests
    out = {}
    for policy in POLICIES:
        options = {"blend_check_layer": 0} if policy.startswith("cacheblend") else {}
        if parse_policy(policy).placement is Placement.SHARED:
            options["chunk_anchor"] = "none"  # the reference's unanchored semantics
        out[policy] = run_engine(
            {
                "model": model,
                "mepic": True,
                "policy": policy,
                "options": options,
                "block_size": B,
                "max_tokens": 4,
                "logprobs": 5,
                "batches": [[encode(a)], [encode(b), encode(a)]],
            }
        )
    return out


@pytest.fixture(scope="module")
def reference(model):
    from transformers import AutoModelForCausalLM

    from ascend_mepic.eval.policy_reference import PolicyReference

    hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    return (
        PolicyReference(hf, B, dummy_token_id=hf.config.bos_token_id, check_layer=0),
        PolicyReference(hf, B, dummy_token_id=hf.config.bos_token_id, check_layer=1),
    )


def assert_matches_reference(policy, run, requests, ref) -> None:
    """Cold and warm outputs agree; first-token logprobs equal the reference's within 1e-4."""
    a, b = requests
    (cold_a,), (warm_b, warm_a) = run["batches"]
    assert cold_a["tokens"] == warm_a["tokens"]  # cached or not, the same output
    for req, out in ((a, cold_a), (b, warm_b)):
        want = ref.logprobs(list(req), policy)[0]
        for tok, lp in out["logprobs"][0].items():
            assert abs(want[int(tok)].item() - lp) < 1e-4, (policy, tok, want[int(tok)], lp)


@pytest.mark.parametrize("policy", POLICIES)
def test_engine_matches_reference(policy, runs, requests, reference):
    ref = reference[0] if policy.startswith("cacheblend") else reference[1]
    assert_matches_reference(policy, runs[policy], requests, ref)


def test_policies_differ_where_they_should(runs, requests, reference):
    a, _ = requests
    ref = reference[1]
    full = ref.logprobs(list(a), "full")[0]
    naive = ref.logprobs(list(a), "naive")[0]
    assert (full - naive).abs().max() > 1e-3  # the check above can tell them apart
    first = runs["mepic"]["batches"][0][0]["logprobs"][0]
    same = runs["mepic-16"]["batches"][0][0]["logprobs"][0]
    assert first.keys() == same.keys()
    assert all(abs(first[t] - same[t]) < 1e-6 for t in first)  # mepic == mepic-16
    paper = runs["mepic-block"]["batches"][0][0]["logprobs"][0]
    assert any(abs(first[t] - paper.get(t, 0.0)) > 1e-4 for t in first)  # 16 tokens, not 26
    naive_engine = runs["naive"]["batches"][0][0]["logprobs"][0]
    assert any(abs(first[t] - naive_engine.get(t, 0.0)) > 1e-4 for t in first)


def test_private_placement_loads_and_shared_placement_shares(runs):
    epic = runs["epic-16"]["metrics"]
    assert epic["host_store_chunks"] == 2 and epic["blocks_loaded"] > 0
    assert epic["chunk_hits"] == 0  # nothing shared in the pool
    for name in ("mepic", "mepic-8", "mepic-block", "naive"):
        mepic = runs[name]["metrics"]
        assert mepic["chunk_hits"] >= 4 and mepic["blocks_loaded"] == 0, name


def test_epic_never_recomputes_the_first_chunk():
    epic = parse_policy("epic-16")
    assert epic.fresh_tokens(0, 90, B) == []
    assert epic.fresh_tokens(1, 90, B) == list(range(16))
    assert epic.fresh_tokens(2, 5, B) == list(range(5))


def test_policy_parsing_and_fresh_sets():
    assert parse_policy("mepic").fresh_tokens(0, 90, B) == list(range(16))
    assert parse_policy("mepic").fresh_tokens(0, 90, 128) == list(range(16))  # any block size
    assert parse_policy("mepic-8").fresh_tokens(0, 90, B) == list(range(8))
    assert parse_policy("mepic-block").fresh_tokens(0, 90, B) == list(range(26))
    assert parse_policy("mepic").chunk_is_cached(17, B)
    assert not parse_policy("mepic").chunk_is_cached(16, B)
    assert not parse_policy("mepic-block").chunk_is_cached(32, B)
    assert parse_policy("naive").fresh_tokens(3, 90, B) == []
    assert parse_policy("cacheblend-15").fresh_tokens(0, 90, B) == list(range(90))
    tune = parse_policy("cachetune-50")
    assert tune.fresh_tokens(0, 4, B, [0.1, 0.9, 0.5, 0.2]) == [1, 2]
    assert top_fraction([1.0, 1.0, 1.0], 0.34) == [0, 1]  # ties: lower index first
    assert parse_policy("epic-16").placement is Placement.PRIVATE
    assert parse_policy("prefix").placement is Placement.NONE
    for bad in ("epic", "mepic-0", "legolink-2", "cacheblend-0", "cachetune-101", "x", "full-3"):
        with pytest.raises(ValueError):
            parse_policy(bad)


def test_private_placement_across_engine_processes(model, requests, runs):
    """vLLM's default engine runs the worker in another process: the store crosses it."""
    a, b = requests
    job = {
        "model": model,
        "mepic": True,
        "policy": "epic-16",
        "block_size": B,
        "max_tokens": 4,
        "logprobs": 5,
        "batches": [[encode(a)], [encode(b), encode(a)]],
    }
    out = run_engine(job, VLLM_ENABLE_V1_MULTIPROCESSING="1")
    want = runs["epic-16"]["batches"]
    assert [[x["tokens"] for x in bt] for bt in out["batches"]] == [
        [x["tokens"] for x in bt] for bt in want
    ]


@pytest.mark.parametrize("policy", ["mepic", "epic-16"])
def test_block_size_16_matches_reference(policy, model, requests):
    """MEPIC's backend takes the paper's GPU block size on CPU too (CPU_ATTN's kernel needs 32)."""
    from transformers import AutoModelForCausalLM

    from ascend_mepic.eval.policy_reference import PolicyReference

    a, b = requests
    run = run_engine(
        {
            "model": model,
            "mepic": True,
            "policy": policy,
            "options": {"chunk_anchor": "none"} if policy == "mepic" else {},  # as the reference
            "block_size": 16,
            "max_tokens": 4,
            "logprobs": 5,
            "batches": [[encode(a)], [encode(b), encode(a)]],
        }
    )
    hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    ref = PolicyReference(hf, 16, dummy_token_id=hf.config.bos_token_id)
    assert_matches_reference(policy, run, requests, ref)
    if policy == "mepic":
        assert run["metrics"]["chunk_hits"] >= 4


def test_store_owner_removes_it_even_if_a_worker_opened_it_first(tmp_path):
    """In-process engines open the store in the worker before the scheduler claims it."""
    import subprocess
    import sys

    root = tmp_path / "store"
    code = (
        "from ascend_mepic.tier.host_store import host_store; "
        f"host_store({str(root)!r}); host_store({str(root)!r}, owner=True)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert not root.exists()
