"""Every vLLM internal ascend_mepic uses, in one package, but the classes it subclasses (vLLM 0.30).

The rest of the plugin goes through vLLM's documented extension points: ``--scheduler-cls``,
``--worker-cls``, attention-backend registration, ``CustomOp.register_oot``,
``--additional-config``, the ``vllm.general_plugins`` / ``vllm.endpoint_plugins`` entry points and
the KV-connector metadata field of ``SchedulerOutput``. What those do not cover is here, each with
why it is needed; docs/architecture.md lists them. When vllm-ascend moves to a new vLLM, this
package (and ``version.SUPPORTED_VLLM``) is what to port.

* ``version``: the supported vLLM and the start-up check.
* ``engine_config`` and ``platform_hook``: the platform's configuration check wrapped, so that
  ``{"mepic": ...}`` in ``additional_config`` selects MEPIC's worker, scheduler and attention
  backend on every platform; ``class_names`` names those classes without importing them.
* ``channel``: the typed per-step plan sent from the scheduler to the workers.
* ``core_types``: the vLLM core types the KV managers hold (blocks, pool, requests, specs).
* ``block_hasher``: the engine core's arrival-time prompt hashing, skipped for segmented
  requests (MEPIC hashes their private stream itself).
* ``scheduler_internals``: KV manager install, compile pseudo-requests, prompt rewrite, running
  limits, outputs of requests finished at arrival.
* ``kv_cache``: the KV manager's request block tables, per-block prefix-cache lookup and
  insertion, and the ``BlockPool`` counts MEPIC's accounting reads.
* ``runner_internals``: the runner's step inputs MEPIC reads, its position and slot rewrite, the
  block-table width and the hand-off to the attention builders.
* ``attention_internals``: backend registration, the CUDA layout flag, the forward context.
* ``ascend``: what vllm-ascend's platform and worker need beyond vLLM's hooks.
* ``front_end``, ``route_override``, ``openai_api``, ``openai_launcher``: the server's request
  checks and MEPIC's routes on vLLM's OpenAI front end.
* ``cpu_attention``: stock vLLM's CPU attention ops, the kernel benchmark's baseline.
"""

from ascend_mepic.vllm_integration.version import (
    SUPPORTED_VLLM,
    SUPPORTED_VLLM_ASCEND,
    UnsupportedVllmVersion,
    check_vllm_version,
)

__all__ = [
    "SUPPORTED_VLLM",
    "SUPPORTED_VLLM_ASCEND",
    "UnsupportedVllmVersion",
    "check_vllm_version",
]
