"""Would cold-call terms make the stand-in rank a server race better? A leave-one-shape-out check.

    python3 bench/cold_terms_fit.py bench/results/families_server_h200 bench/results/families_server_wide_h200 \
        --out bench/results/cold_terms_fit_h200.json

The stand-in (search/standin.kernel_time_us) has no term for what a cold call pays beyond the replayed one: a
cluster launch, a split-K workspace round trip, stream-K's fixup, a persistent prologue. This fits, by relative
least squares over the races' gate-clean records (selection and fresh), a cold time of the form
    b0 + b1 * model_us + sum_i c_i * structure_i
and scores it as `model_check.py` scores the plain model: per shape the Spearman correlation between predicted and
measured medians, each shape predicted by a fit on all the other shapes. CPU only; it reads the races' JSONL records
and their summaries' 'kernels' sections.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
from l2ir.search.records import JsonlStore, passed, results_file
from model_check import spearman

from l2ir.analysis import block_reduce, cluster_reduce
from l2ir.text import parse_kernel, parse_problem

TERMS = ("intercept", "model_us", "cluster", "splitk_workspace", "splitk_cluster", "splitk_block", "stream_k",
         "persistent", "cutlass", "mma_sync", "repack")


def features(kernel, problem, backend) -> list[float]:
    """The fit's regressors for one kernel on one problem, in TERMS order."""
    from l2ir.search.standin import kernel_time_us

    sk = kernel.splitk
    cluster = kernel.tile.cluster[0] * kernel.tile.cluster[1] if kernel.tile.cluster else 1
    split = sk is not None and sk.mode == "split_k" and sk.slices > 1
    return [1.0, kernel_time_us(kernel, problem), float(cluster > 1),
            float(split and not cluster_reduce(kernel) and not block_reduce(kernel)),
            float(split and cluster_reduce(kernel)), float(block_reduce(kernel)),
            float(sk is not None and sk.mode == "stream_k"), float(bool(kernel.pipeline.persistent)),
            float(kernel.target.arch == "sm90a" and backend is None), float(kernel.mma.op == "mma_sync"),
            float(kernel.repack is not None)]


def load(prefixes) -> list[tuple]:
    """(shape, kernel hash, features, measured kernel median) of every gate-clean record of the races."""
    rows = []
    for prefix in prefixes:
        kernels = json.loads(Path(f"{prefix}.json").read_text())["kernels"]
        for suffix in (".jsonl", "-fresh.jsonl"):
            path = results_file(f"{prefix}{suffix}")   # or its archive .gz
            if not path.is_file():
                raise OSError(f"{path}: no such file")
            for rec in JsonlStore(path):
                h = rec["kernel_hash"][:12]
                if h not in kernels or not rec.get("kernel_median_us") or not passed(rec):
                    continue
                problem = parse_problem(rec["problem"])
                rows.append((problem.shape, h, features(parse_kernel(kernels[h]["kernel"]), problem,
                                                        kernels[h].get("backend")), rec["kernel_median_us"]))
    return rows


def fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Relative least squares: each record weighs 1 / its measured time."""
    w = 1.0 / y
    return np.linalg.lstsq(x * w[:, None], y * w, rcond=None)[0]


def shape_spearman(rows, predicted) -> dict[tuple, float]:
    """Per shape with at least 3 kernels: Spearman of the prediction against the kernel's mean measured median."""
    out = {}
    for shape in sorted({r[0] for r in rows}):
        by_kernel: dict[str, list[int]] = {}
        for i, r in enumerate(rows):
            if r[0] == shape:
                by_kernel.setdefault(r[1], []).append(i)
        if len(by_kernel) < 3:
            continue
        pred = [predicted[ix[0]] for ix in by_kernel.values()]
        meas = [statistics.mean(rows[i][3] for i in ix) for ix in by_kernel.values()]
        if len(set(pred)) > 1 and len(set(meas)) > 1:
            out[shape] = spearman(pred, meas)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("races", nargs="+", help="server_race output prefixes (PREFIX.json, PREFIX.jsonl, PREFIX-fresh.jsonl)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    try:
        rows = load(args.races)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: cannot read the races ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    if not rows:
        print("error: no gate-clean records with kernel medians", file=sys.stderr)
        return 2
    x = np.array([r[2] for r in rows])
    y = np.array([r[3] for r in rows])
    held_out = np.zeros(len(rows))
    for shape in {r[0] for r in rows}:
        test = np.array([r[0] == shape for r in rows])
        held_out[test] = x[test] @ fit(x[~test], y[~test])
    plain, fitted = shape_spearman(rows, x[:, 1]), shape_spearman(rows, held_out)
    common = sorted(set(plain) & set(fitted))
    result = {"command": "python3 bench/cold_terms_fit.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "records": len(rows), "shapes": len(common),
              "coefficients_all_shapes": dict(zip(TERMS, map(float, fit(x, y)))),
              "median_spearman_plain": statistics.median(plain[s] for s in common),
              "median_spearman_fitted_held_out": statistics.median(fitted[s] for s in common),
              "mean_spearman_plain": statistics.fmean(plain[s] for s in common),
              "mean_spearman_fitted_held_out": statistics.fmean(fitted[s] for s in common),
              "shapes_better": sum(fitted[s] > plain[s] for s in common),
              "shapes_worse": sum(fitted[s] < plain[s] for s in common)}
    print(json.dumps({k: v for k, v in result.items() if k != "command"}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
