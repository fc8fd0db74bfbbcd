"""The vLLM boundary: which vLLM and vllm-ascend internals code outside ``vllm_integration/`` uses.

``vllm_integration/`` is where MEPIC meets vLLM's internals; it imports nothing from ``worker/``
or ``entrypoints/`` (the classes vLLM loads are named in ``vllm_integration/class_names.py``).
Outside it, code may use vLLM's public API (``PUBLIC``) and the internal modules of ``ALLOWED``
only: a new internal import fails here until it moves into ``vllm_integration/`` or is added to
the list with its reason, and a module no longer used must leave the list. The list holds
only the modules of classes MEPIC subclasses (12, issue 47's bound): the scheduler and KV
manager subclass vLLM's core classes; the workers, runners, backends and rotary ops vLLM's and
vllm-ascend's. The types the KV managers hold come from ``vllm_integration/core_types.py``; the
server reaches vLLM's OpenAI front end through ``vllm_integration/openai_api.py`` and
``openai_launcher.py``. ``from vllm import _private`` counts as the internal module it names.
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
    # core/: the scheduler and KV manager are subclasses (``--scheduler-cls``; the manager is
    # installed by ``vllm_integration.scheduler_internals``). The types they hold (blocks, pool,
    # requests, specs) come from ``vllm_integration.core_types``.
    "vllm.v1.core.sched.scheduler": "MepicScheduler subclasses Scheduler",
    "vllm.v1.core.kv_cache_manager": "MepicKVCacheManager subclasses KVCacheManager (and returns "
    "its KVCacheBlocks); kvsim builds stock managers for the prefix baseline",
    # worker/: the classes ``--worker-cls`` and backend registration install subclass vLLM's
    # and vllm-ascend's; each of these modules is imported only on its own platform.
    "vllm.model_executor.custom_op": "NoPE rotary classes are CustomOp.register_oot subclasses",
    "vllm.v1.attention.backend": "MEPIC's backend, builder and impl subclass vLLM's bases",
    "vllm.v1.attention.backends.cpu_attn": "the CPU backend subclasses CPUAttentionBackend",
    "vllm.v1.worker.cpu_worker": "MepicCPUWorker subclasses CPUWorker",
    "vllm.v1.worker.cpu_model_runner": "MepicCPUModelRunner subclasses CPUModelRunner",
    "vllm.v1.worker.gpu_worker": "MepicGPUWorker subclasses Worker (CUDA)",
    "vllm.v1.worker.gpu_model_runner": "MepicGPUModelRunner subclasses GPUModelRunner (CUDA)",
    "vllm_ascend.attention.attention_v1": "the NPU backend subclasses AscendAttentionBackend",
    "vllm_ascend.worker.model_runner_v1": "MepicNPUModelRunner subclasses NPUModelRunner",
    "vllm_ascend.worker.worker": "MepicNPUWorker subclasses NPUWorker",
}


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside functions (absolute imports)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            if node.module in ("vllm", "vllm_ascend"):  # ``from vllm import _custom_ops``
                found.update(
                    f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")
                )
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
