"""MEPIC's CUDA start-up on vLLM's CUDA platform code, on a machine without a GPU.

UNTESTED ON A GPU. These tests need vLLM's current platform to be the CUDA platform double
(``cuda_double.py``) from before vLLM first resolves it, so they run in their own process:
``tests/test_cuda_startup.py`` (part of ``make test``) starts
``ASCEND_MEPIC_CUDA_DOUBLE=1 pytest tests/cuda``; in any other pytest process this folder is not
collected (its tests would otherwise run on the CPU platform).
"""

from __future__ import annotations

import os

import pytest

DOUBLE_ENV = "ASCEND_MEPIC_CUDA_DOUBLE"
V2_ENV = "VLLM_USE_V2_MODEL_RUNNER"

if os.environ.get(DOUBLE_ENV) == "1":
    from tests.cuda.cuda_double import install

    install((9, 0))
else:
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(autouse=True)
def v2_runner_variable_unset():
    """MEPIC's configuration hook sets ``VLLM_USE_V2_MODEL_RUNNER=0`` in the process that builds
    the config (engine processes inherit it); each test starts, and ends, without it."""
    saved = os.environ.pop(V2_ENV, None)
    yield
    os.environ.pop(V2_ENV, None)
    if saved is not None:
        os.environ[V2_ENV] = saved


def _tiny(tmp_path_factory, head_dim: int) -> str:
    from ascend_mepic.eval.prepare import prepare_tiny_llama

    if head_dim == 32:
        return str(prepare_tiny_llama())
    return str(prepare_tiny_llama(tmp_path_factory.mktemp("models") / "tiny", head_dim=head_dim))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A tiny local Llama, head size 32."""
    return _tiny(tmp_path_factory, 32)


@pytest.fixture(scope="session")
def head128_model(tmp_path_factory) -> str:
    """A tiny local Llama at the 7B models' head size."""
    return _tiny(tmp_path_factory, 128)


@pytest.fixture(scope="session")
def head48_model(tmp_path_factory) -> str:
    """A tiny local Llama with a head size MEPIC's CUDA kernels do not take."""
    return _tiny(tmp_path_factory, 48)
