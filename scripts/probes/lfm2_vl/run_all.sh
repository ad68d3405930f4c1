#!/bin/bash
# Probe (issue 44): build the tiny LFM2-VL and run the four cases; results under ${OUT:-/tmp/lfm2vl_probe}.
set -u
cd "$(dirname "$0")/../../.."
source .venv/bin/activate
OUT=${OUT:-/tmp/lfm2vl_probe}; mkdir -p "$OUT"
[ -f "$OUT/bf16/config.json" ] || python scripts/probes/lfm2_vl/build_lfm2_vl.py "$OUT/bf16"
for case in "plain_bf16:" "conn_bf16:--connector" "plain_fp32:--float32" "conn_fp32:--float32 --connector"; do
  name=${case%%:*}; flags=${case#*:}
  start=$(date +%s)
  python scripts/probes/lfm2_vl/run_probe.py "$OUT/bf16" $flags --out "$OUT/$name.json" > "$OUT/$name.out" 2>&1
  echo "$name rc=$? $(( $(date +%s) - start ))s"
done
