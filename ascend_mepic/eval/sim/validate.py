"""Calibrate on the real engine at one load, validate the simulator at others it never saw.

For each QPS and policy the real engine serves a SQuAD workload (``eval/bench/runner.py``, one
subprocess each, every step's work and wall time recorded). A profile is fitted on the steps of
the calibration QPS only; then the simulator replays every run (the same requests, arrival
times, output lengths, block size, pool size and token budget) and its peak KV, mean TTFT and
mean latency are compared with the real engine's.

Each comparison also carries the replay's *noise band*: the same run simulated on a device 10%
slower, 10% faster, and with the calibration's own step-to-step spread (``StepNoise``). Where
the band of a metric is wider than its tolerance, the real engine itself cannot repeat that
metric within the tolerance on a machine that noisy, and no simulator can be checked there:
at light load one request ending a few milliseconds before or after the next arrives moves the
peak by a whole request. The default loads are the ones whose bands fit the tolerances.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ascend_mepic.entrypoints.streams import log

VALIDATION_POLICIES = ["full", "prefix", "naive", "epic-16", "cacheblend-15", "mepic"]
PEAK_KV_TOLERANCE = 0.05
TIME_TOLERANCE = 0.25
TOLERANCES = {  # summary() key -> largest relative error the validation accepts
    "peak_kv_blocks": PEAK_KV_TOLERANCE,
    "ttft_mean_s": TIME_TOLERANCE,
    "latency_mean_s": TIME_TOLERANCE,
}


def real_job(model: str, policy: str, qps: float, args: Any) -> dict[str, Any]:
    """The benchmark's job, every step recorded (work, wall time, blocks after schedule())."""
    from ascend_mepic.eval.bench.runner import bench_job
    from ascend_mepic.eval.bench.variants import paper_variant

    return bench_job(
        args,
        model,
        paper_variant(policy),  # as the simulator runs it
        qps,
        args.chunks,
        progress=False,
        record_steps=True,
        logprobs=0,
        ignore_eos=True,  # every request decodes max_tokens: the load is the one asked for
        warmup_tokens=args.max_batched_tokens,  # the steps the simulator prices are warm ones
    )


def real_runs(
    model: str, policies: Sequence[str], points: Sequence[float], args: Any, out: Path
) -> dict[tuple[float, str], dict[str, Any]]:
    """Run (or reuse, from ``out``) the real engine for every QPS and policy.

    Each policy's loads run back to back: a machine's speed drifts over tens of minutes (this
    project's VM by 5-70% between two runs of the same job an hour apart), and what is compared
    is one policy at several loads, calibrated on its neighbours.
    """
    from ascend_mepic.eval.bench.runner import run_in_subprocess

    raws = {}
    for policy in policies:
        for qps in points:
            path = out / f"real_qps{qps:g}_{policy}.json"
            if path.is_file() and not args.rerun:
                raws[qps, policy] = json.loads(path.read_text(encoding="utf-8"))
                continue
            log(f"[validate] real engine: {policy} at QPS {qps:g}")
            raws[qps, policy] = raw = run_in_subprocess(real_job(model, policy, qps, args))
            path.write_text(json.dumps(raw) + "\n", encoding="utf-8")
    return raws


def summary(raw: dict[str, Any]) -> dict[str, float]:
    reqs = raw["per_request"]
    # The peak is read right after each schedule() where recorded (recording.py says why).
    used = [u for _, u in raw.get("kv_scheduled") or raw["kv_timeline"]] or [0]
    return {
        "peak_kv_blocks": max(used),
        "peak_kv_usage": max(used) / raw["pool_blocks"],
        "ttft_mean_s": statistics.mean(r["first_token_s"] - r["arrival_s"] for r in reqs),
        "latency_mean_s": statistics.mean(r["finish_s"] - r["arrival_s"] for r in reqs),
        "makespan_s": max(r["finish_s"] for r in reqs) - min(r["arrival_s"] for r in reqs),
        "preemptions": raw.get("preemptions"),
    }


def replay(
    raw: dict[str, Any], requests: list, profile: Any, model: str, noise: Any = None
) -> dict[str, Any]:
    """Simulate the real run ``raw``: its requests, arrivals, output lengths and engine sizes."""
    from ascend_mepic.eval.sim.engine import SimRequest, simulate

    sim_reqs = [
        SimRequest(list(segs), r["arrival_s"], r["output_tokens"])
        for (_, segs), r in zip(requests, raw["per_request"], strict=True)
    ]
    from ascend_mepic.eval.bench.variants import split_variant

    return simulate(
        split_variant(raw["policy"])[0],  # the policy; the simulator compiles as the paper
        sim_reqs,
        profile,
        model,
        block_size=raw["block_size"],
        max_num_batched_tokens=raw["max_num_batched_tokens"],
        num_blocks=raw["pool_blocks"] + 1,  # vLLM's pool holds the null block too
        noise=noise,
    )


def noise_band(
    raw: dict[str, Any],
    requests: list,
    profile: Any,
    model: str,
    sigma: float,
    base: dict[str, float] | None = None,
) -> dict[str, list[float]]:
    """How far the replay of ``raw`` moves on a device 10% slower or faster than ``profile``,
    and with step-to-step spread ``sigma`` (log-normal): per metric, [lowest, highest] relative
    change from the plain replay."""
    from ascend_mepic.eval.sim.profile import StepNoise

    noises = [
        StepNoise(scale=0.9, sigma=sigma, seed=1),
        StepNoise(scale=1.1, sigma=sigma, seed=2),
        StepNoise(scale=1.0, sigma=sigma, seed=3),
    ]
    base = base or summary(replay(raw, requests, profile, model))
    runs = [summary(replay(raw, requests, profile, model, n)) for n in noises]
    band = {}
    for key in TOLERANCES:
        moved = [(r[key] - base[key]) / base[key] if base[key] else 0.0 for r in runs]
        band[key] = [min(0.0, *moved), max(0.0, *moved)]
    return band


def band_fits(band: dict[str, list[float]]) -> bool:
    """Whether every metric's noise band is inside its tolerance (the check means something)."""
    return all(max(-lo, hi) <= TOLERANCES[k] for k, (lo, hi) in band.items())


def compare(real: dict[str, float], sim: dict[str, float]) -> dict[str, Any]:
    def err(key: str) -> float:
        return (sim[key] - real[key]) / real[key] if real[key] else 0.0

    row = {
        "peak_kv_error": err("peak_kv_blocks"),
        "ttft_error": err("ttft_mean_s"),
        "latency_error": err("latency_mean_s"),
    }
    row["ok"] = all(abs(err(key)) <= tol for key, tol in TOLERANCES.items())
    return row
