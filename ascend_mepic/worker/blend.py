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
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch
from torch import nn
from vllm.forward_context import get_forward_context, is_forward_context_available

from ascend_mepic.ops import PagedRopeMetadata


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
    if not is_forward_context_available():
        return None
    metadata = get_forward_context().attn_metadata
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
    """
    bs = cache.shape[2]
    drop = torch.zeros(state.num_rows, dtype=torch.bool)
    selected = []
    for _, _, rows, ratio in state.requests:
        slots = slot_mapping[rows].long()
        cached = cache[0][slots // bs, slots % bs]
        deviation = (key[rows].float() - cached.float()).flatten(1).norm(dim=1)
        count = min(len(rows), math.ceil(ratio * len(rows) - 1e-9))
        # Stable descending order: ties keep the earlier token.
        order = torch.argsort(-deviation, stable=True)
        keep_rows = rows[order[:count]]
        drop[rows] = True
        drop[keep_rows] = False
        selected.append(count)
    keep = torch.nonzero(~drop).flatten()
    state.keep, state.selected = keep, selected
    state.slot_mapping = slot_mapping[keep]
    state.metadata = subset_metadata(metadata, keep)


def subset_metadata(meta: PagedRopeMetadata, keep: torch.Tensor) -> PagedRopeMetadata:
    """The same sequences and block tables with only the kept query rows."""
    loc = meta.query_start_loc.long()
    bounds = torch.bucketize(keep, loc[1:], right=True)  # sequence of each kept row
    counts = torch.bincount(bounds, minlength=len(loc) - 1)
    new_loc = torch.zeros_like(loc)
    new_loc[1:] = torch.cumsum(counts, 0)
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
        max_query_len=int(counts.max()) if len(counts) else 0,
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
        keep = state.keep.to(hidden_states.device)
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
