# hybrid-offload: `make demo` (the main job), `make test` (all tests) and `make serve`.
# All run scripts/setup.sh first: idempotent, seconds when everything is installed.
PY := .venv/bin/python
PYTEST_WORKERS ?= 2
# make serve CONFIG=configs/cpu_disk.yaml [MODEL=dir] [PORT=8000] [SERVE_HOST=127.0.0.1] [VLLM_ARGS=...]
CONFIG ?= configs/cpu_disk.yaml
MODEL ?=
PORT ?= 8000
SERVE_HOST ?= 127.0.0.1
VLLM_ARGS ?=

.PHONY: setup demo test lint typecheck clean serve gpu-check

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m hybrid_offload demo

test: setup
	$(PY) -m ruff check .
	$(PY) scripts/typecheck.py
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup -q -p no:cacheprovider --durations=25

serve: setup
	$(PY) -m hybrid_offload serve --config $(CONFIG) $(if $(MODEL),--model $(MODEL)) \
		--host $(SERVE_HOST) --port $(PORT) $(if $(VLLM_ARGS),-- $(VLLM_ARGS))

# On a GPU machine with torch (no vLLM needed): data-path tests on cuda, `bench gpu`, GDS probe.
gpu-check:
	bash scripts/gpu_check.sh

lint: setup
	$(PY) -m ruff check .

typecheck: setup
	$(PY) scripts/typecheck.py

clean:
	rm -rf demo-output .pytest_cache .ruff_cache
