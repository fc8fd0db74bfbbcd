"""The vLLM boundary: which vLLM and vllm-ascend internals code outside ``vllm_integration/`` uses.

``vllm_integration/`` is where MEPIC meets vLLM's internals; it imports nothing from ``worker/``
or ``entrypoints/`` (the classes vLLM loads are named in ``vllm_integration/class_names.py``).
Outside it, code may use vLLM's public API (``PUBLIC``) and the internal modules of ``ALLOWED``
only: a new internal import fails here until it moves into ``vllm_integration/`` or is added to
the list with its reason, and a module no longer used must leave the list. The list is the
boundary's debt (issue 47 aims at 12 or fewer): the scheduler and KV manager subclass vLLM's
core classes, the workers and backends subclass vLLM's and vllm-ascend's. The server reaches
vLLM's OpenAI front end through ``vllm_integration/openai_api.py`` and ``openai_launcher.py``.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PUBLIC = {
    "vllm",
    "vllm.config",
    "vllm.exceptions",
    "vllm.outputs",
    "vllm.platforms",
    "vllm.sampling_params",
}
ALLOWED: dict[str, str] = {
    # core/: the scheduler and KV manager subclass vLLM's and share its block pool and requests
    **dict.fromkeys(
        [
            "vllm.utils.hashing",
            "vllm.v1.core.block_pool",
            "vllm.v1.core.kv_cache_manager",
            "vllm.v1.core.kv_cache_utils",
            "vllm.v1.core.sched.output",
            "vllm.v1.core.sched.scheduler",
            "vllm.v1.core.single_type_kv_cache_manager",
            "vllm.v1.engine",
            "vllm.v1.kv_cache_interface",
            "vllm.v1.request",
        ],
        "scheduling: subclasses of vLLM's scheduler and KV cache manager",
    ),
    # worker/: workers, runners and attention backends subclass vLLM's and vllm-ascend's
    **dict.fromkeys(
        [
            "vllm.forward_context",
            "vllm.model_executor.custom_op",
            "vllm.v1.attention.backend",
            "vllm.v1.attention.backends.cpu_attn",
            "vllm.v1.attention.backends.registry",
            "vllm.v1.kv_cache_layout",
            "vllm.v1.utils",
            "vllm.v1.worker.cpu_model_runner",
            "vllm.v1.worker.cpu_worker",
            "vllm.v1.worker.gpu_model_runner",
            "vllm.v1.worker.gpu_worker",
            "vllm.v1.worker.workspace",
            "vllm_ascend.attention.attention_v1",
            "vllm_ascend.worker.model_runner_v1",
            "vllm_ascend.worker.worker",
        ],
        "computation: subclasses of vLLM's and vllm-ascend's workers, runners and backends",
    ),
}


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside functions (absolute imports)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def _sources() -> list[Path]:
    return sorted(p for d in ("ascend_mepic", "cuda_fallback") for p in (ROOT / d).rglob("*.py"))


def test_outside_the_integration_package_only_listed_vllm_internals():
    used: dict[str, set[str]] = defaultdict(set)
    for path in _sources():
        if "vllm_integration" in path.parts:
            continue
        for module in _imports(path):
            if module.split(".")[0] in ("vllm", "vllm_ascend") and module not in PUBLIC:
                used[module].add(str(path.relative_to(ROOT)))
    new = {m: sorted(files) for m, files in used.items() if m not in ALLOWED}
    assert not new, f"vLLM internals outside vllm_integration/ (move them there): {new}"
    gone = sorted(set(ALLOWED) - set(used))
    assert not gone, f"no longer used outside vllm_integration/: remove from ALLOWED: {gone}"


def test_the_integration_package_imports_nothing_above_it():
    above = ("ascend_mepic.worker", "ascend_mepic.entrypoints", "ascend_mepic.eval")
    bad = {
        str(path.relative_to(ROOT)): sorted(m for m in _imports(path) if m.startswith(above))
        for path in sorted((ROOT / "ascend_mepic" / "vllm_integration").glob("*.py"))
    }
    assert not {k: v for k, v in bad.items() if v}, bad
