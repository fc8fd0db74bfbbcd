"""A MEPIC cluster on one machine: N ``ascend-mepic serve`` replicas and the ``route`` front,
each its own process on loopback (the cluster benchmark, the fault tests, a try-out).

Each replica's engine gets its own CPU cores (``VLLM_CPU_OMP_THREADS_BIND``, an even split of
this process's CPUs): vLLM's automatic binding puts every engine on the same cores, and two
engines' OpenMP threads spinning on one core starve each other (one replica's requests stall
while another works). With fewer CPUs than replicas nothing is
bound and each engine runs one thread.

Every replica publishes its KV events with a replay endpoint (``tcp://*:PORT``: vLLM's publisher
binds a wildcard endpoint, and Dynamo's indexer connects to it); the front starts Dynamo's
indexer and registers the replicas as they become healthy.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen | None, sig: int = signal.SIGTERM, timeout: float = 30) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=timeout)
    except ProcessLookupError:
        pass


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not healthy in {timeout_s} s:\n{log.read_text()[-3000:]}")


@dataclass
class LocalReplica:
    """One ``ascend-mepic serve`` process with its ports."""

    index: int
    port: int = field(default_factory=free_port)
    events_port: int = field(default_factory=free_port)
    replay_port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    log: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def spec(self) -> str:
        """Its ``--replica`` argument for ``ascend-mepic route``."""
        return f"{self.url}=tcp://127.0.0.1:{self.events_port},tcp://127.0.0.1:{self.replay_port}"

    def kv_events_config(self) -> str:
        return json.dumps(
            {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{self.events_port}",
                "replay_endpoint": f"tcp://*:{self.replay_port}",
                "topic": "kv",
            }
        )


class LocalCluster:
    """Start, kill and restart replicas; start the front with a policy."""

    def __init__(
        self,
        model: str,
        num_replicas: int,
        workdir: Path,
        serve_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 300,
    ) -> None:
        self.model = model
        self.serve_args = list(serve_args)
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ, HF_HUB_OFFLINE="1", **(env or {}))
        self.env.pop("VLLM_PLUGINS", None)
        self.env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        self.startup_timeout_s = startup_timeout_s
        self.replicas = [LocalReplica(i) for i in range(num_replicas)]
        self.front: subprocess.Popen | None = None
        self.front_port = 0
        self.indexer_url: str | None = None
        self._front_log: Path | None = None

    def _cpu_env(self, r: LocalReplica) -> dict[str, str]:
        cpus = sorted(os.sched_getaffinity(0))
        n = len(self.replicas)
        env = {"OMP_WAIT_POLICY": "PASSIVE"}
        if len(cpus) < n:
            return env | {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
        share = len(cpus) // n
        mine = cpus[r.index * share : (r.index + 1) * share]
        return env | {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, mine))}

    def _launch(self, r: LocalReplica) -> None:
        cmd = [
            sys.executable, "-m", "ascend_mepic.entrypoints.cli", "serve", self.model,
            "--host", "127.0.0.1", "--port", str(r.port),
            "--kv-events-config", r.kv_events_config(), *self.serve_args,
        ]  # fmt: skip
        r.log = self.workdir / f"replica{r.index}.log"
        with open(r.log, "ab") as log:
            env = self.env | self._cpu_env(r)
            r.proc = subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def start(self, indices: Sequence[int] | None = None) -> None:
        """Start replicas (all by default) side by side and wait until each is healthy."""
        chosen = [self.replicas[i] for i in (indices or range(len(self.replicas)))]
        for r in chosen:
            self._launch(r)
        for r in chosen:
            _wait_healthy(r.url, r.proc, r.log, self.startup_timeout_s)

    def kill(self, index: int) -> None:
        """SIGKILL a replica (a crash: no drain, no goodbye)."""
        _stop(self.replicas[index].proc, signal.SIGKILL)

    def start_front(
        self, policy: str, tokenizer: str, block_size: int, extra: Sequence[str] = ()
    ) -> str:
        self.stop_front()
        self.front_port = free_port()
        cmd = [
            sys.executable, "-m", "ascend_mepic.entrypoints.cli", "route",
            "--policy", policy, "--tokenizer", tokenizer, "--block-size", str(block_size),
            "--port", str(self.front_port), *extra,
        ]  # fmt: skip
        for r in self.replicas:
            cmd += ["--replica", r.spec]
        self.indexer_url = None
        if policy != "round_robin":
            port = free_port()
            cmd += ["--start-indexer", str(port)]
            self.indexer_url = f"http://127.0.0.1:{port}"
        self._front_log = self.workdir / f"front-{policy}.log"
        with open(self._front_log, "ab") as log:
            self.front = subprocess.Popen(
                cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        url = f"http://127.0.0.1:{self.front_port}"
        _wait_healthy(url, self.front, self._front_log, 120)
        return url

    def stop_front(self) -> None:
        _stop(self.front)
        self.front = None

    def stop(self) -> None:
        self.stop_front()
        for r in self.replicas:
            _stop(r.proc)
