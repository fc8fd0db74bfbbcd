"""Request intake: validate a segmented request and build its scheduling state.

A request arrives with its real prompt tokens and segment lengths (``extra_args[EXTRA_ARGS_KEY]``).
``RequestIntake.inspect`` checks it before anything is allocated (so a bad request never disturbs
others) and names its cached chunks; ``build`` then rewrites the engine request to its
in-context tokens and their prefix-cache hashes, and returns the ``RequestState`` the rest of the
manager works from: ``PackedIntake`` (shared placement: the private stream) or ``PaddedIntake``
(private placement and none: prompt and fresh chunk tokens), chosen once with the admission.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ascend_mepic.core.anchors import AnchorChooser
from ascend_mepic.core.chunk_cache import ChunkCache, ChunkEntry
from ascend_mepic.core.errors import MepicCapacityError, MepicQuotaError, MepicUnsupportedError
from ascend_mepic.core.identity import ChunkId, chunk_identity
from ascend_mepic.core.kv_settings import KVSettings
from ascend_mepic.core.plan import RequestPlan, SequencePlacement
from ascend_mepic.core.policies import Placement, arrival_layout
from ascend_mepic.core.request_limits import RequestLimits
from ascend_mepic.core.segments import (
    EXTRA_ARGS_KEY,
    PIN_KEY,
    Layout,
    SegmentKind,
    layout_from_real,
    segments_from_real,
)
from ascend_mepic.core.step_room import StepRoom
from ascend_mepic.vllm_integration.block_hasher import vllm_prompt_hashes
from ascend_mepic.vllm_integration.core_types import (
    BlockHash,
    BlockPool,
    KVCacheBlock,
    Request,
    hash_block_tokens,
)
from ascend_mepic.vllm_integration.kv_cache import num_usable_blocks, set_block_hashes
from ascend_mepic.vllm_integration.scheduler_internals import set_prompt


class BlockRole(str, enum.Enum):
    """Where a layout block's KV comes from in one request."""

    PRIVATE = "private"  # computed in the request's context (or a prefix-cache hit)
    SHARED = "shared"  # a chunk's canonical block in the pool, referenced
    LOAD = "load"  # private, filled from the host store, then fresh slots overwritten


class Inspected(NamedTuple):
    """What ``RequestIntake.inspect`` found: the arrival layout, each chunk segment's identity
    (None if not cached) and the anchor those identities name (its chunks compile after it)."""

    layout: Layout
    chunk_ids: dict[int, ChunkId | None]
    anchor: tuple[int, ...]


@dataclass
class RequestState:
    """Scheduling-path state of one MEPIC request; survives preemption, dropped when finished."""

    layout: Layout
    chunk_ids: dict[int, ChunkId | None]  # chunk segment -> identity; None if not cached
    roles: list[BlockRole]  # per layout block
    # What the worker needs to place its tokens (shared placement: set at admission, once the
    # chunks are placed).
    placement: SequencePlacement | None
    num_in_context: int = 0  # tokens computed in the request's context (packed: private stream)
    # Private placement (padded layout) only: layout index of in-context token i, and in-context
    # tokens before entry i.
    compact_slots: list[int] = field(default_factory=list)
    compact_before: list[int] = field(default_factory=list)
    entries: list[ChunkEntry] = field(default_factory=list)  # acquired, one per occurrence
    scratch: list[KVCacheBlock] = field(default_factory=list)
    plan: RequestPlan | None = None
    pin: bool = False  # pin this request's chunks once allocated (explicit chunk API)
    # Packed layout: each chunk's private token count, and the request's private blocks in
    # private-stream order (in-context token i, then decode tokens, sit in block i // B).
    private_tokens: list[int] = field(default_factory=list)
    private_blocks: list[KVCacheBlock] = field(default_factory=list)
    # Private placement: host-store copies per table entry, (entry, chunk id, first chunk token,
    # tokens, first slot): the chunk tokens of each entry, copied before the forward pass.
    host_runs: list[tuple[int, ChunkId, int, int, int]] = field(default_factory=list)
    anchor: tuple[int, ...] = ()  # what its first-time chunks are compiled after (``Inspected``)

    def set_packed_layout(self, layout: Layout) -> None:
        """(Re)lay a packed request out, final once its chunks are placed: the layout and its
        block roles. Its private stream is dense, so no per-slot map is needed."""
        self.layout = layout
        self.num_in_context = layout.num_in_context()
        self.roles = [BlockRole.PRIVATE] * layout.num_blocks
        for sp in layout.chunk_spans:  # per chunk, never per entry: its canonical entries
            self.roles[sp.shared_first : sp.shared_first + sp.num_shared] = [
                BlockRole.SHARED
            ] * sp.num_shared

    @property
    def allocated(self) -> bool:
        return self.plan is not None

    def padded_end(self, num_tokens: int) -> int:
        """Layout length covering the request's first ``num_tokens`` (in-context, then decode)."""
        if num_tokens <= 0:
            return 0
        if num_tokens <= self.num_in_context:
            return self.compact_slots[num_tokens - 1] + 1
        return self.layout.num_padded_tokens + num_tokens - self.num_in_context


def num_plain_blocks(layout: Layout) -> int:
    """Leading blocks that lie wholly in a first prompt segment.

    Both layouts put those tokens at the same slots as the unsegmented prompt, and their KV
    depends on nothing but those tokens (every policy computes them in context), so vLLM's own
    hashes of the request's blocks name them: they are reused rather than hashed again, and a
    request without chunks shares them.
    """
    first = layout.segments[0]
    return len(first.token_ids) // layout.block_size if first.kind is SegmentKind.PROMPT else 0


def mepic_block_hashes(
    layout: Layout,
    padded_token_ids: list[int],
    hash_fn: Callable[[Any], bytes],
    cache_salt: str | None,
    policy: str = "mepic",
    leading: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """Private placement: prefix-chained hashes of the layout's full blocks, with a layout key
    (policy, entry kind and valid range) on every block after the ``leading`` ones (vLLM's
    hashes of the first ``num_plain_blocks``, reused as they are).

    Only blocks before the first chunk are ever inserted (``Admission.cache_private``: the
    baselines' systems do not combine chunk KV with prefix caching), so those blocks hold prompt
    tokens only and their KV depends on nothing but the chain.
    """
    bs = layout.block_size
    hashes: list[BlockHash] = list(leading)
    parent: BlockHash | None = hashes[-1] if hashes else None
    for spec in layout.blocks[len(hashes) : len(padded_token_ids) // bs]:
        extra: tuple[Any, ...] = (policy, spec.kind.value, spec.valid_start, spec.valid_end)
        if spec.index == 0 and cache_salt:
            extra = (cache_salt, *extra)
        tokens = padded_token_ids[spec.index * bs : (spec.index + 1) * bs]
        parent = hash_block_tokens(hash_fn, parent, tokens, extra)
        hashes.append(parent)
    return hashes


def packed_block_hashes(
    layout: Layout,
    chunk_ids: dict[int, ChunkId | None],
    hash_fn: Callable[[Any], bytes],
    cache_salt: str | None,
    policy: str,
    leading: Sequence[BlockHash] = (),
    stream: list[int] | None = None,
) -> list[BlockHash]:
    """Prefix-chained hashes of a packed layout's full private blocks.

    A private block's KV depends on every real token before its last one, including the chunks'
    canonical tokens between private runs; those are named by chunk identity. So each hash chains
    the block's tokens with the segments that start before the block ends and were not named
    yet (kind, length, private tokens, chunk identity), beside the policy (and the salt on the
    first block). The ``leading`` blocks (vLLM's hashes of the first ``num_plain_blocks``) are
    reused as they are; the first segment is then named by the first block hashed here.
    ``stream``: the private stream, when the caller has it.
    """
    bs = layout.block_size
    if stream is None:
        stream = layout.private_token_ids()
    hashes: list[BlockHash] = list(leading)
    first, num_full = len(hashes), len(stream) // bs
    if first >= num_full:
        return hashes
    # Each segment is named by the first hashed block that ends after its start in the stream.
    named: list[list[tuple[Any, ...]]] = [[] for _ in range(num_full - first)]
    done = 0
    for span in layout.spans:
        p = max(done // bs, first) - first
        if span.kind is SegmentKind.CHUNK:
            if p < len(named):
                named[p].append(("chunk", span.num_tokens, span.private_tokens,
                                 chunk_ids.get(span.segment)))  # fmt: skip
            done += span.private_tokens
        else:
            if p < len(named):
                named[p].append(("prompt", span.num_tokens, span.private_tokens, None))
            done += span.num_tokens
    parent: BlockHash | None = hashes[-1] if hashes else None
    for p, new in enumerate(named, first):
        extra: tuple[Any, ...] = (policy, "packed", tuple(new))
        if p == 0 and cache_salt:
            extra = (cache_salt, *extra)
        parent = hash_block_tokens(hash_fn, parent, stream[p * bs : (p + 1) * bs], extra)
        hashes.append(parent)
    return hashes


class RequestIntake:
    """Validates segmented requests and builds their ``RequestState``."""

    def __init__(
        self,
        *,
        settings: KVSettings,
        room: StepRoom,
        block_pool: BlockPool,
        chunk_cache: ChunkCache,
        block_size: int,
        max_model_len: int,
        enable_caching: bool,
        hash_fn: Callable[[Any], bytes],
        model_fingerprint: str,
    ) -> None:
        self.settings = settings
        self.room = room
        self.block_pool = block_pool
        self.chunk_cache = chunk_cache
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.hash_fn = hash_fn
        self.model_fingerprint = model_fingerprint
        self.anchors = AnchorChooser(settings.policy)

    def inspect(self, request: Request) -> Inspected | None:
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
        segments = segments_from_real(request.prompt_token_ids or [], extra[EXTRA_ARGS_KEY])
        policy, bs = self.settings.policy, self.block_size
        fingerprint, salt = self.model_fingerprint, request.cache_salt
        anchor = self.anchors.choose(segments).tokens
        chunk_ids: dict[int, ChunkId | None] = {}
        for i, seg in enumerate(segments):
            if seg.kind is SegmentKind.CHUNK:
                cached = policy.chunk_is_cached(len(seg.token_ids), bs)
                chunk_ids[i] = (
                    chunk_identity(seg.token_ids, bs, fingerprint, salt, anchor) if cached else None
                )
        layout = arrival_layout(segments, policy, bs)
        limits = RequestLimits(policy, bs, self.max_model_len, self.settings.max_chunks)
        limits.check(layout, chunk_ids)
        self.room.check_request(layout, chunk_ids, len(anchor))
        worst_case = policy.worst_case_blocks(layout, chunk_ids, len(anchor))
        total = num_usable_blocks(self.block_pool)
        pinned = self.chunk_cache.num_pinned_blocks()
        if worst_case > total - pinned:
            need = (
                f"the request needs up to {worst_case} KV blocks (its table of "
                f"{layout.num_blocks} entries, chunk compiles' scratch)"
            )
            if worst_case <= total:  # it fits the pool: the pinned chunks are in the way
                raise MepicCapacityError(
                    f"{need} but pinned chunks (POST /v1/chunks) hold {pinned} of the KV "
                    f"cache's {total} usable blocks, leaving {total - pinned}: delete pinned "
                    "chunks or lower the MEPIC option pinned_kv_fraction"
                )
            raise MepicCapacityError(f"{need} but the KV cache has only {total} usable blocks")
        if extra.get(PIN_KEY) and policy.placement is Placement.SHARED:
            self._reserve_pins(request, layout, chunk_ids)
        return Inspected(layout, chunk_ids, anchor)

    def _reserve_pins(
        self, request: Request, layout: Layout, chunk_ids: dict[int, ChunkId | None]
    ) -> None:
        """Refuse a pin request past the pinned-KV quota (MepicQuotaError, before anything is
        allocated or evicted), else reserve what it may pin until its chunks are pinned."""
        cache, settings, salt = self.chunk_cache, self.settings, request.cache_salt
        cache.release_pins(request.request_id)  # a staged request is inspected twice
        chunks = [
            (chunk_id, sp.num_tokens - sp.private_tokens)
            for sp in layout.chunk_spans
            if (chunk_id := chunk_ids.get(sp.segment)) is not None
        ]
        growth = cache.pin_growth(chunks)
        usable = num_usable_blocks(self.block_pool)
        limit = int(usable * settings.pinned_fraction)
        held = cache.num_pinned_blocks() + cache.reserved_pins()
        if held + growth > limit:
            raise MepicQuotaError(
                f"MEPIC pinned-KV quota: pinning this chunk takes up to {growth} more KV blocks "
                f"and pinned chunks hold {held} of the {limit} the engine allows "
                f"(pinned_kv_fraction {settings.pinned_fraction} of {usable} usable blocks); "
                "delete chunks (DELETE /v1/chunks/ID) or raise pinned_kv_fraction"
            )
        per_salt = settings.pinned_per_salt
        if per_salt:
            mine = cache.num_pinned_blocks(salt, all_tenants=False)
            mine += cache.reserved_pins(salt, all_tenants=False)
            if mine + growth > per_salt:
                raise MepicQuotaError(
                    f"MEPIC pinned-KV quota: pinning this chunk takes up to {growth} more KV "
                    f"blocks and this cache_salt's pinned chunks hold {mine} of the {per_salt} "
                    "one cache_salt may pin (max_pinned_blocks_per_salt); delete chunks "
                    "(DELETE /v1/chunks/ID) or raise max_pinned_blocks_per_salt"
                )
        cache.reserve_pins(request.request_id, salt, growth)

    def named_chunks(self, request: Request) -> list[ChunkId]:
        """The identity of every chunk a (control) request's segments name, cached or not."""
        extra = request.sampling_params.extra_args if request.sampling_params else None
        layout = layout_from_real(
            list(request.prompt_token_ids or []),
            (extra or {}).get(EXTRA_ARGS_KEY),
            self.block_size,
        )
        anchor = self.anchors.peek(layout.segments).tokens
        return [
            chunk_identity(
                layout.chunk_tokens(span),
                layout.block_size,
                self.model_fingerprint,
                request.cache_salt,
                anchor,
            )
            for span in layout.chunk_spans
        ]

    def build(
        self,
        request: Request,
        layout: Layout,
        chunk_ids: dict[int, ChunkId | None],
        anchor: tuple[int, ...] = (),
    ) -> RequestState:
        """Rewrite the engine request to its in-context tokens and their hashes; its state."""
        raise NotImplementedError

    def _leading_hashes(self, request: Request, layout: Layout) -> list[BlockHash]:
        """vLLM's hashes of the request's ``num_plain_blocks`` (when it hashes blocks of our
        size): taken from the request where vLLM hashed it at arrival, else computed as vLLM
        would (``vllm_integration.block_hasher`` skips that hashing for segmented requests)."""
        if self.block_pool.hash_block_size != self.block_size:
            return []
        return vllm_prompt_hashes(request, num_plain_blocks(layout), self.block_size, self.hash_fn)


class PackedIntake(RequestIntake):
    """Shared placement: the request keeps its private stream, the chunk cache the rest."""

    def build(
        self,
        request: Request,
        layout: Layout,
        chunk_ids: dict[int, ChunkId | None],
        anchor: tuple[int, ...] = (),
    ) -> RequestState:
        """A packed request reaches vLLM as its private stream: prompt tokens and each chunk's
        private tokens, in order; everything else is the chunk cache's."""
        extra = request.sampling_params.extra_args
        policy = self.settings.policy
        leading = self._leading_hashes(request, layout)  # before set_prompt replaces them
        stream = layout.private_token_ids()
        set_prompt(request, stream)
        set_block_hashes(
            request,
            packed_block_hashes(
                layout, chunk_ids, self.hash_fn, request.cache_salt, policy.name, leading, stream
            ),
        )
        request.max_tokens = min(request.max_tokens, self.max_model_len - layout.num_real_tokens)
        st = RequestState(
            layout,
            chunk_ids,
            [],
            None,  # the placement: set at admission, once the chunks are placed
            pin=bool(extra.get(PIN_KEY)),
            private_tokens=[sp.private_tokens for sp in layout.chunk_spans],
            anchor=anchor,
        )
        st.set_packed_layout(layout)
        return st


class PaddedIntake(RequestIntake):
    """Private placement (the baselines) and none: every token has a slot of its own."""

    def build(
        self,
        request: Request,
        layout: Layout,
        chunk_ids: dict[int, ChunkId | None],
        anchor: tuple[int, ...] = (),
    ) -> RequestState:
        """Private placement (the baselines): every token has a slot in the request's private
        blocks; vLLM schedules the prompt tokens and the chunk tokens the policy computes in
        context ("fresh"), and the other chunk tokens are copied from the host store."""
        extra = request.sampling_params.extra_args
        bs, policy = layout.block_size, self.settings.policy
        slot_of = {p: i for i, p in enumerate(layout.slot_positions()) if p >= 0}
        fresh: set[int] = set()
        chunk_of: dict[int, tuple[ChunkId, int]] = {}  # layout index -> (chunk, chunk offset)
        for ci, span in enumerate(layout.chunk_spans):
            chunk_id = chunk_ids[span.segment]
            slots = [slot_of[span.first_position + o] for o in range(span.num_tokens)]
            if chunk_id is None:
                fresh.update(slots)
                continue
            scores = self.settings.store.scores(chunk_id) if policy.needs_scores else None
            fresh.update(slots[o] for o in policy.fresh_tokens(ci, span.num_tokens, bs, scores))
            chunk_of.update((slot, (chunk_id, o)) for o, slot in enumerate(slots))
        runs: list[tuple[int, ChunkId, int, int, int]] = []
        for slot in sorted(chunk_of):
            chunk_id, offset = chunk_of[slot]
            entry, t = divmod(slot, bs)
            last = runs[-1] if runs else None
            if last and last[:2] == (entry, chunk_id) and last[2] + last[3] == offset:
                runs[-1] = (entry, chunk_id, last[2], last[3] + 1, last[4])
            else:
                runs.append((entry, chunk_id, offset, 1, t))
        roles = [BlockRole.PRIVATE] * layout.num_blocks
        for entry, *_ in runs:
            roles[entry] = BlockRole.LOAD  # private placement: filled from the host store
        compact_slots = sorted(
            slot for slot in slot_of.values() if slot not in chunk_of or slot in fresh
        )
        compact_before = [0] * (layout.num_blocks + 1)
        for slot in compact_slots:
            compact_before[slot // bs + 1] += 1
        for i in range(layout.num_blocks):
            compact_before[i + 1] += compact_before[i]
        padded = layout.padded_token_ids()
        leading = self._leading_hashes(request, layout)  # before set_prompt replaces them
        set_prompt(request, [padded[i] for i in compact_slots])
        # Layout-keyed hashes of the prompt's full blocks; decode blocks are not prefix-cached.
        set_block_hashes(
            request,
            mepic_block_hashes(
                layout, padded, self.hash_fn, request.cache_salt, policy.name, leading
            ),
        )
        request.max_tokens = min(request.max_tokens, self.max_model_len - layout.num_real_tokens)
        placement = SequencePlacement(
            layout,
            num_in_context=len(compact_slots),
            fresh_slots=tuple(compact_slots),
            blend=(policy.ratio, policy.check_layer) if policy.dynamic else None,
        )
        return RequestState(
            layout,
            chunk_ids,
            roles,
            placement,
            len(compact_slots),
            compact_slots,
            compact_before,
            pin=bool(extra.get(PIN_KEY)),
            host_runs=runs,
        )
