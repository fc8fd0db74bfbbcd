"""Accounting of the chunk-aware KV manager: block categories and metrics (read-only).

"Used" blocks are those held by live requests and pinned chunks; reclaimable cache (vLLM's cached
free blocks, idle chunks) is not used. ``block_categories`` puts every usable block in exactly one
category; ``metrics`` is what the scheduler publishes for the API server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ascend_mepic.core.chunk_cache import ChunkCache
from ascend_mepic.core.counters import MepicCounters
from ascend_mepic.core.kv_settings import KVSettings
from ascend_mepic.core.request_intake import RequestState
from ascend_mepic.tier.index import recompute_share
from ascend_mepic.vllm_integration.core_types import BlockPool
from ascend_mepic.vllm_integration.kv_cache import (
    num_cached_free_blocks,
    num_usable_blocks,
)

if TYPE_CHECKING:
    from ascend_mepic.core.chunk_transfers import HostStoreStaging, TierTransfers


class KVAccounting:
    """Reads the pool, the chunk cache and the manager's parts; changes nothing."""

    def __init__(
        self,
        *,
        settings: KVSettings,
        counters: MepicCounters,
        block_pool: BlockPool,
        chunk_cache: ChunkCache,
        states: dict[str, RequestState],
        staging: HostStoreStaging,
        tier_transfers: TierTransfers,
    ) -> None:
        self.settings = settings
        self.counters = counters
        self.block_pool = block_pool
        self.chunk_cache = chunk_cache
        self.states = states
        self.staging = staging
        self.tier_transfers = tier_transfers

    def usage(self) -> float:
        """Blocks held by live requests and pinned chunks; idle chunks are reclaimable cache."""
        total = num_usable_blocks(self.block_pool)
        return self.num_used_blocks() / total if total else 0.0

    def num_used_blocks(self) -> int:
        free = self.block_pool.get_num_free_blocks()
        idle = self.chunk_cache.num_blocks(referenced=False)
        return num_usable_blocks(self.block_pool) - free - idle

    def block_categories(self) -> dict[str, int]:
        """Every usable block in exactly one category (they add up to the pool size minus one)."""
        prefix_cached_free = num_cached_free_blocks(self.block_pool)
        referenced_chunk = self.chunk_cache.num_blocks(referenced=True)
        scratch = (
            sum(len(st.scratch) for st in self.states.values())
            + self.staging.num_blocks()
            + self.tier_transfers.num_blocks()
        )
        used = self.num_used_blocks()
        cats = {
            "free": self.block_pool.get_num_free_blocks() - prefix_cached_free,
            "prefix_cached": prefix_cached_free,
            "chunk_shared_referenced": referenced_chunk,
            "chunk_shared_idle": self.chunk_cache.num_blocks(referenced=False),
            # The padded layout's categories, 0 since every request's private blocks follow the
            # packed layout (prompt and chunk tokens mixed: prompt_private); kept for dashboards.
            "chunk_first_private": 0,
            "chunk_private": 0,
            "compile_scratch": scratch,
        }
        cats["prompt_private"] = used - referenced_chunk - scratch
        return cats

    def tier_metrics(self) -> dict[str, Any]:
        """Tier hits, loads, fallbacks, bytes moved and the load-or-compute decisions."""
        tier = self.settings.tier
        if tier is None:
            return {}
        c = self.counters
        worker = tier.worker_state()
        costs = worker.get("load_s_per_token", {})
        compute = worker.get("compute_s_per_token")
        out: dict[str, Any] = {
            "tier_loads_issued": c.tier_loads_issued,
            "tier_loads": c.tier_loads,
            "tier_fallbacks": c.tier_fallbacks,
            "tier_decided_load": c.tier_decided_load,
            "tier_decided_compute": c.tier_decided_compute,
            "tier_puts_issued": c.tier_puts_issued,
        }
        if compute:
            out["tier_compute_us_per_token"] = round(compute * 1e6, 3)
        for backend, cost in costs.items():
            out[f"tier_load_us_per_token_{backend}"] = round(cost * 1e6, 3)
            out[f"tier_recompute_share_{backend}"] = round(recompute_share(cost, compute), 4)
        out.update({f"tier_worker_{k}": v for k, v in worker.get("counters", {}).items()})
        return out

    def metrics(self) -> dict[str, int]:
        c, s = self.counters, self.chunk_cache.stats
        store = self.settings.store
        return {
            **self.tier_metrics(),
            "chunk_hits": c.chunk_hits,
            "chunk_misses": c.chunk_misses,
            "chunk_evictions": s.evictions,
            "tokens_reused": c.tokens_reused,
            "tokens_computed": c.tokens_computed,
            "requests_admitted": c.requests_admitted,
            "admissions_deferred": c.admissions_deferred,
            "blocks_loaded": c.blocks_loaded,
            "host_store_chunks": store.num_chunks() if store else 0,
            "resident_chunks": len(self.chunk_cache.entries),
            "pinned_chunks": sum(e.pinned for e in self.chunk_cache.entries.values()),
            # the pinned-KV quota: blocks held against each limit (``RequestIntake``)
            "pinned_blocks": self.chunk_cache.num_pinned_blocks(),
            "pinned_blocks_limit": int(
                num_usable_blocks(self.block_pool) * self.settings.pinned_fraction
            ),
            "pinned_blocks_top_salt": self.chunk_cache.max_tenant_pinned_blocks(),
            "pinned_blocks_per_salt_limit": self.settings.pinned_per_salt,
            **{f"blocks_{k}": v for k, v in self.block_categories().items()},
        }
