"""One helper per fact: the CPU (``host.cpu_info``), versions (``same_release``, PEP 440) and
process liveness (``host.process_alive``, psutil), each used everywhere that fact is needed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from ascend_mepic import host
from ascend_mepic.vllm_integration.version import same_release

X86 = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum\nflags\t\t: fpu avx2 avx512f\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd sve\nCPU part\t: 0xd0c\n"


def test_cpu_facts_come_from_one_parse_used_by_the_kernel_the_doctor_and_the_reports():
    from ascend_mepic.entrypoints.doctor import _cpu_info
    from ascend_mepic.eval.bench.stats import hardware
    from ascend_mepic.ops.cpu_kernel import cpu_flags

    x86 = host.parse_cpuinfo(X86, "x86_64", 2)
    assert x86.model == "Intel(R) Xeon(R) Platinum" and x86.flags == {"fpu", "avx2", "avx512f"}
    arm = host.parse_cpuinfo(ARM, "aarch64", 4)
    assert arm.flags == {"fp", "asimd", "sve"} and arm.model == ""
    assert arm.describe() == "unknown CPU (aarch64, 4 logical CPUs)"
    here = host.cpu_info()
    assert cpu_flags() == here.flags and here.logical_cpus == os.cpu_count()
    assert _cpu_info()["model"] == here.model
    assert set(_cpu_info()["isa"]) <= here.flags
    assert here.describe() in hardware()


@pytest.mark.parametrize(
    ("found", "pin", "same"),
    [
        ("0.30.0", "0.30.0", True),
        ("0.30.0+cpu", "0.30.0", True),
        ("0.30.0.dev1+g0123abc", "0.30.0", True),
        ("0.30", "0.30.0", True),
        ("0.30.0rc1", "0.30.0", False),  # a pre-release is not the release
        ("0.30.0rc2+x", "0.30.0rc2", True),
        ("0.30.0rc1", "0.30.0rc2", False),
        ("0.30.1", "0.30.0", False),
        ("0.3.0", "0.30.0", False),
        ("2.10.0", "2.10.0.post4", False),
        ("2.10.0.post4+cpu", "2.10.0.post4", True),
        ("not a version", "0.30.0", False),
    ],
)
def test_versions_compare_by_pep_440(found, pin, same):
    assert same_release(found, pin) is same


def test_process_liveness_sees_exits_zombies_and_reused_pids():
    me = os.getpid()
    assert host.process_alive(me) and host.process_alive(me, host.process_start_time(me))
    assert not host.process_alive(me, host.process_start_time(me) - 1.0)  # another start: reused
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert host.process_alive(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while host.process_alive(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not host.process_alive(child.pid)  # killed, not yet reaped: a zombie
    finally:
        child.wait()
    assert not host.process_alive(child.pid) and host.process_start_time(child.pid) is None


def test_percentile_is_numpys():
    import numpy as np

    from ascend_mepic.eval.bench.stats import percentile

    xs = [3.0, 1.0, 4.0, 1.5, 9.0]
    assert percentile(xs, 99) == pytest.approx(float(np.percentile(xs, 99)))
    assert percentile([], 50) != percentile([], 50)  # NaN
