"""An independent transformers implementation of MEPIC's semantics, for next-token logits.

Built only from the Hugging Face model's own modules (embeddings, norms, projections, MLP), with
attention and RoPE written here:

* every chunk with tokens left after its first ``k`` is computed alone from position 0, and its
  per-layer K (un-rotated) and V are kept;
* in the request, prompt tokens and each chunk's first ``k`` tokens are computed in context; a
  chunk's other tokens are not computed, their KV is the chunk-alone KV;
* every real token has its unsegmented position; K is rotated at its position when read.

``k`` per chunk comes from the caller (MEPIC: 16; the paper's first-block policy: the first
block's real tokens); no layout, block or padding is involved.

Anchored compiles (``anchor`` tokens given): every chunk is computed after the anchor tokens
(at positions 0..A-1, the chunk at A..A+L-1) instead of alone, and only the chunk's own K and V
are kept; the anchor's are dropped.

Issue 65's variants (:meth:`MepicOracle.variant_logprobs`): any set of private offsets per chunk
(computed in context, the rest chunk-alone KV) and a compile anchor (the chunk computed alone
after the anchor's tokens, positions continuing from them, the anchor's KV dropped);
:meth:`MepicOracle.question_attention` is the question rows' attention over the naive assembly,
from this file's own attention.

Models: Llama, Mistral, Qwen2 (its QKV bias is in the HF projections) and Qwen3 (q and k are
RMS-normed per head before RoPE, so the chunk-alone K kept is normed and un-rotated). Default RoPE
is computed here from its base; a scaled RoPE (Llama-3.1's llama3) takes its inverse frequencies
from the HF model's own rotary module, so this oracle shares no RoPE code with the policy
reference, which computes them from the config.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ascend_mepic.core.segments import Segment, SegmentKind


def first_k(k: int) -> Callable[[int], int]:
    """MEPIC's rule: the first ``k`` tokens of a chunk are computed in context."""
    return lambda n: min(k, n)


def first_block(block_size: int) -> Callable[[int], int]:
    """The paper's rule: the first block's real tokens of the front-padded chunk."""
    return lambda n: n - block_size * (-(-n // block_size) - 1)


MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def _rotate(x: torch.Tensor, pos: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """Neox-style RoPE (HF Llama's rotate_half) as complex rotation, in float64. x [N, H, D],
    ``inv`` the inverse frequencies [D/2]."""
    d = x.shape[-1]
    rot = torch.polar(
        torch.ones(len(pos), d // 2, dtype=torch.float64), pos.double()[:, None] * inv
    )
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2 :].double()) * rot[:, None, :]
    return torch.cat((z.real, z.imag), dim=-1)


def _inv_freq(model, head_dim: int) -> torch.Tensor:
    """Default RoPE from its base (float64); any other type from the HF rotary module."""
    cfg = model.config
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") == "default":
        theta = float(getattr(cfg, "rope_theta", None) or rope["rope_theta"])
        return theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    rotary = model.model.rotary_emb
    assert float(rotary.attention_scaling) == 1.0, "RoPE that scales cos/sin is not modelled"
    return rotary.inv_freq.detach().double().cpu()


def _norm(attn, name: str, x: torch.Tensor) -> torch.Tensor:
    """Qwen3's per-head q/k RMSNorm (before RoPE); nothing for the other families."""
    norm = getattr(attn, name, None)
    return x if norm is None else norm(x)


class MepicOracle:
    def __init__(self, model) -> None:
        self.model = model.eval()
        cfg = model.config
        assert cfg.model_type in MODEL_TYPES, f"model type {cfg.model_type!r} is not modelled"
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.inv_freq = _inv_freq(model, self.head_dim)

    @torch.no_grad()
    def _run(self, tokens, positions, past, capture=None):
        """Layers over ``tokens`` at ``positions``; ``past`` gives per-layer (K, V, pos) that
        precede them. Returns final hidden states and this pass's per-layer (K, V, pos);
        ``capture`` (a list) receives each layer's attention probabilities [H, q, k]."""
        m = self.model.model
        h = m.embed_tokens(torch.tensor(tokens))
        pos = torch.tensor(positions)
        mine = []
        for i, layer in enumerate(m.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            n = len(tokens)
            q = _norm(attn, "q_norm", attn.q_proj(x).view(n, self.heads, self.head_dim))
            k = _norm(attn, "k_norm", attn.k_proj(x).view(n, self.kv_heads, self.head_dim))
            v = attn.v_proj(x).view(n, self.kv_heads, self.head_dim)
            mine.append((k, v, pos))
            pk, pv, ppos = past[i] if past else (k[:0], v[:0], pos[:0])
            keys, vals, kpos = torch.cat([pk, k]), torch.cat([pv, v]), torch.cat([ppos, pos])
            qr = _rotate(q, pos, self.inv_freq)
            kr = _rotate(keys, kpos, self.inv_freq)
            group = self.heads // self.kv_heads
            kr = kr.repeat_interleave(group, dim=1)
            vv = vals.double().repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", qr, kr) / self.head_dim**0.5
            scores = scores.masked_fill(kpos[None, None, :] > pos[None, :, None], float("-inf"))
            probs = torch.softmax(scores, -1)
            if capture is not None:
                capture.append(probs)
            out = torch.einsum("hqk,khd->qhd", probs, vv)
            h = h + attn.o_proj(out.reshape(n, -1).to(h.dtype))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return m.norm(h), mine

    @torch.no_grad()
    def next_token_logprobs(
        self,
        segments: list[Segment],
        in_context: Callable[[int], int],
        anchor: tuple[int, ...] = (),
    ) -> torch.Tensor:
        """Next-token log-probs when each chunk of n tokens has ``in_context(n)`` leading tokens
        computed in the request and the rest taken from the chunk computed alone (after the
        ``anchor`` tokens, whose KV is dropped, when given)."""
        past = None
        hidden = None
        position = 0

        def extend(kv):
            nonlocal past
            past = (
                kv
                if past is None
                else [
                    (torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]]), torch.cat([a[2], b[2]]))
                    for a, b in zip(past, kv, strict=True)
                ]
            )

        for seg in segments:
            toks = list(seg.token_ids)
            n = len(toks)
            k = n if seg.kind is SegmentKind.PROMPT else in_context(n)
            if k:
                hidden, kv = self._run(toks[:k], list(range(position, position + k)), past)
                extend(kv)
            if k < n:
                a = len(anchor)
                _, alone = self._run([*anchor, *toks], list(range(a + n)), None)
                pos = torch.arange(position + k, position + n)
                extend([(ka[a + k :], va[a + k :], pos) for ka, va, _ in alone])
            position += n
        assert segments[-1].kind is SegmentKind.PROMPT and hidden is not None
        logits = self.model.lm_head(hidden[-1:]).double()
        return torch.log_softmax(logits[0], dim=-1)

    def _alone(self, toks: list[int], anchor: list[int]):
        """A chunk's per-layer (K, V) computed alone after ``anchor`` (its KV dropped)."""
        m = len(anchor)
        _, kv = self._run(list(anchor) + toks, list(range(m + len(toks))), None)
        return [(k[m:], v[m:]) for k, v, _ in kv]

    @torch.no_grad()
    def variant_logprobs(
        self,
        segments: list[Segment],
        private: Callable[[int, int], list[int]],
        anchor: list[int] = (),
    ) -> torch.Tensor:
        """Next-token log-probs when chunk ``c`` of ``n`` tokens has offsets ``private(c, n)``
        computed in the request and the rest taken from the chunk computed alone after
        ``anchor``: runs of private and canonical tokens, in order."""
        past, hidden, position, c = None, None, 0, 0

        def extend(kv):
            nonlocal past
            past = kv if past is None else [
                (torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]]), torch.cat([a[2], b[2]]))
                for a, b in zip(past, kv, strict=True)
            ]  # fmt: skip

        for seg in segments:
            toks = list(seg.token_ids)
            n = len(toks)
            if seg.kind is SegmentKind.PROMPT:
                hidden, kv = self._run(toks, list(range(position, position + n)), past)
                extend(kv)
                position += n
                continue
            mine = set(private(c, n))
            c += 1
            alone = None if len(mine) == n else self._alone(toks, list(anchor))
            j = 0
            while j < n:
                e = j
                while e < n and ((e in mine) == (j in mine)):
                    e += 1
                pos = list(range(position + j, position + e))
                if j in mine:
                    _, kv = self._run(toks[j:e], pos, past)
                    extend(kv)
                else:
                    extend([(k[j:e], v[j:e], torch.tensor(pos)) for k, v in alone])
                j = e
            position += n
        assert segments[-1].kind is SegmentKind.PROMPT and hidden is not None
        logits = self.model.lm_head(hidden[-1:]).double()
        return torch.log_softmax(logits[0], dim=-1)

    @torch.no_grad()
    def question_attention(self, segments: list[Segment], anchor: list[int] = ()) -> torch.Tensor:
        """Per token, the question rows' (the last segment's) attention probability over the
        naive assembly (every chunk token chunk-alone after ``anchor``), averaged over layers,
        heads and question rows."""
        past, position = None, 0
        for i, seg in enumerate(segments):
            toks = list(seg.token_ids)
            n = len(toks)
            if seg.kind is SegmentKind.CHUNK:
                kv = [(k, v, torch.arange(position, position + n))
                      for k, v in self._alone(toks, list(anchor))]  # fmt: skip
            else:
                capture = [] if i == len(segments) - 1 else None
                _, kv = self._run(toks, list(range(position, position + n)), past, capture)
            past = kv if past is None else [
                (torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]]), torch.cat([a[2], b[2]]))
                for a, b in zip(past, kv, strict=True)
            ]  # fmt: skip
            position += n
        probs = torch.stack(capture)  # [layers, H, q, N]
        return probs.mean(dim=(0, 1, 2))


def full_segments(segments: list[Segment]) -> list[Segment]:
    """The same tokens as one prompt segment (full recompute)."""
    return [Segment(SegmentKind.PROMPT, tuple(t for s in segments for t in s.token_ids))]
