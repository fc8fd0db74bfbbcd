"""Which tokens a request's first-time chunks are compiled after (option ``chunk_anchor``).

An anchored compile keeps a chunk's KV close to full recompute: the chunk is computed after an
opening (template, system message, instruction) whose KV is not stored with it, so its KV has
attended to an attention sink and an instruction like every request's, not to a start of its
own. Under ``prefix`` the anchor is the request's own prompt before its first chunk, and it is
part of the chunk's identity, so every opening (system prompt, earlier chat turns) compiles and
holds its own copy of each document: where requests open differently, sharing ends.

``first`` (the default) compiles every chunk after one anchor per engine: the opening (prompt
before the first chunk, at most ``anchor_max_tokens``) of the first request that has one. Every
request then names the same identity for a document, whatever precedes it, so a document has
one copy; and a chunk compiled after another request's opening reads as faithfully as one
compiled after the reader's own (docs/results.md, "Fidelity with sharing"). The anchor never
changes in the engine's life, so a request's output depends on its content and that one value,
never on whether its chunks were cached. Requests before it (no opening yet) compile unanchored.
``none`` compiles chunks alone (the paper's compile).

The decision is made once per request at intake and travels with it (``Inspected.anchor``,
``RequestState.anchor``): a chunk is compiled after the anchor its identity names.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from ascend_mepic.core.policies import Policy
from ascend_mepic.core.segments import Segment

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AnchorChoice:
    """One request's anchor, decided at intake: its chunks' identities name it."""

    tokens: tuple[int, ...] = ()


class AnchorChooser:
    """Decides each request's anchor under the policy's ``anchor`` mode (none, prefix, first)."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.engine_anchor: tuple[int, ...] | None = None  # ``first``: once the first opening came

    def choose(self, segments: Sequence[Segment]) -> AnchorChoice:
        """The anchor of a request arriving now (under ``first`` the first opening becomes the
        engine's anchor)."""
        if self.policy.anchor != "first" or not self.policy.packed:
            return AnchorChoice(self.policy.anchor_tokens(segments))
        if self.engine_anchor is None:
            opening = self.policy.anchor_tokens(segments)
            if not opening:
                return AnchorChoice()
            self.engine_anchor = opening
            logger.info(
                "MEPIC chunk_anchor first: every chunk this engine compiles is compiled after the "
                "first request's opening (%d tokens), whatever precedes the chunk in later "
                "requests",
                len(opening),
            )
        return AnchorChoice(self.engine_anchor)

    def peek(self, segments: Sequence[Segment]) -> AnchorChoice:
        """The anchor a request would get now, deciding nothing (the chunk API names chunks)."""
        if self.policy.anchor != "first" or not self.policy.packed:
            return AnchorChoice(self.policy.anchor_tokens(segments))
        return AnchorChoice(self.engine_anchor or ())
