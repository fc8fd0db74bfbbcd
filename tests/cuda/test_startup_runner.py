"""MEPIC's CUDA model runner, built by vLLM's real V1 ``GPUModelRunner`` constructor.

UNTESTED ON A GPU. What runs: the engine config with ``{"mepic": {}}`` through the CUDA platform's
check and MEPIC's hook, pickled as a worker receives it; MEPIC's worker-process set-up (what
``MepicGPUWorker.__init__`` adds after vLLM's); the real ``MepicGPUModelRunner`` constructor,
``load_model`` of a tiny local Llama (head size 128) and KV allocation by vLLM's
``initialize_kv_cache`` after the engine core's layout resolution. The stand-ins: the "GPU" is
the CPU (``device_config.device`` is set to it; CUDA tensors need a GPU), vLLM's distributed
groups use gloo instead of NCCL, the device's memory counters read 0 and its synchronisation is
a no-op (``DEVICE_COUNTERS``: they need a GPU), and FlashInfer's sampler is off
(``VLLM_USE_FLASHINFER_SAMPLER=0``: FlashInfer is a dependency of vLLM's CUDA wheel, not
installed here). The runner is built in eager mode: vLLM's torch.compile passes on CUDA import
the CUDA wheel's fused ops, so piecewise CUDA graphs (what a MEPIC config gets,
``test_startup.py``) are not built here.
"""

from __future__ import annotations

import pickle
import socket
from types import SimpleNamespace

import pytest
import torch

from tests.cuda.test_startup import engine_config

# The device's memory counters and synchronisation that vLLM's loader and runner call (here
# without a device they raise "Cannot access accelerator device"), as no-ops.
DEVICE_COUNTERS = {
    "max_memory_allocated": lambda *a, **k: 0,
    "memory_allocated": lambda *a, **k: 0,
    "reset_peak_memory_stats": lambda *a, **k: None,
    "synchronize": lambda *a, **k: None,
    "empty_cache": lambda *a, **k: None,
}


@pytest.fixture(scope="module")
def runner(head128_model):
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.worker.worker_base import WorkerBase

    from ascend_mepic.worker.cuda_attention import register_cuda_backend
    from ascend_mepic.worker.gpu_worker import MepicGPUModelRunner, check_worker_config
    from ascend_mepic.worker.nope_rotary import install_nope_rope

    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_USE_FLASHINFER_SAMPLER", "0")
    from vllm.platforms import current_platform

    # The GPU's memory counters (vLLM's load-time memory profiler) do not count CPU tensors.
    mp.setattr(
        type(current_platform), "get_current_memory_usage", classmethod(lambda cls, d=None: 0.0)
    )
    for name, value in DEVICE_COUNTERS.items():
        mp.setattr(torch.accelerator, name, value)
    config = engine_config(
        head128_model,
        dtype="float32",
        block_size=16,
        enforce_eager=True,
        additional_config={"mepic": {}},
    )
    config = pickle.loads(pickle.dumps(config))
    config.device_config.device = torch.device("cpu")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(config):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
        initialize_model_parallel(1, 1)
        try:
            check_worker_config(config)  # MepicGPUWorker.__init__'s additions
            install_nope_rope()
            register_cuda_backend()
            runner = MepicGPUModelRunner(config, torch.device("cpu"))
            runner.load_model()
            specs = runner.get_kv_cache_spec()
            worker = SimpleNamespace(vllm_config=config)
            layout = resolve_kv_cache_layout(
                config, [WorkerBase.get_supported_kv_cache_layouts(worker)], list(specs.values())
            )
            WorkerBase.set_kv_cache_layout(worker, layout.name)
            kv_config = get_kv_cache_configs(config, [specs], [8 * 2**20])[0]
            runner.initialize_kv_cache(kv_config)
            yield runner
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()
            mp.undo()


def test_mepic_backend_and_nope_rotary_are_what_the_runner_built(runner):
    from ascend_mepic.worker.cuda_attention import MepicCudaAttentionBackend

    groups = [g for per_group in runner.attn_groups for g in per_group]
    assert groups and all(g.backend is MepicCudaAttentionBackend for g in groups)
    rotary = [m for m in runner.model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    assert rotary and all(hasattr(type(m), "mepic_base_name") for m in rotary)  # MEPIC's NoPE
    q, k = torch.randn(3, 4 * 128), torch.randn(3, 2 * 128)
    out_q, out_k = rotary[0](torch.arange(3), q, k)
    assert out_q is q and out_k is k  # RoPE is applied in the attention kernel, not here


def test_kv_allocated_by_vllm_is_addressable_by_mepic(runner):
    """vLLM allocates by the layout MEPIC's backend declared; MEPIC's view of a layer's buffer
    writes and reads back the same rows through its op (the torch reference here)."""
    from ascend_mepic.ops import write_kv
    from ascend_mepic.ops.layout import cache_view

    assert len(runner.kv_caches) == runner.model_config.hf_config.num_hidden_layers
    view = cache_view(runner.kv_caches[0], num_kv_heads=2, head_size=128)
    two, num_blocks, block, heads, head = view.shape
    assert (two, block, heads, head) == (2, 16, 2, 128) and num_blocks > 2
    k, v = torch.randn(3, 2, 128), torch.randn(3, 2, 128)
    slots = torch.tensor([0, 17, 33])  # three blocks
    write_kv(k, v, view, slots)
    flat = view.reshape(2, num_blocks * block, heads, head)
    assert torch.equal(flat[0, slots], k) and torch.equal(flat[1, slots], v)


def test_runner_is_vllms_v1_runner(runner):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert isinstance(runner, GPUModelRunner)  # V1's; the fixture's config check refused V2
    assert not any(c.__module__ == "vllm.v1.worker.gpu.model_runner" for c in type(runner).mro())
