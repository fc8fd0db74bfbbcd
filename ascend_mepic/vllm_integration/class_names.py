"""The classes MEPIC hands vLLM by qualified name: its scheduler, its workers, its CUDA backend.

vLLM loads schedulers and workers from ``--scheduler-cls`` / ``--worker-cls`` strings, so naming
them here (not importing them) keeps this package below ``core/`` and ``worker/``: the engine
imports each class in the process that runs it.
"""

from __future__ import annotations

from typing import Any

SCHEDULER_CLS = "ascend_mepic.core.scheduler.MepicScheduler"
CPU_WORKER_CLS = "ascend_mepic.worker.cpu_worker.MepicCPUWorker"
GPU_WORKER_CLS = "ascend_mepic.worker.gpu_worker.MepicGPUWorker"
NPU_WORKER_CLS = "ascend_mepic.worker.npu_worker.MepicNPUWorker"
CUDA_BACKEND_CLS = "ascend_mepic.worker.cuda_attention.MepicCudaAttentionBackend"
# The serving simulator's worker (``ascend-mepic bench simulate``): no model, no device; it prices
# each step on a device profile. Accepted in place of the platform's MEPIC worker.
SIM_WORKER_CLS = "ascend_mepic.eval.sim.worker.SimulatedWorker"


def worker_cls_for(platform: Any) -> str:
    """MEPIC's worker for a vLLM platform (CPU tested; CUDA and Ascend untested on hardware)."""
    if platform.is_cpu():
        return CPU_WORKER_CLS
    if platform.is_cuda():
        return GPU_WORKER_CLS
    if platform.device_type == "npu":
        return NPU_WORKER_CLS
    raise ValueError(
        f"MEPIC has no worker for platform {platform.device_type!r} (CPU, CUDA and "
        "Ascend NPU through vllm-ascend are supported)"
    )


def resolve(qualname: str) -> Any:
    """The object a qualified name names (vLLM's own resolver)."""
    from vllm.utils.import_utils import resolve_obj_by_qualname

    return resolve_obj_by_qualname(qualname)
