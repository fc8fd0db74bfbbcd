"""Fit a device profile from a measured run: each engine step's work and its wall time.

The fit is a non-negative least squares over the steps of every policy run at the calibration
load, alternated with deciding which steps stream the weights rather than compute
(``fit_coefficients``).
"""

from __future__ import annotations

import platform
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import fields
from typing import Any

import numpy as np

from ascend_mepic.eval.sim.cost import FEATURES, ModelShape, StepWork
from ascend_mepic.eval.sim.profile import DeviceProfile

UNRESOLVED_RATE = 1e6  # a rate the fit found no cost for (coefficient 0): effectively free


def nnls(a: np.ndarray, b: np.ndarray, iters: int = 200) -> np.ndarray:
    """Lawson-Hanson non-negative least squares (numpy only)."""
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    for _ in range(iters):
        w = a.T @ (b - a @ x)
        candidates = np.where(~passive & (w > 1e-12 * max(1.0, np.abs(w).max())))[0]
        if candidates.size == 0:
            break
        passive[candidates[np.argmax(w[candidates])]] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            bad = passive & (z <= 0)
            alpha = np.min(x[bad] / (x[bad] - z[bad]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
    return x


def fit_coefficients(
    records: Iterable[Mapping[str, Any]],
    shape: ModelShape,
    iterations: int = 20,
    error_power: float = 0.5,
) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds per unit of each feature (``cost.FEATURES``; ``kv_bytes``'s is the memory's, which
    also streams the weights), and the fit's quality.

    The linear layers cost ``max(FLOPs / GEMM rate, weight bytes / memory rate)``: a step is
    compute-bound or weight-streaming-bound. Given which, the model is linear in the inverse
    rates, so the fit alternates: classify every step with the current rates, solve the
    non-negative least squares, until the classification stops changing; from three starting
    classifications, keeping the best.

    Each step's error is weighted by ``1 / seconds ** error_power``. Relative errors (1.0) let
    the many short decode steps decide the fit and underprice the few long prefill steps that
    make TTFT (a CPU fit found attention free and missed TTFT by 20-28%); absolute errors (0.0)
    do the reverse and missed latency by up to 54%. The square root weighs both (docs/results.md,
    "Serving simulator").
    """
    works, target = [], []
    for rec in records:
        works.append(StepWork(**{f.name: rec[f.name] for f in fields(StepWork)}).features(shape))
        target.append(rec["seconds"])
    if len(works) < 2 * len(FEATURES):
        raise ValueError(f"{len(works)} steps are too few to fit a profile: run more requests")
    b = np.array(target)
    raw = np.array([[f[k] for k in FEATURES] for f in works])
    linear = raw[:, FEATURES.index("linear_flops")]
    # The alternation has several fixed points (a CPU's fit once settled with nearly every step
    # "weight-streaming" at 15 GB/s and missed most steps by 40%): start it from none, half and
    # all of the steps streaming the weights, and keep the fit with the smallest residual.
    starts = [np.zeros(len(b), bool), linear < np.median(linear), np.ones(len(b), bool)]
    fits = [_alternate(raw, b, shape, start, iterations, error_power) for start in starts]
    coef, memory_bound, _ = min(fits, key=lambda fit: fit[2])
    fitted = dict(zip(FEATURES, map(float, coef), strict=True))
    pred = np.array([_seconds(f, fitted, shape) for f in works])
    quality = {
        "steps": len(b),
        "weight_streaming_bound_steps": int(memory_bound.sum()),
        "measured_s": float(b.sum()),
        "fitted_s": float(pred.sum()),
        "mean_abs_step_error": float(np.mean(np.abs(pred - b)) / max(1e-12, np.mean(b))),
        # the spread of measured / fitted step time, for the validation's noise band
        "log_step_sigma": float(np.std(np.log(np.maximum(b, 1e-9) / np.maximum(pred, 1e-9)))),
    }
    return fitted, quality


def _alternate(
    raw: np.ndarray,
    b: np.ndarray,
    shape: ModelShape,
    memory_bound: np.ndarray,
    iterations: int,
    error_power: float,
) -> tuple[np.ndarray, np.ndarray, float]:
    """Classify, solve, repeat from ``memory_bound``: (coefficients, classification, residual)."""
    col = {k: i for i, k in enumerate(FEATURES)}
    # Request latencies are sums of many small steps, TTFTs of a few large ones: weights
    # between relative and absolute errors (``fit_coefficients`` says why).
    w = 1.0 / np.maximum(b, 1e-6) ** error_power
    coef = np.zeros(len(FEATURES))
    for _ in range(iterations):
        a = raw.copy()
        a[memory_bound, col["linear_flops"]] = 0.0
        a[memory_bound, col["kv_bytes"]] += shape.weight_bytes
        scale = np.abs(a * w[:, None]).max(axis=0)
        scale[scale == 0] = 1.0
        coef = nnls(a * w[:, None] / scale, b * w) / scale
        gemm = raw[:, col["linear_flops"]] * coef[col["linear_flops"]]
        stream = shape.weight_bytes * coef[col["kv_bytes"]]
        now_bound = gemm < stream
        if (now_bound == memory_bound).all():
            break
        memory_bound = now_bound
    a = raw.copy()
    a[memory_bound, col["linear_flops"]] = 0.0
    a[memory_bound, col["kv_bytes"]] += shape.weight_bytes
    residual = float(np.sum(((a @ coef - b) * w) ** 2))
    return coef, memory_bound, residual


def _seconds(f: Mapping[str, float], c: Mapping[str, float], shape: ModelShape) -> float:
    linear = max(f["linear_flops"] * c["linear_flops"], shape.weight_bytes * c["kv_bytes"])
    rest = sum(f[k] * c[k] for k in FEATURES if k not in ("linear_flops",))
    return linear + rest


def profile_from_fit(
    name: str,
    coef: Mapping[str, float],
    quality: Mapping[str, float],
    model: str,
    dtype_bytes: int,
    memory_gib: float,
    runs: Sequence[str],
) -> DeviceProfile:
    def rate(c: float) -> float:
        return 1.0 / c if c > 0 else UNRESOLVED_RATE * 1e12

    gemm = rate(coef["linear_flops"])
    attention = rate(coef["attention_flops"])
    peak = max(gemm, attention)
    rope = coef["rope_flops"] / coef["attention_flops"] if coef["attention_flops"] > 0 else 0.0
    return DeviceProfile(
        name=name,
        description=f"calibrated on {platform.node() or 'this machine'} "
        f"({platform.machine()}) with {model}",
        kind="calibrated",
        hbm_gib=round(memory_gib, 3),
        memory_utilization=1.0,
        activation_reserve_gib=0.0,
        peak_tflops=peak / 1e12,
        gemm_efficiency=gemm / peak,
        attention_efficiency=attention / peak,
        hbm_tb_s=rate(coef["kv_bytes"]) / 1e12,
        memory_efficiency=1.0,
        host_gb_s=rate(coef["host_bytes"]) / 1e9,
        step_overhead_ms=coef["steps"] * 1e3,
        seq_overhead_ms=coef["sequences"] * 1e3,
        rope_read_overhead=rope,
        dtype_bytes=dtype_bytes,
        weights_in_overhead=False,
        calibrated_on={"model": model, "runs": list(runs), "fit": dict(quality)},
        sources={"all": "fitted by `ascend-mepic bench profile` (non-negative least squares)"},
    )
