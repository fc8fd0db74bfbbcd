"""scripts/gpu_carry.py on tiny files, offline: the parts split and join back by sha256, receive
is idempotent and refuses a corrupt piece, install refuses while a part is missing or a file is
corrupt (naming the parts to send again), the slimmed wheel drops what it says and stays a
valid zip, the lock's lines parse, and import failures are classified. The real carry (vLLM's
wheel, the rehearsal in a clean Python 3.12) is `scripts/gpu_carry.sh rehearse`."""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def carry():
    spec = importlib.util.spec_from_file_location("gpu_carry", REPO / "scripts" / "gpu_carry.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_carry"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("gpu_carry", None)


def _files(tmp_path: Path, sizes: dict[str, int]) -> list[dict]:
    out = []
    for i, (name, size) in enumerate(sizes.items()):
        data = bytes((i * 7 + j) % 251 for j in range(size))
        path = tmp_path / "src" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        out.append(
            {
                "name": name,
                "path": str(path),
                "size": size,
                "role": "carry",
                "dist": name.split("-")[0],
                "version": "1",
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        )
    return out


def test_split_cuts_the_stream_into_the_fewest_parts(carry):
    parts = carry.split_into_parts([("a.whl", 70), ("b.whl", 20), ("c.whl", 5)], 40)
    assert [[(p["piece"], p["size"]) for p in part] for part in parts] == [
        [("a.whl.000", 40)],
        [("a.whl.001", 30), ("b.whl.000", 10)],
        [("b.whl.001", 10), ("c.whl", 5)],
    ]


@pytest.fixture
def parts(carry, tmp_path):
    files = _files(tmp_path, {"big-1.whl": 70_000, "mid-1.whl": 30_000, "small-1.whl": 3_000})
    manifest = carry.build_parts(files, tmp_path / "out", limit=48 * 1024, room=8 * 1024)
    return files, manifest, tmp_path / "out", tmp_path / "store"


def _install(carry, store: Path):
    carry.cmd_install(argparse.Namespace(store=store, force=False, checkout=str(REPO)))


def test_parts_fit_and_join_back(carry, parts, capsys):
    files, manifest, out, store = parts
    names = sorted(manifest["parts"], key=carry._parts_order)
    assert names == ["part1", "part2", "part3"]
    for name in names:
        assert sum(p.stat().st_size for p in (out / name).iterdir()) <= 48 * 1024
    with pytest.raises(SystemExit) as refused:  # nothing received yet
        _install(carry, store)
    assert refused.value.code == 2
    carry.cmd_receive(
        argparse.Namespace(parts=[str(out / "part1"), str(out / "part3")], store=store)
    )
    assert "missing part2" in capsys.readouterr().out
    with pytest.raises(SystemExit) as refused:
        _install(carry, store)
    assert refused.value.code == 2
    assert "send again: part2" in capsys.readouterr().out
    # part2 arrives; receiving every part again is harmless
    carry.cmd_receive(argparse.Namespace(parts=[str(out / n) for n in names], store=store))
    assert "missing none" in capsys.readouterr().out
    for f in files:
        joined = store / "files" / f["name"]
        assert hashlib.sha256(joined.read_bytes()).hexdigest() == f["sha256"]
    assert not list((store / "pieces").iterdir())


def test_receive_refuses_a_corrupt_piece(carry, parts):
    _, manifest, out, store = parts
    piece = out / "part2" / manifest["parts"]["part2"][0]["piece"]
    data = bytearray(piece.read_bytes())
    data[10] ^= 1
    piece.write_bytes(bytes(data))
    with pytest.raises(SystemExit) as refused:
        carry.cmd_receive(argparse.Namespace(parts=[str(out / "part2")], store=store))
    assert refused.value.code == 3


def test_install_refuses_a_corrupted_file_and_names_its_parts(carry, parts, capsys):
    _, manifest, out, store = parts
    carry.cmd_receive(
        argparse.Namespace(parts=[str(out / n) for n in manifest["parts"]], store=store)
    )
    target = store / "files" / "big-1.whl"
    target.write_bytes(b"x" + target.read_bytes()[1:])
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        _install(carry, store)
    assert refused.value.code == 2
    said = capsys.readouterr().out
    assert "corrupt (removed): big-1.whl" in said and "send again: part1 part2" in said
    assert not target.exists()


def test_a_new_carry_replaces_the_old_one_in_the_store(carry, parts, tmp_path):
    files, manifest, out, store = parts
    carry.cmd_receive(argparse.Namespace(parts=[str(out / "part1")], store=store))
    other = carry.build_parts(
        _files(tmp_path / "other", {"z-1.whl": 100}),
        tmp_path / "o2",
        limit=48 * 1024,
        room=8 * 1024,
    )
    assert other["carry_id"] != manifest["carry_id"]
    carry.cmd_receive(argparse.Namespace(parts=[str(tmp_path / "o2" / "part1")], store=store))
    assert sorted(p.name for p in (store / "files").iterdir()) == ["z-1.whl"]
    assert json.loads((store / "manifest.json").read_text())["carry_id"] == other["carry_id"]


def test_slim_wheel_drops_members_and_their_record_lines(carry, tmp_path):
    src = tmp_path / "vllm-0.30.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    members = {
        "vllm/__init__.py": b"x = 1\n" * 50,
        "vllm/vllm-rs": b"\x7fELF" + b"\0" * 300,
        "vllm/third_party/pynvml.py": b"# kept\n",
        "vllm/third_party/deep_gemm/__init__.py": b"# dropped\n",
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": b"\0" * 999,
        "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": b"\1" * 999,
    }
    record = "".join(f"{name},sha256=x,{len(data)}\n" for name, data in members.items())
    with zipfile.ZipFile(src, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
        z.writestr("vllm-0.30.0.dist-info/RECORD", record + "vllm-0.30.0.dist-info/RECORD,,\n")
    dest = tmp_path / "slim.whl"
    dropped, _ = carry.slim_wheel(src, dest)
    assert dropped == 3
    with zipfile.ZipFile(dest) as z:
        assert z.testzip() is None
        kept = set(z.namelist())
        assert kept == {
            "vllm/__init__.py",
            "vllm/third_party/pynvml.py",
            "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",
            "vllm-0.30.0.dist-info/RECORD",
        }
        assert z.read("vllm/__init__.py") == members["vllm/__init__.py"]
        lines = z.read("vllm-0.30.0.dist-info/RECORD").decode().splitlines()
        assert {line.split(",")[0] for line in lines} == kept


def test_lock_lines_parse(carry, tmp_path):
    h = "ab" * 32
    lock = tmp_path / "lock.txt"
    lock.write_text(
        "# comment\n# image-packages: numpy torch\n"
        f"vllm==0.30.0 --hash=sha256:{h}  # vllm vllm-0.30.0-cp38-abi3-manylinux_2_28_x86_64.whl\n"
        f"aiohttp==3.14.5 --hash=sha256:{h}  # fallback aiohttp-3.14.5-cp312-cp312-x.whl "
        ">=3.13.3\n"
    )
    entries = carry.read_lock(lock)
    assert [(e.name, e.role, e.spec) for e in entries] == [
        ("vllm", "vllm", ""),
        ("aiohttp", "fallback", ">=3.13.3"),
    ]
    assert entries[1].line().startswith("aiohttp==3.14.5 --hash=sha256:")
    assert carry.lock_image_packages(lock) == ["numpy", "torch"]


def test_import_failures_are_classified(carry):
    reqs = {"pydantic", "pyzmq"}
    providers = {"zmq": ["pyzmq"], "transformers": ["transformers"]}

    def c(**kw):
        return carry.classify(
            {"module": "vllm.x", "ok": False, "message": "", **kw}, reqs, providers
        )

    assert c(type="ModuleNotFoundError", missing="pydantic") == "MISSING"
    assert c(type="ModuleNotFoundError", missing="zmq.asyncio") == "MISSING"
    assert c(type="ModuleNotFoundError", missing="cutlass.cute") == "dropped"
    assert c(type="ModuleNotFoundError", missing="ray") == "optional"
    assert c(type="ModuleNotFoundError", missing="vllm.third_party.deep_gemm") == "slimmed"
    assert c(type="ModuleNotFoundError", missing="vllm._flashmla_C") == "slimmed"
    assert (
        c(
            type="ImportError",
            message="tilelang is required for mhc but is not installed. "
            "Install it with `pip install tilelang`.",
        )
        == "dropped"
    )
    assert c(type="ImportError", message="needs it: pip install pydantic") == "MISSING"
    assert c(type="ModuleNotFoundError", missing="transformers.models.x") == "VERSION"
    assert (
        c(
            type="ImportError",
            message="cannot import name 'Foo' from 'transformers' (/x/transformers/__init__.py)",
        )
        == "VERSION"
    )
    assert c(type="ImportError", message="libcuda.so.1: cannot open shared object file") == "cuda"
    assert c(type="RuntimeError", message="Found no NVIDIA driver on your system") == "cuda"
    assert c(type="ValueError", message="something else") == "OTHER"
