PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: demo test bench clean

$(STAMP): pyproject.toml requirements/cpu.txt
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements/cpu.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

$(TEST_STAMP): $(STAMP) requirements/test.txt requirements/tpu-aot.txt
	$(PY) -m pip install --quiet -r requirements/test.txt
	$(PY) -m pip install --quiet --no-deps --upgrade --target $(VENV)/libtpu -r requirements/tpu-aot.txt
	touch $(TEST_STAMP)

demo: $(STAMP)
	$(PY) -m pagedjax.demo

test: $(TEST_STAMP)
	$(PY) -m pytest -n 2 -q tests

bench: $(TEST_STAMP)
	$(PY) benchmarks/kv_memory.py
	$(PY) benchmarks/scheduler_overhead.py
	$(PY) benchmarks/throughput.py
	$(PY) benchmarks/donation.py
	$(PY) benchmarks/prefix_caching.py
	$(PY) benchmarks/parallel_sampling.py
	$(PY) benchmarks/preemption.py
	$(PY) benchmarks/kv_int8.py
	$(PY) benchmarks/hf_load.py
	$(PY) benchmarks/vs_transformers.py
	$(PY) benchmarks/gpu_compile.py
	$(PY) benchmarks/tpu_schedule.py

clean:
	rm -rf $(VENV) build *.egg-info
