#!/usr/bin/env bash
# Device call G (after the review fixes): the GPU tests (planted defects vs the stricter gates), then the Hopper
# benchmark again with the corrected server timing and the current seeds.
set -uo pipefail
OUT=${OUT:-/tmp/l2ir-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests > "$OUT/gpu_tests.log" 2>&1
echo "== gpu tests exit $?"; tail -6 "$OUT/gpu_tests.log"
SHAPES="--shapes 14 --min-gflop 100 --shape 4096x4096x4096 --shape 8192x8192x8192 --shape 16384x16384x256
  --shape 16384x16384x512 --shape 8192x8192x512 --shape 12288x12288x256 --shape 16384x8192x512 --shape 8192x16384x256"
timeout ${G_TIMEOUT:-330} python3 -m l2ir.cli bench --target sm90a $SHAPES --budget-s ${G_BUDGET:-270} \
  --out bench/results/sm90_large_v2_h200 > "$OUT/sm90_v2.log" 2>&1
echo "== sm90 v2 exit $?"; tail -42 "$OUT/sm90_v2.log"
cp "$OUT/sm90_v2.log" bench/results/sm90_large_v2_h200.log; cp "$OUT/gpu_tests.log" bench/results/gpu_tests_v2_h200.log
tar czf "$OUT/results.tgz" bench/results/sm90_large_v2_h200.* bench/results/gpu_tests_v2_h200.log
