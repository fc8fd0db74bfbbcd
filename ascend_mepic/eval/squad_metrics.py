"""SQuAD answer metrics (exact match, token F1) and bootstrap confidence intervals.

Normalization follows the SQuAD evaluation convention: lowercase, drop punctuation, drop the
articles a/an/the, collapse whitespace. Scores are maxima over the gold answers. The bootstrap
helpers let a benchmark say whether a policy's accuracy change vs full recompute is more than
question-sampling noise.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lowercase, strip punctuation and articles, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _f1_one(pred: str, gold: str) -> float:
    p, g = normalize_answer(pred).split(), normalize_answer(gold).split()
    if not p or not g:
        return float(p == g)  # both empty: 1, one empty: 0
    common = sum((Counter(p) & Counter(g)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(g)
    return 2 * precision * recall / (precision + recall)


def f1(pred: str, golds: Sequence[str]) -> float:
    """Token-overlap F1 of ``pred`` against the best-matching gold answer, in [0, 1]."""
    return max((_f1_one(pred, g) for g in golds), default=0.0)


def exact_match(pred: str, golds: Sequence[str]) -> float:
    """1.0 if ``pred`` equals any gold answer after normalization, else 0.0."""
    p = normalize_answer(pred)
    return float(any(p == normalize_answer(g) for g in golds))


@dataclass(frozen=True)
class Interval:
    """A point estimate with a percentile-bootstrap 95% confidence interval."""

    mean: float
    low: float
    high: float


def bootstrap_mean(x: Sequence[float], n: int = 2000, seed: int = 0) -> Interval:
    """Mean of ``x`` and the 95% percentile-bootstrap CI of that mean (deterministic by seed)."""
    arr = np.asarray(x, dtype=np.float64)
    if arr.size == 0:
        raise ValueError("bootstrap needs at least one value")
    rng = np.random.default_rng(seed)
    means = arr[rng.integers(0, arr.size, size=(n, arr.size))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return Interval(float(arr.mean()), float(low), float(high))


def paired_bootstrap(
    a: Sequence[float], b: Sequence[float], n: int = 2000, seed: int = 0
) -> Interval:
    """mean(b) - mean(a) over paired samples (same questions) with its 95% bootstrap CI.

    Resampling the questions jointly keeps the pairing, so per-question difficulty cancels and
    the interval is much tighter than comparing two independent CIs.
    """
    xa, xb = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if xa.shape != xb.shape:
        raise ValueError(f"paired samples differ in length: {xa.shape} vs {xb.shape}")
    return bootstrap_mean(xb - xa, n=n, seed=seed)
