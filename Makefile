# The two commands a new user runs: `make demo` and `make test`. Both create the environment first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.ascend-mepic-setup
DEMO_DIR ?= results/demo

.PHONY: setup lock test test-vllm-core test-ascend test-ascend-compile test-npu test-gpu test-gpu-kernels test-cuda-compile lint demo bench clean

setup: $(STAMP)

# The environment is installed from requirements/main.lock (made by `make lock`, see
# requirements/README.md): exact versions and hashes for CPython 3.11 on x86_64 Linux, resolved by
# uv from requirements/main.in with requirements/excludes.txt (what is kept out: CUDA builds that
# cannot load beside the CPU torch, the model and data packages' heavy dependencies, LMCache's CUDA
# extras). torch's CPU build comes from TORCH_WHEELS: this machine's wheel folder if it has the
# file, else PyTorch's CPU index.
UV_VERSION := 0.13.9
UV := $(VENV)/bin/uv
LOCK := requirements/main.lock
TORCH_WHEEL := torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl
TORCH_WHEELS ?= $(if $(wildcard /opt/wheels/$(TORCH_WHEEL)),/opt/wheels,https://download.pytorch.org/whl/cpu/torch/)
LOCK_FLAGS := --excludes requirements/excludes.txt --overrides requirements/overrides.txt \
	--python-version 3.11 --python-platform x86_64-manylinux_2_28 --generate-hashes \
	--no-emit-package ascend-mepic --no-header --find-links $(TORCH_WHEELS)

$(VENV)/bin/python:
	@$(PYTHON) -c 'import sys, platform; ok = sys.version_info[:2] == (3, 11) and platform.machine() == "x86_64"; \
		ok or sys.exit(f"requirements/main.lock is for CPython 3.11 on x86_64 Linux; {sys.executable} is " \
		f"{platform.python_version()} on {platform.machine()}: run make with PYTHON=python3.11")'
	$(PYTHON) -m venv $(VENV)

$(UV): | $(VENV)/bin/python
	$(PIP) install -q uv==$(UV_VERSION)

# --compile-bytecode: uv writes no .pyc by default, and where PYTHONDONTWRITEBYTECODE is set
# Python never writes them either, so every process compiled vLLM, torch and transformers from
# source again: `from vllm import LLM` took 27 s instead of 11 s on 2 cores. With the flag uv
# compiles what it installs, once, at set-up.
$(STAMP): setup.py Makefile $(LOCK) | $(UV)
	$(UV) pip sync -q --python $(PY) --compile-bytecode --find-links $(TORCH_WHEELS) $(LOCK)
	$(UV) pip install -q --python $(PY) --no-deps --no-build-isolation --compile-bytecode -e ".[eval]"
	command -v redis-server >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& apt-get install -y -q redis-server >/dev/null; } \
		|| echo "note: no redis-server; the Redis tier test will be skipped" >&2
	$(PY) -m ascend_mepic.ops.cpu_kernel || echo "WARNING: the native CPU kernel (csrc/) did not build; the CPU path will use the slower torch reference" >&2
	touch $(STAMP)

# Re-resolve the lock from requirements/main.in (newest versions the constraints allow); review
# the diff of requirements/main.lock, then `make setup` installs exactly it. LOCK_UPGRADE= keeps
# the current pins where main.in still allows them (to add or drop a package only).
LOCK_UPGRADE ?= --upgrade
lock: | $(UV)
	$(UV) pip compile requirements/main.in $(LOCK_FLAGS) $(LOCK_UPGRADE) -o $(LOCK)

lint: setup
	$(VENV)/bin/ruff check ascend_mepic cuda_fallback tests benchmarks scripts

# The Ascend suite (scripts/test_ascend.sh, its own venv from requirements/ascend.lock: first run
# about 1.5 min, mostly downloads; seconds with a warm uv cache) runs beside the main suite: it is
# one process most of its time, so beside the main suite it fills what the main suite leaves of
# the cores (most of all at the end, when one worker has finished), rather than running alone
# after it on one core. Its output is printed after the main suite's; the exit status is the
# first failure's. The CPU kernel is (re)built first if csrc/ changed, so no test pays for it.
# The main suite runs on TEST_WORKERS pytest-xdist workers, whole files per worker (module
# fixtures are made once; tests/conftest.py sends the slowest files first, an order that
# --no-loadscope-reorder keeps: xdist's default sorts files by their number of tests); each
# worker keeps its engine hosts (tests/engine_host.py), so an engine job pays vLLM's imports
# once per worker.
# Each worker may hold two engine hosts and an engine (1-2 GB each): raise it with care.
# The suite runs three to five processes at once on two cores. Each runs one OpenMP thread
# (OMP_NUM_THREADS=1; tests whose subject is the thread split, such as tests/ops/test_cpu_kernel.py,
# set their own count), OpenMP threads sleep while they wait (OMP_WAIT_POLICY=PASSIVE: spinning
# for a thread that is not running made three such files side by side 4.4x slower, 82 s against
# 19 s), and vLLM does not pin its CPU workers (VLLM_CPU_OMP_THREADS_BIND=nobind: its automatic
# binding puts every engine on core 0).
TEST_WORKERS ?= 2
test: export OMP_NUM_THREADS = 1
test: export OMP_WAIT_POLICY = PASSIVE
test: export VLLM_CPU_OMP_THREADS_BIND = nobind
test: setup lint
	@$(PY) -m ascend_mepic.ops.cpu_kernel >/dev/null || echo "WARNING: the native CPU kernel did not build"
	@{ scripts/test_ascend.sh --prepare && scripts/test_ascend.sh; } > .ascend-test.log 2>&1 & asc=$$!; \
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30 tests; main=$$?; \
	wait $$asc; ascend=$$?; \
	echo "== Ascend suite (scripts/test_ascend.sh, run beside the main suite) =="; \
	cat .ascend-test.log; \
	exit $$(( main != 0 ? main : ascend ))

# vLLM 0.30.0's own tests/v1/core with MEPIC's scheduler and KV manager substituted, under MEPIC's
# default policy and under `full` (scripts/vllm_core_tests.py: it downloads vLLM's sdist once into
# .cache/vllm-core-tests/, checks its SHA-256 and runs the tests there; the substitution and the
# expected outcomes are tests/vllm_core/). Fails when a test fails that the expectations do not
# list as a refusal by design, or when a listed refusal is no longer refused. About 5 minutes on
# 2 cores; not part of `make test` (.ci/run runs both).
test-vllm-core: export OMP_NUM_THREADS = 1
test-vllm-core: export OMP_WAIT_POLICY = PASSIVE
test-vllm-core: setup
	$(PY) scripts/vllm_core_tests.py

# The Ascend path without NPU, in its own venv .venv-ascend (made on first use): vllm-cpu 0.30.0 +
# vllm-ascend 0.30.0rc2 (no CANN kernels; torch_npu stubbed by tests/ascend/conftest.py) +
# triton-ascend, whose CPU interpreter runs cuda_fallback's Triton kernels. vllm-ascend's platform
# plugin takes over vLLM's platform and triton-ascend replaces the triton package, so this cannot
# share .venv.
test-ascend:
	scripts/test_ascend.sh

# The triton-ascend kernel's launches through triton-ascend's ttir and ttadapter stages, then
# BiSheng IR's bishengir-compile (ascendnpu-ir, in the Ascend lock) to the final HIVM for
# Ascend910B2 and B3, printing each launch's planned unified buffer and L1 against the chip's
# (tests/ops/test_ascend_compile.py; `make test` runs it too, quietly, answering unchanged
# launches from the HIVM cache in ~/.cache/ascend_mepic/hivm: tests/ops/ascend_hivm.py). No NPU,
# no CANN: the run stops where CANN's hivmc would make the binary. Here every launch compiles.
test-ascend-compile:
	scripts/test_ascend.sh --prepare
	env -u TRITON_INTERPRET TORCH_DEVICE_BACKEND_AUTOLOAD=0 ASCEND_HIVM_CACHE=0 \
		.venv-ascend/bin/python -m pytest -q -s \
		-p no:cacheprovider tests/ops/test_ascend_compile.py

# On a 910B (UNTESTED ON HARDWARE): `ascend-mepic doctor`, then tests/npu (kernel numerics against
# the oracle, a tiny model through MEPIC against stock vllm-ascend), in the Python of the Ascend
# environment (docs/ascend.md): the active virtualenv or conda env, else .venv, else python3;
# NPU_PY=/path/to/python picks another. Without an NPU every test there skips, with the reason.
# Both always run (the doctor's report helps read a test failure); the exit status is the first
# failure's. No `setup`: .venv is the CPU environment.
NPU_PY ?= $(or $(VIRTUAL_ENV:%=%/bin/python),$(CONDA_PREFIX:%=%/bin/python),$(wildcard $(PY)),python3)
test-npu:
	@$(NPU_PY) -m ascend_mepic.entrypoints.cli doctor; doctor=$$?; \
	$(NPU_PY) -m pytest -q -rs -m npu tests/npu; tests=$$?; \
	exit $$(( doctor != 0 ? doctor : tests ))

# On a CUDA GPU (never run with vLLM on a GPU; the kernel tests ran on an H100):
# `ascend-mepic doctor`, then tests/gpu (the Triton kernels
# against the float64 oracle, benchmarks/ops/bench_triton_gpu.py at a tiny size, a tiny model
# through MEPIC against stock vLLM with piecewise CUDA graphs and once eager), in the Python of a
# CUDA environment (CUDA torch, vLLM 0.30.0's CUDA build, `pip install -e .` of this package):
# the active virtualenv or conda env, else .venv, else python3; GPU_PY=/path/to/python picks
# another. Without a GPU every test there skips, with the reason. Both always run; the exit
# status is the first failure's.
# GPU_PYTEST_ARGS passes more to pytest, e.g. "-n 8" (pytest-xdist: the engine tests' engines
# each ask for 20% of the GPU's memory free at start and use a 256 MiB KV pool, so several fit).
GPU_PY ?= $(or $(VIRTUAL_ENV:%=%/bin/python),$(CONDA_PREFIX:%=%/bin/python),$(wildcard $(PY)),python3)
GPU_PYTEST_ARGS ?=
test-gpu:
	@$(GPU_PY) -m ascend_mepic.entrypoints.cli doctor; doctor=$$?; \
	$(GPU_PY) -m pytest -q -rs -m gpu $(GPU_PYTEST_ARGS) tests/gpu; tests=$$?; \
	exit $$(( doctor != 0 ? doctor : tests ))

# The Triton kernels alone on a GPU machine without vLLM (CUDA torch and Triton are enough; this
# checkout is put on the path, nothing is installed): how they ran on an H100 (docs/results.md).
test-gpu-kernels:
	PYTHONPATH=$(CURDIR) $(GPU_PY) -m pytest -q -rs -m gpu tests/gpu/test_gpu_kernels.py

# The CUDA Triton kernels compiled for sm_90a and sm_80 on this machine (no GPU), every launch
# launch_config can choose, with Triton's compiler and the ptxas in its wheel, printing registers,
# spills and cp.async per launch (tests/ops/test_cuda_compile.py; `make test` runs it too, quietly).
test-cuda-compile: setup
	$(VENV)/bin/pytest -q -s -p no:cacheprovider tests/ops/test_cuda_compile.py

# The paper's Table 2 comparison in a quick size on CPU: a SQuAD trace, the KV planner over it, then
# full / EPIC-16 / CacheBlend-15 / MEPIC in the real engine. Ends with a short summary, a plot
# ($(DEMO_DIR)/bench_compare/summary.png) and a verdict against Table 2. Logs go to stderr.
demo: setup
	$(VENV)/bin/ascend-mepic prepare --model smollm2
	$(VENV)/bin/ascend-mepic trace squad --requests 200 --qps 25 --chunks 4 --seed 0 \
		--tokenizer smollm2 --out $(DEMO_DIR)/squad_trace.jsonl
	$(VENV)/bin/ascend-mepic kvsim $(DEMO_DIR)/squad_trace.jsonl --placement all \
		--block-size 128 --num-blocks 2048 --json $(DEMO_DIR)/kvsim.json
	$(VENV)/bin/ascend-mepic bench compare --quick --block-size 128 --kv-gib 3 --no-progress \
		--out $(DEMO_DIR)/bench_compare

bench: setup
	$(PY) benchmarks/bench_kvsim.py
	$(PY) benchmarks/bench_sched_cost.py

clean:
	rm -rf $(VENV) .venv-ascend .ascend-test.log results .pytest_cache .ruff_cache
