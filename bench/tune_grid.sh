#!/usr/bin/env bash
# Tune 48 grid shapes, 12 in each FLOP regime (< 1 GFLOP, 1-100 GFLOP, 0.1-1 TFLOP, >= 1 TFLOP), on one GPU within
# about 15 device-minutes, and write the results under bench/results/:
#   bench/results/$NAME.db          the records DB (every candidate, gate verdict, time sample, edit and the run)
#   bench/results/$NAME.log         the console output (one line per shape)
#   bench/results/$NAME/report.md   geomean speedup per regime and overall, offline and server; per-shape rows;
#                                   GPU- and compile-seconds per shape; the projected cost of the 1000-shape grid
#   bench/results/$NAME/summary.json, heatmap_*.png, regimes_*.png, curves_*.png
# Run from the repository root after installing L2IR (bench/device.sh's preamble). A killed run is resumed by
# running the script again. POLICY (random | rules | learned), BUDGET_S (wall seconds of the search, default 720),
# CANDIDATES (per shape, default 8: 5 from seeds, nearby winners and sweeps, then policy proposals) and NAME
# override the defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=${NAME:-tune_grid48_h200}
POLICY=${POLICY:-random}
DB=${DB:-bench/results/$NAME.db}   # an ignored path (.l2ir/...) keeps a DB across device calls on a warm machine
mkdir -p bench/results

# The last run in the DB if it did not finish (a kill, a lost machine), else a new one.
RUN=$(python3 - "$DB" <<'PY'
import sys, pathlib
if pathlib.Path(sys.argv[1]).exists():
    from l2ir.search.db import RecordsDB
    runs = RecordsDB(sys.argv[1]).runs()
    if runs and runs[-1]["status"] != "done" and not runs[-1]["status"].startswith("stopped"):
        print(runs[-1]["id"])
PY
)
if [ -n "$RUN" ]; then
  ARGS=(--resume "$RUN" --budget-seconds "${BUDGET_S:-720}")
else
  ARGS=(--grid --sample 48 --interleave --policy "$POLICY" --budget-candidates "${CANDIDATES:-8}" --init-size 5 --batch 4
        --budget-seconds "${BUDGET_S:-720}" --seed 0)
fi
python3 -m l2ir.cli tune "${ARGS[@]}" --db "$DB" 2>&1 | tee -a "bench/results/$NAME.log"
RUN=$(python3 -c "import sys; from l2ir.search.db import RecordsDB; print(RecordsDB(sys.argv[1]).runs()[-1]['id'])" "$DB")
python3 -m l2ir.cli report --db "$DB" --run "$RUN" --out "bench/results/$NAME" | tee -a "bench/results/$NAME.log"
