"""``benchmarks/ops/ncu_summary.py`` on a small report in ncu's raw CSV format (no GPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPORT = """==PROF== Connected to process 123
# NVIDIA H200, bf16
"ID","Process ID","Kernel Name","gpu__time_duration.sum","dram__throughput.avg.pct_of_peak_sustained_elapsed","launch__registers_per_thread"
"","","","nsecond","%","register/thread"
"0","123","decode-32768-B16-fused","41,250","88.10","254"
"1","123","decode-32768-B16-sdpa","39000","90.5","128"
==PROF== Disconnected
"""  # noqa: E501


def _module():
    path = Path(__file__).resolve().parents[2] / "benchmarks/ops/ncu_summary.py"
    spec = importlib.util.spec_from_file_location("ncu_summary", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rows_units_and_missing_metrics():
    ncu = _module()
    rows = ncu.summarise(ncu.read_report(REPORT))
    assert [r["kernel"] for r in rows] == ["decode-32768-B16-fused", "decode-32768-B16-sdpa"]
    assert rows[0]["time us"] == "41.2" and rows[0]["DRAM % peak"] == "88.10"
    assert rows[0]["local ld sectors"] == "-"  # a metric this ncu did not report
    assert "| decode-32768-B16-sdpa | 39.0 | 90.5 |" in ncu.markdown(rows)
    with pytest.raises(ValueError, match="no ncu CSV header"):
        ncu.read_report("==PROF== nothing profiled\n")
