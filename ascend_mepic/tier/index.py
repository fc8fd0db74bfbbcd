"""The off-device chunk tier: canonical chunk KV kept in LMCache's storage backends.

Device memory holds the hot chunks; the tier holds every chunk ever compiled (write-through: the
worker offloads a chunk's canonical blocks right after the step that compiled it), so a chunk
evicted from the KV pool, or computed before a restart or by another server, is loaded instead of
compiled. The storage is LMCache's own ``StorageManager`` and backends, keyed by chunk identity
(which already covers tokens, model, dtype, block size and the tenant's cache salt):

* ``cpu_gib``: LMCache's local CPU backend (hot, per worker process);
* ``disk``: a directory, served by LMCache's ``fs://`` connector. LMCache 0.5.6's local disk
  backend keeps its index in process memory and forgets its files on restart, so the persistent
  tier (warm restart, several servers on one host) uses the ``fs`` connector instead;
* ``remote``: any LMCache remote URL, e.g. ``redis://127.0.0.1:6379``: several servers share it.

A shared backend (``disk``, ``remote``) needs a tier key (``key_file`` / ``key_env``) that seals
and authenticates its entries (``sealing.py``), or the explicit ``unauthenticated`` opt-out.

This module is the scheduling side (no tensors): the tier's configuration, LMCache keys, and
:class:`TierIndex`, which answers "is this chunk in the tier, and should it be loaded?". The
worker side (``worker/tier_io.py``) moves and verifies the KV. The two run in different processes;
they meet in a small directory (``<store root>/tier``): the worker writes a marker per chunk it
put into its CPU backend, each load's verified result, and its measured costs and counters.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, Strict, model_validator
from pydantic.dataclasses import dataclass as options_dataclass

from ascend_mepic.core.identity import ChunkId
from ascend_mepic.core.options import OPTIONS, build
from ascend_mepic.tier.sealing import MAKE_KEY, Keyring

logger = logging.getLogger(__name__)

CPU_BACKEND = "LocalCPUBackend"
SHARED_BACKEND = "RemoteBackend"  # LMCache's name for the fs:// or redis:// backend


@options_dataclass(frozen=True, config=OPTIONS)
class TierConfig:
    """``{"mepic": {"tier": {...}}}``; an empty or absent ``tier`` turns the tier off.

    Validated by pydantic when built, as vLLM's own configs are: an unknown key, a wrong type
    or an out-of-range value fails naming the field (``config.MepicConfig`` nests this).
    """

    enabled: Annotated[bool, Strict(), Field(description="set by giving a non-empty `tier`")] = (
        False
    )
    cpu_gib: Annotated[
        float,
        Strict(),
        Field(gt=0, description="LMCache's local CPU backend, per worker process (GiB)"),
    ] = 0.5
    disk: Annotated[
        str,
        Strict(),
        Field(
            description=(
                "a directory served by LMCache's `fs://` connector (persistent; shared, so it "
                "needs a key)"
            )
        ),
    ] = ""
    remote: Annotated[
        str,
        Strict(),
        Field(
            description=(
                "an LMCache remote URL shared by servers (needs a key): `redis://host:port`, "
                "`rediss://user:${PASSWORD_VAR}@host:port` (`${VAR}`: read from the environment)"
            )
        ),
    ] = ""
    offload: Annotated[
        Literal["compile"], Field(description="when chunks are written to the tier")
    ] = "compile"
    load: Annotated[
        Literal["auto", "always", "never"],
        Field(description="load from the tier: by measured costs, always, or never"),
    ] = "auto"
    lmcache: Annotated[dict[str, Any], Field(description="extra LMCache config keys")] = field(
        default_factory=dict
    )
    key_file: Annotated[
        str,
        Strict(),
        Field(
            description=(
                "a file of tier keys (64 hex characters each, one a line; the first seals new "
                "entries, all open them); servers sharing a tier share it"
            )
        ),
    ] = ""
    key_env: Annotated[
        str,
        Strict(),
        Field(description="the name of an environment variable holding tier keys (not a key)"),
    ] = ""
    unauthenticated: Annotated[
        bool,
        Strict(),
        Field(
            description=(
                "run a shared tier (`disk`, `remote`) without a key: whoever can write it can "
                "make servers answer from forged KV, whoever can read it reads every tenant's KV"
            )
        ),
    ] = False

    @model_validator(mode="after")
    def _one_shared_backend(self) -> TierConfig:
        if self.disk and self.remote:
            raise ValueError(
                "LMCache 0.5.6 serves one remote backend per engine: give tier.disk or "
                "tier.remote, not both"
            )
        return self

    @model_validator(mode="after")
    def _shared_tier_is_keyed(self) -> TierConfig:
        """A tier other processes can write must be keyed, unless the operator opts out."""
        keyed = bool(self.key_file or self.key_env)
        if keyed and self.unauthenticated:
            raise ValueError("tier: give a key (key_file, key_env) or unauthenticated, not both")
        shared = self.disk or self.remote or self.lmcache.get("remote_url")
        if shared and not keyed and not self.unauthenticated:
            raise ValueError(
                "a shared tier (disk, remote) needs a key that the servers sharing it share, so "
                "that no one who can write it can make them answer from forged KV: make one with "
                f"`{MAKE_KEY}` and give `\"key_file\": \"/path/to/tier.key\"` (or `key_env`: the "
                'name of an environment variable holding it), or set `"unauthenticated": true` '
                "to accept that risk"
            )
        self.keyring()  # a missing or malformed key fails here, when the config is built
        return self

    def keyring(self, warn: bool = False) -> Keyring | None:
        """The configured tier keys (read from ``key_file`` / ``key_env`` at each call)."""
        return Keyring.load(self.key_file, self.key_env, warn=warn)

    @classmethod
    def parse(cls, raw: Any) -> TierConfig:
        if isinstance(raw, cls):
            return raw
        if not raw:
            return cls()
        if not isinstance(raw, dict):
            raise ValueError(f'MEPIC "tier" must be an object, got {raw!r}')
        return build(cls, {"enabled": True, **raw}, prefix="MEPIC tier")

    @property
    def shared_url(self) -> str:
        """The LMCache remote URL of the backend other processes and restarts can see."""
        if self.disk:
            return f"fs://localhost:0/{os.path.abspath(self.disk).lstrip('/')}"
        return self.remote

    def lmcache_dict(self, store_in_cpu: bool) -> dict[str, Any]:
        config: dict[str, Any] = {
            "chunk_size": 256,
            "local_cpu": store_in_cpu,
            "max_local_cpu_size": self.cpu_gib if store_in_cpu else 0.01,
            "remote_serde": "naive",
            "save_unfull_chunk": True,
        }
        if self.remote:
            # ``${VAR}`` (a Redis password) is expanded here only: vLLM logs the config with
            # the placeholder, not the secret.
            config["remote_url"] = os.path.expandvars(self.remote)
        elif self.disk:
            config["remote_url"] = self.shared_url
        config.update(self.lmcache)
        return config


def open_lmcache(config: TierConfig, model_name: str, store_in_cpu: bool) -> Any:
    """An LMCache ``StorageManager`` with the configured backends (imports LMCache lazily)."""
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    import torch
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.storage_manager import StorageManager

    metadata = LMCacheMetadata(
        model_name=model_name,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.uint8,  # entries are self-describing byte blobs (see worker/tier_io.py)
        kv_shape=(1, 2, 256, 1, 1),
        role="worker",  # LMCache's "scheduler" role cannot open remote backends in 0.5.6
    )
    if config.disk:
        private_dir(Path(config.disk))
    engine_config = LMCacheEngineConfig.from_dict(config.lmcache_dict(store_in_cpu))
    # LMCache starts non-daemon threads (event loop, backends) that would keep an engine process
    # alive after it failed or finished; threads inherit daemon status from their creator, so
    # the manager is built in a daemon thread.
    built: list[Any] = []

    def build() -> None:
        try:
            built.append(StorageManager(engine_config, metadata, EventManager()))
        except BaseException as e:  # re-raised in the caller
            built.append(e)

    thread = threading.Thread(target=build, daemon=True, name="mepic-lmcache-open")
    thread.start()
    thread.join()
    if isinstance(built[0], BaseException):
        raise built[0]
    return built[0]


def close_lmcache(manager: Any, timeout_s: float = 5.0) -> None:
    """Close without hanging the process on a dead remote (LMCache may block in close)."""
    thread = threading.Thread(target=manager.close, daemon=True, name="mepic-lmcache-close")
    thread.start()
    thread.join(timeout_s)


def lmcache_key(chunk_id: ChunkId, namespace: str) -> Any:
    """The LMCache key of a chunk: its identity digest as LMCache's chunk hash."""
    import torch
    from lmcache.utils import CacheEngineKey

    return CacheEngineKey(namespace, 1, 0, int(chunk_id[:32], 16), torch.uint8)


# Bump when the entry format changes. v2: sealed entries (format 3); v1's unsealed entries are
# then misses, not refusals an operator would take for forgeries after the upgrade.
TIER_NAMESPACE = "ascend-mepic-v2"


def private_dir(path: Path) -> Path:
    """Create ``path`` private to this user (0o700; missing parents get the default mode): a
    tier directory holds chunk KV or its bookkeeping. One that exists keeps its mode (the
    operator's choice, e.g. a group of servers sharing a disk tier)."""
    if not path.is_dir():
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.chmod(0o700)  # mkdir's mode is filtered by the umask
    return path


def _atomic_json(path: Path, payload: Any) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(payload, f)
    os.replace(tmp, path)


@dataclass
class TierDir:
    """The directory the scheduler and worker processes share for the tier's bookkeeping."""

    root: Path

    def __post_init__(self) -> None:
        private_dir(self.root)
        (self.root / "markers").mkdir(mode=0o700, exist_ok=True)
        (self.root / "results").mkdir(mode=0o700, exist_ok=True)

    def marker(self, chunk_id: ChunkId) -> Path:
        return self.root / "markers" / chunk_id

    def result(self, io_id: str) -> Path:
        return self.root / "results" / f"{io_id}.json"

    def write_result(self, io_id: str, outcome: dict[ChunkId, str]) -> None:
        _atomic_json(self.result(io_id), outcome)

    def take_result(self, io_id: str) -> dict[ChunkId, str] | None:
        path = self.result(io_id)
        try:
            outcome = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        path.unlink(missing_ok=True)
        return outcome

    @property
    def worker_file(self) -> Path:
        return self.root / "worker.json"

    def write_worker(self, payload: dict[str, Any]) -> None:
        _atomic_json(self.worker_file, payload)

    def read_worker(self) -> dict[str, Any]:
        try:
            return json.loads(self.worker_file.read_text())
        except (OSError, ValueError):
            return {}


def choose_load(load_s_per_token: float | None, compute_s_per_token: float | None) -> bool:
    """Load a chunk from the tier rather than compile it?

    CacheTune's section 4.3 sets the recompute share to r0 = t_i / (t_c + t_i) from the
    per-token transfer (t_i) and compute (t_c) costs. A MEPIC chunk is either loaded whole or
    compiled whole (its private tokens are recomputed in context either way), so the decision is
    r0 < 1/2, i.e. t_i < t_c. Until both costs are measured the tier is used (loading has been
    cheaper on every host measured; see the README).
    """
    if load_s_per_token is None or compute_s_per_token is None:
        return True
    return load_s_per_token < compute_s_per_token


def recompute_share(load_s_per_token: float | None, compute_s_per_token: float | None) -> float:
    """CacheTune's prior r0 = t_i / (t_c + t_i) (0.0 while a cost is unmeasured)."""
    if not load_s_per_token or not compute_s_per_token:
        return 0.0
    return load_s_per_token / (compute_s_per_token + load_s_per_token)


class TierIndex:
    """The scheduler's view of the tier: which chunks it holds, and whether to load them.

    A chunk is in the tier if this engine's worker put it into its CPU backend (a marker file) or
    the shared backend (disk / remote) has it. The answer can be stale (LMCache's CPU backend
    evicts on its own, a remote can die): every load is verified by the worker before any request
    uses the blocks, and a failed load falls back to compiling.
    """

    def __init__(self, config: TierConfig, root: Path, model_name: str) -> None:
        self.config = config
        self.dir = TierDir(root)
        self.model_name = model_name
        self._shared = open_lmcache(config, model_name, False) if config.shared_url else None
        self.failed: set[ChunkId] = set()  # loads that failed: compile these from now on
        self._worker_cache: tuple[float, dict[str, Any]] = (0.0, {})

    def where(self, chunk_id: ChunkId) -> str | None:
        """The backend expected to hold the chunk (CPU_BACKEND or SHARED_BACKEND), or None."""
        if self.config.load == "never" or chunk_id in self.failed:
            return None
        if self.dir.marker(chunk_id).exists():
            return CPU_BACKEND
        if self._shared is None:
            return None
        try:
            found = self._shared.contains(lmcache_key(chunk_id, TIER_NAMESPACE))
        except Exception as e:  # a dead remote: serve on, compile instead
            logger.warning("MEPIC tier lookup failed (%s); compiling instead", e)
            return None
        return SHARED_BACKEND if found else None

    def worker_state(self) -> dict[str, Any]:
        """The worker's measured costs and counters (re-read at most every 0.2 s)."""
        at, state = self._worker_cache
        if time.monotonic() - at > 0.2:
            state = self.dir.read_worker()
            self._worker_cache = (time.monotonic(), state)
        return state

    def should_load(self, backend: str) -> bool:
        if self.config.load == "always":
            return True
        state = self.worker_state()
        costs = state.get("load_s_per_token", {})
        return choose_load(costs.get(backend), state.get("compute_s_per_token"))

    def close(self) -> None:
        if self._shared is not None:
            close_lmcache(self._shared)
            self._shared = None
