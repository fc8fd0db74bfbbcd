"""Suite-wide pytest settings.

`make test` runs the suite on pytest-xdist workers (two by default), whole files per worker
(`--dist loadfile`), so a file's module fixtures, such as the engine runs several tests compare,
are made once. Workers take files in collection order: the files that start real engines for
minutes go first, else one of them is left for last while the other worker waits.
"""

from __future__ import annotations

import sys

import pytest

# Slowest first, longest processing time first (seconds each file took on its worker in a fresh
# clone's `make test` on 2 cores; an engine file's first engine also pays its host's start).
SLOW_FILES = (
    "test_real_geometry.py",  # 28 engines, ~220 s
    "test_docs.py",  # the documented servers and the offline snippet, ~170 s
    "test_tier.py",  # two servers on one Redis, ~110 s
    "test_cluster.py",  # two replicas, a kill and a restart, ~70 s
    "test_policies.py",  # ~100 s
    "test_server.py",  # ~85 s
    "test_serving_offline.py",  # tensor parallel 2, ~70 s
    "test_data_streams.py",  # ~65 s
    "test_cpu_kernel_amx_emulated.py",  # a kernel build, ~60 s
    "test_triton.py",  # ~60 s
    "test_cuda_compile.py",  # 40 launches compiled for sm_90a / sm_80, ~60 s
    "test_bench_fidelity.py",  # ~45 s
    "test_cpu_kernel_guard.py",  # a kernel build, ~35 s
    "test_prepare.py",
    "test_triton_half.py",
    "test_bench.py",
    "test_cuda_startup.py",
    "test_head128.py",
    "test_cpu_kernel.py",
    "test_npu_memory.py",
    "test_doctor.py",
    "test_cpu_kernel_build.py",
    "test_engine_off.py",
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


@pytest.fixture(autouse=True)
def _mepic_logs_reach_caplog():
    """An engine started in this worker earlier attached vLLM's handler to MEPIC's logger and
    stopped it propagating (``vllm_integration/logs.py``); pytest's ``caplog`` listens at the
    root, so each test gets propagation back."""
    import logging

    logger = logging.getLogger("ascend_mepic")
    saved, logger.propagate = logger.propagate, True
    yield
    logger.propagate = saved
