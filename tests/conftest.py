"""Suite-wide pytest settings.

`make test` runs the suite on pytest-xdist workers (two by default), whole files per worker
(`--dist loadfile`), so a file's module fixtures, such as the engine runs several tests compare,
are made once. Workers take files in collection order: the files that start real engines for
minutes go first, else one of them is left for last while the other worker waits.
"""

from __future__ import annotations

import pytest

# Slowest first (seconds of engine starts on 2 cores; `make test` prints the slowest tests).
SLOW_FILES = (
    "test_tier.py",
    "test_policies.py",
    "test_docs.py",
    "test_real_geometry.py",
    "test_data_streams.py",
    "test_serving_offline.py",
    "test_engine_off.py",
    "test_bench.py",
    "test_server.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FILES)))  # stable otherwise
