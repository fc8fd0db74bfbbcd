"""The import paths and commands the README shows keep working, and the version check refuses
any vLLM but the supported one."""

import subprocess
import sys

import pytest

from ascend_mepic.vllm_integration.version import (
    SUPPORTED_VLLM,
    UnsupportedVllmVersion,
    check_vllm_version,
)


def test_readme_offline_api_imports():
    from ascend_mepic.offline import Segment, generate_segments, mepic_llm_kwargs

    kwargs = mepic_llm_kwargs()
    assert kwargs["scheduler_cls"] == "ascend_mepic.core.scheduler.MepicScheduler"
    assert callable(generate_segments) and Segment.prompt([1]).token_ids == (1,)


def test_installed_vllm_is_the_supported_one():
    assert check_vllm_version().split("+")[0] == SUPPORTED_VLLM


@pytest.mark.parametrize("found", ["0.32.0", "0.29.1", "0.31.0+cpu"])
def test_other_vllm_versions_are_refused_with_the_supported_one_named(found, monkeypatch):
    monkeypatch.delenv("ASCEND_MEPIC_SKIP_VLLM_VERSION_CHECK", raising=False)
    with pytest.raises(UnsupportedVllmVersion, match=f"vLLM {SUPPORTED_VLLM} only"):
        check_vllm_version(found)
    assert check_vllm_version(f"{SUPPORTED_VLLM}+cpu") == f"{SUPPORTED_VLLM}+cpu"


def test_cli_and_cuda_fallback_are_installed():
    out = subprocess.run(
        [sys.executable, "-m", "ascend_mepic.entrypoints.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "serve" in out.stdout
    import cuda_fallback  # packaged by setup.py beside ascend_mepic

    assert cuda_fallback.__name__ == "cuda_fallback"


def test_a_wheel_packages_every_package(tmp_path):
    """A non-editable install keeps the Triton path and every subpackage."""
    import shutil
    import zipfile
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    src = tmp_path / "src"  # build a copy: setuptools writes build/ and egg-info in the tree
    src.mkdir()
    for name in ("setup.py", "README.md"):
        shutil.copy(root / name, src / name)
    for name in ("ascend_mepic", "cuda_fallback"):
        shutil.copytree(root / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + [str(src), "-w", str(tmp_path)],
        check=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("ascend_mepic-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for package in ("cuda_fallback", "ascend_mepic/core", "ascend_mepic/vllm_integration"):
        assert f"{package}/__init__.py" in names
    assert "cuda_fallback/rope_paged_attention.py" in names
