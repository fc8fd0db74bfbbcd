"""Make the model's rotary embedding a no-op, keeping its cos/sin cache for the attention backend.

MEPIC stores K without RoPE (so a chunk's cached KV is valid at any offset) and rotates Q and K
inside attention, at each token's logical position. The model still calls
``q, k = self.rotary_emb(positions, q, k)``; vLLM's documented out-of-tree hook
(``CustomOp.register_oot``) replaces each supported rotary class with a subclass whose forward
returns q and k unchanged and which records its ``RopeSpec`` for the backend. Rotary classes that
fused read-time RoPE cannot reproduce are replaced by classes that refuse to be built, so an
unsupported model fails at start-up instead of producing wrong KV.
"""

from __future__ import annotations

import importlib

import torch
from vllm.model_executor.custom_op import CustomOp

from ascend_mepic.ops.rope import SUPPORTED_ROTARY_CLASSES, RopeSpec, UnsupportedRopeError

_ROTARY_MODULE = "vllm.model_executor.layers.rotary_embedding"
# CustomOp rotary classes that must not be used with MEPIC (their cos/sin are not a plain lookup).
REJECTED_ROTARY_CLASSES = (
    "DynamicNTKScalingRotaryEmbedding",
    "DynamicNTKAlphaRotaryEmbedding",
    "MRotaryEmbedding",
    "DualChunkRotaryEmbedding",
    "DeepseekScalingRotaryEmbedding",
    "FourierRotaryEmbedding",
    "Gemma4RotaryEmbedding",
)

_specs: list[RopeSpec] = []  # every NoPE rotary module built in this process, in order
_model_rope: RopeSpec | None = None  # the loaded model's, once a runner recorded it
_installed = False


def _one_rope(specs: list[RopeSpec]) -> RopeSpec:
    if not specs:
        raise RuntimeError(
            "MEPIC attention found no rotary embedding: the model was built before the NoPE "
            "RoPE override was installed, or it does not use vLLM's RotaryEmbedding"
        )
    first = specs[0]
    for spec in specs[1:]:
        same = spec.is_neox_style == first.is_neox_style and torch.equal(
            spec.cos_sin_cache.cpu(), first.cos_sin_cache.cpu()
        )
        if not same:
            raise UnsupportedRopeError("layers with different RoPE parameters are not supported")
    return first


def record_model_rope(model: torch.nn.Module, drafter: torch.nn.Module | None = None) -> RopeSpec:
    """Record the RoPE of the model a runner just loaded, read from its NoPE rotary modules.

    Read from the model rather than from construction records: a process may load one model
    after another (an ``LLM`` shut down, then another built), and vLLM caches rotary modules
    across loads, so the construction records can hold an earlier model's RoPE or miss this one's.
    A draft model's layers use the same attention backend, which applies one RoPE: a drafter
    whose RoPE differs from the model's is refused here.
    """
    global _model_rope
    specs = [
        RopeSpec.from_module(m, m.head_size)
        for module in (model, drafter)
        if module is not None
        for m in module.modules()
        if hasattr(type(m), "mepic_base_name")
    ]
    _model_rope = _one_rope(specs)
    return _model_rope


def registered_rope() -> RopeSpec:
    """The model's RoPE: the loaded model's (``record_model_rope``), else the one recorded when
    its (no-op) rotary modules were built (layers used without a MEPIC runner)."""
    if _model_rope is not None:
        return _model_rope
    return _one_rope(_specs)


def _nope_class(base: type) -> type:
    def __init__(self, *args, **kwargs) -> None:  # noqa: N807
        base.__init__(self, *args, **kwargs)
        _specs.append(RopeSpec.from_module(self, self.head_size))

    def forward(self, positions, query, key=None, *args, **kwargs):
        return query, key

    return type(
        f"Nope{base.__name__}",
        (base,),
        {"__init__": __init__, "forward": forward, "mepic_base_name": base.__name__},
    )


def _rejecting_class(base: type) -> type:
    def __init__(self, *args, **kwargs) -> None:  # noqa: N807
        raise UnsupportedRopeError(
            f"{base.__name__} is not supported with MEPIC: fused read-time RoPE needs a cos/sin "
            "cache that depends only on the position"
        )

    return type(f"Rejected{base.__name__}", (base,), {"__init__": __init__})


def install_nope_rope(replace_registered: bool = False) -> None:
    """Register the no-op rotary classes with vLLM (idempotent, per process).

    ``replace_registered``: a platform plugin (vllm-ascend) already registered its own rotary
    classes under these names; replace them (``vllm_integration.ascend.override_oot_op``).
    """
    global _installed
    if _installed:
        return
    register = lambda name, cls: CustomOp.register_oot(cls, name=name)  # noqa: E731
    if replace_registered:
        from ascend_mepic.vllm_integration.ascend import override_oot_op as register
    module = importlib.import_module(_ROTARY_MODULE)
    for name in SUPPORTED_ROTARY_CLASSES:
        register(name, _nope_class(getattr(module, name)))
    for name in REJECTED_ROTARY_CLASSES:
        base = getattr(module, name, None)
        if base is not None:
            register(name, _rejecting_class(base))
    _installed = True
