#!/usr/bin/env bash
# Device call B: the Hopper benchmark of issue 4 through the evaluator (every timed kernel gated), then the raw
# CUDA/PTX backend's check. Resumable: rerunning continues from bench/results/sm90_large_h200.jsonl.
set -uo pipefail
OUT=${OUT:-/tmp/l2ir-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p bench/results
timeout ${SM90_TIMEOUT:-420} python3 -m l2ir.cli bench --target sm90a --shapes 14 --min-gflop 100 \
  --shape 4096x4096x4096 --shape 8192x8192x8192 --shape 16384x16384x256 --shape 16384x16384x512 \
  --shape 8192x8192x512 --shape 12288x12288x256 --shape 16384x8192x512 --shape 8192x16384x256 \
  --budget-s ${SM90_BUDGET:-380} --out bench/results/sm90_large_h200 > "$OUT/sm90_bench.log" 2>&1
echo "== sm90 bench exit $?"; tail -40 "$OUT/sm90_bench.log"
cp bench/results/sm90_large_h200.* "$OUT/" 2>/dev/null
timeout ${PTX_TIMEOUT:-130} python3 bench/cuda_ptx_check.py ${PTX_ARGS:-} > "$OUT/cuda_ptx.log" 2>&1
echo "== cuda_ptx exit $?"; tail -30 "$OUT/cuda_ptx.log"
cp bench/results/cuda_ptx* "$OUT/" 2>/dev/null
