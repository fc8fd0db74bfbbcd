"""Which engine features MEPIC runs with, checked when its scheduler starts.

A feature MEPIC has not been built or tested for fails the engine's start with a message, never
silently: each would either compute wrong attention or share KV that must not be shared.
"""

from __future__ import annotations

from typing import Any

from ascend_mepic.core.errors import MepicUnsupportedError
from ascend_mepic.core.policies import Placement, Policy
from ascend_mepic.vllm_integration.core_types import FullAttentionSpec, KVCacheConfig

# Speculation kinds MEPIC runs with. n-gram (prompt lookup) drafts on the host from the token
# ids alone; its verification step is a decode step of 1 + k query tokens per request, which
# MEPIC's token map places after the layout like any decode token (a rejected token's slot is
# rewritten by the next step's token at the same index, and causality by index keeps stale KV
# out of attention). A draft model's batches are placed by the same token maps
# (``vllm_integration.draft_proposer``, ``worker.draft_placement``): its layers' KV sits in the
# same blocks, in caches of their own, so its pass over a step's chunk compiles writes its
# canonical chunk KV into the chunk's shared blocks.
SUPPORTED_SPECULATION = ("ngram", "draft_model")
_DRAFTER_HIDDEN = (
    "the drafter reads the target's hidden states per position, and its KV slots and "
    "attention metadata come from vLLM's proposer in vLLM's token indices (MEPIC places only "
    "the draft model's, method 'draft_model')"
)
SPECULATION_REFUSED = {
    "eagle": "EAGLE: " + _DRAFTER_HIDDEN,
    "eagle3": "EAGLE: " + _DRAFTER_HIDDEN,
    "mtp": "MTP: " + _DRAFTER_HIDDEN,
    "medusa": "untested with MEPIC: Medusa heads read the target's hidden states",
}
_OTHER_SPECULATION = "untested with MEPIC (supported: " + ", ".join(SUPPORTED_SPECULATION) + ")"


class UnsupportedEngineFeature(ValueError):
    """An engine setting MEPIC cannot run with."""


def unsupported_features(vllm_config: Any, policy: Policy, tier_enabled: bool) -> list[str]:
    """Reasons MEPIC cannot run with this engine configuration (empty when it can)."""
    parallel = vllm_config.parallel_config
    reasons: list[str] = []
    if parallel.pipeline_parallel_size > 1:
        reasons.append(
            "pipeline parallelism (--pipeline-parallel-size > 1): the compile pseudo-sequences "
            "and per-layer KV writes are untested across pipeline stages"
        )
    if getattr(parallel, "data_parallel_size", 1) > 1:
        reasons.append("data parallelism (--data-parallel-size > 1): untested with MEPIC")
    if getattr(parallel, "decode_context_parallel_size", 1) > 1:
        reasons.append(
            "decode context parallelism: MEPIC's block tables address whole blocks per rank"
        )
    spec = vllm_config.speculative_config
    method = getattr(spec, "method", None)
    if spec is not None and method not in SUPPORTED_SPECULATION:
        reasons.append(
            f"speculative decoding with method {method!r}: "
            + SPECULATION_REFUSED.get(method, _OTHER_SPECULATION)
        )
    if method == "draft_model":
        reasons.extend(_draft_model_refusals(policy, tier_enabled))
    if getattr(vllm_config.scheduler_config, "async_scheduling", False):
        reasons.append(
            "async scheduling: the step plan must describe the step the worker runs next"
        )
    if vllm_config.lora_config is not None:
        reasons.append(
            "LoRA: chunk identity does not include the adapter, so two adapters would share "
            "chunk KV"
        )
    if vllm_config.kv_transfer_config is not None:
        reasons.append(
            "KV connectors (--kv-transfer-config): MEPIC's step plan uses the connector "
            "metadata slot; use MEPIC's own LMCache tier (additional_config mepic.tier)"
        )
    shares = policy.placement is not Placement.NONE  # "full" ignores segments
    if shares and not vllm_config.cache_config.enable_prefix_caching:
        reasons.append("disabled prefix caching: MEPIC keeps private blocks in vLLM's prefix cache")
    tp = parallel.tensor_parallel_size
    if tp > 1 and policy.loads_kv:
        reasons.append(
            f"policy {policy.name!r} with tensor parallelism ({tp}): its host store keeps one "
            "rank's KV per chunk"
        )
    if tp > 1 and tier_enabled:
        reasons.append(
            f"the LMCache tier with tensor parallelism ({tp}): tier entries hold one rank's KV "
            "per chunk"
        )
    return reasons


def _draft_model_refusals(policy: Policy, tier_enabled: bool) -> list[str]:
    """Where a draft model's KV would not follow the target's: the host store and the tier
    copy chunk KV per layer of the target's geometry and were not built with a drafter's
    layers beside it; CacheBlend's selection is made per step for the target's batch only."""
    reasons = []
    if policy.loads_kv:
        reasons.append(
            f"a draft model with policy {policy.name!r}: the host store's chunk copies are "
            "untested with a drafter's layers"
        )
    if policy.dynamic:
        reasons.append(
            f"a draft model with policy {policy.name!r}: CacheBlend selects the target's rows "
            "per step, the drafter's batch has no selection"
        )
    if tier_enabled:
        reasons.append(
            "a draft model with the LMCache tier: tier entries would hold the drafter's layers "
            "beside the target's (untested)"
        )
    return reasons


def check_engine_supported(vllm_config: Any, policy: Policy, tier_enabled: bool) -> None:
    reasons = unsupported_features(vllm_config, policy, tier_enabled)
    if reasons:
        raise UnsupportedEngineFeature(
            "MEPIC cannot run with: " + "; ".join(reasons) + ". Turn MEPIC off (drop 'mepic' "
            "from --additional-config) or remove these settings."
        )


def check_kv_cache_supported(config: KVCacheConfig) -> None:
    """The KV cache MEPIC's manager can hold: one group of full attention (its tables and slot
    arithmetic assume one block size and no sliding window)."""
    groups = config.kv_cache_groups
    if len(groups) != 1:
        raise MepicUnsupportedError(
            f"MEPIC needs a single KV cache group; this model has {len(groups)} "
            "(hybrid or sliding-window models are not supported)"
        )
    spec = groups[0].kv_cache_spec
    if type(spec) is not FullAttentionSpec or spec.sliding_window is not None:
        raise MepicUnsupportedError(
            f"MEPIC supports full attention only, got {type(spec).__name__}"
        )
