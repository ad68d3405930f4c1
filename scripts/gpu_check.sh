#!/usr/bin/env bash
# The prepared device run (`make gpu-check`, or through the device tool): on a GPU machine with
# torch and no vLLM, run the data-path tests on cuda, `bench gpu` and the GPUDirect Storage
# probe; results under $OUT (default ./gpu-check-out). Sized for < 8 minutes.
# Missing Python packages travel as wheels in .whl/ (see docs/benchmarks.md); none were
# missing on the lent H100 image (torch 2.11, numpy, xxhash, pyyaml, pytest, matplotlib).
set -u
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
PY=${PY:-python3}
exec > >(tee "$OUT/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1
start=$(date +%s)
step() { echo; echo "=== $* ($(( $(date +%s) - start )) s)"; }

step machine
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv || true
$PY -c 'import torch, sys; print(sys.version.split()[0], "torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'
uptime

if ls .whl/*.whl >/dev/null 2>&1; then
  step wheels
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

# The package as pip lays it out (backends/ is hybrid_offload.backends), outside the tree so
# that the repository's hybrid_offload/ does not shadow it.
PKG=/tmp/hybrid-offload-pkg
rm -rf "$PKG" && mkdir -p "$PKG"
cp -r hybrid_offload "$PKG/" && rm -rf "$PKG/hybrid_offload/backends" && cp -r backends "$PKG/hybrid_offload/backends"
cp -r tests/datapath "$PKG/tests_datapath"
export PYTHONPATH=$PKG${PYTHONPATH:+:$PYTHONPATH}

step "data-path tests (cpu and cuda)"
(cd "$PKG" && timeout 150 $PY -m pytest --noconftest -p no:cacheprovider -q -rs --durations=8 --timeout 60 \
  tests_datapath --junitxml="$OUT/datapath-junit.xml")
tests_rc=$?
echo "tests exit code: $tests_rc"

step "bench gpu"
(cd "$PKG" && timeout 200 $PY -m hybrid_offload.tools.bench.gpu --out "$OUT" ${BENCH_ARGS:-})
bench_rc=$?
echo "bench exit code: $bench_rc"

step "GPUDirect Storage probe"
df -T /var/tmp /tmp | tail -n +2
ls /dev/nvidia* 2>/dev/null | tr '\n' ' '; echo
printf '{"logging": {"dir": "%s", "level": "INFO"}, "properties": {"allow_compat_mode": true}}\n' "$OUT" > /tmp/cufile.json
CUFILE_ENV_PATH_JSON=/tmp/cufile.json timeout 60 $PY scripts/gds_probe.py | tee "$OUT/gds_probe.json"
ls "$OUT"/cufile*.log >/dev/null 2>&1 && tail -n 30 "$OUT"/cufile*.log

step done
echo "tests=$tests_rc bench=$bench_rc"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
