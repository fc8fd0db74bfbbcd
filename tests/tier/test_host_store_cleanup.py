"""Host chunk stores leave nothing behind: removed on exit, on SIGTERM/SIGINT, and after SIGKILL
by the next owner that starts beside them.

Owners run in subprocesses so this process's signal handlers and exit hooks stay untouched.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ascend_mepic.tier import host_store as hs

REPO = Path(__file__).resolve().parents[2]

OWNER = """
import sys, time
from ascend_mepic.tier.host_store import host_store
{setup}
store = host_store(sys.argv[1], owner=True)
(store.root / "chunk.json").write_text("{{}}")
print(store.root, flush=True)
{after}
time.sleep(60)
"""

CLAIM = "import sys; from ascend_mepic.tier.host_store import host_store as h; h(sys.argv[1], True)"


def _start_owner(root: Path, setup: str = "", after: str = "") -> subprocess.Popen:
    code = OWNER.format(setup=setup, after=after)
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    line = proc.stdout.readline().strip()
    assert line == str(root), proc.stderr.read() if not line else line
    assert (root / "chunk.json").exists() and (root / hs.OWNER_MARKER).exists()
    return proc


def _wait(proc: subprocess.Popen) -> int:
    try:
        return proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        proc.stderr.close()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_owner_killed_by_signal_removes_its_store(tmp_path, signum):
    root = tmp_path / "store"
    # The owner gets a foreground process's SIGINT disposition: a test run started in the
    # background by a non-interactive shell passes SIGINT down ignored, and an ignored signal
    # rightly stays ignored (the store then stays until a normal exit).
    setup = "import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)"
    proc = _start_owner(root, setup=setup)
    proc.send_signal(signum)
    assert _wait(proc) == -signum  # still dies of the signal, as it would have
    assert not root.exists()


def test_python_signal_handler_is_chained_and_a_surviving_process_keeps_its_store(tmp_path):
    """A handler set before the store was claimed still runs; the process goes on, so its store
    stays until it exits."""
    root = tmp_path / "store"
    setup = "import signal\nhits = []\nsignal.signal(signal.SIGTERM, lambda s, f: hits.append(s))"
    after = (
        "while not hits:\n"
        "    time.sleep(0.01)\n"
        "assert store.root.exists()\n"
        "print('survived', flush=True)\n"
        "sys.exit(0)"
    )
    proc = _start_owner(root, setup, after)
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout.readline().strip() == "survived"
    assert _wait(proc) == 0
    assert not root.exists()  # then removed at exit


def test_forked_owner_removes_its_store_and_leaves_the_parents(tmp_path):
    """vLLM's engine core is a forked multiprocessing child, which ends in os._exit (no atexit).
    Its store goes when it exits; the parent's store (and its inherited hooks) are untouched."""
    parent_root, child_root = tmp_path / "parent", tmp_path / "child"
    code = f"""
import multiprocessing, os, time
from ascend_mepic.tier.host_store import host_store

def child():
    host_store({str(child_root)!r}, owner=True)
    assert os.path.isdir({str(child_root)!r})

host_store({str(parent_root)!r}, owner=True)
p = multiprocessing.get_context("fork").Process(target=child)
p.start(); p.join()
assert p.exitcode == 0, p.exitcode
assert not os.path.exists({str(child_root)!r}), "child store left behind"
assert os.path.isdir({str(parent_root)!r}), "the child removed its parent's store"
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)
    assert not parent_root.exists() and not child_root.exists()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _marked(path: Path, **record) -> Path:
    path.mkdir()
    (path / "chunk.pt").write_bytes(b"x")
    (path / hs.OWNER_MARKER).write_text(json.dumps(record))
    return path


def test_sweep_removes_only_stores_whose_owner_is_gone(tmp_path):
    me = hs._owner_record(os.getpid())
    dead = _marked(tmp_path / "dead", **{**me, "pid": _dead_pid(), "started": None})
    reused = _marked(tmp_path / "reused", **{**me, "started": me["started"] - 1.0})
    alive = _marked(tmp_path / "alive", **me)
    other_ns = _marked(tmp_path / "other-ns", **{**me, "pid": _dead_pid(), "pid_ns": "pid:[1]"})
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / hs.OWNER_MARKER).write_text("not json")
    unmarked = tmp_path / "unmarked"
    unmarked.mkdir()
    (tmp_path / "a-file").write_text("x")

    assert sorted(hs.sweep_stale_stores(tmp_path)) == [dead, reused]
    assert not dead.exists() and not reused.exists()
    for kept in (alive, other_ns, garbage, unmarked, tmp_path / "a-file"):
        assert kept.exists()
    assert hs.sweep_stale_stores(tmp_path / "missing") == []


def test_store_of_a_sigkilled_owner_is_swept_by_the_next_owner(tmp_path):
    old = tmp_path / "store-old"
    proc = _start_owner(old)
    proc.kill()
    assert _wait(proc) == -signal.SIGKILL
    assert old.exists()  # nothing could run in the killed process
    record = json.loads((old / hs.OWNER_MARKER).read_text())
    assert record["pid"] == proc.pid

    new = tmp_path / "store-new"
    subprocess.run([sys.executable, "-c", CLAIM, str(new)], check=True, cwd=REPO, timeout=60)
    assert not old.exists() and not new.exists()


def test_a_live_owners_store_is_not_swept(tmp_path):
    first = tmp_path / "store-1"
    proc = _start_owner(first)
    try:
        second = tmp_path / "store-2"
        subprocess.run([sys.executable, "-c", CLAIM, str(second)], check=True, cwd=REPO)
        assert (first / "chunk.json").exists()
    finally:
        proc.terminate()
        _wait(proc)
    assert not first.exists()
