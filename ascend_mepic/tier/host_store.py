"""Off-pool canonical chunk KV for private-placement policies (the baselines' chunk store).

EPIC, CacheBlend and CacheTune keep a chunk's precomputed KV outside the device KV pool and copy
it into request-private blocks per request. This store is that place: the worker saves a chunk's
compiled blocks here right after the forward pass that computed them, and copies them into a
request's blocks when the request is first scheduled; the scheduler only asks whether a chunk is
stored (and, for CacheTune, its token scores).

vLLM's CPU engine runs its worker in another process than the scheduler, so a stored chunk is also
a file in a host-memory directory (``/dev/shm`` where it exists): ``<chunk id>.json`` (token count
and scores) then ``<chunk id>.pt`` (the KV), each written to a temporary name and renamed, so the
``.pt`` file appearing is the commit. Each process keeps what it read in memory. The directory is
per engine instance and removed when the engine process exits. The LMCache tier is meant to
implement the same calls.

Nothing is left behind: the owning process removes the directory at exit (``atexit``, and the
multiprocessing finalizers for a forked child such as vLLM's engine core, which ends in
``os._exit``), and on SIGTERM/SIGINT/SIGHUP that would kill it outright; it records its pid in the
directory, so a directory whose owner was killed (SIGKILL) is removed by the next owner to start
beside it.
"""

from __future__ import annotations

import atexit
import json
import multiprocessing.util
import os
import shutil
import signal
import socket
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ascend_mepic.core.identity import ChunkId
from ascend_mepic.host import process_alive, process_start_time


@dataclass
class StoredChunk:
    kv: Any  # worker-side tensor [num_layers, num_blocks, *block_shape]
    num_tokens: int
    scores: list[float] | None = None  # CacheTune token scores, when asked for


@dataclass
class StoreStats:
    stored: int = 0
    loads: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0


@dataclass
class HostChunkStore:
    root: Path
    chunks: dict[ChunkId, StoredChunk] = field(default_factory=dict)
    stats: StoreStats = field(default_factory=StoreStats)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _path(self, chunk_id: ChunkId, suffix: str) -> Path:
        return self.root / f"{chunk_id}{suffix}"

    def put(self, chunk_id: ChunkId, chunk: StoredChunk) -> None:
        import torch

        with self._lock:
            self.chunks[chunk_id] = chunk
            self.stats.stored += 1
            self.stats.bytes_stored += _nbytes(chunk.kv)
        meta = {"num_tokens": chunk.num_tokens, "scores": chunk.scores}
        _atomic_write(self._path(chunk_id, ".json"), lambda f: f.write(json.dumps(meta).encode()))
        _atomic_write(self._path(chunk_id, ".pt"), lambda f: torch.save(chunk.kv, f))

    def contains(self, chunk_id: ChunkId) -> bool:
        return chunk_id in self.chunks or self._path(chunk_id, ".pt").exists()

    def get(self, chunk_id: ChunkId) -> StoredChunk | None:
        chunk = self.chunks.get(chunk_id)
        if chunk is not None or not self.contains(chunk_id):
            return chunk
        import torch

        meta = json.loads(self._path(chunk_id, ".json").read_text())
        kv = torch.load(self._path(chunk_id, ".pt"), map_location="cpu", weights_only=True)
        chunk = StoredChunk(kv, meta["num_tokens"], meta["scores"])
        self.chunks[chunk_id] = chunk
        return chunk

    def scores(self, chunk_id: ChunkId) -> list[float] | None:
        chunk = self.chunks.get(chunk_id)
        if chunk is not None:
            return chunk.scores
        path = self._path(chunk_id, ".json")
        return json.loads(path.read_text())["scores"] if path.exists() else None

    def record_load(self, chunk: StoredChunk, fraction: float = 1.0) -> None:
        self.stats.loads += 1
        self.stats.bytes_loaded += int(_nbytes(chunk.kv) * fraction)

    def num_chunks(self) -> int:
        return len(list(self.root.glob("*.pt")))


def _atomic_write(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _nbytes(kv: Any) -> int:
    return int(kv.numel() * kv.element_size()) if hasattr(kv, "numel") else 0


def default_root(instance_id: str) -> Path:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"ascend_mepic-store-{os.getuid()}-{instance_id}"


_STORES: dict[Path, HostChunkStore] = {}
_OWNED: dict[Path, int] = {}  # owned store directory -> the owning process's pid
OWNER_MARKER = ".ascend_mepic-owner"  # in an owned directory: who owns it (JSON)
_EXIT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")
_PREV_HANDLERS: dict[int, Any] = {}
_cleanup_pid: int | None = None  # the process whose exit hooks are registered


def host_store(root: str | Path, owner: bool = False) -> HostChunkStore:
    """The store at ``root`` (one object per process); ``owner`` removes it at process exit.

    Ownership is registered even when the store object already exists: with an in-process
    engine the worker (non-owner) opens it before the scheduler (owner) does. Claiming ownership
    first removes stale store directories beside ``root`` (owners that are gone).
    """
    path = Path(root)
    if owner and _OWNED.get(path) != os.getpid():
        sweep_stale_stores(path.parent)
        path.mkdir(parents=True, exist_ok=True)
        _write_owner_marker(path)
        _OWNED[path] = os.getpid()
        _install_cleanup()
    store = _STORES.get(path)
    if store is None:
        path.mkdir(parents=True, exist_ok=True)
        store = _STORES[path] = HostChunkStore(path)
    return store


def _remove_owned() -> None:
    """Remove the store directories this process owns (not those a forked parent owns)."""
    pid = os.getpid()
    for path, owner_pid in list(_OWNED.items()):
        if owner_pid == pid:
            shutil.rmtree(path, ignore_errors=True)
            _OWNED.pop(path, None)


def _install_cleanup() -> None:
    global _cleanup_pid
    if _cleanup_pid != os.getpid():
        _cleanup_pid = os.getpid()
        atexit.register(_remove_owned)
        # A forked multiprocessing child ends in os._exit: atexit does not run, these do.
        multiprocessing.util.Finalize(None, _remove_owned, exitpriority=0)
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set there; the exit hooks above still run
    for name in _EXIT_SIGNALS:
        signum = getattr(signal, name, None)
        if signum is None:
            continue
        try:
            current = signal.getsignal(signum)
            # Ignored stays ignored (and inherited by children); None: set outside Python.
            if current is _on_exit_signal or current is None or current == signal.SIG_IGN:
                continue
            signal.signal(signum, _on_exit_signal)
        except (ValueError, OSError):
            continue
        _PREV_HANDLERS[signum] = current


def _on_exit_signal(signum: int, frame: Any) -> None:
    """Chain to the handler this one replaced; where that is the default, clean up first.

    A Python handler raises (KeyboardInterrupt, SystemExit) or asks for a graceful stop, and
    the exit that follows runs the exit hooks, while a process that goes on keeps its store. The
    default action kills the process without them, so the store is removed here, then the
    signal is sent again with the default action restored.
    """
    prev = _PREV_HANDLERS.get(signum, signal.SIG_DFL)
    if callable(prev):
        prev(signum, frame)
        return
    _remove_owned()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _owner_record(pid: int) -> dict[str, Any]:
    return {
        "pid": pid,
        "started": process_start_time(pid),
        "host": socket.gethostname(),
        "pid_ns": _pid_namespace(),
    }


def _write_owner_marker(path: Path) -> None:
    record = json.dumps(_owner_record(os.getpid())).encode()
    _atomic_write(path / OWNER_MARKER, lambda f: f.write(record))


def _owner_alive(record: Any) -> bool:
    """Whether a marker's owner may still run; True whenever that cannot be told for sure."""
    if not isinstance(record, dict):
        return True
    pid = record.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return True
    # Another host or PID namespace (a container sharing /dev/shm): its pids are not ours.
    if record.get("host") != socket.gethostname() or record.get("pid_ns") != _pid_namespace():
        return True
    started = record.get("started")  # absent in markers older than this field: not compared
    return process_alive(pid, started if isinstance(started, float) else None)


def sweep_stale_stores(parent: str | Path) -> list[Path]:
    """Remove this user's store directories under ``parent`` whose owner process is gone.

    Only directories with an owner marker count (a store nobody claimed is left alone), so a
    shared parent such as /dev/shm is safe to sweep. Returns the directories removed.
    """
    removed: list[Path] = []
    try:
        entries = list(Path(parent).iterdir())
    except OSError:
        return removed
    for entry in entries:
        try:
            if entry.is_symlink() or not entry.is_dir() or entry.stat().st_uid != os.getuid():
                continue
            record = json.loads((entry / OWNER_MARKER).read_text())
        except (OSError, ValueError):
            continue
        if not _owner_alive(record):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed
