"""The vLLM engine-core internals the serving simulator drives (vLLM 0.30.0).

``ascend-mepic bench simulate`` runs vLLM's own ``EngineCore`` (the loop ``LLMEngine`` and
``vllm serve`` drive) in process, with its ``UniProcExecutor`` and a model-free worker installed
through ``worker_cls`` (``eval/sim/worker.py``, a ``WorkerBase`` subclass whose steps return a
``ModelRunnerOutput``). None of these is vLLM's public API, so they are named once, here
(``tests/vllm_integration/test_vllm_boundary.py`` keeps other modules from importing them).
"""

from __future__ import annotations

from vllm.v1.engine import EngineCoreRequest
from vllm.v1.engine.core import EngineCore
from vllm.v1.executor.uniproc_executor import UniProcExecutor
from vllm.v1.kv_cache_interface import KVCacheSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

__all__ = [
    "CompilationTimes",
    "EngineCore",
    "EngineCoreRequest",
    "KVCacheSpec",
    "ModelRunnerOutput",
    "UniProcExecutor",
    "WorkerBase",
]
