"""vllm-ascend's model runner with MEPIC, built by its real constructor from a real config.

UNTESTED ON HARDWARE. What runs: the engine config with ``{"mepic": {}}`` through
``NPUPlatform.check_and_update_config``, pickled as a worker receives it; MEPIC's worker-process
set-up (``prepare_worker_process``, what ``MepicNPUWorker.__init__`` adds); the real
``MepicNPUModelRunner`` (``NPUModelRunner.__init__``) constructor, ``load_model`` of a tiny local
Llama, and KV allocation by vllm-ascend's own ``initialize_kv_cache`` after the engine core's
layout resolution. The stand-ins: the "NPU" is the CPU (``device_config.device`` is set to it:
creating ``npu`` tensors needs the real torch_npu's PrivateUse1 backend), vLLM's distributed
groups use gloo instead of HCCL, and ``NPUWorker`` itself is not built (its ``__init__`` imports
torchvision through vllm-ascend's worker patches; its ``init_device`` needs a device).
"""

from __future__ import annotations

import pickle
import socket
from types import SimpleNamespace

import pytest
import torch

from tests.ascend.test_startup import _engine_config


@pytest.fixture(scope="module")
def runner(tiny_model):
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

    from ascend_mepic.worker.npu_worker import MepicNPUModelRunner, prepare_worker_process

    config = _engine_config(tiny_model, additional_config={"mepic": {}})
    config = pickle.loads(pickle.dumps(config))  # as the worker process receives it
    config.device_config.device = torch.device("cpu")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(config):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
        initialize_model_parallel(1, 1)
        try:
            prepare_worker_process(config)
            runner = MepicNPUModelRunner(config, torch.device("cpu"))
            runner.load_model()
            specs = runner.get_kv_cache_spec()
            # The engine core resolves the layout from the workers' backends, then sizes KV.
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


def test_mepic_backend_and_nope_rotary_are_what_the_runner_built(runner):
    from ascend_mepic.worker.npu_attention import MepicAscendAttentionBackend

    groups = [g for per_group in runner.attn_groups for g in per_group]
    assert groups and all(g.backend is MepicAscendAttentionBackend for g in groups)
    rotary = [m for m in runner.model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    assert rotary and all(hasattr(type(m), "mepic_base_name") for m in rotary)  # MEPIC's NoPE
    q, k = torch.randn(3, 4 * 32), torch.randn(3, 2 * 32)
    out_q, out_k = rotary[0](torch.arange(3), q, k)
    assert out_q is q and out_k is k  # RoPE is applied in the attention kernel, not here


def test_kv_allocated_by_vllm_ascend_is_addressable_by_mepic(runner):
    from ascend_mepic.vllm_integration.ascend import kv_pair_view
    from ascend_mepic.vllm_integration.runner_internals import check_block_table

    assert len(runner.kv_caches) == runner.model_config.hf_config.num_hidden_layers
    k, v = runner.kv_caches[0]
    view = kv_pair_view((k, v))
    assert view.shape[0] == 2 and view.shape[2] == 128
    buffers = runner.mepic_kv_buffers()
    assert all(b.is_contiguous() and b.shape[1] == 2 for b in buffers)
    for table in runner.input_batch.block_table.block_tables:
        check_block_table(table, 128)  # vllm-ascend's real BlockTable: no kernel-block split


def test_vllm_ascends_block_table_rows_hold_mepic_tables(runner):
    """vllm-ascend's own ``BlockTable`` rows are widened to MEPIC's table width (issue 46), so a
    request with many chunks that fits in tokens gets a row (``core.request_limits``)."""
    from ascend_mepic.core.request_limits import DEFAULT_MAX_CHUNKS, table_width

    table = runner.input_batch.block_table.block_tables[0]
    width = table_width(runner.model_config.max_model_len, 128, DEFAULT_MAX_CHUNKS)
    assert table.block_table.np.shape[1] == table.max_num_blocks_per_req == width
    assert width > -(-runner.model_config.max_model_len // 128)
    assert table.block_table.gpu.shape == table.block_table.cpu.shape
    row = list(range(1, width + 1))
    table.add_row(row, 0)  # a full-width row fits
    assert table.block_table.np[0, :width].tolist() == row
    table.clear_row(0)
