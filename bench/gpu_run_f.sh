#!/usr/bin/env bash
# Device call F: the raw CUDA/PTX sm80 rule (mma.sync, ldmatrix, cp.async) through the evaluator's gates and timing.
set -uo pipefail
OUT=${OUT:-/tmp/l2ir-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout 300 python3 -m l2ir.cli bench --target sm80 --backend cuda_ptx_sm80 --shapes 0 --shape 4096x4096x4096 \
  --shape 1000x1000x1000 --shape 127x136x72 --shape 64x64x64 --shape 8192x8192x512 \
  --out bench/results/cuda_ptx_sm80_h200 > "$OUT/ptx_sm80.log" 2>&1
echo "== exit $?"; tail -40 "$OUT/ptx_sm80.log"
cp "$OUT/ptx_sm80.log" bench/results/cuda_ptx_sm80_h200.log
tar czf "$OUT/results.tgz" bench/results/cuda_ptx_sm80_h200.*
