"""An independent transformers implementation of MEPIC's semantics, for next-token logits.

Built only from the Hugging Face model's own modules (embeddings, norms, projections, MLP), with
attention and RoPE written here:

* every multi-block chunk is computed alone from position 0 (no pads: pads are never attended),
  and its per-layer K (un-rotated) and V are kept;
* in the request, prompt tokens and each chunk's first block are computed in context; a chunk's
  other tokens are not computed, their KV is the chunk-alone KV;
* every real token has its unsegmented position; K is rotated at its position when read.
"""

from __future__ import annotations

import torch

from ascend_mepic.core.segments import BlockKind, Segment, SegmentKind, build_layout


def _rotate(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style RoPE (HF Llama's rotate_half) as complex rotation, in float64. x [N, H, D]."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    rot = torch.polar(
        torch.ones(len(pos), d // 2, dtype=torch.float64), pos.double()[:, None] * inv
    )
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2 :].double()) * rot[:, None, :]
    return torch.cat((z.real, z.imag), dim=-1)


class MepicOracle:
    def __init__(self, model) -> None:
        self.model = model.eval()
        cfg = model.config
        self.theta = float(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"])
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads

    @torch.no_grad()
    def _run(self, tokens, positions, past):
        """Layers over ``tokens`` at ``positions``; ``past`` gives per-layer (K, V, pos) that
        precede them. Returns final hidden states and this pass's per-layer (K, V, pos)."""
        m = self.model.model
        h = m.embed_tokens(torch.tensor(tokens))
        pos = torch.tensor(positions)
        mine = []
        for i, layer in enumerate(m.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            n = len(tokens)
            q = attn.q_proj(x).view(n, self.heads, self.head_dim)
            k = attn.k_proj(x).view(n, self.kv_heads, self.head_dim)
            v = attn.v_proj(x).view(n, self.kv_heads, self.head_dim)
            mine.append((k, v, pos))
            pk, pv, ppos = past[i] if past else (k[:0], v[:0], pos[:0])
            keys, vals, kpos = torch.cat([pk, k]), torch.cat([pv, v]), torch.cat([ppos, pos])
            qr = _rotate(q, pos, self.theta)
            kr = _rotate(keys, kpos, self.theta)
            group = self.heads // self.kv_heads
            kr = kr.repeat_interleave(group, dim=1)
            vv = vals.double().repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", qr, kr) / self.head_dim**0.5
            scores = scores.masked_fill(kpos[None, None, :] > pos[None, :, None], float("-inf"))
            out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), vv)
            h = h + attn.o_proj(out.reshape(n, -1).to(h.dtype))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return m.norm(h), mine

    @torch.no_grad()
    def next_token_logprobs(self, segments: list[Segment], block_size: int) -> torch.Tensor:
        layout = build_layout(segments, block_size)
        positions = layout.slot_positions()
        padded = layout.padded_token_ids()
        chunk_kv = {}
        for span in layout.chunk_spans:
            if span.num_blocks > 1:
                toks = list(layout.chunk_tokens(span))
                _, kv = self._run(toks, list(range(len(toks))), None)
                chunk_kv[span.segment] = kv
        # Keys in layout order: in-context tokens computed here, shared ones from the chunk.
        past = None
        hidden = None
        for spec in layout.blocks:
            slots = range(
                spec.index * block_size + spec.valid_start, spec.index * block_size + spec.valid_end
            )
            if spec.kind is BlockKind.CHUNK_SHARED and spec.segment in chunk_kv:
                span = layout.spans[spec.segment]
                first_real = block_size - span.pad
                lo = first_real + (spec.index - span.first_block - 1) * block_size
                kv = [
                    (
                        k[lo : lo + block_size],
                        v[lo : lo + block_size],
                        torch.tensor([positions[s] for s in slots]),
                    )
                    for k, v, _ in chunk_kv[spec.segment]
                ]
            else:
                hidden, kv = self._run(
                    [padded[s] for s in slots], [positions[s] for s in slots], past
                )
            past = (
                kv
                if past is None
                else [
                    (torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]]), torch.cat([a[2], b[2]]))
                    for a, b in zip(past, kv, strict=True)
                ]
            )
        assert layout.blocks[-1].kind is BlockKind.PROMPT and hidden is not None
        logits = self.model.lm_head(hidden[-1:]).double()
        return torch.log_softmax(logits[0], dim=-1)


def full_segments(segments: list[Segment]) -> list[Segment]:
    """The same tokens as one prompt segment (full recompute)."""
    return [Segment(SegmentKind.PROMPT, tuple(t for s in segments for t in s.token_ids))]
