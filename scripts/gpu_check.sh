#!/usr/bin/env bash
# The prepared device run (`make gpu-check`, or through the device tool): on a GPU machine with
# torch and no vLLM, run the data-path tests on cuda, `bench gpu` and the GPUDirect Storage
# probe (GDS=0 skips it); results under $OUT (default ./gpu-check-out). Sized for < 8 minutes.
# With BASELINE=<dir> (a copy of an earlier commit's hybrid_offload/ and backends/), its
# `bench gpu` runs right after ours on the same machine, into $OUT/baseline, for ratios
# measured side by side.
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
package() {  # package SRC DEST
  rm -rf "$2" && mkdir -p "$2"
  cp -r "$1/hybrid_offload" "$2/" && rm -rf "$2/hybrid_offload/backends" && cp -r "$1/backends" "$2/hybrid_offload/backends"
}
PKG=/tmp/hybrid-offload-pkg
package . "$PKG"
cp -r tests/datapath "$PKG/tests_datapath"

step "data-path tests (cpu and cuda)"
(cd "$PKG" && PYTHONPATH=$PKG${PYTHONPATH:+:$PYTHONPATH} timeout 240 $PY -m pytest --noconftest -p no:cacheprovider -q -rs --durations=8 --timeout 60 \
  tests_datapath --junitxml="$OUT/datapath-junit.xml")
tests_rc=$?
echo "tests exit code: $tests_rc"

step "bench gpu"
(cd "$PKG" && PYTHONPATH=$PKG${PYTHONPATH:+:$PYTHONPATH} timeout 200 $PY -m hybrid_offload.tools.bench.gpu \
  --out "$OUT" ${BENCH_ARGS:-})
bench_rc=$?
echo "bench exit code: $bench_rc"

if [ -n "${BASELINE:-}" ]; then
  step "bench gpu, baseline ($BASELINE)"
  BASE=/tmp/hybrid-offload-baseline
  package "$BASELINE" "$BASE"
  mkdir -p "$OUT/baseline"
  (cd "$BASE" && PYTHONPATH=$BASE${PYTHONPATH:+:$PYTHONPATH} timeout 200 $PY -m hybrid_offload.tools.bench.gpu \
    --out "$OUT/baseline" ${BENCH_ARGS:-})
  echo "baseline bench exit code: $?"
fi

if [ "${GDS:-1}" != 0 ]; then
step "GPUDirect Storage probe"
df -T /var/tmp /tmp | tail -n +2
ls /dev/nvidia* 2>/dev/null | tr '\n' ' '; echo
printf '{"logging": {"dir": "%s", "level": "INFO"}, "properties": {"allow_compat_mode": true}}\n' "$OUT" > /tmp/cufile.json
CUFILE_ENV_PATH_JSON=/tmp/cufile.json timeout 60 $PY scripts/gds_probe.py | tee "$OUT/gds_probe.json"
ls "$OUT"/cufile*.log >/dev/null 2>&1 && tail -n 30 "$OUT"/cufile*.log
fi

step done
echo "tests=$tests_rc bench=$bench_rc"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
