"""The environment `make setup` made is exactly requirements/main.lock.

What a new user gets must not drift from day to day: every locked distribution is installed at its
locked version, nothing excluded (requirements/excludes.txt) is installed, and nothing unlocked
slipped in. Runs only in the project's own .venv (elsewhere the environment is the user's).
"""

from __future__ import annotations

import importlib.metadata as md
import re
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REQ = ROOT / "requirements"

pytestmark = pytest.mark.skipif(
    Path(sys.prefix).resolve() != (ROOT / ".venv").resolve(),
    reason="not the project's .venv made by `make setup`",
)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _locked() -> dict[str, str]:
    pins = re.findall(
        r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)", (REQ / "main.lock").read_text(), re.M
    )
    return {_norm(n): v for n, v in pins}


def _names(path: Path) -> set[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return {_norm(line) for line in lines if line}


def _installed() -> dict[str, str]:
    """Distributions installed in the venv's site-packages. Not ``sys.path``: importing
    setuptools puts its ``_vendor`` folder there, whose vendored copies are not installs."""
    paths = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    return {_norm(d.metadata["Name"]): d.version for d in md.distributions(path=paths)}


def test_installed_versions_are_the_locked_ones() -> None:
    locked, installed = _locked(), _installed()
    assert len(locked) > 100
    wrong = {n: (v, installed.get(n)) for n, v in locked.items() if installed.get(n) != v}
    assert not wrong, f"installed != locked (locked, installed): {wrong}; run `make setup`"


def test_nothing_unlocked_or_excluded_is_installed() -> None:
    locked, installed = _locked(), _installed()
    excluded = _names(REQ / "excludes.txt")
    assert {"torchvision", "llama-cpp-python", "cupy-cuda13x"} <= excluded
    assert not excluded & set(locked), "an excluded package is in the lock"
    extra = set(installed) - set(locked) - {"ascend-mepic", "pip"}
    assert not extra, f"installed but not locked: {sorted(extra)}"
