"""MEPIC's engine metrics reach vLLM's /metrics through its stat-logger plugin hook."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
from types import SimpleNamespace

from prometheus_client import REGISTRY

from ascend_mepic.vllm_integration.stat_logger import MepicGauges, MepicStatLogger


def test_the_plugin_sets_gauges_from_the_engines_stats_file(tmp_path):
    path = tmp_path / "stats.json"
    logger = MepicStatLogger(
        SimpleNamespace(additional_config={"mepic": {"stats_file": str(path)}})
    )
    logger.record(None, None)  # no file yet: nothing published
    assert REGISTRY.get_sample_value("ascend_mepic_stats_available") == 0
    stats = {
        "time": 1234.5,
        "num_blocks": 99,
        "block_size": 16,
        "metrics": {
            "chunk_hits": 3,
            "resident_chunks": 2,
            "blocks_free": 90,
            "blocks_chunk_shared_idle": 9,
            "tier_worker_fallback_unauthenticated": 2,  # tier entries refused (issue #76)
        },
    }
    path.write_text(json.dumps(stats))
    logger.record(None, None)
    value = REGISTRY.get_sample_value
    assert value("ascend_mepic_stats_available") == 1
    assert (
        value("ascend_mepic_chunk_hits_total") == 3 and value("ascend_mepic_resident_chunks") == 2
    )
    assert value("ascend_mepic_num_blocks") == 99 and value("ascend_mepic_block_size") == 16
    assert value("ascend_mepic_tier_worker_fallback_unauthenticated_total") == 2
    assert value("ascend_mepic_kv_blocks", {"category": "chunk_shared_idle"}) == 9
    assert value("ascend_mepic_stats_timestamp_seconds") == 1234.5
    stats["metrics"]["chunk_hits"] = 5
    path.write_text(json.dumps(stats))
    os.utime(path, ns=(0, path.stat().st_mtime_ns + 1_000_000))
    logger.log()  # vLLM's periodic log also refreshes (the engine may have gone idle)
    assert value("ascend_mepic_chunk_hits_total") == 5
    # several API servers each hold the engine's totals as of their last read: merged by max
    gauges = MepicGauges.get()
    assert gauges.totals["chunk_hits"]._multiprocess_mode == "max"
    assert gauges.levels["resident_chunks"]._multiprocess_mode == "mostrecent"
    # MEPIC off: the plugin reads nothing
    assert MepicStatLogger(SimpleNamespace(additional_config={})).path == ""


def test_the_plugin_is_registered_with_vllm():
    plugins = md.entry_points(group="vllm.stat_logger_plugins")
    assert any(
        ep.value == "ascend_mepic.vllm_integration.stat_logger:MepicStatLogger" for ep in plugins
    )
