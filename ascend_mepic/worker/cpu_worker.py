"""MepicCPUWorker (``--worker-cls``): vLLM's CPU worker with MEPIC's computation path installed.

Before the model is built it replaces the model's RoPE with the no-op that records its cos/sin
cache and points CPU_ATTN at MEPIC's backend; then it swaps in ``MepicCPUModelRunner``.
"""

from __future__ import annotations

import torch
from vllm.v1.worker.cpu_worker import CPUWorker

from ascend_mepic.core.models import check_model_supported
from ascend_mepic.vllm_integration.version import check_vllm_version
from ascend_mepic.worker.attention import register_backend
from ascend_mepic.worker.model_runner import MepicCPUModelRunner, MepicWorkerMixin
from ascend_mepic.worker.nope_rotary import install_nope_rope


class MepicCPUWorker(MepicWorkerMixin, CPUWorker):
    def __init__(self, *args, **kwargs) -> None:
        check_vllm_version()
        super().__init__(*args, **kwargs)
        check_model_supported(self.vllm_config.model_config)
        install_nope_rope()
        register_backend()

    def init_device(self) -> None:
        super().init_device()
        if getattr(self, "use_v2_model_runner", False):
            raise ValueError("MEPIC supports vLLM's V1 model runner only; unset VLLM_USE_V2_*")
        self.model_runner = MepicCPUModelRunner(self.vllm_config, torch.device("cpu"))
