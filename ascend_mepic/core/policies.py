"""The position-independent caching (PIC) policy family: what is recomputed, where KV lives.

One framework runs MEPIC and the papers' baselines under the same scheduler, batching and kernels;
a policy only decides, per chunk occurrence, which of its tokens are computed in the request's
context ("fresh") and where the chunk's canonical (chunk-alone, un-rotated) KV lives:

============== ========== ================================================================
policy         placement  fresh chunk tokens
============== ========== ================================================================
full           none       all (segments ignored: a plain prompt, no prefix caching)
prefix         none       all (a plain prompt through vLLM's prefix cache)
naive          shared     none (every chunk token is canonical)
mepic          shared     the first 16 tokens (EPIC's setting), at any block size
mepic-K        shared     the first K tokens
mepic-block    shared     the first block's real tokens of the paper's padded layout, i.e.
                          ``L - B * (ceil(L / B) - 1)`` (the paper's policy, for reproduction)
epic-K         private    the first K tokens of every chunk but the request's first (LegoLink-K)
legolink-0     private    none; the chunk is compiled after 4 dummy (BOS) tokens, whose KV is
                          discarded
cacheblend-R   private    all at layers <= check layer; after it only the top R% of the
                          request's chunk tokens by K deviation (the others skip compute)
cachetune-R    private    the top R% of each chunk by low-frequency KV energy, scored once
                          when the chunk is compiled (one set for all layers)
============== ========== ================================================================

*Anchored* compiles (``anchor="prefix"``, shared placement): a first-time chunk is compiled after
an anchor, the request's prompt before its first chunk (its first ``anchor_max_tokens`` tokens:
template opening, system message, instruction), at positions continuing from it, instead of alone
from position 0. The anchor's KV is computed in the compile's scratch and never stored with the
chunk, so the chunk's canonical KV keeps one attention sink that every request has, not a second
one of its own; the chunk's identity includes the anchor, so requests that share a prefix share
the chunk and a request with another prefix gets its own copy. Nothing changes for the request:
the same private tokens, the same blocks.

*Shared* placement keeps canonical KV in the device pool, referenced by every request, in the
packed layout (``segments.build_packed_layout``): a request's in-context tokens (prompt and each
chunk's first tokens) are packed into its private blocks, and each chunk's canonical tokens are
stored once, packed back to back with other chunks' in shared blocks. *Private*
placement is what the baselines do in their own systems: the canonical KV lives off the device pool
(``host_store``) and every request copies it into its own blocks. This module is scheduling path:
no tensors.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ascend_mepic.core.segments import Layout, Segment, SegmentKind, build_packed_layout


class Placement(str, enum.Enum):
    NONE = "none"  # segments are ignored
    SHARED = "shared"
    PRIVATE = "private"


LEGOLINK_DUMMY_TOKENS = 4
ANCHORS = ("none", "prefix", "first")
DEFAULT_ANCHOR_MAX_TOKENS = 256  # an anchor's tokens are recomputed by every compile after it
CACHEBLEND_CHECK_LAYER = 1
MEPIC_DEFAULT_K = 16  # EPIC's setting: tokens of each chunk recomputed in the request's context

_PATTERN = re.compile(
    r"^(?P<kind>full|prefix|naive|mepic-block|mepic|legolink|epic|cacheblend|cachetune)"
    r"(?:-(?P<arg>\d+))?$"
)


@dataclass(frozen=True)
class Policy:
    name: str
    kind: str
    k: int = 0  # mepic / mepic-K / epic-K: tokens recomputed per chunk
    ratio: float = 0.0  # cacheblend-R / cachetune-R: R / 100
    check_layer: int = CACHEBLEND_CHECK_LAYER
    # shared placement: "prefix" compiles chunks after the request's prefix, "first" after the
    # engine's first request's (``anchors.AnchorChooser`` decides per request)
    anchor: str = "none"
    anchor_max_tokens: int = DEFAULT_ANCHOR_MAX_TOKENS

    # Read several times per request on the scheduling path: computed once per policy.
    @cached_property
    def placement(self) -> Placement:
        if self.kind in ("full", "prefix"):
            return Placement.NONE
        if self.kind in ("naive", "mepic", "mepic-block"):
            return Placement.SHARED
        return Placement.PRIVATE

    @cached_property
    def packed(self) -> bool:
        """Requests use the packed layout (shared placement); others the padded one."""
        return self.placement is Placement.SHARED

    @property
    def loads_kv(self) -> bool:
        """Requests copy canonical KV into their own blocks, so chunks must be computed first."""
        return self.placement is Placement.PRIVATE

    def private_tokens(self, num_tokens: int, block_size: int) -> int:
        """Shared placement: how many leading tokens of a chunk are computed in context."""
        n = num_tokens
        if self.kind == "naive":
            return 0
        if self.kind == "mepic":
            return min(self.k, n)
        if self.kind == "mepic-block":
            return n - block_size * (-(-n // block_size) - 1)
        raise AssertionError(f"{self.name} does not use the packed layout")

    def anchor_tokens(self, segments: Sequence[Segment]) -> tuple[int, ...]:
        """The tokens a first-time chunk of this request is compiled after (empty: alone from
        position 0): under ``anchor="prefix"`` the first ``anchor_max_tokens`` of the prompt
        before the request's first chunk (``first``: the candidate for the engine's anchor)."""
        if self.anchor == "none" or not self.packed or not segments:
            return ()
        first = segments[0]
        if first.kind is not SegmentKind.PROMPT or len(segments) < 2:
            return ()
        return tuple(first.token_ids[: self.anchor_max_tokens])

    def in_context_tokens(self, num_tokens: int, block_size: int) -> int:
        """How many of a chunk's tokens a request computes in its own context; the rest are
        shared. Every token for policies that do not share."""
        return self.private_tokens(num_tokens, block_size) if self.packed else num_tokens

    @property
    def dummy_tokens(self) -> int:
        return LEGOLINK_DUMMY_TOKENS if self.kind == "legolink" else 0

    @property
    def needs_scores(self) -> bool:
        return self.kind == "cachetune"

    @property
    def dynamic(self) -> bool:
        """Token selection happens inside the forward pass (CacheBlend)."""
        return self.kind == "cacheblend"

    def fresh_tokens(
        self,
        chunk_index: int,
        num_tokens: int,
        block_size: int,
        scores: list[float] | None = None,
    ) -> list[int]:
        """Chunk-relative offsets of the tokens computed in the request's context.

        For CacheBlend these are the tokens computed up to the check layer (all of them).
        """
        n = num_tokens
        if self.kind in ("full", "prefix", "cacheblend"):
            return list(range(n))
        if self.packed:
            return list(range(self.private_tokens(n, block_size)))
        if self.kind == "legolink":
            return []
        if self.kind == "epic":
            return [] if chunk_index == 0 else list(range(min(self.k, n)))
        if self.kind == "cachetune":
            if scores is None or len(scores) != n:
                raise ValueError(f"cachetune needs {n} token scores, got {scores!r:.40}")
            top = top_fraction(scores, self.ratio)
            return sorted(top)
        raise AssertionError(self.kind)

    def chunk_is_cached(self, num_tokens: int, block_size: int) -> bool:
        """Whether a chunk of this length gets a cache identity (shared placement: only if it
        has canonical tokens left after its private ones)."""
        if self.packed:
            return self.private_tokens(num_tokens, block_size) < num_tokens
        return self.placement is not Placement.NONE

    def worst_case_blocks(
        self, layout: Layout, cached: Mapping[int, Any], anchor_len: int | None = None
    ) -> int:
        """KV blocks a request laid out as ``layout`` may hold at once, with none of its chunks
        resident yet. ``cached``: chunk segment -> its identity, or None if not cached;
        ``anchor_len``: its compiles' anchor (the engine's choice; default its own prefix's)."""
        bs = layout.block_size
        if self.packed:  # private blocks, canonical blocks of every chunk, compile scratch
            worst = layout.num_private_blocks
            lead = len(self.anchor_tokens(layout.segments)) if anchor_len is None else anchor_len
            for sp in layout.chunk_spans:
                worst += -(-(lead + sp.private_tokens) // bs) + sp.num_shared
            return worst
        private = self.placement is Placement.PRIVATE
        return layout.num_blocks + (
            1 if private else sum(1 for c in cached.values() if c is not None)
        )


def top_fraction(scores: list[float], ratio: float) -> list[int]:
    """Indices of the ceil(ratio * n) highest scores; ties go to the lower index."""
    count = min(len(scores), math.ceil(ratio * len(scores) - 1e-9))
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    return order[:count]


def parse_policy(name: str) -> Policy:
    """``mepic``, ``mepic-16``, ``epic-16``, ``cacheblend-15``... (ValueError names the choices)."""
    m = _PATTERN.match(name.strip().lower()) if isinstance(name, str) else None
    if m is None:
        raise ValueError(f"unknown policy {name!r}; choose from {POLICY_NAMES}")
    kind, arg = m.group("kind"), m.group("arg")
    needs_arg = {"epic", "cacheblend", "cachetune"}
    if kind in needs_arg and arg is None:
        raise ValueError(f"policy {name!r} needs a number, e.g. {kind}-16")
    if kind in ("full", "prefix", "naive") and arg is not None:
        raise ValueError(f"policy {kind!r} takes no number")
    if kind == "legolink":
        if arg != "0":
            raise ValueError("only legolink-0 is a separate policy; LegoLink-K is epic-K")
        return Policy("legolink-0", "legolink")
    if kind == "mepic-block":
        if arg is not None:
            raise ValueError("policy 'mepic-block' takes no number")
        return Policy("mepic-block", "mepic-block")
    if kind == "mepic":
        if arg is None:
            return Policy("mepic", "mepic", k=MEPIC_DEFAULT_K)
        k = int(arg)
        if k < 1:
            raise ValueError("mepic-K needs K >= 1 (K = 0 is the 'naive' policy)")
        return Policy(f"mepic-{k}", "mepic", k=k)
    if kind == "epic":
        return Policy(f"epic-{int(arg)}", "epic", k=int(arg))
    if kind in ("cacheblend", "cachetune"):
        r = int(arg)
        if not 0 < r <= 100:
            raise ValueError(f"{kind}-R needs 0 < R <= 100, got {r}")
        return Policy(f"{kind}-{r}", kind, ratio=r / 100)
    return Policy(kind, kind)


POLICY_NAMES = (
    "full",
    "prefix",
    "naive",
    "mepic",
    "mepic-K",
    "mepic-block",
    "epic-K",
    "legolink-0",
    "cacheblend-R",
    "cachetune-R",
)


def arrival_layout(segments: Sequence[Segment], policy: Policy, block_size: int) -> Layout:
    """The layout a segmented request is checked against when it arrives (the engine's intake
    and the HTTP server's pre-check share it, so both accept and reject the same requests).

    Packed policies keep each chunk's first tokens private, at the chunks' worst start slots;
    the others keep every chunk token private. Depends on lengths only, never on the cache.
    """
    counts = [
        policy.in_context_tokens(len(s.token_ids), block_size)
        for s in segments
        if s.kind is SegmentKind.CHUNK
    ]
    return build_packed_layout(segments, block_size, counts)
