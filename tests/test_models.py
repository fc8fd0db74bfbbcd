"""Start-up model checks: unsupported models fail early with the reason."""

from types import SimpleNamespace

import pytest

from ascend_mepic.core.models import UnsupportedModelError, check_model_supported


def config(**hf):
    base = {"architectures": ["LlamaForCausalLM"], "rope_parameters": {"rope_type": "default"}}
    base.update(hf)
    return SimpleNamespace(
        hf_config=SimpleNamespace(**base), use_mla=False, is_multimodal_model=False
    )


def test_supported_families():
    check_model_supported(config())
    check_model_supported(config(architectures=["MistralForCausalLM"], sliding_window=None))
    qwen = config(architectures=["Qwen2ForCausalLM"], sliding_window=4096, use_sliding_window=False)
    check_model_supported(qwen)
    check_model_supported(config(rope_parameters={"rope_type": "llama3", "factor": 8.0}))


@pytest.mark.parametrize(
    "cfg, match",
    [
        (config(architectures=["GPT2LMHeadModel"]), "supports"),
        (config(sliding_window=4096), "sliding-window"),
        (config(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "dynamic"),
        (config(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "yarn"),
        (config(partial_rotary_factor=0.5), "partial rotary"),
    ],
)
def test_unsupported_models_fail_with_reason(cfg, match):
    with pytest.raises(UnsupportedModelError, match=match):
        check_model_supported(cfg)


def test_mla_and_multimodal():
    cfg = config()
    cfg.use_mla = True
    with pytest.raises(UnsupportedModelError, match="MLA"):
        check_model_supported(cfg)
    cfg = config()
    cfg.is_multimodal_model = True
    with pytest.raises(UnsupportedModelError, match="multimodal"):
        check_model_supported(cfg)
