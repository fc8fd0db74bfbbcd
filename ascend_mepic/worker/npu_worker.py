"""MepicNPUWorker (``--worker-cls`` on Ascend): vllm-ascend's NPU worker, MEPIC's computation path.

UNTESTED ON HARDWARE: never run on an Ascend 910B. On x86 (``make test-ascend``) the classes are
built from vllm-ascend 0.30.0rc2's real ``NPUWorker`` / ``NPUModelRunner`` with torch_npu stubbed
as vllm-ascend's own unit tests stub it, and the runner's MEPIC logic (placement, KV views) and the
backend's forward run on CPU tensors; device initialisation, the engine and the kernels on the
NPU never ran.

What it changes, after ``NPUWorker.__init__`` (which registers Ascend's custom ops):

* the model's rotary classes become MEPIC's no-op (NoPE) classes, replacing vllm-ascend's
  registrations (``vllm_integration.ascend.override_oot_op``);
* ``NPUPlatform`` selects ``MepicAscendAttentionBackend`` where it would select its standard
  backend (``vllm_integration.ascend.use_attention_backend``);
* ``init_device`` builds ``MepicNPUModelRunner`` (vllm-ascend's runner with MEPIC's placement
  mixed in) instead of ``NPUModelRunner``, as vllm-ascend's own ``XliteWorker`` swaps its runner.

Eager mode only: MEPIC's per-step tables are built on the host and not wired into ACL graph
capture, so the worker refuses to start without ``enforce_eager``.
"""

from __future__ import annotations

import logging

import torch
from vllm_ascend.worker.model_runner_v1 import NPUModelRunner
from vllm_ascend.worker.worker import NPUWorker

from ascend_mepic.config import MepicConfig
from ascend_mepic.core.models import check_model_supported
from ascend_mepic.core.request_limits import table_width
from ascend_mepic.ops import select_impl
from ascend_mepic.vllm_integration.ascend import (
    block_major_buffer,
    init_workspace_manager,
    report_usage_stats,
    use_attention_backend,
)
from ascend_mepic.vllm_integration.version import check_vllm_version
from ascend_mepic.worker.model_runner import MepicRunnerMixin, MepicWorkerMixin
from ascend_mepic.worker.nope_rotary import install_nope_rope, registered_rope

logger = logging.getLogger(__name__)


class MepicNPUModelRunner(MepicRunnerMixin, NPUModelRunner):
    """vllm-ascend's V1 runner placing MEPIC requests' tokens (``MepicRunnerMixin``)."""

    def __init__(self, vllm_config, device) -> None:
        super().__init__(vllm_config, device)
        self._init_mepic(vllm_config)
        self._kv_buffers: list[torch.Tensor] | None = None

    def profile_run(self) -> None:
        """vllm-ascend's profiling run, after reserving the torch_npu composition's scratch, so
        that the KV cache is sized around it (``ops.npu.reserve_scratch`` says why)."""
        reserve_attention_scratch(self.vllm_config, self.device)
        super().profile_run()

    def mepic_kv_buffers(self) -> list[torch.Tensor]:
        """vllm-ascend's per-layer ``(K, V)`` views as block-major ``[nb, 2, B, Hkv, D]``."""
        if self._kv_buffers is None or len(self._kv_buffers) != len(self.kv_caches):
            self._kv_buffers = [block_major_buffer(kv) for kv in self.kv_caches]
        return self._kv_buffers


def reserve_attention_scratch(vllm_config, device: torch.device) -> None:
    """The attention path's fixed scratch, before vLLM's profiling run counts memory: the
    torch_npu composition's (``ops.npu.reserve_scratch``) or the triton-ascend prefill kernel's
    rotated-K scratch (``reserve_prefill_scratch``)."""
    mc = vllm_config.model_config
    impl = npu_attention_impl(mc, vllm_config.parallel_config)
    if impl == "triton-ascend":
        from ascend_mepic.ops.triton_ascend import (
            dots_in_fp32,
            num_cores,
            reserve_prefill_scratch,
        )

        bs = vllm_config.cache_config.block_size
        config = MepicConfig.from_additional_config(vllm_config.additional_config)
        # The kernel's scratch holds a whole block-table row's slots (``core.request_limits``).
        max_keys = table_width(mc.max_model_len, bs, config.max_chunks_per_request) * bs
        dot_dtype = torch.float32 if dots_in_fp32(mc.dtype, mc.dtype, None) else mc.dtype
        reserve_prefill_scratch(device, num_cores(device), max_keys, mc.get_head_size(), dot_dtype)
        return
    if impl != "npu":
        return
    from ascend_mepic.ops.npu import reserve_scratch

    try:
        rope = registered_rope()
    except Exception:  # noqa: BLE001 - no rotary recorded yet: the tables are built at first use
        rope = None
    reserve_scratch(
        device,
        mc.get_num_kv_heads(vllm_config.parallel_config),
        mc.get_head_size(),
        mc.dtype,
        max_model_len=mc.max_model_len,
        rope=rope,
    )


def check_eager(vllm_config) -> None:
    if not vllm_config.model_config.enforce_eager:
        raise ValueError(
            "MEPIC on Ascend runs in eager mode only (its per-step attention tables are not "
            "captured into ACL graphs yet): pass --enforce-eager (LLM(enforce_eager=True))"
        )


def npu_attention_impl(model_config, parallel_config=None) -> str:
    """The attention implementation this model gets on the NPU (``ops.select_impl``, from the
    head size, dtype and this rank's GQA ratio), chosen at start-up so that a shape no NPU path
    takes fails before the model loads."""
    head_size = model_config.get_head_size()
    if parallel_config is None:
        hq = model_config.get_total_num_attention_heads()
        hkv = model_config.get_total_num_kv_heads()
    else:
        hq = model_config.get_num_attention_heads(parallel_config)
        hkv = model_config.get_num_kv_heads(parallel_config)
    group = hq // hkv if hkv and hq % hkv == 0 else None
    impl = select_impl(torch.device("npu"), head_size, model_config.dtype, group)
    logger.info(
        "MEPIC attention on the NPU (untested on hardware): %s for head size %d, GQA ratio %s, %s",
        impl, head_size, group, model_config.dtype,
    )  # fmt: skip
    return impl


def prepare_worker_process(vllm_config) -> None:
    """What MEPIC sets up in an NPU worker process before its runner is built: the model, eager
    and attention-path checks, NoPE rotary ops over vllm-ascend's, and MEPIC's backend."""
    check_model_supported(vllm_config.model_config)
    check_eager(vllm_config)
    npu_attention_impl(vllm_config.model_config, vllm_config.parallel_config)
    install_nope_rope(replace_registered=True)
    use_attention_backend()


class MepicNPUWorker(MepicWorkerMixin, NPUWorker):
    def __init__(self, *args, **kwargs) -> None:
        check_vllm_version()
        super().__init__(*args, **kwargs)
        prepare_worker_process(self.vllm_config)

    def init_device(self) -> None:
        """``NPUWorker.init_device`` with MEPIC's runner: vllm-ascend builds its runner inline,
        so the method is restated (as its own ``XliteWorker`` does). Kept statement for statement
        equal to vllm-ascend 0.30.0rc2's V1 branch; ``tests/ascend/test_startup.py`` pins that
        body, so a vllm-ascend release that changes it fails the tests until this follows."""
        if self.use_v2_model_runner:
            raise ValueError(
                "MEPIC supports vllm-ascend's V1 model runner only; unset VLLM_USE_V2_MODEL_RUNNER"
            )
        self.device = self._init_device()
        init_workspace_manager(self.device, 1)
        self.model_runner = MepicNPUModelRunner(self.vllm_config, self.device)
        if self.rank == 0:
            report_usage_stats(self.vllm_config)
