"""Which models MEPIC serves, checked at config time so an unsupported one fails early and loudly.

MEPIC caches a chunk's K un-rotated once for every request that reuses it and rotates it inside
attention at each token's position, with the model's own ``cos_sin_cache`` over the whole head.
Every model property that breaks one of those assumptions is a *kind* in ``UNSUPPORTED_KINDS``
(kind -> why); ``check_model_supported`` names every kind a model has, then the architecture, so
the user reads the specific reason even for an architecture MEPIC does not list.
``REFUSAL_EXAMPLES`` lists the published models the tests build to prove each refusal
(``tests/core/test_unsupported_models.py``); docs/models.md's table of refused models comes
from both.

The check reads the config as vLLM 0.30.0 loads it (transformers 5): RoPE settings live in
``rope_parameters`` (the same dict as legacy ``rope_scaling``; nested per layer type for models
with interleaved attention), a partial rotary factor may sit inside it, legacy RoPE types are
renamed (``su`` -> ``longrope``; ``mrope`` -> ``default`` plus ``mrope_section``), and a
multimodal model's text settings are on ``hf_text_config``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
SUPPORTED_ROPE_TYPES = (None, "default", "llama3", "linear")
LONG_ROPE_TYPES = ("longrope", "su")

MLA = "MLA"
MROPE = "M-RoPE"
SLIDING_WINDOW = "sliding-window attention"
LONG_ROPE = "long-RoPE"
ROPE_SCALING = "RoPE scaling"
PARTIAL_ROTARY = "partial rotary"
MULTIMODAL = "multimodal"

UNSUPPORTED_KINDS: dict[str, str] = {
    MLA: (
        "the KV cache holds one compressed latent per token, not a K per head, so there is no "
        "un-rotated per-head K for MEPIC's attention to rotate at read time"
    ),
    MROPE: (
        "positions are 3-D (time, height, width), while MEPIC rotates a cached chunk's K at one "
        "scalar position per token"
    ),
    SLIDING_WINDOW: (
        "a shared chunk's KV is cached once for all requests that reuse it, but which of its "
        "tokens a window drops differs per request (by where the chunk sits in it)"
    ),
    LONG_ROPE: (
        "cos/sin switch between short and long factors by the sequence's length, so they depend "
        "on the sequence length, not only on the position, and a cached chunk's K cannot be "
        "rotated from its position alone"
    ),
    ROPE_SCALING: (
        "MEPIC's attention rotates with a cos/sin table that is a fixed function of the "
        "position and checks only the default, linear and llama3 RoPE types against it"
    ),
    PARTIAL_ROTARY: (
        "only part of each head's dims is rotated, while MEPIC's kernel rotates the whole head "
        "at read time, which would rotate the dims the model passes through"
    ),
    MULTIMODAL: (
        "a chunk is identified by its token ids, and every image's placeholder tokens are the "
        "same ids, so chunks with different images would share one KV"
    ),
}

# Published model -> the kind its refusal proves (config.json values in the tests).
REFUSAL_EXAMPLES: dict[str, str] = {
    "mistralai/Mistral-7B-v0.1": SLIDING_WINDOW,
    "google/gemma-2-2b": SLIDING_WINDOW,
    "microsoft/Phi-3-mini-128k-instruct": LONG_ROPE,
    "stabilityai/stablelm-2-1_6b": PARTIAL_ROTARY,
    "Qwen/Qwen2-VL-2B-Instruct": MROPE,
    "deepseek-ai/DeepSeek-V2-Lite": MLA,
}


class UnsupportedModelError(ValueError):
    """A model MEPIC cannot serve correctly."""


def _text_config(model_config: Any) -> Any:
    """Where a model's decoder settings live (a multimodal model's ``text_config``)."""
    text = getattr(model_config, "hf_text_config", None)
    if text is not None:
        return text
    hf = model_config.hf_config
    get_text_config = getattr(hf, "get_text_config", None)
    return get_text_config() if callable(get_text_config) else hf


def _rope_dicts(*configs: Any) -> Iterator[dict[str, Any]]:
    """Every RoPE parameter dict of the configs, one per layer type when nested."""
    for config in configs:
        for name in ("rope_parameters", "rope_scaling"):
            params = getattr(config, name, None)
            if not isinstance(params, dict):
                continue
            nested = [p for p in params.values() if isinstance(p, dict)]
            if nested and all(isinstance(p, dict) or p is None for p in params.values()):
                yield from nested
            else:
                yield params


def _types(params: dict[str, Any]) -> set[str | None]:
    """A RoPE dict's types: ``rope_type`` and legacy ``type`` (both kept after vLLM's renames,
    e.g. ``type`` "mrope" beside ``rope_type`` "default")."""
    found = {params.get("rope_type"), params.get("type")} - {None}
    return found or {None}


def _rotary_fraction(text: Any, ropes: list[dict[str, Any]]) -> float:
    """Fraction of each head's dims that RoPE rotates (1.0: the whole head)."""
    for params in ropes:
        factor = params.get("partial_rotary_factor")
        if factor is not None and factor != 1.0:
            return float(factor)
    for name in ("partial_rotary_factor", "rotary_pct", "rotary_emb_fraction"):
        factor = getattr(text, name, None)
        if factor is not None and factor != 1.0:
            return float(factor)
    rotary_dim = getattr(text, "rotary_dim", None)
    head_dim = getattr(text, "head_dim", None)
    if head_dim is None and getattr(text, "num_attention_heads", None):
        head_dim = getattr(text, "hidden_size", 0) // text.num_attention_heads
    if isinstance(rotary_dim, int) and head_dim and rotary_dim != head_dim:
        return rotary_dim / head_dim
    return 1.0


def unsupported_kinds(model_config: Any) -> dict[str, str]:
    """Each ``UNSUPPORTED_KINDS`` kind the model has -> what in its config shows it."""
    hf = model_config.hf_config
    text = _text_config(model_config)
    ropes = list(_rope_dicts(text, hf))
    rope_types = {t for p in ropes for t in _types(p)}
    found: dict[str, str] = {}
    if getattr(model_config, "use_mla", False) or getattr(text, "kv_lora_rank", None):
        found[MLA] = f"kv_lora_rank {getattr(text, 'kv_lora_rank', None)}"
    mrope = [p.get("mrope_section") for p in ropes if "mrope_section" in p or "mrope" in _types(p)]
    if mrope or getattr(model_config, "uses_mrope", False):
        found[MROPE] = f"mrope_section {mrope[0] if mrope else None}"
    # vLLM hands every layer without its own window the model's (``get_sliding_window``), and
    # clears it under --disable-sliding-window (capping the length to the window).
    window = getattr(text, "sliding_window", None)
    if window:
        found[SLIDING_WINDOW] = (
            f"window {window}; --disable-sliding-window serves it as full attention up to "
            f"{window} tokens"
        )
    long_types = sorted(t for t in rope_types if t in LONG_ROPE_TYPES)
    if long_types:
        found[LONG_ROPE] = f"rope_type {long_types[0]!r}"
    other = sorted(
        str(t) for t in rope_types if t not in SUPPORTED_ROPE_TYPES + LONG_ROPE_TYPES + ("mrope",)
    )
    if other:
        found[ROPE_SCALING] = f"rope_type {other[0]!r}"
    fraction = _rotary_fraction(text, ropes)
    if fraction != 1.0:
        found[PARTIAL_ROTARY] = f"rotary fraction {fraction}"
    if getattr(model_config, "is_multimodal_model", False):
        found[MULTIMODAL] = "a multimodal architecture"
    return found


def check_model_supported(model_config: Any) -> None:
    """Raise naming every reason MEPIC's read-time RoPE or shared chunk KV cannot serve it.

    The specific reasons come before the architecture's, so a model vLLM serves but MEPIC does
    not still tells the user why.
    """
    archs = list(getattr(model_config.hf_config, "architectures", None) or [])
    reasons = [
        f"{kind} ({what}): {UNSUPPORTED_KINDS[kind]}"
        for kind, what in unsupported_kinds(model_config).items()
    ]
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        reasons.append(f"architecture: MEPIC supports {', '.join(SUPPORTED_ARCHITECTURES)}")
    if reasons:
        name = ", ".join(archs) or "unknown architecture"
        raise UnsupportedModelError(f"MEPIC cannot serve this model ({name}): {'; '.join(reasons)}")
