"""The search on a local Dask cluster of 1 and then 2 GPU workers: throughput, a worker killed on purpose, winners.

    python bench/cluster_bench.py --out bench/results/cluster_h200x2.json        # on a host with 2 or more GPUs

Three runs of the same search (the same shapes, seed, policy and budget; interleaved, so a round's candidates of
every shape are evaluated at once), each on a fresh local cluster (search/cluster.py: one GPU worker per device,
one CPU worker compiling) and a fresh records DB:
  1gpu         one GPU worker
  2gpu         two GPU workers
  2gpu_killed  two GPU workers, one of them SIGKILLed while it evaluates a candidate (after --kill-after
               evaluations); its nanny restarts it, Dask runs the candidate again, the run must lose nothing
Kernels are raw CUDA + PTX only (the cuda_ptx and cuda_ptx_sm80 sweeps and their descendants: nvcc builds one in
seconds, a CUTLASS one in a minute), and the compile cache is warmed by the first run, so what the runs compare is
evaluation. Throughput: candidates evaluated per minute of evaluation wall time (the time the search waited on its
GPU workers), and per GPU-minute (that times the GPUs). Winners: per shape, the re-timed winner of each run; two
runs agree when they pick the same kernel, and where they do not the JSON gives both re-timed speedups (the search
chooses among its --finalists best, default 3, by their median over re-timed rounds; 1 is the single re-timed
incumbent: a different winner within the measured spread is a tie, not an error).

The JSON (--out) holds the environment (GPU, driver, CUDA, torch, from the evaluator's own record), the date, the
command, the configuration, per run its numbers, and the summary: speedup of 2 GPU workers over 1 (issue target
>= 1.8x), the killed run's checks, winner agreement. The records DBs go beside it (OUT without .json / NAME.db).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Mid-size square and skinny shapes of 4-550 GFLOP: an evaluation (gates, then timing) is about a second.
SHAPES = ((2048, 2048, 2048), (4096, 4096, 4096), (1024, 4096, 4096), (4096, 1024, 2048), (8192, 8192, 1024),
          (3072, 3072, 3072))
PTX = ("cuda_ptx", "cuda_ptx_sm80")


def ptx_search_class():
    """Search restricted to raw CUDA + PTX kernels (fast compiles): step 0 and every policy proposal keep only
    candidates lowered by the cuda_ptx backends."""
    from l2ir.search.loop import Search

    class PtxSearch(Search):
        def _initial(self, st, neighbours=True):          # step 0, and the prebuild of every shape's step 0
            return [p for p in super()._initial(st, neighbours) if p.backend in PTX]

        def _propose(self, st):
            made = super()._propose(st)
            if isinstance(made, str):
                return made
            proposals, parent, ctx = made
            return [p for p in proposals if p.backend in PTX], parent, ctx

    return PtxSearch


def run_once(name: str, gpus: int, args, out_dir: Path, kill_after: int | None = None) -> dict:
    from l2ir.backends.compile import COMPILE_PEAK_BYTES_CUTLASS, machine_jobs
    from l2ir.search.cluster import Cluster, distribute
    from l2ir.search.db import RecordsDB
    from l2ir.search.loop import DONE, TuneConfig
    from l2ir.search.tune import _cluster_evaluators

    db_path = out_dir / f"{name}.db"
    for p in out_dir.glob(f"{name}.db*"):
        p.unlink()
    mode = "standin" if args.standin else "gpu"
    cluster = (Cluster.local(fake_gpus=gpus) if args.standin else
               Cluster.local(gpus=list(range(gpus)), cpu_threads=machine_jobs(COMPILE_PEAK_BYTES_CUTLASS)))
    killed: dict = {}
    try:
        ev, rt = _cluster_evaluators(cluster, mode, args.seed)
        # Every GPU worker's evaluators start now, together, so the throughput is that of evaluating, not of
        # starting torch and a CUDA context (once per worker, seconds).
        started = {**ev.warm(), **{f"{w} (re-timer)": why for w, why in rt.warm().items()}}
        if any(started.values()):
            raise SystemExit(f"cluster_bench: evaluators could not start: {started}")
        db = RecordsDB(db_path)
        cfg = TuneConfig(shapes=SHAPES[:args.shapes], policy=args.policy, seed=args.seed,
                         budget_candidates=args.budget, batch=args.batch, init_size=args.init_size, arch="sm90a",
                         mode=mode, interleave=True, cache_dir=args.cache_dir, device_sm="sm_90",
                         budget_wall_s=args.budget_seconds, finalists=args.finalists)
        search = distribute(ptx_search_class()(cfg, db, ev, rt, command=" ".join(sys.argv)), cluster)
        killer = None
        if kill_after is not None:
            killer = threading.Thread(target=_kill_in_flight, args=(cluster, ev, kill_after, killed), daemon=True)
            killer.start()
        t0 = time.perf_counter()
        states = search.run()
        wall = time.perf_counter() - t0
        if killer is not None:
            killer.join(5)
        evaluated = sum(ev.jobs_per_worker.values())
        edits = [e for e in db.edits(search.run_id) if e["verdict"] != DONE]
        rows = db.measurements(run=search.run_id, purpose="search")
        errors = [e for r in rows for e in db.record(r.id).errors]
        result = {
            "gpus": gpus, "run_status": db.run(search.run_id)["status"], "wall_s": wall,
            "evaluation_wall_s": ev.wall_s, "evaluated": evaluated,
            "per_worker": dict(sorted(ev.jobs_per_worker.items())),
            "candidates_per_eval_minute": 60 * evaluated / ev.wall_s if ev.wall_s else None,
            "candidates_per_gpu_minute": 60 * evaluated / (ev.wall_s * gpus) if ev.wall_s else None,
            "compile_wall_s": search.pipeline.compile_wall_s,
            "candidates": {"x".join(map(str, st.shape)): st.candidates for st in states},
            "search_measurements": len(rows),
            "distinct_search_measurements": len({(r.kernel, r.problem, r.scenario) for r in rows}),
            "edits": len(edits), "crashes": ev.crashes,
            "measurement_errors": errors[:10],
            "winners": {"x".join(map(str, st.shape)): (st.done or {}).get("winner") for st in states},
            "environment": ev.environment,
        }
        if kill_after is not None:
            result["killed"] = killed
        return result
    finally:
        cluster.close()


def _kill_in_flight(cluster, ev, after: int, killed: dict):
    """SIGKILL a GPU worker while it runs an evaluation, once `after` evaluations have finished."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if sum(ev.jobs_per_worker.values()) >= after:
            busy = {w: ks for w, ks in cluster.client.processing().items()
                    if any(str(k).startswith("l2ir-eval-") for k in ks)}
            if busy:
                address = min(busy)
                pid = cluster.client.run(os.getpid, workers=[address])[address]
                killed.update(worker=address, pid=pid, after_evaluations=sum(ev.jobs_per_worker.values()),
                              at=time.time())
                os.kill(pid, signal.SIGKILL)
                return
        time.sleep(0.05)


def compare_winners(a: dict, b: dict) -> dict:
    out = {}
    for shape, wa in a["winners"].items():
        wb = b["winners"].get(shape)
        same = bool(wa and wb and wa["kernel"] == wb["kernel"])
        out[shape] = {"same": same, "a": wa and (wa["kernel"][:12], wa.get("offline_speedup")),
                      "b": wb and (wb["kernel"][:12], wb.get("offline_speedup"))}
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/cluster_h200x2.json")
    ap.add_argument("--shapes", type=int, default=len(SHAPES))
    ap.add_argument("--budget", type=int, default=10, help="candidates per shape")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--init-size", type=int, default=4)
    ap.add_argument("--policy", default="random")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--finalists", type=int, default=3,
                    help="candidates per shape re-timed in rounds before the winner is chosen (1: the incumbent only)")
    ap.add_argument("--kill-after", type=int, default=12, help="evaluations before a GPU worker is killed")
    ap.add_argument("--budget-seconds", type=float, default=140.0, help="wall seconds per run (3 runs fit 590 s)")
    ap.add_argument("--cache-dir", default=".l2ir-cache")
    ap.add_argument("--runs", default="1gpu,2gpu,2gpu_killed")
    ap.add_argument("--standin", action="store_true",
                    help="a dry run of this script on the CPU: fake GPU workers, the stand-in cost model "
                         "(NOT measured)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from l2ir.search.pool import parse_gpus

    visible = 2 if args.standin else len(parse_gpus("all"))
    runs = args.runs.split(",")
    if visible < 2 and any(r.startswith("2gpu") for r in runs):
        print(f"cluster_bench: needs 2 GPUs for the 2gpu runs ({visible} visible)", file=sys.stderr)
        return 1
    out = Path(args.out)
    out_dir = out.with_suffix("")
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "command": " ".join([sys.executable.split("/")[-1]] + sys.argv),
              "scenario": "offline selection samples; winners re-timed offline and server",
              "config": {k: v for k, v in vars(args).items()}, "shapes": [list(s) for s in SHAPES[:args.shapes]],
              "backends": list(PTX), "runs": {}}
    if args.standin:
        report["scenario"] = "stand-in cost model on fake GPU workers: NOT measured (a dry run of the script)"
    for name in runs:
        gpus = 1 if name.startswith("1gpu") else 2
        t0 = time.perf_counter()
        r = run_once(name, gpus, args, out_dir, args.kill_after if name.endswith("killed") else None)
        report["runs"][name] = r
        print(f"{name}: {r['evaluated']} evaluated in {r['evaluation_wall_s']:.1f} s of evaluation "
              f"({r['candidates_per_eval_minute'] or 0:.1f}/min, {r['candidates_per_gpu_minute'] or 0:.1f} per "
              f"GPU-minute), wall {r['wall_s']:.1f} s, per worker {r['per_worker']}, status {r['run_status']} "
              f"({time.perf_counter() - t0:.0f} s with the cluster)", flush=True)
        report["environment"] = r["environment"]
        out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    R = report["runs"]
    summary = {}
    if "1gpu" in R and "2gpu" in R and R["1gpu"]["candidates_per_eval_minute"]:
        summary["throughput_2_over_1"] = (R["2gpu"]["candidates_per_eval_minute"]
                                          / R["1gpu"]["candidates_per_eval_minute"])
        summary["wall_2_over_1"] = R["1gpu"]["wall_s"] / R["2gpu"]["wall_s"]
        summary["winners_1gpu_vs_2gpu"] = compare_winners(R["1gpu"], R["2gpu"])
    if "2gpu_killed" in R:
        k = R["2gpu_killed"]
        summary["killed_run"] = {
            "a_worker_was_killed_mid_evaluation": bool(k.get("killed")),
            "status": k["run_status"],
            "every_candidate_recorded_once": k["search_measurements"] == k["distinct_search_measurements"],
            "no_candidate_lost_to_the_kill": not k["crashes"] and not any(
                "died" in e or "crash" in e for e in k["measurement_errors"]),
            "candidates_per_shape": k["candidates"]}
        if "1gpu" in R:
            summary["winners_1gpu_vs_2gpu_killed"] = compare_winners(R["1gpu"], k)
    for key in [k for k in summary if k.startswith("winners_")]:
        same = sum(1 for v in summary[key].values() if v["same"])
        summary[key + "_same"] = f"{same}/{len(summary[key])}"
    report["summary"] = summary
    out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if not isinstance(v, dict) or k == "killed_run"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
