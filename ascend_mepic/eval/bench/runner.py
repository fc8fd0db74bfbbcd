"""One engine, one policy, one workload, in this process: ``python -m ascend_mepic.eval.bench.runner
JOB_JSON`` prints ``RESULT{...}``.

Requests arrive by a seeded Poisson process; this loop adds each request once its arrival time
has passed (wall clock) and calls ``LLMEngine.step()`` itself, so requests really overlap. After
every step it samples the KV blocks in use, and it records every request's arrival, first-token
and finish times, its text, and its first token's top logprobs.

It runs on vLLM's CPU platform (tested) and CUDA platform (UNTESTED ON A GPU): what differs per
platform (dtype, eager or compiled, how the KV pool is sized) is resolved once, from vLLM's
current platform, by :func:`engine_setup`; the result says what the engine resolved.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from ascend_mepic.eval.bench.variants import split_variant
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
        # Platform settings (None: the platform's default, ``engine_setup``); commands without
        # the options (``bench validate``) get the defaults.
        **{key: getattr(args, key, None) for key in SETUP_OPTIONS},
        **extra,
    }


# Job keys ``engine_setup`` reads, each also a bench option of the same name.
SETUP_OPTIONS = ("device", "dtype", "graphs", "load_format", "gpu_memory_utilization")
DEVICES = ("cpu", "cuda")
GRAPHS = ("eager", "compiled")


@dataclass(frozen=True)
class EngineSetup:
    """What one benchmark engine runs with on this platform, resolved once (``engine_setup``).

    ``device``: vLLM's platform, ``cpu`` (tested) or ``cuda`` (UNTESTED ON A GPU). ``dtype``:
    float32 on CPU, bfloat16 on CUDA unless the job says. ``enforce_eager``: always on CPU; on
    CUDA unless the job asks for ``graphs="compiled"`` (vLLM's torch.compile and CUDA graphs:
    FULL_AND_PIECEWISE for stock, PIECEWISE for MEPIC, whose hook turns full graphs off).
    ``kv_cache_bytes``: the KV pool on CUDA (``kv_cache_memory_bytes``, from the job's
    ``kv_gib``); on CPU the pool is ``VLLM_CPU_KVCACHE_SPACE``, set by ``run_in_subprocess``.
    ``load_format``: ``dummy`` for a folder made by ``prepare_dummy`` (no weights), else vLLM's
    ``auto``.
    """

    device: str
    dtype: str
    enforce_eager: bool
    load_format: str
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float | None = None

    def llm_kwargs(self) -> dict[str, Any]:
        """``LLM(...)`` arguments; on CPU with real weights exactly what the runner always
        passed (float32, eager)."""
        kwargs: dict[str, Any] = {"dtype": self.dtype, "enforce_eager": self.enforce_eager}
        if self.load_format != "auto":
            kwargs["load_format"] = self.load_format
        if self.kv_cache_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = self.kv_cache_bytes
        if self.gpu_memory_utilization is not None:
            kwargs["gpu_memory_utilization"] = self.gpu_memory_utilization
        return kwargs


def engine_setup(job: dict, platform: Any = None) -> EngineSetup:
    """The job's engine settings on vLLM's current platform (``platform`` for tests); raises
    when the job asks for another device than vLLM resolved, or for what the platform does not
    take."""
    from ascend_mepic.eval.prepare import is_dummy_model

    if platform is None:
        from vllm.platforms import current_platform as platform
    device = str(getattr(platform, "device_type", "") or "")
    wanted = job.get("device") or "auto"
    if wanted not in ("auto", *DEVICES):
        raise ValueError(f"device {wanted!r}: choose auto, {' or '.join(DEVICES)}")
    if wanted != "auto" and wanted != device:
        raise RuntimeError(
            f"the benchmark asks for device {wanted!r} but vLLM's platform here is "
            f"{device or 'none (vLLM found no platform)'}: check the vLLM build and the device "
            "(`ascend-mepic doctor`)"
        )
    if device not in DEVICES:
        raise RuntimeError(
            f"the benchmark runner runs on vLLM's CPU and CUDA platforms; this is {device!r}"
        )
    graphs = job.get("graphs") or "eager"
    if graphs not in GRAPHS:
        raise ValueError(f"graphs {graphs!r}: choose {' or '.join(GRAPHS)}")
    load_format = job.get("load_format") or ("dummy" if is_dummy_model(job["model"]) else "auto")
    if device == "cpu":
        if graphs != "eager":
            raise ValueError("graphs 'compiled' is for CUDA: the benchmark runs eager on CPU")
        if job.get("gpu_memory_utilization") is not None:
            raise ValueError("--gpu-memory-utilization is for CUDA: on CPU --kv-gib sizes the KV")
        return EngineSetup("cpu", job.get("dtype") or "float32", True, load_format)
    return EngineSetup(
        "cuda",
        job.get("dtype") or "bfloat16",
        graphs == "eager",
        load_format,
        kv_cache_bytes=int(float(job.get("kv_gib") or 1) * 2**30),
        gpu_memory_utilization=job.get("gpu_memory_utilization"),
    )


def build_requests(tokenizer: Any, job: dict) -> list[tuple[Any, list]]:
    """(SquadQuestion, segments) per request: the chat-template SQuAD workload, or the one the
    job's ``workload_file`` holds (``eval.bench.workload_file``: made elsewhere, no SQuAD
    package or chat template needed here)."""
    if job.get("workload_file"):
        from ascend_mepic.eval.bench import workload_file

        data = workload_file.load(job["workload_file"])
        workload_file.check_model(data, job["workload_file"], job["model"])
        return workload_file.requests(data)
    return squad_workload(tokenizer, job)


def warmup_requests(tokenizer: Any, job: dict, workload: list[tuple[Any, list]]) -> list:
    """``job["warmup_requests"]`` requests shaped like the workload (its chunk count, chat
    template, one article) on a SQuAD article the workload does not use, so they share no chunk
    with it; or those of the job's ``workload_file``. None unless asked for."""
    if job.get("workload_file"):
        from ascend_mepic.eval.bench import workload_file

        return workload_file.warmup(workload_file.load(job["workload_file"]))
    n = int(job.get("warmup_requests") or 0)
    if n <= 0:
        return []
    used = {q.article for q, _ in workload}
    chunks = {s.token_ids for _, segs in workload for s in segs if s.kind.value == "chunk"}
    for k in range(1, 64):
        other = {**job, "requests": n, "seed": job["seed"] + k, "articles": 1}
        reqs = squad_workload(tokenizer, other)
        shared = any(s.token_ids in chunks for _, segs in reqs for s in segs)
        if len(reqs) == n and not used & {q.article for q, _ in reqs} and not shared:
            return reqs
    raise ValueError(f"found no SQuAD article for {n} warm-up requests apart from the workload's")


def squad_workload(tokenizer: Any, job: dict) -> list[tuple[Any, list]]:
    """The chat-template SQuAD workload, built from the SQuAD package."""
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
        return 2 * layers * heads * head * block_size * mc.dtype.itemsize  # K and V
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

    setup = engine_setup(job)
    tok = AutoTokenizer.from_pretrained(job["model"])
    requests = build_requests(tok, job)
    warmup = warmup_requests(tok, job, requests)
    stock = job["policy"] == "prefix"
    block_size = stock_block_size(job["block_size"]) if stock else job["block_size"]
    max_model_len = job.get("max_model_len") or _model_len(requests, job)
    started = time.perf_counter()
    llm = LLM(**llm_arguments(job, setup, block_size, max_model_len))
    startup_s = time.perf_counter() - started
    try:
        result = _measure(job, llm, tok, requests, block_size, warmup)
        result["engine"] = {**asdict(setup), "startup_s": startup_s, **resolved(llm, setup)}
        return result
    finally:  # a process may run several jobs (the test suite's engine hosts)
        llm.llm_engine.engine_core.shutdown()


def llm_arguments(
    job: dict, setup: EngineSetup, block_size: int, max_model_len: int
) -> dict[str, Any]:
    """The job's ``LLM(...)`` arguments: stock vLLM with prefix caching (``prefix``) or MEPIC
    with the job's policy, on the platform's settings."""
    from ascend_mepic.offline import mepic_llm_kwargs

    policy, options = split_variant(job["policy"])
    stock = policy == "prefix"
    kwargs = (
        {"enable_prefix_caching": True} if stock else mepic_llm_kwargs(policy=policy, **options)
    )
    if job.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = job["max_num_batched_tokens"]
    if job.get("record_steps"):  # calibration (``bench profile``): each step's work is recorded
        from ascend_mepic.eval.sim import recording

        kwargs["scheduler_cls"] = (
            recording.RECORDING_STOCK_SCHEDULER_CLS if stock else recording.RECORDING_SCHEDULER_CLS
        )
    return {
        "model": job["model"],
        "block_size": block_size,
        "max_model_len": max_model_len,
        "seed": 0,
        **setup.llm_kwargs(),
        **kwargs,
    }


def attention_in_use(worker: Any) -> dict[str, Any]:
    """The model runner and the first attention layer's backend and implementation (run in the
    worker through ``collective_rpc``): what the engine really selected. For vLLM's flash
    attention, its version (3 is FA3, vLLM's default on SM90)."""
    runner = getattr(worker, "worker", worker).model_runner
    found: dict[str, Any] = {"model_runner": type(runner).__name__}
    for module in runner.model.modules():
        backend, impl = getattr(module, "attn_backend", None), getattr(module, "impl", None)
        if backend is not None and impl is not None:
            found["attention_backend"] = backend.get_name()
            found["attention_backend_cls"] = f"{backend.__module__}.{backend.__qualname__}"
            found["attention_impl"] = type(impl).__name__
            found["flash_attn_version"] = getattr(impl, "vllm_flash_attn_version", None)
            break
    return found


def resolved(llm: Any, setup: EngineSetup) -> dict[str, Any]:
    """What the engine resolved from the job's arguments and the platform's defaults."""
    config = llm.llm_engine.vllm_config
    out: dict[str, Any] = {
        "resolved_dtype": str(config.model_config.dtype).removeprefix("torch."),
        "resolved_enforce_eager": config.model_config.enforce_eager,
        "cudagraph_mode": getattr(config.compilation_config.cudagraph_mode, "name", None),
        "async_scheduling": config.scheduler_config.async_scheduling,
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "worker_cls": config.parallel_config.worker_cls,
        "resolved_load_format": str(config.load_config.load_format),
    }
    try:
        out.update(llm.collective_rpc(attention_in_use)[0])
    except Exception as exc:  # noqa: BLE001 - informative; the run itself is valid
        out["attention_backend"] = f"unknown ({type(exc).__name__}: {exc})"
    if setup.device == "cuda":
        import torch

        out["gpu_name"] = torch.cuda.get_device_name()
        out["gpu_capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        out["gpu_peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def _measure(
    job: dict, llm: Any, tok: Any, requests: list, block_size: int, warmup: list = ()
) -> dict:
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
    warm_started = time.perf_counter()
    warm_out = llm.generate([p], [warm_params], use_tqdm=False)
    check_request_outputs(warm_out, [warm_params], f"{policy}: warm-up request", expected=1)
    # Warm-up requests shaped like the workload, on an article it does not use: on a GPU the
    # first prefill, decode, chunk compile and chunk hit each compile kernels (MEPIC's Triton
    # kernels when first called with a shape), which would otherwise land on the first timed
    # requests' TTFT. Two waves, so the second reads chunks the first compiled.
    half = (len(warmup) + 1) // 2
    for wave in (warmup[:half], warmup[half:]):
        if wave:
            pairs = [prompt_of(segs) for _, segs in wave]
            outs = llm.generate([x for x, _ in pairs], [y for _, y in pairs], use_tqdm=False)
            check_request_outputs(
                outs, [y for _, y in pairs], f"{policy}: warm-up requests", expected=len(wave)
            )
    warmup_s = time.perf_counter() - warm_started

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
        "warmup_s": warmup_s,
        "warmup_requests": len(warmup),
        "step_records": steps,
    }


def job_env(job: dict) -> dict[str, str]:
    """The environment of a job's process: the engine core in process (the runner steps it and
    reads its scheduler), the CPU's KV pool (ignored on CUDA, where ``engine_setup`` sizes it),
    no model hub.

    On CUDA, vLLM's V1 runner warms FlashInfer's top-k/top-p sampler up at start-up, which
    FlashInfer compiles with nvcc where its kernels are not prebuilt (minutes on a fresh
    machine, or a failed start without nvcc); the benchmark's greedy requests never reach that
    sampler, so it is off (``VLLM_USE_FLASHINFER_SAMPLER=0``) unless the caller set it. The
    CPU platform never reads it."""
    env = dict(
        os.environ,
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE=str(job.get("kv_gib", 1)),
        HF_HUB_OFFLINE="1",
    )
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    return env


def job_argv(job: dict) -> list[str]:
    """The command line of a job's process."""
    return [sys.executable, "-m", "ascend_mepic.eval.bench.runner", json.dumps(job)]


def run_in_subprocess(job: dict, timeout: float = 3600) -> dict:
    """Run ``job`` in a fresh Python process (vLLM's global state stays per policy)."""
    return run_job_process(
        job_argv(job),
        job_env(job),
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
