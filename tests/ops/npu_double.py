"""A plain-torch test double of the two torch_npu ops the NPU attention path composes.

Written from the op-plugin documentation (``docs/context/torch_npu-npu_rotary_mul.md`` and
``torch_npu-npu_fused_infer_attention_score.md``), not from ``ascend_mepic.ops.npu``: it computes
the documented formulas and rejects the inputs the documentation rules out for Atlas A2 (910B), so
that a composition relying on undocumented behaviour fails here instead of on hardware.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

INT_MAX = 2147483647
ROTARY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
A2_ATTENTION_DTYPES = (torch.float16, torch.bfloat16)
MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)

# Keyword arguments of npu_fused_infer_attention_score this double does not model; they must stay
# at their documented defaults.
UNMODELLED = {
    "pse_shift": None,
    "actual_seq_lengths": None,
    "actual_seq_lengths_kv": None,
    "dequant_scale1": None,
    "quant_scale1": None,
    "dequant_scale2": None,
    "quant_scale2": None,
    "quant_offset2": None,
    "antiquant_scale": None,
    "antiquant_offset": None,
    "block_table": None,
    "query_padding_size": None,
    "kv_padding_size": None,
    "key_antiquant_scale": None,
    "key_antiquant_offset": None,
    "value_antiquant_scale": None,
    "value_antiquant_offset": None,
    "key_shared_prefix": None,
    "value_shared_prefix": None,
    "actual_shared_prefix_len": None,
    "query_rope": None,
    "key_rope": None,
    "key_rope_antiquant_scale": None,
    "block_size": 0,
    "antiquant_mode": 0,
    "key_antiquant_mode": 0,
    "value_antiquant_mode": 0,
}


class DocumentedConstraintError(ValueError):
    """An input the torch_npu documentation does not allow (real hardware would fail or differ)."""


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise DocumentedConstraintError(what)


@dataclass
class NpuOpsDouble:
    """Stands in for the ``torch_npu`` module: ``npu_rotary_mul`` and ``npu_fused_infer_...``.

    ``attention_dtypes`` defaults to what the A2 documentation allows; a test may widen it to
    float32 to check a composition's index logic at tight tolerance. Calls are recorded.
    """

    attention_dtypes: tuple[torch.dtype, ...] = A2_ATTENTION_DTYPES
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def npu_rotary_mul(
        self, input: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half"
    ) -> torch.Tensor:
        """``r1 * input + r2 * rotate(input)``; rotate per ``rotary_mode`` ("half"/"interleave")."""
        self.calls.append(("npu_rotary_mul", {"shape": tuple(input.shape), "mode": rotary_mode}))
        _require(input.dim() == 4 and r1.dim() == 4 and r2.dim() == 4, "inputs must be 4-D")
        for name, t in (("input", input), ("r1", r1), ("r2", r2)):
            _require(t.dtype in ROTARY_DTYPES, f"{name} dtype {t.dtype} not supported")
        _require(r1.shape == r2.shape, "r1 and r2 must have the same shape")
        d = input.shape[-1]
        _require(d % 2 == 0 and d < 896, f"D={d} must be even and < 896")
        _require(r1.shape[-1] == d, "r1/r2 must span the full last dimension D")
        # Documented r1/r2 forms for BSND input (the layout is not passed, the shape tells it):
        # half accepts 1S1D, BS1D, BSND; interleave only 1S1D. The same holds for BNSD (11SD) and
        # SBND (S11D); require a broadcast over B and N, and in interleave mode one non-1 axis.
        _require(
            all(r == x or r == 1 for r, x in zip(r1.shape, input.shape, strict=True)),
            f"r1 {tuple(r1.shape)} does not broadcast to input {tuple(input.shape)}",
        )
        if rotary_mode == "interleave":
            non_unit = [i for i in range(3) if r1.shape[i] != 1]
            _require(len(non_unit) <= 1, "interleave mode takes r1/r2 as 11SD, 1S1D or S11D only")
        batch_heads = input.shape[0] * input.shape[2]
        _require(batch_heads < 1000, "B*N must be < 1000")
        x = input.float()
        if rotary_mode == "half":
            first, second = x[..., : d // 2], x[..., d // 2 :]
            turned = torch.cat((-second, first), dim=-1)
        elif rotary_mode == "interleave":
            even, odd = x[..., 0::2], x[..., 1::2]
            turned = torch.stack((-odd, even), dim=-1).reshape(x.shape)
        else:
            raise DocumentedConstraintError(f"rotary_mode {rotary_mode!r}")
        return (r1.float() * x + r2.float() * turned).to(input.dtype)

    def npu_fused_infer_attention_score(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        atten_mask: torch.Tensor | None = None,
        num_heads: int = 1,
        scale: float = 1.0,
        pre_tokens: int = INT_MAX,
        next_tokens: int = INT_MAX,
        input_layout: str = "BSH",
        num_key_value_heads: int = 0,
        sparse_mode: int = 0,
        inner_precise: int = 0,
        softmax_lse_flag: bool = False,
        **unmodelled: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Masked softmax attention; returns ``(attention_out, softmax_lse)`` as documented."""
        self.calls.append(
            (
                "npu_fused_infer_attention_score",
                {
                    "layout": input_layout,
                    "q": tuple(query.shape),
                    "k": tuple(key.shape),
                    "mask": None if atten_mask is None else (atten_mask.dtype, atten_mask.shape),
                    "dtype": query.dtype,
                    "inner_precise": inner_precise,
                },
            )
        )
        for name, value_ in unmodelled.items():
            _require(name in UNMODELLED, f"unknown keyword {name!r}")
            _require(value_ == UNMODELLED[name], f"{name} is not modelled by the double")
        for name, t in (("query", query), ("key", key), ("value", value)):
            _require(t.is_contiguous(), f"{name} must be contiguous")
            _require(t.dtype in self.attention_dtypes, f"{name} dtype {t.dtype} not supported")
        _require(key.dtype == query.dtype == value.dtype, "query/key/value dtypes differ")
        _require(key.shape == value.shape, "key and value shapes must match")
        kv_heads = num_key_value_heads or num_heads
        q, k, v = (
            _to_bnsd(t, input_layout, n)
            for t, n in ((query, num_heads), (key, kv_heads), (value, kv_heads))
        )
        b, n, q_s, d = q.shape
        _, kv_n, kv_s, _ = k.shape
        _require(n == num_heads, f"query has {n} heads, num_heads={num_heads}")
        _require(kv_n == kv_heads, f"key has {kv_n} heads, num_key_value_heads={kv_heads}")
        _require(k.shape[0] == b, "query and key batch differ")
        _require(num_heads % kv_heads == 0, "num_heads must be a multiple of num_key_value_heads")
        _require(num_heads // kv_heads <= 64, "GQA ratio must be <= 64")
        _require(n <= 256 and d <= 512, "N <= 256 and D <= 512")
        if q_s > 1:
            _require(d % 16 == 0, "float16/bfloat16 D must be 16-aligned when Q_S > 1")
            _require(inner_precise in (0, 1, 2, 3), "inner_precise in 0..3")
            _require(sparse_mode == 0, "the double models sparse_mode=0 only")
        else:
            _require(inner_precise in (0, 1), "Q_S == 1 supports inner_precise 0 or 1 only")
        _require(
            (pre_tokens, next_tokens) == (INT_MAX, INT_MAX),
            "the double models pre_tokens/next_tokens at their defaults only",
        )
        scores = torch.einsum(
            "bnqd,bnkd->bnqk", q.float(), k.float().repeat_interleave(n // kv_n, 1)
        )
        scores = scores * scale
        if atten_mask is not None:
            hidden = _mask_bnqk(atten_mask, b, q_s, kv_s)
            # Additive, as a kernel may apply it: a NaN score stays NaN even where masked.
            scores = scores + torch.zeros_like(scores).masked_fill(hidden, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        probs = torch.softmax(scores, dim=-1)
        dead = torch.isneginf(scores).all(dim=-1, keepdim=True)
        # Rows with no visible key: zero with invalid-row correction (bit 1), else undefined (NaN).
        probs = probs.masked_fill(dead, 0.0 if inner_precise & 2 else float("nan"))
        out = torch.einsum("bnqk,bnkd->bnqd", probs, v.float().repeat_interleave(n // kv_n, 1))
        out = _from_bnsd(out.to(query.dtype), input_layout, query.shape)
        if softmax_lse_flag:
            return out, lse.float()
        return out, torch.zeros(1, dtype=torch.float32, device=query.device)


def _to_bnsd(t: torch.Tensor, layout: str, heads: int) -> torch.Tensor:
    if layout == "BNSD":
        _require(t.dim() == 4, "BNSD inputs are 4-D")
        return t
    if layout == "BSND":
        _require(t.dim() == 4, "BSND inputs are 4-D")
        return t.transpose(1, 2)
    if layout == "BSH":
        _require(t.dim() == 3 and t.shape[-1] % heads == 0, "BSH inputs are 3-D, H = N * D")
        b, s, h = t.shape
        return t.reshape(b, s, heads, h // heads).transpose(1, 2)
    raise DocumentedConstraintError(f"the double models BNSD, BSND, BSH only, not {layout!r}")


def _from_bnsd(t: torch.Tensor, layout: str, shape: torch.Size) -> torch.Tensor:
    if layout == "BNSD":
        return t.contiguous()
    return t.transpose(1, 2).reshape(shape).contiguous()


def _mask_bnqk(mask: torch.Tensor, b: int, q_s: int, kv_s: int) -> torch.Tensor:
    """The documented mask shapes, broadcast to ``[B, 1, Q_S, KV_S]``; nonzero = masked out."""
    _require(mask.dtype in MASK_DTYPES, f"atten_mask dtype {mask.dtype} not supported")
    _require(mask.is_contiguous(), "atten_mask must be contiguous")
    shape = tuple(mask.shape)
    if q_s > 1:
        allowed = {
            (q_s, kv_s),
            (b, q_s, kv_s),
            (1, q_s, kv_s),
            (b, 1, q_s, kv_s),
            (1, 1, q_s, kv_s),
        }
    else:
        allowed = {(b, kv_s), (b, 1, kv_s), (b, 1, 1, kv_s)}
    _require(shape in allowed, f"atten_mask shape {shape} not documented for Q_S={q_s}")
    hidden = mask != 0
    if q_s == 1:
        return hidden.reshape(b, 1, 1, kv_s)
    return hidden.reshape(-1, 1, q_s, kv_s).expand(b, 1, q_s, kv_s)
