"""What the scheduling path hands the computation path for one request (no tensors)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ascend_mepic.core.identity import ChunkId
from ascend_mepic.core.segments import Layout


class StepPlanError(RuntimeError):
    """The scheduler's plan and what the worker sees disagree; the step is not run."""


class Residency(str, enum.Enum):
    RESIDENT = "resident"  # canonical blocks already computed and shared
    IN_FLIGHT = "in-flight"  # being compiled by another request in this same step
    COMPILE = "compile"  # first time: this request compiles it
    SINGLE_BLOCK = "single-block"  # no canonical tokens (L <= k): computed in context
    HOST = "host"  # private placement: copied from the host store into the request's blocks


@dataclass(frozen=True)
class ChunkCompile:
    """Compute a chunk alone, from position 0 (or after its anchor), as its own sequence.

    Shared placement (``packing`` set): the compile's table is its packed layout's, entry by
    entry: its first ``private_tokens`` tokens go to scratch blocks, the rest (the canonical
    tokens) to the chunk cache's blocks from slot ``offset`` on. Host-store compiles (private
    placement) use the padded layout (leading pad slots, every block saved afterwards).
    ``layout`` is the compile's own (its ``SequencePlacement`` in the step plan).
    """

    chunk_id: ChunkId
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]  # one per table entry
    layout: Layout
    packing: tuple[int, int] | None = None  # (private tokens, offset) of a shared compile
    num_scratch: int = 0  # shared compile: leading entries in scratch blocks
    # Private-placement and mepic-K compiles: leading dummy tokens (LegoLink-0) in a block of
    # their own, and how many trailing blocks the worker saves to the host store afterwards.
    dummy_tokens: tuple[int, ...] = ()
    store_blocks: int = 0
    store_scores: bool = False
    # Anchored shared compiles: the request's prefix the chunk is compiled after, in scratch
    # (the layout's leading prompt segment; ``Policy.anchor_tokens``).
    anchor_tokens: tuple[int, ...] = ()

    @property
    def sequence_tokens(self) -> tuple[int, ...]:
        """The tokens the compile's sequence computes, in order."""
        return (*self.dummy_tokens, *self.anchor_tokens, *self.token_ids)

    @property
    def num_sequence_tokens(self) -> int:
        return len(self.dummy_tokens) + len(self.anchor_tokens) + len(self.token_ids)

    @property
    def canonical_block_ids(self) -> tuple[int, ...]:
        """A shared compile's blocks in the chunk cache (its canonical tokens), in order."""
        return self.block_ids[self.num_scratch :]

    @property
    def num_canonical(self) -> int:
        """Tokens this compile adds to the chunk cache (0 for a host-store compile)."""
        return len(self.token_ids) - self.packing[0] if self.packing else 0


@dataclass(frozen=True)
class TierLoad:
    """Fill a chunk's canonical blocks from the off-device tier, as its own 1-token sequence.

    The worker verifies the entry before the forward pass and reports the outcome under
    ``io_id``; requests use the blocks only after that report (a failed load is compiled).
    """

    io_id: str
    chunk_id: ChunkId
    block_ids: tuple[int, ...]
    num_tokens: int  # canonical tokens, stored from slot ``offset`` of ``block_ids[0]`` on
    scratch_block_id: int
    offset: int = 0


@dataclass(frozen=True)
class RequestPlan:
    """Block table and work for one request's prompt.

    ``block_ids[i]`` holds layout entry ``i`` (a packed layout may list a private block several
    times, and a canonical block of the chunk cache beside other chunks' tokens).
    ``num_in_context_computed`` in-context tokens are computed in the request's context (those
    not found in vLLM's prefix cache); canonical chunk tokens never are. ``compiles`` must run no
    later than the step that computes the first token after their chunk.
    """

    request_id: str
    layout: Layout
    block_ids: tuple[int, ...]
    num_prefix_hit_blocks: int  # private blocks found in vLLM's prefix cache
    num_in_context_computed: int
    compiles: tuple[ChunkCompile, ...]
    residency: tuple[Residency, ...]  # one per chunk segment, in order

    @property
    def num_compute_tokens(self) -> int:
        """Real tokens computed for this request: in context plus its compiles."""
        return self.num_in_context_computed + sum(c.num_sequence_tokens for c in self.compiles)

    @property
    def num_reused_tokens(self) -> int:
        """Real prompt tokens whose KV came from a cache (prefix hits or resident chunks)."""
        compiled = sum(c.num_canonical for c in self.compiles)
        return self.layout.num_real_tokens - self.num_in_context_computed - compiled


@dataclass(frozen=True)
class SequencePlacement:
    """Where a scheduled sequence's tokens go, for the worker (MEPIC requests and compiles).

    A MEPIC request reaches the worker as its in-context tokens only. ``layout`` is the one the
    scheduler placed the request with (derived once, carried here: the worker reads its token
    places off it); ``fresh_slots`` (policies other than mepic) lists the padded index of each
    in-context token. A compile is the chunk alone (``compile=True``, the compile's layout).
    ``num_in_context`` is how many prompt tokens the worker must see for this sequence: a
    different count means the two sides disagree and the step is refused.
    """

    layout: Layout
    num_in_context: int
    compile: bool = False
    fresh_slots: tuple[int, ...] | None = None
    blend: tuple[float, int] | None = None  # CacheBlend: (ratio, check layer)


@dataclass(frozen=True)
class HostLoad:
    """Copy tokens ``[offset, offset + num_tokens)`` of a chunk's host-store entry into private
    block ``block_id`` from slot ``slot`` on."""

    chunk_id: ChunkId
    offset: int
    num_tokens: int
    block_id: int
    slot: int


@dataclass(frozen=True)
class ChunkSave:
    """After the forward pass, copy a compile's ``block_ids`` out (host store or tier)."""

    chunk_id: ChunkId
    block_ids: tuple[int, ...]
    num_tokens: int
    with_scores: bool = False  # host store: CacheTune's low-frequency scores
    offset: int = 0  # tier: the canonical tokens start at this slot of ``block_ids[0]``


@dataclass(frozen=True)
class ChunkMove:
    """Copy a chunk's canonical tokens to where the chunk arena placed it anew, before the
    forward pass (the old blocks stay held until the step has run)."""

    chunk_id: ChunkId
    num_tokens: int
    src_block_ids: tuple[int, ...]
    src_offset: int
    dst_block_ids: tuple[int, ...]
    dst_offset: int


@dataclass(frozen=True)
class StepPlan:
    """Everything the scheduling path tells the workers about one step, in one structure.

    It travels on ``SchedulerOutput.kv_connector_metadata`` (see
    ``vllm_integration/channel.py``) to every worker (every tensor-parallel rank reads the same).
    """

    step: int
    placements: dict[str, SequencePlacement]  # new or resumed sequences this step, by request id
    host_loads: tuple[HostLoad, ...] = ()
    host_saves: tuple[ChunkSave, ...] = ()
    tier_puts: tuple[ChunkSave, ...] = ()
    tier_loads: tuple[TierLoad, ...] = ()
    chunk_moves: tuple[ChunkMove, ...] = ()  # run first, before any load or the forward


@dataclass(frozen=True)
class ExtraSequence:
    """A sequence of the step that is not a vLLM request (a chunk compile or a tier load): the
    scheduler adds it to the step's output, and the worker forgets it after the step."""

    seq_id: str
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
