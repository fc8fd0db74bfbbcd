"""``ascend-mepic bench fidelity``: the verdict arithmetic (no engine) and one real run on the
tiny model, where full rerun against full must agree exactly."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ascend_mepic.eval.bench import fidelity


def _raw(policy: str, firsts: list[int], texts: list[str]) -> dict:
    reqs = [
        {
            "index": i,
            "arrival_s": 0.0,
            "first_token_s": 0.1,
            "finish_s": 0.2,
            "prompt_tokens": 100,
            "answers": ["Paris"],
            "text": text,
            "output_tokens": 2,
            "first_token": first,
            "top_logprobs": {str(first): math.log(0.8), "99": math.log(0.1)},
            "num_cached_tokens": 0,
        }
        for i, (first, text) in enumerate(zip(firsts, texts, strict=True))
    ]
    return {
        "policy": policy,
        "workload": "squad-chat-4p",
        "qps": 0.0,
        "block_size": 16,
        "pool_blocks": 100,
        "kv_timeline": [[0.1, 5]],
        "per_request": reqs,
        "manager_metrics": {},
    }


def test_rows_and_verdicts_follow_the_thresholds() -> None:
    n = fidelity.MIN_QUESTIONS
    full = _raw("full", [5] * n, ["Paris\nmore text"] * n)
    # One first token in n flipped (agreement 1 - 1/n >= 0.9), answers kept: safe.
    close = _raw("mepic", [6] + [5] * (n - 1), ["Paris"] * n)
    # A third of first tokens flipped and those answers wrong: not safe on either count.
    k = n // 3
    far = _raw("naive", [6] * k + [5] * (n - k), ["London"] * k + ["Paris"] * (n - k))
    rows = [fidelity.policy_row(p, r, full, n_boot=200) for p, r in
            (("full", full), ("mepic", close), ("naive", far))]  # fmt: skip
    ref, ok, bad = rows
    assert ref["top1_agreement"] == 1.0 and ref["kl_first_token"] == 0.0
    assert ref["f1"] == 1.0 and ref["f1_drop"] == 0.0  # F1 of the first line only
    assert ok["top1_agreement"] == pytest.approx(1 - 1 / n) and ok["kl_first_token"] > 0
    assert ok["safe"] and ok["verdict"].startswith("mepic: safe to turn on (top-1 agreement 0.97")
    assert not bad["safe"] and bad["f1_drop"] == pytest.approx(k / n)
    assert (
        "NOT safe" in bad["verdict"] and "< 0.90" in bad["verdict"] and "> 0.05" in bad["verdict"]
    )
    lo, hi = bad["f1_drop_ci"]
    assert lo <= bad["f1_drop"] <= hi
    lo, hi = bad["top1_agreement_ci"]
    assert lo < bad["top1_agreement"] < hi
    few = fidelity.policy_row("mepic", _raw("m", [5], ["Paris"]), _raw("f", [5], ["Paris"]))
    assert "indicative" in few["verdict"]
    text = fidelity.render(rows, "header")
    assert text.count("\n| ") == 4  # the column header and three rows
    assert [line for line in text.splitlines() if line.startswith(("mepic:", "naive:"))] == [
        ok["verdict"],
        bad["verdict"],
    ]


def test_bench_fidelity_on_the_tiny_model(tmp_path: Path, capsys) -> None:
    """Two engines (full, then full again): the table's format, and agreement 1 / KL 0 between
    two runs of full on the same questions."""
    from ascend_mepic.entrypoints.cli import main
    from ascend_mepic.eval.prepare import prepare_tiny_llama

    prepare_tiny_llama()
    out = tmp_path / "fidelity.json"
    argv = ["bench", "fidelity", "--model", "tiny", "--questions", "3", "--chunks", "2",
            "--max-tokens", "3", "--policies", "full", "--no-progress",
            "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0].startswith("Fidelity vs full recompute: model tiny, 3 SQuAD v2 questions")
    assert lines[2].startswith("| policy | questions | top-1 agree [95% CI] | KL 1st tok | F1 |")
    assert lines[4].startswith("| full | 3 | 1.000 [1.00, 1.00] | 0.0000 |")
    assert lines[5].startswith("| full (rerun) | 3 | 1.000 [1.00, 1.00] | 0.0000 |")
    assert "full (rerun): identical to full" in text
    rows = json.loads(out.read_text())["rows"]
    assert [r["policy"] for r in rows] == ["full", "full (rerun)"]
    rerun = rows[1]
    assert rerun["top1_agreement"] == 1.0 and rerun["kl_first_token"] == 0.0
    assert rerun["f1_drop"] == 0.0 and len(rerun["per_question"]) == 3
    assert [q["answer"] for q in rerun["per_question"]] == [
        q["answer"] for q in rows[0]["per_question"]
    ]
