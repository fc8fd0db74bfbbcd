"""MEPIC inside the real vLLM engine (tiny random Llama, float32, greedy).

Each job runs on a fresh engine in an engine host (tests/engine_host.py).
"""

import random

import pytest
import torch

from ascend_mepic.core.segments import Segment
from ascend_mepic.eval.prepare import prepare_tiny_llama
from tests.engine_host import encode, run_engine
from tests.hf_oracle import MepicOracle, first_k, full_segments

B = 32  # stock-vLLM comparisons; MEPIC runs at vllm-ascend's 128 and at 16


@pytest.fixture(scope="module")
def model():
    return str(prepare_tiny_llama())


@pytest.fixture(scope="module")
def requests():
    rng = random.Random(7)
    doc = Segment.chunk([rng.randint(5, 500) for _ in range(90)])  # 16 private, 74 shared
    other = Segment.chunk([rng.randint(5, 500) for _ in range(70)])
    a = [Segment.prompt([1, 40, 41]), doc, other, Segment.prompt([60, 61, 62, 63])]
    b = [
        Segment.prompt([1] + [rng.randint(5, 500) for _ in range(45)]),
        other,
        doc,
        Segment.prompt([70, 71]),
    ]
    return a, b


def many_chunks(seed: int, num_chunks: int) -> list[Segment]:
    """A prompt of ``num_chunks`` chunks of 17 to 60 tokens (so each has canonical tokens)
    between short prompts: it fits 1,024 tokens, and at block 128 its table needs about three
    entries per chunk, far more than vLLM's 8 for 1,024 tokens."""
    rng = random.Random(seed)
    segments = [Segment.prompt([1] + [rng.randint(5, 500) for _ in range(5)])]
    for _ in range(num_chunks):
        segments.append(Segment.chunk([rng.randint(5, 500) for _ in range(rng.randint(17, 60))]))
        segments.append(Segment.prompt([rng.randint(5, 500) for _ in range(rng.randint(1, 3))]))
    return segments


MANY = (many_chunks(1, 8), many_chunks(2, 16))
MAX_CHUNKS = 16  # the engine's max_chunks_per_request in these runs


def mepic_job(model, requests, block_size: int, tensor_parallel_size: int = 1) -> dict:
    """Batch 0: a, b and a under another tenant's salt, together; then a and b alone (warm);
    then a again after every idle chunk (and the blocks they share) was evicted."""
    a, b = requests
    return {
        "model": model,
        "mepic": True,
        "block_size": block_size,
        "max_tokens": 8,
        "batches": [
            [encode(a), encode(b), {**encode(a), "salt": "tenant-2"}],
            [encode(a)],
            [encode(b)],
            [encode(a)],
            [encode(r) for r in MANY],
        ],
        "reset_before": [3],
        "tensor_parallel_size": tensor_parallel_size,
        # Unanchored compiles: a and b (other prefixes) share chunks, checked against the
        # unanchored oracle; the default (anchored) is checked by ``anchored`` below.
        "options": {"max_chunks_per_request": MAX_CHUNKS, "chunk_anchor": "none"},
        # Refused in the front end, before the engine core: one chunk too many (through the
        # offline helper), and segments that do not add up to the prompt (plain LLM.generate).
        "refuse": [
            encode(many_chunks(3, MAX_CHUNKS + 1)),
            {
                "raw": {
                    "prompt_token_ids": [1, 2, 3],
                    "extra_args": {"mepic_segments": [["prompt", 1], ["chunk", 1], ["prompt", 2]]},
                }
            },
        ],
    }


@pytest.fixture(scope="module", params=[16, 128])
def block_size(request) -> int:
    return request.param


@pytest.fixture(scope="module")
def mepic_run(model, requests, block_size):
    return run_engine(mepic_job(model, requests, block_size))


def test_full_policy_reproduces_stock_vllm(model, requests):
    batches = [[encode(r) for r in requests]]
    stock = run_engine({"model": model, "mepic": False, "block_size": B, "batches": batches})
    full = run_engine(
        {"model": model, "mepic": True, "policy": "full", "block_size": B, "batches": batches}
    )
    for s, f in zip(stock["batches"][0], full["batches"][0], strict=True):
        assert s["tokens"] == f["tokens"]
        for ls, lf in zip(s["logprobs"], f["logprobs"], strict=True):
            assert ls.keys() == lf.keys()
            for t in ls:
                assert abs(ls[t] - lf[t]) < 1e-5


def test_outputs_do_not_depend_on_cache_state(mepic_run):
    batched, alone_a, alone_b, evicted_a = mepic_run["batches"][:4]
    assert batched[0]["tokens"] == alone_a[0]["tokens"] == evicted_a[0]["tokens"]
    assert batched[1]["tokens"] == alone_b[0]["tokens"]
    assert batched[2]["tokens"] == batched[0]["tokens"]  # same request, other tenant
    for x, y in zip(alone_a[0]["logprobs"], evicted_a[0]["logprobs"], strict=True):
        assert all(abs(x[t] - y[t]) < 1e-5 for t in x.keys() & y.keys())
    # The engine core skipped its own hashing of these segmented prompts (MEPIC hashes them).
    assert mepic_run["block_hasher"].startswith("mepic_request_block_hasher")
    metrics = mepic_run["metrics"]
    assert metrics["chunk_hits"] >= 4  # warm runs hit both chunks
    assert metrics["chunk_evictions"] >= 2  # the reset evicted chunks that share a block


def test_concurrent_requests_share_chunk_blocks_and_tenants_do_not(mepic_run, block_size):
    (_, blocks_a), (_, blocks_b), (_, blocks_c) = mepic_run["chunk_blocks"][:3]
    doc_a, doc_b = blocks_a[0], blocks_b[1]  # 'doc' is chunk 0 of a and chunk 1 of b
    other_a, other_b = blocks_a[1], blocks_b[0]
    # Every canonical block is shared; 74 + 54 canonical tokens are packed back to back
    # ('other' starts in the block where 'doc' ends), so together they take ceil(128 / B).
    assert doc_a == doc_b and other_a == other_b
    assert len(set(doc_a) | set(other_a)) == -(-(74 + 54) // block_size)
    # The same chunks under another salt share no block with the first tenant's.
    assert not (set(blocks_c[0]) | set(blocks_c[1])) & (set(doc_a) | set(other_a))


def test_next_token_logits_match_independent_oracle(model, requests, mepic_run, block_size):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    oracle = MepicOracle(hf)
    for req, out in zip(requests, mepic_run["batches"][0][:2], strict=True):
        want = oracle.next_token_logprobs(list(req), first_k(16))
        full = oracle.next_token_logprobs(full_segments(list(req)), first_k(16))
        got = out["logprobs"][0]
        for tok, lp in got.items():
            assert abs(want[int(tok)].item() - lp) < 1e-4, (tok, want[int(tok)].item(), lp)
        # The oracle distinguishes MEPIC from full recompute, so the check above can fail.
        assert (want - full).abs().max().item() > 1e-4


MANY_TOKENS: dict[int, list[list[int]]] = {}  # block size -> tokens of the MANY requests


def test_many_chunks_fit_at_every_block_size(model, mepic_run, block_size):
    """8 and 16 chunks in 1,024 tokens are served at block 128 as at 16 (issue 46: vLLM's
    8-entry rows refused them), their first token's log-probabilities match the independent
    oracle, and the tokens are the same at both block sizes."""
    from transformers import AutoModelForCausalLM

    outs = mepic_run["batches"][4]
    for out in outs:
        assert out["finish"] == "length" and len(out["tokens"]) == 8, out["finish"]
    oracle = MepicOracle(AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32))
    for req, out in zip(MANY, outs, strict=True):
        want = oracle.next_token_logprobs(list(req), first_k(16))
        for tok, lp in out["logprobs"][0].items():
            assert abs(want[int(tok)].item() - lp) < 1e-4, (tok, want[int(tok)].item(), lp)
    MANY_TOKENS[block_size] = [out["tokens"] for out in outs]
    if len(MANY_TOKENS) == 2:
        assert MANY_TOKENS[16] == MANY_TOKENS[128]


def test_unservable_requests_raise_in_the_front_end(mepic_run):
    """``LLM.generate`` raises vLLM's ``VLLMValidationError`` naming the limit and the need, as
    for an over-long prompt, instead of returning an empty output with finish_reason "error";
    the engine then serves the other batches as usual."""
    too_many, malformed = mepic_run["refused"]
    assert (
        too_many is not None
        and (f"{MAX_CHUNKS + 1} chunks; this engine serves at most {MAX_CHUNKS} per request")
        in too_many
    )
    assert malformed is not None and "prompt has 3 tokens but segments" in malformed
    assert "sum to 4" in malformed


def test_tensor_parallel_2_equals_1_with_mepic_on(model, requests, mepic_run, block_size):
    """TP=2 (two CPU workers, gloo all-reduce) gives TP=1's tokens and log-probabilities."""
    if block_size != 128:
        pytest.skip("run once, at vllm-ascend's block size")
    tp2 = run_engine(
        mepic_job(model, requests, block_size, tensor_parallel_size=2),
        VLLM_CPU_OMP_THREADS_BIND="nobind",
    )
    assert tp2["metrics"]["chunk_hits"] == mepic_run["metrics"]["chunk_hits"]
    for one, two in zip(mepic_run["batches"], tp2["batches"], strict=True):
        for o1, o2 in zip(one, two, strict=True):
            assert o1["tokens"] == o2["tokens"]
            for l1, l2 in zip(o1["logprobs"], o2["logprobs"], strict=True):
                for tok in l1.keys() & l2.keys():
                    assert abs(l1[tok] - l2[tok]) < 1e-4


@pytest.fixture(scope="module")
def anchored(model, requests, block_size):
    """The default ``chunk_anchor: first``, at blocks 16 and 128: c and d share a prefix and
    place the chunks in other orders with other questions; e has another prefix. c alone
    (cold), c and d together, e, then c again (warm), with every ready chunk's KV digested after
    each batch."""
    a, _ = requests
    doc, other = a[1], a[2]
    prefix = Segment.prompt([1, 40, 41, 42, 43, 44, 45])
    c = [prefix, doc, other, Segment.prompt([60, 61, 62, 63])]
    d = [prefix, other, doc, Segment.prompt([70, 71])]
    e = [Segment.prompt([1, 50, 51]), doc, Segment.prompt([80, 81, 82])]
    job = {
        "model": model,
        "mepic": True,
        "block_size": block_size,
        "max_tokens": 4,
        "batches": [[encode(c)], [encode(c), encode(d)], [encode(e)], [encode(c)]],
        "chunk_digests": True,
    }
    return (c, d, e), run_engine(job)


def test_anchored_chunks_match_the_oracle_and_stay_canonical(model, anchored):
    """Every chunk is compiled after the first request's prefix (c's), and each request's
    first-token log-probabilities match the oracle's semantics for that anchor (which differ
    from unanchored MEPIC's and, for e, from its own prefix's, so the check can fail): c, d and
    e, whose prefix differs, read the same canonical blocks of ``doc``, whose bytes never change;
    c is the same cold and warm."""
    from transformers import AutoModelForCausalLM

    (c, d, e), run = anchored
    oracle = MepicOracle(AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32))
    batches = run["batches"]
    anchor = tuple(c[0].token_ids)
    for req, out in zip((c, d, e), (batches[0][0], batches[1][1], batches[2][0]), strict=True):
        want = oracle.next_token_logprobs(list(req), first_k(16), anchor)
        for tok, lp in out["logprobs"][0].items():
            assert abs(want[int(tok)].item() - lp) < 1e-4, (tok, want[int(tok)].item(), lp)
        plain = oracle.next_token_logprobs(list(req), first_k(16))
        own = oracle.next_token_logprobs(list(req), first_k(16), tuple(req[0].token_ids))
        assert (want - plain).abs().max().item() > 1e-4
        assert req is not e or (want - own).abs().max().item() > 1e-4
    assert batches[0][0]["tokens"] == batches[1][0]["tokens"] == batches[3][0]["tokens"]
    (_, c_blocks), (_, d_blocks) = run["chunk_blocks"][1:3]  # c and d together
    assert c_blocks[0] == d_blocks[1] and c_blocks[1] == d_blocks[0]  # doc, other: shared
    after_c, after_d, after_e, _ = run["chunk_digests"]  # after_d: after c and d
    assert len(after_c) == len(after_e) == 2  # e compiled nothing: one copy of doc
    for cid, (_, digest) in after_c.items():  # the KV bytes, wherever the chunk sits
        assert after_d[cid][1] == after_e[cid][1] == digest
    assert run["metrics"]["chunk_anchor_tokens"] == len(anchor)
