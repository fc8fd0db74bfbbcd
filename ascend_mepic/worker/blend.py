"""CacheBlend inside the engine: tokens not selected at the check layer really skip later layers.

A ``cacheblend-R`` request arrives with every chunk token in context and its private chunk
blocks pre-filled with the chunk's canonical KV. Layers up to the check layer compute every token.
At the check layer, before its fresh K/V overwrite the cache, the attention backend compares each
chunk token's fresh K with the cached one (L2 over heads and dims), keeps the top R% of the
request's chunk tokens and every other row, and builds the attention metadata of that subset.
``install_layer_gates`` wraps the decoder layers after the check layer: the first gathers the
kept rows (hidden states, residual, positions), the last scatters them back to the step's full
row count, so vLLM's runner and sampler see the shapes they expect. Unselected chunk tokens keep
their cached KV in every later layer and cost nothing there: the latency is CacheBlend's.

Runs in eager mode only (row selection is data-dependent). If a request's prefill is split across
steps, each step selects among its own chunk tokens.

Masks and indices live on the device of the KV cache and hidden states; the runner's host
candidate rows are copied there once per step, at the check layer, and every size comes from
host counts, so selection and gates never sync with the device nor copy per layer
(``tests/worker/test_blend_device.py`` runs them on torch's ``meta`` device to check).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from ascend_mepic.ops import PagedRopeMetadata
from ascend_mepic.vllm_integration.attention_internals import in_forward, step_attention_metadata


@dataclass
class BlendStep:
    """One step's selection state: built by the runner, carried on the attention metadata,
    filled at the check layer."""

    check_layer: int
    num_rows: int
    # Per blending request: (first row, last row + 1, candidate rows, ratio).
    requests: list[tuple[int, int, torch.Tensor, float]]
    keep: torch.Tensor | None = None
    metadata: PagedRopeMetadata | None = None
    slot_mapping: torch.Tensor | None = None
    selected: list[int] = field(default_factory=list)  # chunk tokens kept, per request

    def active(self, layer: int) -> bool:
        return self.keep is not None and layer > self.check_layer


def current() -> BlendStep | None:
    """This forward pass's selection state: it rides on MEPIC's attention metadata, which the
    runner's builders produced for the step (no process globals)."""
    if not in_forward():
        return None
    metadata = step_attention_metadata()
    if not isinstance(metadata, dict) or not metadata:
        return None
    return getattr(next(iter(metadata.values())), "blend", None)


_LAYER = re.compile(r"layers\.(\d+)\.")


def layer_index(layer_name: str) -> int:
    m = _LAYER.search(layer_name)
    if m is None:
        raise ValueError(f"cannot find the layer index in {layer_name!r}")
    return int(m.group(1))


def select(
    state: BlendStep,
    key: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    metadata: PagedRopeMetadata,
) -> None:
    """At the check layer: pick each request's top-R% chunk tokens by K deviation.

    ``key`` is this layer's fresh un-rotated K ``[rows, Hkv, D]``; ``cache`` the op's
    ``[2, num_blocks, B, Hkv, D]`` view still holding the canonical K at those slots.

    Everything is computed on ``key``'s device (the KV cache's and the hidden states'): the
    runner's host candidate rows are copied there once, here, and every size (tokens kept per
    request, rows kept, the subset's longest sequence) comes from host counts, so a GPU step
    neither syncs nor mixes devices.
    """
    device = key.device
    bs = cache.shape[2]
    host_rows = [rows for _, _, rows, _ in state.requests]
    sizes = [len(rows) for rows in host_rows]
    # One copy per step (a no-op for rows already there); from pageable memory it is staged
    # without waiting for the device.
    all_rows = torch.cat(host_rows).to(device, torch.long, non_blocking=True)
    drop = torch.zeros(state.num_rows, dtype=torch.bool, device=device)
    selected = []
    for rows, n, (_, _, _, ratio) in zip(all_rows.split(sizes), sizes, state.requests, strict=True):
        slots = slot_mapping[rows].long()
        cached = cache[0][slots // bs, slots % bs]
        deviation = (key[rows].float() - cached.float()).flatten(1).norm(dim=1)
        count = min(n, math.ceil(ratio * n - 1e-9))
        # Stable descending order: ties keep the earlier token.
        order = torch.argsort(-deviation, stable=True)
        drop.index_fill_(0, rows, True).index_fill_(0, rows[order[:count]], False)
        selected.append(count)
    num_keep = state.num_rows - sum(sizes) + sum(selected)
    # The kept rows in row order: a stable sort puts the not-dropped rows first. ``nonzero``
    # would give the same rows but syncs to learn their number, which the host already knows.
    keep = torch.argsort(drop.to(torch.int32), stable=True)[:num_keep]
    state.keep, state.selected = keep, selected
    state.slot_mapping = slot_mapping[keep]
    state.metadata = subset_metadata(
        metadata, keep, _subset_max_query_len(state, metadata.max_query_len)
    )


def _subset_max_query_len(state: BlendStep, max_query_len: int) -> int:
    """An upper bound on the subset's longest sequence, from host values only.

    Exact for the blending sequences (rows minus dropped candidates). The other sequences keep
    all their rows and lie in the row ranges between blending ones: each is no longer than its
    range and than the step's ``max_query_len``. The ops read lengths from ``query_start_loc``;
    this value only picks the decode kernel (<= 1), which a bound never picks wrongly.
    """
    requests = zip(state.requests, state.selected, strict=True)
    spans = sorted((a, b, len(rows), count) for (a, b, rows, _), count in requests)
    longest = max((b - a - n + count for a, b, n, count in spans), default=0)
    starts = [a for a, _, _, _ in spans] + [state.num_rows]
    ends = [0] + [b for _, b, _, _ in spans]
    gap = max(start - end for start, end in zip(starts, ends, strict=True))
    return max(longest, min(gap, max_query_len))


def subset_metadata(
    meta: PagedRopeMetadata, keep: torch.Tensor, max_query_len: int
) -> PagedRopeMetadata:
    """The same sequences and block tables with only the kept query rows.

    ``keep`` is ascending and on the metadata's device; ``max_query_len`` is the host's bound
    on the subset's longest sequence (``_subset_max_query_len``): reading it off the device
    would sync.
    """
    loc = meta.query_start_loc.long()
    # Sequence s starts, in the subset, after the kept rows before its first row.
    new_loc = torch.searchsorted(keep, loc)
    return PagedRopeMetadata(
        block_size=meta.block_size,
        query_start_loc=new_loc.to(meta.query_start_loc.dtype),
        query_positions=meta.query_positions[keep],
        query_indices=meta.query_indices[keep],
        block_tables=meta.block_tables,
        num_blocks=meta.num_blocks,
        block_first_pos=meta.block_first_pos,
        block_valid_start=meta.block_valid_start,
        block_valid_end=meta.block_valid_end,
        max_query_len=max_query_len,
        max_num_blocks=meta.max_num_blocks,
    )


class _LayerGate(nn.Module):
    """Wraps one decoder layer after the check layer: gathers rows at the first, scatters at
    the last (vLLM 0.30.0 decoder layers take ``(positions, hidden_states, residual)``)."""

    def __init__(self, layer: nn.Module, index: int, first: bool, last: bool) -> None:
        super().__init__()
        self.layer, self.index, self.first, self.last = layer, index, first, last

    def forward(self, positions, hidden_states, residual, **kwargs):
        state = current()
        if state is None or not state.active(self.index):
            return self.layer(positions, hidden_states, residual, **kwargs)
        keep = state.keep  # on the device of the KV cache, i.e. of the hidden states
        if hidden_states.shape[0] == state.num_rows:  # the first gated layer of this step
            hidden_states, residual = hidden_states[keep], residual[keep]
        hidden_states, residual = self.layer(positions[keep], hidden_states, residual, **kwargs)
        if self.last:
            full_h = hidden_states.new_zeros((state.num_rows, *hidden_states.shape[1:]))
            full_r = residual.new_zeros((state.num_rows, *residual.shape[1:]))
            full_h[keep], full_r[keep] = hidden_states, residual
            return full_h, full_r
        return hidden_states, residual


def install_layer_gates(model: nn.Module, check_layer: int) -> int:
    """Wrap the decoder layers after ``check_layer``; returns how many were wrapped."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"cacheblend needs a decoder with model.layers; {type(model).__name__} has none"
        )
    if not 0 <= check_layer < len(layers):
        raise ValueError(f"check layer {check_layer} outside the model's {len(layers)} layers")
    last = len(layers) - 1
    for i in range(check_layer + 1, len(layers)):
        layers[i] = _LayerGate(layers[i], i, i == check_layer + 1, i == last)
    return last - check_layer
