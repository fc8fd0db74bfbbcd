"""Suite-wide pytest settings.

`make test` runs the suite on pytest-xdist workers (two by default), whole files per worker
(`--dist loadfile`), so a file's module fixtures, such as the engine runs several tests compare,
are made once. Workers take files in collection order: the files that start real engines for
minutes go first, else one of them is left for last while the other worker waits.
"""

from __future__ import annotations

import sys

import pytest

# Slowest first (seconds on 2 cores in a fresh clone's `make test`, which prints the slowest tests;
# an engine file's first engine also pays its host's start).
SLOW_FILES = (
    "test_real_geometry.py",  # 28 engines, ~340 s
    "test_docs.py",  # the documented servers and the offline snippet, ~250 s
    "test_policies.py",
    "test_tier.py",
    "test_cpu_kernel_build.py",
    "test_serving_offline.py",
    "test_triton.py",
    "test_data_streams.py",
    "test_bench_fidelity.py",
    "test_server.py",
    "test_prepare.py",
    "test_head128.py",
    "test_cpu_kernel_amx_emulated.py",
    "test_bench.py",
    "test_engine_off.py",
    "test_triton_half.py",
    "test_cuda_startup.py",
)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Where the test modules imported triton-ascend, speed its interpreter up (results
    unchanged; see ``tests/ops/interpreter_speed.py``)."""
    if "triton" in sys.modules:
        from tests.ops import interpreter_speed

        interpreter_speed.install()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FILES)))  # stable otherwise
