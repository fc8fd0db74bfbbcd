"""Engine hosts: long-lived ``tests/engine_runner.py --serve`` processes that run engine jobs.

An engine start on CPU is mostly torch's and vLLM's imports; a host pays them once per test
process (each pytest-xdist worker has its own hosts) and then builds a fresh ``LLM`` per job.
Hosts are keyed by whether the job turns MEPIC on and by the environment the job needs, so a
stock engine never runs in a process where MEPIC registered its backend and ops, and a job that
needs other environment variables gets a process started with them.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUNNER = Path(__file__).with_name("engine_runner.py")
BASE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}
JOB_TIMEOUT_S = 600


class EngineJobError(AssertionError):
    """A job failed in its host: the message carries the host's traceback and log tail."""


class EngineHost:
    """One ``engine_runner.py --serve`` process; ``run`` sends a job and waits for its answer."""

    def __init__(self, env: dict[str, str]) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix="engine-host-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, str(RUNNER), "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,  # a file: vLLM logs a lot, and a full pipe would block the host
            text=True,
            env=env,
        )
        self.jobs = 0

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, job: dict, timeout: float = JOB_TIMEOUT_S) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        self.jobs += 1
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while True:
                if not sel.select(max(0.0, deadline - time.monotonic())):
                    log = self.tail()
                    self.close()
                    raise EngineJobError(f"engine job timed out after {timeout} s\n{log}")
                line = self.proc.stdout.readline()
                if not line:
                    raise EngineJobError(f"engine host exited ({self.proc.wait()})\n{self.tail()}")
                if line.startswith("RESULT"):
                    answer = json.loads(line[len("RESULT") :])
                    break
        if "error" in answer:
            log = self.tail()  # before close() removes the log
            self.close()
            raise EngineJobError(f"{answer['error']}\n{log}")
        return answer["result"]

    def tail(self, chars: int = 4000) -> str:
        return Path(self.log.name).read_text(errors="replace")[-chars:]

    def close(self) -> None:
        if self.alive():
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)  # closed once after a failed job, once at exit


def encode(segments) -> dict:
    """A request of a job: its segments as ``[kind, token ids]`` pairs."""
    return {"segments": [[s.kind.value, list(s.token_ids)] for s in segments]}


_HOSTS: dict[tuple, EngineHost] = {}


def run_engine(job: dict, **env_overrides: str) -> dict:
    """Run ``job`` (see ``engine_runner.py``) on a fresh engine in this process's host for its
    kind and environment; the host is started on first use and kept until the process exits.

    A job whose engine core runs in its own process (``VLLM_ENABLE_V1_MULTIPROCESSING=1``) runs
    in a one-shot ``engine_runner.py`` process instead: started from a host, such an engine
    stalled in 2 of 6 runs on 2 cores (its engine core gone, neither the host nor the test
    reading anything); started from a fresh process it never did."""
    if env_overrides.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "1":
        return run_engine_once(job, **env_overrides)
    # An override the environment already has (make test exports VLLM_CPU_OMP_THREADS_BIND)
    # needs no host of its own: each host costs vLLM's imports again.
    base = dict(os.environ, **BASE_ENV)
    env_overrides = {k: v for k, v in env_overrides.items() if base.get(k) != v}
    key = (bool(job["mepic"]), tuple(sorted(env_overrides.items())))
    host = _HOSTS.get(key)
    if host is None or not host.alive():
        env = dict(os.environ, **BASE_ENV, PYTHONPATH=str(RUNNER.parent.parent))
        env.update(env_overrides)
        host = _HOSTS[key] = EngineHost(env)
    return host.run(job)


def run_engine_once(job: dict, **env_overrides: str) -> dict:
    """Run ``job`` in a fresh ``engine_runner.py`` process that exits after it."""
    env = dict(os.environ, **BASE_ENV, PYTHONPATH=str(RUNNER.parent.parent))
    env.update(env_overrides)
    with tempfile.TemporaryFile("w+") as log:
        done = subprocess.run(
            [sys.executable, str(RUNNER), json.dumps(job)],
            stdout=subprocess.PIPE, stderr=log, text=True, env=env, timeout=JOB_TIMEOUT_S,
        )  # fmt: skip
        if done.returncode != 0:
            log.seek(0)
            raise EngineJobError(f"engine job exited {done.returncode}\n{log.read()[-4000:]}")
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT")]
    if not lines:
        raise EngineJobError(f"engine job printed no RESULT line:\n{done.stdout[-2000:]}")
    return json.loads(lines[-1][len("RESULT") :])


@atexit.register
def close_all() -> None:
    while _HOSTS:
        _HOSTS.popitem()[1].close()
