"""What the scheduling path hands the computation path for one request (no tensors)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ascend_mepic.core.identity import ChunkId
from ascend_mepic.core.segments import Layout


class Residency(str, enum.Enum):
    RESIDENT = "resident"  # canonical blocks already computed and shared
    IN_FLIGHT = "in-flight"  # being compiled by another request in this same step
    COMPILE = "compile"  # first time: this request compiles it
    SINGLE_BLOCK = "single-block"  # fits in its first block: nothing to share, computed in context
    HOST = "host"  # private placement: copied from the host store into the request's blocks


@dataclass(frozen=True)
class ChunkCompile:
    """Compute a chunk alone, from position 0, as its own sequence.

    ``block_ids[0]`` is a scratch block for the (padded) first block; ``block_ids[1:]`` become the
    chunk's canonical shared blocks. Its pads are the first ``pad`` slots of the scratch block.
    """

    chunk_id: ChunkId
    token_ids: tuple[int, ...]
    pad: int
    block_ids: tuple[int, ...]
    # Private-placement and mepic-K compiles: leading dummy tokens (LegoLink-0) in a block of
    # their own, and how many trailing blocks the worker saves to the host store afterwards.
    dummy_tokens: tuple[int, ...] = ()
    store_blocks: int = 0
    store_scores: bool = False

    @property
    def segment_lengths(self) -> list[list]:
        """The compile's own layout (its ``SequencePlacement`` in the step plan)."""
        chunk = ["chunk", len(self.token_ids)]
        return [["prompt", len(self.dummy_tokens)], chunk] if self.dummy_tokens else [chunk]


@dataclass(frozen=True)
class TierLoad:
    """Fill a chunk's canonical blocks from the off-device tier, as its own 1-token sequence.

    The worker verifies the entry before the forward pass and reports the outcome under
    ``io_id``; requests use the blocks only after that report (a failed load is compiled).
    """

    io_id: str
    chunk_id: ChunkId
    block_ids: tuple[int, ...]
    num_tokens: int
    scratch_block_id: int


@dataclass(frozen=True)
class RequestPlan:
    """Block table and work for one request's prompt.

    ``block_ids[i]`` holds layout block ``i``. ``compute_blocks`` are the layout blocks the worker
    computes in the request's context (prompt blocks and every chunk's first block that missed the
    prefix cache); chunk blocks after the first are never computed in context. ``compiles`` must
    run no later than the step that computes the first token after their chunk.
    """

    request_id: str
    layout: Layout
    block_ids: tuple[int, ...]
    num_prefix_hit_blocks: int
    compute_blocks: tuple[int, ...]
    compiles: tuple[ChunkCompile, ...]
    residency: tuple[Residency, ...]  # one per chunk segment, in order

    @property
    def num_compute_tokens(self) -> int:
        """Real tokens computed for this request: in-context blocks plus compiles."""
        in_context = sum(self.layout.blocks[i].num_valid for i in self.compute_blocks)
        return in_context + sum(len(c.token_ids) for c in self.compiles)

    @property
    def num_reused_tokens(self) -> int:
        """Real prompt tokens whose KV came from the cache (prefix hits or resident chunks)."""
        bs = self.layout.block_size
        in_context = sum(self.layout.blocks[i].num_valid for i in self.compute_blocks)
        compiled_shared = sum(len(c.token_ids) - (bs - c.pad) for c in self.compiles)
        return self.layout.num_real_tokens - in_context - compiled_shared


@dataclass(frozen=True)
class SequencePlacement:
    """Where a scheduled sequence's tokens go, for the worker (MEPIC requests and compiles).

    A MEPIC request reaches the worker as its in-context tokens only; ``segment_lengths`` lets
    the worker rebuild the layout and ``fresh_slots`` (policies other than mepic) lists the
    padded index of each in-context token. A compile is the chunk alone (``compile=True``).
    ``num_in_context`` is how many prompt tokens the worker must see for this sequence: a
    different count means the two sides disagree and the step is refused.
    """

    segment_lengths: tuple[tuple[str, int], ...]
    num_in_context: int
    compile: bool = False
    fresh_slots: tuple[int, ...] | None = None
    blend: tuple[float, int] | None = None  # CacheBlend: (ratio, check layer)


@dataclass(frozen=True)
class HostLoad:
    """Copy block ``offset`` of a chunk's host-store entry into private block ``block_id``."""

    chunk_id: ChunkId
    offset: int
    block_id: int


@dataclass(frozen=True)
class ChunkSave:
    """After the forward pass, copy a compile's ``block_ids`` out (host store or tier)."""

    chunk_id: ChunkId
    block_ids: tuple[int, ...]
    num_tokens: int
    with_scores: bool = False  # host store: CacheTune's low-frequency scores


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
