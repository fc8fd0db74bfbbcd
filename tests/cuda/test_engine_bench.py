"""What ``ascend-mepic bench engine`` starts on vLLM's CUDA platform: the runner's own engine
arguments for the dummy Mistral-7B (published shape: 32 layers, 32/8 heads, head 128), built into
an engine config by vLLM's CUDA platform code on an SM90 double. UNTESTED ON A GPU.

Stock (``prefix``) must get vLLM's defaults, FLASH_ATTN among them (which flash attention version
it runs, FA3 on SM90, is decided by the CUDA wheel's compiled modules at run time, and the
benchmark reports it); MEPIC must get its worker, scheduler and the ``CUSTOM`` backend.
"""

from __future__ import annotations

import pytest

from ascend_mepic.vllm_integration.class_names import GPU_WORKER_CLS, SCHEDULER_CLS
from tests.cuda.test_startup import selected_backend


@pytest.fixture(scope="module")
def mistral7b_dummy(tmp_path_factory) -> str:
    """The dummy folder as ``prepare_dummy`` makes it, with the tiny tokenizer in place of
    SmolLM2's (the config's vocabulary follows the tokenizer either way)."""
    from ascend_mepic.eval import prepare

    dest = tmp_path_factory.mktemp("models") / "mistral7b-dummy"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prepare, "_smollm2_tokenizer", lambda n: prepare._tiny_tokenizer())
        return str(prepare.prepare_dummy(dest=dest))


def bench_config(model: str, policy: str, graphs: str = "eager"):
    """The engine config of one bench job from the runner's own ``LLM(...)`` arguments
    (``runner.llm_arguments``, platform settings by ``runner.engine_setup`` on this CUDA
    platform), built as ``LLM`` builds it."""
    from vllm.engine.arg_utils import EngineArgs

    from ascend_mepic.eval.bench.runner import engine_setup, llm_arguments
    from ascend_mepic.plugin import register

    register()  # what vLLM's plugin loader does in every process (idempotent)
    job = {"model": model, "policy": policy, "device": "cuda", "kv_gib": 4, "graphs": graphs}
    kwargs = llm_arguments(job, engine_setup(job), block_size=16, max_model_len=4096)
    return EngineArgs(**kwargs).create_engine_config()


def test_stock_gets_vllms_defaults_and_flash_attention(mistral7b_dummy):
    import torch
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    config = bench_config(mistral7b_dummy, "prefix")
    assert config.model_config.dtype == torch.bfloat16
    assert str(config.load_config.load_format) == "dummy"
    assert config.cache_config.kv_cache_memory_bytes == 4 << 30
    assert config.model_config.enforce_eager
    assert config.parallel_config.worker_cls == "vllm.v1.worker.gpu_worker.Worker"
    assert config.use_v2_model_runner and config.scheduler_config.async_scheduling
    assert config.attention_config.backend is None  # vLLM's own choice
    assert selected_backend(config) is FlashAttentionBackend


@pytest.mark.parametrize("graphs", ["eager", "compiled"])
def test_mepic_gets_its_worker_and_backend(mistral7b_dummy, graphs):
    from vllm.config import CUDAGraphMode
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from ascend_mepic.worker.cuda_attention import MepicCudaAttentionBackend

    config = bench_config(mistral7b_dummy, "mepic", graphs)
    assert config.parallel_config.worker_cls == GPU_WORKER_CLS
    assert config.scheduler_config.scheduler_cls == SCHEDULER_CLS
    assert not config.use_v2_model_runner and not config.scheduler_config.async_scheduling
    assert config.attention_config.backend == AttentionBackendEnum.CUSTOM
    mode = CUDAGraphMode.NONE if graphs == "eager" else CUDAGraphMode.PIECEWISE
    assert config.compilation_config.cudagraph_mode == mode
    assert config.model_config.get_head_size() == 128
    assert selected_backend(config) is MepicCudaAttentionBackend
