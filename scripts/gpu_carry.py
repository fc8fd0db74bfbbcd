#!/usr/bin/env python3
"""Carry vLLM 0.30.0's CUDA wheel and what it needs to a GPU machine without a package index.

The GPU test machine (docs/cuda.md, "Carrying vLLM to a GPU machine without a package index")
has Python 3.12, torch 2.11.0+cu130 and Triton 3.6.0 but no vLLM, reaches no package index and
takes at most 64 MiB of files per upload, the working tree included; uploads can be chained
while it stays up, and files under /tmp survive between them. So, here:

* ``lock`` resolves the carried set (vLLM's requirements, this project's, FlashInfer) against
  the image's packages and pins it with hashes in ``scripts/gpu_carry_requirements.txt``;
* ``prepare`` downloads the pinned wheels (cache: ``.gpu-carry/cache``), slims vLLM's wheel and
  packs everything into ``.gpu-carry/part1`` ... ``partN``, each at most 56 MiB, each with the
  manifest (every piece's and every file's sha256);
* ``rehearse`` runs the GPU side in a clean Python 3.12 with the image's torch, and imports vLLM,
  its engine, runner, backends, models and server, this project's CUDA modules and every
  ``vllm.*`` module, classifying each failure (a missing package fails the rehearsal; a missing
  CUDA driver is expected here);

and there, one device call per part:

* ``receive PART...`` copies parts into /tmp/mepic-carry, checking each piece by sha256, joins
  the split files (checked again) and says which parts are still missing (idempotent);
* ``install`` refuses while a part is missing or corrupt, else installs every wheel with
  ``pip --no-index --no-deps`` into /tmp/mepic-carry/site, writes this checkout's entry points
  (vLLM finds MEPIC's plugin through them) and /tmp/mepic-carry/env.sh;
* ``check`` imports the start path that ``rehearse`` imports (``--walk``: every vllm module),
  there with the GPU, and classifies each failure the same way.

``plan`` prints the device calls. Logs go to stderr, results to stdout. ``receive``,
``install``, ``check`` and ``plan`` use only the standard library and pip (the image's
``packaging`` where present).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "scripts" / "gpu_carry_requirements.txt"
CARRY_DIR = ROOT / ".gpu-carry"
CACHE = CARRY_DIR / "cache"
DEFAULT_STORE = Path(os.environ.get("MEPIC_CARRY_STORE", "/tmp/mepic-carry"))
REHEARSE_DIR = Path(os.environ.get("MEPIC_REHEARSE_DIR", "/tmp/mepic-rehearse"))
MIB = 1 << 20
# An upload takes 64 MiB, the working tree (about 4 MiB) included.
PART_LIMIT = 56 * MIB
UPLOAD_LIMIT = 64 * MIB
FORMAT = 1

VLLM_REQUIREMENT = "vllm==0.30.0"
# Carried beside vLLM's own requirements: FlashInfer for the ROPE_LLAMA reference row of
# benchmarks/ops (vLLM 0.30.0 requires the same version).
EXTRA_REQUIREMENTS = ("flashinfer-python==0.6.18.post1",)

# The GPU machine's image, as KINDS.md lists it (2026-11-17); versions where known.
IMAGE_PINS = {
    "torch": "2.11.0",
    "triton": "3.6.0",
    "torchvision": "0.26.0",
    "torchaudio": "2.11.0",
    "numpy": "2.5.2",
    "transformers": "5.17.0",
    "tokenizers": "0.23.2",
    "huggingface-hub": "1.33.0",
    "safetensors": "0.8.0",
    "sentencepiece": "0.2.2",
    "tiktoken": "0.14.0",
}
IMAGE_PACKAGES = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops
equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch
grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig
interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton
typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp
""".split()

# vLLM 0.30.0 requirements that are not carried: the image's own (vLLM pins other versions), or
# CUDA kernel packages that the dense-model path on an SM90 GPU never imports (each is imported
# inside a function, behind an availability check, or by model-specific modules only; the
# rehearsal's walk over every vllm module lists which modules need them).
DROPPED = {
    "torch": "the image's 2.11.0+cu130 (vLLM pins 2.13.0; its compiled modules use only torch's "
    "stable C shim, which rehearse loads against torch 2.11.0)",
    "torchvision": "the image's 0.26.0 (vLLM pins 0.28.0): multimodal processors only",
    "torchaudio": "the image's 2.11.0: audio models only",
    "numba": "the image's (vLLM pins 0.65.0): n-gram speculative decoding and two multimodal "
    "processors only",
    "triton": "the image's 3.6.0 (torch 2.11.0's own pin)",
    "torchcodec": "video decoding for multimodal inputs (imports guarded or lazy)",
    "pynvvideocodec": "video decoding for multimodal inputs (lazy import)",
    "nvidia-cutlass-dsl": "CuTe-DSL kernels (FA4, DeepSeek/Kimi/MiniMax/Qwen-Next kernels, "
    "router GEMMs, FlashInfer's cute_dsl modules): lazy, availability-checked or model-specific "
    "imports; FA4 is used on SM90 only for heads over 256, sinks or diffusion models",
    "quack-kernels": "CuTe-DSL kernels on top of nvidia-cutlass-dsl (same modules)",
    "tilelang": "mHC kernels (DeepSeek): lazy import behind has_tilelang()",
    "tokenspeed-mla": "MLA attention backends (DeepSeek-style models): lazy imports",
    "humming-kernels": "quantized linear kernels behind has_humming()",
    "fastsafetensors": "the optional fastsafetensors load format: lazy import",
    "instanttensor": "the optional instanttensor load format: lazy import",
    "cuda-python": "a metapackage without code (FlashInfer imports cuda.bindings, the image's); "
    "carried, it would only ask for another cuda-bindings",
    "nvidia-cudnn-frontend": "cuDNN attention and GEMMs through FlashInfer (11 MiB): every "
    "import of `cudnn` in vLLM and FlashInfer is in a try; vLLM's default paths never ask for it",
}
# Import names of the dropped distributions (a walk failure on one of these is by design).
DROPPED_IMPORTS = {
    "cutlass": "nvidia-cutlass-dsl",
    "quack": "quack-kernels",
    "tilelang": "tilelang",
    "tokenspeed_mla": "tokenspeed-mla",
    "humming": "humming-kernels",
    "torchcodec": "torchcodec",
    "PyNvVideoCodec": "pynvvideocodec",
    "fastsafetensors": "fastsafetensors",
    "instanttensor": "instanttensor",
    "cudnn": "nvidia-cudnn-frontend",
}
# Requirements overridden at lock time (the image's version is kept although a package caps it).
OVERRIDES = {
    "numpy": "2.5.2",  # mistral-common 1.13.1 caps numpy<2.4 on Python <= 3.12
}
# Image packages whose version may fail a carried package's specifier without harm: no fallback
# wheel is carried for them and ``install`` only notes the mismatch.
HARMLESS = {
    "numpy": "the image's numpy is kept (torch and the image's compiled packages use it); "
    "mistral-common's numpy<2.4 cap is overridden, and rehearse imports mistral_common with 2.5.2",
    "setuptools": "vLLM pins setuptools<81 for its build; vLLM 0.30.0 never imports setuptools",
    "torch": DROPPED["torch"],
    "torchvision": DROPPED["torchvision"],
    "torchaudio": DROPPED["torchaudio"],
    "numba": DROPPED["numba"],
    "triton": DROPPED["triton"],
}
# Fallback wheels (a newer version of an image package, installed only where the image's own
# fails the specifier) are carried up to this size; larger ones are only reported.
FALLBACK_MAX_BYTES = 4 * MIB

# What is taken out of vLLM's wheel (paths in the wheel), and why it is safe on an SM90 GPU.
WHEEL_DROPS = (
    (
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
        "FlashAttention 2 (124 MiB): on SM90 vLLM's FLASH_ATTN backend runs FA3 "
        "(fa_utils.get_flash_attn_version); FA2 only serves ALiBi, batch invariance and pre-SM90 "
        "GPUs (vllm_flash_attn/flash_attn_interface.py imports it in a try)",
    ),
    ("vllm/vllm-rs", "the Rust front end binary (21 MiB), used only with VLLM_USE_RUST_FRONTEND=1"),
    (
        "vllm/third_party/deep_gemm/",
        "DeepGEMM (fp8 block GEMMs): found through has_deep_gemm(), absent means off",
    ),
    ("vllm/third_party/fmha_sm100/", "SM100 sparse attention of MiniMax-M3 (lazy imports)"),
    ("vllm/third_party/tml_fa4/", "FA4 relative attention of one model family (lazy import)"),
    ("vllm/_flashmla_C.abi3.so", "FlashMLA (MLA models; imported in a try)"),
    ("vllm/_flashmla_extension_C.abi3.so", "FlashMLA (MLA models; imported in a try)"),
    ("vllm/_flashkda_C.abi3.so", "Kimi KDA kernels (model-specific)"),
    ("vllm/_deepselect_C.abi3.so", "DeepSeek sparse top-k (imported in a try)"),
    ("vllm/_qutlass_C.abi3.so", "FP4 QuTLASS kernels (imported under suppress(ImportError))"),
)

PLATFORM_TAGS = [f"manylinux_2_{n}_x86_64" for n in (5, 12, 17, 24, 26, 27, 28, 31, 34, 35)] + [
    "manylinux1_x86_64",
    "manylinux2010_x86_64",
    "manylinux2014_x86_64",
]
UV_PLATFORM = "x86_64-manylinux_2_35"
MARKER_ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "implementation_version": "3.12.3",
    "platform_python_implementation": "CPython",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "sys_platform": "linux",
    "os_name": "posix",
    "platform_release": "",
    "platform_version": "",
}


def log(msg: str) -> None:
    print(f"[gpu_carry] {msg}", file=sys.stderr, flush=True)


def die(msg: str, code: int = 2) -> None:
    print(f"[gpu_carry] error: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(4 * MIB), b""):
            h.update(block)
    return h.hexdigest()


def mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB"


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _packaging():
    try:
        from packaging import markers, requirements, specifiers, version
    except ImportError:  # pip vendors it
        from pip._vendor.packaging import markers, requirements, specifiers, version
    return markers, requirements, specifiers, version


# ---------------------------------------------------------------------------------------------
# The lock: scripts/gpu_carry_requirements.txt


@dataclass
class LockEntry:
    name: str
    version: str
    sha256: str
    role: str  # vllm | carry | fallback
    filename: str
    spec: str = ""  # fallback: the specifier the image's version must meet

    def line(self) -> str:
        tail = f" {self.spec}" if self.spec else ""
        return (
            f"{self.name}=={self.version} --hash=sha256:{self.sha256}"
            f"  # {self.role} {self.filename}{tail}"
        )


LOCK_LINE = re.compile(
    r"^(?P<name>[A-Za-z0-9_.\-]+)==(?P<version>\S+) --hash=sha256:(?P<sha>[0-9a-f]{64})"
    r"\s+# (?P<role>vllm|carry|fallback) (?P<file>\S+\.whl)(?: (?P<spec>.+))?$"
)


def lock_image_packages(path: Path = LOCK) -> list[str]:
    """The image's packages that the carried set uses (the lock's ``# image-packages:`` line)."""
    for raw in path.read_text().splitlines():
        if raw.startswith("# image-packages:"):
            return raw.split(":", 1)[1].split()
    die(f"{path}: no '# image-packages:' line; run `scripts/gpu_carry.sh lock` again")
    raise AssertionError


def read_lock(path: Path = LOCK) -> list[LockEntry]:
    if not path.exists():
        die(f"{path} is missing: run `scripts/gpu_carry.sh lock` (needs network and uv)")
    entries = []
    for raw in path.read_text().splitlines():
        if not raw.strip() or raw.startswith("#"):
            continue
        m = LOCK_LINE.match(raw)
        if not m:
            die(f"{path}: cannot read line {raw!r}")
        entries.append(
            LockEntry(
                m["name"], m["version"], m["sha"], m["role"], m["file"], (m["spec"] or "").strip()
            )
        )
    if sum(e.role == "vllm" for e in entries) != 1:
        die(f"{path}: expected exactly one vllm line")
    return entries


def wheel_metadata(path: Path) -> str:
    with zipfile.ZipFile(path) as z:
        name = next(
            n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1
        )
        return z.read(name).decode("utf-8", "replace")


def requires_dist(metadata: str, extras: Iterable[str] = ()) -> list:
    """Requirements of a wheel that apply on the GPU machine (Linux x86-64, CPython 3.12), with
    the given extras."""
    markers, requirements, _, _ = _packaging()
    out = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = requirements.Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None:
            envs = [dict(MARKER_ENV, extra=e) for e in ("", *extras)]
            if not any(req.marker.evaluate(env) for env in envs):
                continue
        out.append(req)
    return out


def find_uv() -> str:
    for cand in (ROOT / ".venv" / "bin" / "uv", shutil.which("uv")):
        if cand and Path(cand).exists():
            return str(cand)
    die("uv not found: run `make setup` (it installs uv into .venv)")
    raise AssertionError


def pip_download(requirements: list[str], dest: Path, hashes: bool = False) -> None:
    """Download wheels for the GPU machine (CPython 3.12, manylinux x86-64), without their
    dependencies."""
    if not requirements:
        return
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(requirements) + "\n")
        req_file = f.name
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "-q",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        "-d",
        str(dest),
        "-r",
        req_file,
    ]
    for tag in PLATFORM_TAGS:
        cmd += ["--platform", tag]
    if hashes:
        cmd.append("--require-hashes")
    try:
        subprocess.run(cmd, check=True, stdout=sys.stderr)
    finally:
        os.unlink(req_file)


def _downloaded(dest: Path, name: str, version: str) -> Path:
    """The wheel of name==version in dest."""
    _, _, _, versions = _packaging()
    want = versions.Version(version)
    for path in sorted(dest.glob("*.whl")):
        dist, ver = path.name.split("-")[:2]
        if norm(dist) == norm(name) and versions.Version(ver) == want:
            return path
    die(f"no wheel of {name}=={version} in {dest}")
    raise AssertionError


def project_requirements() -> list[str]:
    """setup.py's SERVING_REQUIRES: what ascend_mepic's CUDA path imports."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        target = getattr(node, "targets", [None])[0]
        if isinstance(node, ast.Assign) and getattr(target, "id", "") == "SERVING_REQUIRES":
            return list(ast.literal_eval(node.value))
    die("setup.py has no SERVING_REQUIRES")
    raise AssertionError


def uv_compile(
    uv: str, inputs: list[str], constraints: list[str], excludes: Iterable[str], workdir: Path
) -> dict[str, str]:
    """Resolve inputs for CPython 3.12 on manylinux x86-64; name -> version."""
    files = {}
    for key, lines in (
        ("in", inputs),
        ("constraints", constraints),
        ("overrides", [f"{k}=={v}" for k, v in OVERRIDES.items()]),
        ("excludes", sorted(excludes)),
    ):
        files[key] = workdir / f"{key}.txt"
        files[key].write_text("\n".join(lines) + "\n")
    out = workdir / "resolved.txt"
    subprocess.run(
        [
            uv,
            "pip",
            "compile",
            str(files["in"]),
            "-c",
            str(files["constraints"]),
            "--overrides",
            str(files["overrides"]),
            "--excludes",
            str(files["excludes"]),
            "--python-version",
            "3.12",
            "--python-platform",
            UV_PLATFORM,
            "--no-header",
            "--no-annotate",
            "--quiet",
            "-o",
            str(out),
        ],
        check=True,
        stdout=sys.stderr,
    )
    resolved = {}
    for line in out.read_text().splitlines():
        if "==" in line and not line.startswith((" ", "#")):
            name, ver = line.split("==", 1)
            resolved[norm(name.split("[")[0])] = ver.strip()
    return resolved


def image_specifiers(wheels: list[Path], image: set[str]) -> dict[str, str]:
    """What the given wheels (vLLM, carried ones) require of the image's packages: name ->
    combined specifier, extras requested anywhere included."""
    _, _, specifiers, _ = _packaging()
    metas = {norm(p.name.split("-")[0]): wheel_metadata(p) for p in wheels}
    extras: dict[str, set[str]] = {}
    specs: dict[str, specifiers.SpecifierSet] = {}
    changed = True
    while changed:  # extras requested by one wheel add requirements of another
        changed = False
        specs = {}
        for name, meta in metas.items():
            for req in requires_dist(meta, extras.get(name, ())):
                key = norm(req.name)
                if req.extras and not set(req.extras) <= extras.get(key, set()):
                    extras.setdefault(key, set()).update(req.extras)
                    changed = True
                if key in image:
                    specs[key] = specs.get(key, specifiers.SpecifierSet()) & req.specifier
    return {k: str(v) for k, v in sorted(specs.items())}


def _pin_fits(name: str, spec: str) -> bool:
    """Whether the image's known version of name (IMAGE_PINS) meets spec."""
    _, _, specifiers, versions = _packaging()
    pins = {norm(k): v for k, v in IMAGE_PINS.items()}
    return name in pins and versions.Version(pins[name]) in specifiers.SpecifierSet(spec)


def cmd_lock(args: argparse.Namespace) -> None:
    """Resolve and pin the carried set (network; uv from .venv)."""
    uv = find_uv()
    image = {norm(n) for n in IMAGE_PACKAGES}
    dropped = {norm(n) for n in DROPPED}
    wheels_dir = CACHE / "wheels"
    pip_download([VLLM_REQUIREMENT], wheels_dir)
    vllm_whl = _downloaded(wheels_dir, "vllm", VLLM_REQUIREMENT.split("==")[1])
    vllm_reqs = [str(r) for r in requires_dist(wheel_metadata(vllm_whl))]
    inputs = vllm_reqs + list(EXTRA_REQUIREMENTS) + project_requirements()
    constraints = [f"{k}=={v}" for k, v in IMAGE_PINS.items() if norm(k) not in dropped]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        # 1. Everything vLLM asks for (the image's torch and friends aside), to fix versions as
        #    a full install would; 2. the same without the dropped packages and what only they
        #    need, constrained to step 1's versions.
        full = uv_compile(
            uv, inputs, constraints, {"torch", "torchvision", "torchaudio", "triton", "numba"}, work
        )
        kept_inputs = [r for r in inputs if norm(re.split(r"[\s\[<>=!~;]", r)[0]) not in dropped]
        reduced = uv_compile(
            uv,
            kept_inputs,
            constraints + [f"{k}=={v}" for k, v in full.items() if k not in dropped],
            dropped,
            work,
        )
    carried = {k: v for k, v in reduced.items() if k not in image and k != "vllm"}
    log(
        f"resolved {len(full)} packages; {len(carried)} are carried, "
        f"{len([k for k in reduced if k in image])} are the image's"
    )
    pip_download([f"{k}=={v}" for k, v in sorted(carried.items())], wheels_dir)
    carried_whl = {k: _downloaded(wheels_dir, k, v) for k, v in carried.items()}
    # Fallbacks: image packages that vLLM or a carried wheel constrains (their version there is
    # not known for all): a wheel of the resolved version, installed only where needed.
    fallback_whl: dict[str, Path] = {}
    while True:
        specs = image_specifiers([vllm_whl, *carried_whl.values(), *fallback_whl.values()], image)
        want = {
            k
            for k, s in specs.items()
            if s and k not in HARMLESS and k in reduced and not _pin_fits(k, s)
        }
        new = sorted(want - set(fallback_whl))
        if not new:
            break
        pip_download([f"{k}=={reduced[k]}" for k in new], wheels_dir)
        fallback_whl.update({k: _downloaded(wheels_dir, k, reduced[k]) for k in new})
    entries = [
        LockEntry(
            "vllm", VLLM_REQUIREMENT.split("==")[1], sha256_file(vllm_whl), "vllm", vllm_whl.name
        )
    ]
    for k in sorted(carried_whl):
        p = carried_whl[k]
        entries.append(LockEntry(k, carried[k], sha256_file(p), "carry", p.name))
    skipped = []
    for k in sorted(fallback_whl):
        p = fallback_whl[k]
        if p.stat().st_size > FALLBACK_MAX_BYTES:
            skipped.append(f"{k}{specs[k]} ({mib(p.stat().st_size)})")
            continue
        entries.append(LockEntry(k, reduced[k], sha256_file(p), "fallback", p.name, specs[k]))
    unchecked = {k: s for k, s in specs.items() if s and k in HARMLESS}
    lines = [
        '# What scripts/gpu_carry.py carries to the GPU machine (docs/cuda.md, "Carrying vLLM',
        '# to a GPU machine without a package index"). Written by `scripts/gpu_carry.sh lock`;',
        "# do not edit.",
        f"# Resolved by uv for CPython 3.12 on {UV_PLATFORM} against the image's packages",
        "# (scripts/gpu_carry.py: IMAGE_PACKAGES, IMAGE_PINS).",
        "# Roles: vllm (slimmed by prepare), carry (always installed), fallback (an image",
        "# package, installed only where the image's own version fails the specifier at the end",
        "# of its line).",
        "# vLLM requirements not carried (scripts/gpu_carry.py: DROPPED):",
        *[f"#   {k}: {v}" for k, v in sorted(DROPPED.items())],
        "# Overridden: " + ", ".join(f"{k}=={v}" for k, v in OVERRIDES.items()),
        "# Image packages constrained without a fallback (harmless, scripts/gpu_carry.py: "
        "HARMLESS): " + (", ".join(f"{k}{s}" for k, s in unchecked.items()) or "none"),
        "# Image packages constrained whose fallback is too large to carry (reported by "
        "install): " + (", ".join(skipped) or "none"),
    ]
    used = sorted(k for k in reduced if k in image)
    lines.append("# image-packages: " + " ".join(used))
    LOCK.write_text("\n".join(lines + [e.line() for e in entries]) + "\n")
    print(
        f"wrote {LOCK.relative_to(ROOT)}: vllm, {len(carried_whl)} carried, "
        f"{sum(e.role == 'fallback' for e in entries)} fallback wheels"
    )


# ---------------------------------------------------------------------------------------------
# prepare: slim the vLLM wheel, split everything into parts


def _drop_reason(member: str) -> str | None:
    for pattern, reason in WHEEL_DROPS:
        if member == pattern or (pattern.endswith("/") and member.startswith(pattern)):
            return reason
    return None


def slim_wheel(src: Path, dest: Path) -> tuple[int, int]:
    """Copy src to dest without the members WHEEL_DROPS names, their RECORD lines removed.
    Members are copied compressed as they are (no recompression): the output is the same for
    the same input. Returns (members dropped, bytes dropped compressed)."""
    dropped = 0
    dropped_bytes = 0
    with zipfile.ZipFile(src) as zin, open(src, "rb") as raw, open(dest, "wb") as out:
        central = []
        record_name = None
        for info in zin.infolist():
            if info.filename.endswith(".dist-info/RECORD"):
                record_name = info.filename
                continue
            if _drop_reason(info.filename):
                dropped += 1
                dropped_bytes += info.compress_size
                continue
            raw.seek(info.header_offset)
            header = raw.read(30)
            sig, _, _, _, _, _, _, _, _, name_len, extra_len = struct.unpack("<IHHHHHIIIHH", header)
            if sig != 0x04034B50:
                die(f"{src}: bad local header for {info.filename}")
            raw.seek(info.header_offset + 30 + name_len + extra_len)
            data = raw.read(info.compress_size)
            central.append(_write_member(out, info, data))
        if record_name is None:
            die(f"{src}: no RECORD")
        kept = [
            line
            for line in zin.read(record_name).decode().splitlines()
            if line and not _drop_reason(line.rsplit(",", 2)[0])
        ]
        record = ("\n".join(kept) + "\n").encode()
        rinfo = zipfile.ZipInfo(record_name, date_time=zin.getinfo(record_name).date_time)
        rinfo.compress_type = zipfile.ZIP_DEFLATED
        rinfo.external_attr = zin.getinfo(record_name).external_attr
        comp = zlib.compressobj(6, zlib.DEFLATED, -15)
        data = comp.compress(record) + comp.flush()
        rinfo.CRC = zlib.crc32(record)
        rinfo.compress_size = len(data)
        rinfo.file_size = len(record)
        central.append(_write_member(out, rinfo, data))
        cd_start = out.tell()
        for entry in central:
            out.write(entry)
        cd_size = out.tell() - cd_start
        out.write(
            struct.pack(
                "<IHHHHIIH", 0x06054B50, 0, 0, len(central), len(central), cd_size, cd_start, 0
            )
        )
    with zipfile.ZipFile(dest) as z:  # the result reads back, and every member's CRC holds
        bad = z.testzip()
        if bad:
            die(f"slimmed wheel: member {bad} is corrupt")
    return dropped, dropped_bytes


def _write_member(out, info: zipfile.ZipInfo, data: bytes) -> bytes:
    """Write a local header and the member's compressed data; return its central entry."""
    offset = out.tell()
    name = info.filename.encode("utf-8")
    flags = 0x800 if not info.filename.isascii() else 0
    dt = info.date_time
    dostime = dt[3] << 11 | dt[4] << 5 | (dt[5] // 2)
    dosdate = (dt[0] - 1980) << 9 | dt[1] << 5 | dt[2]
    if offset > 0xFFFFFFFF or info.file_size > 0xFFFFFFFF:
        die("zip64 members are not supported")
    out.write(
        struct.pack(
            "<IHHHHHIIIHH",
            0x04034B50,
            20,
            flags,
            info.compress_type,
            dostime,
            dosdate,
            info.CRC,
            len(data),
            info.file_size,
            len(name),
            0,
        )
    )
    out.write(name)
    out.write(data)
    return (
        struct.pack(
            "<IHHHHHHIIIHHHHHII",
            0x02014B50,
            0x031E,
            20,
            flags,
            info.compress_type,
            dostime,
            dosdate,
            info.CRC,
            len(data),
            info.file_size,
            len(name),
            0,
            0,
            0,
            0,
            info.external_attr,
            offset,
        )
        + name
    )


def split_into_parts(files: list[tuple[str, int]], limit: int) -> list[list[dict]]:
    """Lay the files end to end and cut the stream every ``limit`` bytes: the fewest parts;
    a file cut at a boundary becomes pieces ``name.000``, ``name.001``, ... Returns per part
    its pieces: {piece, file, index, offset, size}."""
    parts: list[list[dict]] = [[]]
    room = limit
    for name, size in files:
        pieces = []
        offset = 0
        while True:
            if room == 0:
                parts.append([])
                room = limit
            take = min(room, size - offset)
            pieces.append({"file": name, "index": len(pieces), "offset": offset, "size": take})
            parts[-1].append(pieces[-1])
            offset += take
            room -= take
            if offset >= size:
                break
        for p in pieces:
            p["piece"] = name if len(pieces) == 1 else f"{name}.{p['index']:03d}"
    return [p for p in parts if p]


def build_parts(
    files: list[dict],
    out_dir: Path,
    limit: int = PART_LIMIT,
    extra: dict | None = None,
    room: int = 256 * 1024,
) -> dict:
    """Write part1..partN under out_dir from files [{name, path, size, sha256, role, ...}];
    each part holds its pieces and the whole manifest (``room`` bytes are kept for it).
    Returns the manifest."""
    for old in out_dir.glob("part*"):
        if old.is_dir() and re.fullmatch(r"part\d+", old.name):
            shutil.rmtree(old)
    # Each part also holds the manifest (about 70 KiB for 130 wheels).
    layout = split_into_parts([(f["name"], f["size"]) for f in files], limit - room)
    by_name = {f["name"]: f for f in files}
    manifest_parts = {}
    for i, pieces in enumerate(layout, 1):
        pdir = out_dir / f"part{i}"
        pdir.mkdir(parents=True)
        entries = []
        for p in pieces:
            src = Path(by_name[p["file"]]["path"])
            h = hashlib.sha256()
            with open(src, "rb") as fin, open(pdir / p["piece"], "wb") as fout:
                fin.seek(p["offset"])
                left = p["size"]
                while left:
                    block = fin.read(min(4 * MIB, left))
                    h.update(block)
                    fout.write(block)
                    left -= len(block)
            entries.append(
                {
                    "piece": p["piece"],
                    "file": p["file"],
                    "index": p["index"],
                    "size": p["size"],
                    "sha256": h.hexdigest(),
                }
            )
        manifest_parts[f"part{i}"] = entries
    file_entries = []
    for f in files:
        pieces = [
            e["piece"] for part in manifest_parts.values() for e in part if e["file"] == f["name"]
        ]
        entry = {k: v for k, v in f.items() if k != "path"}
        entry["pieces"] = pieces
        file_entries.append(entry)
    ident = hashlib.sha256(json.dumps([(f["name"], f["sha256"]) for f in files]).encode())
    manifest = {
        "format": FORMAT,
        "carry_id": ident.hexdigest()[:16],
        "part_limit": limit,
        "parts": manifest_parts,
        "files": file_entries,
        **(extra or {}),
    }
    for name in manifest_parts:
        write_atomic(
            out_dir / name / "manifest.json",
            json.dumps({**manifest, "part": name}, separators=(",", ":")) + "\n",
        )
        total = sum(p.stat().st_size for p in (out_dir / name).iterdir())
        if total > limit:
            die(f"{name} is {total} bytes, over {limit}")
    write_atomic(out_dir / "manifest.json", json.dumps(manifest, indent=1) + "\n")
    return manifest


def working_tree_bytes() -> int:
    """Bytes of what every device call uploads besides the carried folder: tracked and
    untracked-not-ignored files."""
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "ls-files", "-co", "--exclude-standard", "-z"],
            check=True,
            capture_output=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return 0
    total = 0
    for name in out.decode().split("\0"):
        p = ROOT / name
        if name and p.is_file():
            total += p.stat().st_size
    return total


def cmd_prepare(args: argparse.Namespace) -> None:
    entries = read_lock()
    wheels_dir = CACHE / "wheels"
    wheels_dir.mkdir(parents=True, exist_ok=True)
    have = {}
    for e in entries:
        p = wheels_dir / e.filename
        if p.exists() and sha256_file(p) == e.sha256:
            have[e.filename] = p
    missing = [e for e in entries if e.filename not in have]
    if missing:
        log(f"downloading {len(missing)} wheels into {wheels_dir.relative_to(ROOT)}")
        pip_download(
            [f"{e.name}=={e.version} --hash=sha256:{e.sha256}" for e in missing],
            wheels_dir,
            hashes=True,
        )
    for e in entries:
        p = wheels_dir / e.filename
        if not p.exists() or sha256_file(p) != e.sha256:
            die(f"{p.name}: missing or its sha256 differs from the lock")
    vllm = next(e for e in entries if e.role == "vllm")
    slim_dir = CACHE / "slim" / vllm.sha256[:16]
    slim = slim_dir / vllm.filename
    rules = hashlib.sha256(repr(WHEEL_DROPS).encode()).hexdigest()[:16]
    stamp = slim_dir / "rules"
    if not slim.exists() or not stamp.exists() or stamp.read_text() != rules:
        slim_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        n, nbytes = slim_wheel(wheels_dir / vllm.filename, slim)
        stamp.write_text(rules)
        log(
            f"slimmed {vllm.filename}: {n} members dropped ({mib(nbytes)} compressed) in "
            f"{time.time() - t0:.1f} s"
        )
    files = [
        {
            "name": slim.name,
            "path": str(slim),
            "size": slim.stat().st_size,
            "sha256": sha256_file(slim),
            "role": "vllm",
            "dist": "vllm",
            "version": vllm.version,
        }
    ]
    for e in entries:
        if e.role == "vllm":
            continue
        p = wheels_dir / e.filename
        f = {
            "name": e.filename,
            "path": str(p),
            "size": p.stat().st_size,
            "sha256": e.sha256,
            "role": e.role,
            "dist": e.name,
            "version": e.version,
        }
        if e.spec:
            f["spec"] = e.spec
        files.append(f)
    lock_hash = sha256_file(LOCK)
    manifest = build_parts(
        files,
        CARRY_DIR,
        args.part_mib * MIB,
        extra={
            "lock_sha256": lock_hash,
            "harmless": HARMLESS,
            "image_specifiers": _image_specs_from_files(files, lock_image_packages()),
        },
    )
    tree = working_tree_bytes()
    sizes = {name: sum(p["size"] for p in pieces) for name, pieces in manifest["parts"].items()}
    for name, size in sizes.items():
        fits = "ok" if size + tree < UPLOAD_LIMIT else "OVER THE UPLOAD LIMIT"
        print(
            f"{name}: {mib(size)} in {len(manifest['parts'][name])} pieces; with the working "
            f"tree ({mib(tree)}) {mib(size + tree)}: {fits}"
        )
    roles = {r: sum(f["role"] == r for f in files) for r in ("vllm", "carry", "fallback")}
    print(
        f"carry {manifest['carry_id']}: {len(sizes)} parts, {mib(sum(sizes.values()))} "
        f"({roles['carry']} carried wheels, {roles['fallback']} fallbacks, vLLM slimmed to "
        f"{mib(files[0]['size'])}) in {CARRY_DIR.relative_to(ROOT)}/part1..part{len(sizes)}"
    )
    print("device calls: scripts/gpu_carry.sh plan")


def _image_specs_from_files(files: list[dict], used: list[str]) -> dict[str, str]:
    """Every image package the carried set uses, with the specifier that vLLM and the carried
    wheels put on it ("" where none)."""
    image = {norm(n) for n in IMAGE_PACKAGES}
    paths = [Path(f["path"]) for f in files if f["role"] in ("vllm", "carry")]
    specs = image_specifiers(paths, image)
    return {k: specs.get(k, "") for k in sorted(set(used) | set(specs))}


# ---------------------------------------------------------------------------------------------
# GPU side: receive, install


def load_manifest(path: Path) -> dict:
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        die(f"cannot read {path}: {exc}")
    if manifest.get("format") != FORMAT:
        die(f"{path}: manifest format {manifest.get('format')}, expected {FORMAT}")
    return manifest


def _copy_hashed(src: Path, dest: Path, size: int, sha: str) -> bool:
    """Copy src to dest (atomically) if its size and sha256 are the expected ones."""
    if not src.exists() or src.stat().st_size != size:
        return False
    tmp = dest.with_name(dest.name + ".tmp")
    h = hashlib.sha256()
    with open(src, "rb") as fin, open(tmp, "wb") as fout:
        for block in iter(lambda: fin.read(4 * MIB), b""):
            h.update(block)
            fout.write(block)
    if h.hexdigest() != sha:
        tmp.unlink()
        return False
    tmp.replace(dest)
    return True


def store_state(store: Path, manifest: dict) -> tuple[dict[str, list[str]], list[str]]:
    """Per part, the pieces still missing; and the files not yet assembled. A piece counts as
    received when it is in pieces/ or its file is assembled in files/ (both written only after
    their sha256 was checked)."""
    files_dir, pieces_dir = store / "files", store / "pieces"
    assembled = {f["name"] for f in manifest["files"] if (files_dir / f["name"]).exists()}
    missing_parts = {}
    for part, pieces in manifest["parts"].items():
        gone = [
            p["piece"]
            for p in pieces
            if p["file"] not in assembled and not (pieces_dir / p["piece"]).exists()
        ]
        if gone:
            missing_parts[part] = gone
    not_assembled = [f["name"] for f in manifest["files"] if f["name"] not in assembled]
    return missing_parts, not_assembled


def _parts_order(name: str) -> int:
    return int(name[4:]) if name[4:].isdigit() else 0


def cmd_receive(args: argparse.Namespace) -> None:
    store: Path = args.store
    for folder in sorted(args.parts, key=lambda p: _parts_order(Path(p).name)):
        receive_part(Path(folder), store)
    manifest = load_manifest(store / "manifest.json")
    missing, _ = store_state(store, manifest)
    have = [p for p in manifest["parts"] if p not in missing]
    print(
        f"carry {manifest['carry_id']} in {store}: received {' '.join(have) or 'none'}; "
        f"missing {' '.join(sorted(missing, key=_parts_order)) or 'none'}"
    )
    if not missing:
        print("all parts received: next `scripts/gpu_carry.sh install`")


def receive_part(part: Path, store: Path) -> None:
    t0 = time.time()
    manifest = load_manifest(part / "manifest.json")
    name = manifest.get("part")
    if name not in manifest["parts"]:
        die(f"{part}/manifest.json names no part of its carry")
    store.mkdir(parents=True, exist_ok=True)
    current = store / "manifest.json"
    first = not current.exists()
    if not first:
        old = load_manifest(current)
        if old["carry_id"] != manifest["carry_id"]:
            log(f"{store} held carry {old['carry_id']}; replacing it with {manifest['carry_id']}")
            for sub in ("pieces", "files", "site", "meta", "bin"):
                shutil.rmtree(store / sub, ignore_errors=True)
            (store / "env.sh").unlink(missing_ok=True)
            first = True
    write_atomic(current, json.dumps({k: v for k, v in manifest.items() if k != "part"}) + "\n")
    files_dir, pieces_dir = store / "files", store / "pieces"
    files_dir.mkdir(exist_ok=True)
    pieces_dir.mkdir(exist_ok=True)
    by_file = {f["name"]: f for f in manifest["files"]}
    nbytes = 0
    for p in manifest["parts"][name]:
        f = by_file[p["file"]]
        if (files_dir / f["name"]).exists():
            continue
        whole = len(f["pieces"]) == 1
        dest = files_dir / f["name"] if whole else pieces_dir / p["piece"]
        if dest.exists() and dest.stat().st_size == p["size"]:
            continue
        if not _copy_hashed(part / p["piece"], dest, p["size"], p["sha256"]):
            die(
                f"{part / p['piece']} is missing or corrupt (size or sha256 differs from the "
                f"manifest): send {name} again",
                3,
            )
        nbytes += p["size"]
    assemble(store, manifest)
    log(f"received {name} from {part}: {mib(nbytes)} new in {time.time() - t0:.1f} s")
    if first:
        report_image(manifest, out=sys.stderr)


def assemble(store: Path, manifest: dict) -> None:
    """Join every file whose pieces are all in pieces/, check its sha256, drop the pieces."""
    files_dir, pieces_dir = store / "files", store / "pieces"
    for f in manifest["files"]:
        dest = files_dir / f["name"]
        if dest.exists() or len(f["pieces"]) == 1:
            continue
        pieces = [pieces_dir / p for p in f["pieces"]]
        if not all(p.exists() for p in pieces):
            continue
        tmp = dest.with_name(dest.name + ".tmp")
        h = hashlib.sha256()
        with open(tmp, "wb") as out:
            for p in pieces:
                with open(p, "rb") as fin:
                    for block in iter(lambda fin=fin: fin.read(4 * MIB), b""):
                        h.update(block)
                        out.write(block)
        if h.hexdigest() != f["sha256"]:
            tmp.unlink()
            for p in pieces:
                p.unlink()
            die(
                f"{f['name']}: its pieces join to a file whose sha256 differs from the manifest; "
                f"pieces removed, send the parts holding them again: "
                f"{' '.join(parts_of(manifest, f['name']))}",
                3,
            )
        tmp.replace(dest)
        for p in pieces:
            p.unlink()
        log(f"assembled {f['name']} ({mib(f['size'])}, sha256 ok)")


def parts_of(manifest: dict, file_name: str) -> list[str]:
    return [
        part
        for part, pieces in manifest["parts"].items()
        if any(p["file"] == file_name for p in pieces)
    ]


def image_status(manifest: dict) -> list[dict]:
    """The image's version of each package vLLM or a carried wheel constrains, and what
    install does about it."""
    from importlib import metadata

    _, _, specifiers, versions = _packaging()
    fallbacks = {norm(f["dist"]): f for f in manifest["files"] if f["role"] == "fallback"}
    rows = []
    specs = dict(manifest.get("image_specifiers", {}))
    for name, f in fallbacks.items():
        specs.setdefault(name, f.get("spec", ""))
    for name, spec in sorted(specs.items()):
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = None
        ok = have is not None and (
            not spec or versions.Version(have) in specifiers.SpecifierSet(spec, prereleases=True)
        )
        if ok:
            action = "ok"
        elif name in fallbacks:
            action = f"install the carried {fallbacks[name]['version']}"
        elif name in manifest.get("harmless", {}):
            action = "kept: " + manifest["harmless"][name]
        else:
            action = "MISMATCH, no fallback carried"
        rows.append({"name": name, "spec": spec, "image": have, "ok": ok, "action": action})
    return rows


def report_image(manifest: dict, out=sys.stdout) -> list[dict]:
    if sys.version_info[:2] != (3, 12):
        print(
            f"WARNING: {sys.executable} is Python {sys.version.split()[0]}; the carried "
            "wheels are for CPython 3.12",
            file=out,
        )
    rows = image_status(manifest)
    bad = [r for r in rows if not r["ok"]]
    import platform

    libc = " ".join(platform.libc_ver())
    print(
        f"image check ({sys.executable}, Python {sys.version.split()[0]}, {libc}): "
        f"{len(rows) - len(bad)} of the {len(rows)} image packages the carried set uses fit",
        file=out,
    )
    for r in bad:
        print(
            f"  {r['name']} {r['image'] or 'absent'} (needs {r['spec'] or 'any version'}): "
            f"{r['action']}",
            file=out,
        )
    return rows


def cmd_install(args: argparse.Namespace) -> None:
    store: Path = args.store
    current = store / "manifest.json"
    if not current.exists():
        die(
            f"nothing received in {store}: run `scripts/gpu_carry.sh receive .gpu-carry/partN` "
            "for every part first"
        )
    manifest = load_manifest(current)
    missing, not_assembled = store_state(store, manifest)
    corrupt = []
    for f in manifest["files"]:
        p = store / "files" / f["name"]
        if f["name"] in not_assembled:
            continue
        if p.stat().st_size != f["size"] or sha256_file(p) != f["sha256"]:
            corrupt.append(f["name"])
            p.unlink()
    if missing or corrupt:
        resend = sorted(
            set(missing) | {part for name in corrupt for part in parts_of(manifest, name)},
            key=_parts_order,
        )
        lines = [f"carry {manifest['carry_id']} is incomplete in {store}; not installing."]
        lines += [
            f"  missing {part}: {len(pieces)} pieces"
            for part, pieces in sorted(missing.items(), key=lambda kv: _parts_order(kv[0]))
        ]
        lines += [f"  corrupt (removed): {name}" for name in corrupt]
        lines.append(
            f"  send again: {' '.join(resend)} (scripts/gpu_carry.sh receive .gpu-carry/<part>)"
        )
        print("\n".join(lines))
        raise SystemExit(2)
    rows = report_image(manifest)
    chosen = {r["name"] for r in rows if not r["ok"] and r["action"].startswith("install")}
    wheels = [
        store / "files" / f["name"]
        for f in manifest["files"]
        if f["role"] != "fallback" or norm(f["dist"]) in chosen
    ]
    site = store / "site"
    stamp = {
        "carry_id": manifest["carry_id"],
        "fallbacks": sorted(chosen),
        "python": sys.executable,
    }
    stamp_file = site / ".gpu-carry-installed"
    if stamp_file.exists() and json.loads(stamp_file.read_text()) == stamp and not args.force:
        log(f"{site} already holds this carry ({len(wheels)} wheels)")
    else:
        t0 = time.time()
        new = store / "site.new"
        shutil.rmtree(new, ignore_errors=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-index",
                "--no-deps",
                "--no-compile",
                "--no-cache-dir",
                "--disable-pip-version-check",
                "--target",
                str(new),
                *map(str, wheels),
            ],
            check=True,
            stdout=sys.stderr,
        )
        write_atomic(new / ".gpu-carry-installed", json.dumps(stamp) + "\n")
        old = store / "site.old"
        shutil.rmtree(old, ignore_errors=True)
        if site.exists():
            site.replace(old)
        new.replace(site)
        shutil.rmtree(old, ignore_errors=True)
        log(f"installed {len(wheels)} wheels into {site} in {time.time() - t0:.1f} s")
    checkout = Path(args.checkout).resolve()
    write_project_metadata(store, checkout)
    env = env_lines(store, checkout)
    write_atomic(
        store / "env.sh",
        "# scripts/gpu_carry.py install: source it from any directory\n" + "\n".join(env) + "\n",
    )
    print("\n".join(env))
    print(f"# or: . {store / 'env.sh'}")


def write_project_metadata(store: Path, checkout: Path) -> None:
    """This checkout's metadata (entry points: vLLM loads MEPIC's plugins through them) in
    store/meta, and an ``ascend-mepic`` command in store/bin; the code itself is imported
    from the checkout (PYTHONPATH), so each call's working tree is the one that runs."""
    meta = store / "meta"
    shutil.rmtree(meta, ignore_errors=True)
    meta.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            [sys.executable, "setup.py", "-q", "egg_info", "--egg-base", tmp],
            cwd=checkout,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr)
            die(f"`setup.py egg_info` failed in {checkout}")
        info = next(Path(tmp).glob("*.egg-info"))
        shutil.copytree(info, meta / info.name)
    bindir = store / "bin"
    bindir.mkdir(exist_ok=True)
    script = bindir / "ascend-mepic"
    script.write_text(
        f"#!{sys.executable}\nimport sys\n"
        "from ascend_mepic.entrypoints.cli import main\n\nsys.exit(main())\n"
    )
    script.chmod(0o755)


def env_lines(store: Path, checkout: Path) -> list[str]:
    path = [str(checkout), str(store / "site"), str(store / "meta")]
    return [
        f"export PYTHONPATH={':'.join(path)}${{PYTHONPATH:+:$PYTHONPATH}}",
        f"export PATH={store / 'bin'}:{store / 'site' / 'bin'}:$PATH",
    ]


def store_env(store: Path, checkout: Path = ROOT) -> dict[str, str]:
    env = dict(os.environ)
    path = [str(checkout), str(store / "site"), str(store / "meta")]
    env["PYTHONPATH"] = ":".join(path + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PATH"] = f"{store / 'bin'}:{store / 'site' / 'bin'}:{env.get('PATH', '')}"
    return env


# ---------------------------------------------------------------------------------------------
# check: import what the GPU path imports, classify each failure

CORE_MODULES = (
    "vllm",
    "vllm:LLM",
    "vllm.platforms.cuda",
    "vllm._custom_ops",
    "vllm.vllm_flash_attn",
    "vllm.v1.engine.core",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.engine.async_llm",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.attention.backends.flash_attn",
    "vllm.v1.attention.backends.triton_attn",
    "vllm.v1.attention.backends.flashinfer",
    "vllm.v1.sample.ops.topk_topp_sampler",
    "vllm.model_executor.models.llama",
    "vllm.model_executor.models.mistral",
    "vllm.model_executor.warmup.kernel_warmup",
    "vllm.entrypoints.openai.api_server",
    "vllm.entrypoints.cli.main",
    "flashinfer",
    "flashinfer.decode",
    "mistral_common.tokens.tokenizers.mistral",
    "ascend_mepic",
    "ascend_mepic.plugin",
    "ascend_mepic.offline",
    "ascend_mepic.vllm_integration.engine_config",
    "ascend_mepic.worker.gpu_worker",
    "ascend_mepic.worker.cuda_attention",
    "ascend_mepic.worker.model_runner",
    "ascend_mepic.entrypoints.cli",
    "ascend_mepic.entrypoints.server",
    "ascend_mepic.ops",
    "cuda_fallback.rope_paged_attention",
    "entry-points:vllm.general_plugins:ascend_mepic",
)
# Modules whose functions run while an engine starts on a GPU (worker, runner, warm-up): the
# vllm modules they import inside functions are checked too.
START_PATH = (
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.model_executor.warmup.kernel_warmup",
    "vllm.v1.engine.core",
    "vllm.v1.attention.backends.flash_attn",
    "vllm.v1.sample.ops.topk_topp_sampler",
)
# Another platform's modules, which the start path imports only on that platform.
OTHER_PLATFORMS = re.compile(r"\.(rocm|xpu|tpu|cpu|amd)(\.|$)|rocm_")
CUDA_PATTERNS = (
    "libcuda.so",
    "libcudart",
    "libnvrtc",
    "libnvidia-ml",
    "NVML",
    "nvml",
    "NVIDIA driver",
    "not compiled with CUDA",
    "CUDA driver",
    "no CUDA GPUs",
    "No CUDA GPUs",
    "CUDA is not available",
    "cuda is not available",
    "_C_stable_libtorch",
    "torch.ops._C",
    "_moe_C",
    "_vllm_fa3_C",
    "_vllm_fa2_C",
    "cudaGetDeviceCount",
    "Found no NVIDIA",
)


def lazy_vllm_imports(site: Path, modules: Iterable[str]) -> list[str]:
    """vllm modules imported inside functions of the given modules (first level)."""
    found = []
    for mod in modules:
        path = site / (mod.replace(".", "/") + ".py")
        if not path.exists():
            path = site / mod.replace(".", "/") / "__init__.py"
        if not path.exists():
            continue
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    if node.module.startswith("vllm."):
                        found.append(node.module)
                elif isinstance(node, ast.Import):
                    found += [a.name for a in node.names if a.name.startswith("vllm.")]
    return sorted(set(found))


def all_vllm_modules(site: Path) -> list[str]:
    mods = []
    for path in sorted((site / "vllm").rglob("*.py")):
        rel = path.relative_to(site).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts[-1] == "__main__" or any(not p.isidentifier() for p in parts):
            continue
        mods.append(".".join(parts))
    return mods


# Failures read and explained by hand (module prefix -> why it is not the carry's doing).
KNOWN_OTHER = {
    "vllm.compilation.passes.fusion.rocm_aiter_fusion": "ROCm only: AITER's ops do not exist on "
    "CUDA",
    "vllm.distributed.kv_transfer.kv_connector.v1.hf3fs": "the HF3FS KV connector compiles a C++ "
    "extension against 3FS at import; an optional connector",
    "vllm.v1.executor.ray_executor_v2": "needs ray (the optional ray extra): its import is guarded "
    "but a type annotation is not",
}
# Symbols vLLM 0.30.0 takes from a package the image holds at another version (the image's
# version gap, not the carry's): reported, not failures, outside the start path.
KNOWN_IMAGE_GAPS = {
    "PixtralRotaryEmbedding": "transformers 5.17.0 (the image's) renamed it "
    "PixtralVisionRotaryEmbedding: vLLM's Pixtral, LLaVA and Mistral3 multimodal models do not "
    "import; text models are unaffected",
}
# Failures that depend on the walk's order (a module re-run after an earlier failed import
# registers its op again; an import cycle entered from the middle): retried alone.
ORDER_ARTIFACTS = ("multiple times", "Duplicate op name", "partially initialized module")
_INSTALL_HINT = re.compile(
    r"pip install ([A-Za-z0-9_.\-]+)|requires (?:the )?`?([A-Za-z0-9_\-]+)`?(?: package| to be "
    r"installed)|([A-Za-z0-9_\-]+) is required for"
)


def _dropped_from_wheel(module: str) -> str | None:
    """The WHEEL_DROPS reason if module (vllm.x.y) was taken out of the wheel."""
    base = module.replace(".", "/")
    for pattern, reason in WHEEL_DROPS:
        stem = pattern.rstrip("/").split(".abi3.so")[0]
        if base == stem or base.startswith(stem + "/"):
            return reason
    return None


def classify(result: dict, requirements: set[str], providers: dict[str, list[str]]) -> str:
    """ok | cuda (the missing CUDA driver, expected without a GPU) | dropped (a vLLM requirement
    left out on purpose) | slimmed (a part of vLLM's wheel left out on purpose) | optional (a
    package that is not among vLLM's requirements: an extra or another platform's) | known (read
    and explained: KNOWN_OTHER) | cycle (vLLM's own import cycle, retried alone) | image-gap
    (KNOWN_IMAGE_GAPS) | MISSING (a vLLM requirement the carry lacks) | VERSION (an installed
    package lacks what vLLM imports) | OTHER."""
    if result["ok"]:
        return "ok"
    etype, msg = result["type"], result.get("message") or ""
    missing = result.get("missing") or ""
    if not missing:
        hint = _INSTALL_HINT.search(msg)
        if hint and etype == "ImportError":
            missing = next(g for g in hint.groups() if g).split("[")[0]
            result["missing"] = missing
    top = missing.split(".")[0]
    if top == "vllm" and _dropped_from_wheel(missing):
        return "slimmed"
    if top and top not in ("vllm", "ascend_mepic", "cuda_fallback", "tests"):
        if top in DROPPED_IMPORTS or norm(top) in {norm(d) for d in DROPPED}:
            return "dropped"
        dists = providers.get(top) or [top]
        if any(norm(d) in requirements for d in dists):
            return "MISSING"
        if top in providers:  # installed, but a submodule is missing: a version question
            return "VERSION"
        return "optional"
    if result.get("retried") == 2 and "partially initialized module 'vllm." in msg:
        return "cycle"
    for prefix in KNOWN_OTHER:
        if result["module"] == prefix or result["module"].startswith(prefix + "."):
            return "known"
    m = re.search(r"cannot import name '([^']+)' from '([^']+)'", msg)
    if (
        etype == "ImportError"
        and m
        and m.group(2).split(".")[0] not in ("vllm", "ascend_mepic", "cuda_fallback")
    ):
        if any(p in msg for p in CUDA_PATTERNS):
            return "cuda"
        return "image-gap" if m.group(1) in KNOWN_IMAGE_GAPS else "VERSION"
    if any(p in msg for p in CUDA_PATTERNS):
        return "cuda"
    return "OTHER"


def _worker(args: argparse.Namespace) -> None:
    """Import each module given on stdin (one per line) in this process; one JSON line per
    module on stdout."""
    import importlib
    import traceback

    double_error = None
    if args.double:
        try:
            _install_cuda_double()
        except Exception as exc:  # noqa: BLE001 - reported for every module
            double_error = {
                "ok": False,
                "type": "DoubleFailed",
                "missing": None,
                "message": f"the CUDA platform double failed: {type(exc).__name__}: {exc}",
            }
    for line in sys.stdin:
        target = line.strip()
        if not target:
            continue
        t0 = time.time()
        res = {"module": target, "ok": True}
        if double_error:
            print(json.dumps({"module": target, **double_error}), flush=True)
            continue
        try:
            if target.startswith("entry-points:"):
                from importlib import metadata

                _, group, name = target.split(":")
                eps = [ep for ep in metadata.entry_points(group=group) if ep.name == name]
                if not eps:
                    raise LookupError(f"no entry point {name!r} in group {group!r}")
                eps[0].load()
            elif ":" in target:
                mod, attr = target.split(":")
                getattr(importlib.import_module(mod), attr)
            else:
                importlib.import_module(target)
        except BaseException as exc:  # noqa: BLE001 - every failure is reported
            tb = traceback.format_exc()
            missing = None  # ImportError.name is the importing module: only a missing one counts
            cause: BaseException | None = exc
            while missing is None and cause is not None:  # a wrapped ModuleNotFoundError
                if isinstance(cause, ModuleNotFoundError):
                    missing = cause.name
                cause = cause.__cause__ or cause.__context__
            res = {
                "module": target,
                "ok": False,
                "type": type(exc).__name__,
                "message": str(exc)[:500],
                "missing": missing,
                "trace": tb[-3000:],
            }
        res["seconds"] = round(time.time() - t0, 3)
        print(json.dumps(res), flush=True)


def _install_cuda_double() -> None:
    """Without a GPU: make vLLM's current platform its CUDA platform reporting an H200 (SM90),
    so that imports take the branches they take on the GPU machine. Nothing else is faked:
    vLLM's compiled modules load or fail for real."""
    import vllm.platforms as platforms
    from vllm.platforms.cuda import CudaPlatformBase
    from vllm.platforms.interface import DeviceCapability

    class H200Double(CudaPlatformBase):
        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(9, 0)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return "NVIDIA H200 (double)"

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return 141 << 30

        @classmethod
        def is_fully_connected(cls, device_ids: list[int]) -> bool:
            return True

        @classmethod
        def num_compute_units(cls, device_id: int = 0) -> int:
            return 132

    platforms._current_platform = H200Double()
    import vllm.triton_utils.importing as importing

    importing.HAS_TRITON = True  # as on a GPU, where Triton's CUDA driver is active
    for name in [m for m in sys.modules if m.startswith("vllm.triton_utils")]:
        if name != "vllm.triton_utils.importing":
            del sys.modules[name]


def run_imports(
    python: str, targets: list[str], env: dict[str, str], double: bool, per_module: float = 180.0
) -> list[dict]:
    """Import targets in order in worker processes of ``python``, one JSON line each; a worker
    that dies or spends over ``per_module`` seconds on one module is replaced, and that module
    reported."""
    import select

    results: list[dict] = []
    todo = list(targets)
    while todo:
        cmd = [python, str(Path(__file__).resolve()), "_import-worker"]
        if double:
            cmd.append("--double")
        with tempfile.TemporaryFile("w+") as stdin:
            stdin.write("\n".join(todo) + "\n")
            stdin.seek(0)
            proc = subprocess.Popen(
                cmd,
                stdin=stdin,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env=env,
                text=True,
                cwd="/",
            )
        done: list[dict] = []
        assert proc.stdout is not None
        while len(done) < len(todo):
            ready, _, _ = select.select([proc.stdout], [], [], per_module)
            if not ready:
                proc.kill()
                break
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("{"):
                done.append(json.loads(line))
        proc.kill()
        proc.wait()
        proc.stdout.close()
        results += done
        todo = todo[len(done) :]
        if todo:  # the worker died, or hung, on todo[0]
            results.append(
                {
                    "module": todo[0],
                    "ok": False,
                    "type": "WorkerDied",
                    "message": f"the importing process ended or hung (exit {proc.returncode})",
                    "missing": None,
                }
            )
            todo = todo[1:]
    return results


def vllm_requirements(site: Path) -> set[str]:
    dist = next(site.glob("vllm-*.dist-info"), None)
    if dist is None:
        return set()
    _, requirements, _, _ = _packaging()
    reqs = set()
    for line in (dist / "METADATA").read_text().splitlines():
        if line.startswith("Requires-Dist:"):
            req = requirements.Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or "extra" not in str(req.marker):
                reqs.add(norm(req.name))
    return reqs


def import_check(
    store: Path,
    walk: bool,
    double: bool,
    checkout: Path = ROOT,
    python: str = sys.executable,
    env_extra: dict[str, str] | None = None,
) -> dict:
    site = store / "site"
    env = {**store_env(store, checkout), **(env_extra or {})}
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    lazy = [
        m
        for m in lazy_vllm_imports(site, START_PATH)
        if m not in CORE_MODULES and not OTHER_PLATFORMS.search(m)
    ]
    targets = list(CORE_MODULES) + lazy
    t0 = time.time()
    core = run_imports(python, targets, env, double)
    walked = run_imports(python, all_vllm_modules(site), env, double) if walk else []
    requirements = vllm_requirements(site)
    probe = subprocess.run(
        [
            python,
            "-c",
            "import json, importlib.metadata as m; print(json.dumps(m.packages_distributions()))",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    providers = json.loads(probe.stdout)
    # Failures that may come from the walk's order: all again in one fresh process, then those
    # still failing so one by one.
    for batch in (True, False):
        redo = [
            i
            for i, r in enumerate(walked)
            if not r["ok"]
            and any(p in (r.get("message") or "") for p in ORDER_ARTIFACTS)
            and r.get("retried", 0) < (1 if batch else 2)
        ]
        groups = [redo] if batch else [[i] for i in redo]
        for group in groups:
            if not group:
                continue
            again = run_imports(python, [walked[i]["module"] for i in group], env, double)
            for i, r in zip(group, again, strict=True):
                r["retried"] = walked[i].get("retried", 0) + 1
                walked[i] = r
    for r in core + walked:
        r["class"] = classify(r, requirements, providers)
    return {
        "core": core,
        "lazy": lazy,
        "walk": walked,
        "seconds": round(time.time() - t0, 1),
        "double": double,
    }


FAILING = ("MISSING", "VERSION", "OTHER")
EXPLAINED = {
    "cuda": "fail only on the missing CUDA driver (expected without a GPU)",
    "dropped": "need a vLLM requirement left out on purpose (DROPPED)",
    "slimmed": "need a part of vLLM's wheel left out on purpose (WHEEL_DROPS)",
    "optional": "need a package outside vLLM's requirements (an extra, another platform)",
    "known": "read and explained (KNOWN_OTHER)",
    "cycle": "vLLM's own import cycle, also when imported alone in a fresh process",
    "image-gap": "need what the image's version of a package lacks (KNOWN_IMAGE_GAPS)",
}


def summarize(report: dict, out=sys.stdout) -> int:
    """Print the classified results; return the number of failures. On the start path (core
    targets and their lazy imports) anything but ok, cuda, dropped and slimmed fails."""
    failures = 0
    for section in ("core", "walk"):
        results = report[section]
        if not results:
            continue
        counts: dict[str, int] = {}
        for r in results:
            counts[r["class"]] = counts.get(r["class"], 0) + 1
        label = (
            "start path (core targets and the vllm modules their functions import)"
            if section == "core"
            else "every vllm module"
        )
        print(
            f"{label}: {len(results)} imported: "
            + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())),
            file=out,
        )
        for r in results:
            bad = r["class"] in FAILING or (
                section == "core" and r["class"] not in ("ok", "cuda", "dropped", "slimmed")
            )
            if r["class"] == "ok" or (section == "walk" and not bad):
                continue
            failures += bad
            print(
                f"  [{'FAIL' if bad else 'expected'}: {r['class']}] {r['module']}: {r['type']}: "
                f"{(r.get('message') or '').splitlines()[0][:160] if r.get('message') else ''}",
                file=out,
            )
        if section == "walk":
            groups: dict[str, list[str]] = {}
            for r in results:
                if r["class"] in FAILING or r["class"] == "ok":
                    continue
                key = r["class"]
                if key in ("dropped", "optional"):
                    key += " " + (r.get("missing") or "?").split(".")[0]
                elif key == "slimmed":
                    key += " " + (r.get("missing") or "?")
                elif key == "image-gap":
                    key += " " + next((k for k in KNOWN_IMAGE_GAPS if k in r["message"]), "?")
                groups.setdefault(key, []).append(r["module"])
            for key, mods in sorted(groups.items()):
                cls = key.split(" ")[0]
                print(
                    f"  {key}: {len(mods)} modules ({EXPLAINED[cls]}), e.g. {', '.join(mods[:3])}",
                    file=out,
                )
            for name, why in KNOWN_IMAGE_GAPS.items():
                if any(name in (r.get("message") or "") for r in results):
                    print(f"  note: {name}: {why}", file=out)
    print(f"import check: {failures} failures ({report['seconds']} s)", file=out)
    return failures


def cmd_check(args: argparse.Namespace) -> None:
    store: Path = args.store
    if not (store / "site" / ".gpu-carry-installed").exists():
        die(f"nothing installed in {store}: run `scripts/gpu_carry.sh install` first")
    report = import_check(store, args.walk, args.double, Path(args.checkout).resolve())
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    raise SystemExit(1 if summarize(report) else 0)


# ---------------------------------------------------------------------------------------------
# plan: the device calls


def cmd_plan(args: argparse.Namespace) -> None:
    """The device calls of one 15-minute GPU lease (issue 49), most important first: the
    carry's parts, the kernels' benchmark and counters while the parts arrive (they need no
    vLLM), then vLLM: the 7B engine benchmark with FlashInfer's decode row, `make test-gpu`,
    and the launch sweep if time is left."""
    manifest = load_manifest(CARRY_DIR / "manifest.json")
    parts = sorted(manifest["parts"], key=_parts_order)
    tree = working_tree_bytes()
    ready = "scripts/gpu_carry.sh install >/dev/null && . /tmp/mepic-carry/env.sh && "
    bench_data = "results/gpu_engine_bench"
    if not (ROOT / bench_data / "squad_quick.json").exists():
        print(
            f"# {bench_data} is missing: make it here first (docs/cuda.md, the 7B engine "
            "benchmark):\n#   .venv/bin/ascend-mepic prepare --model mistral7b-dummy --out "
            f"{bench_data}/mistral7b-dummy\n#   .venv/bin/ascend-mepic bench engine --model "
            f"{bench_data}/mistral7b-dummy --save-workload {bench_data}/squad_quick.json"
        )
    print(
        f"# carry {manifest['carry_id']}: {len(parts)} parts, then the work; issue the calls "
        "back to back (the machine keeps\n# /tmp about 30 s after a call; if a call says "
        "parts are missing, the machine was replaced:\n# send those parts again). Estimated "
        "device time: about 15 minutes with the machine's start."
    )
    for i, part in enumerate(parts, 1):
        size = sum(p["size"] for p in manifest["parts"][part])
        cmd = "scripts/gpu_carry.sh receive .gpu-carry/part*"
        carry = [f".gpu-carry/{part}"]
        timeout = 120
        if i == 1:  # the kernels need only CUDA torch and Triton: measured while parts arrive
            cmd = f"nvidia-smi -L; {cmd}; CONTEXTS='8192 32768' scripts/gpu_kernels.sh bench ncu"
            timeout = 420
        if i == len(parts):
            cmd += (
                " && scripts/gpu_carry.sh install && scripts/gpu_carry.sh check && "
                ". /tmp/mepic-carry/env.sh && ascend-mepic bench engine --device cuda "
                f"--model {bench_data}/mistral7b-dummy --workload {bench_data}/squad_quick.json"
                " --policy-timeout 150 --out $OUT/engine_bench; "
                "scripts/gpu_kernels.sh flashinfer"
            )
            carry.append(bench_data)
            timeout = 540
        print(
            f"run(command={cmd!r}, carry={carry!r}, timeout_s={timeout})  "
            f"# uploads {mib(size + tree)} plus any carried data"
        )
    tests = "make test-gpu GPU_PY=python3 GPU_PYTEST_ARGS='-n 8'"
    print(f"run(command={ready + tests!r}, timeout_s=600)")
    print("# if time is left: the launch sweep on the new kernels")
    print("run(command='scripts/gpu_kernels.sh sweep', timeout_s=240)")
    print("# then give_back(); results: docs/results.md (issue 49's sections)")


# ---------------------------------------------------------------------------------------------
# rehearse: the GPU side in a clean Python 3.12 with the image's packages

REHEARSE_PYTHON = Path(
    os.environ.get(
        "MEPIC_REHEARSE_PYTHON", Path.home() / ".pyenv" / "versions" / "3.12.1" / "bin" / "python"
    )
)
# Image packages installed in the rehearsal's base besides those vLLM's closure constrains.
REHEARSE_EXTRA = ("numba", "pytest", "pytest-xdist", "setuptools", "wheel", "packaging")
STUB_SYMBOLS = (
    "cuGetProcAddress_v2",
    "cuPointerGetAttribute",
    "cuTensorMapEncodeTiled",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuGetErrorString",
    "cuMemAddressFree",
    "cuMemAddressReserve",
    "cuMemCreate",
    "cuMemGetAllocationGranularity",
    "cuMemMap",
    "cuMemRelease",
    "cuMemSetAccess",
    "cuMemUnmap",
)


def base_requirements(manifest: dict) -> list[str]:
    """The rehearsal's image: IMAGE_PINS, plus every image package vLLM or a carried wheel
    constrains (newest version torch and the pins allow; the image's own versions are not all
    known), plus REHEARSE_EXTRA."""
    names = {norm(n) for n in manifest.get("image_specifiers", {})}
    names |= {norm(f["dist"]) for f in manifest["files"] if f["role"] == "fallback"}
    names |= {norm(n) for n in REHEARSE_EXTRA}
    reqs = [f"{k}=={v}" for k, v in IMAGE_PINS.items()]
    reqs += sorted(n for n in names if n not in {norm(k) for k in IMAGE_PINS})
    return reqs


def ensure_base(manifest: dict) -> Path:
    venv = REHEARSE_DIR / "base-venv"
    py = venv / "bin" / "python"
    reqs = base_requirements(manifest)
    stamp = venv / ".gpu-carry-base"
    key = hashlib.sha256("\n".join(reqs).encode()).hexdigest()
    if py.exists() and stamp.exists() and stamp.read_text() == key:
        return py
    if not REHEARSE_PYTHON.exists():
        die(f"no Python 3.12 at {REHEARSE_PYTHON} (MEPIC_REHEARSE_PYTHON picks another)")
    shutil.rmtree(venv, ignore_errors=True)
    log(
        f"building the rehearsal's image-like base in {venv} (torch 2.11.0 with its CUDA "
        "libraries from PyPI, as on the image: about 3 GB, once)"
    )
    subprocess.run([str(REHEARSE_PYTHON), "-m", "venv", str(venv)], check=True)
    req_file = REHEARSE_DIR / "base-requirements.txt"
    req_file.write_text("\n".join(reqs) + "\n")
    subprocess.run(
        [find_uv(), "pip", "install", "-q", "--python", str(py), "-r", str(req_file)],
        check=True,
        stdout=sys.stderr,
    )
    stamp.write_text(key)
    return py


def build_libcuda_stub(dest: Path) -> Path | None:
    """A libcuda.so.1 whose driver functions all fail: lets vLLM's compiled modules be loaded
    (every symbol resolved against torch 2.11.0) on a machine without a driver."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    dest.mkdir(parents=True, exist_ok=True)
    src = dest / "libcuda_stub.c"
    src.write_text("".join(f"int {s}(void) {{ return 999; }}\n" for s in STUB_SYMBOLS))
    lib = dest / "libcuda.so.1"
    subprocess.run(
        [cc, "-shared", "-fPIC", "-o", str(lib), "-Wl,-soname,libcuda.so.1", str(src)], check=True
    )
    return dest


ABI_MODULES = (
    "vllm._C_stable_libtorch",
    "vllm._moe_C_stable_libtorch",
    "vllm.vllm_flash_attn._vllm_fa3_C",
    "vllm.cumem_allocator",
    "vllm._rust_tool_parser",
)


def abi_check(py: Path, store: Path) -> list[tuple[str, str]]:
    """Load each compiled module of vLLM's wheel with RTLD_NOW (every undefined symbol resolved
    at load) against the rehearsal's torch 2.11.0, with a failing libcuda stub."""
    stub = build_libcuda_stub(REHEARSE_DIR / "libcuda-stub")
    if stub is None:
        return [("all", "skipped: no C compiler for the libcuda stub")]
    env = store_env(store)
    env["LD_LIBRARY_PATH"] = f"{stub}:{env.get('LD_LIBRARY_PATH', '')}"
    code = (
        "import importlib, json, sys, torch\nsys.setdlopenflags(2 | 256)\nout = []\n"
        f"for m in {list(ABI_MODULES)!r}:\n"
        "    try:\n        importlib.import_module(m); out.append((m, 'loaded'))\n"
        "    except Exception as e:\n        out.append((m, f'{type(e).__name__}: {e}'))\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run([str(py), "-c", code], env=env, capture_output=True, text=True, cwd="/")
    if proc.returncode != 0:
        return [("all", f"the loading process failed: {proc.stderr[-500:]}")]
    return [tuple(x) for x in json.loads(proc.stdout.strip().splitlines()[-1])]


def _script(py: Path, *args: str, store: Path) -> subprocess.CompletedProcess:
    cmd = [str(py), str(Path(__file__).resolve()), *args, "--store", str(store)]
    log("$ " + " ".join(cmd[1:]))
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)


def cmd_rehearse(args: argparse.Namespace) -> None:
    t0 = time.time()
    if not (CARRY_DIR / "manifest.json").exists() or load_manifest(CARRY_DIR / "manifest.json").get(
        "lock_sha256"
    ) != sha256_file(LOCK):
        log("parts missing or older than the lock: preparing")
        cmd_prepare(argparse.Namespace(part_mib=PART_LIMIT // MIB))
    manifest = load_manifest(CARRY_DIR / "manifest.json")
    py = ensure_base(manifest)
    store = REHEARSE_DIR / "carry"
    shutil.rmtree(store, ignore_errors=True)
    checks = []

    def expect(name: str, ok: bool, detail: str = "") -> None:
        checks.append((name, ok))
        print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}")

    parts = sorted(manifest["parts"], key=_parts_order)
    r = _script(py, "install", store=store)
    expect(
        "install refuses before any part arrived",
        r.returncode == 2,
        (r.stdout + r.stderr).strip().splitlines()[-1],
    )
    t_recv = time.time()
    for part in parts[:-1]:
        r = _script(py, "receive", str(CARRY_DIR / part), store=store)
        expect(f"receive {part}", r.returncode == 0, r.stdout.strip().splitlines()[-1])
    r = _script(py, "install", store=store)
    expect(
        f"install refuses while {parts[-1]} is missing",
        r.returncode == 2 and parts[-1] in r.stdout,
        r.stdout.strip().splitlines()[-1],
    )
    r = _script(py, "receive", *[str(CARRY_DIR / p) for p in parts], store=store)
    expect(
        "receive of every part again, the last one new (idempotent)",
        r.returncode == 0 and "missing none" in r.stdout,
        r.stdout.strip().splitlines()[0],
    )
    t_recv = time.time() - t_recv
    t_inst = time.time()
    r = _script(py, "install", store=store)
    expect("install", r.returncode == 0, f"{time.time() - t_inst:.1f} s")
    if r.returncode != 0:
        print(r.stdout + r.stderr[-3000:])
    print(r.stdout.strip())
    t_inst = time.time() - t_inst
    for mod, outcome in abi_check(py, store):
        expect(f"load {mod} against torch 2.11.0 (libcuda stub)", outcome == "loaded", outcome)
    # vllm/platforms/cuda.py loads vLLM's compiled ops at import: with the failing libcuda stub
    # they load here too (the ABI check above), so the walk sees what a GPU machine imports.
    stub = {"LD_LIBRARY_PATH": str(REHEARSE_DIR / "libcuda-stub")}
    report = import_check(store, walk=not args.no_walk, double=True, python=str(py), env_extra=stub)
    genuine = run_imports(
        str(py),
        ["vllm:LLM", "vllm.v1.engine.core", "ascend_mepic.plugin"],
        {**store_env(store), "VLLM_LOGGING_LEVEL": "ERROR"},
        double=False,
    )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(f"import check in {py} with vLLM's CUDA platform reporting an H200 (no driver here):")
    failures = summarize(report)
    print(
        "without the platform double (as this machine resolves it): "
        + ", ".join(
            f"{r['module']} {'ok' if r['ok'] else r['type'] + ': ' + r['message'][:120]}"
            for r in genuine
        )
    )
    expect("no import fails on a missing or mismatched package", failures == 0)
    print(
        f"rehearsal: {sum(ok for _, ok in checks)}/{len(checks)} checks passed; receive "
        f"{t_recv:.1f} s, install {t_inst:.1f} s, import check {report['seconds']} s, total "
        f"{time.time() - t0:.0f} s"
    )
    raise SystemExit(0 if all(ok for _, ok in checks) else 1)


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("lock", help="resolve and pin the carried set (here; network, uv)")
    p = sub.add_parser("prepare", help="download, slim vLLM, write .gpu-carry/partN (here)")
    p.add_argument("--part-mib", type=int, default=PART_LIMIT // MIB)
    p = sub.add_parser("receive", help="copy parts into the store, checked by sha256 (GPU)")
    p.add_argument("parts", nargs="+", help="part folders, e.g. .gpu-carry/part1")
    p = sub.add_parser("install", help="install the received carry (GPU)")
    p.add_argument("--force", action="store_true", help="reinstall even if installed")
    p = sub.add_parser("check", help="import vLLM's GPU path and this project's (GPU)")
    p.add_argument("--walk", action="store_true", help="also import every vllm module")
    p.add_argument("--double", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", help="write the full report here")
    sub.add_parser("plan", help="print the device calls")
    p = sub.add_parser("rehearse", help="the GPU side in a clean Python 3.12 (here)")
    p.add_argument("--no-walk", action="store_true", help="skip the walk over every module")
    p.add_argument("--json", help="write the import report here")
    p = sub.add_parser("_import-worker")
    p.add_argument("--double", action="store_true")
    for name in ("receive", "install", "check", "rehearse"):
        sub.choices[name].add_argument("--store", type=Path, default=DEFAULT_STORE)
    for name in ("install", "check"):
        sub.choices[name].add_argument("--checkout", default=str(ROOT))
    args = parser.parse_args(argv)
    {
        "lock": cmd_lock,
        "prepare": cmd_prepare,
        "receive": cmd_receive,
        "install": cmd_install,
        "check": cmd_check,
        "plan": cmd_plan,
        "rehearse": cmd_rehearse,
        "_import-worker": _worker,
    }[args.cmd](args)


if __name__ == "__main__":
    main()
