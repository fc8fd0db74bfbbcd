"""Published models MEPIC cannot serve fail at config time with MEPIC's reason, not vLLM's.

Real here: vLLM 0.30.0's ``EngineArgs.create_engine_config`` on the CPU platform with MEPIC's
configuration hook (``ascend_mepic.plugin.register``), on local folders holding the published
``config.json`` of real models (the values are written below, nothing is downloaded;
``num_hidden_layers`` cut to 2). Building a config reads no weights, and no tokenizer with
``skip_tokenizer_init``. Each model is configured once without MEPIC (vLLM accepts it, so the
refusal is MEPIC's) and once with ``{"mepic": {}}`` (refused with the kind and its reason from
``UNSUPPORTED_KINDS``, before any engine process starts).

Qwen2-VL: while building a ``ModelConfig`` vLLM inspects the architecture's module, and vLLM
0.30.0's ``qwen2_vl`` module imports transformers' Qwen2-VL image processor, which needs
torchvision. Without torchvision (this project's CPU environment) vLLM can build no config for it,
with or without MEPIC, before MEPIC's hook runs (in ``VllmConfig``, after ``ModelConfig``); there
MEPIC's check runs on the config vLLM's own loader (``get_config``) gives.
"""

from __future__ import annotations

import importlib.util
import json
from types import SimpleNamespace

import pytest

from ascend_mepic.core.models import (
    LONG_ROPE,
    MLA,
    MROPE,
    PARTIAL_ROTARY,
    REFUSAL_EXAMPLES,
    SLIDING_WINDOW,
    UNSUPPORTED_KINDS,
    UnsupportedModelError,
    check_model_supported,
)

QWEN2_VL = "Qwen/Qwen2-VL-2B-Instruct"
MISTRAL = "mistralai/Mistral-7B-v0.1"
HAVE_TORCHVISION = importlib.util.find_spec("torchvision") is not None

# microsoft/Phi-3-mini-128k-instruct rope_scaling: one factor per rotated pair (head_dim 96).
PHI3_LONG_FACTOR = [
    1.0700000524520874, 1.1200000047683716, 1.149999976158142, 1.4199999570846558,
    1.5699999332427979, 1.7999999523162842, 2.129999876022339, 2.129999876022339,
    3.009999990463257, 5.910000324249268, 6.950000286102295, 9.070000648498535,
    9.930000305175781, 10.710000038146973, 11.130000114440918, 14.609999656677246,
    15.409998893737793, 19.809999465942383, 37.279998779296875, 38.279998779296875,
    38.599998474121094, 40.12000274658203, 46.20000457763672, 50.940006256103516,
    53.66000747680664, 54.9373893737793, 56.89738845825195, 57.28738784790039,
    59.98738479614258, 60.86738586425781, 60.887386322021484, 61.71739196777344,
    62.91739273071289, 62.957393646240234, 63.41739273071289, 63.8173942565918,
    63.83739471435547, 63.897396087646484, 63.93739700317383, 64.06739807128906,
    64.11434936523438, 64.12435150146484, 64.15435028076172, 64.19435119628906,
    64.24435424804688, 64.57435607910156, 64.69000244140625, 64.76000213623047,
]  # fmt: skip
PHI3_SHORT_FACTOR = (
    [1.1, 1.1, 1.1, 1.3000000000000003, 1.3500000000000003, 1.3500000000000003]
    + [1.4000000000000004, 1.5500000000000005]
    + [2.000000000000001] * 17
    + [2.0500000000000007] * 6
    + [2.1000000000000005] * 2
    + [2.1500000000000004]
    + [2.25] * 5
    + [2.3999999999999995, 2.4499999999999993, 2.499999999999999, 2.6999999999999984]
    + [2.6999999999999984, 2.7499999999999982, 2.799999999999998, 2.8999999999999977]
    + [3.049999999999997]
)

# Published config.json values (the ones vLLM reads; auto_map and similar left out).
PUBLISHED: dict[str, dict] = {
    MISTRAL: {
        "architectures": ["MistralForCausalLM"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 32768,
        "model_type": "mistral",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 32000,
    },
    "google/gemma-2-2b": {
        "architectures": ["Gemma2ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": 50.0,
        "bos_token_id": 2,
        "cache_implementation": "hybrid",
        "eos_token_id": 1,
        "final_logit_softcapping": 30.0,
        "head_dim": 256,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 2304,
        "initializer_range": 0.02,
        "intermediate_size": 9216,
        "max_position_embeddings": 8192,
        "model_type": "gemma2",
        "num_attention_heads": 8,
        "num_hidden_layers": 26,
        "num_key_value_heads": 4,
        "pad_token_id": 0,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": 256000,
    },
    "microsoft/Phi-3-mini-128k-instruct": {
        "architectures": ["Phi3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "embd_pdrop": 0.0,
        "eos_token_id": 32000,
        "hidden_act": "silu",
        "hidden_size": 3072,
        "initializer_range": 0.02,
        "intermediate_size": 8192,
        "max_position_embeddings": 131072,
        "model_type": "phi3",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 32,
        "original_max_position_embeddings": 4096,
        "pad_token_id": 32000,
        "resid_pdrop": 0.0,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "long_factor": PHI3_LONG_FACTOR,
            "short_factor": PHI3_SHORT_FACTOR,
            "type": "longrope",
        },
        "rope_theta": 10000.0,
        "sliding_window": 262144,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 32064,
    },
    "stabilityai/stablelm-2-1_6b": {
        "architectures": ["StableLmForCausalLM"],
        "bos_token_id": 100257,
        "eos_token_id": 100257,
        "hidden_act": "silu",
        "hidden_dropout": 0.0,
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 5632,
        "layer_norm_eps": 1e-05,
        "max_position_embeddings": 4096,
        "model_type": "stablelm",
        "num_attention_heads": 32,
        "num_hidden_layers": 24,
        "num_key_value_heads": 32,
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_qkv_bias": True,
        "vocab_size": 100352,
    },
    QWEN2_VL: {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "vision_start_token_id": 151652,
        "vision_end_token_id": 151653,
        "vision_token_id": 151654,
        "image_token_id": 151655,
        "video_token_id": 151656,
        "hidden_act": "silu",
        "hidden_size": 1536,
        "initializer_range": 0.02,
        "intermediate_size": 8960,
        "max_position_embeddings": 32768,
        "max_window_layers": 28,
        "model_type": "qwen2_vl",
        "num_attention_heads": 12,
        "num_hidden_layers": 28,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vision_config": {
            "depth": 32,
            "embed_dim": 1280,
            "mlp_ratio": 4,
            "num_heads": 16,
            "in_chans": 3,
            "hidden_size": 1536,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "spatial_patch_size": 14,
            "temporal_patch_size": 2,
        },
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "vocab_size": 151936,
    },
    "deepseek-ai/DeepSeek-V2-Lite": {
        "architectures": ["DeepseekV2ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "aux_loss_alpha": 0.001,
        "bos_token_id": 100000,
        "eos_token_id": 100001,
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 10944,
        "kv_lora_rank": 512,
        "max_position_embeddings": 163840,
        "model_type": "deepseek_v2",
        "moe_intermediate_size": 1408,
        "moe_layer_freq": 1,
        "n_group": 1,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "norm_topk_prob": False,
        "num_attention_heads": 16,
        "num_experts_per_tok": 6,
        "num_hidden_layers": 27,
        "num_key_value_heads": 16,
        "pretraining_tp": 1,
        "q_lora_rank": None,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "rope_theta": 10000,
        "routed_scaling_factor": 1.0,
        "scoring_func": "softmax",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "greedy",
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "v_head_dim": 128,
        "vocab_size": 102400,
    },
}


@pytest.fixture(scope="module", autouse=True)
def inspect_in_this_process():
    """On a miss in its model-info cache (``~/.cache/vllm/modelinfos``, keyed by the module's
    hash) vLLM inspects an architecture's module in a fresh Python process, to keep CUDA out of
    this one: 15 to 50 s per architecture on 2 CPU cores. On the CPU platform the same inspection
    runs here in under a second, and its result is cached as vLLM's own would be."""
    from vllm.model_executor.models import registry

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(registry, "_run_in_subprocess", lambda inspect: inspect())
        yield


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    """One folder per published model: its config.json with 2 layers."""
    root = tmp_path_factory.mktemp("published")
    dirs = {}
    for name, published in PUBLISHED.items():
        folder = root / name.replace("/", "--")
        folder.mkdir()
        config = {**published, "num_hidden_layers": 2}
        (folder / "config.json").write_text(json.dumps(config))
        dirs[name] = str(folder)
    return dirs


def engine_config(model: str, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    from ascend_mepic.plugin import register

    register()  # what vLLM's plugin loader does in every process (idempotent)
    kwargs.setdefault("max_model_len", 2048)
    return EngineArgs(model=model, skip_tokenizer_init=True, **kwargs).create_engine_config()


def assert_refused(message: str, model: str) -> None:
    kind = REFUSAL_EXAMPLES[model]
    arch = PUBLISHED[model]["architectures"][0]
    assert f"MEPIC cannot serve this model ({arch}): " in message
    assert f"{kind} (" in message and UNSUPPORTED_KINDS[kind] in message


def test_every_kind_has_a_published_model():
    assert set(PUBLISHED) == set(REFUSAL_EXAMPLES)
    required = {SLIDING_WINDOW, LONG_ROPE, PARTIAL_ROTARY, MROPE, MLA}
    assert required <= set(REFUSAL_EXAMPLES.values())
    assert len(PHI3_LONG_FACTOR) == len(PHI3_SHORT_FACTOR) == 3072 // 32 // 2


@pytest.mark.parametrize("model", [m for m in PUBLISHED if m != QWEN2_VL])
def test_refused_by_mepic_at_config_time(model, model_dirs):
    folder = model_dirs[model]
    stock = engine_config(folder)  # vLLM's own config handling accepts the model
    assert stock.model_config.architecture == PUBLISHED[model]["architectures"][0]
    with pytest.raises(ValueError) as raised:  # pydantic's ValidationError around MEPIC's
        engine_config(folder, additional_config={"mepic": {}})
    assert_refused(str(raised.value), model)


def test_deepseek_names_mla_first(model_dirs):
    """vLLM itself turns MLA on for DeepSeek-V2-Lite; MEPIC names it before the YaRN scaling."""
    model = "deepseek-ai/DeepSeek-V2-Lite"
    assert engine_config(model_dirs[model]).model_config.use_mla
    with pytest.raises(ValueError) as raised:
        engine_config(model_dirs[model], additional_config={"mepic": {}})
    message = str(raised.value)
    assert message.index("MLA (") < message.index("RoPE scaling (") < message.index("architecture")


def test_without_the_window_mistral_starts(model_dirs):
    """The refusal is exactly the window: with vLLM's --disable-sliding-window (full attention,
    length capped to the window) MEPIC configures Mistral-7B-v0.1."""
    config = engine_config(
        model_dirs[MISTRAL],
        max_model_len=None,
        disable_sliding_window=True,
        additional_config={"mepic": {}},
    )
    assert config.model_config.max_model_len == 4096
    assert config.model_config.get_sliding_window() is None


@pytest.mark.skipif(not HAVE_TORCHVISION, reason="vLLM's qwen2_vl module needs torchvision")
def test_mrope_refused_by_mepic_at_config_time(model_dirs):
    folder = model_dirs[QWEN2_VL]
    assert engine_config(folder).model_config.uses_mrope
    with pytest.raises(ValueError) as raised:
        engine_config(folder, additional_config={"mepic": {}})
    assert_refused(str(raised.value), QWEN2_VL)


@pytest.mark.skipif(HAVE_TORCHVISION, reason="vLLM builds Qwen2-VL's config with torchvision")
def test_without_torchvision_vllm_fails_on_qwen2_vl_before_mepic(model_dirs):
    """Here vLLM's own model inspection fails, with or without MEPIC, before MEPIC's hook."""
    for mepic in ({}, {"additional_config": {"mepic": {}}}):
        with pytest.raises(ValueError, match="failed to be inspected"):
            engine_config(model_dirs[QWEN2_VL], **mepic)


def test_mrope_refused_on_the_config_vllm_loads(model_dirs):
    """MEPIC's check on Qwen2-VL's config as vLLM's loader gives it (whatever torchvision): the
    M-RoPE is found in the text config's ``rope_parameters``, not taken from vLLM's flag."""
    from vllm.transformers_utils.config import get_config, uses_mrope

    hf_config = get_config(model_dirs[QWEN2_VL], trust_remote_code=False)
    assert uses_mrope(hf_config)
    model_config = SimpleNamespace(
        hf_config=hf_config,
        hf_text_config=hf_config.get_text_config(),
        use_mla=False,
        is_multimodal_model=True,  # what vLLM's ModelConfig says of a multimodal architecture
    )
    with pytest.raises(UnsupportedModelError) as raised:
        check_model_supported(model_config)
    assert_refused(str(raised.value), QWEN2_VL)
