"""MEPIC inside vllm-ascend on a real NPU: policy ``full`` (every chunk recomputed in context)
gives stock vllm-ascend's greedy tokens. UNTESTED ON HARDWARE.

A tiny random Llama (2 layers, 4 query / 2 KV heads) at head sizes 128 (the torch_npu
composition's FIA shape) and 64 (the triton-ascend kernel), float16, block 128; each engine in
its own process (tests/engine_runner.py). Requests mix chunks and prompts and cross block
boundaries. MEPIC's attention differs from stock vllm-ascend's in rounding only, so where a
greedy choice was a near tie the two may part: there, stock's token must be among MEPIC's top 5
and within ``NEAR_TIE`` nats of MEPIC's choice at the first step they differ.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from ascend_mepic.eval.prepare import prepare_tiny_llama

pytestmark = pytest.mark.npu

RUNNER = Path(__file__).parents[1] / "engine_runner.py"
MAX_TOKENS = 12
NEAR_TIE = 0.05  # nats, float16


def run_engine(job: dict) -> dict:
    """One engine in its own process; its outputs in order, checked to have run on the NPU."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(RUNNER.parents[1]))
    batch = [{"segments": segments} for segments in job.pop("requests")]
    runner_job = {**job, "block_size": 128, "logprobs": 5, "batches": [batch]}
    proc = subprocess.run(
        [sys.executable, str(RUNNER), json.dumps(runner_job)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    who = f"MEPIC policy {job['policy']}" if job["mepic"] else "stock vllm-ascend"
    assert proc.returncode == 0, f"{who} failed:\n{proc.stderr[-6000:]}"
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    result = json.loads(line[len("RESULT") :])
    assert result["platform"] == "npu", f"{who} ran on {result['platform']!r}, not the NPU"
    return {"outputs": result["batches"][0]}


def requests() -> list:
    rng = random.Random(28)

    def ids(n: int) -> list[int]:
        return [rng.randint(5, 500) for _ in range(n)]

    return [
        [["prompt", ids(5)]],
        [["prompt", ids(3)], ["chunk", ids(150)], ["chunk", ids(90)], ["prompt", ids(40)]],
        [["chunk", ids(130)], ["prompt", ids(7)]],
    ]


def compare(stock: dict, mepic: dict) -> None:
    for i, (s, m) in enumerate(zip(stock["outputs"], mepic["outputs"], strict=True)):
        if s["tokens"] == m["tokens"]:
            continue
        pairs = zip(s["tokens"], m["tokens"], strict=False)
        step = next((j for j, (a, b) in enumerate(pairs) if a != b), None)
        assert step is not None, f"request {i}: one run stopped early: {s['tokens']}, {m['tokens']}"
        want, got = str(s["tokens"][step]), str(m["tokens"][step])
        lp = m["logprobs"][step]
        assert want in lp, (
            f"request {i}: step {step}: stock's token {want} is not in MEPIC's top 5 "
            f"(stock {s['tokens']}, MEPIC {m['tokens']})"
        )
        gap = lp[got] - lp[want]
        assert gap <= NEAR_TIE, (
            f"request {i}: step {step}: MEPIC chose {got} over stock's {want} by {gap:.3f} "
            f"nats (> {NEAR_TIE}): stock {s['tokens']}, MEPIC {m['tokens']}"
        )


@pytest.mark.parametrize("head_dim", [128, 64])
def test_policy_full_matches_stock_vllm_ascend(head_dim, npu_device, tmp_path_factory):
    if importlib.util.find_spec("vllm_ascend") is None:
        pytest.fail("vllm-ascend is not installed (docs/ascend.md)")
    model = prepare_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", head_dim=head_dim)
    job = {"model": str(model), "dtype": "float16", "requests": requests(),
           "max_tokens": MAX_TOKENS, "policy": None}  # fmt: skip
    stock = run_engine({**job, "mepic": False})
    mepic = run_engine({**job, "mepic": True, "policy": "full"})
    compare(stock, mepic)
