#!/usr/bin/env bash
# Device call H: the GPU tests after the NVRTC-child and worker-memory fixes, then resume the Hopper v2 benchmark
# (only the measurements that ended in an error, such as out-of-memory, are taken again).
set -uo pipefail
OUT=${OUT:-/tmp/l2ir-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 110 python3 -m pytest -q -m gpu -p no:cacheprovider tests > "$OUT/gpu_tests.log" 2>&1
echo "== gpu tests exit $?"; tail -4 "$OUT/gpu_tests.log"
SHAPES="--shapes 14 --min-gflop 100 --shape 4096x4096x4096 --shape 8192x8192x8192 --shape 16384x16384x256
  --shape 16384x16384x512 --shape 8192x8192x512 --shape 12288x12288x256 --shape 16384x8192x512 --shape 8192x16384x256"
timeout 120 python3 -m l2ir.cli bench --target sm90a $SHAPES --out bench/results/sm90_large_v2_h200 > "$OUT/sm90_v2.log" 2>&1
echo "== sm90 v2 exit $?"; tail -16 "$OUT/sm90_v2.log"
cp "$OUT/gpu_tests.log" bench/results/gpu_tests_v2_h200.log; cp "$OUT/sm90_v2.log" bench/results/sm90_large_v2_h200_resume.log
tar czf "$OUT/results.tgz" bench/results/sm90_large_v2_h200.* bench/results/gpu_tests_v2_h200.log
