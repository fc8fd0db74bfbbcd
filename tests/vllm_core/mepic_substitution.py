"""pytest plugin: vLLM 0.30.0's own ``tests/v1/core`` with MEPIC's classes in place of vLLM's.

Loaded by ``scripts/vllm_core_tests.py`` (``make test-vllm-core``) with ``-p mepic_substitution``
into a pytest run of vLLM's test files, unpacked from vLLM's sdist into an ignored cache folder
and run there, unchanged (this repository never holds a copy of them). It lives in this tree, not
beside vLLM's files, because it is MEPIC's part of the check: which classes stand in for vLLM's,
under which policy, and what each outcome means.

Substitution. vLLM's engine takes MEPIC's scheduler through ``--scheduler-cls``, but these unit
tests build ``Scheduler``, ``AsyncScheduler`` and ``KVCacheManager`` themselves, from names they
import at module level (``tests/v1/core/utils.py``'s ``create_scheduler``, test_prefix_caching's
``make_kv_cache_manager``, ...). So once vLLM's test modules are imported
(``pytest_collection_modifyitems``, again before each test for modules imported later), every
module-level name bound to one of those three vLLM classes in a ``tests.*`` module is rebound to
MEPIC's class under test:

* ``Scheduler`` -> ``MepicScheduler`` (``ascend_mepic.core.scheduler``), with MEPIC turned on in
  the test's ``VllmConfig``: ``additional_config["mepic"]`` is set to the policy's options, as
  ``--additional-config '{"mepic": {...}}'`` does. MEPIC's scheduler then swaps its KV manager in
  (``MepicKVCacheManager``), as in the engine;
* ``AsyncScheduler`` -> the same over vLLM's ``AsyncScheduler`` (MEPIC refuses async scheduling:
  each such test is an expected refusal);
* ``KVCacheManager`` -> ``MepicKVCacheManager`` with the policy's ``KVSettings`` and vLLM's
  default prefix-cache hash (SHA-256).

MEPIC's model check (``check_model_supported``, run at engine configuration and in the worker)
is not part of it: these tests build a scheduler for OPT and other models MEPIC would refuse at
start-up, and the scheduling path does not depend on the model.

Outcomes (``expectations.toml`` beside this file; the plugin fails the run on any mismatch):

* pass;
* expected refusal: the test configures something MEPIC refuses by design. It must fail with
  the group's MEPIC error type and message; it is then reported as xfailed with the group's
  reason. Passing, or failing any other way, fails the run;
* skipped by vLLM itself (its own ``skipif`` / ``pytest.skip``);
* not applicable here: listed with a reason, skipped before it runs.

A test outside the expectations that fails, fails the run. ``--mepic-strict`` (the runner sets
it) also fails the run when an expectation names no collected test, so the list stays current.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tomllib

EXPECTATIONS = Path(__file__).with_name("expectations.toml")
POLICIES = ("default", "full")  # "default": MEPIC's default policy (``{"mepic": {}}``)

_state: dict[str, Any] = {"policy": "default", "constructed": False}


def mepic_options(policy: str) -> dict[str, Any]:
    return {} if policy == "default" else {"policy": policy}


def _mark_constructed() -> None:
    _state["constructed"] = True


def _substitutes() -> dict[type, type]:
    """vLLM's class -> MEPIC's stand-in, under the run's policy (made once per run)."""
    if "substitutes" in _state:
        return _state["substitutes"]
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from ascend_mepic.core.kv_manager import MepicKVCacheManager
    from ascend_mepic.core.kv_settings import KVSettings
    from ascend_mepic.core.policies import parse_policy
    from ascend_mepic.core.scheduler import MepicScheduler

    options = mepic_options(_state["policy"])
    policy = parse_policy(options.get("policy", "mepic"))

    def turn_mepic_on(vllm_config: Any) -> None:
        additional = dict(vllm_config.additional_config or {})
        additional["mepic"] = dict(options)
        vllm_config.additional_config = additional

    class SubstitutedScheduler(MepicScheduler):
        """MepicScheduler with MEPIC on in the test's config (its ``--additional-config``)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            config = kwargs.get("vllm_config", args[0] if args else None)
            turn_mepic_on(config)
            _mark_constructed()
            super().__init__(*args, **kwargs)

    class SubstitutedAsyncScheduler(SubstitutedScheduler, AsyncScheduler):
        """A test that builds vLLM's ``AsyncScheduler`` schedules asynchronously, which MEPIC
        refuses. vLLM's CPU platform has already turned ``async_scheduling`` off in the test's
        config (the class is chosen by the test, not by the config), so the flag is set back
        to what the test means, and MEPIC's start-up check refuses it with its own error."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            config = kwargs.get("vllm_config", args[0] if args else None)
            config.scheduler_config.async_scheduling = True
            super().__init__(*args, **kwargs)

    class SubstitutedKVCacheManager(MepicKVCacheManager):
        """MepicKVCacheManager built where a test builds vLLM's ``KVCacheManager``."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("hash_fn", sha256)  # vLLM's default prefix_caching_hash_algo
            kwargs.setdefault("model_fingerprint", "vllm-core-tests")
            kwargs.setdefault("settings", KVSettings(policy=policy))
            _mark_constructed()
            super().__init__(*args, **kwargs)

    for cls, original in (
        (SubstitutedScheduler, Scheduler),
        (SubstitutedAsyncScheduler, AsyncScheduler),
        (SubstitutedKVCacheManager, KVCacheManager),
    ):
        cls.__name__ = cls.__qualname__ = original.__name__  # what vLLM's messages print
    _state["substitutes"] = {
        Scheduler: SubstitutedScheduler,
        AsyncScheduler: SubstitutedAsyncScheduler,
        KVCacheManager: SubstitutedKVCacheManager,
    }
    return _state["substitutes"]


def substitute_in_test_modules() -> int:
    """Rebind vLLM's classes in every imported ``tests.*`` module; the number rebound."""
    substitutes = _substitutes()
    count = 0
    for name, module in list(sys.modules.items()):
        if not (name == "tests" or name.startswith("tests.")) or module is None:
            continue
        namespace = vars(module)
        for attr, value in list(namespace.items()):
            if isinstance(value, type) and value in substitutes:
                namespace[attr] = substitutes[value]
                count += 1
    return count


# -- expectations --------------------------------------------------------------------------


@dataclass(frozen=True)
class Group:
    kind: str  # "refused" or "not_applicable"
    name: str
    reason: str
    tests: tuple[str, ...]
    policies: tuple[str, ...] = POLICIES
    error: str = ""  # refused: the MEPIC error's class name
    match: str = ""  # refused: a part of its message

    def matches(self, nodeid: str) -> bool:
        return any(pattern_matches(pattern, nodeid) for pattern in self.tests)


def pattern_matches(pattern: str, nodeid: str) -> bool:
    """A node id pattern: ``*`` is any text, everything else literal (``[`` too: ids have
    parameters in brackets)."""
    regex = ".*".join(re.escape(part) for part in pattern.split("*"))
    return re.fullmatch(regex, nodeid) is not None


REFUSAL_ERRORS = {
    # ascend_mepic/core/engine_support.py: start-up refusals of engine features
    "UnsupportedEngineFeature": "ascend_mepic.core.engine_support",
    # ascend_mepic/core/errors.py: a KV cache the KV manager cannot hold, a step too small
    "MepicUnsupportedError": "ascend_mepic.core.errors",
    # ascend_mepic/core/plan.py: a step MEPIC does not run (a KV connector set on a scheduler)
    "StepPlanError": "ascend_mepic.core.plan",
}


def load_expectations(path: Path = EXPECTATIONS) -> list[Group]:
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    groups = []
    for kind in ("refused", "not_applicable"):
        for name, g in data.get(kind, {}).items():
            unknown = set(g) - {"reason", "tests", "policies", "error", "match"}
            if unknown or not g.get("reason") or not g.get("tests"):
                raise ValueError(f"{path}: [{kind}.{name}] needs reason and tests, got {sorted(g)}")
            policies = tuple(g.get("policies", POLICIES))
            if set(policies) - set(POLICIES):
                raise ValueError(f"{path}: [{kind}.{name}] policies must be among {POLICIES}")
            if kind == "refused" and (g.get("error") not in REFUSAL_ERRORS or not g.get("match")):
                raise ValueError(
                    f"{path}: [refused.{name}] needs error (one of {sorted(REFUSAL_ERRORS)}) "
                    "and match"
                )
            groups.append(
                Group(kind, name, g["reason"], tuple(g["tests"]), policies,
                      g.get("error", ""), g.get("match", ""))
            )
    return groups


def _error_class(name: str) -> type:
    module = __import__(REFUSAL_ERRORS[name], fromlist=[name])
    return getattr(module, name)


# -- pytest hooks --------------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("mepic", "MEPIC substituted into vLLM's core tests")
    group.addoption("--mepic-policy", default="default", choices=POLICIES,
                    help="MEPIC policy of the substituted classes (default: MEPIC's default)")
    group.addoption("--mepic-strict", action="store_true",
                    help="fail when an expectation names no collected test")
    group.addoption("--mepic-report", default=None,
                    help="write each test's outcome class to this JSON file")


def pytest_configure(config: pytest.Config) -> None:
    _state["policy"] = config.getoption("--mepic-policy")
    groups = [g for g in load_expectations() if _state["policy"] in g.policies]
    _state["groups"] = groups
    _state["outcomes"] = {}
    _state["errors"] = {}
    _state["used"] = Counter()


def pytest_report_header(config: pytest.Config) -> list[str]:
    import vllm

    import ascend_mepic

    return [
        f"MEPIC substituted: policy {_state['policy']} (additional_config mepic = "
        f"{mepic_options(_state['policy'])}), ascend_mepic from "
        f"{Path(ascend_mepic.__file__).parent}",
        f"vLLM {vllm.__version__} from {Path(vllm.__file__).parent}",
    ]


def _group_of(nodeid: str) -> Group | None:
    found = [g for g in _state["groups"] if g.matches(nodeid)]
    if len(found) > 1:
        raise pytest.UsageError(f"{nodeid} is in more than one expectation group: {found}")
    return found[0] if found else None


def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    substitute_in_test_modules()
    for item in items:
        group = _group_of(item.nodeid)
        if group is not None:
            item.stash[_GROUP] = group
            _state["used"][group.name] += 1
    if config.getoption("--mepic-strict"):
        unused = [
            f"[{g.kind}.{g.name}] {pattern}"
            for g in _state["groups"]
            for pattern in g.tests
            if not any(pattern_matches(pattern, i.nodeid) for i in items)
        ]
        if unused:
            raise pytest.UsageError(
                "expectations naming no collected test (remove them):\n  " + "\n  ".join(unused)
            )


_GROUP = pytest.StashKey[Group]()


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures are set up
def pytest_runtest_setup(item: pytest.Item) -> None:
    substitute_in_test_modules()  # modules first imported by an earlier test
    _state["constructed"] = False
    group = item.stash.get(_GROUP, None)
    if group is not None and group.kind == "not_applicable":
        pytest.skip(f"not applicable here ({group.name}): {group.reason}")


def _refused_as_expected(group: Group, excinfo: pytest.ExceptionInfo[BaseException]) -> bool:
    return isinstance(excinfo.value, _error_class(group.error)) and group.match in str(
        excinfo.value
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    group = item.stash.get(_GROUP, None)
    outcomes = _state["outcomes"]
    if report.failed and call.excinfo is not None:  # for --mepic-report: why it failed
        _state["errors"].setdefault(
            item.nodeid, f"{call.excinfo.typename}: {str(call.excinfo.value)[:400]}"
        )
    if report.when == "setup" and report.skipped:
        na = group is not None and group.kind == "not_applicable"
        outcomes[item.nodeid] = f"not applicable: {group.name}" if na else "skipped by vLLM"
        return report
    refused = group is not None and group.kind == "refused"
    if refused and report.when in ("setup", "call"):
        if report.failed and call.excinfo is not None and _refused_as_expected(group, call.excinfo):
            report.outcome = "skipped"
            report.wasxfail = f"expected refusal ({group.name}): {group.reason}"
            outcomes[item.nodeid] = f"expected refusal: {group.name}"
            return report
        if report.failed:
            report.longrepr = (
                f"expected MEPIC to refuse this test with {group.error} ({group.match!r}), "
                f"group {group.name}; it failed otherwise:\n{report.longrepr}"
            )
            outcomes[item.nodeid] = "failed"
            return report
        if report.when == "call" and report.passed:
            report.outcome = "failed"
            report.longrepr = (
                f"expected MEPIC to refuse this test with {group.error} ({group.match!r}), "
                f"group {group.name}, but it passed: update tests/vllm_core/expectations.toml"
            )
            outcomes[item.nodeid] = "failed: refusal expected"
            return report
    if report.when == "call":
        if report.passed:
            how = "MEPIC's classes" if _state["constructed"] else "no MEPIC class"
            outcomes[item.nodeid] = f"passed ({how})"
        elif report.skipped:
            outcomes[item.nodeid] = "skipped by vLLM"
        else:
            outcomes[item.nodeid] = "failed"
    elif report.failed:
        outcomes[item.nodeid] = "failed"
    return report


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    outcomes: dict[str, str] = _state.get("outcomes", {})
    counts = Counter(outcomes.values())
    write = terminalreporter.write_line
    write("")
    write(f"== MEPIC substituted, policy {_state['policy']}: outcomes of vLLM's tests ==")
    for line in pytest_report_header(config):  # also under -q, which hides the header
        write(f"  {line}")
    for outcome, n in sorted(counts.items()):
        write(f"  {n:4d}  {outcome}")
    path = config.getoption("--mepic-report")
    if path:
        Path(path).write_text(
            json.dumps({"policy": _state["policy"], "outcomes": outcomes,
                        "errors": _state["errors"]}, indent=1,
                       sort_keys=True),
            encoding="utf-8",
        )
