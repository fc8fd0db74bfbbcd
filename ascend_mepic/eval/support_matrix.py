"""The support matrix: the published architectures MEPIC is checked on, and which checks run.

Product data, read by ``tests/engine/test_real_geometry.py`` (its engine tests are parametrized from
``SUPPORT_MATRIX``, so a row is exactly what runs in ``make test``) and by
``scripts/supported_models.py`` (docs/models.md's tables are generated from it).
Each model is the reduced copy of a published model (``eval.prepare.REDUCED_ARCHITECTURES``).
"""

from __future__ import annotations

from typing import Any

from ascend_mepic.eval.prepare import REDUCED_ARCHITECTURES

BLOCK_SIZES = [16, 128]
STOCK_BLOCK_SIZE = 128
# The block sizes each architecture runs at. The block size is a layout question (how a chunk's
# canonical run and the private stream fall into blocks, the kernels' tiles), the architecture a
# geometry question (GQA ratio, RoPE scaling, biases, q/k norms): every architecture runs at one
# block size, both block sizes meet at least two architectures, and Qwen2.5 (GQA 7, the one ratio
# that is not a power of two, and QKV biases) runs at both. Every kernel at head 128 and both
# block sizes is also checked op by op (tests/ops/test_head128.py). Running all four at both cost
# 28 engines in make test against 19.
MODEL_BLOCK_SIZES: dict[str, list[int]] = {
    "mistralai/Mistral-7B-Instruct-v0.3": [128],
    "meta-llama/Llama-3.1-8B-Instruct": [16],
    "Qwen/Qwen2.5-7B-Instruct": list(BLOCK_SIZES),
    "Qwen/Qwen3-8B": [128],
}
CHECKS: dict[str, str] = {
    "full-equals-stock": "policy full gives stock vLLM's greedy tokens and log-probabilities",
    "cache-state-independence": (
        "full, mepic and epic-16 give the same outputs cold, warm, and with chunks shared at "
        "other positions"
    ),
    "mepic-matches-reference": "mepic matches the transformers reference of its semantics",
    "epic-16-matches-reference": "epic-16 matches the transformers reference of its semantics",
}


def geometry(spec: Any) -> str:
    """The published attention geometry the reduced model keeps, as docs/models.md says it."""
    pub = spec.published
    heads, kv = pub["num_attention_heads"], pub["num_key_value_heads"]
    head = pub.get("head_dim") or pub["hidden_size"] // heads
    parts = [f"{heads}/{kv} heads (GQA {heads // kv})", f"head {head}"]
    parts.append(f"RoPE θ {pub['rope_theta']:,.0f}")
    scaling = pub.get("rope_scaling") or {}
    if scaling:
        parts.append(f"{scaling.get('rope_type')} scaling ×{scaling.get('factor'):g}")
    if spec.model_type == "qwen2":
        parts.append("QKV bias")
    if spec.model_type == "qwen3":
        parts.append("q/k RMSNorm before RoPE")
    return ", ".join(parts)


# Published model -> what runs: every check at the model's block sizes.
SUPPORT_MATRIX: dict[str, dict[str, Any]] = {
    model_id: {
        "model": model_id,
        "architecture": spec.architecture,
        "geometry": geometry(spec),
        "block_sizes": MODEL_BLOCK_SIZES[model_id],
        "checks": list(CHECKS),
    }
    for model_id, spec in REDUCED_ARCHITECTURES.items()
}
