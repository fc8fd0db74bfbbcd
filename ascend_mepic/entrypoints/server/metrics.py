"""MEPIC's engine stats in the API server: the stats file and its Prometheus collector.

The engine core runs in another process; the scheduler publishes its metrics to a JSON file,
which ``GET /v1/mepic/stats`` returns and :class:`MepicStatsCollector` shows on ``/metrics``.
"""

import json
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)


def read_stats(path: str) -> dict[str, Any] | None:
    """The scheduler's last stats snapshot, or None before it wrote one."""
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


_COUNTERS = {
    "chunk_hits": "Chunk lookups that found the chunk's shared blocks resident",
    "chunk_misses": "Chunk lookups that had to compile the chunk",
    "chunk_evictions": "Idle chunks evicted from the KV pool",
    "tokens_reused": "Prompt tokens served from shared chunk blocks",
    "tokens_computed": "Prompt tokens computed (in context or in chunk compiles)",
    "requests_admitted": "MEPIC requests admitted by the scheduler",
    "admissions_deferred": "MEPIC admissions deferred for lack of free blocks",
    "tier_loads": "Chunks loaded from the off-device tier and verified",
    "tier_fallbacks": "Tier loads that failed (miss, corruption, backend error) and were compiled",
    "tier_decided_load": "Chunks found in the tier that the scheduler chose to load",
    "tier_decided_compute": "Chunks found in the tier that the scheduler chose to recompute",
    "tier_worker_puts": "Chunks offloaded to the tier",
    "tier_worker_bytes_stored": "Bytes offloaded to the tier",
    "tier_worker_bytes_loaded": "Bytes loaded from the tier",
}
_GAUGES = {
    "resident_chunks": "Chunks with KV resident in the pool",
    "pinned_chunks": "Chunks pinned through the chunk API",
}


class MepicStatsCollector(Collector):
    """Exposes the engine's MEPIC stats file as ``ascend_mepic_*`` Prometheus metrics.

    The engine core runs in another process; the scheduler publishes its metrics to a JSON file
    and this collector reads it on every scrape.
    """

    def __init__(self, path: str) -> None:
        self.path = path

    def collect(self) -> Iterator[Metric]:
        stats = read_stats(self.path)
        up = GaugeMetricFamily(
            "ascend_mepic_stats_available", "1 once the engine published MEPIC stats"
        )
        up.add_metric([], 0.0 if stats is None else 1.0)
        yield up
        if stats is None:
            return
        metrics = stats.get("metrics", {})
        for key, doc in _COUNTERS.items():
            if key in metrics:
                yield CounterMetricFamily(f"ascend_mepic_{key}", doc, value=metrics[key])
        for key, doc in _GAUGES.items():
            if key in metrics:
                yield GaugeMetricFamily(f"ascend_mepic_{key}", doc, value=metrics[key])
        blocks = GaugeMetricFamily(
            "ascend_mepic_kv_blocks",
            "KV blocks by MEPIC category (they add up to the usable pool)",
            labels=["category"],
        )
        for key, value in sorted(metrics.items()):
            if key.startswith("blocks_"):
                blocks.add_metric([key[len("blocks_") :]], value)
        yield blocks
        for key, doc in (("num_blocks", "Usable KV blocks"), ("block_size", "Tokens per block")):
            if key in stats:
                yield GaugeMetricFamily(f"ascend_mepic_{key}", doc, value=stats[key])
        if "time" in stats:
            yield GaugeMetricFamily(
                "ascend_mepic_stats_age_seconds",
                "Seconds since the engine last published MEPIC stats (it does while scheduling)",
                value=max(0.0, time.time() - float(stats["time"])),
            )


_collectors: dict[str, MepicStatsCollector] = {}


def register_stats_collector(path: str) -> None:
    """Register the collector once per process and stats file.

    vLLM 0.30.0 serves ``/metrics`` from prometheus' default registry unless
    ``PROMETHEUS_MULTIPROC_DIR`` is set (several API server processes), in which case it reads
    only the multiprocess files and a collector object is not shown: MEPIC's metrics are then
    available from ``/v1/mepic/stats`` only, and a warning says so.
    """
    if not path or path in _collectors:
        return
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        logger.warning(
            "PROMETHEUS_MULTIPROC_DIR is set: /metrics shows prometheus' multiprocess files only, "
            "so MEPIC's metrics are served at /v1/mepic/stats, not /metrics"
        )
    collector = MepicStatsCollector(path)
    REGISTRY.register(collector)
    _collectors[path] = collector
