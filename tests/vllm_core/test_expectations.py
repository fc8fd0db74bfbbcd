"""The expectations of ``make test-vllm-core`` (tests/vllm_core/expectations.toml), checked in
``make test`` without vLLM's test files: each refused group names one of MEPIC's own error
classes and a message MEPIC raises, and no test is in two groups of the same policy."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from ascend_mepic.vllm_integration.version import SUPPORTED_VLLM
from tests.vllm_core import mepic_substitution as plugin

REPO = Path(__file__).resolve().parents[2]


def test_every_refusal_names_a_mepic_error_and_a_message_mepic_raises():
    groups = plugin.load_expectations()
    sources = "".join(p.read_text(encoding="utf-8") for p in (REPO / "ascend_mepic").rglob("*.py"))
    refused = [g for g in groups if g.kind == "refused"]
    assert refused
    for g in refused:
        module = importlib.import_module(plugin.REFUSAL_ERRORS[g.error])
        error = getattr(module, g.error)
        assert error.__module__.startswith("ascend_mepic."), g.name
        assert g.match in sources, f"{g.name}: no MEPIC message contains {g.match!r}"


def test_no_test_is_in_two_groups_of_one_policy():
    groups = plugin.load_expectations()
    for policy in plugin.POLICIES:
        seen: dict[str, str] = {}
        for g in groups:
            if policy not in g.policies:
                continue
            for pattern in g.tests:
                assert pattern not in seen, f"{pattern}: {seen.get(pattern)} and {g.name}"
                seen[pattern] = g.name


def test_runner_runs_the_vllm_mepic_supports():
    """The sdist whose tests run is the vLLM MEPIC targets, pinned by its SHA-256."""
    path = REPO / "scripts" / "vllm_core_tests.py"
    spec = importlib.util.spec_from_file_location("vllm_core_tests", path)
    runner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runner)
    assert runner.VERSION == SUPPORTED_VLLM
    assert runner.SDIST_URL.endswith(f"/vllm-{SUPPORTED_VLLM}.tar.gz")
    assert len(runner.SDIST_SHA256) == 64 and int(runner.SDIST_SHA256, 16) >= 0
    assert ".cache/vllm-core-tests/" in (REPO / ".gitignore").read_text(encoding="utf-8")


def test_node_id_patterns_take_brackets_literally():
    match = plugin.pattern_matches
    assert match("t.py::test_a[*]", "t.py::test_a[True-16]")
    assert not match("t.py::test_a[*]", "t.py::test_ab")
    assert match("t.py::test_a[0]", "t.py::test_a[0]")
    assert not match("t.py::test_a[0]", "t.py::test_a0")
    assert match("t.py::*", "t.py::test_b[x]")
