"""CacheBlend's selection and row gates stay on the step's device, without a GPU.

``worker.blend`` only ever ran on CPU, where a tensor built on the host by mistake costs nothing.
Here the KV cache, K, slot mapping, metadata and hidden states live on ``meta`` (torch's device
without data): host syncs (``.item()``, ``int()``, ``nonzero``, ``bincount``) raise there, and a
dispatch-mode log records every op's devices, so any op mixing the host with the device, any
index tensor built on the host and any per-layer copy fails the test. The runner hands the
candidate rows as host tensors (``model_runner._place_tokens``): one copy of them per step is
the only host-to-device transfer allowed. The same scenario on CPU checks the selection itself
against a plain Python oracle.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ascend_mepic.ops.metadata import PagedRopeMetadata
from ascend_mepic.worker import blend

B, HKV, D, HIDDEN = 4, 2, 8, 16
# (rows, candidate rows or None, ratio): a plain prefill, a blending prefill, a decode, a
# blending prefill, a plain prefill.
SEQS = [
    (5, None, 0.0),
    (20, range(3, 18), 0.3),
    (1, None, 0.0),
    (14, range(1, 13), 0.5),
    (3, None, 0.0),
]
CHECK_LAYER, NUM_LAYERS = 1, 4


class DeviceLog(TorchDispatchMode):
    """Records, per aten op, the devices of its tensors (inputs and outputs). A 0-dim CPU
    tensor is a wrapped Python number (torch passes those to device kernels by value)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, frozenset[str]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        devices = {t.device.type for t in tensors if not (t.dim() == 0 and t.device.type == "cpu")}
        self.ops.append((str(func.overloadpacket.__name__), frozenset(devices)))
        return out


def _scenario(seed: int = 0):
    """A step of ``SEQS``: K, the cache holding canonical K at the step's slots, the slot
    mapping, the metadata and the blend state (candidate rows on the host, as the runner
    hands them)."""
    g = torch.Generator().manual_seed(seed)
    counts = [n for n, _, _ in SEQS]
    num_rows = sum(counts)
    loc = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    requests = []
    for s, (_, candidates, ratio) in enumerate(SEQS):
        if candidates is not None:
            a, b = int(loc[s]), int(loc[s + 1])
            rows = torch.tensor([a + r for r in candidates], dtype=torch.int64)
            requests.append((a, b, rows, ratio))
    num_blocks = 16
    slot_mapping = torch.randperm(num_blocks * B, generator=g)[:num_rows]
    key = torch.randn(num_rows, HKV, D, generator=g)
    cache = torch.randn(2, num_blocks, B, HKV, D, generator=g)
    # Canonical K = fresh K plus noise of a per-token scale: deviations far apart, no ties.
    noise = torch.randn(num_rows, HKV, D, generator=g) * torch.rand(num_rows, 1, 1, generator=g)
    cache[0].view(-1, HKV, D)[slot_mapping] = key + noise
    tables = torch.zeros(len(SEQS), 3, dtype=torch.int32)
    meta = PagedRopeMetadata(
        block_size=B,
        query_start_loc=loc,
        query_positions=torch.arange(num_rows, dtype=torch.int32) + 7,
        query_indices=torch.arange(num_rows, dtype=torch.int32) * 2,
        block_tables=tables,
        num_blocks=torch.full((len(SEQS),), 3, dtype=torch.int32),
        block_first_pos=tables,
        block_valid_start=tables,
        block_valid_end=tables + B,
        max_query_len=max(counts),
        max_num_blocks=3,
    )
    state = blend.BlendStep(CHECK_LAYER, num_rows, requests)
    return state, key, cache, slot_mapping, meta


def _oracle(state: blend.BlendStep, key, cache, slot_mapping) -> tuple[list[int], list[int]]:
    """Kept rows and per-request counts, in plain Python."""
    dropped: set[int] = set()
    selected = []
    for _, _, rows, ratio in state.requests:
        rows = rows.tolist()
        dev = []
        for r in rows:
            slot = int(slot_mapping[r])
            cached = cache[0, slot // B, slot % B]
            dev.append(float((key[r] - cached).double().pow(2).sum().sqrt()))
        count = min(len(rows), math.ceil(ratio * len(rows) - 1e-9))
        ranked = sorted(range(len(rows)), key=lambda i: (-dev[i], i))
        dropped |= {rows[i] for i in ranked[count:]}
        selected.append(count)
    return [r for r in range(state.num_rows) if r not in dropped], selected


class _Layer(nn.Module):
    """A decoder layer's calling convention: rows transformed independently."""

    def forward(self, positions, hidden_states, residual):
        return hidden_states * 2 + positions[:, None], residual + 1


def _run_gates(state, hidden, residual, positions, monkeypatch) -> tuple[torch.Tensor, ...]:
    """The layers after the check layer, gated, as the model runs them in one step."""
    monkeypatch.setattr(blend, "current", lambda: state)
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList(_Layer() for _ in range(NUM_LAYERS))
    blend.install_layer_gates(model, CHECK_LAYER)
    for layer in model.model.layers[CHECK_LAYER + 1 :]:
        hidden, residual = layer(positions, hidden, residual)
    return hidden, residual


def test_select_on_cpu_matches_the_oracle(monkeypatch):
    state, key, cache, slot_mapping, meta = _scenario()
    keep, selected = _oracle(state, key, cache, slot_mapping)
    blend.select(state, key, cache, slot_mapping, meta)
    assert state.keep.tolist() == keep and state.selected == selected
    assert state.slot_mapping.tolist() == slot_mapping[keep].tolist()
    sub = state.metadata
    seq = torch.bucketize(torch.tensor(keep), meta.query_start_loc[1:].long(), right=True)
    lengths = torch.bincount(seq, minlength=len(SEQS))
    assert sub.query_start_loc.tolist() == [0, *lengths.cumsum(0).tolist()]
    assert sub.query_start_loc.dtype == meta.query_start_loc.dtype
    assert sub.query_positions.tolist() == meta.query_positions[keep].tolist()
    assert sub.query_indices.tolist() == meta.query_indices[keep].tolist()
    assert sub.max_query_len == int(lengths.max())  # the bound is exact in this step
    # The gates compute the kept rows only and hand back the step's full row count.
    num_rows = state.num_rows
    hidden = torch.randn(num_rows, HIDDEN)
    positions = meta.query_positions.long()
    out_h, out_r = _run_gates(state, hidden, torch.zeros(num_rows, HIDDEN), positions, monkeypatch)
    layers = NUM_LAYERS - CHECK_LAYER - 1
    want = hidden[keep]
    for _ in range(layers):
        want = want * 2 + positions[keep][:, None]
    assert out_h.shape == hidden.shape and torch.equal(out_h[keep], want)
    dropped = [r for r in range(num_rows) if r not in set(keep)]
    assert not out_h[dropped].any() and torch.equal(out_r[keep], torch.full_like(want, layers))


def test_subset_max_query_len_bounds_the_lengths():
    """Sequences between blending ones keep all rows; the bound never undercounts them."""
    state, key, cache, slot_mapping, meta = _scenario()
    state.requests = state.requests[:1]  # rows 25..43 (decode, 14 rows, 3 rows) unblended
    blend.select(state, key, cache, slot_mapping, meta)
    sub = state.metadata
    lengths = (sub.query_start_loc[1:] - sub.query_start_loc[:-1]).tolist()
    assert lengths == [5, 20 - 15 + 5, 1, 14, 3]
    assert sub.max_query_len == 18  # the unblended range 25..43: no host table splits it
    assert max(lengths) <= sub.max_query_len <= meta.max_query_len


def test_select_and_gates_stay_on_the_device(monkeypatch):
    cpu_state, key, cache, slot_mapping, meta = _scenario()
    blend.select(cpu_state, key, cache, slot_mapping, meta)
    state, *_ = _scenario()  # candidate rows on the host, as the runner hands them
    dev = torch.device("meta")
    on_dev = key.to(dev), cache.to(dev), slot_mapping.to(dev), meta.to(dev)
    log = DeviceLog()
    with log:
        blend.select(state, *on_dev)
    host = [op for op, devices in log.ops if "cpu" in devices]
    mixed = [op for op, devices in log.ops if len(devices) > 1]
    # The runner's host rows are concatenated and copied once; nothing else touches the host.
    assert mixed == ["_to_copy"], log.ops
    assert set(host) <= {"cat", "_to_copy"}, log.ops
    sub = state.metadata
    for t in (state.keep, state.slot_mapping, sub.query_start_loc, sub.query_positions):
        assert t.device == dev
    assert state.keep.shape == cpu_state.keep.shape
    assert state.selected == cpu_state.selected
    assert sub.max_query_len == cpu_state.metadata.max_query_len
    assert sub.query_start_loc.shape == meta.query_start_loc.shape

    # Every gated layer works on the device's tensors only: no copy, no host index.
    num_rows = state.num_rows
    hidden = torch.empty(num_rows, HIDDEN, device=dev)
    positions = torch.empty(num_rows, dtype=torch.long, device=dev)
    log = DeviceLog()
    with log:
        out_h, out_r = _run_gates(state, hidden, torch.empty_like(hidden), positions, monkeypatch)
    assert all(devices == {"meta"} for _, devices in log.ops), log.ops
    assert "_to_copy" not in [op for op, _ in log.ops]
    assert out_h.shape == out_r.shape == hidden.shape and out_h.device == dev
