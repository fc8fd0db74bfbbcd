"""One engine, one policy, one workload, in this process: ``python -m ascend_mepic.eval.bench.runner
JOB_JSON`` prints ``RESULT{...}``.

Requests arrive by a seeded Poisson process; this loop adds each request once its arrival time
has passed (wall clock) and calls ``LLMEngine.step()`` itself, so requests really overlap. After
every step it samples the KV blocks in use, and it records every request's arrival, first-token
and finish times, its text, and its first token's top logprobs.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from typing import Any

from ascend_mepic.eval.outputs import (
    check_records,
    check_request_outputs,
    failures_reported,
    raise_from_job,
)

STOCK_POLICIES = ("prefix", "full-stock")


def bench_job(
    args: Any, model: str, policy: str, qps: float, chunks: int, **extra: Any
) -> dict[str, Any]:
    """A runner job from the benchmark options every real-engine command shares."""
    return {
        "policy": policy,
        "model": model,
        "requests": args.requests,
        "chunks": chunks,
        "seed": args.seed,
        "articles": args.articles,
        "block_size": args.block_size,
        "max_tokens": args.max_tokens,
        "qps": qps,
        "kv_gib": args.kv_gib,
        "max_num_batched_tokens": args.max_batched_tokens,
        **extra,
    }


def build_requests(tokenizer: Any, job: dict) -> list[tuple[Any, list]]:
    """(SquadQuestion, segments) per request: the chat-template SQuAD workload."""
    from ascend_mepic.eval.trace import squad_requests

    pairs = list(
        squad_requests(job["requests"], job["chunks"], job["seed"], job.get("articles") or None)
    )
    try:
        from ascend_mepic.eval.squad_prompts import chat_segments

        return [(q, chat_segments(tokenizer, q.question, paras)) for q, paras in pairs]
    except ImportError:  # older tree: plain marker segments
        from ascend_mepic.core.markers import TextSegment, tokenize_segments
        from ascend_mepic.core.segments import SegmentKind

        out = []
        for q, paras in pairs:
            pieces = [TextSegment(SegmentKind.PROMPT, "Answer from the documents.\n")]
            pieces += [TextSegment(SegmentKind.CHUNK, p + "\n\n") for p in paras]
            pieces.append(TextSegment(SegmentKind.PROMPT, f"Question: {q.question}\nAnswer:"))
            out.append((q, tokenize_segments(tokenizer, pieces)))
        return out


def stock_block_size(block_size: int) -> int:
    """Block size stock vLLM runs at: on CPU its CPU_ATTN kernel takes only multiples of its
    base (32), so a smaller request (the paper's 16) is rounded up for the ``prefix`` baseline,
    and its row says so; compare it with the others by KV % or bytes, not by block counts."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return block_size
    from ascend_mepic.vllm_integration.cpu_attention import kernel_block_base

    base = kernel_block_base()
    return -(-block_size // base) * base


def _model_len(requests: list[tuple[Any, list]], job: dict) -> int:
    """4096, or more when the workload's longest prompt needs it (16 paragraphs per request),
    within the model's own context (a tiny test model has 2048)."""
    from transformers import AutoConfig

    longest = max(sum(len(s.token_ids) for s in segs) for _, segs in requests)
    need = longest + job["max_tokens"] + (job["chunks"] + 1) * job["block_size"]  # chunk padding
    limit = getattr(AutoConfig.from_pretrained(job["model"]), "max_position_embeddings", None)
    if limit and need > limit:
        raise ValueError(
            f"the workload needs {need} tokens per request (longest prompt {longest}, "
            f"{job['max_tokens']} output, chunk padding) but {job['model']} has a context of "
            f"{limit}: use fewer --chunks or a longer-context model"
        )
    want = max(4096, -(-need // 1024) * 1024)
    return min(want, limit) if limit else want


def _block_bytes(llm: Any, block_size: int) -> int:
    try:
        mc = llm.llm_engine.model_config
        pc = llm.llm_engine.vllm_config.parallel_config
        layers = mc.get_num_layers(pc)
        heads = mc.get_num_kv_heads(pc)
        head = mc.get_head_size()
        return 2 * layers * heads * head * block_size * 4  # K and V, float32
    except Exception:  # noqa: BLE001 - bytes are informative only
        return 0


def record_outputs(recs: list[dict], outs: list[Any], t: float) -> int:
    """Record one engine step's outputs (vLLM ``RequestOutput``, request id = index in ``recs``)
    at ``t`` seconds; returns how many requests finished in it."""
    finished = 0
    for o in outs:
        r = recs[int(o.request_id)]
        c = o.outputs[0]
        if r["first_token_s"] is None and len(c.token_ids) > 0:
            r["first_token_s"] = t
        if o.finished:
            r["finish_s"] = t
            r["text"] = c.text
            r["output_tokens"] = len(c.token_ids)
            r["first_token"] = c.token_ids[0] if c.token_ids else None
            lp = c.logprobs[0] if c.logprobs else {}
            r["top_logprobs"] = {str(k): v.logprob for k, v in lp.items()}
            r["num_cached_tokens"] = o.num_cached_tokens
            r["finish_reason"] = c.finish_reason
            finished += 1
    return finished


def check_run(recs: list[dict], job: dict) -> None:
    """Refuse a run in which any request was not served (see ``ascend_mepic.eval.outputs``)."""
    check_records(
        recs,
        job["max_tokens"],
        f"policy {job['policy']} ({job['chunks']} chunks, QPS {job['qps']:g})",
        hint="the engine's log says why, e.g. a step budget too small: --max-batched-tokens; "
        "not a valid run",
    )


def run(job: dict) -> dict:
    """One benchmark job on an engine of its own, shut down before returning."""
    from transformers import AutoTokenizer
    from vllm import LLM

    from ascend_mepic.offline import mepic_llm_kwargs

    policy = job["policy"]
    tok = AutoTokenizer.from_pretrained(job["model"])
    requests = build_requests(tok, job)
    stock = policy == "prefix"
    block_size = stock_block_size(job["block_size"]) if stock else job["block_size"]
    kwargs = {"enable_prefix_caching": True} if stock else mepic_llm_kwargs(policy=policy)
    if job.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = job["max_num_batched_tokens"]
    if job.get("record_steps"):  # calibration (``bench profile``): each step's work is recorded
        from ascend_mepic.eval.sim import recording

        kwargs["scheduler_cls"] = (
            recording.RECORDING_STOCK_SCHEDULER_CLS if stock else recording.RECORDING_SCHEDULER_CLS
        )
    llm = LLM(
        model=job["model"],
        dtype="float32",
        enforce_eager=True,
        block_size=block_size,
        max_model_len=job.get("max_model_len") or _model_len(requests, job),
        seed=0,
        **kwargs,
    )
    try:
        return _measure(job, llm, tok, requests, block_size)
    finally:  # a process may run several jobs (the test suite's engine hosts)
        llm.llm_engine.engine_core.shutdown()


def _measure(job: dict, llm: Any, tok: Any, requests: list, block_size: int) -> dict:
    """Warm the engine up, replay the job's Poisson arrivals, and record each request's times,
    outputs and the pool's use after every step."""
    from vllm import SamplingParams

    from ascend_mepic.core.segments import Segment, SegmentKind
    from ascend_mepic.eval.bench.stats import poisson_arrivals
    from ascend_mepic.eval.sim.recording import used_blocks
    from ascend_mepic.offline import segment_request

    policy = job["policy"]
    stock = policy == "prefix"
    engine = llm.llm_engine
    manager = engine.engine_core.engine_core.scheduler.kv_cache_manager
    pool_blocks = manager.block_pool.num_gpu_blocks - 1  # block 0 is the null block
    params = SamplingParams(
        temperature=0.0,
        max_tokens=job["max_tokens"],
        logprobs=job.get("logprobs", 20),
        ignore_eos=bool(job.get("ignore_eos")),  # fixed output lengths (the simulator's checks)
    )

    def prompt_of(segs: list) -> tuple[dict, Any]:
        if stock:
            return {"prompt_token_ids": [t for s in segs for t in s.token_ids]}, params
        return segment_request(segs, params)

    # Warm-up on an unrelated prompt-only request (shares no chunk with the workload).
    # ``warmup_tokens`` makes it that long: the first full-budget step on a CPU pays a one-time
    # cost (about 1 s on 2 cores) that would otherwise land on the first request's TTFT and
    # queue behind it every later one (the simulator's validation sets it; steps are priced
    # warm).
    hello = tok.encode("Hello, how are you today?")
    length = max(len(hello), int(job.get("warmup_tokens") or 0))
    warm = [Segment(SegmentKind.PROMPT, tuple((hello * (length // len(hello) + 1))[:length]))]
    p, sp = prompt_of(warm)
    warm_params = sp.clone()
    warm_params.max_tokens = 2
    warm_out = llm.generate([p], [warm_params], use_tqdm=False)
    check_request_outputs(warm_out, [warm_params], f"{policy}: warm-up request", expected=1)

    arrivals = poisson_arrivals(len(requests), job["qps"], job["seed"])
    recs: list[dict] = [
        {
            "index": i,
            "arrival_s": a,
            "first_token_s": None,
            "finish_s": None,
            "prompt_tokens": sum(len(s.token_ids) for s in segs),
            "answers": list(q.answers),
        }
        for i, ((q, segs), a) in enumerate(zip(requests, arrivals, strict=True))
    ]
    timeline: list[tuple[float, int]] = []  # blocks in use after each step
    scheduled: list[tuple[float, int]] = []  # record_steps: after each schedule() (the peak)
    bar = None
    if job.get("progress", True):
        from tqdm import tqdm

        bar = tqdm(total=len(recs), desc=f"{policy} qps={job['qps']}", file=sys.stderr)
    scheduler = engine.engine_core.engine_core.scheduler
    steps: list[dict] = []  # record_steps: each step's work and wall time
    nxt, done = 0, 0
    t0 = time.perf_counter()
    while done < len(recs):
        now = time.perf_counter() - t0
        while nxt < len(recs) and recs[nxt]["arrival_s"] <= now:
            p, sp = prompt_of(requests[nxt][1])
            engine.add_request(str(nxt), p, sp)
            nxt += 1
        if not engine.has_unfinished_requests():
            if nxt < len(recs):
                time.sleep(max(0.0, recs[nxt]["arrival_s"] - (time.perf_counter() - t0)))
            continue
        started = time.perf_counter() - t0
        seen = len(getattr(scheduler, "recorded_work", ()))
        seen_peak = len(getattr(scheduler, "scheduled_blocks", ()))
        outs = engine.step()
        t = time.perf_counter() - t0
        if job.get("record_steps") and len(scheduler.recorded_work) > seen:
            steps.append({"seconds": t - started, **asdict(scheduler.recorded_work[-1])})
        timeline.append((round(t, 4), used_blocks(manager)))
        if len(getattr(scheduler, "scheduled_blocks", ())) > seen_peak:
            scheduled.append((round(t, 4), scheduler.scheduled_blocks[-1]))
        finished = record_outputs(recs, outs, t)
        done += finished
        if bar is not None:
            bar.update(finished)
    if bar is not None:
        bar.close()
    check_run(recs, job)
    metrics = manager.metrics() if hasattr(manager, "metrics") else {}
    return {
        "policy": policy,
        "workload": f"squad-chat-{job['chunks']}p",
        "qps": job["qps"],
        "block_size": block_size,
        "max_tokens": job["max_tokens"],
        "max_num_batched_tokens": engine.vllm_config.scheduler_config.max_num_batched_tokens,
        "num_chunks": job["chunks"],
        "pool_blocks": pool_blocks,
        "block_bytes": _block_bytes(llm, block_size),
        "kv_timeline": timeline,
        "kv_scheduled": scheduled,
        "per_request": recs,
        "manager_metrics": metrics,
        "wall_s": time.perf_counter() - t0,
        "step_records": steps,
    }


def run_in_subprocess(job: dict, timeout: float = 3600) -> dict:
    """Run ``job`` in a fresh Python process (vLLM's global state stays per policy)."""
    env = dict(
        os.environ,
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE=str(job.get("kv_gib", 1)),
        HF_HUB_OFFLINE="1",
    )
    return run_job_process(
        [sys.executable, "-m", "ascend_mepic.eval.bench.runner", json.dumps(job)],
        env,
        timeout,
        f"bench runner for {job['policy']}",
        capture_stderr=not job.get("progress", True),
    )


def run_job_process(
    argv: list[str], env: dict, timeout: float, label: str, capture_stderr: bool = True
) -> dict:
    """Run a benchmark job's process and return the ``RESULT{...}`` line it prints; a job that
    reported a failed request or measurement (``ascend_mepic.eval.outputs.failures_reported``)
    raises that error here, any other failure raises with the tail of its stderr (when
    captured)."""
    import subprocess

    proc = subprocess.run(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE if capture_stderr else None,
        text=True,
        env=env,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise_from_job(proc.stdout, label)  # a failed request or measurement: its own message
        tail = (proc.stderr or "")[-3000:]
        raise RuntimeError(f"{label} failed (rc {proc.returncode})\n{tail}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


def main() -> None:
    from ascend_mepic.entrypoints.streams import isolate_stdout

    out = isolate_stdout()  # vLLM's logs to stderr: stdout holds only the RESULT line
    job = json.loads(sys.argv[1])
    with failures_reported(out):
        result = run(job)
    out.write("RESULT" + json.dumps(result) + "\n")
    out.flush()


if __name__ == "__main__":
    main()
