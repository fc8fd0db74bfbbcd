"""vLLM 0.30.0's own ``tests/v1/core``, run with MEPIC's scheduler and KV manager substituted.

``make test-vllm-core`` runs this. It

1. downloads vLLM 0.30.0's sdist from PyPI once (into ``.cache/vllm-core-tests/``, ignored by
   git) and checks its SHA-256 (pinned below, the digest PyPI lists for the file);
2. unpacks from it only what the tests need: ``tests/v1/core`` and the modules it imports
   (``tests/v1/kv_connector/unit/utils.py``, the packages' ``__init__.py``) and vLLM's
   ``pyproject.toml`` (its pytest markers). This repository never holds a copy of them;
3. writes the ``config.json`` of the Hugging Face models whose configuration the tests read
   (``ModelConfig(model=...)``, never the weights) into a Hugging Face cache of its own, from the
   models' published configurations, since the test machines have no Hugging Face Hub access
   (``HF_HUB_OFFLINE=1``);
4. runs pytest there, in place, once per policy (``default``: MEPIC's default policy, and
   ``full``), with ``tests/vllm_core/mepic_substitution.py`` loaded (``-p``): it substitutes
   MEPIC's classes and classifies each outcome against ``tests/vllm_core/expectations.toml``.
   vLLM's top-level ``tests/conftest.py`` is not loaded (``--confcutdir``): it imports test-only
   packages MEPIC's environment does not have (tblib, the model test helpers), and nothing in
   ``tests/v1/core`` but the fixture ``caplog_vllm`` comes from it.

The exit status is the first failing run's. ``--policy`` runs one policy; other arguments go
to pytest (``-k``, ``-x``; ``--mepic-strict`` is dropped when a selection is given).

    .venv/bin/python scripts/vllm_core_tests.py [--policy default|full] [pytest args]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache" / "vllm-core-tests"
VERSION = "0.30.0"
SDIST_URL = (
    "https://files.pythonhosted.org/packages/3d/88/"
    "fc455e2e8cd81764a81027a7464f775a7d613e6c95ac00e23b47824bf10d/vllm-0.30.0.tar.gz"
)
SDIST_SHA256 = "5f8f4e890c042ffa1c3e103f81c35e2d96f60a0a175ac43a4adbae7006bef62b"
TOP = f"vllm-{VERSION}"
# What is unpacked: tests/v1/core and what it imports, nothing else.
MEMBERS = (
    "pyproject.toml",
    "tests/__init__.py",
    "tests/v1/__init__.py",
    "tests/v1/core/",
    "tests/v1/kv_connector/__init__.py",
    "tests/v1/kv_connector/unit/__init__.py",
    "tests/v1/kv_connector/unit/utils.py",
)
PLUGIN_DIR = REPO / "tests" / "vllm_core"
POLICIES = ("default", "full")

# The configuration fields the tests read, from each model's published config.json (no weights:
# the tests build ModelConfig / VllmConfig, never a model). facebook/opt-125m is vLLM's
# create_scheduler default, Qwen/Qwen3-0.6B ModelConfig's default model, opt-350m and Qwen1.5-7B
# are named by single tests. Multimodal models (LLaVA, Qwen2.5-VL) are not provided: their
# model classes need torchvision (expectations.toml, not_applicable.multimodal_models).
HF_CONFIGS: dict[str, dict] = {
    "facebook/opt-125m": {
        "architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 768,
        "num_hidden_layers": 12, "num_attention_heads": 12, "ffn_dim": 3072,
        "max_position_embeddings": 2048, "vocab_size": 50272, "word_embed_proj_dim": 768,
        "do_layer_norm_before": True, "torch_dtype": "float16", "bos_token_id": 2,
        "eos_token_id": 2, "pad_token_id": 1,
    },
    "facebook/opt-350m": {
        "architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 1024,
        "num_hidden_layers": 24, "num_attention_heads": 16, "ffn_dim": 4096,
        "max_position_embeddings": 2048, "vocab_size": 50272, "word_embed_proj_dim": 512,
        "do_layer_norm_before": False, "torch_dtype": "float16", "bos_token_id": 2,
        "eos_token_id": 2, "pad_token_id": 1,
    },
    "Qwen/Qwen1.5-7B": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 4096,
        "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 32, "max_position_embeddings": 32768, "max_window_layers": 28,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
        "use_sliding_window": False, "vocab_size": 151936, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151643,
    },
    "Qwen/Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
        "max_window_layers": 28, "rms_norm_eps": 1e-06, "rope_theta": 1000000,
        "sliding_window": None, "use_sliding_window": False, "tie_word_embeddings": True,
        "vocab_size": 151936, "torch_dtype": "bfloat16", "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
}
SNAPSHOT = "0" * 40  # a local snapshot name; nothing is fetched


def log(message: str) -> None:
    print(f"[vllm-core-tests] {message}", file=sys.stderr, flush=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_sdist() -> Path:
    """The sdist, downloaded once and checked (a file that fails the check is fetched again)."""
    path = CACHE / f"vllm-{VERSION}.tar.gz"
    if path.exists() and _sha256(path) == SDIST_SHA256:
        return path
    CACHE.mkdir(parents=True, exist_ok=True)
    log(f"downloading {SDIST_URL}")
    tmp = path.with_suffix(".part")
    with urllib.request.urlopen(SDIST_URL, timeout=120) as response, tmp.open("wb") as f:
        shutil.copyfileobj(response, f)
    got = _sha256(tmp)
    if got != SDIST_SHA256:
        tmp.unlink()
        raise SystemExit(f"vllm-{VERSION}.tar.gz: SHA-256 {got}, expected {SDIST_SHA256}")
    tmp.replace(path)
    return path


def unpack(sdist: Path) -> Path:
    """vLLM's test files, unpacked afresh next to the sdist; the folder tests run in."""
    root = CACHE / TOP
    stamp = root / ".unpacked"
    if stamp.exists() and stamp.read_text() == SDIST_SHA256:
        return root
    shutil.rmtree(root, ignore_errors=True)
    with tarfile.open(sdist) as tar:
        wanted = [
            m for m in tar.getmembers()
            if any(m.name == f"{TOP}/{x}" or (x.endswith("/") and m.name.startswith(f"{TOP}/{x}"))
                   for x in MEMBERS)
        ]
        tar.extractall(CACHE, members=wanted, filter="data")
    stamp.write_text(SDIST_SHA256)
    return root


def write_hf_configs() -> Path:
    hub = CACHE / "hf" / "hub"
    for repo, config in HF_CONFIGS.items():
        folder = hub / ("models--" + repo.replace("/", "--"))
        snapshot = folder / "snapshots" / SNAPSHOT
        snapshot.mkdir(parents=True, exist_ok=True)
        (folder / "refs").mkdir(exist_ok=True)
        (folder / "refs" / "main").write_text(SNAPSHOT)
        (snapshot / "config.json").write_text(json.dumps(config, indent=1))
    return hub.parent


def run_policy(root: Path, hf_home: Path, policy: str, pytest_args: list[str]) -> int:
    env = dict(os.environ)
    env.update(
        # vLLM's files first, so that ``tests`` is vLLM's test package; then this checkout
        # (``ascend_mepic``) and the plugin's folder.
        PYTHONPATH=os.pathsep.join(
            [str(root), str(REPO), str(PLUGIN_DIR), env.get("PYTHONPATH", "")]
        ).rstrip(os.pathsep),
        HF_HOME=str(hf_home),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
        VLLM_CPU_OMP_THREADS_BIND="nobind",
    )
    selecting = any(a in ("-k", "-m") or a.startswith(("-k", "-m", "tests/")) for a in pytest_args)
    report = CACHE / f"outcomes-{policy}.json"
    cmd = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "mepic_substitution",
        "-c", str(root / "pyproject.toml"), "--rootdir", str(root),
        "--confcutdir", str(root / "tests" / "v1"),
        "--mepic-policy", policy, "--mepic-report", str(report), "-rfE",
        *([] if selecting else ["--mepic-strict", "tests/v1/core"]),
        *pytest_args,
    ]
    log(f"policy {policy}: {' '.join(cmd[1:])}")
    start = time.monotonic()
    rc = subprocess.call(cmd, cwd=root, env=env)
    log(f"policy {policy}: exit {rc} in {time.monotonic() - start:.0f} s")
    return rc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--policy", choices=POLICIES, action="append")
    args, pytest_args = parser.parse_known_args(argv)
    root = unpack(fetch_sdist())
    hf_home = write_hf_configs()
    codes = [run_policy(root, hf_home, p, pytest_args) for p in args.policy or POLICIES]
    return next((c for c in codes if c), 0)


if __name__ == "__main__":
    sys.exit(main())
