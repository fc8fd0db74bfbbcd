"""MEPIC reads the loaded model's RoPE from the model, not from every rotary module ever built.

A process can load one model after another (an ``LLM`` shut down, then another built, as a
notebook or the Ascend engine-loop tests do); before, the second model with other RoPE
parameters failed at its first forward ("layers with different RoPE parameters").
"""

from __future__ import annotations

import pytest
import torch
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

from ascend_mepic.ops.rope import UnsupportedRopeError
from ascend_mepic.worker import nope_rotary as rope


def _nope(theta: float) -> torch.nn.Module:
    cls = rope._nope_class(RotaryEmbedding)
    return cls(64, 64, 256, theta, True, torch.float32)


@pytest.fixture(autouse=True)
def clean_records(monkeypatch):
    from vllm.config import VllmConfig, set_current_vllm_config

    monkeypatch.setattr(rope, "_specs", [])
    monkeypatch.setattr(rope, "_model_rope", None)
    with set_current_vllm_config(VllmConfig()):  # vLLM's CustomOps read it when built
        yield


def test_a_second_model_with_other_rope_gets_its_own():
    first = torch.nn.ModuleList([_nope(10000.0), _nope(10000.0)])
    assert rope.record_model_rope(first).cos_sin_cache.shape[0] == 256
    second = torch.nn.ModuleList([_nope(1e6)])
    with pytest.raises(UnsupportedRopeError):  # the construction records mix both models
        rope._one_rope(rope._specs)
    got = rope.record_model_rope(second)
    assert torch.equal(got.cos_sin_cache, second[0].cos_sin_cache)
    assert rope.registered_rope() is got


def test_one_model_with_two_ropes_is_still_refused():
    with pytest.raises(UnsupportedRopeError, match="different RoPE parameters"):
        rope.record_model_rope(torch.nn.ModuleList([_nope(10000.0), _nope(1e6)]))


def test_a_model_without_nope_rotary_modules_is_refused():
    with pytest.raises(RuntimeError, match="found no rotary embedding"):
        rope.record_model_rope(torch.nn.Linear(2, 2))


def test_a_draft_model_must_share_the_models_rope():
    """The drafter's layers use the same attention backend, which applies one RoPE."""
    model = torch.nn.ModuleList([_nope(10000.0)])
    assert rope.record_model_rope(model, torch.nn.ModuleList([_nope(10000.0)])) is not None
    with pytest.raises(UnsupportedRopeError, match="different RoPE parameters"):
        rope.record_model_rope(model, torch.nn.ModuleList([_nope(1e6)]))
