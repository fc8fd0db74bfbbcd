"""vllm-ascend's real start-up path with MEPIC switched on by its one switch.

UNTESTED ON HARDWARE: runs vllm-ascend 0.30.0rc2's Python on x86 with torch_npu stubbed
(conftest.py). What runs for real here: vLLM's ``EngineArgs.create_engine_config`` with a real
``ModelConfig`` of a tiny local Llama, which calls ``NPUPlatform.check_and_update_config`` and
vllm-ascend's ``init_ascend_config``; the config is then pickled and validated again the way the
engine-core process (vllm-ascend's ``run_engine_core`` patch) and ``NPUWorker.__init__`` do.
"""

from __future__ import annotations

import pickle

import pytest


def _engine_config(model: str, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    from ascend_mepic.plugin import register

    register()  # what vLLM's plugin loader does in every process (idempotent)
    args = EngineArgs(model=model, dtype="float32", max_model_len=512, **kwargs)
    return args.create_engine_config()


def test_additional_config_mepic_key_starts_on_vllm_ascend(tiny_model):
    from vllm.config import CUDAGraphMode
    from vllm_ascend.ascend_config import init_ascend_config

    from ascend_mepic.vllm_integration.class_names import NPU_WORKER_CLS, SCHEDULER_CLS

    config = _engine_config(
        tiny_model, enable_prefix_caching=True, additional_config={"mepic": {"policy": "mepic"}}
    )
    assert config.parallel_config.worker_cls == NPU_WORKER_CLS
    assert config.scheduler_config.scheduler_cls == SCHEDULER_CLS
    assert config.model_config.enforce_eager
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    assert config.scheduler_config.async_scheduling is False
    assert config.additional_config["mepic"] == {"policy": "mepic"}
    # The engine-core process and every NPU worker get the config pickled and validate it again.
    again = pickle.loads(pickle.dumps(config))
    assert again.additional_config["mepic"] == {"policy": "mepic"}
    init_ascend_config(again)


def test_offline_kwargs_start_on_vllm_ascend(tiny_model):
    from ascend_mepic.offline import NPU_WORKER_CLS, mepic_llm_kwargs

    config = _engine_config(tiny_model, **mepic_llm_kwargs(policy="epic-16"))
    assert config.parallel_config.worker_cls == NPU_WORKER_CLS
    assert config.scheduler_config.async_scheduling is False
    assert config.additional_config["mepic"]["policy"] == "epic-16"


def test_vllm_ascend_still_rejects_its_own_unknown_keys(tiny_model):
    with pytest.raises(Exception, match="not_an_ascend_option"):
        _engine_config(tiny_model, additional_config={"mepic": {}, "not_an_ascend_option": 1})


def test_without_mepic_key_nothing_changes(tiny_model):
    config = _engine_config(tiny_model)
    assert "ascend_mepic" not in str(config.parallel_config.worker_cls)
    assert config.scheduler_config.scheduler_cls != "ascend_mepic.core.scheduler.MepicScheduler"


def test_ascend_mepic_serve_arguments_start_on_vllm_ascend(tiny_model):
    """``ascend-mepic serve MODEL``: vLLM's own server parser, MEPIC's defaults, then the
    engine config the server builds from them."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from ascend_mepic.config import STATS_FILE_ENV
    from ascend_mepic.entrypoints.server.launch import apply_mepic_defaults
    from ascend_mepic.vllm_integration.class_names import NPU_WORKER_CLS, SCHEDULER_CLS

    parser = make_arg_parser(FlexibleArgumentParser())
    args = parser.parse_args([tiny_model, "--dtype", "float32", "--max-model-len", "512"])
    args.model = args.model_tag
    environ: dict[str, str] = {}
    temp = apply_mepic_defaults(args, is_cpu=False, environ=environ)
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert config.parallel_config.worker_cls == NPU_WORKER_CLS
    assert config.scheduler_config.scheduler_cls == SCHEDULER_CLS
    assert config.scheduler_config.async_scheduling is False
    assert config.model_config.enforce_eager
    assert environ[STATS_FILE_ENV].startswith(temp)  # not in additional_config (vLLM's hash)


def test_block_table_split_is_refused_under_vllm_ascends_attribute_name():
    """vllm-ascend's BlockTable calls the kernel-block split ``blocks_per_phys_block`` (vLLM's
    ``blocks_per_kv_block``); MEPIC's check must read the name the real class sets."""
    import inspect
    from types import SimpleNamespace

    from vllm_ascend.worker.block_table import BlockTable

    from ascend_mepic.core.plan import StepPlanError
    from ascend_mepic.vllm_integration.runner_internals import check_block_table

    source = inspect.getsource(BlockTable.__init__)
    assert "self.blocks_per_phys_block =" in source and "blocks_per_kv_block" not in source
    check_block_table(SimpleNamespace(blocks_per_phys_block=1, block_size=128), 128)
    with pytest.raises(StepPlanError, match="2 per block"):
        check_block_table(SimpleNamespace(blocks_per_phys_block=2, block_size=128), 128)


@pytest.mark.parametrize("layout", ["HND", "LBHNC"])
def test_head_major_kv_layout_is_refused_before_allocation(monkeypatch, layout):
    """vllm-ascend's head-major layouts have the default layout's strides, so MEPIC refuses
    them by name when the KV shape is asked for, before anything is allocated."""
    from vllm_ascend.attention.attention_v1 import AscendAttentionBackend

    from ascend_mepic.vllm_integration.ascend import UnsupportedAscendLayout
    from ascend_mepic.worker.npu_attention import MepicAscendAttentionBackend

    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", layout)
    assert AscendAttentionBackend.get_kv_cache_shape(4, 128, 2, 64) == (2, 4, 2, 128, 64)
    with pytest.raises(UnsupportedAscendLayout, match=layout):
        MepicAscendAttentionBackend.get_kv_cache_shape(4, 128, 2, 64)
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT")
    assert MepicAscendAttentionBackend.get_kv_cache_shape(4, 128, 2, 64) == (2, 4, 128, 2, 64)


def _statements(function) -> list[str]:
    """A function body's statements as source lines, comments and blank lines dropped."""
    import ast
    import inspect
    import textwrap

    body = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0].body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # docstring
    return [ast.unparse(node) for node in body]


def test_mepic_init_device_follows_vllm_ascends():
    """MEPIC restates ``NPUWorker.init_device`` (vllm-ascend builds its runner inline): both
    bodies, statement for statement, with only the runner class and the V2 refusal differing.
    A vllm-ascend release that changes its method fails here until MEPIC's follows."""
    from vllm_ascend.worker.worker import NPUWorker

    from ascend_mepic.worker.npu_worker import MepicNPUWorker

    upstream = "\n".join(_statements(NPUWorker.init_device))
    ours = "\n".join(_statements(MepicNPUWorker.init_device))
    v1_branch = "self.model_runner = NPUModelRunner(self.vllm_config, self.device)"
    assert v1_branch in upstream
    expected = upstream.replace("num_ubatches = 1\n", "").replace(
        "init_workspace_manager(self.device, num_ubatches)",
        "init_workspace_manager(self.device, 1)",
    )
    # upstream: if use_v2: <V2 runner> else: <V1 runner>; ours: refuse V2 first, then V1.
    start = expected.index("if self.use_v2_model_runner:")
    end = expected.index(v1_branch) + len(v1_branch)
    expected = (
        expected[:start]
        + v1_branch.replace("NPUModelRunner", "MepicNPUModelRunner")
        + expected[end:]
    )
    ours_without_refusal = ours[ours.index("self.device = self._init_device()") :]
    assert ours_without_refusal == expected
