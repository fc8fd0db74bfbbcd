"""Keep a command's data and its logs on separate streams.

vLLM logs to stdout by default (``VLLM_LOGGING_STREAM=ext://sys.stdout``), and torch, OpenMP and
vLLM's native code can write to file descriptor 1 directly. A command whose output is piped into
another program (``ascend-mepic trace ... > trace.jsonl``) must not carry any of that, so every
process entry point (the CLI, the benchmark scripts) calls :func:`isolate_stdout` first, before
vLLM is imported, and commands write their data only to :func:`data_stream`:

- vLLM's logging is pointed at stderr (``VLLM_LOGGING_STREAM``), and so is ours;
- file descriptor 1 is re-pointed at stderr, so anything else that writes to stdout, from Python
  or native code, in this process or in the subprocesses it starts, lands in the log stream;
- the original stdout survives as a private descriptor behind the data stream.
"""

from __future__ import annotations

import atexit
import io
import logging
import os
import sys
from pathlib import Path
from typing import TextIO

STDERR_STREAM = "ext://sys.stderr"

_data: TextIO | None = None


def route_logs_to_stderr() -> None:
    """Send vLLM's default logging (configured at its import) and ours to stderr."""
    # Only the stream of vLLM's default config: a user's VLLM_LOGGING_CONFIG_PATH is theirs.
    if os.environ.get("VLLM_LOGGING_STREAM", "ext://sys.stdout") == "ext://sys.stdout":
        os.environ["VLLM_LOGGING_STREAM"] = STDERR_STREAM
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
        )


def isolate_stdout() -> TextIO:
    """Return the process's data stream (the original stdout); everything else goes to stderr.

    Idempotent: a second call returns the same stream. Call it before importing vLLM.
    """
    global _data
    if _data is not None:
        return _data
    route_logs_to_stderr()
    sys.stdout.flush()
    try:
        fd1 = sys.stdout.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        # No real descriptor (an embedding host, pytest's capture): keep the Python stream,
        # and look it up again next time (the host may replace it).
        return sys.stdout
    data_fd = os.dup(fd1)
    os.dup2(sys.stderr.fileno(), fd1)
    _data = os.fdopen(data_fd, "w", encoding="utf-8", buffering=1, closefd=True)
    atexit.register(_data.flush)
    # sys.stdout still wraps descriptor 1, which now is stderr: stray prints are logs.
    return _data


def data_stream() -> TextIO:
    """Where a command writes its data: the isolated stdout once the process entry point
    called :func:`isolate_stdout`, else the current ``sys.stdout`` (a command run in-process,
    e.g. from a test, leaves the caller's descriptors alone)."""
    return _data if _data is not None else sys.stdout


def open_output(path: str | None) -> TextIO:
    """The stream a command's data goes to: ``path`` (``-`` or None: the data stdout)."""
    if path in (None, "-"):
        return data_stream()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    return p.open("w", encoding="utf-8")


def log(msg: str) -> None:
    """A progress or status line for the person at the terminal (stderr, never data)."""
    print(msg, file=sys.stderr, flush=True)


def print_data_only() -> TextIO:
    """For scripts that print() their data: stdout becomes the data stream, the rest stderr.

    Loggers configured before this call hold the old stdout object, whose descriptor now leads
    to stderr; vLLM, if imported later, logs to stderr (``VLLM_LOGGING_STREAM``).
    """
    sys.stdout = isolate_stdout()
    return sys.stdout
