# hybrid-offload: `make demo` (the main job) and `make test` (all tests).
# Both run scripts/setup.sh first: idempotent, seconds when everything is installed.
PY := .venv/bin/python
PYTEST_WORKERS ?= 2

.PHONY: setup demo test lint clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m hybrid_offload.cli.main demo

test: setup
	$(PY) -m ruff check .
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup -q -p no:cacheprovider

lint: setup
	$(PY) -m ruff check .

clean:
	rm -rf demo-output .pytest_cache .ruff_cache
