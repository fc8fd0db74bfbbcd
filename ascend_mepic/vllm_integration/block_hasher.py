"""vLLM's prompt block hashing at request arrival, skipped for requests MEPIC re-hashes.

Why: vLLM 0.30.0's ``EngineCore`` hashes every full block of every prompt when the request
arrives (``get_request_block_hasher``, one SHA-256 over a CBOR encoding per block: ~6 us per 16
tokens, ~3 ms for an 8k-token prompt), before the scheduler sees it. A segmented request's
prompt is rewritten by MEPIC to its private stream and hashed again with layout keys
(``core.request_intake``), so all of vLLM's hashes but the first few are thrown away: measured by
``benchmarks/bench_sched_cost.py`` this was the largest part of MEPIC's admission cost.

No documented hook reaches the hasher: ``EngineCore.__init__`` builds it from the module-level
name ``vllm.v1.engine.core.get_request_block_hasher`` *after* it has built the scheduler, so
``MepicScheduler.__init__`` replaces that name (``install``) with a factory whose hasher returns
no hashes for a segmented request and vLLM's own for every other request. MEPIC then hashes the
leading blocks it shares with unsegmented requests itself, exactly as vLLM would
(``vllm_prompt_hashes``). Targets vLLM 0.30.0 (``version.SUPPORTED_VLLM``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    generate_block_hash_extra_keys,
    get_request_block_hasher,
    hash_block_tokens,
)
from vllm.v1.request import Request

from ascend_mepic.core.segments import EXTRA_ARGS_KEY, UNPIN_KEY

RequestBlockHasher = Callable[[Request], list[BlockHash]]


def rehashed_by_mepic(request: Request) -> bool:
    """Whether MEPIC replaces this request's prompt and block hashes (a segmented request that
    is not an unpin control request). A request MEPIC rejects needs no hashes either."""
    params = request.sampling_params
    extra = params.extra_args if params is not None else None
    return bool(extra) and EXTRA_ARGS_KEY in extra and not extra.get(UNPIN_KEY)


def mepic_request_block_hasher(
    hash_block_size: int, caching_hash_fn: Callable[[Any], bytes]
) -> RequestBlockHasher:
    """vLLM's request block hasher, except that a segmented request gets no hashes at arrival."""
    vllm_hasher = get_request_block_hasher(hash_block_size, caching_hash_fn)

    def hasher(request: Request) -> list[BlockHash]:
        if rehashed_by_mepic(request):
            return []
        return vllm_hasher(request)

    return hasher


def install() -> None:
    """Make the engine core in this process build MEPIC's hasher (idempotent).

    Must run before ``EngineCore.__init__`` builds its hasher: ``MepicScheduler.__init__`` does.
    """
    import vllm.v1.engine.core as engine_core  # heavy; only the engine-core process needs it

    engine_core.get_request_block_hasher = mepic_request_block_hasher


def installed() -> bool:
    import vllm.v1.engine.core as engine_core

    return engine_core.get_request_block_hasher is mepic_request_block_hasher


def vllm_prompt_hashes(
    request: Request, num_blocks: int, block_size: int, hash_fn: Callable[[Any], bytes]
) -> list[BlockHash]:
    """vLLM's hashes of the request's first ``num_blocks`` prompt blocks, equal to what its own
    hasher computes (same chain, same extra keys: cache salt, LoRA, multimodal, embeddings), so
    those blocks are shared with unsegmented requests."""
    hashes = list(request.block_hashes[:num_blocks])
    tokens = request.all_token_ids
    parent: BlockHash | None = hashes[-1] if hashes else None
    mm_idx = 0
    for b in range(len(hashes), num_blocks):
        start, end = b * block_size, (b + 1) * block_size
        extra, mm_idx = generate_block_hash_extra_keys(request, start, end, mm_idx)
        parent = hash_block_tokens(hash_fn, parent, tokens[start:end], extra)
        hashes.append(parent)
    return hashes
