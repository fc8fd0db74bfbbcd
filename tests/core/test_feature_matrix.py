"""docs/features.md's refused rows: each refusal on a real ``VllmConfig`` of the bundled tiny
model (no engine), with the reason it names. The supported rows' engine tests are named in the
doc (``tests/engine/test_features.py``, ``test_speculative.py``, ``test_serving_offline.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

from ascend_mepic.core.engine_support import (
    SUPPORTED_SPECULATION,
    UnsupportedEngineFeature,
    check_engine_supported,
    check_kv_cache_supported,
    unsupported_features,
)
from ascend_mepic.core.errors import MepicUnsupportedError
from ascend_mepic.core.policies import parse_policy
from ascend_mepic.eval.prepare import prepare_tiny_llama

MEPIC = parse_policy("mepic")


@pytest.fixture(scope="module")
def model() -> str:
    return str(prepare_tiny_llama())


def config(model: str, **kwargs):
    kwargs.setdefault("enable_prefix_caching", True)
    args = EngineArgs(model=model, dtype="float32", block_size=32, max_model_len=1024, **kwargs)
    return args.create_engine_config()


def reasons(vllm_config, policy=MEPIC) -> str:
    return "; ".join(unsupported_features(vllm_config, policy, tier_enabled=False))


def test_the_plain_configuration_is_supported(model):
    check_engine_supported(config(model), MEPIC, tier_enabled=False)


def test_prefix_caching_off_is_refused_where_chunks_are_shared(model):
    off = config(model, enable_prefix_caching=False)
    assert "disabled prefix caching: MEPIC keeps private blocks" in reasons(off)
    assert reasons(off, parse_policy("full")) == ""  # full ignores segments


def test_ngram_speculation_is_supported(model):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    assert SUPPORTED_SPECULATION == ("ngram", "draft_model")
    assert reasons(config(model, speculative_config=spec)) == ""


DRAFT = {"method": "draft_model", "num_speculative_tokens": 2}


def test_draft_model_speculation_is_supported_under_shared_placement(model):
    spec = config(model, speculative_config={**DRAFT, "model": model})
    assert reasons(spec) == ""
    assert reasons(spec, parse_policy("mepic-block")) == ""


@pytest.mark.parametrize(
    ("policy", "tier", "says"),
    [
        ("epic-16", False, "a draft model with policy 'epic-16': the host store"),
        ("cacheblend-15", False, "a draft model with policy 'cacheblend-15': CacheBlend"),
        ("mepic", True, "a draft model with the LMCache tier"),
    ],
)
def test_draft_model_is_refused_where_its_kv_would_not_follow(model, policy, tier, says):
    spec = config(model, speculative_config={**DRAFT, "model": model})
    with pytest.raises(UnsupportedEngineFeature, match=says):
        check_engine_supported(spec, parse_policy(policy), tier_enabled=tier)


@pytest.mark.parametrize(
    ("method", "says"),
    [
        ("eagle", "EAGLE: the drafter reads the target's hidden states"),
        ("eagle3", "EAGLE: the drafter reads the target's hidden states"),
        ("mtp", "MTP: the drafter reads the target's hidden states"),
        ("medusa", "Medusa heads"),
        ("suffix", "untested with MEPIC (supported: ngram, draft_model)"),
    ],
)
def test_other_speculation_kinds_are_refused(model, method, says):
    c = config(model)
    c.speculative_config = SimpleNamespace(method=method)  # their drafter models are not here
    assert f"speculative decoding with method {method!r}" in reasons(c)
    assert says in reasons(c)


@pytest.mark.parametrize(
    ("connector", "role"),
    [("OffloadingConnector", "kv_both"), ("NixlConnector", "kv_producer")],
)
def test_kv_connectors_are_refused(model, connector, role):
    from vllm.config import KVTransferConfig

    c = config(model)
    c.kv_transfer_config = KVTransferConfig(kv_connector=connector, kv_role=role)
    assert "KV connectors (--kv-transfer-config): MEPIC's step plan uses" in reasons(c)


@pytest.mark.parametrize(
    ("field", "says"),
    [
        ("pipeline_parallel_size", "pipeline parallelism"),
        ("data_parallel_size", "data parallelism"),
        ("decode_context_parallel_size", "decode context parallelism"),
    ],
)
def test_parallelism_refusals(model, field, says):
    c = config(model)
    setattr(c.parallel_config, field, 2)
    assert says in reasons(c)


def test_tensor_parallelism_is_refused_only_for_loading_policies_and_the_tier(model):
    c = config(model)
    c.parallel_config.tensor_parallel_size = 2
    assert reasons(c) == ""  # supported: tests/engine/test_serving_offline.py (TP 2 = TP 1)
    assert "host store keeps one rank's KV" in reasons(c, parse_policy("epic-16"))
    assert "tier entries hold one rank's KV" in "; ".join(unsupported_features(c, MEPIC, True))


def test_lora_is_refused_until_chunk_identity_includes_the_adapter(model):
    c = config(model, enable_lora=True, max_lora_rank=8)
    assert c.lora_config is not None
    assert "LoRA: chunk identity does not include the adapter" in reasons(c)


def test_sliding_window_and_hybrid_kv_caches_are_refused():
    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=16, dtype=torch.float32)
    window = SlidingWindowSpec(
        block_size=32, num_kv_heads=2, head_size=16, dtype=torch.float32, sliding_window=64
    )
    check_kv_cache_supported(KVCacheConfig(8, [], [KVCacheGroupSpec(["a"], full)]))
    with pytest.raises(MepicUnsupportedError, match="full attention only"):
        check_kv_cache_supported(KVCacheConfig(8, [], [KVCacheGroupSpec(["a"], window)]))
    two = [KVCacheGroupSpec(["a"], full), KVCacheGroupSpec(["b"], window)]
    with pytest.raises(MepicUnsupportedError, match="single KV cache group; this model has 2"):
        check_kv_cache_supported(KVCacheConfig(8, [], two))


def test_beam_search_and_prompt_logprobs_are_refused_for_chunk_requests():
    from ascend_mepic.entrypoints.server import service

    refused = "use_beam_search, prompt_logprobs cannot be used with MEPIC chunks"
    with pytest.raises(service.MepicRequestError, match=refused):
        service._raise_unsupported({"use_beam_search": True, "prompt_logprobs": True})


def test_cpu_kv_offloading_is_a_kv_connector_and_refused(model):
    c = config(model, kv_offloading_size=1.0)
    assert c.kv_transfer_config is not None  # vLLM turns the size into its offloading connector
    assert "KV connectors" in reasons(c)


def test_async_scheduling_is_turned_off():
    from ascend_mepic.vllm_integration.engine_config import turn_off_async_scheduling

    c = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=True))
    turn_off_async_scheduling(c)
    assert c.scheduler_config.async_scheduling is False
