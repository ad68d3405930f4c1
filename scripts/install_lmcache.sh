#!/usr/bin/env bash
# Install LMCache 0.5.6 into the project venv for the `lmcache` backend, without its CUDA stack.
#
# LMCache's declared dependencies pull torch (CUDA), cupy-cuda13x, cuda-python, nvtx, ... and
# pins that conflict with this venv (numpy<=2.2.6, protobuf<7, ...). So, as shared/PLATFORM.md
# says, it goes in with --no-deps, plus the few pure-Python packages the storage stack the
# backend uses (lmcache.v1.storage_backend: connectors, memory objects, config) imports that
# the venv does not already have. Every package is pinned and installed with --no-deps, so pip
# never resolves (or replaces) torch, numpy or anything else already installed.
#
# Idempotent: when every pinned version is present it returns without calling pip.
# Run it after torch/vllm are installed (scripts/setup.sh order); PYTHON=... overrides the venv.
set -euo pipefail
cd "$(dirname "$0")/.."

PYBIN=${PYTHON:-.venv/bin/python}
# name==version, installed in this order (aiofile needs caio at import).
PACKAGES=(
  "caio==0.12.10"
  "aiofile==3.12.3"
  "aiofiles==25.1.0"
  "lmcache==0.5.6"
)

missing=$("$PYBIN" - "${PACKAGES[@]}" <<'PYEOF'
import sys
from importlib.metadata import PackageNotFoundError, version
for spec in sys.argv[1:]:
    name, want = spec.split("==")
    try:
        have = version(name)
    except PackageNotFoundError:
        have = None
    if have != want:
        print(spec)
PYEOF
)
if [ -z "$missing" ]; then
  exit 0
fi

echo "[install_lmcache] installing (--no-deps): $(echo $missing | tr '\n' ' ')"
# shellcheck disable=SC2086  # one argument per spec
"$PYBIN" -m pip --disable-pip-version-check -q install --no-deps $missing

"$PYBIN" - <<'PYEOF'
import torch
assert torch.__version__.startswith("2.13.0") and "+cpu" in torch.__version__, torch.__version__
import lmcache.v1.storage_backend.connector  # noqa: F401  (the layer the backend uses)
from importlib.metadata import version
print("[install_lmcache] lmcache", version("lmcache"), "torch", torch.__version__)
PYEOF
