"""Run the real vLLM engine on JSON jobs and print JSON results.

``engine_runner.py JOB`` runs one job and exits. ``engine_runner.py --serve`` is an engine host
(``tests/engine_host.py``): it reads one job per line from stdin and answers each with one
``RESULT`` line, so a test process pays torch's and vLLM's imports (most of an engine start on
CPU) once, not once per job. Every job still gets a fresh ``LLM``, shut down after it, so a job
never sees another job's cache; stock and MEPIC jobs use different hosts, so a stock engine never
runs where MEPIC's backend and ops were registered.

Job: {"model", "mepic": bool, "policy": str|null, "dtype" (float32), "block_size",
"max_model_len", "batches":
[[{"segments": [[kind, [ids...]], ...], "salt": str|null}, ...], ...], "max_tokens",
"logprobs", "options" (MEPIC options), "reset_between_batches", "reset_before" (batch indices),
"tensor_parallel_size", "kv_cache_bytes", "scheduler_cls" (a stock job's ``--scheduler-cls``),
"refuse": [request, or {"raw": {"prompt_token_ids", "extra_args"}}], "chunk_digests": bool,
"speculative_config" (vLLM's), "log_stats": bool (adds vLLM's ``spec_decode`` counters),
"kv_events" (``KVEventsConfig`` fields: vLLM's KV events publisher)}.
With ``chunk_digests`` the result has, after each batch, every ready chunk's canonical blocks and
a SHA-256 of its canonical KV bytes in every layer (``chunk_digests``: one
``{chunk id: [block ids, digest]}`` per batch; in-process engine only).
Each batch is one ``generate`` call, run in order on the same engine. The ``refuse`` requests go
first, one ``generate`` call each, each expected to raise ``VLLMValidationError`` (its message,
or None where it did not raise, is reported in ``refused``).
"""

import gc
import json
import os
import sys
import traceback


def run_job(job: dict) -> dict:
    """One job on a fresh engine, shut down before returning (also when the job fails). A job
    ``{"bench": ..., "mepic": ...}`` is a benchmark job, run by ``eval.bench.runner.run``."""
    if "bench" in job:
        from ascend_mepic.eval.bench.runner import run

        return run(job["bench"])
    from vllm import LLM

    llm = None
    try:
        llm = build_llm(job, LLM)
        return features_job(job, llm) if job.get("features") else serve_job(job, llm)
    finally:
        if llm is not None:
            close(llm)


def close(llm) -> None:
    """Shut an in-process engine down. The core's shutdown tears the distributed state down and
    collects garbage (``cleanup_dist_env_and_memory``); the rest of the engine goes with its last
    reference, or at the next engine's start-up, which collects before it freezes its heap. No
    collection of its own: each full one walks torch's and vLLM's import heap, which was most of
    a job's time on CPU."""
    llm.llm_engine.engine_core.shutdown()


def build_llm(job: dict, LLM):
    from ascend_mepic.offline import mepic_llm_kwargs

    kwargs = {"scheduler_cls": job["scheduler_cls"]} if job.get("scheduler_cls") else {}
    if job["mepic"]:
        options = {"policy": job["policy"]} if job.get("policy") else {}
        options.update(job.get("options", {}))
        kwargs.update(mepic_llm_kwargs(**options))
    if job.get("speculative_config"):
        kwargs["speculative_config"] = job["speculative_config"]
    if job.get("log_stats"):
        kwargs["disable_log_stats"] = False
    for key in ("enable_chunked_prefill", "scheduling_policy", "max_num_seqs"):
        if key in job:
            kwargs[key] = job[key]
    if job.get("kv_cache_bytes"):  # else VLLM_CPU_KVCACHE_SPACE's 1 GiB, zeroed at each start
        kwargs["kv_cache_memory_bytes"] = job["kv_cache_bytes"]
    if job.get("kv_events"):  # KVEventsConfig's fields: vLLM's KV events publisher
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(**job["kv_events"])
    # vLLM's CPU platform replaces kv_cache_memory_bytes with VLLM_CPU_KVCACHE_SPACE where that
    # is set (the hosts set it): unset while the engine is built, the job's size holds (zeroing
    # the hosts' 1 GiB took 0.9 s of each engine's start).
    space = os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None) if job.get("kv_cache_bytes") else None
    try:
        return _llm(job, LLM, kwargs)
    finally:
        if space is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = space


def _llm(job: dict, LLM, kwargs: dict):
    return LLM(
        model=job["model"],
        dtype=job.get("dtype", "float32"),
        max_model_len=job.get("max_model_len", 1024),
        block_size=job.get("block_size", 32),
        seed=0,
        tensor_parallel_size=job.get("tensor_parallel_size", 1),
        **{"enforce_eager": True, **kwargs},  # eager for stock too (MEPIC's NPU path is eager)
    )


def serve_job(job: dict, llm) -> dict:
    from vllm import SamplingParams

    from ascend_mepic.core.segments import Segment, SegmentKind
    from ascend_mepic.offline import generate_segments

    params = SamplingParams(
        temperature=0.0, max_tokens=job.get("max_tokens", 8), logprobs=job.get("logprobs", 5)
    )
    refused = []
    for r in job.get("refuse", ()):
        from vllm.exceptions import VLLMValidationError

        try:
            if "raw" in r:
                raw = SamplingParams(max_tokens=4, extra_args=r["raw"]["extra_args"])
                prompt = {"prompt_token_ids": r["raw"]["prompt_token_ids"]}
                llm.generate([prompt], raw, use_tqdm=False)
            else:
                segs = [Segment(SegmentKind(k), tuple(ids)) for k, ids in r["segments"]]
                generate_segments(llm, [segs], params)
            refused.append(None)
        except VLLMValidationError as e:
            refused.append(str(e))
    results = []
    digests = []
    for index, batch in enumerate(job["batches"]):
        if (index and job.get("reset_between_batches")) or index in job.get("reset_before", ()):
            llm.reset_prefix_cache()  # evicts every idle chunk from the KV pool
        reqs = [[Segment(SegmentKind(k), tuple(ids)) for k, ids in r["segments"]] for r in batch]
        salts = [r.get("salt") for r in batch]
        if job["mepic"]:
            outs = generate_segments(llm, reqs, params, salts)
        else:
            prompts = [{"prompt_token_ids": [t for s in r for t in s.token_ids]} for r in reqs]
            outs = llm.generate(prompts, params, use_tqdm=False)
        results.append(
            [
                {
                    "tokens": list(o.outputs[0].token_ids),
                    "finish": o.outputs[0].finish_reason,
                    "logprobs": [
                        {str(t): v.logprob for t, v in d.items()} for d in o.outputs[0].logprobs
                    ],
                }
                for o in outs
            ]
        )
        if job.get("chunk_digests"):
            digests.append(chunk_digests(llm))
    from vllm.platforms import current_platform

    info = {"platform": current_platform.device_type, "refused": refused}
    if digests:
        info["chunk_digests"] = digests
    if job.get("log_stats"):  # speculative decoding's counters (vLLM's own metrics)
        info["spec_decode"] = {
            m.name.removeprefix("vllm:spec_decode_"): m.value
            for m in llm.get_metrics()
            if m.name.startswith("vllm:spec_decode_num") and hasattr(m, "value")
        }
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)  # in-process engine only
    if job["mepic"] and core is not None:
        manager = core.scheduler.kv_cache_manager
        if hasattr(manager, "metrics"):
            info.update(metrics=manager.metrics(), chunk_blocks=list(manager.recent_chunk_blocks))
        info["block_hasher"] = getattr(core.request_block_hasher, "__qualname__", None)
    return {"batches": results, **info}


def features_job(job: dict, llm) -> dict:
    """vLLM serving features on a MEPIC engine (``tests/engine/test_features.py``): the job's
    RAG request (``batches[0][0]``) as a MEPIC request with n = 1 (the reference), with n = 2,
    under a structured-output choice, twice at two priorities, and as a plain prompt with prompt
    logprobs."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from ascend_mepic.core.segments import Segment, SegmentKind
    from ascend_mepic.offline import segment_request

    segs = [Segment(SegmentKind(k), tuple(ids)) for k, ids in job["batches"][0][0]["segments"]]
    greedy = SamplingParams(temperature=0.0, max_tokens=job.get("max_tokens", 6))

    def run(params, copies=1, priority=None):
        pairs = [segment_request(segs, params) for _ in range(copies)]
        outs = llm.generate([p for p, _ in pairs], [sp for _, sp in pairs], use_tqdm=False,
                            priority=priority)  # fmt: skip
        return [[list(c.token_ids) for c in o.outputs] for o in outs], outs

    result = {"reference": run(greedy)[0][0][0]}
    # n > 1 must sample (vLLM refuses greedy); top-k 1 samples the greedy token
    result["n2"] = run(SamplingParams(temperature=1.0, top_k=1, n=2, max_tokens=greedy.max_tokens))[
        0
    ][0]
    choice = greedy.clone()
    choice.max_tokens = 16
    choice.structured_outputs = StructuredOutputsParams(choice=job["choices"])
    result["choice"] = run(choice)[1][0].outputs[0].text
    result["priority"] = [o[0] for o in run(greedy, copies=2, priority=[5, 0])[0]]
    logprobs = greedy.clone()
    logprobs.prompt_logprobs = 1
    plain = {"prompt_token_ids": [t for s in segs for t in s.token_ids]}
    out = llm.generate([plain], logprobs, use_tqdm=False)[0]
    result["plain"] = list(out.outputs[0].token_ids)
    result["prompt_logprobs"] = len(out.prompt_logprobs or ())
    result["metrics"] = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.metrics()
    return result


def _digest_worker_chunks(worker, entries: list, block_size: int) -> dict:
    """On the worker: SHA-256 of each chunk's canonical tokens' KV, every layer."""
    import hashlib

    from ascend_mepic.tier import transfer

    caches = worker.model_runner.mepic_kv_buffers()
    return {
        cid: hashlib.sha256(
            transfer.save_tokens(caches, blocks, offset, n, block_size).numpy().tobytes()
        ).hexdigest()
        for cid, blocks, offset, n in entries
    }


def chunk_digests(llm) -> dict:
    """Every ready chunk's canonical block ids and KV digest (read through the worker)."""
    from ascend_mepic.core.chunk_cache import ChunkState

    manager = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager
    entries = [
        (e.chunk_id, e.block_ids, e.offset, e.num_canonical)
        for e in manager.chunk_cache.entries.values()
        if e.state is ChunkState.READY
    ]
    found = llm.collective_rpc(_digest_worker_chunks, args=(entries, manager.mepic_block_size))[0]
    return {cid: [blocks, found[cid]] for cid, blocks, _, _ in entries}


def serve() -> None:
    """Answer jobs from stdin until it closes; a failed job answers its traceback and ends the
    host (its engine may have left the process in any state).

    Before each job the host's heap (the imports; the last engine was collected at its shutdown)
    is frozen out of the garbage collector's sight: the engine's start-up collects three times
    (vLLM's ``freeze_gc_heap``), and each walked torch's and vLLM's import heap (0.2 s each on 2
    cores). The engine's shutdown unfreezes and collects as before."""
    for line in sys.stdin:
        gc.freeze()
        try:
            answer = {"result": run_job(json.loads(line))}
        except BaseException:
            answer = {"error": traceback.format_exc()}
        print("RESULT" + json.dumps(answer), flush=True)
        if "error" in answer:
            return


def main() -> None:
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        print("RESULT" + json.dumps(run_job(json.loads(sys.argv[1]))))


if __name__ == "__main__":
    main()
