"""Every data-producing command keeps its data and its logs apart.

Each command runs as a real subprocess with vLLM's logging at its defaults (stdout stream), turned
up to DEBUG so that it certainly logs, and what it wrote to stdout (or to --out) must parse as the
command's data. A log line reaching a data stream again fails here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "ascend_mepic.entrypoints.cli"]
# vLLM's log format ("INFO 11-25 11:34:16 [file.py:83] ...") and ours ("INFO name: ...").
LOG_LINE = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL)[ :]")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LOGGING")}
    env.pop("VLLM_CONFIGURE_LOGGING", None)
    env.update(VLLM_LOGGING_LEVEL="DEBUG", HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    return env


def _run(argv: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        argv, capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=timeout
    )
    assert proc.returncode == 0, f"{argv} failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    return proc


def _no_log_lines(text: str) -> None:
    bad = [line for line in text.splitlines() if LOG_LINE.match(line)]
    assert not bad, f"log lines in a data stream: {bad[:3]}"


def _vllm_logged(proc: subprocess.CompletedProcess) -> None:
    """The run did log through vLLM's default config: the check above had something to catch."""
    assert re.search(r"^(DEBUG|INFO|WARNING) \d\d-\d\d ", proc.stderr, re.M), proc.stderr[-2000:]


SCRIPT = (
    "from ascend_mepic.entrypoints.streams import print_data_only\n"
    "print_data_only()\n"
    "import os, logging, vllm\n"
    "from vllm.logger import init_logger\n"
    "init_logger('vllm.test').warning('a log line')\n"
    "os.write(1, b'native write\\n')\n"  # fd 1 from native code lands in the log stream
    "print('| data |')\n"
)


@dataclass
class Runs:
    """The module's commands, started together; ``out`` holds their --out files."""

    out: Path
    futures: dict[str, Future]

    def result(self, name: str) -> subprocess.CompletedProcess:
        return self.futures[name].result()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Iterator[Runs]:
    """The independent commands three at a time: each spends most of its time importing vLLM
    on one core, so one after another they took about two minutes of the suite."""
    from ascend_mepic.eval.prepare import prepare_tiny_llama

    prepare_tiny_llama()
    out = tmp_path_factory.mktemp("streams")
    commands = {
        "trace_file": [*CLI, "trace", "squad", "--requests", "4", "--chunks", "2", "--tokenizer",
                       "tiny", "--out", str(out / "trace.jsonl")],
        "trace": [*CLI, "trace", "squad", "--requests", "4", "--chunks", "2", "--tokenizer",
                  "tiny"],
        "prepare": [*CLI, "prepare", "--model", "tiny"],
        "workload": [*CLI, "bench", "workload", "--model", "tiny", "--requests", "4",
                     "--articles", "1", "--points", "2", "--out", str(out / "workload")],
        "kernels": [*CLI, "bench", "kernels", "--context", "64", "--batch", "1", "--heads", "2",
                    "--kv-heads", "1", "--head-size", "32", "--block-size", "32", "--dtypes",
                    "float32", "--repeats", "1", "--no-reference", "--threads", "1"],
        "compare": [*CLI, "bench", "compare", "--model", "tiny", "--requests", "2", "--chunks",
                    "1", "--max-tokens", "2", "--articles", "1", "--qps", "50", "--block-size",
                    "32", "--policies", "mepic", "--out", str(out / "compare")],
        "script": [sys.executable, "-c", SCRIPT],
    }  # fmt: skip
    with ThreadPoolExecutor(max_workers=3) as pool:
        yield Runs(out, {name: pool.submit(_run, argv) for name, argv in commands.items()})


@pytest.fixture(scope="module")
def trace_file(runs: Runs) -> Path:
    proc = runs.result("trace_file")
    path = runs.out / "trace.jsonl"
    assert proc.stdout == ""
    assert len([json.loads(line) for line in path.read_text().splitlines()]) == 4
    return path


def test_trace_to_stdout_is_pure_jsonl(trace_file: Path, runs: Runs) -> None:
    proc = runs.result("trace")
    # `trace` no longer imports vLLM (the KV layout moved to ops/layout.py, 0f4c2f0), so there is
    # no vLLM log to catch here; every stdout line must still parse as one JSON record.
    lines = proc.stdout.splitlines()
    assert [json.loads(line) for line in lines] == [
        json.loads(line) for line in trace_file.read_text().splitlines()
    ]


def test_kvsim_prints_only_its_table(trace_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "kvsim.json"
    proc = _run([*CLI, "kvsim", str(trace_file), "--placement", "all", "--block-size", "32",
                 "--num-blocks", "256", "--json", str(out)])  # fmt: skip
    _vllm_logged(proc)
    lines = proc.stdout.splitlines()
    assert lines and all(line.startswith("|") for line in lines), proc.stdout
    assert len(lines) == 2 + 3  # header, rule, one row per placement
    assert {r["placement"] for r in json.loads(out.read_text())} == {"mepic", "private", "prefix"}


def test_prepare_prints_only_model_folders(runs: Runs) -> None:
    proc = runs.result("prepare")
    (line,) = proc.stdout.splitlines()
    name, path = line.split(": ", 1)
    assert name == "tiny" and Path(path, "config.json").is_file()


def test_bench_workload_prints_only_its_report(runs: Runs) -> None:
    proc = runs.result("workload")
    _no_log_lines(proc.stdout)
    assert proc.stdout == (runs.out / "workload" / "report.md").read_text()


def test_bench_kernels_prints_only_json(runs: Runs) -> None:
    proc = runs.result("kernels")
    _vllm_logged(proc)
    report = json.loads(proc.stdout)
    assert report["shapes"]["context"] == 64


def test_bench_compare_prints_only_its_summary(runs: Runs) -> None:
    """The engine runs in a subprocess of the command; its logs must not reach stdout either."""
    proc = runs.result("compare")
    _no_log_lines(proc.stdout)
    assert proc.stdout == (runs.out / "compare" / "summary.md").read_text()
    assert proc.stdout.startswith("| policy |") and "| mepic |" in proc.stdout
    assert "[bench] compare: mepic" in proc.stderr


def test_a_script_printing_data_keeps_vllm_logs_out(runs: Runs) -> None:
    """A benchmark script's pattern (print_data_only, then vLLM imported and used)."""
    proc = runs.result("script")
    assert proc.stdout == "| data |\n"
    assert "a log line" in proc.stderr and "native write" in proc.stderr
