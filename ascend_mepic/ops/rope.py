"""RoPE parameters taken from the model's own rotary module, and the torch rotation.

MEPIC keeps K un-rotated in the cache and rotates Q and every K at read time, so the attention op
needs exactly the model's rotation: its ``cos_sin_cache`` (``[max_position, rotary_dim]``, cosines
in the first half, sines in the second, vLLM's layout) and its style (neox: rotate halves; GPT-J:
rotate interleaved pairs). Only static caches over the full head dimension are supported: a cache
that changes with sequence length (dynamic NTK, long-RoPE switching), multimodal M-RoPE or partial
rotary dims cannot be applied per key at read time as a plain lookup, and are rejected.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Rotary classes whose cos/sin cache is a fixed function of the position (vLLM 0.30.0 names).
SUPPORTED_ROTARY_CLASSES = (
    "RotaryEmbedding",
    "Llama3RotaryEmbedding",
    "LinearScalingRotaryEmbedding",
    "NTKScalingRotaryEmbedding",
    "YaRNScalingRotaryEmbedding",
)


class UnsupportedRopeError(ValueError):
    """A rotary configuration that fused read-time RoPE cannot reproduce exactly."""


@dataclass(frozen=True)
class RopeSpec:
    cos_sin_cache: torch.Tensor  # [max_position, head_size]: cos | sin
    is_neox_style: bool

    @property
    def head_size(self) -> int:
        return self.cos_sin_cache.shape[-1]

    @property
    def max_position(self) -> int:
        return self.cos_sin_cache.shape[0]

    @classmethod
    def from_module(cls, rotary: torch.nn.Module, head_size: int) -> RopeSpec:
        """Validate a vLLM rotary module and take its cache and style."""
        name = getattr(type(rotary), "mepic_base_name", type(rotary).__name__)
        if name not in SUPPORTED_ROTARY_CLASSES:
            raise UnsupportedRopeError(
                f"rotary embedding {name} is not supported by fused read-time RoPE "
                f"(supported: {', '.join(SUPPORTED_ROTARY_CLASSES)}); its cos/sin depend on more "
                "than the position or it is multimodal"
            )
        rotary_dim = getattr(rotary, "rotary_dim", None)
        if rotary_dim != head_size:
            raise UnsupportedRopeError(
                f"partial rotary dims are not supported: rotary_dim={rotary_dim}, "
                f"head_size={head_size}"
            )
        cache = rotary.cos_sin_cache
        return cls.from_cache(cache, bool(rotary.is_neox_style))

    @classmethod
    def from_cache(cls, cos_sin_cache: torch.Tensor, is_neox_style: bool) -> RopeSpec:
        if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] % 2:
            raise UnsupportedRopeError(
                f"cos_sin_cache must be [max_position, even rotary_dim], got "
                f"{tuple(cos_sin_cache.shape)}"
            )
        return cls(cos_sin_cache, is_neox_style)


def default_cos_sin_cache(
    head_size: int, max_position: int, base: float = 10000.0, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The standard RoPE cache (what vLLM's plain RotaryEmbedding computes), for tests/benches."""
    inv_freq = 1.0 / (
        base ** (torch.arange(0, head_size, 2, dtype=torch.float64, device=device) / head_size)
    )
    t = torch.arange(max_position, dtype=torch.float64, device=device)
    freqs = torch.outer(t, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).float()


def apply_rope(x: torch.Tensor, positions: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    """Rotate ``x`` ``[N, H, D]`` at ``positions`` ``[N]`` in fp32; returns ``x.dtype``."""
    cos_sin = rope.cos_sin_cache.index_select(0, positions.long()).float()
    cos, sin = cos_sin.chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    xf = x.float()
    if rope.is_neox_style:
        x1, x2 = xf.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return out.to(x.dtype)
