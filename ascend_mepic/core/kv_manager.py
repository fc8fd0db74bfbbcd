"""MepicKVCacheManager: vLLM's KVCacheManager, made chunk-aware.

Requests without MEPIC segments go through vLLM's own code unchanged. For a MEPIC request (one
registered with ``track``) the manager builds its block table from the canonical layout:

* private blocks (prompt blocks and every chunk's first block) go through vLLM's prefix cache,
  keyed by a hash chain over the padded tokens plus a layout key per block;
* a chunk's blocks after the first are the chunk's canonical blocks, shared through the
  ``ChunkCache``; a first-time chunk gets new canonical blocks plus a scratch block for its
  compile, and becomes READY when the next step starts (its compile ran in this one).

Everything lives in the one BlockPool vLLM built. The request's table is stored in vLLM's own
single-type manager (``req_to_blocks``), so ``get_blocks``, ``free`` and the scheduler's
bookkeeping work unchanged. Only full-attention models with a single KV cache group are supported.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.core.kv_cache_utils import BlockHash, KVCacheBlock, hash_block_tokens
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig
from vllm.v1.request import Request

from ascend_mepic.core.chunk_cache import ChunkCache, ChunkEntry, ChunkState
from ascend_mepic.core.identity import ChunkId, chunk_identity
from ascend_mepic.core.plan import (
    ChunkCompile,
    HostLoad,
    RequestPlan,
    Residency,
    SequencePlacement,
    TierLoad,
)
from ascend_mepic.core.policies import Placement, Policy, parse_policy
from ascend_mepic.core.segments import (
    EXTRA_ARGS_KEY,
    PIN_KEY,
    BlockKind,
    Layout,
    layout_from_real,
)
from ascend_mepic.tier.host_store import HostChunkStore
from ascend_mepic.tier.index import TierIndex, recompute_share
from ascend_mepic.vllm_integration.scheduler import set_prompt

logger = logging.getLogger(__name__)


class MepicCapacityError(ValueError):
    """A request that can never fit the KV pool, even with every idle chunk evicted."""


class MepicUnsupportedError(ValueError):
    """A model or configuration MEPIC's scheduling path cannot serve."""


@dataclass
class MepicCounters:
    chunk_hits: int = 0
    chunk_misses: int = 0
    tokens_reused: int = 0
    tokens_computed: int = 0
    requests_admitted: int = 0
    admissions_deferred: int = 0
    blocks_loaded: int = 0
    tier_loads_issued: int = 0
    tier_loads: int = 0
    tier_fallbacks: int = 0
    tier_decided_load: int = 0
    tier_decided_compute: int = 0
    tier_puts_issued: int = 0


class BlockRole(str, enum.Enum):
    """Where a layout block's KV comes from in one request."""

    PRIVATE = "private"  # computed in the request's context (or a prefix-cache hit)
    SHARED = "shared"  # a chunk's canonical block in the pool, referenced
    LOAD = "load"  # private, filled from the host store, then fresh slots overwritten


@dataclass
class _RequestState:
    """Scheduling-path state of one MEPIC request; survives preemption, dropped when finished."""

    layout: Layout
    chunk_ids: dict[int, ChunkId | None]  # chunk segment -> identity; None if not cached
    roles: list[BlockRole]  # per layout block
    placement: SequencePlacement  # what the worker needs to place its tokens
    compact_slots: list[int] = field(default_factory=list)  # padded index of in-context token i
    compact_before: list[int] = field(default_factory=list)  # in-context tokens before block i
    entries: list[ChunkEntry] = field(default_factory=list)  # acquired, one per occurrence
    scratch: list[KVCacheBlock] = field(default_factory=list)
    plan: RequestPlan | None = None
    pin: bool = False  # pin this request's chunks once allocated (explicit chunk API)

    @property
    def allocated(self) -> bool:
        return self.plan is not None

    @property
    def num_in_context(self) -> int:
        return len(self.compact_slots)

    def padded_end(self, num_tokens: int) -> int:
        """Padded length covering the request's first ``num_tokens`` (in-context, then decode)."""
        if num_tokens <= 0:
            return 0
        if num_tokens <= self.num_in_context:
            return self.compact_slots[num_tokens - 1] + 1
        return self.layout.num_padded_tokens + num_tokens - self.num_in_context


def mepic_block_hashes(
    layout: Layout,
    padded_token_ids: list[int],
    hash_fn: Callable[[Any], bytes],
    cache_salt: str | None,
    policy: str = "mepic",
) -> list[BlockHash]:
    """Prefix-chained hashes of the layout's full blocks, with a layout key on every block.

    The key makes the same tokens under a different segmentation (hence different KV) miss.
    """
    bs = layout.block_size
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for spec in layout.blocks[: len(padded_token_ids) // bs]:
        extra: tuple[Any, ...] = (policy, spec.kind.value, spec.valid_start, spec.valid_end)
        if spec.index == 0 and cache_salt:
            extra = (cache_salt, *extra)
        tokens = padded_token_ids[spec.index * bs : (spec.index + 1) * bs]
        parent = hash_block_tokens(hash_fn, parent, tokens, extra)
        hashes.append(parent)
    return hashes


class MepicKVCacheManager(KVCacheManager):
    """KVCacheManager with a chunk cache beside the prefix cache in one BlockPool."""

    def __init__(
        self,
        *args: Any,
        hash_fn: Callable[[Any], bytes],
        model_fingerprint: str,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._check_supported(self.kv_cache_config)
        self.hash_fn = hash_fn
        self.model_fingerprint = model_fingerprint
        self.chunk_cache = ChunkCache(self.block_pool)
        self.counters = MepicCounters()
        self._states: dict[str, _RequestState] = {}
        self._single = self.coordinator.single_type_managers[0]
        # Chunk compiles run as extra sequences in the admitting step; the scheduler reserves room
        # for them in its token and sequence budgets and sets these (unbounded for kvsim).
        self.compile_token_budget = 1 << 62
        self.compile_seq_budget = 1 << 62
        self._step_tokens_left = self.compile_token_budget
        self._step_seqs_left = self.compile_seq_budget
        self._step_compiles: list[tuple[str, ChunkCompile]] = []
        self._host_loads: list[HostLoad] = []
        # Recent admissions' chunk block ids, for operators and tests (bounded).
        self.recent_chunk_blocks: deque[tuple[str, list[list[int]]]] = deque(maxlen=1024)
        self.mepic_block_size = self._single.block_size
        self.policy: Policy = parse_policy("mepic")
        self.dummy_token_id = 0  # LegoLink-0's dummy token (the model's BOS)
        self.store: HostChunkStore | None = None  # set by the scheduler for loading policies
        # Host-store compiles in flight: chunk -> temporary blocks, freed once the step ran.
        self._store_pending: dict[ChunkId, list[KVCacheBlock]] = {}
        self.tier: TierIndex | None = None  # set by the scheduler when the tier is configured
        self._step_loads: list[TierLoad] = []
        self._loads_in_flight: dict[str, tuple[TierLoad, KVCacheBlock]] = {}
        self._load_seq = 0

    @staticmethod
    def _check_supported(config: KVCacheConfig) -> None:
        groups = config.kv_cache_groups
        if len(groups) != 1:
            raise MepicUnsupportedError(
                f"MEPIC needs a single KV cache group; this model has {len(groups)} "
                "(hybrid or sliding-window models are not supported)"
            )
        spec = groups[0].kv_cache_spec
        if type(spec) is not FullAttentionSpec or spec.sliding_window is not None:
            raise MepicUnsupportedError(
                f"MEPIC supports full attention only, got {type(spec).__name__}"
            )

    # ---------------------------------------------------------------- request registration

    def is_tracked(self, request_id: str) -> bool:
        return request_id in self._states

    def inspect(self, request: Request) -> tuple[Layout, dict[int, ChunkId | None]] | None:
        """Validate a segmented request and name its cached chunks; None if it has no segments.

        Raises LayoutError / MepicCapacityError / MepicUnsupportedError before anything is
        allocated, so a bad request never disturbs others.
        """
        params = request.sampling_params
        extra = params.extra_args if params else None
        if not extra or EXTRA_ARGS_KEY not in extra:
            return None
        if not self.enable_caching:
            raise MepicUnsupportedError("MEPIC requests need prefix caching enabled")
        if params is not None and params.prompt_logprobs is not None:
            raise MepicUnsupportedError("prompt logprobs are not supported for MEPIC requests")
        if request.num_computed_tokens or request.num_output_tokens:
            raise MepicUnsupportedError("a MEPIC request must be registered before it runs")
        layout = layout_from_real(
            list(request.prompt_token_ids or []), extra[EXTRA_ARGS_KEY], self.mepic_block_size
        )
        if layout.num_padded_tokens >= self.max_model_len:
            raise MepicCapacityError(
                f"padded prompt of {layout.num_padded_tokens} tokens leaves no room in the "
                f"model's max_model_len {self.max_model_len}"
            )
        chunk_ids: dict[int, ChunkId | None] = {}
        for span in layout.chunk_spans:
            cached = self.policy.chunk_is_cached(span.num_tokens, layout.block_size)
            chunk_ids[span.segment] = (
                chunk_identity(
                    layout.chunk_tokens(span),
                    layout.block_size,
                    self.model_fingerprint,
                    request.cache_salt,
                )
                if cached
                else None
            )
        self._check_compile_budget(layout, chunk_ids)
        private = self.policy.placement is Placement.PRIVATE
        worst_case = layout.num_blocks + (
            1 if private else sum(1 for c in chunk_ids.values() if c is not None)
        )
        usable = self.block_pool.num_gpu_blocks - 1 - self.chunk_cache.num_pinned_blocks()
        if worst_case > usable:
            raise MepicCapacityError(
                f"request needs up to {worst_case} KV blocks (layout {layout.num_blocks} + "
                f"compile scratch) but the pool has only {usable} usable blocks"
            )
        return layout, chunk_ids

    def track(self, request: Request) -> bool:
        """Register a request carrying ``extra_args[EXTRA_ARGS_KEY]``; False if it has none.

        The request arrives with its real prompt tokens and segment lengths. After validation
        (``inspect``) the engine request is rewritten to its in-context tokens only, in layout
        order: prompt tokens and the chunk tokens the policy computes in context (for MEPIC each
        chunk's first block). Those are all vLLM schedules for it; other chunk tokens are shared,
        loaded, or compiled as separate sequences. Policies that load chunk KV must have their
        chunks stored first (``stage``).
        """
        found = self.inspect(request)
        if found is None:
            return False
        layout, chunk_ids = found
        extra = request.sampling_params.extra_args
        bs, policy = layout.block_size, self.policy
        roles = [BlockRole.PRIVATE] * layout.num_blocks
        fresh: set[int] = set()
        for ci, span in enumerate(layout.chunk_spans):
            chunk_id = chunk_ids[span.segment]
            base = span.first_block * bs + span.pad
            if chunk_id is None:
                fresh.update(range(base, base + span.num_tokens))
                continue
            scores = self.store.scores(chunk_id) if policy.needs_scores else None
            offsets = policy.fresh_tokens(ci, span.num_tokens, bs, scores)
            fresh.update(base + o for o in offsets)
            for j in range(span.num_blocks):
                b = span.first_block + j
                if policy.placement is Placement.PRIVATE:
                    roles[b] = BlockRole.LOAD
                elif j > 0 or policy.keeps_first_block:
                    roles[b] = BlockRole.SHARED
                elif policy.kind == "mepic-k":
                    roles[b] = BlockRole.LOAD
        compact_slots = sorted(
            slot
            for spec in layout.blocks
            for slot in range(spec.index * bs + spec.valid_start, spec.index * bs + spec.valid_end)
            if spec.kind is BlockKind.PROMPT or slot in fresh
        )
        compact_before = [0] * (layout.num_blocks + 1)
        for slot in compact_slots:
            compact_before[slot // bs + 1] += 1
        for i in range(layout.num_blocks):
            compact_before[i + 1] += compact_before[i]
        padded = layout.padded_token_ids()
        set_prompt(request, [padded[i] for i in compact_slots])
        # Layout-keyed hashes of the prompt's full blocks; decode blocks are not prefix-cached.
        request.block_hashes = mepic_block_hashes(
            layout, padded, self.hash_fn, request.cache_salt, policy.name
        )
        request.max_tokens = min(request.max_tokens, self.max_model_len - layout.num_padded_tokens)
        placement = SequencePlacement(
            segment_lengths=tuple((kind, n) for kind, n in layout.segment_lengths()),
            num_in_context=len(compact_slots),
            fresh_slots=tuple(compact_slots) if policy.kind != "mepic" else None,
            blend=(policy.ratio, policy.check_layer) if policy.dynamic else None,
        )
        self._states[request.request_id] = _RequestState(
            layout,
            chunk_ids,
            roles,
            placement,
            compact_slots,
            compact_before,
            pin=bool(extra.get(PIN_KEY)),
        )
        return True

    # ---------------------------------------------------------------- staging (loading policies)

    def chunks_stored(self, chunk_ids: dict[int, ChunkId | None]) -> bool:
        """Whether every chunk a loading policy copies from is in the host store."""
        return all(c is None or self.store.contains(c) for c in chunk_ids.values())

    def stage(self, request: Request, layout: Layout, chunk_ids: dict[int, ChunkId | None]) -> bool:
        """Make sure the chunks a loading policy copies from are in the host store.

        ``layout`` and ``chunk_ids`` are the request's ``inspect`` result (computed once at
        arrival). Issues the missing chunks' compiles (within this step's compile room, into
        temporary blocks the worker saves from after the forward pass); True once all are stored.
        """
        ready = True
        for span in layout.chunk_spans:
            chunk_id = chunk_ids[span.segment]
            if chunk_id is None or self.store.contains(chunk_id):
                continue
            ready = False
            if chunk_id in self._store_pending:
                continue
            tokens = layout.chunk_tokens(span)
            if self.policy.kind == "mepic-k":  # only the canonical first block is stored
                first = span.num_tokens - layout.block_size * (span.num_blocks - 1)
                tokens, num_blocks = tokens[:first], 1
            else:
                num_blocks = span.num_blocks
            dummy = (self.dummy_token_id,) * self.policy.dummy_tokens
            table_len = num_blocks + (1 if dummy else 0)
            if (
                len(tokens) + len(dummy) > self._step_tokens_left
                or self._step_seqs_left < 1
                or table_len
                > self.block_pool.get_num_free_blocks()
                - self.watermark_blocks
                + self.chunk_cache.lru.evictable_blocks()
            ):
                self.counters.admissions_deferred += 1
                continue
            if table_len > self.block_pool.get_num_free_blocks() - self.watermark_blocks:
                self.chunk_cache.evict_until_free(table_len + self.watermark_blocks)
            blocks = self.block_pool.get_new_blocks(table_len)
            self._store_pending[chunk_id] = blocks
            pad = num_blocks * layout.block_size - len(tokens)
            self._step_compiles.append(
                (
                    request.request_id,
                    ChunkCompile(
                        chunk_id,
                        tokens,
                        pad,
                        tuple(b.block_id for b in blocks),
                        dummy_tokens=dummy,
                        store_blocks=num_blocks,
                        store_scores=self.policy.needs_scores,
                    ),
                )
            )
            self._step_tokens_left -= len(tokens) + len(dummy)
            self._step_seqs_left -= 1
            self.counters.tokens_computed += len(tokens) + len(dummy)
            self.counters.chunk_misses += 1
        return ready

    # ---------------------------------------------------------------- the off-device tier

    def tier_wanted(self, chunk_ids: dict[int, ChunkId | None], count: bool = False) -> bool:
        """Must a request wait for tier loads? (a chunk of it is loading, or is missing from
        the pool but in the tier, where loading beats compiling). ``count``: record decisions."""
        if self.tier is None:
            return False
        wanted = False
        for chunk_id in {c for c in chunk_ids.values() if c is not None}:
            entry = self.chunk_cache.lookup(chunk_id)
            if entry is not None:
                wanted |= entry.state is ChunkState.LOADING
                continue
            backend = self.tier.where(chunk_id)
            if backend is None:
                continue
            load = self.tier.should_load(backend)
            wanted |= load
            if count:
                if load:
                    self.counters.tier_decided_load += 1
                else:
                    self.counters.tier_decided_compute += 1
        return wanted

    def stage_tier_loads(self, layout: Layout, chunk_ids: dict[int, ChunkId | None]) -> None:
        """Issue loads for a staged request's chunks that are in the tier but not in the pool.

        Each load allocates the chunk's canonical blocks (state LOADING: no request may use
        them) and a scratch block for its 1-token carrier sequence, within this step's sequence
        room and free blocks; a load that does not fit waits for a later step.
        """
        assert self.tier is not None
        keep_first = self.policy.keeps_first_block
        for span in layout.chunk_spans:
            chunk_id = chunk_ids[span.segment]
            if chunk_id is None or self.chunk_cache.lookup(chunk_id) is not None:
                continue
            backend = self.tier.where(chunk_id)
            if backend is None or not self.tier.should_load(backend):
                continue
            num_blocks = span.num_blocks - (0 if keep_first else 1)
            need = num_blocks + 1
            free = self.block_pool.get_num_free_blocks() - self.watermark_blocks
            if (
                self._step_seqs_left < 1
                or self._step_tokens_left < 1
                or need > free + self.chunk_cache.lru.evictable_blocks()
            ):
                self.counters.admissions_deferred += 1
                continue
            if need > free:
                self.chunk_cache.evict_until_free(need + self.watermark_blocks)
            entry = self.chunk_cache.create_loading(chunk_id, span.num_tokens, num_blocks)
            scratch = self.block_pool.get_new_blocks(1)[0]
            self._load_seq += 1
            load = TierLoad(
                f"mepic-load-{self._load_seq}-{chunk_id[:16]}",
                chunk_id,
                tuple(entry.block_ids),
                span.num_tokens,
                scratch.block_id,
            )
            self._step_loads.append(load)
            self._loads_in_flight[load.io_id] = (load, scratch)
            self._step_seqs_left -= 1
            self._step_tokens_left -= 1
            self.counters.tier_loads_issued += 1

    def take_step_loads(self) -> list[TierLoad]:
        out, self._step_loads = self._step_loads, []
        return out

    def tier_step_finished(self, scheduled_ids: Iterable[str]) -> None:
        """Loads that ran in the finished step: verified ones become resident, others are
        dropped (their chunk is compiled by the next request that needs it)."""
        assert self.tier is not None
        for io_id in [i for i in scheduled_ids if i in self._loads_in_flight]:
            load, scratch = self._loads_in_flight.pop(io_id)
            outcome = self.tier.dir.take_result(io_id) or {}
            result = outcome.get(load.chunk_id, "error: no result from the worker")
            self.block_pool.free_blocks([scratch])
            entry = self.chunk_cache.lookup(load.chunk_id)
            assert entry is not None and entry.state is ChunkState.LOADING
            self.chunk_cache.finish_loading(entry, ok=result == "ok")
            if result == "ok":
                self.counters.tier_loads += 1
            else:
                self.tier.failed.add(load.chunk_id)
                self.counters.tier_fallbacks += 1
                logger.warning("MEPIC tier load of %s failed: %s", load.chunk_id[:12], result)

    def wants_offload(self, chunk_id: ChunkId) -> bool:
        """Should this compile's canonical KV go to the tier (write-through on compile)?"""
        if self.tier is None or self.tier.config.offload != "compile":
            return False
        if self.tier.where(chunk_id) is not None:
            return False  # already there (compiled because compiling was cheaper)
        self.tier.failed.discard(chunk_id)  # a bad entry is replaced by this fresh one
        self.counters.tier_puts_issued += 1
        return True

    def unpin_chunks(self, request: Request) -> int:
        """Unpin the chunks of a control request (its segments name them); returns how many.

        Unpinned chunks stay resident and follow the LRU like any idle chunk.
        """
        extra = request.sampling_params.extra_args if request.sampling_params else None
        layout = layout_from_real(
            list(request.prompt_token_ids or []),
            (extra or {}).get(EXTRA_ARGS_KEY),
            self.mepic_block_size,
        )
        count = 0
        for span in layout.chunk_spans:
            chunk_id = chunk_identity(
                layout.chunk_tokens(span),
                layout.block_size,
                self.model_fingerprint,
                request.cache_salt,
            )
            entry = self.chunk_cache.lookup(chunk_id)
            if entry is not None and entry.pinned:
                self.chunk_cache.unpin(entry)
                count += 1
        return count

    def _check_compile_budget(self, layout: Layout, chunk_ids: dict[int, ChunkId | None]) -> None:
        unique = {cid: span for span in layout.chunk_spans if (cid := chunk_ids[span.segment])}
        tokens = sum(span.num_tokens for span in unique.values())
        if tokens > self.compile_token_budget or len(unique) > self.compile_seq_budget:
            raise MepicCapacityError(
                f"request has {len(unique)} chunks with {tokens} tokens to compile, more than one "
                f"step can compile ({self.compile_seq_budget} sequences, "
                f"{self.compile_token_budget} tokens); raise --max-num-batched-tokens"
            )

    def take_step_compiles(self) -> list[tuple[str, ChunkCompile]]:
        """(request id, compile) for every chunk first allocated in this step, once."""
        out, self._step_compiles = self._step_compiles, []
        return out

    def take_host_loads(self) -> list[HostLoad]:
        """Host-store copies into private blocks allocated in this step, once."""
        out, self._host_loads = self._host_loads, []
        return out

    def placement(self, request_id: str) -> SequencePlacement | None:
        """How the worker places a tracked request's tokens; None for other requests."""
        st = self._states.get(request_id)
        return st.placement if st is not None else None

    def get_plan(self, request_id: str) -> RequestPlan | None:
        st = self._states.get(request_id)
        return st.plan if st else None

    # ---------------------------------------------------------------- prefix lookup

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int, int]:
        st = self._states.get(request.request_id)
        if st is None:
            return super().get_computed_blocks(request)
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        hits = self._longest_hit(request, st)
        return self.create_kv_cache_blocks((hits,)), st.compact_before[len(hits)], 0

    def _longest_hit(self, request: Request, st: _RequestState) -> list[KVCacheBlock]:
        """Leading blocks already in the pool: prefix-cache hits and resident chunk blocks."""
        hits: list[KVCacheBlock] = []
        # The last layout block holds the last prompt token, which is always recomputed.
        for i in range(st.layout.num_blocks - 1):
            block = self._resident_block(request, st, i)
            if block is None:
                break
            hits.append(block)
        return hits

    def _entry_block(self, st: _RequestState, entry: ChunkEntry, i: int) -> KVCacheBlock:
        """The canonical pool block of layout block ``i`` (a chunk block) in ``entry``."""
        span = st.layout.spans[st.layout.blocks[i].segment]
        return entry.blocks[i - span.first_block - (0 if self.policy.keeps_first_block else 1)]

    def _resident_block(self, request: Request, st: _RequestState, i: int) -> KVCacheBlock | None:
        if st.roles[i] is BlockRole.SHARED:
            spec = st.layout.blocks[i]
            entry = self.chunk_cache.lookup(st.chunk_ids[spec.segment] or "")
            if entry is None:
                return None
            return self._entry_block(st, entry, i)
        if i >= len(request.block_hashes):
            return None
        cached = self.block_pool.get_cached_block(request.block_hashes[i], [0])
        return cached[0] if cached else None

    # ---------------------------------------------------------------- allocation

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
        st = self._states.get(request.request_id)
        if st is None:
            return super().allocate_slots(
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
        if num_external_computed_tokens:
            raise MepicUnsupportedError("KV connectors are not supported with MEPIC requests yet")
        total_computed = request.num_computed_tokens + num_new_computed_tokens
        # Everything below works in the padded layout; vLLM counts in-context tokens.
        num_need_slot = min(
            st.padded_end(total_computed + num_new_tokens + num_lookahead_tokens),
            self.max_model_len,
        )
        if not st.allocated:
            hits = list(new_computed_blocks.blocks[0]) if new_computed_blocks else []
            # As vLLM does, keep a watermark free when admitting beside running requests.
            headroom = reserved_blocks + (self.watermark_blocks if has_scheduled_reqs else 0)
            new_blocks = self._admit(request, st, hits, num_need_slot, headroom)
        else:
            new_blocks = self._grow(request, st, num_need_slot, reserved_blocks)
        if new_blocks is None:
            return None
        if not delay_cache_blocks:
            num_to_cache = min(total_computed + num_new_tokens, request.num_tokens)
            self._cache_private(request, st, st.padded_end(num_to_cache))
        return self.create_kv_cache_blocks((new_blocks,))

    def _admit(
        self,
        request: Request,
        st: _RequestState,
        hits: list[KVCacheBlock],
        num_need_slot: int,
        reserved: int,
    ) -> list[KVCacheBlock] | None:
        """First allocation: the whole layout at once, or nothing (the request keeps waiting)."""
        layout, bs = st.layout, self.mepic_block_size
        n_hit = len(hits)
        num_table = max(layout.num_blocks, -(-num_need_slot // bs))
        # Residency of each chunk occurrence, deciding what must be allocated.
        reused: dict[int, ChunkEntry] = {}  # chunk segment -> resident entry
        new_chunks: dict[ChunkId, list[int]] = {}  # first-time chunk -> its segments
        residency: list[Residency] = []
        private = self.policy.placement is Placement.PRIVATE
        for span in layout.chunk_spans:
            chunk_id = st.chunk_ids[span.segment]
            if chunk_id is None:
                residency.append(Residency.SINGLE_BLOCK)
                continue
            if private:
                residency.append(Residency.HOST)
                continue
            entry = self.chunk_cache.lookup(chunk_id)
            if entry is not None and entry.state is ChunkState.LOADING:
                self.counters.admissions_deferred += 1  # usable once the load is verified
                return None
            if entry is not None:
                reused[span.segment] = entry
                residency.append(
                    Residency.RESIDENT if entry.state is ChunkState.READY else Residency.IN_FLIGHT
                )
            else:
                first = chunk_id not in new_chunks
                new_chunks.setdefault(chunk_id, []).append(span.segment)
                residency.append(Residency.COMPILE if first else Residency.IN_FLIGHT)
        new_chunk_blocks = sum(
            layout.spans[segs[0]].num_blocks for segs in new_chunks.values()
        )  # canonical blocks plus one scratch block each (naive: all canonical, no scratch)
        num_new_private = sum(
            1
            for i in range(n_hit, num_table)
            if i >= len(st.roles) or st.roles[i] is not BlockRole.SHARED
        )
        compile_tokens = sum(layout.spans[segs[0]].num_tokens for segs in new_chunks.values())
        if compile_tokens > self._step_tokens_left or len(new_chunks) > self._step_seqs_left:
            self.counters.admissions_deferred += 1  # this step's compile room is used up
            return None
        free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        need = num_new_private + new_chunk_blocks + free_hits
        protect = list(reused.values())
        free = self.block_pool.get_num_free_blocks() - reserved
        if need > free + self.chunk_cache.lru.evictable_blocks(protect):
            self.counters.admissions_deferred += 1
            return None
        if need > free:
            self.chunk_cache.evict_until_free(need + reserved, protect)

        # Hit blocks and reused chunk blocks first, so new allocations cannot take them.
        self.block_pool.touch(hits)
        for entry in reused.values():
            self.chunk_cache.acquire(entry)
            st.entries.append(entry)
        created: dict[ChunkId, ChunkEntry] = {}
        compiles: list[ChunkCompile] = []
        for chunk_id, segs in new_chunks.items():
            span = layout.spans[segs[0]]
            keep_first = self.policy.keeps_first_block
            entry = self.chunk_cache.create(
                chunk_id,
                span.num_tokens,
                span.num_blocks - (0 if keep_first else 1),
                request.request_id,
            )
            scratch = [] if keep_first else self.block_pool.get_new_blocks(1)
            st.scratch.extend(scratch)
            created[chunk_id] = entry
            compiles.append(
                ChunkCompile(
                    chunk_id,
                    layout.chunk_tokens(span),
                    span.pad,
                    (*(b.block_id for b in scratch), *entry.block_ids),
                )
            )
            for _ in segs:
                self.chunk_cache.acquire(entry)
                st.entries.append(entry)
            for seg in segs:
                reused[seg] = entry

        table = list(hits)
        new_blocks: list[KVCacheBlock] = []
        shared_touch: list[KVCacheBlock] = []
        loads: list[list[Any]] = []
        for i in range(n_hit, num_table):
            role = st.roles[i] if i < len(st.roles) else BlockRole.PRIVATE
            if role is BlockRole.SHARED:
                block = self._entry_block(st, reused[layout.blocks[i].segment], i)
                shared_touch.append(block)
                table.append(block)
                continue
            block = self.block_pool.get_new_blocks(1)[0]
            new_blocks.append(block)
            table.append(block)
            if role is BlockRole.LOAD:
                span = layout.spans[layout.blocks[i].segment]
                offset = i - span.first_block if private else 0
                loads.append([st.chunk_ids[span.segment], offset, block.block_id])
        self.block_pool.touch(shared_touch)
        self._single.req_to_blocks[request.request_id] = table
        self._single.num_cached_block[request.request_id] = n_hit
        self._host_loads.extend(HostLoad(c, offset, block) for c, offset, block in loads)
        self.counters.blocks_loaded += len(loads)

        compute = tuple(
            i for i in range(n_hit, layout.num_blocks) if st.roles[i] is not BlockRole.SHARED
        )
        st.plan = RequestPlan(
            request.request_id,
            layout,
            tuple(b.block_id for b in table[: layout.num_blocks]),
            n_hit,
            compute,
            tuple(compiles),
            tuple(residency),
        )
        self._count_admission(st, residency)
        self.recent_chunk_blocks.append(
            (
                request.request_id,
                [
                    [b.block_id for b in table[sp.first_block : sp.first_block + sp.num_blocks]]
                    for sp in layout.chunk_spans
                ],
            )
        )
        if st.pin:
            for entry in st.entries:
                self.chunk_cache.pin(entry)
        self._step_tokens_left -= compile_tokens
        self._step_seqs_left -= len(compiles)
        self._step_compiles.extend((request.request_id, c) for c in compiles)
        return table[n_hit:]

    def _count_admission(self, st: _RequestState, residency: list[Residency]) -> None:
        c = self.counters
        c.requests_admitted += 1
        c.chunk_hits += sum(r in (Residency.RESIDENT, Residency.IN_FLIGHT) for r in residency)
        c.chunk_misses += sum(r is Residency.COMPILE for r in residency)
        assert st.plan is not None
        if self.policy.kind == "mepic":
            computed = st.plan.num_compute_tokens
            reused = st.plan.num_reused_tokens
        else:
            in_context = st.num_in_context - st.compact_before[st.plan.num_prefix_hit_blocks]
            computed = in_context + sum(len(x.token_ids) for x in st.plan.compiles)
            # A compile's first-block tokens are also recomputed in context, unless the policy
            # keeps the canonical first block (naive).
            overlap = 0 if self.policy.keeps_first_block else self.mepic_block_size
            reused = (
                st.layout.num_real_tokens
                - in_context
                - sum(len(x.token_ids) - max(0, overlap - x.pad) for x in st.plan.compiles)
            )
        c.tokens_computed += computed
        c.tokens_reused += reused

    def _grow(
        self, request: Request, st: _RequestState, num_need_slot: int, reserved: int
    ) -> list[KVCacheBlock] | None:
        """Later steps (decode, or the rest of a split prefill): plain private blocks."""
        table = self._single.req_to_blocks[request.request_id]
        missing = -(-num_need_slot // self.mepic_block_size) - len(table)
        if missing <= 0:
            return []
        free = self.block_pool.get_num_free_blocks() - reserved
        if missing > free + self.chunk_cache.lru.evictable_blocks(st.entries):
            return None
        if missing > free:
            self.chunk_cache.evict_until_free(missing + reserved, st.entries)
        new_blocks = self.block_pool.get_new_blocks(missing)
        table.extend(new_blocks)
        return new_blocks

    def _cache_private(self, request: Request, st: _RequestState, padded_end: int) -> None:
        """Insert full private blocks into vLLM's prefix cache; canonical blocks stay out."""
        rid = request.request_id
        num_cached = self._single.num_cached_block.get(rid, 0)
        num_full = min(padded_end // self.mepic_block_size, len(request.block_hashes))
        if num_full <= num_cached:
            return
        # Private-placement baselines do not combine chunk KV with prefix caching (their own
        # systems cannot; CacheBlend's selection even depends on later chunks): only the
        # prompt blocks before the first chunk enter the prefix cache.
        limit = num_full
        if self.policy.placement is Placement.PRIVATE and st.layout.chunk_spans:
            limit = min(num_full, st.layout.chunk_spans[0].first_block)
        mask = [
            i < limit and (i >= len(st.roles) or st.roles[i] is not BlockRole.SHARED)
            for i in range(num_cached, num_full)
        ]
        self.block_pool.cache_full_blocks(
            request=request,
            blocks=self._single.req_to_blocks[rid],
            num_cached_blocks=num_cached,
            num_full_blocks=num_full,
            block_size=self.mepic_block_size,
            kv_cache_group_id=0,
            block_mask=mask,
        )
        self._single.num_cached_block[rid] = num_full

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        st = self._states.get(request.request_id)
        if st is None:
            super().cache_blocks(request, num_computed_tokens)
        elif st.allocated and self.enable_caching:
            self._cache_private(request, st, st.padded_end(num_computed_tokens))

    # ---------------------------------------------------------------- steps and release

    def step_finished(self) -> None:
        """The step's forward pass ran: its compiles are in the cache, their scratch is free.

        Called before finished requests are released, so a request that ends in the step that
        compiled its chunks leaves them resident (idle) rather than dropping them.
        """
        for entry in self.chunk_cache.commit_pending():
            if entry.refs == 0 and not entry.pinned:  # its only user already left
                self.chunk_cache.lru.add(entry)
        for blocks in self._store_pending.values():  # the worker saved them after the forward
            self.block_pool.free_blocks(blocks)
        self._store_pending = {}
        for st in self._states.values():
            if st.scratch:
                self.block_pool.free_blocks(st.scratch)
                st.scratch = []

    def new_step_starts(self) -> None:
        """A new step: the previous one has run (idempotent with ``step_finished``)."""
        super().new_step_starts()
        self.step_finished()
        self._step_tokens_left = self.compile_token_budget
        self._step_seqs_left = self.compile_seq_budget
        self._step_compiles = []

    def _release(self, request: Request) -> None:
        st = self._states.get(request.request_id)
        if st is None:
            return
        if st.allocated:
            self.chunk_cache.drop_pending(request.request_id)
            for entry in st.entries:
                self.chunk_cache.release(entry)
            if st.scratch:
                self.block_pool.free_blocks(st.scratch)
            st.entries, st.scratch, st.plan = [], [], None
        if request.is_finished():
            del self._states[request.request_id]

    def free(self, request: Request) -> None:
        self._release(request)
        super().free(request)

    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        self._release(request)
        return super().pop_blocks_for_free(request)

    def forget(self, request_id: str) -> None:
        """Drop a tracked request that was never allocated (e.g. rejected at admission)."""
        st = self._states.pop(request_id, None)
        assert st is None or not st.allocated

    def reset_prefix_cache(self) -> bool:
        self.chunk_cache.evict_all_idle()
        return super().reset_prefix_cache()

    # ---------------------------------------------------------------- accounting

    @property
    def usage(self) -> float:
        """Blocks held by live requests and pinned chunks; idle chunks are reclaimable cache."""
        total = self.block_pool.num_gpu_blocks - 1
        return self.num_used_blocks() / total if total else 0.0

    def num_used_blocks(self) -> int:
        free = self.block_pool.get_num_free_blocks()
        return self.block_pool.num_gpu_blocks - 1 - free - self.chunk_cache.lru.num_blocks

    def block_categories(self) -> dict[str, int]:
        """Every usable block in exactly one category (they add up to the pool size minus one)."""
        pool = self.block_pool
        prefix_cached_free = sum(
            1 for b in pool.blocks if b.ref_cnt == 0 and b.block_hash is not None and not b.is_null
        )
        referenced_chunk = self.chunk_cache.num_blocks(referenced=True)
        scratch = (
            sum(len(st.scratch) for st in self._states.values())
            + sum(len(b) for b in self._store_pending.values())
            + len(self._loads_in_flight)
        )
        chunk_first, chunk_private = set(), 0
        for rid, st in self._states.items():
            table = self._single.req_to_blocks.get(rid, [])
            for spec in st.layout.blocks[: len(table)]:
                if st.roles[spec.index] is BlockRole.SHARED:
                    continue
                if spec.kind is BlockKind.CHUNK_FIRST:
                    chunk_first.add(table[spec.index].block_id)
                elif spec.kind is BlockKind.CHUNK_SHARED:
                    chunk_private += 1  # a private copy of a chunk block (private placement)
        used = self.num_used_blocks()
        cats = {
            "free": pool.get_num_free_blocks() - prefix_cached_free,
            "prefix_cached": prefix_cached_free,
            "chunk_shared_referenced": referenced_chunk,
            "chunk_shared_idle": self.chunk_cache.lru.num_blocks,
            "chunk_first_private": len(chunk_first),
            "chunk_private": chunk_private,
            "compile_scratch": scratch,
        }
        cats["prompt_private"] = (
            used - referenced_chunk - len(chunk_first) - chunk_private - scratch
        )
        return cats

    def tier_metrics(self) -> dict[str, Any]:
        """Tier hits, loads, fallbacks, bytes moved and the load-or-compute decisions."""
        if self.tier is None:
            return {}
        c = self.counters
        worker = self.tier.worker_state()
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
            "host_store_chunks": self.store.num_chunks() if self.store else 0,
            "resident_chunks": len(self.chunk_cache.entries),
            "pinned_chunks": sum(e.pinned for e in self.chunk_cache.entries.values()),
            **{f"blocks_{k}": v for k, v in self.block_categories().items()},
        }
