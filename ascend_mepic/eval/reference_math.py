"""The dense transformers reference's arithmetic helpers (``policy_reference``): RoPE's inverse
frequencies as each supported config states them, the question-attention probe, APE's
adjustment, CacheTune's scores and the small tensor utilities its prefills share."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ascend_mepic.core.segments import Segment, SegmentKind

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(config: Any) -> torch.Tensor:
    """RoPE inverse frequencies [D/2] in float64 from a transformers config (transformers 5's
    ``rope_parameters``): default, linear (positions / factor) or llama3 (Llama-3.1's smooth
    scaling of the low frequencies). Raises ValueError naming any other RoPE type."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"RoPE type {kind!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary RoPE is not supported")
    theta = float(rope.get("rope_theta", getattr(config, "rope_theta", None)))
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    inv = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if kind == "linear":
        return inv / float(rope["factor"])
    if kind == "llama3":
        factor, low, high = (
            float(rope[k]) for k in ("factor", "low_freq_factor", "high_freq_factor")
        )
        old_len = float(rope["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        # Short wavelengths kept, long ones divided by factor, a linear blend in between.
        smooth = ((old_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
        blended = (1 - smooth) * inv / factor + smooth * inv
        return torch.where(
            wavelen < old_len / high,
            inv,
            torch.where(wavelen > old_len / low, inv / factor, blended),
        )
    return inv


class _Probe:
    """Sum of attention probabilities from query rows at logical position >= ``q_from`` to each
    key, over every layer and head it sees (keys indexed as the request's tokens)."""

    def __init__(self, n_keys: int, q_from: int) -> None:
        self.total = torch.zeros(n_keys, dtype=torch.float64)
        self.q_from = q_from

    def add(self, probs: torch.Tensor, qpos_rows: torch.Tensor) -> None:
        sel = qpos_rows >= self.q_from  # probs [Hkv, rows, N], rows ordered as qpos_rows
        if bool(sel.any()):
            self.total[: probs.shape[-1]] += probs[:, sel, :].sum(dim=(0, 1))


@dataclass(frozen=True)
class _Ape:
    """APE's attention temperature and scaling for query rows at positions >= ``q_from``:
    logits over chunk keys divided by T, their log-sum-exp multiplied by S."""

    temperature: float
    lse_scale: float
    chunk_pos: torch.Tensor  # [N] bool, by logical position: the key is a chunk token
    q_from: int

    def adjust(self, scores: torch.Tensor, qpos_rows: torch.Tensor, kpos: torch.Tensor) -> None:
        rows = qpos_rows >= self.q_from
        if not bool(rows.any()):
            return
        ck = self.chunk_pos[kpos]
        z = scores[:, rows, :]
        zc = z.masked_fill(~ck, -math.inf) / self.temperature
        lse = torch.logsumexp(zc, dim=-1, keepdim=True)
        scores[:, rows, :] = torch.where(ck, zc + (self.lse_scale - 1.0) * lse, z)


def _request_tokens(segments: Sequence[Segment]) -> torch.Tensor:
    """The request's tokens, after the checks every policy's prefill needs."""
    if not segments or segments[-1].kind is not SegmentKind.PROMPT:
        raise ValueError("the request must end with a prompt segment (the question)")
    if any(not s.token_ids for s in segments):
        raise ValueError("segments must be non-empty")
    return torch.tensor([t for s in segments for t in s.token_ids])


def opening(segments: Sequence[Segment]) -> tuple[int, ...]:
    """The tokens before the request's first chunk (what ``anchor=prefix`` compiles after)."""
    out: list[int] = []
    for seg in segments:
        if seg.kind is SegmentKind.CHUNK:
            break
        out += seg.token_ids
    return tuple(out)


def _top(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the ``count`` highest scores, ties to the lower index (stable sort)."""
    order = torch.sort(-scores.double(), stable=True).indices
    return order[:count]


def _ceil_percent(percent: int, n: int) -> int:
    return -(-percent * n // 100)


def cachetune_scores(kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Per-token score of a chunk from its canonical per-layer (K un-rotated, V), each [L, H, D].

    Low-pass each layer's K and V along the token axis (keep the lowest floor((L//2+1)/2) rfft
    bins), take the mean of the tokens' K and V L2 norms, normalize by its mean over the chunk,
    then average over layers.
    """
    n = kv[0][0].shape[0]
    keep = (n // 2 + 1) // 2
    total = torch.zeros(n, dtype=torch.float64)
    for k, v in kv:
        s = torch.zeros(n, dtype=torch.float64)
        for x in (k, v):
            spec = torch.fft.rfft(x.reshape(n, -1).double(), dim=0)
            spec[keep:] = 0
            s += torch.fft.irfft(spec, n=n, dim=0).norm(dim=-1) / 2
        mean = s.mean()
        total += s / mean if mean > 0 else s
    return total / len(kv)


def _check_rope_against_hf(hf_model: torch.nn.Module, inv_freq: torch.Tensor) -> None:
    """Refuse a model whose own rotary module disagrees with ``rope_inv_freq`` (a RoPE variant
    this module does not restate) or scales cos/sin (attention_scaling != 1)."""
    rotary = getattr(getattr(hf_model, "model", None), "rotary_emb", None)
    theirs = getattr(rotary, "inv_freq", None)
    if theirs is None:
        return
    # transformers computes in float32: agreement to float32 rounding, not to float64.
    if theirs.shape != inv_freq.shape or not torch.allclose(
        theirs.detach().cpu().double(), inv_freq, rtol=1e-5, atol=0.0
    ):
        raise ValueError("the model's rotary inv_freq differs from its config's RoPE parameters")
    scaling = float(getattr(rotary, "attention_scaling", 1.0))
    if scaling != 1.0:
        raise ValueError(f"RoPE attention scaling {scaling} is not supported")


def _head_norm(attn: torch.nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
    """Qwen3's per-head RMSNorm of q or k (before RoPE); identity where the model has none."""
    norm = getattr(attn, name, None)
    return x if norm is None else norm(x)
