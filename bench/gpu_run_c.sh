#!/usr/bin/env bash
# Device call C: extend the Hopper benchmark (resume: only new configurations are evaluated), repeat it against
# torch.matmul with PyTorch's default flags, and run every GPU-marked test.
set -uo pipefail
OUT=${OUT:-/tmp/l2ir-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
SHAPES="--shapes 14 --min-gflop 100 --shape 4096x4096x4096 --shape 8192x8192x8192 --shape 16384x16384x256
  --shape 16384x16384x512 --shape 8192x8192x512 --shape 12288x12288x256 --shape 16384x8192x512 --shape 8192x16384x256"
timeout 200 python3 -m l2ir.cli bench --target sm90a $SHAPES --out bench/results/sm90_large_h200 \
  > "$OUT/sm90_bench.log" 2>&1; echo "== sm90 contract exit $?"; tail -14 "$OUT/sm90_bench.log"
timeout 200 python3 -m l2ir.cli bench --target sm90a $SHAPES --torch-defaults --out bench/results/sm90_large_torchdefault_h200 \
  > "$OUT/sm90_torchdefault.log" 2>&1; echo "== sm90 torch-defaults exit $?"; tail -34 "$OUT/sm90_torchdefault.log"
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests > "$OUT/gpu_tests.log" 2>&1; echo "== gpu tests exit $?"; tail -5 "$OUT/gpu_tests.log"
cp bench/results/sm90_large_h200.* bench/results/sm90_large_torchdefault_h200.* "$OUT/" 2>/dev/null
