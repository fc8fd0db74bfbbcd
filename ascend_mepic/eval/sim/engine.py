"""The serving simulator: vLLM's engine core, MEPIC's scheduler and KV managers, a priced worker.

``simulate(job)`` builds a real ``vllm.v1.engine.core.EngineCore`` (the loop ``LLMEngine`` and
``vllm serve`` drive) from engine arguments, with the policy's scheduler (``MepicScheduler``, or
stock vLLM's for ``prefix``) and ``SimulatedWorker`` as its worker. Requests arrive at their
trace times on a simulated clock; each ``EngineCore.step()`` schedules, "executes" (the worker
prices the step on the device profile) and updates requests exactly as in the engine, and the
clock advances by the priced step time. So admission, queueing, batching, the token budget,
chunked prefill, preemption and every block the KV managers hold are the engine's own; only the
step durations are modelled.

The result has the shape of a real benchmark run's (``eval/bench/runner.py``): per-request
arrival, first-token and finish times, and the pool's used blocks after every step.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ascend_mepic.core.segments import EXTRA_ARGS_KEY, Segment
from ascend_mepic.entrypoints.streams import log
from ascend_mepic.eval.sim.profile import DeviceProfile, StepNoise
from ascend_mepic.vllm_integration.class_names import SIM_WORKER_CLS

MODELS_DIR = Path(__file__).parent / "models"
MP_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
MAX_IDLE_STEPS = 10_000  # steps in a row that schedule nothing before the run is declared stuck


@dataclass
class SimRequest:
    segments: list[Segment]
    arrival_s: float
    output_tokens: int
    cache_salt: str | None = None


def model_path(name: str) -> str:
    """A bundled model shape (``mistral-7b-instruct-v0.3``), a prepared model, or a folder."""
    bundled = MODELS_DIR / name
    if (bundled / "config.json").is_file():
        return str(bundled)
    from ascend_mepic.eval.prepare import resolve_model

    return str(resolve_model(name))


def engine_args(
    policy: str,
    model: str,
    profile: DeviceProfile,
    block_size: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    num_blocks: int | None = None,
    noise: StepNoise | None = None,
) -> Any:
    """The engine arguments a real run of ``policy`` uses, with the simulated worker."""
    from vllm import EngineArgs

    from ascend_mepic.eval.bench.variants import paper_variant, split_variant
    from ascend_mepic.eval.sim.recording import PEAK_SCHEDULER_CLS, PEAK_STOCK_SCHEDULER_CLS
    from ascend_mepic.offline import mepic_llm_kwargs

    sim = {"profile": asdict(profile), "token_id": 0}
    if noise is not None:
        sim["noise"] = asdict(noise)
    if policy == "prefix":
        kwargs: dict[str, Any] = {"enable_prefix_caching": True, "async_scheduling": False}
        kwargs["additional_config"] = {}
    else:
        name, options = split_variant(paper_variant(policy))
        kwargs = mepic_llm_kwargs(policy=name, **options)
    kwargs.pop("enforce_eager", None)
    kwargs["additional_config"] = {**kwargs["additional_config"], "mepic_sim": sim}
    kwargs["worker_cls"] = SIM_WORKER_CLS
    # Records the blocks in use after each schedule(), the step's peak (recording.py says why).
    kwargs["scheduler_cls"] = PEAK_STOCK_SCHEDULER_CLS if policy == "prefix" else PEAK_SCHEDULER_CLS
    return EngineArgs(
        model=model,
        skip_tokenizer_init=True,
        dtype="float32",  # the engine's; the KV dtype is the profile's (the worker's spec)
        enforce_eager=True,
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        num_gpu_blocks_override=num_blocks,
        distributed_executor_backend="uni",
        seed=0,
        **kwargs,
    )


def build_engine_core(args: Any) -> Any:
    from ascend_mepic.vllm_integration.engine_core import EngineCore, UniProcExecutor

    # The engine core runs here, in process: with multiprocessing on, the CPU platform's check
    # would replace the "uni" executor backend (the variable is restored after).
    saved = os.environ.get(MP_ENV)
    os.environ[MP_ENV] = "0"
    try:
        config = args.create_engine_config()
    finally:
        if saved is None:
            del os.environ[MP_ENV]
        else:
            os.environ[MP_ENV] = saved
    # The CPU platform sizes KV from VLLM_CPU_KVCACHE_SPACE: the device profile decides here.
    config.cache_config.kv_cache_memory_bytes = None
    return EngineCore(config, UniProcExecutor, log_stats=False)


def _core_request(index: int, req: SimRequest, policy: str) -> Any:
    from vllm.sampling_params import SamplingParams

    from ascend_mepic.vllm_integration.engine_core import EngineCoreRequest

    extra = None
    if policy != "prefix":
        extra = {EXTRA_ARGS_KEY: [[s.kind.value, len(s.token_ids)] for s in req.segments]}
    params = SamplingParams(
        max_tokens=max(1, req.output_tokens), temperature=0.0, ignore_eos=True, extra_args=extra
    )
    return EngineCoreRequest(
        request_id=str(index),
        prompt_token_ids=[t for s in req.segments for t in s.token_ids],
        mm_features=None,
        sampling_params=params,
        pooling_params=None,
        arrival_time=req.arrival_s,
        lora_request=None,
        cache_salt=req.cache_salt,
        data_parallel_rank=None,
    )


def simulate(
    policy: str,
    requests: Sequence[SimRequest],
    profile: DeviceProfile,
    model: str,
    block_size: int = 16,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 256,
    max_model_len: int | None = None,
    num_blocks: int | None = None,
    record_steps: bool = False,
    noise: StepNoise | None = None,
) -> dict[str, Any]:
    """One policy over one trace on the simulated device; the engine is shut down after.

    ``noise`` perturbs the priced step times (``StepNoise``): how far a load's peak KV and
    latencies move when the device is a little slower, faster or noisier than its profile."""
    longest = max(sum(len(s.token_ids) for s in r.segments) + r.output_tokens for r in requests)
    chunks = max(sum(1 for s in r.segments if s.kind.value == "chunk") for r in requests)
    if max_model_len is None:
        need = longest + (chunks + 1) * block_size
        max_model_len = max(4096, -(-need // 1024) * 1024)
    args = engine_args(
        policy,
        model,
        profile,
        block_size,
        max_model_len,
        max_num_batched_tokens,
        max_num_seqs,
        num_blocks,
        noise,
    )
    core = build_engine_core(args)
    try:
        check_requests(core, policy, requests)
        return run_on(core, policy, requests, record_steps)
    finally:
        core.shutdown()


class RequestRefused(ValueError):
    """A request vLLM's front end would refuse with MEPIC on (``vllm_integration/front_end``)."""


def check_requests(core: Any, policy: str, requests: Sequence[SimRequest]) -> None:
    """Refuse, before the run, what ``vllm serve`` would refuse at the front end: the simulator
    adds requests to the engine core directly, below that check."""
    if policy == "prefix":
        return
    from ascend_mepic.config import MepicConfig
    from ascend_mepic.core.errors import MepicCapacityError
    from ascend_mepic.core.request_limits import RequestLimits
    from ascend_mepic.core.segments import LayoutError

    config = core.vllm_config
    limits = RequestLimits.from_vllm_config(
        config, MepicConfig.from_additional_config(config.additional_config)
    )
    for i, req in enumerate(requests):
        lengths = [[s.kind.value, len(s.token_ids)] for s in req.segments]
        try:
            limits.check_prompt([t for s in req.segments for t in s.token_ids], lengths)
        except (LayoutError, MepicCapacityError) as e:
            raise RequestRefused(f"{policy}: request {i} would be refused: {e}") from None


def run_on(
    core: Any, policy: str, requests: Sequence[SimRequest], record_steps: bool = False
) -> dict[str, Any]:
    """Serve ``requests`` on a built engine core, on the simulated clock."""
    from ascend_mepic.eval.sim.recording import used_blocks

    scheduler = core.scheduler
    manager = scheduler.kv_cache_manager
    worker = core.model_executor.driver_worker.worker
    pool_blocks = manager.block_pool.num_gpu_blocks - 1
    order = sorted(range(len(requests)), key=lambda i: (requests[i].arrival_s, i))
    recs = [
        {
            "index": i,
            "arrival_s": r.arrival_s,
            "first_token_s": None,
            "finish_s": None,
            "prompt_tokens": sum(len(s.token_ids) for s in r.segments),
            "output_tokens": 0,
            "finish_reason": None,
        }
        for i, r in enumerate(requests)
    ]
    timeline: list[tuple[float, int]] = []  # blocks in use after each step
    scheduled: list[tuple[float, int]] = []  # after each schedule(): the step's peak
    steps: list[dict[str, Any]] = []
    preempted: dict[str, int] = {}  # request id -> times vLLM's scheduler preempted it
    now, nxt, done, idle, num_steps, busy = 0.0, 0, 0, 0, 0, 0.0
    while done < len(recs):
        while nxt < len(order) and requests[order[nxt]].arrival_s <= now:
            i = order[nxt]
            req, wave = core.preprocess_add_request(_core_request(i, requests[i], policy))
            core.add_request(req, wave)
            nxt += 1
        if not scheduler.has_requests():
            now = max(now, requests[order[nxt]].arrival_s)
            continue
        outputs, executed = core.step()
        num_steps += 1
        dt = worker.last_step_s
        now += dt
        busy += dt
        if record_steps:
            steps.append({"t": now, "seconds": dt, **asdict(worker.last_work)})
        timeline.append((round(now, 6), used_blocks(manager)))
        scheduled.append((round(now, 6), scheduler.scheduled_blocks[-1]))
        for rid, r in scheduler.requests.items():
            if r.num_preemptions:
                preempted[rid] = r.num_preemptions
        progressed = False
        for eco in outputs.values():
            for o in eco.outputs:
                r = recs[int(o.request_id)]
                if o.new_token_ids:
                    progressed = True
                    r["output_tokens"] += len(o.new_token_ids)
                    if r["first_token_s"] is None:
                        r["first_token_s"] = now
                if o.finish_reason is not None:
                    progressed = True
                    r["finish_s"] = now
                    r["finish_reason"] = str(o.finish_reason)
                    done += 1
        idle = 0 if (progressed or executed) else idle + 1
        if idle > MAX_IDLE_STEPS:
            raise RuntimeError(
                f"simulation of {policy} stuck at t={now:.3f}s: {MAX_IDLE_STEPS} steps scheduled "
                f"nothing with {len(recs) - done} requests unfinished"
            )
    metrics = manager.metrics() if hasattr(manager, "metrics") else {}
    log(f"[simulate] {policy}: {len(recs)} requests, {num_steps} steps, {now:.2f} s simulated")
    return {
        "policy": policy,
        "block_size": scheduler.block_size,
        "max_num_batched_tokens": core.vllm_config.scheduler_config.max_num_batched_tokens,
        "pool_blocks": pool_blocks,
        "block_bytes": worker.shape.kv_bytes_per_token * scheduler.block_size,
        "kv_timeline": timeline,
        "kv_scheduled": scheduled,
        "per_request": recs,
        "manager_metrics": metrics,
        "steps": num_steps,
        "preemptions": sum(preempted.values()),
        "busy_s": busy,
        "makespan_s": now,
        "step_records": steps,
    }
