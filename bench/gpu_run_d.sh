#!/usr/bin/env bash
# Device call D: regenerate the benchmark summaries with the per-kernel report (resume: no measurement is repeated)
# and run the raw CUDA/PTX backend through the evaluator's gates and timing. Results come back in $OUT/results.tgz.
set -uo pipefail
OUT=${OUT:-/tmp/l2ir-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
SHAPES="--shapes 14 --min-gflop 100 --shape 4096x4096x4096 --shape 8192x8192x8192 --shape 16384x16384x256
  --shape 16384x16384x512 --shape 8192x8192x512 --shape 12288x12288x256 --shape 16384x8192x512 --shape 8192x16384x256"
timeout 120 python3 -m l2ir.cli bench --target sm80 --shapes 40 --out bench/results/sm80_grid40_h200 > "$OUT/sm80.log" 2>&1
echo "== sm80 exit $?"; tail -12 "$OUT/sm80.log"
timeout 150 python3 -m l2ir.cli bench --target sm90a $SHAPES --out bench/results/sm90_large_h200 > "$OUT/sm90.log" 2>&1
echo "== sm90 exit $?"; tail -16 "$OUT/sm90.log"
timeout 200 python3 -m l2ir.cli bench --target sm90a --backend cuda_ptx --shapes 0 --shape 4096x4096x4096 \
  --shape 8192x8192x8192 --shape 8192x8192x512 --shape 16384x16384x512 --shape 1000x1000x1000 --shape 256x256x256 \
  --out bench/results/cuda_ptx_h200 > "$OUT/ptx.log" 2>&1
echo "== cuda_ptx exit $?"; tail -22 "$OUT/ptx.log"
cp "$OUT"/sm80.log bench/results/sm80_grid40_h200.log; cp "$OUT"/sm90.log bench/results/sm90_large_h200.log
cp "$OUT"/ptx.log bench/results/cuda_ptx_h200.log
tar czf "$OUT/results.tgz" bench/results
