"""MepicGPUWorker (``--worker-cls`` on CUDA): vLLM's GPU worker with MEPIC's computation path.

UNTESTED ON A GPU: no GPU was available while building this. It mirrors ``MepicCPUWorker`` (which
is tested in the real engine) on vLLM's CUDA worker and runner; attention dispatches to the
Triton kernels of ``cuda_fallback/`` (tested only under the Triton interpreter). The backend is
registered over vLLM's TRITON_ATTN and FLASH_ATTN names, the CUDA platform's usual choices.
"""

from __future__ import annotations

from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from ascend_mepic.core.models import check_model_supported
from ascend_mepic.vllm_integration.version import check_vllm_version
from ascend_mepic.worker.attention import register_backend
from ascend_mepic.worker.model_runner import MepicRunnerMixin
from ascend_mepic.worker.rope import install_nope_rope


class MepicGPUModelRunner(MepicRunnerMixin, GPUModelRunner):
    def __init__(self, vllm_config, device) -> None:
        super().__init__(vllm_config, device)
        self._init_mepic(vllm_config)


class MepicGPUWorker(Worker):
    def __init__(self, *args, **kwargs) -> None:
        check_vllm_version()
        super().__init__(*args, **kwargs)
        check_model_supported(self.vllm_config.model_config)
        install_nope_rope()
        register_backend(("TRITON_ATTN", "FLASH_ATTN"))

    def init_device(self) -> None:
        super().init_device()
        if getattr(self, "use_v2_model_runner", False):
            raise ValueError("MEPIC supports vLLM's V1 model runner only; unset VLLM_USE_V2_*")
        self.model_runner = MepicGPUModelRunner(self.vllm_config, self.device)
