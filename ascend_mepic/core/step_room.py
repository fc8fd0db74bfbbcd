"""One scheduling step's batch, shared by vLLM's scheduled requests and MEPIC's extra sequences.

Chunk compiles (and tier loads) run as extra sequences of the step that issues them, and the
model runner's buffers hold ``token_budget`` tokens and ``seq_budget`` sequences in all (vLLM's
``max_num_scheduled_tokens`` / ``max_num_seqs``; unbounded for kvsim). Nothing is set aside in a
step without compiles: the room a compile takes is what the step's scheduled requests left, and
a request that would overflow the batch beside the step's compiles waits for the next step.

``claim`` records each request's scheduled tokens as vLLM allocates its slots; compiles and loads
``fit`` in what is left, within ``compile_token_cap``. An admission whose compiles did not fit
``defer``s them, and the scheduler keeps exactly that room (``take_reserve``) in the next step,
so a large compile is never starved by the requests scheduled beside it.
"""

from __future__ import annotations

from ascend_mepic.core.errors import MepicCapacityError, MepicUnsupportedError
from ascend_mepic.core.identity import ChunkId
from ascend_mepic.core.plan import ChunkCompile
from ascend_mepic.core.segments import Layout

UNBOUNDED = 1 << 62


class StepRoom:
    def __init__(self) -> None:
        self.token_budget = UNBOUNDED  # tokens of the step's batch, requests and compiles
        self.seq_budget = UNBOUNDED  # sequences of the step's batch
        self.compile_token_cap = UNBOUNDED  # most tokens one step's compiles and loads may take
        self.whole_prefills = False  # chunked prefill off: a prompt is scheduled whole
        self.claims: dict[str, int] = {}  # request id -> tokens scheduled in this step
        self.claimed_tokens = 0
        self.compile_tokens = 0
        self.compile_seqs = 0
        self.compiles: list[tuple[str, ChunkCompile]] = []  # (request id, compile), this step
        self._wanted = (0, 0)  # compile room deferred in this step: kept in the next one

    def set_budgets(
        self,
        tokens: int,
        seqs: int,
        compile_token_cap: int,
        whole_prefills: bool = False,
        compiles: bool = True,
    ) -> None:
        """The runner's per-step batch, and the share of it one step's compiles may take.

        ``compiles``: whether the engine's policy ever runs a chunk compile or load (false for
        ``full`` and ``prefix``, which ignore segments); only then does a step need room for
        two sequences and two tokens, so only then are smaller budgets refused.
        """
        if tokens < 1 or seqs < 1:
            raise ValueError(f"step budgets must be positive, got {tokens} tokens, {seqs} seqs")
        if compiles and (tokens < 2 or seqs < 2):
            small = [
                f"{name}={value}"
                for name, value in (("max_num_batched_tokens", tokens), ("max_num_seqs", seqs))
                if value < 2
            ]
            raise MepicUnsupportedError(  # a ValueError
                f"{' and '.join(small)} is too small for a policy that compiles chunks: a "
                "chunk's compile runs as a sequence of its own (at least one token) in the step "
                "that admits the request bringing it, beside at least one of that request's "
                "tokens, and is never split across steps, so a step must hold 2 sequences and "
                "2 tokens; raise them to at least 2, or use policy 'full' or 'prefix' (no "
                "compiles)"
            )
        self.token_budget, self.seq_budget = tokens, seqs
        self.compile_token_cap = max(1, min(compile_token_cap, tokens - 1))
        self.whole_prefills = whole_prefills

    @property
    def max_compile_tokens(self) -> int:
        """Compile tokens one step can hold: the cap, beside at least one scheduled token."""
        return min(self.compile_token_cap, self.token_budget - 1)

    @property
    def max_compile_seqs(self) -> int:
        """Compiles one step can hold, beside the request that brings them."""
        return self.seq_budget - 1

    def check_request(
        self, layout: Layout, chunk_ids: dict[int, ChunkId | None], anchor_tokens: int = 0
    ) -> None:
        """A request whose unique chunks could not all compile in one otherwise empty step, beside
        its first scheduled tokens (its whole prompt without chunked prefill), can never run.
        ``anchor_tokens``: what each compile computes before its chunk (its anchor)."""
        unique = {cid: span for span in layout.chunk_spans if (cid := chunk_ids[span.segment])}
        tokens = sum(anchor_tokens + span.num_tokens for span in unique.values())
        beside = layout.num_in_context() if self.whole_prefills else 1
        if (
            tokens > self.max_compile_tokens
            or tokens + beside > self.token_budget
            or len(unique) > self.max_compile_seqs
        ):
            raise MepicCapacityError(
                f"request has {len(unique)} chunks with {tokens} tokens to compile, more than one "
                f"step can compile ({self.max_compile_seqs} sequences, "
                f"{self.max_compile_tokens} tokens); raise --max-num-batched-tokens"
            )

    @property
    def tokens_left(self) -> int:
        return self.token_budget - self.claimed_tokens - self.compile_tokens

    @property
    def seqs_left(self) -> int:
        return self.seq_budget - len(self.claims) - self.compile_seqs

    def claim(self, request_id: str, tokens: int, force: bool = False) -> bool:
        """Schedule ``tokens`` of a request in this step (again: its earlier claim is replaced).

        False (nothing recorded) when they and its sequence do not fit beside the step's
        compiles. ``force``: a running request, scheduled before any compile of the step, so
        always within vLLM's own budgets.
        """
        old = self.claims.get(request_id)  # called for every scheduled request: kept lean
        extra_tokens = tokens - (old or 0)
        if not force and (
            extra_tokens > self.token_budget - self.claimed_tokens - self.compile_tokens
            or (old is None and len(self.claims) + self.compile_seqs >= self.seq_budget)
        ):
            return False
        self.claims[request_id] = tokens
        self.claimed_tokens += extra_tokens
        return True

    def release(self, request_id: str) -> None:
        """A request is not scheduled in this step after all (its allocation failed, or it was
        preempted)."""
        tokens = self.claims.pop(request_id, None)
        if tokens is not None:
            self.claimed_tokens -= tokens

    def fits(self, tokens: int, seqs: int) -> bool:
        """Whether ``seqs`` more extra sequences of ``tokens`` tokens in all fit this step."""
        return (
            tokens <= self.tokens_left
            and seqs <= self.seqs_left
            and self.compile_tokens + tokens <= self.compile_token_cap
        )

    def defer(self, tokens: int, seqs: int) -> None:
        """Compiles that did not fit this step: the next step keeps room for them."""
        wanted_tokens, wanted_seqs = self._wanted
        self._wanted = (max(wanted_tokens, tokens), max(wanted_seqs, seqs))

    def take_reserve(self) -> tuple[int, int]:
        """(tokens, sequences) to keep out of vLLM's budgets in the coming step, once."""
        tokens, seqs = self._wanted
        self._wanted = (0, 0)
        return min(tokens, self.max_compile_tokens), min(seqs, self.max_compile_seqs)

    def use(self, tokens: int, seqs: int) -> None:
        self.compile_tokens += tokens
        self.compile_seqs += seqs

    def add_compiles(self, request_id: str, compiles: list[ChunkCompile]) -> None:
        """Issue compiles in this step, using their tokens and one sequence each."""
        self.use(sum(c.num_sequence_tokens for c in compiles), len(compiles))
        self.compiles.extend((request_id, c) for c in compiles)

    def take_compiles(self) -> list[tuple[str, ChunkCompile]]:
        """(request id, compile) for every compile issued in this step, once."""
        out, self.compiles = self.compiles, []
        return out

    def new_step(self) -> None:
        self.claims = {}
        self.claimed_tokens = 0
        self.compile_tokens = 0
        self.compile_seqs = 0
        self.compiles = []
