"""Every place ascend_mepic touches a vLLM internal, in one package (targets vLLM 0.30.0).

The rest of the plugin goes through vLLM's documented extension points: ``--scheduler-cls``,
``--worker-cls``, attention-backend registration, ``CustomOp.register_oot``,
``--additional-config``, the ``vllm.general_plugins`` / ``vllm.endpoint_plugins`` entry points and
the KV-connector metadata field of ``SchedulerOutput``. What those do not cover is here, each with
why it is needed; docs/architecture.md lists them. When vllm-ascend moves to a new vLLM, this
package (and ``version.SUPPORTED_VLLM``) is what to port.

* ``version``: the supported vLLM and the start-up check.
* ``engine_config``: the platform's configuration check wrapped, so that ``{"mepic": ...}`` in
  ``additional_config`` selects MEPIC's worker, scheduler and attention backend on every platform.
* ``channel``: the typed per-step plan sent from the scheduler to the workers.
* ``block_hasher``: the engine core's arrival-time prompt hashing, skipped for segmented
  requests (MEPIC hashes their private stream itself).
* ``scheduler``: KV manager install, compile pseudo-requests, prompt rewrite, running limits,
  outputs of requests finished at arrival.
* ``kv_cache``: the KV manager's request block tables, per-block prefix-cache lookup and
  insertion, and the ``BlockPool`` counts MEPIC's accounting reads.
* ``runner``: the runner's step inputs MEPIC rewrites and the hand-off to the attention builders.
* ``routes``: MEPIC's HTTP routes in place of vLLM's own completions routes.
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
