"""ascend_mepic: MEPIC chunk KV sharing inside vLLM's paged KV cache.

Scheduling path (no tensors): ``segments``, ``markers``, ``identity``, ``chunk_cache``,
``kv_manager``, ``scheduler``, ``plan``. Tools: ``kvsim``, ``trace``, ``prepare``, ``cli``.
"""

__version__ = "0.1.0"
