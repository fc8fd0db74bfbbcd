"""Pure parts of ``ascend_mepic.eval.bench`` (no engine)."""

import math

import pytest

from ascend_mepic.core.segments import Segment, SegmentKind
from ascend_mepic.eval.bench import stats


def _segs(*chunks: tuple[int, ...]) -> list[Segment]:
    out = [Segment(SegmentKind.PROMPT, (1, 2, 3))]
    out += [Segment(SegmentKind.CHUNK, c) for c in chunks]
    out.append(Segment(SegmentKind.PROMPT, (4, 5)))
    return out


def test_workload_stats_counts_reuse_and_fresh_tokens():
    a, b = tuple(range(100, 110)), tuple(range(200, 206))  # 10 and 6 tokens
    reqs = [_segs(a, b), _segs(b, a)]
    st = stats.workload_stats(
        reqs, block_size=4, policies=["full", "mepic-block", "mepic-3", "epic-2"]
    )
    assert st["prompt_tokens_mean"] == 21
    assert st["reused_fraction"] == pytest.approx(16 / 42)
    assert st["recomputed_steady"]["full"] == 21
    # mepic-block recomputes each chunk's first (partial) block: 10 -> 2, 6 -> 2
    assert st["recomputed_steady"]["mepic-block"] == 5 + 2 + 2
    assert st["recomputed_first_seen"]["mepic-block"] == pytest.approx((5 + 16 + 5 + 4) / 2)
    assert st["recomputed_steady"]["mepic-3"] == 5 + 3 + 3  # the first 3 tokens of each
    # epic-2: first chunk nothing, later chunks 2 tokens
    assert st["recomputed_steady"]["epic-2"] == 5 + 0 + 2


def test_kl_identical_is_zero_and_shift_positive():
    d = {1: math.log(0.6), 2: math.log(0.3), 3: math.log(0.05)}
    assert stats.kl_first_token(d, d) == pytest.approx(0.0, abs=1e-12)
    other = {1: math.log(0.3), 2: math.log(0.6), 3: math.log(0.05)}
    expect = 0.6 * math.log(2) + 0.3 * math.log(0.5)
    assert stats.kl_first_token(d, other) == pytest.approx(expect)


def test_kl_missing_token_uses_bounded_share():
    full = {1: math.log(0.5), 2: math.log(0.5)}
    pol = {1: math.log(0.9), 3: math.log(0.05)}
    # token 2 missing: min(0.05, remaining 0.05 / 1) = 0.05
    expect = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.05)
    assert stats.kl_first_token(full, pol) == pytest.approx(expect)


def test_fidelity_matches_by_index():
    lp = {"7": math.log(0.9)}
    full = [
        {"index": 0, "first_token": 7, "top_logprobs": lp},
        {"index": 1, "first_token": 8, "top_logprobs": {"8": 0.0}},
    ]
    pol = [
        {"index": 1, "first_token": 9, "top_logprobs": {"9": 0.0}},
        {"index": 0, "first_token": 7, "top_logprobs": lp},
    ]
    agree, kl = stats.fidelity(full, pol)
    assert agree == 0.5
    assert kl > 0


def _raw(policy: str, first: int) -> dict:
    reqs = [
        {
            "index": i,
            "arrival_s": 0.5 * i,
            "first_token_s": 0.5 * i + 0.2,
            "finish_s": 0.5 * i + 1,
            "prompt_tokens": 100,
            "answers": ["Paris"],
            "text": "Paris" if i else "London",
            "output_tokens": 4,
            "first_token": first,
            "top_logprobs": {str(first): -0.1},
            "num_cached_tokens": 16,
        }
        for i in range(3)
    ]
    return {
        "policy": policy,
        "workload": "squad-chat-4p",
        "qps": 2.0,
        "block_size": 32,
        "pool_blocks": 100,
        "block_bytes": 10,
        "kv_timeline": [[0.1, 5], [0.2, 20], [0.3, 10]],
        "per_request": reqs,
        "manager_metrics": {"tokens_computed": 60, "tokens_reused": 240}
        if policy == "mepic"
        else {},
    }


def test_summarize_keys_and_values():
    full = stats.summarize(_raw("full", 5), _raw("full", 5))
    mep = stats.summarize(_raw("mepic", 6), _raw("full", 5))
    for row in (full, mep):
        assert set(stats.REQUIRED_KEYS) <= set(row)
    assert mep["peak_kv_usage"] == pytest.approx(0.2)
    assert mep["peak_kv_blocks"] == 20 and mep["peak_kv_bytes"] == 200
    assert mep["mean_kv_usage"] == pytest.approx(35 / 3 / 100)
    assert mep["f1"] == pytest.approx(2 / 3) and mep["em"] == pytest.approx(2 / 3)
    assert mep["latency_mean_s"] == pytest.approx(1.0)
    assert mep["recomputed_tokens_per_request"] == 20 and mep["reuse_fraction"] == 0.8
    assert full["recomputed_tokens_per_request"] == 84 and full["top1_agreement"] == 1.0
    assert mep["top1_agreement"] == 0.0


def test_reports_render():
    rows = [stats.summarize(_raw(p, 5)) for p in ("mepic", "epic-16", "cacheblend-15")]
    rows[1]["peak_kv_blocks"] = 40
    md = stats.render_compare_report(rows, "T", ["note"], hw="test-hw")
    assert "| mepic |" in md and "epic-16 / mepic: ours 2.00x, paper Table 2 1.96x" in md
    assert "Hardware: test-hw" in md and "n/a" in md
    # epic-16 at 2.00x vs the paper's 1.96x, cacheblend-15 at 1.00x vs 1.97x: not reproduced.
    assert "Verdict: peak KV cacheblend-15 / MEPIC 1.00x (paper 1.97x), epic-16 / MEPIC " in md
    assert "epic-16 / MEPIC 2.00x (paper 1.96x)" in md
    assert "NOT reproduced" in md
    rows[2]["peak_kv_blocks"] = 30
    assert "is reproduced at this size" in stats.verdict(rows)
    rows[2]["peak_kv_blocks"] = 25
    assert "less than the paper's" in stats.verdict(rows)
    summary = stats.render_compare_summary(rows, "out/report.md", "out/summary.png")
    assert summary.count("\n") < 15 and "Plot: out/summary.png" in summary
    sweep = [{**r, "x": x} for x in (1, 2) for r in rows]
    md2 = stats.render_sweep_report(sweep, "S", "QPS", "paper", hw="hw")
    assert "epic-16 / mepic: 2.00x, 2.00x" in md2


def test_poisson_arrivals_seeded_and_increasing():
    a = stats.poisson_arrivals(50, 4.0, seed=1)
    assert a == stats.poisson_arrivals(50, 4.0, seed=1)
    assert all(x < y for x, y in zip(a, a[1:], strict=False))
    assert 5 < a[-1] < 30
    assert stats.percentile([1, 2, 3, 4], 50) == 2.5


def test_runner_drives_the_real_engine_at_block_16():
    """One bench job per engine kind on the tiny model: MEPIC at the paper's block size 16, and
    the stock prefix baseline rounded up to the 32 its CPU attention needs. The jobs run in the
    engine hosts (``run``, as the job's own process would); ``run_in_subprocess``, which `bench
    compare` uses, runs in ``tests/entrypoints/test_data_streams.py``."""
    from ascend_mepic.eval.prepare import prepare_tiny_llama
    from tests.engine_host import run_engine

    job = {
        "model": str(prepare_tiny_llama()),
        "requests": 3,
        "chunks": 2,
        "seed": 0,
        "articles": 1,
        "block_size": 16,
        "max_tokens": 2,
        "qps": 50.0,
        "kv_gib": 1,
        "max_model_len": 2048,
        "progress": False,
        "record_steps": True,  # `bench profile`'s recording schedulers (MEPIC's and stock's)
    }
    # MEPIC unanchored: with 3 requests the sharing is too small to pay for anchored compiles'
    # recompute of the prompt (results.md), and this test is about the runner.
    policies = ("full", "mepic,chunk_anchor=none", "prefix")
    raws = {p: run_engine({"mepic": p != "prefix", "bench": {**job, "policy": p}})
            for p in policies}  # fmt: skip
    raws["mepic"] = raws.pop("mepic,chunk_anchor=none")
    assert raws["mepic"]["block_size"] == 16 and raws["prefix"]["block_size"] == 32
    for raw in raws.values():
        assert all(r["finish_s"] is not None for r in raw["per_request"])
        assert max(used for _, used in raw["kv_timeline"]) > 0
        steps = raw["step_records"]  # one per engine step, its work and its wall time
        assert len(steps) == len(raw["kv_timeline"]) and all(s["seconds"] > 0 for s in steps)
        # and the blocks in use right after each schedule(), the step's peak
        assert all(p >= a for (_, a), (_, p) in zip(raw["kv_timeline"], raw["kv_scheduled"],
                                                      strict=True))  # fmt: skip
        outputs = sum(r["output_tokens"] for r in raw["per_request"])
        assert sum(s["logits"] for s in steps) == outputs
    # MEPIC's steps compute fewer tokens than full recompute's: its chunks are shared
    assert sum(s["tokens"] for s in raws["mepic"]["step_records"]) < sum(
        s["tokens"] for s in raws["full"]["step_records"]
    )
    rows = [stats.summarize(raws[p], raws["full"]) for p in ("full", "mepic", "prefix")]
    assert rows[0]["top1_agreement"] == 1.0
    assert rows[1]["reuse_fraction"] > 0  # the second and third requests share the article
    assert "prefix at 32" in stats.render_compare_report(rows, "T", hw="hw")


def test_bench_kernels_reports_both_ratios_on_matching_outputs(tmp_path):
    """``ascend-mepic bench kernels``: MEPIC's CPU kernel and vLLM's run the same attention
    (their outputs are cross-checked before timing) and the JSON holds both ratios."""
    import json

    from ascend_mepic.entrypoints.cli import main

    out = tmp_path / "kernels.json"
    argv = ["bench", "kernels", "--context", "256", "--batch", "2", "--repeats", "1"]
    assert main([*argv, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["decode_vs_vllm"] > 0 and report["prefill_vs_vllm"] > 0
    assert set(report["results"]) == {
        "decode/float32", "prefill/float32", "decode/bfloat16", "prefill/bfloat16"
    }  # fmt: skip
    assert report["results"]["prefill/float32"]["max_abs_diff"] < 1e-3
    assert report["shapes"]["context"] == 256
