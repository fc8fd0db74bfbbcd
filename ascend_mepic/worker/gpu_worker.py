"""MepicGPUWorker (``--worker-cls`` on CUDA): vLLM's GPU worker with MEPIC's computation path.

UNTESTED ON A GPU: no GPU was available while building this. Its start-up (the configuration
hook, this constructor, backend selection) runs here on vLLM's CUDA platform code with a faked
device capability (``tests/cuda``); it mirrors ``MepicCPUWorker`` (tested in the real engine) on
vLLM's CUDA worker and V1 runner; attention dispatches to the Triton kernels of
``cuda_fallback/`` (tested under the Triton interpreter). The configuration hook
(``vllm_integration.engine_config.CudaSelection``) has already chosen the V1 runner, turned async
scheduling off and selected the ``CUSTOM`` attention backend; this worker registers MEPIC's class
under that name and refuses a configuration that bypassed the hook.
"""

from __future__ import annotations

from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from ascend_mepic.core.models import check_model_supported
from ascend_mepic.vllm_integration.attention_internals import is_custom_backend
from ascend_mepic.vllm_integration.engine_config import V2_RUNNER_ENV, MepicStartupError
from ascend_mepic.vllm_integration.version import check_vllm_version
from ascend_mepic.worker.cuda_attention import register_cuda_backend
from ascend_mepic.worker.model_runner import MepicRunnerMixin, MepicWorkerMixin
from ascend_mepic.worker.nope_rotary import install_nope_rope


class MepicGPUModelRunner(MepicRunnerMixin, GPUModelRunner):
    def __init__(self, vllm_config, device) -> None:
        super().__init__(vllm_config, device)
        self._init_mepic(vllm_config)


def check_worker_config(vllm_config) -> None:
    """What the configuration hook settles, checked again in the worker: a configuration built
    without it (``--worker-cls`` given by hand, MEPIC's key missing) fails here, before the
    device is touched, with the setting to change."""
    if vllm_config.use_v2_model_runner:
        raise MepicStartupError(
            f"MEPIC runs on vLLM's V1 model runner; this engine selects the V2 runner: set "
            f"{V2_RUNNER_ENV}=0, or start MEPIC through --additional-config '{{\"mepic\": {{}}}}' "
            "(which sets it)"
        )
    if vllm_config.scheduler_config.async_scheduling:
        raise MepicStartupError(
            "MEPIC does not run with async scheduling (its step plan must describe the step the "
            "worker runs next): pass --no-async-scheduling, or start MEPIC through "
            "--additional-config '{\"mepic\": {}}'"
        )
    backend = vllm_config.attention_config.backend
    if not is_custom_backend(backend):
        name = "automatic selection" if backend is None else backend.name
        raise MepicStartupError(
            f"MEPIC's attention backend must be selected (vLLM's CUSTOM backend); this engine "
            f"has {name}: start MEPIC through --additional-config '{{\"mepic\": {{}}}}'"
        )


class MepicGPUWorker(MepicWorkerMixin, Worker):
    def __init__(self, *args, **kwargs) -> None:
        check_vllm_version()
        super().__init__(*args, **kwargs)
        check_model_supported(self.vllm_config.model_config)
        check_worker_config(self.vllm_config)
        install_nope_rope()
        register_cuda_backend()

    def init_device(self) -> None:
        # vLLM's init_device binds the device, starts NCCL, takes the memory snapshot and builds
        # its V1 runner (V2 was ruled out in __init__); MEPIC's runner replaces that runner
        # before anything is loaded into it (the snapshot was taken before either was built).
        super().init_device()
        self.model_runner = MepicGPUModelRunner(self.vllm_config, self.device)
