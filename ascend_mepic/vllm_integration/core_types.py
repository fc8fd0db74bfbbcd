"""The vLLM v1 core types MEPIC's scheduler, KV managers and ``eval.kvsim`` hold (vLLM 0.30.0).

Why one module: ``ascend_mepic.core`` keeps every block in vLLM's ``BlockPool``, tracks vLLM's
``Request`` objects, hashes prompt blocks as vLLM's prefix cache does and builds vLLM's KV specs
(kvsim drives the real managers with them), and publishes chunk residency in vLLM's KV event
types (``BlockStored``, ``BlockRemoved``, their external hash form). None of these names is
vLLM's public API, and they moved between releases (``KVCacheBlocks`` and
``SingleTypeKVCacheManager`` in 0.6-0.9, the hash helpers in 0.10-0.11), so they are named once,
here: a vLLM upgrade that moves one changes this file, and
``tests/vllm_integration/test_vllm_boundary.py`` stops any other module importing them from vLLM
directly. The classes MEPIC subclasses (``Scheduler``, ``KVCacheManager``) are imported where
they are subclassed, and listed in that test.
"""

from __future__ import annotations

from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.utils.hashing import get_hash_fn_by_name, sha256_cbor
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    ExternalBlockHash,
    KVCacheBlock,
    get_request_block_hasher,
    hash_block_tokens,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request, RequestStatus

__all__ = [
    "BlockHash",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "ExternalBlockHash",
    "EngineCoreOutputs",
    "FullAttentionSpec",
    "KVCacheBlock",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "Request",
    "RequestStatus",
    "SchedulerOutput",
    "SingleTypeKVCacheManager",
    "get_hash_fn_by_name",
    "get_request_block_hasher",
    "hash_block_tokens",
    "init_none_hash",
    "maybe_convert_block_hash",
    "sha256_cbor",
]
