"""A plain-torch test double of the torch_npu ops the NPU attention path composes.

Written from the documentation, not from ``ascend_mepic.ops.npu`` nor from anyone's kernel: it
computes the documented formulas and rejects (``DocumentedConstraintError``) the inputs the
documentation rules out for Atlas A2 (910B), so that a composition relying on undocumented
behaviour fails here instead of on hardware. Where the documents disagree between releases the
double takes the strictest reading (the intersection), and says so; a test may widen a knob
(``attention_dtypes``, ``tnd_head_dims``, ``tnd_block_sizes``) to check index logic at small sizes.

Doc sources (read 2026-08; quoted by repository/path):

* ``Ascend/op-plugin``
  ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_fused_infer_attention_score.md`` (HEAD
  517f2e7d) and its English twin ``docs/en/custom_APIs/torch_npu/...`` (commit 6f94ee7c);
  older ``docs/context/torch_npu-npu_fused_infer_attention_score.md`` and
  ``docs/context/torch_npu-npu_rotary_mul.md``.
* ``hicann/ops-transformer`` ``attention/fused_infer_attention_score/docs/
  aclnnFusedInferAttentionScoreV4.md`` (CANN 9.2.0 revision; the TND/PagedAttention tables) and
  ``aclnnFusedInferAttentionScoreV3.md`` (a 2026 revision with the same A2 TND table).
* ``Ascend/op-plugin`` ``docs/zh/custom_APIs/torch_npu/torch_npu-npu_scatter_pa_kv_cache.md`` and
  ``hicann/ops-transformer`` ``attention/scatter_pa_kv_cache/docs/aclnnScatterPaKvCache.md``.
* ``Ascend/op-plugin`` ``docs/{zh,en}/custom_APIs/torch_npu/torch_npu-npu_mrope.md`` and
  ``aclnnRopeWithSinCosCache.md`` (ops-transformer).
* ``Ascend/op-plugin`` ``docs/{zh,en}/custom_APIs/torch_npu/torch_npu-apply_rotary_pos_emb.md``.
* CANN ATB ``ReshapeAndCacheOperation`` (hiascend.com ascendtb_01_0073, CANN 8.0.RC2/RC3), the
  operation behind the undocumented-in-op-plugin ``torch_npu._npu_reshape_and_cache``.
* The torch_npu 2.10.0.post4 wheel (cp311 manylinux_2_28_x86_64, sha256 ``7d88428d...0d90``,
  the torch_npu vllm-ascend 0.30.0rc2 pins): the op schemas registered in
  ``torch_npu/lib/libtorch_npu.so`` and ``libop_plugin_atb.so``, extracted by
  ``scripts/torch_npu_schemas.py`` into ``tests/ops/torch_npu_schemas.txt``, against which
  ``tests/ops/test_npu_double.py`` checks every op's signature (names, order, keyword-only,
  defaults); and its docstrings, ``torch_npu/_op_plugin_docs.py`` (``npu_rotary_mul``: "r1:
  数据范围：[-1, 1]", r2 "同r1"; ``npu_fused_infer_attention_score``: "TND场景下query、key、value
  输入的综合限制: T小于等于65536").
* ``mindspore.ops.rotary_position_embedding`` (a wrapper of the same CANN kernel): "cos: has the
  same type as x, in range of [-1, 1]" -- the source of the one-dtype rule for ``npu_rotary_mul``
  (the torch_npu docstring lists each input's dtypes but says nothing about mixing them).
* Device placement: every tensor argument must be on the (emulated) NPU and every tensor output
  is on it (``tests/ops/emulated_device.py``); a host tensor raises ``NotOnNpuError``.
* As evidence of how the ops are called (not as a spec): vllm-ascend 0.30.0rc2,
  ``vllm_ascend/attention/attention_v1.py`` (``_get_fia_params``, ``forward_fused_infer_attention``)
  and ``vllm_ascend/device/device_op.py`` (``reshape_and_cache``).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from tests.ops.emulated_device import NotOnNpuError, mark_outputs, require_on_npu

__all__ = ["DocumentedConstraintError", "NotOnNpuError", "NpuOpsDouble"]

INT_MAX = 2147483647
ROTARY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
A2_ATTENTION_DTYPES = (torch.float16, torch.bfloat16)
MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)

# TND (no rope, D != 512) on A2. torch_npu doc: Q_D = K_D = V_D = 128 (or 192/128 MLA-style
# splits); aclnn V4 (CANN 9.2.0) also allows 64 and, for GQA with inner_precise 0, any D <= 256.
# The intersection with key.shape == value.shape (required for PagedAttention) is 128.
TND_HEAD_DIMS: tuple[int, ...] = (128,)
# PagedAttention block_size for TND on A2. torch_npu doc: Q_S > 1 -> 128..512, multiple of 128;
# Q_S == 1 -> multiple of 16, <= 512; TND (D != 512) -> multiple of 16, <= 1024. aclnn V4 TND
# table (GQA and MHA): "blockSize <= 128, 16-aligned". A TND batch mixes Q_S == 1 and Q_S > 1
# sequences, so every rule applies at once: only 128 satisfies all of them.
TND_PAGE_BLOCK_SIZES: tuple[int, ...] = (128,)
TND_MAX_BATCH = 4096
# torch_npu 2.10.0.post4 docstring (_op_plugin_docs.py, npu_fused_infer_attention_score, "TND场景下
# query、key、value输入的综合限制: T小于等于65536"); aclnn V4 (Nov 2025) allows T <= 1048576: the
# stricter reading wins. (That docstring's TND table also lists N in 8..128 with Q_N = KV_N,
# D = 192 and bfloat16 only -- an MLA table at odds with aclnn V4's GQA/D=128 TND rows and with
# vllm-ascend's own TND calls; not enforced, see tnd_head_dims.)
TND_MAX_TOKENS = 65536
ROTARY_RANGE = 1.0  # npu_rotary_mul r1/r2 "数据范围：[-1, 1]" (torch_npu 2.10 docstring)
BNBSH_MAX_H = 65535  # BnBsH cache: KV_N * D must not exceed 65535
OPT_MASK_SIZE = 2048  # sparse_mode 2/3/4 take the "optimized" 2048 x 2048 mask
KV_CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.int8)  # scatter/reshape-and-cache on A2
SLOT_DTYPES = (torch.int32, torch.int64)

# Keyword arguments of npu_fused_infer_attention_score this double does not model; they must stay
# at their documented defaults.
UNMODELLED = {
    "pse_shift": None,
    "dequant_scale1": None,
    "quant_scale1": None,
    "dequant_scale2": None,
    "quant_scale2": None,
    "quant_offset2": None,
    "antiquant_scale": None,
    "antiquant_offset": None,
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
    "antiquant_mode": 0,
    "key_antiquant_mode": 0,
    "value_antiquant_mode": 0,
}


# The torch_npu ops the double implements (their schemas: tests/ops/torch_npu_schemas.txt).
OPS = (
    "npu_rotary_mul",
    "npu_mrope",
    "npu_apply_rotary_pos_emb",
    "npu_scatter_pa_kv_cache",
    "_npu_reshape_and_cache",
    "npu_fused_infer_attention_score",
    "npu_rms_norm",
    "npu_swiglu",
)


class DocumentedConstraintError(ValueError):
    """An input the torch_npu documentation does not allow (real hardware would fail or differ)."""


Op = TypeVar("Op", bound=Callable[..., Any])


def _device_op(op: Op) -> Op:
    """An op runs on the NPU: its tensor arguments must be there (``NotOnNpuError``) and its
    tensor outputs are. The body runs without torch-function modes (no mark bookkeeping per
    internal torch call); ``inspect.signature`` still sees the op's own signature."""
    signature = inspect.signature(op)

    @functools.wraps(op)
    def checked(self: NpuOpsDouble, *args: Any, **kwargs: Any) -> Any:
        if self.device_check:
            bound = signature.bind(self, *args, **kwargs)
            named = {k: v for k, v in bound.arguments.items() if k != "self"}
            require_on_npu(op.__name__, named)
        with torch._C.DisableTorchFunction():
            result = op(self, *args, **kwargs)
        return mark_outputs(result) if self.device_check else result

    return checked  # type: ignore[return-value]


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise DocumentedConstraintError(what)


@dataclass
class NpuOpsDouble:
    """Stands in for the ``torch_npu`` module. Calls are recorded in ``calls``.

    ``attention_dtypes`` defaults to what the A2 documentation allows for the fused attention; a
    test may widen it to float32 to check a composition's index logic at tight tolerance.
    ``tnd_head_dims`` and ``tnd_block_sizes`` are the TND-layout limits (see the module
    constants); a test may widen them the same way to exercise small shapes. ``device_check``:
    tensor arguments must be marked as on the emulated NPU (``tests/ops/emulated_device.py``);
    off only where host and device cannot be told apart (the emulated engine loop).
    """

    attention_dtypes: tuple[torch.dtype, ...] = A2_ATTENTION_DTYPES
    tnd_head_dims: tuple[int, ...] = TND_HEAD_DIMS
    tnd_block_sizes: tuple[int, ...] = TND_PAGE_BLOCK_SIZES
    device_check: bool = True
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    # ------------------------------------------------------------------ rotary

    @_device_op
    def npu_rotary_mul(
        self,
        input: torch.Tensor,
        r1: torch.Tensor,
        r2: torch.Tensor,
        rotary_mode: str = "half",
        rotate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``r1 * input + r2 * rotate(input)``; rotate per ``rotary_mode`` ("half"/"interleave").

        Enforced beyond shapes: ``input``, ``r1`` and ``r2`` one dtype (see the module docstring)
        and r1/r2 values in [-1, 1] (torch_npu 2.10 docstring: "r1: 数据范围：[-1, 1]"; "r2: 同r1"):
        so YaRN's cos/sin, scaled by mscale > 1, must not be passed as r1/r2. NaN is out of range.
        ``rotate`` (the explicit rotation matrix) is not modelled: it must be None.
        """
        self.calls.append(("npu_rotary_mul", {"shape": tuple(input.shape), "mode": rotary_mode}))
        _require(rotate is None, "rotate (an explicit rotation matrix) is not modelled")
        _require(input.dim() == 4 and r1.dim() == 4 and r2.dim() == 4, "inputs must be 4-D")
        for name, t in (("input", input), ("r1", r1), ("r2", r2)):
            _require(t.dtype in ROTARY_DTYPES, f"{name} dtype {t.dtype} not supported")
        _require(
            r1.dtype == r2.dtype == input.dtype,
            f"input/r1/r2 dtypes must be identical ({input.dtype}, {r1.dtype}, {r2.dtype})",
        )
        for name, t in (("r1", r1), ("r2", r2)):
            if t.numel():
                peak = float(t.float().abs().nan_to_num(math.inf).max())
                _require(
                    peak <= ROTARY_RANGE,
                    f"{name} values must lie in [-1, 1] (docstring: 数据范围); |{name}| reaches "
                    f"{peak:.4g}",
                )
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
            turned = _rotate_half(x)
        elif rotary_mode == "interleave":
            turned = _rotate_pairs(x)
        else:
            raise DocumentedConstraintError(f"rotary_mode {rotary_mode!r}")
        return (r1.float() * x + r2.float() * turned).to(input.dtype)

    @_device_op
    def npu_mrope(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        head_size: int,
        *,
        mrope_section: Sequence[int] | None = None,
        rotary_mode: str = "half",
        cache_mode: str = "default",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE from a cos/sin cache (the 1-D ``positions`` "RoPE mode" only); ``(q_out, k_out)``.

        Source: ``Ascend/op-plugin`` ``docs/{zh,en}/custom_APIs/torch_npu/torch_npu-npu_mrope.md``;
        ``aclnnRopeWithSinCosCache.md`` (ops-transformer) for the kernel it calls.

        Formula (per token t and per head; rotary_dim = ``cos_sin_cache.shape[-1]``)::

            cos, sin = cos_sin_cache[positions[t]].chunk(2)         # rotary_dim / 2 each
            rot, pass = x[:rotary_dim], x[rotary_dim:]
            "half"        (NeoX): x1, x2 = rot.chunk(2)
            "interleaved" (GPT-J): x1, x2 = rot[0::2], rot[1::2]
            o1 = x1 * cos - x2 * sin;  o2 = x2 * cos + x1 * sin
            "half": rot = cat(o1, o2);  "interleaved": rot = stack(o1, o2).flatten()
            out = cat(rot, pass)

        Enforced: ``positions`` 1-D int32/int64 of length ``num_tokens``, values in
        ``[0, max_seq_len)``; ``query`` ``[num_tokens, Nq * head_size]`` and ``key``
        ``[num_tokens, Nk * head_size]`` (2-D); query, key and cache share one dtype among
        float16/bfloat16/float32; ``head_size`` and ``rotary_dim`` multiples of 32
        (float16/bfloat16) or 16 (float32); ``rotary_dim <= head_size``; ``rotary_mode`` is
        ``"half"`` or ``"interleaved"`` -- NOT ``"interleave"``, the spelling ``npu_rotary_mul``
        uses (vllm-ascend passes ``"interleaved"`` too); ``cache_mode="default"`` (the only value
        for RoPE mode); ``mrope_section`` None or ``[0, 0, 0]``. Non-contiguous inputs are
        documented as supported.
        Not modelled: MRoPE (2-D positions with a section list) -- rejected. The outputs are new
        tensors (assumed; the doc only says they match the inputs' shape and dtype).
        """
        self.calls.append(
            (
                "npu_mrope",
                {
                    "q": tuple(query.shape),
                    "k": tuple(key.shape),
                    "cache": tuple(cos_sin_cache.shape),
                    "head_size": head_size,
                    "mode": rotary_mode,
                    "dtype": query.dtype,
                },
            )
        )
        section = None if mrope_section is None else [int(s) for s in mrope_section]
        _require(
            section is None or section == [0, 0, 0],
            f"mrope_section {section} (MRoPE mode) is not modelled by the double",
        )
        _require(cache_mode == "default", f"cache_mode {cache_mode!r}: RoPE mode takes 'default'")
        _require(
            rotary_mode in ("half", "interleaved"),
            f"rotary_mode {rotary_mode!r}: npu_mrope takes 'half' or 'interleaved'",
        )
        _require(positions.dim() == 1, "RoPE mode takes 1-D positions [num_tokens]")
        _require(positions.dtype in SLOT_DTYPES, f"positions dtype {positions.dtype}")
        _require(query.dim() == 2 and key.dim() == 2, "query/key must be 2-D [T, N * head_size]")
        t = query.shape[0]
        _require(key.shape[0] == t and positions.shape[0] == t, "num_tokens differ")
        dtype = query.dtype
        _require(dtype in ROTARY_DTYPES, f"dtype {dtype} not supported")
        _require(key.dtype == dtype and cos_sin_cache.dtype == dtype, "dtypes must be identical")
        align = 16 if dtype == torch.float32 else 32
        _require(head_size > 0 and head_size % align == 0, f"head_size: multiple of {align}")
        _require(cos_sin_cache.dim() == 2, "cos_sin_cache must be 2-D [max_seq_len, rotary_dim]")
        max_pos, rotary_dim = cos_sin_cache.shape
        _require(
            rotary_dim % align == 0 and 0 < rotary_dim <= head_size,
            f"rotary_dim {rotary_dim} must be a multiple of {align} and <= head_size",
        )
        for name, x in (("query", query), ("key", key)):
            _require(x.shape[1] % head_size == 0, f"{name} width not a multiple of head_size")
        if t:
            _require(
                int(positions.min()) >= 0 and int(positions.max()) < max_pos,
                "positions must lie in [0, max_seq_len)",
            )
        cos, sin = cos_sin_cache.index_select(0, positions.long()).float().chunk(2, dim=-1)
        cos, sin = cos[:, None, :], sin[:, None, :]

        def rotate(x: torch.Tensor) -> torch.Tensor:
            heads = x.float().reshape(t, -1, head_size)
            rot, keep = heads[..., :rotary_dim], heads[..., rotary_dim:]
            if rotary_mode == "half":
                x1, x2 = rot.chunk(2, dim=-1)
                rot = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
            else:
                x1, x2 = rot[..., 0::2], rot[..., 1::2]
                rot = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
            return torch.cat((rot, keep), dim=-1).reshape(x.shape).to(dtype)

        return rotate(query), rotate(key)

    @_device_op
    def npu_apply_rotary_pos_emb(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layout: str = "BSND",
        rotary_mode: str = "half",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """In-place ``x = x * cos + rotate_half(x) * sin`` on query and key; returns them.

        Source: ``Ascend/op-plugin`` ``docs/{zh,en}/custom_APIs/torch_npu/
        torch_npu-apply_rotary_pos_emb.md`` (A2 column). Enforced: ``layout`` "BSND" (4-D) or
        "TND" (3-D); ``rotary_mode="half"`` only; D (last dim) of query/key/cos/sin is 64 or 128;
        query ``(B, S, Nq, D)``/``(T, Nq, D)``, key ``(B, S, Nk, D)``/``(T, Nk, D)``, cos/sin
        ``(B, S, 1, D)``/``(T, 1, D)``; one dtype among float16/bfloat16/float32; no empty tensors.
        Assumed: the formula (the doc gives none; it is ``npu_rotary_mul``'s "half" with
        full-width cos/sin) and ``cos_d == D`` (the doc requires each to be 64 or 128).
        """
        self.calls.append(
            (
                "npu_apply_rotary_pos_emb",
                {"q": tuple(query.shape), "k": tuple(key.shape), "layout": layout},
            )
        )
        _require(layout in ("BSND", "TND"), f"layout {layout!r}: A2 takes BSND or TND")
        _require(rotary_mode == "half", f"rotary_mode {rotary_mode!r}: A2 takes 'half' only")
        dims = 4 if layout == "BSND" else 3
        for name, t in (("query", query), ("key", key), ("cos", cos), ("sin", sin)):
            _require(t.dim() == dims, f"{name} must be {dims}-D for layout {layout}")
            _require(t.numel() > 0, f"{name} must not be empty")
            _require(t.dtype == query.dtype, "query/key/cos/sin dtypes must be identical")
        _require(query.dtype in ROTARY_DTYPES, f"dtype {query.dtype} not supported")
        d = query.shape[-1]
        _require(d in (64, 128), f"D={d} must be 64 or 128")
        lead = query.shape[:-2]
        _require(key.shape[:-2] == lead and key.shape[-1] == d, "key must match query but in N")
        for name, t in (("cos", cos), ("sin", sin)):
            _require(t.shape == (*lead, 1, d), f"{name} must be {(*lead, 1, d)}")
        c, s = cos.float(), sin.float()
        for x in (query, key):
            xf = x.float()
            x.copy_((xf * c + _rotate_half(xf) * s).to(x.dtype))
        return query, key

    # ------------------------------------------------------------------ KV cache writes

    @_device_op
    def npu_scatter_pa_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        compress_lens: torch.Tensor | None = None,
        compress_seq_offsets: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,
        cache_mode: str | None = "PA_NZ",
    ) -> None:
        """Write ``key[t]``/``value[t]`` into cache slot ``slot_mapping[t]`` in place; returns None.

        Source: ``Ascend/op-plugin`` ``docs/zh/custom_APIs/torch_npu/
        torch_npu-npu_scatter_pa_kv_cache.md``; shapes of the ND ("Norm") case from
        ``hicann/ops-transformer`` ``attention/scatter_pa_kv_cache/docs/aclnnScatterPaKvCache.md``
        (scenario 2, supported on A2). Modelled case only::

            key [T, N, Dk], value [T, N, Dv]
            key_cache [num_blocks, block_size, N, Dk], value_cache [num_blocks, block_size, N, Dv]
            slot_mapping [T]; slot s = block_id * block_size + offset
            key_cache.view(-1, N, Dk)[slot_mapping[t]] = key[t]   (same for value)

        Enforced: ``cache_mode`` must be ``"Norm"`` (or None): the documented DEFAULT is
        ``"PA_NZ"``, which needs FRACTAL_NZ caches and is rejected here -- callers with ND caches
        must pass ``cache_mode="Norm"`` explicitly, as vllm-ascend does. Compression arguments
        (``compress_lens``, ``seq_lens``, ``compress_seq_offsets``) not modelled. Dtypes: key, value
        and both caches identical, one of float16/bfloat16/int8 (the aclnn doc excludes float32 and
        the other types on A2). ``slot_mapping`` int32/int64, 1-D, length T. All inputs contiguous
        (torch_npu doc: "non-contiguous inputs are not supported"). Slots in
        ``[0, num_blocks * block_size - 1]``: negative (padding, -1) slots are OUTSIDE the
        documented range and rejected -- slice them off before the call. Slots must be distinct
        ("no guarantee of correctness" with duplicates) -- rejected.
        """
        self.calls.append(
            (
                "npu_scatter_pa_kv_cache",
                {
                    "k": tuple(key.shape),
                    "cache": tuple(key_cache.shape),
                    "slots": tuple(slot_mapping.shape),
                    "cache_mode": cache_mode,
                },
            )
        )
        _require(
            compress_lens is None and compress_seq_offsets is None and seq_lens is None,
            "compressed scatter modes are not modelled by the double",
        )
        _require(
            cache_mode in (None, "Norm"),
            f"cache_mode {cache_mode!r}: 'PA_NZ' (the default) needs FRACTAL_NZ caches; pass "
            "cache_mode='Norm' for ND [num_blocks, block_size, N, D] caches",
        )
        _write_slots(key, value, key_cache, value_cache, slot_mapping, "slot_mapping")

    @_device_op
    def _npu_reshape_and_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_indices: torch.Tensor,
    ) -> None:
        """ATB ReshapeAndCache: the same ND slot write as ``npu_scatter_pa_kv_cache`` "Norm".

        Source: CANN ATB ``ReshapeAndCacheOperation`` (hiascend.com ascendtb_01_0073): key
        ``[num_tokens, k_num_head, head_size]``, caches ``[num_blocks, block_size, num_head,
        head_size]`` (ND modelled; NZ not), ``slotMapping [num_tokens]`` = block_id * block_size +
        offset, float16/bfloat16/int8, all four tensors one dtype, in-place. The op-plugin docs do
        not document ``_npu_reshape_and_cache`` itself (private API). Assumed: int32 or int64
        slots (ATB documents int32), contiguous inputs, slots in range and distinct; negative
        slots are undocumented and rejected (op-plugin's own test skips slot < 0, so hardware may
        tolerate them, but a composition should not rely on it).
        """
        self.calls.append(
            (
                "_npu_reshape_and_cache",
                {"k": tuple(key.shape), "cache": tuple(key_cache.shape)},
            )
        )
        _write_slots(key, value, key_cache, value_cache, slot_indices, "slot_indices")

    # ------------------------------------------------------------------ attention

    @_device_op
    def npu_fused_infer_attention_score(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        atten_mask: torch.Tensor | None = None,
        actual_seq_lengths: Sequence[int] | None = None,
        actual_seq_lengths_kv: Sequence[int] | None = None,
        block_table: torch.Tensor | None = None,
        num_heads: int = 1,
        scale: float = 1.0,
        pre_tokens: int = INT_MAX,
        next_tokens: int = INT_MAX,
        input_layout: str = "BSH",
        num_key_value_heads: int = 0,
        sparse_mode: int = 0,
        inner_precise: int = 0,
        block_size: int = 0,
        softmax_lse_flag: bool = False,
        **unmodelled: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Masked softmax attention; returns ``(attention_out, softmax_lse)`` as documented.

        ``softmax(scale * Q K^T + mask) V``, GQA query head h reading KV head
        ``h // (num_heads / num_key_value_heads)``. Two modelled families:

        Dense ``BNSD``/``BSND``/``BSH`` (no paging, no actual lengths): see ``_fia_dense``.

        ``TND`` (varlen), optionally paged (``block_table``): see ``_fia_tnd`` for the exact
        semantics of ``actual_seq_lengths`` (cumulative query ends) and ``actual_seq_lengths_kv``
        (cumulative without paging, per-batch lengths with paging) and ``sparse_mode`` 0/3.
        """
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
                    "sparse_mode": sparse_mode,
                    "block_size": block_size,
                    "paged": block_table is not None,
                    "actual_seq_lengths": _as_list(actual_seq_lengths),
                    "actual_seq_lengths_kv": _as_list(actual_seq_lengths_kv),
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
        _require(num_heads % kv_heads == 0, "num_heads must be a multiple of num_key_value_heads")
        _require(num_heads // kv_heads <= 64, "GQA ratio must be <= 64")
        if input_layout == "TND":
            return self._fia_tnd(
                query,
                key,
                value,
                atten_mask=atten_mask,
                q_ends=actual_seq_lengths,
                kv_arg=actual_seq_lengths_kv,
                block_table=block_table,
                block_size=block_size,
                num_heads=num_heads,
                kv_heads=kv_heads,
                scale=scale,
                sparse_mode=sparse_mode,
                inner_precise=inner_precise,
                softmax_lse_flag=softmax_lse_flag,
            )
        _require(
            actual_seq_lengths is None and actual_seq_lengths_kv is None,
            "the double models actual_seq_lengths(_kv) in TND layout only",
        )
        _require(
            block_table is None and block_size == 0,
            "the double models PagedAttention (block_table) in TND layout only",
        )
        return self._fia_dense(
            query,
            key,
            value,
            atten_mask=atten_mask,
            num_heads=num_heads,
            kv_heads=kv_heads,
            scale=scale,
            pre_tokens=pre_tokens,
            next_tokens=next_tokens,
            input_layout=input_layout,
            sparse_mode=sparse_mode,
            inner_precise=inner_precise,
            softmax_lse_flag=softmax_lse_flag,
        )

    def _fia_dense(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        atten_mask: torch.Tensor | None,
        num_heads: int,
        kv_heads: int,
        scale: float,
        pre_tokens: int,
        next_tokens: int,
        input_layout: str,
        sparse_mode: int,
        inner_precise: int,
        softmax_lse_flag: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense BNSD/BSND/BSH with a full mask (``sparse_mode=0``, default pre/next tokens).

        Enforced: N <= 256, D <= 512, D 16-aligned when Q_S > 1, ``inner_precise`` 0..3 when
        Q_S > 1 and 0/1 when Q_S == 1, documented mask shapes (see ``_mask_bnqk``).
        """
        q, k, v = (
            _to_bnsd(t, input_layout, n)
            for t, n in ((query, num_heads), (key, kv_heads), (value, kv_heads))
        )
        b, n, q_s, d = q.shape
        _, kv_n, kv_s, _ = k.shape
        _require(n == num_heads, f"query has {n} heads, num_heads={num_heads}")
        _require(kv_n == kv_heads, f"key has {kv_n} heads, num_key_value_heads={kv_heads}")
        _require(k.shape[0] == b, "query and key batch differ")
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

    def _fia_tnd(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        atten_mask: torch.Tensor | None,
        q_ends: Sequence[int] | None,
        kv_arg: Sequence[int] | None,
        block_table: torch.Tensor | None,
        block_size: int,
        num_heads: int,
        kv_heads: int,
        scale: float,
        sparse_mode: int,
        inner_precise: int,
        softmax_lse_flag: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """TND varlen attention, contiguous or paged, as vllm-ascend calls it.

        Shapes: query ``[T, Q_N, D]`` (T = total query tokens), output ``[T, Q_N, D]`` in the
        query's dtype; ``softmax_lse`` ``[T, Q_N, 1]`` float32 when ``softmax_lse_flag`` (else the
        documented ``[1]`` zero tensor).

        ``actual_seq_lengths`` (required, host ``List[int]``): CUMULATIVE query ends -- element b
        is the total query length of batches 0..b; non-decreasing, non-negative; its length is
        the batch B (<= 4096) and its last element must equal T. (Doc: "每个元素值为当前batch与之前
        所有batch的seqlen累加和"; T = sum of seqlens; vllm-ascend passes ``query_start_loc[1:]`` and
        slices ``query[:actual_seq_lengths[-1]]``.) Query of batch b is rows
        ``[ends[b-1], ends[b])``.

        ``actual_seq_lengths_kv`` (required, length B):
          * without ``block_table``: CUMULATIVE key ends like the query's, over key/value
            ``[T_kv, KV_N, D]``; last element == T_kv.
          * with ``block_table`` (PagedAttention): PER-BATCH key lengths, NOT cumulative
            (aclnnFusedInferAttentionScoreV4.md, CANN 9.2.0: "PA场景下该参数是batch模式，非PA在TND
            场景下是累加模式"; the TND D=512 row: "actualSeqLengthsKv长度等于key/value的batch值，
            代表每个batch的实际长度"; vllm-ascend passes ``seq_lens`` with a block table and the
            cumulative query ends without one).
          Key i of batch b is cache slot ``block_table[b, i // block_size] * block_size +
          i % block_size``; slots past the batch's length are never read.

        Paged cache: key/value ``(num_blocks, block_size, KV_N * D)`` (BnBsH, as
        ``key_cache.view(num_blocks, block_size, -1)``), ``KV_N * D <= 65535``. The generic PA
        section also lists BnNBsD ``(num_blocks, KV_N, block_size, D)`` for TND queries, but the
        A2 TND table (aclnn V4) lists BnBsH only, so the double rejects 4-D caches. ``block_table``
        int32 ``[B, >= max blocks per batch]``; ``num_blocks >= sum of per-batch block counts``;
        block ids read must be valid (user-guaranteed per the docs; checked here).
        ``block_size``: in ``tnd_block_sizes`` (default 128, the intersection of the documented
        rules -- see ``TND_PAGE_BLOCK_SIZES``).

        ``sparse_mode`` (A2 TND table: "sparse=0且attenMask为nullptr，或sparse=3且传入优化后的
        attenMask"): 0 = no mask, ``atten_mask`` must be None (a full mask is not allowed in TND);
        3 = rightDownCausal with the optimized mask: ``atten_mask`` of shape (2048, 2048),
        (1, 2048, 2048) or (1, 1, 2048, 2048), bool/int8/uint8 with values 0/1, equal to
        ``triu(ones(2048, 2048), diagonal=1)`` (1 = masked; the doc's "lower triangular" names the
        kept part; vllm-ascend builds exactly this int8 mask). Semantics per batch b with
        ``q_len``/``kv_len``: query i (0-based within the batch) sees keys ``0 .. kv_len - q_len +
        i`` (the causal diagonal anchored at the bottom-right corner). Requires ``q_len <=
        kv_len`` (one revision says strictly <, but the 9.2.0 table drops it and prefill without
        cache has q_len == kv_len; int8-output docs block kv_len - q_len < 0). Other modes
        (1, 2, 4 band, 9 tree) are not modelled. ``pre_tokens``/``next_tokens`` are ignored by
        modes 0 (no mask) and 3, as documented.

        Also enforced: D in ``tnd_head_dims`` (default 128); Q_N <= 256; ``num_key_value_heads``
        matches the cache's heads; ``inner_precise`` 0 for GQA/MQA (Q_N != KV_N), 0 or 1 for
        float16 MHA, 0 for bfloat16 MHA; T <= 65536 (``TND_MAX_TOKENS``); zero-length query
        batches are allowed; a batch with q_len > 0 and kv_len == 0 is rejected (undocumented;
        assumed).
        """
        _require(query.dim() == 3, "TND query is 3-D [T, N, D]")
        t, n, d = query.shape
        _require(n == num_heads, f"query has {n} heads, num_heads={num_heads}")
        _require(n <= 256, "N <= 256")
        _require(d in self.tnd_head_dims, f"TND head dim D={d} not in {self.tnd_head_dims}")
        _require(t <= TND_MAX_TOKENS, f"T={t} > {TND_MAX_TOKENS}")
        ends = _cumulative(q_ends, "actual_seq_lengths")
        batch = len(ends)
        _require(ends[-1] == t, f"actual_seq_lengths[-1]={ends[-1]} must equal T={t}")
        q_starts = [0, *ends[:-1]]
        q_lens = [e - s for s, e in zip(q_starts, ends, strict=True)]
        _require(kv_arg is not None, "TND requires actual_seq_lengths_kv")
        if block_table is None:
            _require(block_size == 0, "block_size without block_table")
            _require(key.dim() == 3, "TND key/value are 3-D [T_kv, KV_N, D] without paging")
            _require(key.shape[1:] == (kv_heads, d), f"key must be [T_kv, {kv_heads}, {d}]")
            kv_ends = _cumulative(kv_arg, "actual_seq_lengths_kv")
            _require(len(kv_ends) == batch, "actual_seq_lengths_kv length must equal the batch")
            _require(kv_ends[-1] == key.shape[0], "actual_seq_lengths_kv[-1] must equal T_kv")
            kv_starts = [0, *kv_ends[:-1]]
            kv_lens = [e - s for s, e in zip(kv_starts, kv_ends, strict=True)]
            k_rows = key
            v_rows = value
            slots = [
                torch.arange(s, s + n_, dtype=torch.long)
                for s, n_ in zip(kv_starts, kv_lens, strict=True)
            ]
        else:
            kv_lens = _host_ints(kv_arg, "actual_seq_lengths_kv")
            _require(len(kv_lens) == batch, "actual_seq_lengths_kv length must equal the batch")
            _require(all(x >= 0 for x in kv_lens), "actual_seq_lengths_kv must be non-negative")
            slots = _paged_slots(block_table, block_size, key, kv_lens, batch, self.tnd_block_sizes)
            _require(key.shape[2] == kv_heads * d, f"cache H={key.shape[2]} != KV_N*D")
            _require(key.shape[2] <= BNBSH_MAX_H, f"BnBsH cache needs KV_N*D <= {BNBSH_MAX_H}")
            k_rows = key.reshape(-1, kv_heads, d)
            v_rows = value.reshape(-1, kv_heads, d)
        if sparse_mode == 0:
            _require(atten_mask is None, "TND sparse_mode=0 takes no atten_mask")
        elif sparse_mode == 3:
            _require(atten_mask is not None, "sparse_mode=3 needs the optimized 2048x2048 mask")
            _check_optimized_causal_mask(atten_mask)
            for b_ in range(batch):
                _require(
                    q_lens[b_] <= kv_lens[b_],
                    f"sparse_mode=3 needs q_len <= kv_len per batch (batch {b_}: "
                    f"{q_lens[b_]} > {kv_lens[b_]})",
                )
        else:
            raise DocumentedConstraintError(f"TND sparse_mode {sparse_mode} is not modelled")
        if kv_heads != num_heads:
            _require(inner_precise == 0, "TND GQA/MQA supports inner_precise=0 only")
        elif query.dtype == torch.bfloat16:
            _require(inner_precise == 0, "TND bfloat16 MHA supports inner_precise=0 only")
        else:
            _require(inner_precise in (0, 1), "TND float16 MHA supports inner_precise 0 or 1")
        group = num_heads // kv_heads
        out = torch.empty(t, n, d, dtype=torch.float32, device=query.device)
        lse = torch.zeros(t, n, 1, dtype=torch.float32, device=query.device)
        for b_ in range(batch):
            q_len, kv_len = q_lens[b_], kv_lens[b_]
            if q_len == 0:
                continue
            _require(kv_len > 0, f"batch {b_} has queries but no keys (undocumented)")
            rows = slots[b_].to(query.device)
            k = k_rows.index_select(0, rows).float().repeat_interleave(group, dim=1)
            v = v_rows.index_select(0, rows).float().repeat_interleave(group, dim=1)
            q = query[q_starts[b_] : ends[b_]].float()
            scores = torch.einsum("qnd,knd->nqk", q, k) * scale
            if sparse_mode == 3:
                i = torch.arange(q_len, device=query.device)[:, None]
                j = torch.arange(kv_len, device=query.device)[None, :]
                hidden = j > kv_len - q_len + i
                # Additive, as in the dense path: a NaN score stays NaN even where masked.
                scores = scores + torch.zeros_like(scores).masked_fill(hidden, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[q_starts[b_] : ends[b_]] = torch.einsum("nqk,knd->qnd", probs, v)
            lse[q_starts[b_] : ends[b_], :, 0] = torch.logsumexp(scores, dim=-1).transpose(0, 1)
        out = out.to(query.dtype)
        if softmax_lse_flag:
            return out, lse
        return out, torch.zeros(1, dtype=torch.float32, device=query.device)

    # ------------------------------------------------------- model layers (engine loop)
    # What vllm-ascend's custom ops call for a Llama's norms and MLP (``vllm_ascend/ops/
    # layernorm.py``, ``activation.py``), so that its engine loop runs on CPU tensors
    # (tests/ascend/test_engine_loop.py). Formulas from op-plugin's
    # ``torch_npu-npu_rms_norm.md`` and ``torch_npu-npu_swiglu.md``; computed in float32.

    @_device_op
    def npu_rms_norm(
        self, input: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x * rstd * gamma, rstd)``, ``rstd = 1 / sqrt(mean(x**2) + epsilon)`` over the
        trailing ``gamma.dim()`` dims; ``rstd`` (float32) keeps those dims as size 1."""
        x = input
        self.calls.append(("npu_rms_norm", {"shape": tuple(x.shape)}))
        _require(x.shape[x.dim() - gamma.dim() :] == gamma.shape, "gamma is x's trailing shape")
        dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(dim=dims, keepdim=True) + epsilon)
        return (x32 * rstd * gamma.float()).to(x.dtype), rstd

    @_device_op
    def npu_swiglu(self, input: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """``silu(a) * b`` for ``a, b = input.chunk(2, dim)``."""
        x = input
        self.calls.append(("npu_swiglu", {"shape": tuple(x.shape)}))
        _require(x.shape[dim] % 2 == 0, "swiglu splits an even dimension")
        a, b = x.float().chunk(2, dim=dim)
        return (torch.nn.functional.silu(a) * b).to(x.dtype)


# ---------------------------------------------------------------------- helpers


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((-odd, even), dim=-1).reshape(x.shape)


def _as_list(v: Any) -> list[int] | None:
    if v is None:
        return None
    try:
        return [int(x) for x in v]
    except (TypeError, ValueError):
        return None


def _host_ints(v: Any, name: str) -> list[int]:
    """A documented ``List[int]`` argument: a host list/tuple of Python ints (not a tensor)."""
    _require(isinstance(v, (list, tuple)), f"{name} must be a host List[int], got {type(v)}")
    _require(
        all(isinstance(x, int) and not isinstance(x, bool) for x in v),
        f"{name} must hold Python ints",
    )
    return list(v)


def _cumulative(v: Any, name: str) -> list[int]:
    _require(v is not None, f"TND requires {name}")
    ends = _host_ints(v, name)
    _require(1 <= len(ends) <= TND_MAX_BATCH, f"{name}: 1..{TND_MAX_BATCH} elements (= batch)")
    _require(ends[0] >= 0, f"{name} must be non-negative")
    _require(
        all(a <= b for a, b in zip(ends[:-1], ends[1:], strict=True)),
        f"{name} is cumulative in TND: it must be non-decreasing",
    )
    return ends


def _paged_slots(
    block_table: torch.Tensor,
    block_size: int,
    key: torch.Tensor,
    kv_lens: list[int],
    batch: int,
    block_sizes: tuple[int, ...],
) -> list[torch.Tensor]:
    """Flat cache rows (``block_id * block_size + offset``) each batch reads, after the checks."""
    _require(
        block_size in block_sizes,
        f"TND PagedAttention block_size {block_size} not in {block_sizes}",
    )
    _require(
        key.dim() == 3,
        "TND PagedAttention takes the BnBsH cache (num_blocks, block_size, KV_N*D); the A2 TND "
        "table does not list BnNBsD",
    )
    num_blocks = key.shape[0]
    _require(key.shape[1] == block_size, f"cache dim 1 ({key.shape[1]}) != block_size")
    _require(block_table.dtype == torch.int32, "block_table must be int32")
    _require(block_table.dim() == 2, "block_table must be 2-D [B, max_blocks]")
    _require(block_table.shape[0] == batch, "block_table rows must equal the batch")
    need = [math.ceil(n / block_size) for n in kv_lens]
    _require(max(need) <= block_table.shape[1], "block_table is narrower than the longest batch")
    _require(sum(need) <= num_blocks, "num_blocks < total blocks the batches need")
    table = block_table.to("cpu", torch.long)
    slots = []
    for b, (n, m) in enumerate(zip(kv_lens, need, strict=True)):
        ids = table[b, :m]
        _require(
            bool(((ids >= 0) & (ids < num_blocks)).all()),
            f"batch {b} reads an invalid block id (validity is the caller's duty)",
        )
        rows = (ids[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:n]
        slots.append(rows)
    return slots


def _check_optimized_causal_mask(mask: torch.Tensor) -> None:
    """sparse_mode 2/3/4 mask: 2048x2048 (optionally 1x / 1x1x), 1 strictly above the diagonal."""
    size = OPT_MASK_SIZE
    _require(
        tuple(mask.shape) in {(size, size), (1, size, size), (1, 1, size, size)},
        f"sparse_mode=3 atten_mask shape {tuple(mask.shape)} must be (2048, 2048) or 1x/1x1x",
    )
    _require(mask.dtype in MASK_DTYPES, f"atten_mask dtype {mask.dtype} not supported")
    _require(mask.is_contiguous(), "atten_mask must be contiguous")
    flat = mask.reshape(size, size)
    if flat.dtype != torch.bool:
        _require(bool(((flat == 0) | (flat == 1)).all()), "int8/uint8 atten_mask must be 0/1")
    want = torch.ones(size, size, dtype=torch.bool, device=mask.device).triu_(1)
    _require(
        bool(torch.equal(flat != 0, want)),
        "sparse_mode=3 atten_mask must be triu(ones(2048, 2048), diagonal=1) (1 = masked)",
    )


def _write_slots(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    slot_name: str,
) -> None:
    """The ND slot write of both cache ops: checks, then ``cache[s // B, s % B] = x``.

    Caches: contiguous, or block-strided, i.e. each block's ``[B, N, D]`` rows contiguous with
    blocks further apart. The op docs say "non-contiguous inputs are not supported", but
    vllm-ascend 0.30.0rc2 itself passes block-strided caches: ``DeviceOperator.reshape_and_cache``
    (``vllm_ascend/device/device_op.py``) hands ``kv_cache[0]`` and ``kv_cache[1]`` of the
    per-layer buffer ``NPUModelRunner._reshape_kv_cache_tensors`` allocates (each block: K then
    V) straight to this op. Any other stride pattern is rejected."""
    for name, t in (("key", key), ("value", value), (slot_name, slots)):
        _require(t.is_contiguous(), f"{name} must be contiguous")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        _require(
            t.dim() == 4 and (t.is_contiguous() or t[0].is_contiguous()),
            f"{name} must be contiguous or block-strided (each block's rows contiguous)",
        )
    _require(key.dtype in KV_CACHE_DTYPES, f"key dtype {key.dtype} not supported on A2")
    _require(
        value.dtype == key_cache.dtype == value_cache.dtype == key.dtype,
        "key, value, key_cache and value_cache dtypes must be identical",
    )
    _require(key.dim() == 3 and value.dim() == 3, "key/value must be 3-D [T, N, D]")
    _require(key.shape[:2] == value.shape[:2], "key and value must agree on [T, N]")
    _require(key_cache.dim() == 4 and value_cache.dim() == 4, "caches must be 4-D (ND)")
    t, n, dk = key.shape
    dv = value.shape[2]
    num_blocks, block_size = key_cache.shape[:2]
    _require(
        tuple(key_cache.shape) == (num_blocks, block_size, n, dk),
        f"key_cache must be [num_blocks, block_size, {n}, {dk}]",
    )
    _require(
        tuple(value_cache.shape) == (num_blocks, block_size, n, dv),
        f"value_cache must be [{num_blocks}, {block_size}, {n}, {dv}]",
    )
    _require(slots.dtype in SLOT_DTYPES, f"{slot_name} dtype {slots.dtype} must be int32/int64")
    _require(slots.dim() == 1 and slots.shape[0] == t, f"{slot_name} must be 1-D of length T")
    s = slots.long()
    if t:
        _require(
            int(s.min()) >= 0 and int(s.max()) < num_blocks * block_size,
            f"{slot_name} values must lie in [0, num_blocks * block_size - 1] (no -1 padding)",
        )
        _require(s.unique().numel() == t, f"{slot_name} values must be distinct")
    blocks, offsets = s // block_size, s % block_size
    key_cache[blocks, offsets] = key
    value_cache[blocks, offsets] = value


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
    raise DocumentedConstraintError(f"the double models BNSD, BSND, BSH, TND only, not {layout!r}")


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
