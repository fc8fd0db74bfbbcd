"""The vllm-ascend 0.30.0rc2 internals MEPIC's NPU worker touches, each with why (vLLM 0.30.0).

UNTESTED ON HARDWARE: checked on x86 with vllm-ascend's real Python classes and a torch_npu double
(``make test-ascend``), never on an Ascend NPU.

Five things vLLM's documented hooks do not reach on vllm-ascend:

* **MEPIC's key in ``additional_config``.** vllm-ascend validates every ``additional_config`` key
  as an ``AscendConfig`` field (``init_ascend_config``: a pydantic dataclass with
  ``extra="forbid"``), in the platform's config check, in the engine-core process
  (``run_engine_core`` patch) and in ``NPUWorker.__init__``; ``{"mepic": {...}}`` would stop
  every one of them. ``hide_plugin_keys`` makes ``additional_config`` a dict that keeps the
  ``mepic`` entry for whoever asks for it by name (MEPIC's scheduler, worker and server) and
  leaves it out when iterated (how ``init_ascend_config`` collects its fields), pickles with it,
  and leaves vllm-ascend's own keys, typos included, to its validation. The clean fix is
  upstream: an allowlist of plugin keys in ``init_ascend_config`` (it has one for vLLM-Omni).
* **Async scheduling.** vLLM 0.30.0 turns it on by default before the platform's check; the CPU
  platform turns it off, vllm-ascend does not. MEPIC's step plan must describe the step the
  worker runs next, so MEPIC's configuration hook turns it off (logged) before vllm-ascend
  picks its scheduler classes from it; likewise eager mode (``use_eager_mode``).
* **Worker and scheduler choice.** ``vllm serve MODEL --additional-config '{"mepic": {}}'`` must
  start MEPIC's worker and scheduler, but ``NPUPlatform.check_and_update_config`` replaces an
  ``auto`` worker with its own and is the only code that sees the final config before the
  workers start. MEPIC's general plugin wraps it on every platform
  (``platform_hook.install_config_hook``, with ``AscendSelection`` here): with a ``mepic`` entry
  in ``additional_config``, an ``auto`` worker becomes MEPIC's and an unset scheduler MEPIC's; a
  vllm-ascend scheduler chosen by its own options is refused.
* **Attention backend.** ``NPUPlatform.get_attn_backend_cls`` returns hard-coded class paths and
  never reads ``selected_backend`` or vLLM's backend registry, so ``register_backend`` (the CPU
  and CUDA route) has no effect. ``use_attention_backend`` wraps that classmethod, in the worker
  process, so the standard (non-MLA, non-sparse) choice becomes MEPIC's subclass of
  ``AscendAttentionBackend``; every other choice is refused (MEPIC does not support it).
* **Rotary ops.** ``NPUWorker.__init__`` registers Ascend's rotary classes with
  ``CustomOp.register_oot``, which refuses a second registration of a name; ``override_oot_op``
  replaces the registry entry instead, for the names vllm-ascend took.
* **KV cache layout.** vllm-ascend hands each layer a ``(K, V)`` pair of strided views over one
  block-major buffer (each block: K then V), not one tensor; ``kv_pair_view`` and
  ``block_major_buffer`` view that buffer the way MEPIC's ops and tier code read it, and refuse
  any other layout (vllm-ascend's contiguous-PA layout keeps all K before all V).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ascend_mepic.vllm_integration.class_names import NPU_WORKER_CLS
from ascend_mepic.vllm_integration.engine_config import MEPIC_KEY, MepicSelection

# vllm-ascend 0.30.0rc2's path for the standard attention backend (``NPUPlatform``'s backend map).
ASCEND_STANDARD_BACKEND = "vllm_ascend.attention.attention_v1.AscendAttentionBackend"
MEPIC_NPU_BACKEND = "ascend_mepic.worker.npu_attention.MepicAscendAttentionBackend"


class PluginKeysHidden(dict):
    """``additional_config`` with MEPIC's entry kept out of iteration. Why: see the module
    docstring. Lookups by name (``d["mepic"]``, ``"mepic" in d``, ``d.get``) see it; iteration,
    ``keys()``, ``items()``, ``values()``, ``dict(d)`` and ``{**d}`` do not; pickling and copies
    keep it (the engine core and the workers get the config pickled). ``len`` still counts it,
    so a config that holds only MEPIC's entry stays truthy (``additional_config or {}``)."""

    HIDDEN = frozenset({MEPIC_KEY})

    def __iter__(self):
        return (k for k in dict.__iter__(self) if k not in self.HIDDEN)

    def keys(self):  # type: ignore[override]
        return list(self)

    def items(self):  # type: ignore[override]
        return [(k, self[k]) for k in self]

    def values(self):  # type: ignore[override]
        return [self[k] for k in self]

    def __reduce__(self):
        return (type(self), (dict(dict.items(self)),))


def hide_plugin_keys(additional_config: dict) -> PluginKeysHidden:
    """``additional_config`` as vllm-ascend may validate it, MEPIC's entry still readable."""
    if isinstance(additional_config, PluginKeysHidden):
        return additional_config
    return PluginKeysHidden(dict.items(additional_config))


def use_eager_mode(vllm_config) -> None:
    """MEPIC's per-step tables are not captured into ACL graphs: eager mode, set before
    vllm-ascend's check so that it turns compilation off itself (as for ``--enforce-eager``)."""
    from vllm.config import CUDAGraphMode

    if vllm_config.model_config is not None and not vllm_config.model_config.enforce_eager:
        import logging

        logging.getLogger(__name__).info("MEPIC on Ascend runs in eager mode: enforce_eager set")
        vllm_config.model_config.enforce_eager = True
    vllm_config.compilation_config.cudagraph_mode = CUDAGraphMode.NONE


class UnsupportedAscendLayout(RuntimeError):
    """vllm-ascend allocated a KV layout MEPIC cannot address."""


def use_attention_backend(backend_path: str = MEPIC_NPU_BACKEND) -> None:
    """Make ``NPUPlatform`` select ``backend_path`` where it would select its standard backend.

    Why: see the module docstring. Call in the worker process before the model runner is built
    (it selects the backend in its constructor); clears vLLM's selector cache. Idempotent.
    """
    from vllm.v1.attention import selector
    from vllm_ascend.platform import NPUPlatform

    current = NPUPlatform.get_attn_backend_cls
    if getattr(current, "mepic_backend", None) == backend_path:
        return
    original = getattr(current, "mepic_original", current)

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        path = original(selected_backend, attn_selector_config, num_heads)
        if path != ASCEND_STANDARD_BACKEND:
            raise ValueError(
                f"MEPIC supports vllm-ascend's standard attention only; this model selects {path} "
                "(MLA, sparse, compressed and FA3 attention are not supported)"
            )
        return backend_path

    get_attn_backend_cls.mepic_backend = backend_path  # type: ignore[attr-defined]
    get_attn_backend_cls.mepic_original = original  # type: ignore[attr-defined]
    NPUPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)  # type: ignore[method-assign]
    selector._cached_get_attn_backend.cache_clear()


class AscendSelection(MepicSelection):
    """vllm-ascend's ``NPUPlatform``: MEPIC's key hidden from vllm-ascend's validation and eager
    mode, set before vllm-ascend's own check (which keeps a non-``auto`` worker, turns
    compilation off for eager mode and picks its scheduler classes from async scheduling).
    Installed by ``platform_hook.install_config_hook``; why: see the module docstring."""

    worker_cls = NPU_WORKER_CLS

    def before_platform_check(self, vllm_config) -> None:
        vllm_config.additional_config = hide_plugin_keys(vllm_config.additional_config)
        super().before_platform_check(vllm_config)
        use_eager_mode(vllm_config)


def override_oot_op(name: str, op_cls: type) -> None:
    """Register ``op_cls`` as vLLM's out-of-tree op ``name``, replacing vllm-ascend's entry.

    Why: ``CustomOp.register_oot`` asserts the name is new, and ``NPUWorker.__init__`` already
    registered Ascend's rotary classes under vLLM's names.
    """
    from vllm.model_executor.custom_op import CustomOp, op_registry_oot

    if name in op_registry_oot:
        op_cls.name = name
        op_registry_oot[name] = op_cls
    else:
        CustomOp.register_oot(op_cls, name=name)


HEAD_MAJOR_LAYOUTS = ("HND", "LBHNC")


def refuse_head_major_layout() -> None:
    """vllm-ascend allocates ``[2, nb, Hkv, B, D]`` under ``VLLM_KV_CACHE_LAYOUT=HND`` (or
    ``LBHNC``): the same strides as the default ``[2, nb, B, Hkv, D]``, so the shape alone cannot
    tell them apart and MEPIC's ops would read heads as slots. Refused by name instead, when
    MEPIC's backend is asked for the KV shape (before anything is allocated)."""
    import vllm.envs as envs

    layout = envs.VLLM_KV_CACHE_LAYOUT
    if layout in HEAD_MAJOR_LAYOUTS:
        raise UnsupportedAscendLayout(
            f"VLLM_KV_CACHE_LAYOUT={layout}: MEPIC supports vllm-ascend's default "
            "[2, num_blocks, block_size, kv_heads, head_size] layout only; unset the variable"
        )


def kv_pair_view(kv_cache: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """The ops' ``[2, num_blocks, B, Hkv, D]`` view of one layer's vllm-ascend ``(K, V)`` pair.

    Why: vllm-ascend 0.30.0rc2 (``NPUModelRunner._reshape_kv_cache_tensors``, strided layout)
    allocates one buffer per layer and hands out ``(kv[0], kv[1])`` views with block stride
    ``2 * B * Hkv * D`` and V one block-half after K. A 5-D tensor is taken as already viewed.
    Head-major layouts are refused before allocation (``refuse_head_major_layout``), not here:
    this runs for every layer of every step.
    """
    if isinstance(kv_cache, torch.Tensor):
        if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
            raise UnsupportedAscendLayout(f"expected [2, nb, B, H, D], got {tuple(kv_cache.shape)}")
        return kv_cache
    k, v = kv_cache
    if k.dim() != 4 or k.shape != v.shape or k.dtype != v.dtype:
        raise UnsupportedAscendLayout(
            f"expected K and V [num_blocks, B, Hkv, D] alike, got {tuple(k.shape)} {k.dtype} "
            f"and {tuple(v.shape)} {v.dtype}"
        )
    nb, bs, h, d = k.shape
    half = bs * h * d
    strides = (2 * half, h * d, d, 1)
    adjacent = (
        k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
        and v.storage_offset() == k.storage_offset() + half
    )
    if k.stride() != strides or v.stride() != strides or not adjacent:
        raise UnsupportedAscendLayout(
            "MEPIC needs vllm-ascend's strided KV layout (each block's K then V in one buffer); "
            f"got K strides {k.stride()}, V strides {v.stride()}, V offset "
            f"{v.storage_offset() - k.storage_offset()} elements after K (expected {half}). "
            "Contiguous-PA, sparse, DCP and xlite layouts are not supported."
        )
    return torch.as_strided(k, (2, nb, bs, h, d), (half, 2 * half, h * d, d, 1), k.storage_offset())


def block_major_buffer(kv_cache: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """The same memory as a contiguous ``[num_blocks, 2, B, Hkv, D]`` tensor (``tier.transfer``)."""
    return kv_pair_view(kv_cache).transpose(0, 1)


# ``MepicNPUWorker.init_device`` restates vllm-ascend's (it builds its runner inline) and calls
# these two vLLM internals as that body does, under the same names; imported when a worker starts.
def init_workspace_manager(device: torch.device, num_ubatches: int) -> None:
    """vLLM's ``init_workspace_manager`` (``vllm.v1.worker.workspace``), as NPUWorker calls it."""
    from vllm.v1.worker.workspace import init_workspace_manager as vllm_init

    vllm_init(device, num_ubatches)


def report_usage_stats(vllm_config) -> None:
    """vLLM's ``report_usage_stats`` (``vllm.v1.utils``), as NPUWorker calls it on rank 0."""
    from vllm.v1.utils import report_usage_stats as vllm_report

    vllm_report(vllm_config)
