#!/usr/bin/env bash
# Device call A: the evaluator's GPU tests, a one-shape sm90 bench through the evaluator (host-shim path), then the
# sm80 grid benchmark of issue 3 (resumable: rerun to continue). Everything lands in $OUT/results.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/l2ir-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p bench/results
l2ir() { python3 -m l2ir.cli "$@"; }
timeout 150 bash bench/gpu_evaluator_check.sh -q > "$OUT/evaluator.log" 2>&1; echo "== evaluator exit $?"; tail -15 "$OUT/evaluator.log"
timeout 120 python3 -m l2ir.cli bench --target sm90a --shapes 0 --shape 4096x4096x4096 \
  --sweep pingpong_128x128x64_c1x1 --out "$OUT/sm90_smoke" > "$OUT/sm90_smoke.log" 2>&1; echo "== sm90 smoke exit $?"; tail -12 "$OUT/sm90_smoke.log"
timeout ${SM80_TIMEOUT:-330} python3 -m l2ir.cli bench --target sm80 --shapes 40 --budget-s ${SM80_BUDGET:-270} \
  --out bench/results/sm80_grid40_h200 > "$OUT/sm80_bench.log" 2>&1; echo "== sm80 bench exit $?"; tail -30 "$OUT/sm80_bench.log"
cp bench/results/sm80_grid40_h200.* "$OUT/" 2>/dev/null
tar czf "$OUT/results.tgz" -C "$OUT" --exclude results.tgz . 2>/dev/null
