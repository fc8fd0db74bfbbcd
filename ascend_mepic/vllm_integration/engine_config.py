"""What a configuration with MEPIC on gets, per platform (vLLM 0.30.0).

``vllm serve MODEL --additional-config '{"mepic": {}}'`` (and ``LLM(..., additional_config=...)``)
must start MEPIC's scheduler, worker, runner and attention backend, and must refuse at start-up
what MEPIC cannot serve; ``platform_hook`` runs the selection around the platform's own check.

What a configuration with MEPIC on gets differs per platform: one ``MepicSelection`` subclass per
platform:

* every platform: MEPIC's worker for an ``auto`` worker (another worker must subclass it), MEPIC's
  scheduler, async scheduling off (the step plan must describe the step the worker runs next;
  vLLM 0.30.0 resolves it to on outside the CPU platform before the platform's check), MEPIC's
  options and the model checked (``MepicConfig``, ``check_model_supported``);
* CUDA (``CudaSelection``; UNTESTED ON A GPU): vLLM's V1 model runner (the V2 runner, vLLM 0.30.0's
  default on CUDA when Triton is present, is turned off with a logged reason, or refused when the
  user or a V2-only feature asked for it), MEPIC's attention backend as vLLM's ``CUSTOM`` backend
  (any other ``--attention-backend`` is refused, and the model's head size, dtype and KV cache
  dtype are checked against the backend's support for the GPU's compute capability), and
  piecewise CUDA graphs instead of full ones (MEPIC's per-step tables are not captured);
* Ascend: ``vllm_integration.ascend.AscendSelection``.

The platform's selection is chosen once, in ``platform_hook.selection_for``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ascend_mepic.vllm_integration.class_names import (
    CPU_WORKER_CLS,
    CUDA_BACKEND_CLS,
    GPU_WORKER_CLS,
    SCHEDULER_CLS,
    SIM_WORKER_CLS,
    resolve,
)

logger = logging.getLogger(__name__)

MEPIC_KEY = "mepic"
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


class MepicStartupError(ValueError):
    """A configuration with MEPIC on that MEPIC cannot start with (raised at config time)."""


def mepic_on(vllm_config: Any) -> bool:
    additional = vllm_config.additional_config
    return isinstance(additional, dict) and MEPIC_KEY in additional


def _subclass_of(qualname: str, base_qualname: str) -> bool:
    """Whether the class at ``qualname`` subclasses the one at ``base_qualname`` (False when it
    cannot be imported: the platform's own check would fail on it anyway)."""
    try:
        cls = resolve(qualname)
    except (ImportError, AttributeError, ValueError):
        return False
    return isinstance(cls, type) and issubclass(cls, resolve(base_qualname))


class MepicSelection:
    """What a configuration with MEPIC on gets, around the platform's own check."""

    worker_cls: str = ""

    def before_platform_check(self, vllm_config: Any) -> None:
        from ascend_mepic.config import MepicConfig
        from ascend_mepic.core.models import check_model_supported

        MepicConfig.from_additional_config(vllm_config.additional_config)  # unknown options fail
        if vllm_config.model_config is not None:
            check_model_supported(vllm_config.model_config)
        parallel = vllm_config.parallel_config
        if parallel.worker_cls == "auto":
            parallel.worker_cls = self.worker_cls
        elif parallel.worker_cls not in (self.worker_cls, SIM_WORKER_CLS) and not _subclass_of(
            parallel.worker_cls, self.worker_cls
        ):
            raise MepicStartupError(
                f"MEPIC needs its worker ({self.worker_cls}) or a subclass; --worker-cls selects "
                f"{parallel.worker_cls}"
            )
        turn_off_async_scheduling(vllm_config)

    def after_platform_check(self, vllm_config: Any) -> None:
        scheduler = vllm_config.scheduler_config
        if scheduler.scheduler_cls is None:
            scheduler.scheduler_cls = SCHEDULER_CLS
        elif scheduler.scheduler_cls != SCHEDULER_CLS and not _subclass_of(
            str(scheduler.scheduler_cls), SCHEDULER_CLS
        ):
            raise MepicStartupError(
                f"MEPIC needs its scheduler ({SCHEDULER_CLS}) or a subclass; the configuration "
                f"selects {scheduler.scheduler_cls}"
            )


class CpuSelection(MepicSelection):
    """The CPU platform: MEPIC's backend is registered over CPU_ATTN by its worker."""

    worker_cls = CPU_WORKER_CLS


class CudaSelection(MepicSelection):
    """vLLM's CUDA platform. UNTESTED ON A GPU: checked with vLLM's CUDA platform code and a faked
    device capability (``tests/cuda``)."""

    worker_cls = GPU_WORKER_CLS

    def before_platform_check(self, vllm_config: Any) -> None:
        super().before_platform_check(vllm_config)
        use_v1_model_runner(vllm_config)
        use_mepic_attention_backend(vllm_config)
        use_piecewise_cuda_graphs(vllm_config)


def turn_off_async_scheduling(vllm_config: Any) -> None:
    """MEPIC's step plan describes the step the worker runs next; async scheduling plans one
    step ahead. vLLM 0.30.0 resolves it (default on) before the platform's check."""
    scheduler = vllm_config.scheduler_config
    if scheduler.async_scheduling:
        logger.warning(
            "MEPIC turns async scheduling off: its step plan must describe the step the worker "
            "runs next"
        )
    scheduler.async_scheduling = False


def use_v1_model_runner(vllm_config: Any) -> None:
    """MEPIC's runner subclasses vLLM's V1 ``GPUModelRunner``. vLLM 0.30.0 picks the V2 runner
    on CUDA by default (``VllmConfig.use_v2_model_runner``: Triton present and no V2-unsupported
    feature), read from ``VLLM_USE_V2_MODEL_RUNNER`` by the scheduler, the worker and the
    compilation config; the variable is the only switch, so it is set here, where every engine
    process started later inherits it."""
    import vllm.envs as envs

    explicit = os.environ.get(V2_RUNNER_ENV)
    if explicit is not None and envs.VLLM_USE_V2_MODEL_RUNNER:
        raise MepicStartupError(
            f"MEPIC runs on vLLM's V1 model runner; {V2_RUNNER_ENV}={explicit} asks for the V2 "
            f"runner: unset it or set {V2_RUNNER_ENV}=0"
        )
    if explicit is None:
        logger.warning(
            "MEPIC runs on vLLM's V1 model runner: setting %s=0 (vLLM 0.30.0 defaults to the V2 "
            "runner on CUDA)",
            V2_RUNNER_ENV,
        )
        os.environ[V2_RUNNER_ENV] = "0"
    cached = getattr(envs, "__getattr__", None)
    if hasattr(cached, "cache_clear"):  # vLLM's env cache is on in this process: re-read
        cached.cache_clear()
    if vllm_config.use_v2_model_runner:
        raise MepicStartupError(
            "MEPIC runs on vLLM's V1 model runner; this configuration needs the V2 runner "
            "(HiSparse attention or watermarking): turn that feature off to use MEPIC"
        )


def use_mepic_attention_backend(vllm_config: Any) -> None:
    """MEPIC's backend applies RoPE at read time to un-rotated KV: no other backend can serve its
    cache. Selected as vLLM's ``CUSTOM`` backend (its worker registers the class under that name)
    and checked now against the model, so a head size, dtype or KV cache dtype it cannot serve
    fails here, before any process starts, not at the model's first placed step."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    attention = vllm_config.attention_config
    chosen = attention.backend
    if chosen is not None and chosen != AttentionBackendEnum.CUSTOM:
        raise MepicStartupError(
            f"MEPIC applies RoPE inside its own attention backend; --attention-backend "
            f"{chosen.name} cannot read MEPIC's un-rotated KV cache: drop the option"
        )
    if attention.backend_per_kind:
        raise MepicStartupError(
            "MEPIC applies RoPE inside its own attention backend; per-kind attention backends "
            f"({dict(attention.backend_per_kind)}) cannot read its KV cache: drop them"
        )
    attention.backend = AttentionBackendEnum.CUSTOM
    if vllm_config.model_config is not None:
        check_backend_serves_model(vllm_config)


def check_backend_serves_model(vllm_config: Any) -> None:
    """Raise if MEPIC's CUDA backend cannot serve this model on this GPU (vLLM's own checks)."""
    from vllm.platforms import current_platform

    backend = resolve(CUDA_BACKEND_CLS)  # by name: the backend sits above this package
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    capability = current_platform.get_device_capability()
    if capability is None:
        raise MepicStartupError("MEPIC could not read the GPU's compute capability")
    reasons = backend.validate_configuration(
        head_size=model.get_head_size(),
        dtype=model.dtype,
        kv_cache_dtype=cache.cache_dtype,
        block_size=cache.block_size if cache.user_specified_block_size else None,
        use_mla=model.use_mla,
        has_sink=False,
        use_sparse=False,
        use_mm_prefix=False,
        use_per_head_quant_scales=False,
        device_capability=capability,
        attn_type="decoder",
        has_sliding_window=model.get_sliding_window() is not None,
    )
    if reasons:
        raise MepicStartupError(
            f"MEPIC's attention backend cannot serve this model on this GPU (compute capability "
            f"{capability.major}.{capability.minor}; head size {model.get_head_size()}, "
            f"{model.dtype}, KV cache dtype {cache.cache_dtype}): {'; '.join(reasons)}"
        )


def use_piecewise_cuda_graphs(vllm_config: Any) -> None:
    """MEPIC's attention metadata builder supports no full CUDA graphs (its per-step tables are
    rebuilt every step): full graphs become piecewise ones, attention running between them."""
    from vllm.config import CUDAGraphMode

    compilation = vllm_config.compilation_config
    mode = compilation.cudagraph_mode
    if mode is not None and mode.has_full_cudagraphs():
        logger.warning(
            "MEPIC's attention is not captured in full CUDA graphs: cudagraph_mode %s -> PIECEWISE",
            mode.name,
        )
        compilation.cudagraph_mode = CUDAGraphMode.PIECEWISE
