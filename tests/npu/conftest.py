"""tests/npu: run only on a real Ascend NPU (``make test-npu``); UNTESTED ON HARDWARE.

Every test here is marked ``npu`` and skipped, with the reason, unless a real NPU is usable:
the torch-npu distribution installed, torch_npu importing and ``torch.npu.is_available()``
(``ascend_mepic.entrypoints.doctor.probe_npu``). A module named ``torch_npu`` alone does not
count: tests/ascend/conftest.py puts a stub under that name in ``.venv-ascend``, whose
``torch.npu.is_available()`` is False and which no distribution backs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
_probe: dict = {}


def npu_skip_reason() -> str | None:
    """None on a usable NPU, else why these tests skip (probed once per session)."""
    if not _probe:
        from ascend_mepic.entrypoints.doctor import probe_npu

        _probe.update(probe_npu())
    if _probe["present"]:
        return None
    return f"needs a real Ascend NPU (make test-npu on a 910B): {_probe['reason']}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A session-wide hook: only this directory's items are touched.
    mine = [item for item in items if HERE in Path(str(item.path)).resolve().parents]
    if not mine:
        return
    reason = npu_skip_reason()
    for item in mine:
        item.add_marker(pytest.mark.npu)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def npu_device():
    """The NPU the tests run on (``npu:0``; set ASCEND_RT_VISIBLE_DEVICES to pick another)."""
    import torch

    reason = npu_skip_reason()
    if reason is not None:  # a test collected some other way than through this directory
        pytest.skip(reason)
    return torch.device("npu:0")


def sync() -> None:
    import torch

    torch.npu.synchronize()  # type: ignore[attr-defined]
