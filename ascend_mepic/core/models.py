"""Which models MEPIC serves, checked at start-up so an unsupported one fails early and loudly."""

from __future__ import annotations

from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = (None, "default", "llama3", "linear")


class UnsupportedModelError(ValueError):
    """A model MEPIC cannot serve correctly."""


def check_model_supported(model_config: Any) -> None:
    """Raise with the reason if MEPIC's fused read-time RoPE or paged layout cannot serve it."""
    hf = model_config.hf_config
    archs = list(getattr(hf, "architectures", None) or [])
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise UnsupportedModelError(
            f"MEPIC supports {', '.join(SUPPORTED_ARCHITECTURES)}; this model is {archs}"
        )
    if getattr(model_config, "use_mla", False):
        raise UnsupportedModelError("MLA models are not supported by MEPIC")
    if getattr(model_config, "is_multimodal_model", False):
        raise UnsupportedModelError("multimodal models are not supported by MEPIC")
    sliding = getattr(hf, "sliding_window", None)
    if sliding and getattr(hf, "use_sliding_window", True):
        raise UnsupportedModelError(
            f"sliding-window attention (window {sliding}) is not supported by MEPIC: a shared "
            "chunk's KV would have to be dropped per request"
        )
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type")) if isinstance(params, dict) else None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"RoPE scaling {rope_type!r} is not supported by MEPIC (supported: default, llama3, "
            "linear): its cos/sin are not a fixed function of the position"
        )
    factor = params.get("partial_rotary_factor", 1.0) if isinstance(params, dict) else 1.0
    factor = getattr(hf, "partial_rotary_factor", factor)
    if factor != 1.0:
        raise UnsupportedModelError(f"partial rotary dims ({factor}) are not supported by MEPIC")
