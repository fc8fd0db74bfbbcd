"""What a request asks a replica to hold: its leading prompt tokens and each chunk's tokens.

The front must see the tokens the replica will see, because the indexer matches token blocks.
It reads them with the server's own code (``completion_pieces``, ``pieces_segments``,
``marked_text_segments``, ``segments_from_real``), so the tokens are the server's exactly:

* the token-level form (``prompt`` token ids + ``vllm_xargs.mepic_segments``): as sent;
* a completion prompt of pieces, or a marked completion string: tokenized as MEPIC's server
  tokenizes it (each piece alone, BOS first when the tokenizer adds one and
  ``add_special_tokens`` is not false);
* anything else (chat requests, prompts without chunks, a reference to a registered chunk, which
  only the replica can resolve): no chunks, so the policy falls back to load alone for the
  chunks it cannot see.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ascend_mepic.core.markers import MarkerError, Markers
from ascend_mepic.core.segments import EXTRA_ARGS_KEY, LayoutError, SegmentKind, segments_from_real


@dataclass(frozen=True)
class RoutingView:
    """The tokens a routing policy scores a request by."""

    prompt: tuple[int, ...] = ()  # the whole prompt, as the engine gets it (empty: unknown)
    chunks: tuple[tuple[int, ...], ...] = ()  # each chunk's tokens, in prompt order
    prefix: tuple[int, ...] = field(default=())  # the prompt tokens before the first chunk

    @property
    def chunk_tokens(self) -> int:
        return sum(len(c) for c in self.chunks)


class _NoRefs:
    """A resolver for registered-chunk references, which only the replica can resolve."""

    def __call__(self, chunk_id: str) -> Sequence[int]:
        raise LookupError(chunk_id)


def _view(segments: Sequence[Any]) -> RoutingView:
    chunks = tuple(tuple(s.token_ids) for s in segments if s.kind is SegmentKind.CHUNK)
    prefix: list[int] = []
    for s in segments:
        if s.kind is SegmentKind.CHUNK:
            break
        prefix += s.token_ids
    prompt = tuple(t for s in segments for t in s.token_ids)
    return RoutingView(prompt=prompt, chunks=chunks, prefix=tuple(prefix))


class RequestReader:
    """Reads the routing view of completion requests with the model's tokenizer."""

    def __init__(self, tokenizer: Any, markers: Markers | None = None) -> None:
        from ascend_mepic.entrypoints.server.text_segments import tokenizer_adds_bos

        self.tokenizer = tokenizer
        self.markers = markers or Markers()
        self._adds_bos = tokenizer_adds_bos(tokenizer) if tokenizer is not None else False

    def completion(self, body: dict[str, Any]) -> RoutingView:
        """The view of a ``/v1/completions`` body; an empty view where it cannot tell."""
        from ascend_mepic.entrypoints.server.chunk_parts import completion_pieces, is_piece_prompt
        from ascend_mepic.entrypoints.server.text_segments import (
            MepicRequestError,
            has_markup,
            marked_text_segments,
            pieces_segments,
        )

        prompt = body.get("prompt")
        xargs = body.get("vllm_xargs") or {}
        try:
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                if EXTRA_ARGS_KEY in xargs:
                    return _view(segments_from_real(prompt, xargs[EXTRA_ARGS_KEY]))
                return RoutingView(prompt=tuple(prompt), prefix=tuple(prompt))
            if self.tokenizer is None:
                return RoutingView()
            add_bos = self._adds_bos and body.get("add_special_tokens", True) is not False
            if is_piece_prompt(prompt):
                pieces = completion_pieces(prompt)
                return _view(pieces_segments(self.tokenizer, pieces, _NoRefs(), add_bos))
            if isinstance(prompt, str) and has_markup(prompt, self.markers):
                segs = marked_text_segments(
                    self.tokenizer, prompt, self.markers, _NoRefs(), add_bos
                )
                return _view(segs)
            if isinstance(prompt, str):
                ids = tuple(self.tokenizer.encode(prompt, add_special_tokens=add_bos))
                return RoutingView(prompt=ids, prefix=ids)
        except (LookupError, MarkerError, LayoutError, MepicRequestError, TypeError, ValueError):
            # Malformed, or a registered chunk: the replica answers (a 400 names the problem).
            return RoutingView()
        return RoutingView()
