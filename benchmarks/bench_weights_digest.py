"""First-start cost of MEPIC's weight identity: v1 (one SHA-256 stream) against v2 (BLAKE3).

Side by side in one run, on a folder of weight files (``--gib`` GiB of random bytes in
``--files`` safetensors files, written once to ``--dir``): the time ``core.identity`` takes to
digest them on a server's first start, with the old scheme (one SHA-256 stream over names,
sizes and contents in 1 MiB reads, reimplemented here as it was) and the new (each file
memory-mapped and hashed by BLAKE3 on every core, files concurrently). Both read the same
files with the page cache warm (a first pass reads them in), best of ``--repeats``; with
``--cold`` (root only) the page cache is dropped before each pass instead, as on a server's
first start after a reboot. Prints the times and the ratio; asserts nothing about time.

    .venv/bin/python benchmarks/bench_weights_digest.py --gib 4 --files 4 [--cold]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import sys
import time
from pathlib import Path

from ascend_mepic.core import identity
from ascend_mepic.entrypoints.streams import print_data_only


def v1_digest(files: list[tuple[str, Path]]) -> str:
    """The v1 scheme (before issue 50): one SHA-256 stream, 1 MiB reads."""
    h = hashlib.sha256(b"mepic-weights-v1")
    for name, path in files:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            h.update(struct.pack("<QQ", len(name.encode()), size))
            h.update(name.encode())
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def make_weights(root: Path, gib: float, files: int) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    size = int(gib * (1 << 30)) // files
    block = os.urandom(1 << 24)
    for i in range(files):
        path = root / f"model-{i:05d}-of-{files:05d}.safetensors"
        if path.is_file() and path.stat().st_size == size:
            continue
        with open(path, "wb") as f:
            left = size
            while left:
                f.write(block[: min(left, len(block))])
                left -= min(left, len(block))


def drop_page_cache() -> None:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as e:
        raise SystemExit(f"--cold needs root to drop the page cache: {e}") from None


def best_of(fn, repeats: int, cold: bool) -> float:
    times = []
    for _ in range(repeats):
        if cold:
            drop_page_cache()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="/tmp/ascend-mepic-weights-bench")
    p.add_argument("--gib", type=float, default=4.0)
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--cold", action="store_true", help="drop the page cache before each pass")
    args = p.parse_args()
    out = print_data_only()
    root = Path(args.dir)
    make_weights(root, args.gib, args.files)
    files = identity._weight_files(root.resolve())
    print(f"[bench] {len(files)} files, {sum(p.stat().st_size for _, p in files) / 2**30:.2f} GiB "
          f"in {root}; warming the page cache", file=sys.stderr)  # fmt: skip
    v1_digest(files)
    v1 = best_of(lambda: v1_digest(files), args.repeats, args.cold)
    v2 = best_of(lambda: identity._hash_weight_files(files), args.repeats, args.cold)
    gib = sum(p.stat().st_size for _, p in files) / 2**30
    report = {
        "gib": round(gib, 3),
        "files": len(files),
        "cpus": os.cpu_count(),
        "page_cache": "cold" if args.cold else "warm",
        "v1_sha256_s": round(v1, 3),
        "v2_blake3_s": round(v2, 3),
        "v1_gib_s": round(gib / v1, 2),
        "v2_gib_s": round(gib / v2, 2),
        "v1_over_v2": round(v1 / v2, 2),
    }
    out.write(json.dumps(report) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
