#!/usr/bin/env bash
# One device call that checks every GPU path: the evaluator's gate tests, the cute_sm80 backend and the
# cutlass_sm90 backend. Each step has its own time limit; logs go to $OUT (or /tmp/l2ir-smoke).
# Usage (on the GPU host, repo root, wheels in .whl/): bash bench/gpu_smoke.sh [steps...]
set -uo pipefail
OUT=${OUT:-/tmp/l2ir-smoke}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
# The folders install under l2ir.* through the editable finder (a bare PYTHONPATH would not map them).
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
steps=${*:-"evaluator cute sm90"}
for step in $steps; do
  case $step in
    evaluator) timeout 220 bash bench/gpu_evaluator_check.sh -x -q > "$OUT/evaluator.log" 2>&1; rc=$? ;;
    cute) timeout 200 python3 bench/cute_sm80_check.py --cutlass /tmp/site --out "$OUT/cute_sm80_h200.json" \
            > "$OUT/cute.log" 2>&1; rc=$? ;;
    sm90) timeout 170 python3 bench/cutlass_sm90_check.py --out "$OUT" > "$OUT/sm90.log" 2>&1; rc=$? ;;
    *) echo "unknown step $step"; rc=2 ;;
  esac
  echo "== $step: exit $rc"
  tail -n 25 "$OUT/$step.log" 2>/dev/null || tail -n 25 "$OUT/${step}.log"
done
