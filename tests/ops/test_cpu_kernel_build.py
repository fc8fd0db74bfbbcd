"""The native CPU kernel is compiled at set-up only; the serving path loads it or falls back.

Before, the first attention forward built it through torch's extension loader: engines waited
on its build lock, forever when a killed build had left the lock behind. Each check runs in a
fresh process with its own ``ASCEND_MEPIC_EXT_DIR`` (the kernel loads once per process).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ascend_mepic.ops import cpu_kernel

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import json, time, torch
from ascend_mepic.ops import cpu_kernel, select_impl
start = time.perf_counter()
ok = cpu_kernel.load()
print(json.dumps({"ok": ok, "seconds": time.perf_counter() - start,
                  "impl": select_impl(torch.device("cpu"))}))
"""


def _run(code: str, ext_dir: Path, timeout: int = 120) -> tuple[dict, str]:
    env = dict(os.environ, ASCEND_MEPIC_EXT_DIR=str(ext_dir))
    env.pop("ASCEND_MEPIC_ATTN_IMPL", None)
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def _folder_in(ext_dir: Path) -> Path:
    return ext_dir / cpu_kernel.build_dir().name


@pytest.fixture
def built_copy(tmp_path) -> Path:
    """A copy of this environment's build in a private extension folder."""
    library, why = cpu_kernel.prebuilt()
    if library is None:
        pytest.skip(f"the kernel is not built here ({why}); make setup builds it")
    shutil.copytree(library.parent, _folder_in(tmp_path), symlinks=True)
    return tmp_path


def test_without_a_build_the_serving_path_falls_back_at_once(tmp_path):
    folder = _folder_in(tmp_path)
    folder.mkdir(parents=True)
    (folder / "lock").write_text("")  # what a killed torch build leaves: it used to hang here
    got, log = _run(PROBE, tmp_path)
    assert got == {"ok": False, "seconds": got["seconds"], "impl": "reference"}
    assert got["seconds"] < 5, got
    assert (
        "not built for this environment" in log and "python -m ascend_mepic.ops.cpu_kernel" in log
    )
    assert not list(folder.glob("*.so"))  # nothing was compiled


def test_a_stale_torch_lock_does_not_stop_loading_a_build(built_copy):
    (_folder_in(built_copy) / "lock").write_text("")
    got, _ = _run(PROBE, built_copy)
    assert got["ok"] and got["impl"] == "cpu" and got["seconds"] < 5, got


def test_a_build_of_another_source_is_not_loaded(built_copy):
    stamp = _folder_in(built_copy) / cpu_kernel.STAMP
    data = json.loads(stamp.read_text())
    stamp.write_text(json.dumps({**data, "source_sha256": "0" * 64}))
    got, log = _run(PROBE, built_copy)
    assert not got["ok"] and got["impl"] == "reference" and "stale" in log


def test_build_clears_a_lock_left_by_a_killed_build(built_copy, monkeypatch, caplog):
    """What a killed build leaves (torch's lock file, the objects folder, a partial library) is
    cleared, and the build completes and stamps. The compiler is not what is under test here (the
    set-up build, the guard build and the AMX emulation build run it): ``_compile`` copies this
    environment's own libraries into the partial outputs, and raises on anything else."""
    real_dir = cpu_kernel.build_dir()
    folder = _folder_in(built_copy)
    (folder / "lock").write_text("")
    (folder / cpu_kernel.STAMP).unlink()
    stale_objs = folder / f".{cpu_kernel.EXT_NAME}_avx2.so.1.tmp.objs"
    stale_objs.mkdir()
    (stale_objs / "unit.o").write_text("")
    stale_partial = folder / f"{cpu_kernel.EXT_NAME}_avx2.so.1.tmp"
    stale_partial.write_text("")
    compiled = []

    def copy_library(targets, verbose=False):
        for variant, output, defines in targets:
            assert defines == () and output.name.endswith(f".so.{os.getpid()}.tmp"), output
            shutil.copyfile(real_dir / f"{cpu_kernel.EXT_NAME}_{variant}.so", output)
            compiled.append(variant)
        return {}

    monkeypatch.setenv("ASCEND_MEPIC_EXT_DIR", str(built_copy))
    monkeypatch.setattr(cpu_kernel, "_compile", copy_library)
    with caplog.at_level("WARNING", logger=cpu_kernel.logger.name):
        library = cpu_kernel.build()
    assert "left by an interrupted build" in caplog.text
    assert library.parent == folder and not (folder / "lock").exists()
    assert sorted(compiled) == sorted(cpu_kernel.VARIANTS)
    assert not stale_objs.exists() and not stale_partial.exists()
    assert not list(folder.glob("*.tmp"))
    assert cpu_kernel.prebuilt()[0] == library  # stamped for these sources


def test_each_environment_gets_its_own_build_folder(monkeypatch):
    here = cpu_kernel.build_dir()
    monkeypatch.setattr(sys, "prefix", "/elsewhere/.venv-ascend")
    assert cpu_kernel.build_dir() != here
    assert cpu_kernel.build_dir().parent == here.parent


AVX512 = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"})


def test_the_best_variant_the_cpu_runs_is_chosen(monkeypatch):
    monkeypatch.delenv(cpu_kernel.ISA_ENV, raising=False)
    assert cpu_kernel.choose_variant(AVX512 | {"amx_bf16"})[0] == "avx512"
    assert cpu_kernel.choose_variant(frozenset({"avx2", "fma", "f16c"}))[0] == "avx2"
    variant, why = cpu_kernel.choose_variant(frozenset({"sse4_2"}))
    assert variant is None and "none of the kernel's instruction sets" in why
    # AVX-512F without BW/VL (Knights Landing) gets the AVX2 library
    assert cpu_kernel.choose_variant(frozenset({"avx2", "fma", "f16c", "avx512f"}))[0] == "avx2"


def test_a_forced_variant_must_run_here(monkeypatch):
    monkeypatch.setenv(cpu_kernel.ISA_ENV, "avx512")
    variant, why = cpu_kernel.choose_variant(frozenset({"avx2", "fma", "f16c"}))
    assert variant is None and "lacks" in why and "avx512f" in why
    monkeypatch.setenv(cpu_kernel.ISA_ENV, "sse")
    assert cpu_kernel.choose_variant(AVX512)[0] is None


def test_no_build_depends_on_the_build_machine():
    flags = [f for variant in cpu_kernel.VARIANTS.values() for f in variant[0]]
    assert not any(f.startswith(("-march", "-mtune=native")) for f in flags), flags


CHECK_AVX2 = """
import json, torch
from ascend_mepic.ops import cpu_kernel
from tests.ops.oracle import dense_oracle, random_batch
worst = 0.0
for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
    for decode in (False, True):
        b = random_batch(3, 24, 8, 2, head=64, dtype=dtype, decode=decode)
        out = cpu_kernel.rope_paged_attention_cpu(b.query, b.kv_cache, b.meta, b.rope, b.scale)
        want = dense_oracle(b.query, b.kv_cache, b.meta, b.base, b.rope.is_neox_style, b.scale)
        err = (out.double() - want).abs().max().item()
        assert err <= tol * (1 + want.abs().max().item()), (dtype, decode, err)
print(json.dumps({"isa": cpu_kernel.isa()}))
"""


def test_the_avx2_library_matches_the_oracle():
    """The AVX2 library is built everywhere; on an AVX-512 machine it is loaded by force."""
    library, why = cpu_kernel.prebuilt()
    if library is None:
        pytest.skip(f"the kernel is not built here ({why})")
    if not cpu_kernel.VARIANTS["avx2"][1] <= cpu_kernel.cpu_flags():
        pytest.skip("this CPU cannot run the AVX2 library")
    env = dict(os.environ, **{cpu_kernel.ISA_ENV: "avx2"})
    done = subprocess.run(
        [sys.executable, "-c", CHECK_AVX2], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"isa": "avx2"}
