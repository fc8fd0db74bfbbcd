"""Issue 46: no benchmark or evaluation command reports a number from a request the engine did
not serve, or a time or rate that is not positive.

A failing request is planted into each command's own collection or reporting path: vLLM's real
``RequestOutput`` / ``CompletionOutput`` as the engine returns a refused request (empty,
``finish_reason="error"``) or an empty ``"length"`` one, or the bench runner's per-request record
made from them by the runner's own code. Each must end in ``ascend_mepic.eval.outputs``'s error,
whose message names the request, the configuration, the finish reason and the tokens. No engine
starts and nothing is downloaded (the tiny model is built locally when missing).
"""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
from vllm import SamplingParams
from vllm.outputs import CompletionOutput, RequestOutput

from ascend_mepic.core.segments import Segment
from ascend_mepic.eval import outputs
from ascend_mepic.eval.bench import fidelity, kernels, runner, stats
from ascend_mepic.eval.outputs import FailedRequestError, InvalidMeasurementError

ROOT = Path(__file__).resolve().parents[2]


def _script(relative: str) -> ModuleType:
    """A benchmark script (benchmarks/ is no package) imported as a module."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(f"_bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


def _output(request_id: str, tokens: list[int], finish_reason: str | None) -> RequestOutput:
    completion = CompletionOutput(
        index=0,
        text="",
        token_ids=tokens,
        cumulative_logprob=None,
        logprobs=None,
        finish_reason=finish_reason,
    )
    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=[1, 2, 3],
        prompt_logprobs=None,
        outputs=[completion],
        finished=True,
    )


def refused(request_id: str) -> RequestOutput:
    """What vLLM returns for a request it refused: no tokens, finish_reason "error"."""
    return _output(request_id, [], "error")


def served(request_id: str, n: int) -> RequestOutput:
    return _output(request_id, list(range(7, 7 + n)), "length")


def planted_engine(
    fails: Callable[[SamplingParams], bool],
    bad: Callable[[str], RequestOutput] = refused,
) -> Callable[[list, list], list[RequestOutput]]:
    """``LLM.generate(prompts, params)``'s stand-in: per prompt, the planted ``bad`` output where
    ``fails(params)``, else ``max_tokens`` tokens after 5 ms per token (so a decode time, the
    difference of two calls, is clearly positive)."""

    def generate(prompts: list, params: list) -> list[RequestOutput]:
        out = []
        for i, sp in enumerate(params):
            if fails(sp):
                out.append(bad(str(i)))
            else:
                time.sleep(5e-3 * sp.max_tokens)
                out.append(served(str(i), sp.max_tokens))
        return out

    return generate


# -- the shared checker ------------------------------------------------------------------------


def test_checker_names_request_reason_and_tokens():
    outs = [served("a", 1), refused("b"), _output("c", [], "length"), _output("d", [5], "abort")]
    with pytest.raises(FailedRequestError) as e:
        outputs.check_request_outputs(outs, SamplingParams(max_tokens=1), "config X")
    msg = str(e.value)
    assert msg.startswith("config X: 3 of 4 requests failed: ")
    assert "request 1 (id 'b'): finish_reason 'error', 0 tokens received of max_tokens=1" in msg
    assert "request 2 (id 'c'): finish_reason 'length', 0 tokens received" in msg
    assert "request 3 (id 'd'): finish_reason 'abort', 1 tokens received" in msg
    assert [f.request.split()[1] for f in e.value.failures] == ["1", "2", "3"]
    # Served outputs pass, and an empty one passes where no tokens were asked.
    outputs.check_request_outputs([served("a", 2)], [SamplingParams(max_tokens=2)], "ok")
    outputs.check_request_outputs([_output("z", [], "length")], 0, "nothing asked")
    with pytest.raises(FailedRequestError, match="returned 1 outputs for 2 prompts"):
        outputs.check_request_outputs([served("a", 1)], 1, "short", expected=2)


@pytest.mark.parametrize("value", [0, 0.0, -1e-3, -12145.9, float("nan"), float("inf"), None])
def test_positive_refuses_zero_negative_and_missing(value):
    with pytest.raises(InvalidMeasurementError, match="decode tok/s is"):
        outputs.positive(value, "decode tok/s")
    assert outputs.positive(1e-9, "t") == 1e-9


def test_job_process_failure_reaches_the_parent_with_its_reason():
    """A job process (bench runner, bench_serving/bench_tier --job) that dies of a failed
    request: its parent raises the same error with the child's message, not a bare rc."""
    child = (
        "import sys\n"
        "from ascend_mepic.eval.outputs import FailedRequestError, failures_reported\n"
        "with failures_reported(sys.stdout):\n"
        "    raise FailedRequestError('policy mepic: 1 of 1 requests failed: request 0: "
        "finish_reason \\'error\\'')\n"
    )
    with pytest.raises(FailedRequestError) as e:
        runner.run_job_process([sys.executable, "-c", child], None, 60, "job mepic")
    assert str(e.value).startswith("job mepic: policy mepic: 1 of 1 requests failed")
    assert "finish_reason 'error'" in str(e.value)


# -- bench_serving.py --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bench_serving() -> ModuleType:
    return _script("benchmarks/bench_serving.py")


def _serving_job(mepic: bool) -> dict:
    return {
        "config": "mepic" if mepic else "prefix",
        "mepic": mepic,
        "chunks": 8,
        "decode_tokens": 4,
        "decode_batch": 2,
        "decode_rounds": 1,
    }


def _requests(n: int) -> list[list[Segment]]:
    return [
        [Segment.prompt([1, 2, 3]), Segment.chunk([10 + i] * 20), Segment.prompt([4, 5])]
        for i in range(n)
    ]


@pytest.mark.parametrize("mepic", [True, False])
def test_bench_serving_refused_requests_end_the_job(bench_serving, mepic):
    """The issue's run: the engine refused every request. Before, TTFT came out as 1.3 ms and
    decode as -12,146 tok/s; now the first refused call ends the job with the reason."""
    generate = planted_engine(lambda sp: True)
    with pytest.raises(FailedRequestError) as e:
        bench_serving.measure(generate, _requests(2), _requests(2), _serving_job(mepic))
    config = "mepic" if mepic else "prefix"
    assert str(e.value).startswith(f"{config}, 8 paragraphs: warm-up request 0: 1 of 1 requests")
    assert "finish_reason 'error', 0 tokens received of max_tokens=1" in str(e.value)


def test_bench_serving_empty_decode_output_ends_the_job(bench_serving):
    """TTFT served, decode outputs empty: refused before a rate is computed."""
    generate = planted_engine(lambda sp: sp.max_tokens > 1, lambda i: _output(i, [], "length"))
    with pytest.raises(FailedRequestError, match=r"mepic, 8 paragraphs: decode warm-up: 2 of 2"):
        bench_serving.measure(generate, _requests(2), _requests(2), _serving_job(True))


def test_bench_serving_success_and_table_guards(bench_serving):
    r = bench_serving.measure(
        planted_engine(lambda sp: False), _requests(2), _requests(2), _serving_job(True)
    )
    assert r["ttft_mean_s"] > 0 and r["decode_tok_s"] > 0
    row = bench_serving.table_row(8, 0, "mepic", r, r)
    assert row.startswith("| 8 | 1 | mepic |") and row.endswith("| 1.00x |")
    # The numbers: a decode rate below zero (and a TTFT of 0) are refused, not printed.
    bad = {**r, "decode_tok_s": -12145.9}
    with pytest.raises(InvalidMeasurementError, match="8 paragraphs, repeat 1, mepic: decode"):
        bench_serving.table_row(8, 0, "mepic", bad, r)
    with pytest.raises(InvalidMeasurementError, match="TTFT mean"):
        bench_serving.table_row(8, 0, "prefix", r, {**r, "ttft_mean_s": 0.0})


# -- bench_tier.py -----------------------------------------------------------------------------


def test_bench_tier_refused_request_is_not_timed():
    bench_tier = _script("benchmarks/bench_tier.py")
    segs = _requests(1)[0]
    with pytest.raises(FailedRequestError, match=r"cpu/auto, question 0, tier: 1 of 1 .*'error'"):
        bench_tier.ttft(planted_engine(lambda sp: True), segs, "cpu/auto, question 0, tier")
    assert bench_tier.ttft(planted_engine(lambda sp: False), segs, "ok") > 0
    result = {"ttft_s": {"absent": 0.2, "device": 0.1, "tier": 0.0}, "metrics": {}}
    with pytest.raises(InvalidMeasurementError, match="disk/never: mean TTFT, chunks tier"):
        bench_tier.table_row("disk/never", result)


# -- ascend-mepic bench compare / qps / chunks / fidelity (the bench runner) -----------------


def _raw(policy: str, step_outputs: list[RequestOutput], max_tokens: int = 8) -> dict:
    """A runner result whose per-request records the runner's own code made from
    ``step_outputs`` (request id = index)."""
    recs = [
        {
            "index": i,
            "arrival_s": 0.1 * i,
            "first_token_s": None,
            "finish_s": None,
            "prompt_tokens": 3,
            "answers": ["Paris"],
        }
        for i in range(len(step_outputs))
    ]
    assert runner.record_outputs(recs, step_outputs, 0.5) == len(step_outputs)
    return {
        "policy": policy,
        "workload": "squad-chat-4p",
        "qps": 4.0,
        "block_size": 16,
        "max_tokens": max_tokens,
        "num_chunks": 4,
        "pool_blocks": 100,
        "block_bytes": 10,
        "kv_timeline": [[0.5, 10]],
        "per_request": recs,
        "manager_metrics": {},
        "wall_s": 0.6,
    }


def test_runner_refuses_a_run_with_a_refused_request():
    raw = _raw("mepic", [served("0", 8), refused("1")])
    job = {"policy": "mepic", "chunks": 4, "qps": 4.0, "max_tokens": 8}
    with pytest.raises(FailedRequestError) as e:
        runner.check_run(raw["per_request"], job)
    msg = str(e.value)
    assert msg.startswith("policy mepic (4 chunks, QPS 4): 1 of 2 requests failed: ")
    assert "request 1: finish_reason 'error', 0 tokens received of max_tokens=8" in msg
    assert "--max-batched-tokens" in msg
    runner.check_run(_raw("mepic", [served("0", 8)])["per_request"], job)


def test_summaries_refuse_failed_requests_and_zero_durations():
    full = _raw("full", [served("0", 8), served("1", 8)])
    assert stats.summarize(full, full)["throughput_tok_s"] > 0
    empty = _raw("mepic", [served("0", 8), _output("1", [], "length")])
    with pytest.raises(FailedRequestError, match="policy mepic: 1 of 2 .*'length', 0 tokens"):
        stats.summarize(empty, full)
    with pytest.raises(FailedRequestError, match="policy full: 1 of 2"):
        stats.summarize(full, empty | {"policy": "full"})
    # A request that finished at its arrival: a latency of 0 is refused, not averaged.
    instant = _raw("full", [served("0", 8), served("1", 8)])
    instant["per_request"][1]["arrival_s"] = 0.5
    with pytest.raises(InvalidMeasurementError, match="request 1 latency"):
        stats.summarize(instant)
    # bench fidelity's rows compare nothing against a refused request.
    with pytest.raises(FailedRequestError, match="policy mepic: 1 of 2"):
        fidelity.policy_row("mepic", _raw("mepic", [served("0", 8), refused("1")]), full)


def test_bench_compare_exits_non_zero_with_the_reason(tmp_path, monkeypatch, capsys):
    """``ascend-mepic bench compare`` (what ``make demo`` runs) with MEPIC's requests refused:
    exit status 1, the reason on stderr, no table on stdout."""
    from ascend_mepic.entrypoints.cli import main

    raws = {
        "full": _raw("full", [served("0", 8), served("1", 8)]),
        "mepic": _raw("mepic", [refused("0"), refused("1")]),
    }
    monkeypatch.setattr(runner, "run_in_subprocess", lambda job: raws[job["policy"]])
    out = tmp_path / "out"
    argv = ["bench", "compare", "--model", str(tmp_path), "--policies", "full", "mepic"]
    assert main([*argv, "--no-progress", "--out", str(out)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "ascend-mepic: error: policy mepic: 2 of 2 requests failed: request 0: " in captured.err
    assert "finish_reason 'error', 0 tokens received of max_tokens=8" in captured.err
    assert not (out / "summary.md").exists()


def test_bench_fidelity_exits_non_zero_with_the_reason(monkeypatch, capsys):
    from ascend_mepic.entrypoints.cli import main

    def run(job: dict) -> dict:
        n = job["requests"]
        if job["policy"] == "full":
            return _raw("full", [served(str(i), 16) for i in range(n)], 16)
        return _raw(job["policy"], [refused(str(i)) for i in range(n)], 16)

    monkeypatch.setattr(runner, "run_in_subprocess", run)
    argv = ["bench", "fidelity", "--model", "tiny", "--questions", "2", "--policies", "mepic"]
    assert main([*argv, "--no-progress"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "ascend-mepic: error: policy mepic: 2 of 2 requests failed" in captured.err


# -- ascend-mepic bench kernels and the microbenchmarks: times only ---------------------------


def test_bench_kernels_refuses_a_zero_time(monkeypatch, capsys):
    from ascend_mepic.entrypoints.cli import main

    monkeypatch.setattr(kernels, "_time", lambda fns, repeats: dict.fromkeys(fns, 0.0))
    argv = ["bench", "kernels", "--context", "64", "--batch", "1", "--repeats", "1"]
    assert main([*argv, "--dtypes", "float32", "--no-reference"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "decode/float32: vLLM kernel call (s) is 0.0" in captured.err


def test_bench_sched_cost_refuses_a_zero_time():
    bench = _script("benchmarks/bench_sched_cost.py")
    best = {
        "prefix": {"admit_ms": 10.0, "decode_step_ms": 0.5},
        "mepic": {"admit_ms": 12.0, "decode_step_ms": 0.6},
    }
    assert "| ratio mepic/stock | 1.20x | 1.20x |" in bench.table(best)
    best["prefix"]["decode_step_ms"] = 0.0
    with pytest.raises(InvalidMeasurementError, match="prefix manager: decode_step_ms"):
        bench.table(best)


def test_bench_step_metadata_refuses_a_non_positive_plan_time(monkeypatch):
    bench = _script("benchmarks/bench_step_metadata.py")
    clock = iter([0.0, 1.0, 3.0])  # first call 1 s, the later one 2 s: a plan cost of -1 s
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    with pytest.raises(InvalidMeasurementError, match=r"per-step plan, 2 sequences .* is -1.0"):
        bench.reference_plan_seconds(2, context=64, repeats=1)


def test_bench_cpu_attention_refuses_a_zero_time():
    bench = _script("benchmarks/ops/bench_cpu_attention.py")
    case = bench.Case(bench.SHAPES[0], "decode", 512, "fp32", 32)
    split = {"gather": 0.1, "rope_k": 0.2, "rope_q": 0.01, "sdpa": 0.3}
    bench.checked(bench.Row(case, 1e-6, 1.0, 0.5, split))
    with pytest.raises(InvalidMeasurementError, match="smollm2-135m decode ctx=512 .*ours"):
        bench.print_tables([bench.Row(case, 1e-6, 0.0, 0.5, split)])
    with pytest.raises(InvalidMeasurementError, match="rope_q step"):
        bench.print_tables([bench.Row(case, None, 1.0, None, {**split, "rope_q": -0.01})])


def test_bench_triton_gpu_refuses_a_zero_time():
    """The GPU benchmark's reporting on CPU tensors, with a timer that measured nothing."""
    bench = _script("benchmarks/ops/bench_triton_gpu.py")

    def out() -> torch.Tensor:
        return torch.zeros(2, 2)

    case = bench.Case("decode", 2048, 16, 16, out, out, out, "flash", 1 << 20, 1e9, ())
    with pytest.raises(InvalidMeasurementError, match="decode context 2048 B=16: fused RoPE"):
        bench.run_case(case, lambda fn: 0.0, 3350.0)
    assert bench.run_case(case, lambda fn: 0.5, 3350.0)["fused/SDPA"] == "1.00"


# -- bench_accuracy.py (the dense reference, no engine) ----------------------------------------


def test_bench_accuracy_refuses_an_empty_answer(monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ascend_mepic.eval.policy_reference import PolicyReference
    from ascend_mepic.eval.prepare import resolve_model

    bench = _script("benchmarks/bench_accuracy.py")
    path = str(resolve_model("tiny"))
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref = PolicyReference(model, 4, dummy_token_id=0, check_layer=0)
    segs = [Segment.prompt([5, 6, 7]), Segment.chunk(list(range(20, 31))), Segment.prompt([8])]
    # The reference's greedy answers with the mepic one planted empty.
    monkeypatch.setattr(ref, "greedy_batch", lambda states, n, eos: [[9, 10], []])
    with pytest.raises(FailedRequestError) as e:
        bench.evaluate_question(ref, tok, segs, ("Paris",), ["full", "mepic"], 4, [2], "q7")
    assert str(e.value) == (
        "bench_accuracy, question q7: 1 of 2 requests failed: policy mepic: finish_reason None, "
        "0 tokens received of max_tokens=4"
    )
