"""An emulated NPU worker: ``MepicNPUWorker`` with the CPU as its device and gloo for HCCL.

UNTESTED ON HARDWARE. Used by ``tests/ascend/test_engine_loop.py`` to run vLLM's engine loop on
vllm-ascend's platform with MEPIC's worker, runner, scheduler and backend, where no NPU exists.
Replaced, because they need the device:

* ``NPUWorker._init_device``: it binds an NPU (``torch.npu.set_device``), reads device memory
  and joins HCCL. Its replacement runs the device-independent steps through vllm-ascend's own
  code: the distributed set-up (``_init_worker_distributed_environment``, over gloo), the seed,
  the device properties vllm-ascend's Triton kernels read (``init_device_properties_triton``;
  under the interpreter the conftest's driver reports a 910B3's), and a memory snapshot
  (8 GiB free, as if);
* ``_warm_up_atb``: an ATB matmul on NPU tensors that warms CANN's library up; kept off;
* in ``shutdown``, only the device synchronisation.

Everything else (``NPUWorker.__init__`` and its patches, ``init_device``'s runner,
``load_model``, ``determine_available_memory``, ``initialize_from_config``, warm-up, and
``execute_model`` / ``sample_tokens`` every step) is vllm-ascend's and MEPIC's real code.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import vllm.distributed.parallel_state as parallel_state
import vllm_ascend.worker.worker as npu_worker_module
from vllm.utils.mem_utils import MemorySnapshot

from ascend_mepic.worker.npu_worker import MepicNPUWorker

WORKER_CLS = f"{__name__}.EmulatedNPUWorker"


@contextmanager
def gloo_for_hccl() -> Iterator[None]:
    """vllm-ascend's distributed set-up with gloo where it asks for HCCL.

    The worker asks for the ``hccl`` backend, and vllm-ascend's ``GroupCoordinator`` (installed
    by its worker patches) builds HCCL process-group options for every group; neither exists
    without CANN. For the call, the backend is gloo and groups are vLLM's own coordinator (the
    class vllm-ascend's subclasses), so the world, model-parallel and Ascend groups are made by
    the same calls, over gloo.
    """
    init = npu_worker_module.init_distributed_environment
    coordinator = parallel_state.GroupCoordinator
    upstream = next(c for c in coordinator.__mro__ if c.__module__ == parallel_state.__name__)

    def init_distributed_environment(world_size, rank, method, local_rank, backend="gloo"):
        return init(world_size, rank, method, local_rank, "gloo")

    npu_worker_module.init_distributed_environment = init_distributed_environment
    parallel_state.GroupCoordinator = upstream
    try:
        yield
    finally:
        npu_worker_module.init_distributed_environment = init
        parallel_state.GroupCoordinator = coordinator


class EmulatedNPUWorker(MepicNPUWorker):
    def _init_device(self) -> torch.device:
        device = torch.device("cpu")
        self.device_config.device = device
        with gloo_for_hccl():
            self._init_worker_distributed_environment()
        npu_worker_module.set_random_seed(self.model_config.seed)
        npu_worker_module.init_device_properties_triton()
        self.init_snapshot = MemorySnapshot(device=device, auto_measure=False)
        self.init_snapshot.free_memory = self.init_snapshot.total_memory = 8 * 2**30
        self.requested_memory = self.init_snapshot.total_memory
        return device

    def _warm_up_atb(self) -> None:
        """Kept off: warms CANN's ATB library up with a matmul on NPU tensors (performance only,
        no state the engine reads)."""

    def shutdown(self) -> None:
        """vllm-ascend's shutdown, with ``torch.accelerator.synchronize`` a no-op during it:
        torch's accelerator API needs the real torch_npu's C++ device hooks, and CPU tensors have
        nothing to wait for."""
        synchronize = torch.accelerator.synchronize
        torch.accelerator.synchronize = lambda *args, **kwargs: None
        try:
            super().shutdown()
        finally:
            torch.accelerator.synchronize = synchronize
