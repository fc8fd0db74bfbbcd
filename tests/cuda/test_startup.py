"""MEPIC's one switch on vLLM's CUDA platform: what is chosen, and what fails at start-up.

UNTESTED ON A GPU. Real here: vLLM 0.30.0's ``EngineArgs.create_engine_config`` with a real
``ModelConfig`` of a tiny local Llama, vLLM's ``CudaPlatformBase.check_and_update_config`` (with
MEPIC's configuration hook around it), vLLM's attention selector and the CUDA platform's
``get_attn_backend_cls``, and the real ``MepicGPUWorker`` constructor on the pickled config.
Faked: the GPU's identity per generation (SM80, SM90, SM100) and the compiled modules of vLLM's
CUDA wheel (``cuda_double.py``). Refusals at config time reach the user as vLLM's configuration
error (pydantic wraps ``VllmConfig.__post_init__``'s ``ValueError``), MEPIC's message inside.
"""

from __future__ import annotations

import pickle
import shutil

import pytest
import torch

from ascend_mepic.vllm_integration.class_names import GPU_WORKER_CLS, SCHEDULER_CLS
from tests.cuda.cuda_double import set_capability

GENERATIONS = {"SM80": (8, 0), "SM90": (9, 0), "SM100": (10, 0)}


@pytest.fixture(params=list(GENERATIONS.values()), ids=list(GENERATIONS))
def gpu(request):
    set_capability(request.param)
    yield request.param
    set_capability((9, 0))


def engine_config(model: str, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    from ascend_mepic.plugin import register

    register()  # what vLLM's plugin loader does in every process (idempotent)
    kwargs.setdefault("max_model_len", 512)
    return EngineArgs(model=model, **kwargs).create_engine_config()


def serve_config(model: str, *argv: str):
    """``ascend-mepic serve MODEL ...``: vLLM's own server parser, MEPIC's defaults, then the
    engine config the server builds from them."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from ascend_mepic.entrypoints.server.launch import apply_mepic_defaults
    from ascend_mepic.plugin import register

    register()
    args = make_arg_parser(FlexibleArgumentParser()).parse_args([model, "--max-model-len", "512"])
    args.model = args.model_tag
    temp = apply_mepic_defaults(args, is_cpu=False, environ={})  # the stats file: not used here
    if temp is not None:
        shutil.rmtree(temp)
    return EngineArgs.from_cli_args(args).create_engine_config()


def selected_backend(config):
    """The class vLLM's selector hands the model's attention layers in a MEPIC worker."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend

    from ascend_mepic.worker.cuda_attention import register_cuda_backend

    register_cuda_backend()  # MepicGPUWorker.__init__ does this
    model = config.model_config
    with set_current_vllm_config(config):
        return get_attn_backend(model.get_head_size(), model.dtype, config.cache_config.cache_dtype)


def build_worker(config):
    from vllm.utils.import_utils import resolve_obj_by_qualname

    worker_cls = resolve_obj_by_qualname(config.parallel_config.worker_cls)
    return worker_cls(
        vllm_config=pickle.loads(pickle.dumps(config)),  # as the worker process receives it
        local_rank=0,
        rank=0,
        distributed_init_method="tcp://127.0.0.1:1",
        is_driver_worker=True,
    )


def test_stock_defaults_the_double_reproduces(gpu, tiny_model):
    """Without MEPIC, vLLM 0.30.0 on CUDA resolves the settings MEPIC cannot run with: async
    scheduling on, the V2 model runner, full CUDA graphs, its own worker."""
    from vllm.config import CUDAGraphMode

    config = engine_config(tiny_model)
    assert config.scheduler_config.async_scheduling is True
    assert config.use_v2_model_runner is True
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
    assert config.parallel_config.worker_cls == "vllm.v1.worker.gpu_worker.Worker"
    assert config.attention_config.backend is None
    assert "ascend_mepic" not in str(config.scheduler_config.scheduler_cls)


@pytest.mark.parametrize("entry", ["additional_config", "offline", "serve"])
def test_one_switch_selects_mepic_on_every_generation(gpu, entry, head128_model):
    from vllm.config import CUDAGraphMode
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from ascend_mepic.offline import mepic_llm_kwargs
    from ascend_mepic.worker.cuda_attention import MepicCudaAttentionBackend

    if entry == "additional_config":  # vllm serve MODEL --additional-config '{"mepic": {}}'
        config = engine_config(head128_model, additional_config={"mepic": {}})
    elif entry == "offline":  # LLM(model, **mepic_llm_kwargs())
        config = engine_config(head128_model, **mepic_llm_kwargs(policy="mepic"))
    else:
        config = serve_config(head128_model)
    assert config.parallel_config.worker_cls == GPU_WORKER_CLS
    assert config.scheduler_config.scheduler_cls == SCHEDULER_CLS
    assert config.scheduler_config.async_scheduling is False
    assert config.use_v2_model_runner is False
    assert config.attention_config.backend == AttentionBackendEnum.CUSTOM
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    assert config.cache_config.enable_prefix_caching
    assert selected_backend(config) is MepicCudaAttentionBackend


def test_worker_constructor_on_the_config_a_worker_receives(tiny_model):
    """The real ``Worker.__init__`` plus MEPIC's checks and registrations; the next step,
    ``init_device``, binds a GPU and is where this machine stops."""
    from ascend_mepic.worker.cuda_attention import MepicCudaAttentionBackend
    from ascend_mepic.worker.gpu_worker import MepicGPUWorker

    config = engine_config(tiny_model, additional_config={"mepic": {}})
    worker = build_worker(config)
    assert type(worker) is MepicGPUWorker
    assert worker.use_v2_model_runner is False
    assert selected_backend(worker.vllm_config) is MepicCudaAttentionBackend


def test_eager_mode_keeps_cuda_graphs_off(tiny_model):
    from vllm.config import CUDAGraphMode

    config = engine_config(tiny_model, enforce_eager=True, additional_config={"mepic": {}})
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE


@pytest.mark.parametrize("backend", ["FLASHINFER", "FLASH_ATTN", "TRITON_ATTN"])
def test_another_attention_backend_fails_at_config_time(tiny_model, backend):
    with pytest.raises(ValueError, match=f"--attention-backend {backend} cannot read"):
        engine_config(tiny_model, attention_backend=backend, additional_config={"mepic": {}})


def test_head_size_the_kernels_do_not_take_fails_at_config_time(head48_model):
    with pytest.raises(ValueError, match="head size 48.*head_size not supported"):
        engine_config(head48_model, additional_config={"mepic": {}})


def test_quantized_kv_cache_fails_at_config_time(tiny_model):
    with pytest.raises(ValueError, match="kv_cache_dtype not supported"):
        engine_config(tiny_model, kv_cache_dtype="fp8", additional_config={"mepic": {}})


def test_pre_ampere_gpu_fails_at_config_time(tiny_model):
    set_capability((7, 5))
    try:
        with pytest.raises(ValueError, match="7.5.*compute capability not supported"):
            engine_config(tiny_model, dtype="float16", additional_config={"mepic": {}})
    finally:
        set_capability((9, 0))


def test_v2_runner_asked_for_fails_at_config_time(monkeypatch, tiny_model):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(ValueError, match="VLLM_USE_V2_MODEL_RUNNER=1 asks for the V2"):
        engine_config(tiny_model, additional_config={"mepic": {}})


def test_worker_refuses_a_config_built_without_mepics_switch(monkeypatch, tiny_model):
    """``--worker-cls`` set by hand without MEPIC's key: vLLM's CUDA defaults stay, and the
    worker says which setting to change, in its constructor (before the GPU is touched)."""
    from ascend_mepic.vllm_integration.engine_config import MepicStartupError

    config = engine_config(tiny_model, worker_cls=GPU_WORKER_CLS)
    with pytest.raises(MepicStartupError, match="set VLLM_USE_V2_MODEL_RUNNER=0"):
        build_worker(config)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    config = engine_config(tiny_model, worker_cls=GPU_WORKER_CLS, async_scheduling=False)
    with pytest.raises(MepicStartupError, match="CUSTOM backend"):
        build_worker(config)


def test_unsupported_model_fails_at_config_time(tmp_path, tiny_model):
    """MEPIC's model check runs in the configuration hook, before any process starts."""
    import json
    import shutil

    model = tmp_path / "sliding"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "config.json").read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=64)
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="sliding-window"):
        engine_config(str(model), additional_config={"mepic": {}})


def test_kernels_dtypes_are_the_platforms(tiny_model):
    """bf16, fp16 and fp32 models all select MEPIC's backend on SM90."""
    from ascend_mepic.worker.cuda_attention import MepicCudaAttentionBackend

    for dtype in ("bfloat16", "float16", "float32"):
        config = engine_config(tiny_model, dtype=dtype, additional_config={"mepic": {}})
        assert config.model_config.dtype == getattr(torch, dtype)
        assert selected_backend(config) is MepicCudaAttentionBackend
