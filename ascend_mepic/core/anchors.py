"""Which tokens a request's first-time chunks are compiled after (option ``chunk_anchor``).

An anchored compile (``Policy.anchor_tokens``: the request's prompt before its first chunk) keeps
a chunk's KV close to full recompute, but the anchor is part of the chunk's identity, so every
opening (system prompt, earlier chat turns) compiles and holds its own copy of each document.
Where requests open alike that costs nothing; where they do not (multi-turn chats, several apps'
system prompts) it ends sharing: one copy per opening and document, none reused.

``auto`` (the default) keeps the anchor while it costs no copy: a deployment is anchored until a
document is about to be compiled under a second opening. From that request on, the engine
compiles unanchored for the rest of its life (one copy per document, the paper's compile), says
so once on stderr, counts it (``ascend_mepic_chunk_anchor_switches``) and drops idle anchored
copies, which no request can name any more. The switch is one-way, so within each mode a
request's output never depends on whether its chunks were cached; it changes at most once per
engine, and which requests ran before it decides when.

The decision is made once per request at intake (:class:`AnchorChoice` travels with it): a
chunk is always compiled after the anchor its identity names, even when the switch falls
between the request's intake and its compile.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from ascend_mepic.core.identity import ChunkId, chunk_identity
from ascend_mepic.core.policies import Policy
from ascend_mepic.core.segments import Segment, SegmentKind

logger = logging.getLogger(__name__)

# Documents remembered with the opening they were first compiled after (bounded: one digest
# pair each; an older document forgotten can only delay the switch, never cause a wrong one).
MAX_TRACKED_DOCUMENTS = 65536


@dataclass(frozen=True)
class AnchorChoice:
    """One request's anchor, decided at intake: its chunks' identities name it."""

    tokens: tuple[int, ...] = ()


def opening_digest(tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(struct.pack(f"<{len(tokens)}q", *tokens), digest_size=16).digest()


class AnchorChooser:
    """Decides each request's anchor under the policy's ``anchor`` mode (none, prefix, auto)."""

    def __init__(self, policy: Policy, block_size: int, model_fingerprint: str) -> None:
        self.policy = policy
        self.block_size = block_size
        self.model_fingerprint = model_fingerprint
        self.anchored = policy.packed and policy.anchor in ("prefix", "auto")
        self.switches = 0  # 1 once ``auto`` stopped anchoring
        self._openings: OrderedDict[ChunkId, bytes] = OrderedDict()

    def choose(self, segments: Sequence[Segment], cache_salt: str | None) -> AnchorChoice:
        """The anchor of a request arriving now; under ``auto`` it may end anchoring (the
        request that would compile a document under a second opening is the first one not
        anchored)."""
        candidate = self.policy.anchor_tokens(segments)
        if not candidate or not self.anchored:
            return AnchorChoice()
        if self.policy.anchor == "prefix":
            return AnchorChoice(candidate)
        opening = opening_digest(candidate)
        docs = self._documents(segments, cache_salt)
        if any(self._openings.get(d, opening) != opening for d in docs):
            self._switch(len(candidate))
            return AnchorChoice()
        for d in docs:
            self._openings[d] = opening
            self._openings.move_to_end(d)
        while len(self._openings) > MAX_TRACKED_DOCUMENTS:
            self._openings.popitem(last=False)
        return AnchorChoice(candidate)

    def peek(self, segments: Sequence[Segment]) -> AnchorChoice:
        """The anchor a request would get now, deciding nothing (the chunk API names chunks)."""
        candidate = self.policy.anchor_tokens(segments)
        return AnchorChoice(candidate if candidate and self.anchored else ())

    def _documents(self, segments: Sequence[Segment], salt: str | None) -> list[ChunkId]:
        """Each cached chunk's identity without an anchor: the document, whatever opens it."""
        bs, fp = self.block_size, self.model_fingerprint
        return [
            chunk_identity(s.token_ids, bs, fp, salt)
            for s in segments
            if s.kind is SegmentKind.CHUNK and self.policy.chunk_is_cached(len(s.token_ids), bs)
        ]

    def _switch(self, anchor_len: int) -> None:
        self.anchored = False
        self.switches += 1
        self._openings.clear()
        logger.warning(
            "MEPIC chunk_anchor auto: a document arrived after a second opening (prompt before "
            "its chunks, %d tokens), so anchored compiles would keep one copy per opening; this "
            "engine now compiles chunks unanchored (one shared copy per document, the paper's "
            "compile) for the rest of its life. Set chunk_anchor to 'prefix' to keep anchoring "
            "per opening, or 'none' to start unanchored.",
            anchor_len,
        )
