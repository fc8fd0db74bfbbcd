"""Config-time model checks on config shapes as vLLM 0.30.0 (transformers 5) loads them.

The end-to-end refusals of published models through ``create_engine_config`` are in
``tests/core/test_unsupported_models.py``; these cases cover the shapes one by one.
"""

from types import SimpleNamespace

import pytest

from ascend_mepic.core.models import (
    LONG_ROPE,
    MLA,
    MROPE,
    MULTIMODAL,
    PARTIAL_ROTARY,
    ROPE_SCALING,
    SLIDING_WINDOW,
    SUPPORTED_ARCHITECTURES,
    UNSUPPORTED_KINDS,
    UnsupportedModelError,
    check_model_supported,
    unsupported_kinds,
)

DEFAULT_ROPE = {"rope_theta": 10000.0, "rope_type": "default"}


def config(text=None, **hf):
    """A model config as vLLM's: ``hf_config``, ``hf_text_config`` (the same object unless
    ``text`` is given), and the properties the check reads."""
    base = {"architectures": ["LlamaForCausalLM"], "rope_parameters": dict(DEFAULT_ROPE)}
    base.update(hf)
    hf_config = SimpleNamespace(**base)
    return SimpleNamespace(
        hf_config=hf_config,
        hf_text_config=hf_config if text is None else SimpleNamespace(**text),
        use_mla=False,
        is_multimodal_model=False,
        uses_mrope=False,
    )


def refusal(cfg) -> str:
    with pytest.raises(UnsupportedModelError) as raised:
        check_model_supported(cfg)
    return str(raised.value)


def test_supported_families():
    check_model_supported(config())
    check_model_supported(config(architectures=["MistralForCausalLM"], sliding_window=None))
    # Qwen2/Qwen3 as transformers 5 loads them: use_sliding_window false clears the window.
    for arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        layers = ["full_attention"] * 4
        check_model_supported(
            config(
                architectures=[arch],
                sliding_window=None,
                use_sliding_window=False,
                layer_types=layers,
            )
        )
    llama3 = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0}
    check_model_supported(config(rope_parameters=llama3, rope_scaling=llama3))
    linear = {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 1.0}
    check_model_supported(config(rope_parameters=linear))
    check_model_supported(config(head_dim=128, rotary_dim=128))
    assert "Qwen3ForCausalLM" in SUPPORTED_ARCHITECTURES


@pytest.mark.parametrize(
    "cfg, kind, what",
    [
        (config(sliding_window=4096), SLIDING_WINDOW, "window 4096"),
        # Gemma-2: interleaved layers; the window is still on the config
        (
            config(sliding_window=4096, layer_types=["sliding_attention", "full_attention"]),
            SLIDING_WINDOW,
            "window 4096",
        ),
        # Phi-3-mini-128k as vLLM loads it (a window past the context is still a window)
        (
            config(
                sliding_window=262144,
                rope_parameters={"type": "longrope", "rope_type": "longrope", "long_factor": []},
            ),
            LONG_ROPE,
            "'longrope'",
        ),
        (
            config(rope_scaling={"type": "su", "long_factor": []}, rope_parameters=None),
            LONG_ROPE,
            "'su'",
        ),
        (
            config(rope_parameters={"rope_type": "dynamic", "factor": 2.0}),
            ROPE_SCALING,
            "'dynamic'",
        ),
        (config(rope_parameters={"rope_type": "yarn", "factor": 4.0}), ROPE_SCALING, "'yarn'"),
        # StableLM-2 as vLLM loads it: the factor inside rope_parameters
        (
            config(rope_parameters={**DEFAULT_ROPE, "partial_rotary_factor": 0.25}),
            PARTIAL_ROTARY,
            "0.25",
        ),
        (config(partial_rotary_factor=0.5), PARTIAL_ROTARY, "0.5"),
        (config(rotary_pct=0.25), PARTIAL_ROTARY, "0.25"),  # GPT-NeoX's name
        (config(head_dim=256, rotary_dim=64), PARTIAL_ROTARY, "0.25"),  # GPT-J's
        # Gemma-3-style nested rope_parameters, one dict per layer type
        (
            config(
                rope_parameters={
                    "full_attention": {"rope_type": "linear", "factor": 8.0},
                    "sliding_attention": {"rope_type": "yarn", "factor": 4.0},
                }
            ),
            ROPE_SCALING,
            "'yarn'",
        ),
    ],
)
def test_unsupported_models_fail_with_reason(cfg, kind, what):
    message = refusal(cfg)
    assert f"{kind} (" in message and what in message
    assert UNSUPPORTED_KINDS[kind] in message


def test_mrope_on_the_text_config_of_a_multimodal_model():
    """Qwen2-VL as vLLM loads it: the top-level config has no RoPE settings; the text config's
    ``rope_type`` is "default" (vLLM renames legacy "mrope") beside ``mrope_section``."""
    text = {
        "rope_parameters": {
            "type": "mrope",
            "mrope_section": [16, 24, 24],
            "rope_theta": 1000000.0,
            "rope_type": "default",
        },
        "sliding_window": None,
        "use_sliding_window": False,
    }
    cfg = config(text=text, architectures=["Qwen2VLForConditionalGeneration"], rope_parameters=None)
    cfg.is_multimodal_model = True
    assert list(unsupported_kinds(cfg)) == [MROPE, MULTIMODAL]
    message = refusal(cfg)
    assert message.index(MROPE) < message.index("architecture: MEPIC supports")
    # without the legacy "type" key, vLLM's own uses_mrope still tells
    del text["rope_parameters"]["type"], text["rope_parameters"]["mrope_section"]
    cfg = config(text=text, rope_parameters=None)
    cfg.uses_mrope = True
    assert MROPE in unsupported_kinds(cfg)


def test_mla_by_vllm_or_by_the_latent_rank():
    cfg = config()
    cfg.use_mla = True
    assert list(unsupported_kinds(cfg)) == [MLA]
    # VLLM_MLA_DISABLE=1 makes vLLM's use_mla false; the model is still MLA
    assert MLA in unsupported_kinds(config(kv_lora_rank=512))


def test_multimodal():
    cfg = config()
    cfg.is_multimodal_model = True
    assert UNSUPPORTED_KINDS[MULTIMODAL] in refusal(cfg)


def test_specific_reasons_before_the_architecture():
    """A model vLLM serves but MEPIC does not names its reasons first, every one of them."""
    message = refusal(
        config(
            architectures=["DeepseekV2ForCausalLM"],
            kv_lora_rank=512,
            rope_parameters={"rope_type": "yarn", "factor": 40},
        )
    )
    assert message.startswith("MEPIC cannot serve this model (DeepseekV2ForCausalLM): MLA (")
    assert message.index(MLA) < message.index(ROPE_SCALING) < message.index("architecture:")
    assert "architecture:" in refusal(config(architectures=["GPT2LMHeadModel"]))
