#!/usr/bin/env python3
"""Extract the op schemas of the ops the torch_npu double implements from the real torch_npu wheel.

The double (``tests/ops/npu_double.py``) must accept exactly the calls the real ops accept, so
``tests/ops/test_npu_double.py`` checks its signatures against the schema strings torch_npu
registers with torch (``m.def("npu_rotary_mul(Tensor input, ...) -> Tensor")``), which are stored
as plain text in the wheel's shared libraries. This script:

1. downloads the wheel vllm-ascend 0.30.0rc2 pins, torch-npu 2.10.0.post4 for CPython 3.11 on
   x86_64 manylinux_2_28 (``pip download --no-deps --only-binary :all:``; torch-npu is kept out
   of ``requirements/ascend.lock``, see ``requirements/ascend-excludes.txt``, so its hash is pinned
   here), into a temporary folder unless ``--wheel`` names a local copy;
2. checks its sha256 against ``WHEEL_SHA256``;
3. scans every ``.so`` in it for printable strings ``<op>(<args>) -> <returns>`` for each op in
   ``tests.ops.npu_double.OPS`` (exactly one distinct schema per op, or it fails);
4. writes them, sorted, one per line, under a header naming the wheel and its hash, to
   ``tests/ops/torch_npu_schemas.txt`` (``--check``: compare instead, exit 1 on a difference).

Usage: ``.venv/bin/python scripts/torch_npu_schemas.py [--wheel PATH] [--check]``.
Needs pip and network access to the package index (about 40 MB); nothing else beyond the stdlib
and the double's op list.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "ops" / "torch_npu_schemas.txt"
REQUIREMENT = "torch-npu==2.10.0.post4"
WHEEL = "torch_npu-2.10.0.post4-cp311-cp311-manylinux_2_28_x86_64.whl"
# From PyPI's JSON for torch-npu (releases["2.10.0.post4"], this file's digests.sha256), read
# 2026-11-27; the downloaded file matched it.
WHEEL_SHA256 = "7d88428d9bb8473919a38947617fcc481cb6e28927a8aa30e486a9bc42f30d90"
PRINTABLE = re.compile(rb"[\x20-\x7e]{8,}")


def op_names() -> tuple[str, ...]:
    sys.path.insert(0, str(ROOT))
    from tests.ops.npu_double import OPS

    return OPS


def download(folder: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
         "--python-version", "3.11", "--platform", "manylinux_2_28_x86_64",
         "--implementation", "cp", "-d", str(folder), REQUIREMENT],
        check=True,
    )  # fmt: skip
    return folder / WHEEL


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def schemas(wheel: Path, ops: tuple[str, ...]) -> dict[str, str]:
    """One schema string per op, from the strings of every shared library in the wheel."""
    pattern = re.compile(rb"^(%s)\(.*\) -> .+$" % b"|".join(re.escape(o.encode()) for o in ops))
    found: dict[str, set[str]] = {op: set() for op in ops}
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            if not re.search(r"\.so(\.|$)", info.filename):
                continue
            for text in PRINTABLE.findall(zf.read(info)):
                match = pattern.match(text)
                if match:
                    found[match.group(1).decode()].add(text.decode())
    problems = {op: sorted(s) for op, s in found.items() if len(s) != 1}
    if problems:
        raise SystemExit(f"torch_npu_schemas: expected one schema per op, found {problems}")
    return {op: s.pop() for op, s in found.items()}


def render(found: dict[str, str], digest: str) -> str:
    header = (
        f"# Op schemas of the ops tests/ops/npu_double.py implements, from {WHEEL}\n"
        f"# (sha256 {digest}), read from its shared libraries by scripts/torch_npu_schemas.py.\n"
        "# Generated: do not edit; regenerate with that script.\n"
    )
    return header + "".join(f"{schema}\n" for schema in sorted(found.values()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", type=Path, help="a local copy of the wheel (else downloaded)")
    parser.add_argument("--check", action="store_true", help=f"compare with {OUT.name} only")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="torch_npu_wheel_") as tmp:
        wheel = args.wheel or download(Path(tmp))
        digest = sha256(wheel)
        if digest != WHEEL_SHA256:
            raise SystemExit(f"torch_npu_schemas: {wheel} has sha256 {digest}, not {WHEEL_SHA256}")
        text = render(schemas(wheel, op_names()), digest)
    if args.check:
        same = OUT.exists() and OUT.read_text() == text
        print(f"torch_npu_schemas: {OUT.relative_to(ROOT)} {'matches' if same else 'DIFFERS'}")
        return 0 if same else 1
    OUT.write_text(text)
    print(f"torch_npu_schemas: wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
