"""An independent transformers reference of the position-independent caching (PIC) policy family.

The engine implements each policy inside vLLM (paged blocks, compiles, fused kernels). This module
restates what each policy *means* with dense tensors, so the engine's outputs can be checked
against it and accuracy can be measured without the engine. It shares no code with the engine:
only the Hugging Face model's own modules are used (embeddings, norms, projections, MLP, LM head);
attention and RoPE are written here, in float64.

Models: the Llama family as transformers implements it (``SUPPORTED_MODEL_TYPES``): Llama
(llama3 RoPE scaling), Mistral, Qwen2 (QKV bias, carried by the HF projections) and Qwen3
(per-head RMSNorm of q and k before RoPE, so a chunk's cached K is the normed, un-rotated one).
RoPE inverse frequencies are computed here in float64 from the config (default, linear, llama3)
and checked against the HF model's own rotary module.

Semantics. Real tokens of a request have logical positions 0..N-1 (their index in the
unsegmented prompt). A chunk's *canonical* KV is the chunk run alone at chunk-local positions
0..L-1 (legolink-0: after 4 dummy tokens, whose KV is dropped); K is kept un-rotated and rotated
at the token's logical position when a request reads it. Per layer, each chunk token is either
*fresh* (its hidden state flows through the layer in the request's context, attending causally to
everything before it) or *canonical* (its KV at that layer is the canonical one). Prompt tokens
and continuation/decoded tokens are always fresh. A token's fresh layers are always a prefix of
the layer stack, so canonical tokens never need a hidden state again.

============== ==================================================================================
policy         fresh chunk tokens (chunk-relative offsets; f = real tokens of the first block)
============== ==================================================================================
full           all
naive          none
mepic          0..15 (a chunk of at most 16 tokens: all)
mepic-K        0..K-1 (a chunk of at most K tokens: all)
mepic-block    0..f-1 (a chunk of at most one block: all): the paper's first-block policy
epic-K         none in chunk 0; 0..min(K, L)-1 in later chunks
legolink-0     none (canonical KV computed after 4 dummy tokens)
cacheblend-R   all at layers <= check layer; above it the top ceil(R% of the request's chunk
               tokens) by the L2 deviation of fresh vs canonical un-rotated K at the check layer
cachetune-R    top ceil(R% of L) per chunk by low-frequency KV energy of the canonical KV, the same
               set at every layer (per-layer sets would need in-context hidden states for tokens
               that enter at a later layer)
============== ==================================================================================

Variants (issue 65): a base ``naive``, ``mepic`` or ``mepic-K`` followed by ``+``-separated
options, e.g. ``mepic+anchor=prefix+pick=q4``. Every variant keeps chunk KV canonical: one entry
per (anchor, chunk tokens), the same for every request, never written by a request.

* ``anchor=prefix``: each chunk is compiled after the request's prompt before its first chunk
  (positions continuing from it); the anchor's KV is not stored with the chunk. Identity:
  (anchor tokens, chunk tokens), so requests with the same prefix (a RAG deployment's template,
  system message and instruction) share entries and a request with another prefix gets its own.
* ``anchor=fixed``: compiled after ``fixed_anchor`` (a per-model or per-deployment text, e.g.
  the chat template's opening with a fixed system message), whatever the request's prefix.
* ``anchor=first`` / ``anchor=auto``: anchors chosen by a sequence of requests (the opening of
  the first request that read the chunk; ``prefix`` until a chunk is read under another
  opening, then none); the caller passes them per chunk (``prefill(..., chunk_anchors)``).
* ``pick=qF``: the K private tokens of a chunk of more than K tokens are its first F plus the
  K - F others with the most attention from the question rows (the trailing prompt segment)
  over the naive assembly (every chunk token canonical, same anchor), averaged over layers,
  heads and question rows: a probe pass of the prompt rows after the first chunk. ``pick=q``
  is F = 0. Private tokens are fresh at every layer; the rest of the chunk stays canonical.
* ``T=x``, ``S=y`` (APE): for query rows after the last chunk, logits over chunk keys are divided
  by T and their log-sum-exp multiplied by S (softmax over the adjusted logits); prompt-only:
  :meth:`PolicyReference.extend` and decoding do not apply it.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ascend_mepic.core.segments import Segment, SegmentKind
from ascend_mepic.eval.policy_names import (  # noqa: F401 (re-exported)
    _MEPIC_K,
    ANCHOR_KINDS,
    SEQUENCE_ANCHORS,
    Variant,
    is_variant,
    parse_policy,
    parse_variant,
)
from ascend_mepic.eval.reference_math import (  # noqa: F401 (re-exported)
    SUPPORTED_MODEL_TYPES,
    SUPPORTED_ROPE_TYPES,
    _Ape,
    _ceil_percent,
    _check_rope_against_hf,
    _head_norm,
    _Probe,
    _request_tokens,
    _top,
    cachetune_scores,
    opening,
    rope_inv_freq,
)

LEGOLINK_DUMMIES = 4
_QUERY_BLOCK = 128  # query rows per attention block


@dataclass(frozen=True)
class PromptState:
    """A request's prompt after prefill: per-layer rotated K and V (float64) for every real token,
    the next-token log-probs, and what the policy recomputed.

    Immutable: extending it (teacher forcing, decoding) returns a new state, so one prefill can
    serve a greedy generation and several teacher-forced scorings.
    """

    keys: tuple[torch.Tensor, ...]  # per layer [N, Hkv, D], rotated at the logical positions
    values: tuple[torch.Tensor, ...]  # per layer [N, Hkv, D]
    next_logprobs: torch.Tensor  # [vocab] float64
    recomputed: int  # chunk tokens fresh above layer 0 (cacheblend: the selected ones)
    chunk_tokens: int
    prompt_tokens: int
    probe_tokens: int = 0  # variants with pick: prompt rows the probe pass computes in addition
    canonical_runs: int | None = None  # variants: maximal runs of canonical tokens (table entries)

    @property
    def length(self) -> int:
        return self.keys[0].shape[0]

    @property
    def reuse_fraction(self) -> float:
        """Canonical chunk tokens (at the last layer) over all prompt tokens."""
        return (self.chunk_tokens - self.recomputed) / self.prompt_tokens


class PolicyReference:
    """Dense float64-attention forward of a Llama-family HF model (``SUPPORTED_MODEL_TYPES``)
    under each PIC policy.

    ``block_size`` fixes mepic-block's first block; ``dummy_token_id`` (the tokenizer's BOS) is
    needed by legolink-0; ``check_layer`` is CacheBlend's selection layer; ``fixed_anchor`` the
    token ids of the variants' ``anchor=fixed``. Canonical chunk KV is cached by token ids and
    anchor (``cache_size`` chunks, LRU), so running several policies on the same request computes
    each chunk alone once.
    """

    def __init__(
        self,
        hf_model: torch.nn.Module,
        block_size: int,
        dummy_token_id: int | None = None,
        check_layer: int = 1,
        cache_size: int = 32,
        fixed_anchor: Sequence[int] | None = None,
    ) -> None:
        cfg = hf_model.config
        if getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model type {getattr(cfg, 'model_type', None)!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if block_size < 1:
            raise ValueError(f"block size must be positive, got {block_size}")
        num_layers = cfg.num_hidden_layers
        if not 0 <= check_layer < num_layers:
            raise ValueError(f"check layer must be in [0, {num_layers}), got {check_layer}")
        self.model = hf_model.eval()
        self.block_size = block_size
        self.dummy_token_id = dummy_token_id
        self.check_layer = check_layer
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.inv_freq = rope_inv_freq(cfg)
        _check_rope_against_hf(hf_model, self.inv_freq)
        self.cache_size = cache_size
        self.fixed_anchor = None if fixed_anchor is None else tuple(int(t) for t in fixed_anchor)
        self._probe_cache: dict[tuple, tuple[torch.Tensor, int]] = {}
        self._canonical: OrderedDict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()

    # -- primitives -------------------------------------------------------------------------

    def _rotate(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Neox-style RoPE (HF Llama's rotate_half) in float64. x [N, H, D], pos [N]."""
        ang = pos.double()[:, None] * self.inv_freq  # [N, D/2]
        cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
        half = self.head_dim // 2
        a, b = x[..., :half].double(), x[..., half:].double()
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)

    def _attend(
        self,
        q: torch.Tensor,
        qpos: torch.Tensor,
        keys: torch.Tensor,
        vals: torch.Tensor,
        kpos: torch.Tensor,
        probe: _Probe | None = None,
        ape: _Ape | None = None,
    ) -> torch.Tensor:
        """Causal (by logical position) GQA attention in float64. q [n, H, D] un-rotated, keys
        rotated [N, Hkv, D], ``kpos`` ascending. Returns [n, H*D]. ``probe`` accumulates the
        attention probabilities, ``ape`` adjusts the logits of the rows after the chunks.

        Queries go in blocks that read only the keys at or before their last position, which
        skips most of the masked half of a long prompt's score matrix.
        """
        qr = self._rotate(q, qpos) * (1.0 / math.sqrt(self.head_dim))
        out = torch.empty(q.shape[0], self.heads * self.head_dim, dtype=torch.float64)
        for lo in range(0, q.shape[0], _QUERY_BLOCK):
            hi = min(lo + _QUERY_BLOCK, q.shape[0])
            end = int(torch.searchsorted(kpos, qpos[hi - 1], right=True))
            out[lo:hi] = self._attend_block(
                qr[lo:hi], qpos[lo:hi], keys[:end], vals[:end], kpos[:end], probe, ape
            )
        return out

    def _attend_block(
        self,
        qr: torch.Tensor,
        qpos: torch.Tensor,
        keys: torch.Tensor,
        vals: torch.Tensor,
        kpos: torch.Tensor,
        probe: _Probe | None = None,
        ape: _Ape | None = None,
    ) -> torch.Tensor:
        n, group = qr.shape[0], self.heads // self.kv_heads
        # Query heads sharing a KV head are stacked as rows of one matrix per KV head, so both
        # products are plain batched matmuls over KV heads (no GQA expansion of K and V).
        qr = qr.view(n, self.kv_heads, group, self.head_dim).permute(1, 2, 0, 3)
        qr = qr.reshape(self.kv_heads, group * n, self.head_dim)
        scores = torch.matmul(qr, keys.permute(1, 2, 0))  # [Hkv, group * n, N]
        scores.masked_fill_(kpos[None, :] > qpos.repeat(group)[:, None], -math.inf)
        if ape is not None:
            ape.adjust(scores, qpos.repeat(group), kpos)
        probs = torch.softmax(scores, dim=-1)
        if probe is not None:
            probe.add(probs, qpos.repeat(group))
        out = torch.matmul(probs, vals.permute(1, 0, 2))
        out = out.view(self.kv_heads, group, n, self.head_dim).permute(2, 0, 1, 3)
        return out.reshape(n, -1)

    # -- canonical KV -----------------------------------------------------------------------

    @torch.inference_mode()
    def canonical_kv(
        self, tokens: Sequence[int], dummies: bool = False, anchor: Sequence[int] = ()
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (K un-rotated, V) of a chunk computed alone, each [L, Hkv, D] in the model's
        dtype; with ``dummies`` after LEGOLINK_DUMMIES dummy tokens, with ``anchor`` after those
        tokens (positions continuing from them), in both cases their KV dropped."""
        key = self.canonical_key(tokens, dummies, anchor)
        hit = self._canonical.get(key)
        if hit is not None:
            self._canonical.move_to_end(key)
            return hit
        toks = list(tokens)
        skip = 0
        if dummies:
            if self.dummy_token_id is None:
                raise ValueError("legolink-0 needs dummy_token_id (the tokenizer's BOS id)")
            skip = LEGOLINK_DUMMIES
            toks = [self.dummy_token_id] * skip + toks
        if anchor:
            if dummies:
                raise ValueError("a chunk is compiled after dummies or after an anchor, not both")
            skip = len(anchor)
            toks = [int(t) for t in anchor] + toks
        pos = torch.arange(len(toks))
        _, raw, _ = self._layers(torch.tensor(toks), pos, pos, None)
        kv = [(k[skip:].clone(), v[skip:].clone()) for k, v in raw]
        self._canonical[key] = kv
        while len(self._canonical) > self.cache_size:
            self._canonical.popitem(last=False)
        return kv

    @staticmethod
    def canonical_key(
        tokens: Sequence[int], dummies: bool = False, anchor: Sequence[int] = ()
    ) -> tuple:
        """A chunk's canonical identity: its tokens (and how it was compiled). With an anchor the
        identity holds the anchor's tokens (the engine would key by their hash)."""
        key: tuple = (tuple(tokens), dummies)
        return key + (tuple(int(t) for t in anchor),) if anchor else key

    @property
    def _num_layers(self) -> int:
        return len(self.model.model.layers)

    # -- the layer stack --------------------------------------------------------------------

    def _layers(
        self,
        tokens: torch.Tensor,
        pos: torch.Tensor,
        rows: torch.Tensor,
        canon: list[tuple[torch.Tensor, torch.Tensor]] | None,
        past: PromptState | None = None,
        select: Callable[[torch.Tensor], torch.Tensor] | None = None,
        probe: _Probe | None = None,
        ape: _Ape | None = None,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
        """Run the stack over ``tokens`` at logical positions ``pos``, after ``past``'s tokens.

        Only ``rows`` are computed; the others take their per-layer K/V from ``canon``
        (un-rotated, [N, Hkv, D]). ``select``, called after CacheBlend's check layer with that
        layer's fresh K of the computed rows, returns the rows computed above it (a subset).
        Returns final-normed hidden states (valid for rows computed at the last layer), per-layer
        un-rotated (K, V) in the model's dtype and per-layer rotated K in float64.
        """
        m = self.model.model
        n = len(tokens)
        h = m.embed_tokens(tokens)
        raw: list[tuple[torch.Tensor, torch.Tensor]] = []
        rotated: list[torch.Tensor] = []
        for i, layer in enumerate(m.layers):
            attn = layer.self_attn
            r = len(rows)
            x = layer.input_layernorm(h[rows])
            q = _head_norm(attn, "q_norm", attn.q_proj(x).view(r, self.heads, self.head_dim))
            k_new = _head_norm(attn, "k_norm", attn.k_proj(x).view(r, self.kv_heads, self.head_dim))
            v_new = attn.v_proj(x).view(r, self.kv_heads, self.head_dim)
            if r == n:
                k, v = k_new, v_new
            else:
                assert canon is not None, "rows not computed need canonical KV"
                k, v = canon[i][0].clone(), canon[i][1].clone()
                k[rows], v[rows] = k_new, v_new
            raw.append((k, v))
            kr = self._rotate(k, pos)
            rotated.append(kr)
            keys, vals, kpos = kr, v.double(), pos
            if past is not None:
                keys = torch.cat([past.keys[i], kr])
                vals = torch.cat([past.values[i], vals])
                kpos = torch.arange(len(keys))
            out = self._attend(q, pos[rows], keys, vals, kpos, probe, ape)
            hr = h[rows] + attn.o_proj(out.to(h.dtype))
            hr = hr + layer.mlp(layer.post_attention_layernorm(hr))
            if r == n:
                h = hr
            else:
                h[rows] = hr
            if select is not None and i == self.check_layer:
                assert r == n, "CacheBlend computes every token up to its check layer"
                rows = select(k_new)
        return m.norm(h), raw, rotated

    def _assemble(
        self,
        segments: Sequence[Segment],
        parts: list[list[tuple[torch.Tensor, torch.Tensor]] | None],
    ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Per-layer canonical (K, V) over the whole request; rows without one stay zero."""
        if all(p is None for p in parts):
            return None
        n = sum(len(s.token_ids) for s in segments)
        ref = next(p for p in parts if p is not None)
        out = []
        for layer in range(self._num_layers):
            k = ref[layer][0].new_zeros((n, self.kv_heads, self.head_dim))
            v = torch.zeros_like(k)
            offset = 0
            for seg, part in zip(segments, parts, strict=True):
                L = len(seg.token_ids)
                if part is not None:
                    k[offset : offset + L] = part[layer][0]
                    v[offset : offset + L] = part[layer][1]
                offset += L
            out.append((k, v))
        return out

    # -- policies ---------------------------------------------------------------------------

    def _fresh_offsets(
        self, kind: str, arg: int | None, c: int, tokens: tuple[int, ...]
    ) -> torch.Tensor | None:
        """Chunk-relative fresh offsets of chunk ``c`` for static policies (None: all)."""
        n, b = len(tokens), self.block_size
        first = n - b * (-(-n // b) - 1)
        if kind == "full":
            return None
        if kind in ("naive", "legolink"):
            return torch.arange(0)
        if kind == "mepic":  # the first K tokens (all of a chunk of at most K: none shared)
            k = _MEPIC_K if arg is None else arg
            return None if n <= k else torch.arange(k)
        if kind == "mepic-block":  # the paper's: the first block's real tokens
            return None if n <= b else torch.arange(first)
        if kind == "epic":
            assert arg is not None
            return torch.arange(0) if c == 0 else torch.arange(min(arg, n))
        if kind == "cachetune":
            assert arg is not None
            top = _top(cachetune_scores(self.canonical_kv(tokens)), _ceil_percent(arg, n))
            return torch.sort(top).values
        raise AssertionError(kind)

    @torch.inference_mode()
    def prefill(
        self,
        segments: Sequence[Segment],
        policy: str,
        chunk_anchors: Sequence[Sequence[int]] | None = None,
    ) -> PromptState:
        """The request's prompt under ``policy`` (a policy or a variant, :func:`parse_variant`):
        KV of every token and next-token log-probs. ``chunk_anchors`` (variants without pick):
        each chunk's compile anchor, in chunk order, instead of the variant's own; how anchors
        that depend on earlier requests (``anchor=first|auto``) reach a request."""
        if is_variant(policy):
            return self._prefill_variant(segments, parse_variant(policy), chunk_anchors)
        if chunk_anchors is not None:
            raise ValueError(f"chunk_anchors need a variant, got {policy!r}")
        kind, arg = parse_policy(policy)
        tokens = _request_tokens(segments)
        n = len(tokens)
        pos = torch.arange(n)
        fresh = torch.ones(n, dtype=torch.bool)
        chunk_rows = torch.zeros(n, dtype=torch.bool)
        parts: list[list[tuple[torch.Tensor, torch.Tensor]] | None] = []
        offset, c = 0, 0
        for seg in segments:
            L = len(seg.token_ids)
            part = None
            if seg.kind is SegmentKind.CHUNK:
                chunk_rows[offset : offset + L] = True
                if kind == "cacheblend":
                    part = self.canonical_kv(seg.token_ids)
                else:
                    offs = self._fresh_offsets(kind, arg, c, seg.token_ids)
                    if offs is not None:
                        fresh[offset : offset + L] = False
                        fresh[offset + offs] = True
                        part = self.canonical_kv(seg.token_ids, dummies=kind == "legolink")
                c += 1
            parts.append(part)
            offset += L
        canon = self._assemble(segments, parts)
        chunk_total = int(chunk_rows.sum())
        if kind == "cacheblend":
            assert arg is not None
            h, raw, rotated, recomputed = self._cacheblend(tokens, chunk_rows, canon, arg)
        else:
            h, raw, rotated = self._layers(tokens, pos, fresh.nonzero().squeeze(1), canon)
            recomputed = int((fresh & chunk_rows).sum())
        logits = self.model.lm_head(h[-1:]).double()
        return PromptState(
            keys=tuple(rotated),
            values=tuple(v.double() for _, v in raw),
            next_logprobs=torch.log_softmax(logits[0], dim=-1),
            recomputed=recomputed,
            chunk_tokens=chunk_total,
            prompt_tokens=n,
        )

    # -- variants (issue 65) ------------------------------------------------------------------

    def anchor_tokens(self, segments: Sequence[Segment], anchor: str | None) -> tuple[int, ...]:
        """The compile anchor of a request's chunks: none, the prompt before its first chunk, or
        ``fixed_anchor``."""
        if anchor is None:
            return ()
        if anchor in SEQUENCE_ANCHORS:
            raise ValueError(f"anchor={anchor} depends on earlier requests: pass chunk_anchors")
        if anchor == "fixed":
            if self.fixed_anchor is None:
                raise ValueError("anchor=fixed needs fixed_anchor (the anchor's token ids)")
            return self.fixed_anchor
        return opening(segments)

    def canonical_parts(
        self, segments: Sequence[Segment], policy: str
    ) -> list[tuple[tuple, list[tuple[torch.Tensor, torch.Tensor]]] | None]:
        """Per segment, (identity, canonical per-layer (K, V)) of each chunk a variant reads
        canonical KV of; None for prompts and chunks entirely private. The KV is the cache's own
        entry: the same object for every request with that identity."""
        v = parse_variant(policy)
        anchor = self.anchor_tokens(segments, v.anchor)
        out: list[tuple[tuple, list[tuple[torch.Tensor, torch.Tensor]]] | None] = []
        for seg in segments:
            if seg.kind is SegmentKind.CHUNK and len(seg.token_ids) > v.k:
                key = self.canonical_key(seg.token_ids, anchor=anchor)
                out.append((key, self.canonical_kv(seg.token_ids, anchor=anchor)))
            else:
                out.append(None)
        return out

    @torch.inference_mode()
    def question_attention(
        self, segments: Sequence[Segment], anchor: str | None = None
    ) -> tuple[torch.Tensor, int]:
        """The probe pass: (per-token mean attention probability [N] from the question rows,
        prompt rows computed beyond the leading prefix).

        The request runs over its naive assembly (every chunk token canonical, compiled after
        ``anchor``; prompt tokens fresh); the question rows are the trailing prompt segment, and
        their attention is averaged over layers, query heads and rows. The leading prefix's KV
        does not depend on the chunks, so only the prompt rows after the first chunk are the
        probe's own cost. One request's result is kept (variants of a request share it).
        """
        tokens = torch.tensor([t for s in segments for t in s.token_ids])
        anchor_ids = self.anchor_tokens(segments, anchor)
        key = (tuple(tokens.tolist()), tuple(s.kind for s in segments), anchor_ids)
        hit = self._probe_cache.get(key)
        if hit is not None:
            return hit
        n = len(tokens)
        fresh = torch.ones(n, dtype=torch.bool)
        parts: list[list[tuple[torch.Tensor, torch.Tensor]] | None] = []
        offset, first_chunk = 0, None
        for seg in segments:
            L = len(seg.token_ids)
            part = None
            if seg.kind is SegmentKind.CHUNK:
                fresh[offset : offset + L] = False
                part = self.canonical_kv(seg.token_ids, anchor=anchor_ids)
                first_chunk = offset if first_chunk is None else first_chunk
            parts.append(part)
            offset += L
        q_from = n - len(segments[-1].token_ids)
        probe = _Probe(n, q_from)
        pos = torch.arange(n)
        self._layers(tokens, pos, fresh.nonzero().squeeze(1), self._assemble(segments, parts),
                     probe=probe)  # fmt: skip
        scores = probe.total / (self._num_layers * self.heads * (n - q_from))
        extra = 0 if first_chunk is None else int(fresh[first_chunk:].sum())
        self._probe_cache.clear()
        self._probe_cache[key] = (scores, extra)
        return scores, extra

    def _variant_offsets(
        self, v: Variant, tokens: tuple[int, ...], scores: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Chunk-relative private offsets of a variant (None: the whole chunk is private)."""
        n = len(tokens)
        if v.k == 0:
            return torch.arange(0)
        if n <= v.k:
            return None
        if v.pick is None:
            return torch.arange(v.k)
        assert scores is not None
        chosen = _top(scores[v.pick :], v.k - v.pick) + v.pick
        return torch.sort(torch.cat([torch.arange(v.pick), chosen])).values

    def _prefill_variant(
        self, segments: Sequence[Segment], v: Variant, chunk_anchors: Sequence[Sequence[int]] | None
    ) -> PromptState:
        """A variant's prompt: private chunk tokens fresh at every layer, the others read from
        the chunk's canonical entry (compiled after the variant's or ``chunk_anchors``' anchor)."""
        tokens = _request_tokens(segments)
        n = len(tokens)
        pos = torch.arange(n)
        n_chunks = sum(s.kind is SegmentKind.CHUNK for s in segments)
        if chunk_anchors is not None and (v.pick is not None or len(chunk_anchors) != n_chunks):
            raise ValueError("chunk_anchors: one per chunk, and not with pick")
        anchors = iter(chunk_anchors or ())
        anchor = () if chunk_anchors is not None else self.anchor_tokens(segments, v.anchor)
        scores, probe_tokens = None, 0
        needs_probe = v.pick is not None and any(
            s.kind is SegmentKind.CHUNK and len(s.token_ids) > v.k for s in segments
        )
        if needs_probe:
            scores, probe_tokens = self.question_attention(segments, v.anchor)
        fresh = torch.ones(n, dtype=torch.bool)
        chunk_rows = torch.zeros(n, dtype=torch.bool)
        parts: list[list[tuple[torch.Tensor, torch.Tensor]] | None] = []
        offset, runs = 0, 0
        for seg in segments:
            L = len(seg.token_ids)
            part = None
            if seg.kind is SegmentKind.CHUNK:
                chunk_rows[offset : offset + L] = True
                local = None if scores is None else scores[offset : offset + L]
                offs = self._variant_offsets(v, seg.token_ids, local)
                if chunk_anchors is not None:
                    anchor = tuple(next(anchors))
                if offs is not None:
                    fresh[offset : offset + L] = False
                    fresh[offset + offs] = True
                    part = self.canonical_kv(seg.token_ids, anchor=anchor)
                    canon = ~fresh[offset : offset + L]
                    runs += int(canon[0]) + int((canon[1:] & ~canon[:-1]).sum())
            parts.append(part)
            offset += L
        ape = None
        if v.temperature != 1.0 or v.lse_scale != 1.0:
            last_chunk_end = int(chunk_rows.nonzero().max()) + 1 if bool(chunk_rows.any()) else n
            ape = _Ape(v.temperature, v.lse_scale, chunk_rows, last_chunk_end)
        h, raw, rotated = self._layers(
            tokens, pos, fresh.nonzero().squeeze(1), self._assemble(segments, parts), ape=ape
        )
        logits = self.model.lm_head(h[-1:]).double()
        return PromptState(
            keys=tuple(rotated),
            values=tuple(val.double() for _, val in raw),
            next_logprobs=torch.log_softmax(logits[0], dim=-1),
            recomputed=int((fresh & chunk_rows).sum()),
            chunk_tokens=int(chunk_rows.sum()),
            prompt_tokens=n,
            probe_tokens=probe_tokens,
            canonical_runs=runs,
        )

    def _cacheblend(
        self,
        tokens: torch.Tensor,
        chunk_rows: torch.Tensor,
        canon: list[tuple[torch.Tensor, torch.Tensor]] | None,
        percent: int,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor], int]:
        """Every token fresh up to the check layer; above it prompt tokens and the chunk tokens
        whose fresh K deviates most from the canonical K at the check layer."""
        n = len(tokens)
        chunk_idx = chunk_rows.nonzero().squeeze(1)
        count = _ceil_percent(percent, len(chunk_idx))
        picked: list[torch.Tensor] = []

        def select(k_fresh: torch.Tensor) -> torch.Tensor:
            assert canon is not None
            ref = canon[self.check_layer][0]
            dev = (k_fresh[chunk_idx].double() - ref[chunk_idx].double()).flatten(1).norm(dim=1)
            chosen = chunk_idx[_top(dev, count)]
            keep = ~chunk_rows
            keep[chosen] = True
            picked.append(chosen)
            return keep.nonzero().squeeze(1)

        everyone = torch.arange(n)
        if canon is None:  # no chunks: a plain prompt
            h, raw, rotated = self._layers(tokens, everyone, everyone, None)
            return h, raw, rotated, 0
        h, raw, rotated = self._layers(tokens, everyone, everyone, canon, None, select)
        last = self.check_layer == self._num_layers - 1
        return h, raw, rotated, len(chunk_idx) if last else len(picked[0])

    # -- public API -------------------------------------------------------------------------

    @torch.inference_mode()
    def extend(self, state: PromptState, tokens: Sequence[int]) -> tuple[torch.Tensor, PromptState]:
        """Feed ``tokens`` after ``state`` (fresh, like decode). Returns the log-probs predicting
        each next token [len(tokens), vocab] (float64) and the extended state."""
        if not tokens:
            return state.next_logprobs.new_empty((0, len(state.next_logprobs))), state
        toks = torch.tensor(list(tokens))
        pos = torch.arange(state.length, state.length + len(toks))
        h, raw, rotated = self._layers(toks, pos, torch.arange(len(toks)), None, past=state)
        lp = torch.log_softmax(self.model.lm_head(h).double(), dim=-1)
        new = PromptState(
            keys=tuple(torch.cat([a, b]) for a, b in zip(state.keys, rotated, strict=True)),
            values=tuple(
                torch.cat([a, v.double()]) for a, (_, v) in zip(state.values, raw, strict=True)
            ),
            next_logprobs=lp[-1],
            recomputed=state.recomputed,
            chunk_tokens=state.chunk_tokens,
            prompt_tokens=state.prompt_tokens,
        )
        return lp, new

    def score(self, state: PromptState, continuation: Sequence[int] = ()) -> torch.Tensor:
        """[1 + len(continuation), vocab] log-probs: after the prompt, then teacher-forced after
        each continuation token. The prompt's KV is reused, not recomputed."""
        lp, _ = self.extend(state, continuation)
        return torch.cat([state.next_logprobs[None], lp])

    def greedy(
        self, state: PromptState, max_new_tokens: int, eos_token_id: int | Sequence[int] | None
    ) -> list[int]:
        """Greedy decoding from a prefilled prompt; the EOS token, if produced, ends the list."""
        return self.greedy_batch([state], max_new_tokens, eos_token_id)[0]

    @torch.inference_mode()
    def greedy_batch(
        self,
        states: Sequence[PromptState],
        max_new_tokens: int,
        eos_token_id: int | Sequence[int] | None,
    ) -> list[list[int]]:
        """Greedy decoding of several prefilled prompts in lockstep.

        One decode step reads every weight matrix once for all sequences (decode on a CPU is
        bound by reading weights) and attends for all of them in two matmuls. Batched float32
        matmuls may round differently from single rows, so a near-tie argmax could differ from
        :meth:`greedy` on one state; results are deterministic for a given batch.
        """
        stop = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id or ())
        b = len(states)
        lengths = torch.tensor([s.length for s in states])
        cap = int(lengths.max()) + max_new_tokens
        # Per layer [b, Hkv, cap, D]: the layout in which both attention products are batched
        # matmuls over (sequence, KV head) without copying the cache.
        keys, values = [], []
        for i in range(self._num_layers):
            k = torch.zeros(b, self.kv_heads, cap, self.head_dim, dtype=torch.float64)
            v = torch.zeros_like(k)
            for j, s in enumerate(states):
                k[j, :, : s.length] = s.keys[i].transpose(0, 1)
                v[j, :, : s.length] = s.values[i].transpose(0, 1)
            keys.append(k)
            values.append(v)
        outs: list[list[int]] = [[] for _ in states]
        done = [False] * b
        lp = torch.stack([s.next_logprobs for s in states])
        for _ in range(max_new_tokens):
            toks = lp.argmax(dim=-1)
            for j in range(b):
                if not done[j]:
                    outs[j].append(int(toks[j]))
                    done[j] = outs[j][-1] in stop or len(outs[j]) == max_new_tokens
            if all(done):
                break
            lp = self._decode_step(keys, values, lengths, toks)
            lengths = lengths + 1
        return outs

    def _decode_step(
        self,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        lengths: torch.Tensor,
        tokens: torch.Tensor,
    ) -> torch.Tensor:
        """One token per sequence at position ``lengths``; writes its KV into the caches and
        returns log-probs [b, vocab]. Finished sequences keep stepping (their rows are ignored):
        cheaper than reshaping the batch, since decode cost is reading the weights."""
        m = self.model.model
        b, group = len(tokens), self.heads // self.kv_heads
        rows = torch.arange(b)
        span = int(lengths.max()) + 1
        masked = torch.arange(span)[None, :] > lengths[:, None]  # [b, span]
        h = m.embed_tokens(tokens)
        for i, layer in enumerate(m.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = _head_norm(attn, "q_norm", attn.q_proj(x).view(b, self.heads, self.head_dim))
            k = _head_norm(attn, "k_norm", attn.k_proj(x).view(b, self.kv_heads, self.head_dim))
            v = attn.v_proj(x).view(b, self.kv_heads, self.head_dim)
            keys[i][rows, :, lengths] = self._rotate(k, lengths)
            values[i][rows, :, lengths] = v.double()
            qr = self._rotate(q, lengths) * (1.0 / math.sqrt(self.head_dim))
            qr = qr.view(b, self.kv_heads, group, self.head_dim)
            # K @ q^T is the faster orientation for a handful of query rows per sequence.
            scores = torch.matmul(keys[i][:, :, :span], qr.transpose(2, 3)).transpose(2, 3)
            scores = scores.masked_fill(masked[:, None, None, :], -math.inf)  # [b, Hkv, g, span]
            out = torch.matmul(torch.softmax(scores, dim=-1), values[i][:, :, :span])
            h = h + attn.o_proj(out.reshape(b, -1).to(h.dtype))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return torch.log_softmax(self.model.lm_head(m.norm(h)).double(), dim=-1)

    def logprobs(
        self, segments: Sequence[Segment], policy: str, continuation: Sequence[int] = ()
    ) -> torch.Tensor:
        """Float64 log-softmax [1 + len(continuation), vocab] of the request under ``policy``."""
        return self.score(self.prefill(segments, policy), continuation)

    def generate(
        self,
        segments: Sequence[Segment],
        policy: str,
        max_new_tokens: int,
        eos_token_id: int | Sequence[int] | None = None,
    ) -> list[int]:
        """Greedy tokens (ending with EOS if it was produced) under ``policy``."""
        return self.greedy(self.prefill(segments, policy), max_new_tokens, eos_token_id)

    def recomputed_tokens(self, segments: Sequence[Segment], policy: str) -> tuple[int, float]:
        """(chunk tokens fresh above layer 0, canonical chunk tokens / prompt tokens).

        Static policies need no model run beyond canonical KV; CacheBlend runs the prefill,
        since its selection depends on the request.
        """
        state = self.prefill(segments, policy)
        return state.recomputed, state.reuse_fraction
