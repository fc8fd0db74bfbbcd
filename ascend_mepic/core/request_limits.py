"""What a segmented request may ask of an engine: one definition, checked in three places.

vLLM sizes a request's block-table row for ``max_model_len`` tokens. A MEPIC table lists more
entries than its tokens fill: a chunk's canonical tokens start anywhere in a shared block (up to
two entries beyond their tokens: ``segments.shared_entries``), and the request's private run that
follows them re-lists the private block they interrupted (one more). So the worker's table is
``table_width`` = ``cdiv(max_model_len, B) + EXTRA_ENTRIES_PER_CHUNK * max_chunks`` entries wide
(``max_chunks_per_request``, default ``DEFAULT_MAX_CHUNKS``), and every request whose tokens fit
``max_model_len`` and that has at most that many chunks fits its table, output included.

``RequestLimits.check`` is what the engine's intake (``core.request_intake``), the HTTP server's
400 pre-check and vLLM's front end (``vllm_integration.front_end``, so that ``LLM.generate``
raises as it does for an over-long prompt) all call. It holds no pool state: the intake adds the
check that depends on what is pinned right now.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ascend_mepic.core.errors import MepicCapacityError
from ascend_mepic.core.policies import Placement, Policy, arrival_layout
from ascend_mepic.core.segments import Layout, SegmentKind, segments_from_real
from ascend_mepic.core.step_room import StepRoom

# Chunks per request the block table is sized for by default: beyond what RAG (the paper's
# Fig. 8 goes to 16 per request) or an agent's context usually retrieves.
DEFAULT_MAX_CHUNKS = 64
# Table entries one chunk may add beyond the blocks its tokens fill: two for its canonical tokens
# at the worst start slot, one for the private block its canonical tokens interrupt.
EXTRA_ENTRIES_PER_CHUNK = 3


def table_width(max_model_len: int, block_size: int, max_chunks: int) -> int:
    """Entries of the worker's block-table row (see the module docstring)."""
    return -(-max_model_len // block_size) + EXTRA_ENTRIES_PER_CHUNK * max_chunks


def entries_needed(layout: Layout, num_output_tokens: int) -> int:
    """Table entries ``layout`` needs once ``num_output_tokens`` more tokens are generated.

    Output tokens extend the private stream past the prompt's private blocks; every policy's
    arrival layout is packed (an all-private one has one entry per private block).
    """
    stream = layout.num_private_tokens + num_output_tokens
    return layout.num_blocks + -(-stream // layout.block_size) - layout.num_private_blocks


@dataclass(frozen=True)
class RequestLimits:
    """An engine's limits on a segmented request (from its vLLM configuration)."""

    policy: Policy
    block_size: int
    max_model_len: int
    max_chunks: int = DEFAULT_MAX_CHUNKS
    # Step budgets chunk compiles share (``StepRoom.set_budgets``): tokens, sequences, compile
    # cap, whole prefills. None: not checked here (the intake's own room checks them).
    step_budgets: tuple[int, int, int, bool] | None = None
    # KV blocks requests can hold (all but vLLM's null block), once the engine has sized its
    # pool; None before.
    usable_blocks: int | None = None

    @classmethod
    def from_vllm_config(cls, vllm_config: Any, config: Any) -> RequestLimits:
        """The limits of an engine configured with ``vllm_config`` and MEPIC's ``config`` (a
        ``config.MepicConfig``)."""
        sched = vllm_config.scheduler_config
        tokens = sched.max_num_scheduled_tokens or sched.max_num_batched_tokens
        num_blocks = vllm_config.cache_config.num_gpu_blocks
        return cls(
            policy=config.parsed_policy,
            block_size=vllm_config.cache_config.block_size,
            max_model_len=vllm_config.model_config.max_model_len,
            max_chunks=config.max_chunks_per_request,
            step_budgets=(
                tokens,
                sched.max_num_seqs,
                int(tokens * config.compile_token_fraction),
                not sched.enable_chunked_prefill,
            ),
            usable_blocks=num_blocks - 1 if num_blocks else None,
        )

    @property
    def table_width(self) -> int:
        return table_width(self.max_model_len, self.block_size, self.max_chunks)

    def check(self, layout: Layout, chunk_ids: Mapping[int, Hashable | None]) -> None:
        """Raise MepicCapacityError, naming the limit and the request's need, if the request can
        never run on this engine. ``chunk_ids``: chunk segment -> a key equal for equal chunks
        (the chunk's identity), or None where ``Policy.chunk_is_cached`` is false."""
        n, limit = layout.num_real_tokens, self.max_model_len
        if n >= limit:
            raise MepicCapacityError(
                f"the prompt (length {n}) plus the number of requested output tokens (at least "
                f"1) is longer than the maximum model length of {limit}"
            )
        if self.policy.placement is Placement.NONE:
            return  # segments ignored (``full``, ``prefix``): vLLM serves it as a plain prompt
        chunks = len(layout.chunk_spans)
        if chunks > self.max_chunks:
            raise MepicCapacityError(
                f"the request has {chunks} chunks; this engine serves at most {self.max_chunks} "
                f"per request (MEPIC option max_chunks_per_request, which sizes the block table)"
            )
        need = entries_needed(layout, limit - n)
        if need > self.table_width:  # the width's bound failed: never expected
            raise MepicCapacityError(
                f"the request's block table needs {need} entries, more than the "
                f"{self.table_width} MEPIC sized it for ({chunks} chunks, {n} tokens)"
            )
        if self.step_budgets is not None:
            room = StepRoom()
            room.set_budgets(*self.step_budgets[:3], whole_prefills=self.step_budgets[3])
            room.check_request(layout, chunk_ids, len(self.policy.anchor_tokens(layout.segments)))
        if self.usable_blocks is not None:
            worst = self.policy.worst_case_blocks(layout, chunk_ids)
            if worst > self.usable_blocks:
                raise MepicCapacityError(
                    f"the request needs up to {worst} KV blocks (its table of {layout.num_blocks} "
                    f"entries, chunk compiles' scratch) but the KV cache has only "
                    f"{self.usable_blocks} usable blocks"
                )

    def check_prompt(self, token_ids: Sequence[int], segment_lengths: object) -> Layout:
        """``check`` for a prompt sent as its real tokens and ``mepic_segments``; returns its
        arrival layout. Raises LayoutError for malformed segments, MepicCapacityError as
        ``check``."""
        segments = segments_from_real(token_ids, segment_lengths)
        layout = arrival_layout(segments, self.policy, self.block_size)
        bs = self.block_size
        keys = {
            i: seg.token_ids if self.policy.chunk_is_cached(len(seg.token_ids), bs) else None
            for i, seg in enumerate(segments)
            if seg.kind is SegmentKind.CHUNK
        }
        self.check(layout, keys)
        return layout
