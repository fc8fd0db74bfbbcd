"""MEPIC's engine metrics on vLLM's ``/metrics``, through vLLM's stat-logger plugin hook.

The scheduler (engine core process) writes its metrics to a JSON stats file after its steps (at
most every 0.25 s while requests run, at once when it goes idle, before the step's outputs are
sent); ``SchedulerStats`` cannot carry them,
since vLLM 0.30 decodes it into its declared fields only. :class:`MepicStatLogger` is registered
under vLLM's ``vllm.stat_logger_plugins`` entry point, so every API server process builds one
with its ``AsyncLLM``; on each ``record`` (each batch of engine outputs) and each periodic ``log``
it reads the file when it changed and sets ``prometheus_client`` gauges. vLLM serves those
gauges from prometheus' default registry with one API server, and from the multiprocess files
when ``PROMETHEUS_MULTIPROC_DIR`` is set (several API servers): totals are merged by ``max``
(each API server holds the engine's totals as of its last read), levels by ``mostrecent``.
"""

from __future__ import annotations

import json
import os
from typing import Any

from prometheus_client import Gauge
from vllm.v1.metrics.loggers import StatLoggerBase

TOTALS = {
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
    "tier_worker_fallback_unauthenticated": (
        "Tier entries refused: no tier key of this server vouches for them (forged, sealed under "
        "another key, or unsealed); compiled instead"
    ),
}
LEVELS = {
    "resident_chunks": "Chunks with KV resident in the pool",
    "chunk_anchor_tokens": "Tokens of the engine's compile anchor (chunk_anchor first; 0: none)",
    "pinned_chunks": "Chunks pinned through the chunk API",
    "pinned_blocks": "KV blocks pinned chunks hold, every tenant together",
    "pinned_blocks_limit": "The most KV blocks pinned chunks may hold (pinned_kv_fraction)",
    "pinned_blocks_top_salt": "KV blocks the cache_salt that pins the most holds",
    "pinned_blocks_per_salt_limit": (
        "The most KV blocks one cache_salt may pin (max_pinned_blocks_per_salt; 0: no own limit)"
    ),
}
POOL = {"num_blocks": "Usable KV blocks", "block_size": "Tokens per block"}


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


class MepicGauges:
    """The ``ascend_mepic_*`` gauges of this process (made once: prometheus names are global)."""

    _made: MepicGauges | None = None

    def __init__(self) -> None:
        def level(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, labels, multiprocess_mode="mostrecent")

        self.available = level("ascend_mepic_stats_available", "1 once the engine published")
        self.published = level(
            "ascend_mepic_stats_timestamp_seconds", "When the engine last published MEPIC stats"
        )
        # Engine-wide totals: a counter in the engine, a gauge here (the API servers each hold
        # the engine's total as of their last read; merged by max, never summed).
        self.totals = {
            k: Gauge(f"ascend_mepic_{k}_total", doc, multiprocess_mode="max")
            for k, doc in TOTALS.items()
        }
        self.levels = {k: level(f"ascend_mepic_{k}", doc) for k, doc in {**LEVELS, **POOL}.items()}
        self.blocks = level(
            "ascend_mepic_kv_blocks",
            "KV blocks by MEPIC category (they add up to the usable pool)",
            ("category",),
        )

    @classmethod
    def get(cls) -> MepicGauges:
        if cls._made is None:
            cls._made = cls()
        return cls._made

    def show(self, stats: dict[str, Any]) -> None:
        metrics = stats.get("metrics", {})
        for key, gauge in self.totals.items():
            if key in metrics:
                gauge.set(metrics[key])
        for key, gauge in self.levels.items():
            value = metrics.get(key, stats.get(key))
            if value is not None:
                gauge.set(value)
        for key, value in metrics.items():
            if key.startswith("blocks_"):
                self.blocks.labels(key[len("blocks_") :]).set(value)
        if "time" in stats:
            self.published.set(float(stats["time"]))
        self.available.set(1)


class MepicStatLogger(StatLoggerBase):
    """vLLM stat-logger plugin: MEPIC's engine metrics as ``ascend_mepic_*`` gauges.

    Does nothing for an engine without MEPIC or without a stats file.
    """

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        from ascend_mepic.config import MepicConfig

        config = MepicConfig.from_additional_config(vllm_config.additional_config)
        self.path = config.stats_file if config.enabled else ""
        self._seen: float | None = None
        if self.path:
            MepicGauges.get().available.set(0)

    def _refresh(self) -> None:
        if not self.path:
            return
        try:
            changed = os.stat(self.path).st_mtime_ns
        except OSError:
            return
        if changed == self._seen:
            return
        stats = read_stats(self.path)
        if stats is not None:
            self._seen = changed
            MepicGauges.get().show(stats)

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        self._refresh()

    def log(self) -> None:
        self._refresh()

    def log_engine_initialized(self) -> None:
        pass
