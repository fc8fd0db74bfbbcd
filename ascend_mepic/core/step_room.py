"""The compile room of one scheduling step, and the compiles issued into it.

Chunk compiles (and tier loads) run as extra sequences in the step that issues them; the scheduler
reserves room for them in its token and sequence budgets and sets ``token_budget`` /
``seq_budget`` here (unbounded for kvsim). What is left shrinks as admissions, host-store staging
and tier loads use it, and is restored when the next step starts.
"""

from __future__ import annotations

from ascend_mepic.core.errors import MepicCapacityError
from ascend_mepic.core.identity import ChunkId
from ascend_mepic.core.plan import ChunkCompile
from ascend_mepic.core.segments import Layout

UNBOUNDED = 1 << 62


class StepRoom:
    def __init__(self) -> None:
        self.token_budget = UNBOUNDED
        self.seq_budget = UNBOUNDED
        self.tokens_left = self.token_budget
        self.seqs_left = self.seq_budget
        self.compiles: list[tuple[str, ChunkCompile]] = []  # (request id, compile), this step

    def check_request(self, layout: Layout, chunk_ids: dict[int, ChunkId | None]) -> None:
        """A request whose unique chunks could not all compile in one step can never run."""
        unique = {cid: span for span in layout.chunk_spans if (cid := chunk_ids[span.segment])}
        tokens = sum(span.num_tokens for span in unique.values())
        if tokens > self.token_budget or len(unique) > self.seq_budget:
            raise MepicCapacityError(
                f"request has {len(unique)} chunks with {tokens} tokens to compile, more than one "
                f"step can compile ({self.seq_budget} sequences, "
                f"{self.token_budget} tokens); raise --max-num-batched-tokens"
            )

    def fits(self, tokens: int, seqs: int) -> bool:
        """Whether ``seqs`` more sequences of ``tokens`` tokens in all fit this step."""
        return tokens <= self.tokens_left and seqs <= self.seqs_left

    def use(self, tokens: int, seqs: int) -> None:
        self.tokens_left -= tokens
        self.seqs_left -= seqs

    def add_compiles(self, request_id: str, compiles: list[ChunkCompile]) -> None:
        """Issue compiles in this step, using their tokens and one sequence each."""
        self.use(sum(len(c.token_ids) + len(c.dummy_tokens) for c in compiles), len(compiles))
        self.compiles.extend((request_id, c) for c in compiles)

    def take_compiles(self) -> list[tuple[str, ChunkCompile]]:
        """(request id, compile) for every compile issued in this step, once."""
        out, self.compiles = self.compiles, []
        return out

    def new_step(self) -> None:
        self.tokens_left = self.token_budget
        self.seqs_left = self.seq_budget
        self.compiles = []
