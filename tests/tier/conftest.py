"""The tier tests' Redis (a real ``redis-server`` on a free port, killed afterwards) and tier
keys (files in a temporary folder)."""

from __future__ import annotations

import secrets
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest


def write_key_file(path: Path, *keys: str) -> str:
    """A tier key file holding ``keys`` (one fresh key if none), private to this user."""
    path.write_text("".join(k + "\n" for k in keys or (secrets.token_hex(32),)))
    path.chmod(0o600)
    return str(path)


@pytest.fixture
def tier_key(tmp_path) -> str:
    """The path of a fresh tier key file: the key that servers sharing a test's tier share."""
    return write_key_file(tmp_path / "tier.key")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def redis_url(tmp_path):
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server)")
    port = _free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.1)
    yield proc, f"redis://127.0.0.1:{port}"
    proc.kill()
    proc.wait()
