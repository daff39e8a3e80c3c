#!/usr/bin/env bash
# Device call E: the Hopper sweep over 20 grid shapes of at least 1 TFLOP (2MNK >= 1e12), every kernel gated.
set -uo pipefail
OUT=${OUT:-/tmp/l2ir-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout ${E_TIMEOUT:-470} python3 -m l2ir.cli bench --target sm90a --shapes 20 --min-gflop 1000 --sweep pingpong_128x128x64_c1x1 pingpong_128x128x64_c1x2 pingpong_64x256x64_c1x1 pingpong_64x256x64_c2x1 coop_128x256x64_c1x1 --budget-s ${E_BUDGET:-400} \
  --out bench/results/sm90_1tflop_h200 > "$OUT/sm90_1tflop.log" 2>&1
echo "== exit $?"; tail -45 "$OUT/sm90_1tflop.log"
cp "$OUT/sm90_1tflop.log" bench/results/sm90_1tflop_h200.log
tar czf "$OUT/results.tgz" bench/results/sm90_1tflop_h200.*
