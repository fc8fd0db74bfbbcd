"""Facts about this machine, each read in one place.

The CPU's model and feature flags (one parse of ``/proc/cpuinfo``, which ``lscpu`` and
``platform.processor()`` would only repeat or, on Linux, leave empty) and whether a process is
still the one that was recorded (psutil, which also sees zombies and reused pids).
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import psutil


@dataclass(frozen=True)
class CpuInfo:
    machine: str  # x86_64, aarch64...
    model: str  # "Intel(R) Xeon(R) ..." ("" where the kernel does not say)
    flags: frozenset[str]  # x86 "flags" or Arm "Features"
    logical_cpus: int

    def describe(self) -> str:
        return f"{self.model or 'unknown CPU'} ({self.machine}, {self.logical_cpus} logical CPUs)"


def parse_cpuinfo(text: str, machine: str, logical_cpus: int) -> CpuInfo:
    flags: frozenset[str] = frozenset()
    model = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("flags", "features") and not flags:
            flags = frozenset(value.split())
        elif key in ("model name", "cpu model") and not model:
            model = value.strip()
    return CpuInfo(machine, model, flags, logical_cpus)


@functools.cache
def cpu_info() -> CpuInfo:
    """This machine's CPU (Linux ``/proc/cpuinfo``; no model or flags where it is unreadable)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    return parse_cpuinfo(text, platform.machine(), os.cpu_count() or 1)


def process_start_time(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch), or None if there is none."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return None


def process_alive(pid: int, started: float | None = None) -> bool:
    """Whether ``pid`` runs (not a zombie) and, given ``started``, is still that process.

    Another user's process counts as alive when it cannot be inspected.
    """
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False  # killed, not yet reaped
        return started is None or proc.create_time() == started  # else: the pid was reused
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True
