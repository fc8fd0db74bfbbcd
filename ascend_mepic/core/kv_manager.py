"""MepicKVCacheManager: vLLM's KVCacheManager, made chunk-aware.

Requests without MEPIC segments go through vLLM's own code unchanged. For a MEPIC request (one
registered with ``track``) the manager builds its block table from the canonical layout:

* shared placement (MEPIC, naive) uses the packed layout: the request's private stream (prompt
  tokens and each chunk's first tokens, then decode) is packed into private blocks that go
  through vLLM's prefix cache under chained hashes naming the chunks in between; each chunk's
  canonical tokens are the ``ChunkCache``'s, packed back to back with other chunks' in shared
  blocks; a first-time chunk is compiled in the admitting step and becomes READY when the next
  step starts;
* private placement (the baselines) uses the padded layout: every chunk block is a private block
  filled from the host store.

Everything lives in the one BlockPool vLLM built. The request's table is stored in vLLM's own
single-type manager (``req_to_blocks``), so ``get_blocks``, ``free`` and the scheduler's
bookkeeping work unchanged. Only full-attention models with a single KV cache group are supported.

This class is the vLLM-facing surface; the work is done by its parts, data flowing one way
(manager -> parts -> ChunkCache / BlockPool), much as vLLM's own KVCacheManager ->
KVCacheCoordinator -> SingleTypeKVCacheManager -> BlockPool:

* ``RequestIntake`` (request_intake.py): validation, layout, chunk identity, block roles,
  placement and layout-keyed hashes of a request (its ``RequestState``); one class per
  placement, ``PackedIntake`` and ``PaddedIntake``;
* ``Admission`` (admission.py): prefix-cache hits, whole-layout admission, growth, prefix-cache
  insertion, release; one class per placement: ``PackedAdmission`` (shared placement,
  packed_admission.py) and ``PaddedAdmission`` (private and none, padded_admission.py). The
  placement's intake and admission are chosen once, from the policy;
* ``HostStoreStaging`` / ``TierTransfers`` (chunk_transfers.py): host-store and tier transfers;
* ``StepRoom`` (step_room.py): the step's compile room and its compiles;
* ``StepPlanner`` (step_planner.py): each step's ``StepPlan`` from the parts' queues;
* ``MepicCounters`` (counters.py), ``KVAccounting`` (kv_accounting.py): counts, metrics;
* ``KVSettings`` (kv_settings.py): policy, dummy token, host store, tier, limits (frozen).

vLLM internals it touches are in ``ascend_mepic/vllm_integration/kv_cache.py``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager

from ascend_mepic.core.admission import Admission
from ascend_mepic.core.chunk_cache import ChunkCache
from ascend_mepic.core.chunk_events import ChunkEvents
from ascend_mepic.core.chunk_transfers import HostStoreStaging, TierTransfers
from ascend_mepic.core.counters import MepicCounters
from ascend_mepic.core.engine_support import check_kv_cache_supported
from ascend_mepic.core.errors import MepicCapacityError, MepicUnsupportedError
from ascend_mepic.core.identity import ChunkId
from ascend_mepic.core.kv_accounting import KVAccounting
from ascend_mepic.core.kv_settings import KVSettings
from ascend_mepic.core.packed_admission import PackedAdmission
from ascend_mepic.core.padded_admission import PaddedAdmission
from ascend_mepic.core.plan import (
    ExtraSequence,
    RequestPlan,
    StepPlan,
)
from ascend_mepic.core.request_intake import (
    BlockRole,
    Inspected,
    PackedIntake,
    PaddedIntake,
    RequestIntake,
    RequestState,
    mepic_block_hashes,
)
from ascend_mepic.core.segments import Layout
from ascend_mepic.core.step_planner import StepPlanner
from ascend_mepic.core.step_room import StepRoom
from ascend_mepic.vllm_integration.core_types import (
    KVCacheBlock,
    Request,
    RequestStatus,
)
from ascend_mepic.vllm_integration.kv_cache import request_tables, table_block_size

__all__ = [
    "BlockRole",
    "MepicCapacityError",
    "MepicCounters",
    "MepicKVCacheManager",
    "MepicUnsupportedError",
    "RequestState",
    "mepic_block_hashes",
]


class MepicKVCacheManager(KVCacheManager):
    """KVCacheManager with a chunk cache beside the prefix cache in one BlockPool."""

    def __init__(
        self,
        *args: Any,
        hash_fn: Callable[[Any], bytes],
        model_fingerprint: str,
        settings: KVSettings | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        check_kv_cache_supported(self.kv_cache_config)
        self.hash_fn = hash_fn
        self.model_fingerprint = model_fingerprint
        self.counters = MepicCounters()
        self.settings = settings if settings is not None else KVSettings()
        # Chunk compiles run as extra sequences in the admitting step, in the room the step's
        # scheduled requests leave, within the runner's batch (unbounded for kvsim).
        self.room = StepRoom()
        if self.settings.budgets is not None:
            b = self.settings.budgets
            self.room.set_budgets(
                b.tokens, b.seqs, b.compile_token_cap, b.whole_prefills, b.compiles
            )
        self._states: dict[str, RequestState] = {}
        self._single = request_tables(self)  # vLLM's holder of the request block tables
        self.mepic_block_size = table_block_size(self._single)
        self.chunk_cache = ChunkCache(self.block_pool, self.mepic_block_size)
        # Chunk residency as vLLM KV events, published with vLLM's (``take_events``) when
        # ``--kv-events-config`` is on.
        self.chunk_cache.events = ChunkEvents(self.block_pool, self.mepic_block_size)
        common: dict[str, Any] = dict(
            settings=self.settings, block_pool=self.block_pool, chunk_cache=self.chunk_cache
        )
        # The placement, chosen once: packed (shared placement) or padded.
        packed = self.settings.policy.packed
        intake_cls = PackedIntake if packed else PaddedIntake
        self.intake: RequestIntake = intake_cls(
            **common,
            room=self.room,
            block_size=self.mepic_block_size,
            max_model_len=self.max_model_len,
            enable_caching=self.enable_caching,
            hash_fn=hash_fn,
            model_fingerprint=model_fingerprint,
        )
        admission_cls = PackedAdmission if packed else PaddedAdmission
        self.admission: Admission = admission_cls(
            **common,
            room=self.room,
            counters=self.counters,
            tables=self._single,
            block_size=self.mepic_block_size,
            max_model_len=self.max_model_len,
            watermark_blocks=self.watermark_blocks,
        )
        self.staging = HostStoreStaging(
            **common, room=self.room, counters=self.counters, watermark_blocks=self.watermark_blocks
        )
        self.tier_transfers = TierTransfers(
            **common, room=self.room, counters=self.counters, watermark_blocks=self.watermark_blocks
        )
        self.planner = StepPlanner(
            self.room,
            self.admission,
            self.tier_transfers,
            self._states,
            self.settings.dummy_token_id,
        )
        self.accounting = KVAccounting(
            **common,
            counters=self.counters,
            states=self._states,
            staging=self.staging,
            tier_transfers=self.tier_transfers,
        )

    # ---------------------------------------------------------------- settings (read-only)

    @property
    def num_blocks(self) -> int:
        """Usable blocks of the pool (vLLM keeps one null block)."""
        return self.block_pool.num_gpu_blocks - 1

    def compile_room(self) -> tuple[int, int]:
        """(tokens, sequences) one step's compiles can hold."""
        return self.room.max_compile_tokens, self.room.max_compile_seqs

    def take_compile_reserve(self) -> tuple[int, int]:
        """(tokens, sequences) to keep from vLLM's requests this step, for compiles a previous
        step had to defer (see ``StepRoom.take_reserve``)."""
        return self.room.take_reserve()

    @property
    def recent_chunk_blocks(self) -> deque[tuple[str, list[list[int]]]]:
        """Recent admissions' chunk block ids, for operators and tests (bounded)."""
        return self.admission.recent_chunk_blocks

    # ---------------------------------------------------------------- request registration

    def is_tracked(self, request_id: str) -> bool:
        return request_id in self._states

    def inspect(self, request: Request) -> Inspected | None:
        """Validate a segmented request and name its cached chunks; None if it has no segments.

        Raises LayoutError / MepicCapacityError / MepicUnsupportedError before anything is
        allocated, so a bad request never disturbs others.
        """
        return self.intake.inspect(request)

    def track(self, request: Request) -> bool:
        """Register a request carrying ``extra_args[EXTRA_ARGS_KEY]``; False if it has none.

        The request arrives with its real prompt tokens and segment lengths. After validation
        (``inspect``) the engine request is rewritten to its in-context tokens only, in order:
        prompt tokens and the chunk tokens the policy computes in context (for MEPIC each chunk's
        first 16). Those are all vLLM schedules for it; other chunk tokens are shared,
        loaded, or compiled as separate sequences. Policies that load chunk KV must have their
        chunks stored first (``stage``).
        """
        found = self.intake.inspect(request)
        if found is None:
            return False
        self._states[request.request_id] = self.intake.build(request, *found)
        return True

    def forget(self, request_id: str) -> None:
        """Drop a tracked request that was never allocated (e.g. rejected at admission)."""
        st = self._states.pop(request_id, None)
        assert st is None or not st.allocated
        self.chunk_cache.release_pins(request_id)

    def get_plan(self, request_id: str) -> RequestPlan | None:
        st = self._states.get(request_id)
        return st.plan if st else None

    # ---------------------------------------------------------------- host store and tier

    def chunks_stored(self, chunk_ids: dict[int, ChunkId | None]) -> bool:
        """Whether every chunk a loading policy copies from is in the host store."""
        return self.staging.chunks_stored(chunk_ids)

    def stage(self, request: Request, layout: Layout, chunk_ids: dict[int, ChunkId | None]) -> bool:
        """Issue compiles for a loading policy's chunks missing from the host store; True once
        all are stored (see ``HostStoreStaging.stage``)."""
        return self.staging.stage(request, layout, chunk_ids)

    def tier_wanted(self, chunk_ids: dict[int, ChunkId | None], count: bool = False) -> bool:
        """Must a request wait for tier loads? ``count``: record the decisions."""
        return self.tier_transfers.wanted(chunk_ids, count)

    def stage_tier_loads(
        self,
        layout: Layout,
        chunk_ids: dict[int, ChunkId | None],
        tenant: str | None = None,
        anchor: tuple[int, ...] = (),
    ) -> None:
        """Issue loads for a staged request's chunks that are in the tier but not in the pool
        (placed in ``tenant``'s blocks: the request's cache salt; ``anchor``: the one its chunk
        identities name)."""
        self.tier_transfers.stage_loads(layout, chunk_ids, tenant, anchor)

    def take_step_plan(
        self, step: int, new_request_ids: Iterable[str]
    ) -> tuple[StepPlan, list[ExtraSequence]]:
        """This step's plan for the workers and its extra sequences, taken once
        (``StepPlanner.take``)."""
        return self.planner.take(step, new_request_ids)

    def unpin_chunks(self, request: Request) -> int:
        """Unpin the chunks a control request names; returns how many. Unpinned chunks stay
        resident and follow the LRU like any idle chunk."""
        return self.chunk_cache.unpin_all(self.intake.named_chunks(request))

    # ---------------------------------------------------------------- vLLM's KVCacheManager API

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int, int]:
        st = self._states.get(request.request_id)
        if st is None:
            return super().get_computed_blocks(request)
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        hits = self.admission.longest_hit(request, st)
        return self.create_kv_cache_blocks((hits,)), self.admission.hit_tokens(st, len(hits)), 0

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
    ) -> KVCacheBlocks | None:
        # Every scheduled request's tokens count in the step's batch, beside its compiles. A
        # running request is scheduled before any compile of the step: it always fits.
        running = request.status is RequestStatus.RUNNING
        if not self.room.claim(request.request_id, num_new_tokens, force=running):
            self.counters.admissions_deferred += 1  # the step's compiles filled the batch
            return None
        st = self._states.get(request.request_id)
        if st is None:
            blocks = super().allocate_slots(
                request,
                num_new_tokens,
                num_new_computed_tokens=num_new_computed_tokens,
                new_computed_blocks=new_computed_blocks,
                num_lookahead_tokens=num_lookahead_tokens,
                num_external_computed_tokens=num_external_computed_tokens,
                delay_cache_blocks=delay_cache_blocks,
                num_encoder_tokens=num_encoder_tokens,
                full_sequence_must_fit=full_sequence_must_fit,
                reserved_blocks=reserved_blocks,
                has_scheduled_reqs=has_scheduled_reqs,
            )
        elif num_external_computed_tokens:
            raise MepicUnsupportedError("KV connectors are not supported with MEPIC requests yet")
        else:
            new_blocks = self.admission.allocate(
                request,
                st,
                num_new_tokens,
                num_new_computed_tokens,
                new_computed_blocks,
                num_lookahead_tokens,
                delay_cache_blocks,
                reserved_blocks,
                has_scheduled_reqs,
            )
            blocks = None if new_blocks is None else self.create_kv_cache_blocks((new_blocks,))
        if blocks is None:
            self.room.release(request.request_id)
        return blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        st = self._states.get(request.request_id)
        if st is None:
            super().cache_blocks(request, num_computed_tokens)
        elif st.allocated and self.enable_caching:
            self.admission.cache(request, st, num_computed_tokens)

    # ---------------------------------------------------------------- steps and release

    def step_finished(self, scheduled_ids: Iterable[str] | None = None) -> None:
        """The step's forward pass ran: its compiles are in the cache, their scratch is free;
        with the scheduled ids (from the engine's output), its tier loads became resident or
        are dropped.

        Called before finished requests are released, so a request that ends in the step that
        compiled its chunks leaves them resident (idle) rather than dropping them.
        """
        if scheduled_ids is not None and self.settings.tier is not None:
            self.tier_transfers.step_finished(scheduled_ids)
        self.admission.commit_compiled()
        self.admission.moves = []  # sent with the step that ran (kvsim has no worker to send to)
        self.staging.step_finished()  # the worker saved the host-store compiles after the forward
        self.admission.free_scratch(self._states.values())

    def new_step_starts(self) -> None:
        """A new step: the previous one has run (idempotent with ``step_finished``)."""
        super().new_step_starts()
        self.step_finished()
        self.room.new_step()

    def _release(self, request: Request) -> None:
        self.room.release(request.request_id)  # preempted: not scheduled in this step after all
        if request.is_finished():
            self.chunk_cache.release_pins(request.request_id)
        st = self._states.get(request.request_id)
        if st is None:
            return
        self.admission.release(request.request_id, st)
        if request.is_finished():
            del self._states[request.request_id]

    def free(self, request: Request) -> None:
        self._release(request)
        super().free(request)

    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        self._release(request)
        return super().pop_blocks_for_free(request)

    def reset_prefix_cache(self) -> bool:
        """Evict every idle chunk (``BlockRemoved`` each), then vLLM's reset (which publishes
        ``AllBlocksCleared`` when it succeeds: no block in use, no chunk pinned)."""
        self.chunk_cache.evict_all_idle()
        return super().reset_prefix_cache()

    # ---------------------------------------------------------------- accounting

    @property
    def usage(self) -> float:
        """Blocks held by live requests and pinned chunks; idle chunks are reclaimable cache."""
        return self.accounting.usage()

    def num_used_blocks(self) -> int:
        return self.accounting.num_used_blocks()

    def block_categories(self) -> dict[str, int]:
        """Every usable block in exactly one category (they add up to the pool size minus one)."""
        return self.accounting.block_categories()

    def metrics(self) -> dict[str, int]:
        return {
            **self.accounting.metrics(),
            "chunk_anchor_tokens": len(self.intake.anchors.engine_anchor or ()),
        }
