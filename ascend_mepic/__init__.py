"""ascend_mepic: MEPIC chunk KV sharing inside vLLM's paged KV cache.

The package tree follows the two paths of a request (see docs/architecture.md):

* ``core/``: the scheduling path, no tensors: segments and markers, chunk identity, policies,
  the chunk cache, the chunk-aware KV manager and the scheduler.
* ``ops/``, ``worker/``: the computation path: NoPE KV writes and fused-RoPE paged attention,
  the attention backend, the runner mixin and the per-platform workers.
* ``tier/``: chunk KV off the device: the LMCache tier, the host store and block transfers.
* ``vllm_integration/``: every use of a vLLM internal, in one place, and the version check.
* ``entrypoints/``: the OpenAI-compatible server, the offline API and the ``ascend-mepic`` CLI.
* ``eval/``: kvsim, traces, SQuAD prompts and metrics, the transformers reference, benchmarks.
"""

__version__ = "0.1.0"
