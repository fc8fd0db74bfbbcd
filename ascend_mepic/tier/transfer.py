"""KV copies between vLLM's paged cache and storage outside it, and CacheTune's scores.

Whole blocks for the host store (private placement's padded chunk blocks); token ranges for the
tier (a chunk's canonical tokens, which the chunk arena packs from any slot of a block on).

Every per-layer cache is handed over as a logical ``[num_blocks, 2, B, Hkv, D]`` view (see
``ops.layout.block_view``; its memory is the backend's business), indexed through its strides:
saving whole blocks yields them in that logical order, whatever the physical layout, and token
ranges are stored ``[n, 2, Hkv * D]``. Loads run after vLLM zeroes the step's new blocks and
before the forward pass; saves run right after the forward pass that compiled the chunk, before
the scheduler frees the compile's blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def save_blocks(caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> torch.Tensor:
    """Copy ``block_ids`` of every layer out of the pool: ``[num_layers, n, 2, B, Hkv, D]``."""
    index = torch.as_tensor(list(block_ids), dtype=torch.long, device=caches[0].device)
    return torch.stack([cache.index_select(0, index) for cache in caches]).cpu()


def load_blocks(
    caches: Sequence[torch.Tensor],
    stored: torch.Tensor,
    offsets: Sequence[int],
    block_ids: Sequence[int],
) -> None:
    """Write stored blocks ``offsets`` into pool blocks ``block_ids`` of every layer."""
    src = torch.as_tensor(list(offsets), dtype=torch.long)
    dst = torch.as_tensor(list(block_ids), dtype=torch.long, device=caches[0].device)
    for layer, cache in enumerate(caches):
        cache.index_copy_(0, dst, stored[layer].index_select(0, src).to(cache.device))


def load_stored_tokens(
    caches: Sequence[torch.Tensor],
    stored: torch.Tensor,
    num_tokens: int,
    runs: Sequence[tuple[int, int, int, int]],
    block_size: int,
) -> None:
    """Copy token runs of a host-store entry (``save_blocks`` of a padded compile: the chunk's
    ``num_tokens`` real tokens are its last slots) into private slots: each run is
    ``(first chunk token, tokens, block id, first slot)``."""
    device = caches[0].device
    src = torch.cat([torch.arange(o, o + n) for o, n, _, _ in runs])
    dst_blocks = torch.cat([torch.full((n,), b, dtype=torch.long) for _, n, b, _ in runs])
    dst_slots = torch.cat([torch.arange(t, t + n) for _, n, _, t in runs])
    num_blocks = stored.shape[1]
    src = src + num_blocks * block_size - num_tokens  # skip the front pad
    dst_blocks, dst_slots = dst_blocks.to(device), dst_slots.to(device)
    for layer, c in enumerate(caches):
        tokens = stored[layer].reshape(num_blocks, 2, block_size, -1).transpose(0, 1)
        tokens = tokens.reshape(2, num_blocks * block_size, -1)[:, src].transpose(0, 1)
        c[dst_blocks, :, dst_slots] = tokens.reshape(-1, 2, *c.shape[3:]).to(c.device)


def _token_index(
    block_ids: Sequence[int], offset: int, num_tokens: int, block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, slot) of each of ``num_tokens`` tokens stored from slot ``offset`` of the first
    block on, continuing through ``block_ids``."""
    flat = torch.arange(offset, offset + num_tokens, device=device)
    if num_tokens and (offset + num_tokens - 1) // block_size >= len(block_ids):
        raise ValueError(f"{num_tokens} tokens from slot {offset} overflow {len(block_ids)} blocks")
    blocks = torch.as_tensor(list(block_ids), dtype=torch.long, device=device)[flat // block_size]
    return blocks, flat % block_size


def save_tokens(
    caches: Sequence[torch.Tensor],
    block_ids: Sequence[int],
    offset: int,
    num_tokens: int,
    block_size: int,
) -> torch.Tensor:
    """Copy a token range of every layer out of the pool: ``[num_layers, n, 2, Hkv * D]``."""
    blocks, slots = _token_index(block_ids, offset, num_tokens, block_size, caches[0].device)
    return torch.stack([c[blocks, :, slots].flatten(2) for c in caches]).cpu()


def load_tokens(
    caches: Sequence[torch.Tensor],
    stored: torch.Tensor,
    block_ids: Sequence[int],
    offset: int,
    block_size: int,
) -> None:
    """Write ``save_tokens``' output back, from slot ``offset`` of ``block_ids[0]`` on."""
    blocks, slots = _token_index(block_ids, offset, stored.shape[1], block_size, caches[0].device)
    for layer, c in enumerate(caches):
        c[blocks, :, slots] = stored[layer].reshape(-1, 2, *c.shape[3:]).to(c.device)


def lowfreq_scores(
    stored: torch.Tensor,
    num_tokens: int,
    num_kv_heads: int,
    head_size: int,
    alpha: float = 0.5,
) -> list[float]:
    """CacheTune's token importance from a chunk's canonical KV (its section 4.1).

    Per layer, K and V (``[tokens, heads * dim]``, K un-rotated) are low-passed along the
    sequence (rFFT, keep the lowest ``alpha`` of the frequencies, inverse); a token's energy is
    the mean of its K and V row norms, normalized by the layer's mean so no layer dominates, then
    averaged over layers. The chunk's real tokens are the last ``num_tokens`` slots.
    """
    num_layers, num_blocks = stored.shape[:2]
    kv = stored.reshape(num_layers, num_blocks, 2, -1, num_kv_heads * head_size).double()
    kv = kv.transpose(1, 2).reshape(num_layers, 2, -1, num_kv_heads * head_size)
    kv = kv[:, :, kv.shape[2] - num_tokens :]
    spectrum = torch.fft.rfft(kv, dim=2)
    cut = int(alpha * (num_tokens // 2 + 1))
    spectrum[:, :, cut:] = 0
    low = torch.fft.irfft(spectrum, n=num_tokens, dim=2)
    energy = low.norm(dim=-1).mean(dim=1)  # [layers, tokens]: (|K~| + |V~|) / 2
    energy = energy / energy.mean(dim=1, keepdim=True).clamp_min(1e-12)
    return energy.mean(dim=0).tolist()
