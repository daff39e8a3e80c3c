"""`l2ir tune`, `l2ir runs`, `l2ir best`, `l2ir report`, `l2ir db import`: the search from the command line.

    l2ir tune --shape 4096x4096x4096 [--policy random|rules|learned] [--budget-candidates N] [--budget-seconds S]
    l2ir tune --grid --sample 48 --budget-gpu-seconds 800          12 shapes in each FLOP regime
    l2ir tune --resume RUN                                         continue a killed run from the records DB
    l2ir runs | l2ir best --shape MxNxK | l2ir report --out DIR | l2ir db import FILE.jsonl

On a machine without a GPU, `tune` says so in one line and runs the CPU path instead: `--compile-only` (lower and
compile the proposals, time nothing; 4 candidates per shape unless a budget is given); with no nvcc either, the
search on the stand-in cost model (`--standin`), whose numbers are labelled as not measured everywhere they are
shown and never rank against a GPU's.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

DEFAULT_DB = ".l2ir/records.db"
DEFAULT_CANDIDATES = 24
FALLBACK_CANDIDATES = 4
RESULTS = "bench/results"          # earlier bench measurements, imported into a new DB on first use
STANDIN_LABEL = "stand-in cost model: NOT measured on a GPU"


class TuneError(Exception):
    """A usage problem reported as one line (the CLI turns it into `error: ...` and exit status 1)."""


# ---------------------------------------------------------------------------------------------------------------
# Shapes.
# ---------------------------------------------------------------------------------------------------------------


def regime_sample(count: int) -> list[tuple[int, int, int]]:
    """`count` grid shapes, an equal share from each FLOP regime, spread evenly over the FLOPs inside it."""
    from .bench import GRID
    from .report import REGIMES

    every = sorted(((m, n, k) for m in GRID for n in GRID for k in GRID), key=lambda s: (s[0] * s[1] * s[2], s))
    out = []
    per, extra = divmod(count, len(REGIMES))
    for i, (lo, hi, _) in enumerate(REGIMES):
        want = per + (i < extra)
        pool = [s for s in every if lo <= 2 * s[0] * s[1] * s[2] < hi]
        if want <= 0 or not pool:
            continue
        idx = sorted({round(j * (len(pool) - 1) / max(1, want - 1)) for j in range(want)}) if want > 1 else [
            len(pool) // 2]
        out += [pool[j] for j in idx]
    return out


def _parse_shape(text: str, where: str) -> tuple[int, int, int]:
    try:
        m, n, k = (int(p) for p in text.lower().split("x"))
    except ValueError:
        raise TuneError(f"{where}: expected MxNxK like 4096x4096x4096, got '{text}'") from None
    if min(m, n, k) < 1:
        raise TuneError(f"{where}: sizes must be positive, got '{text}'")
    return m, n, k


def shapes_from_file(path: str) -> list[tuple[int, int, int]]:
    """One MxNxK per line; blank lines and '#' comments are skipped."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise TuneError(f"{path}: cannot read: {e.strerror}") from None
    out = []
    for i, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if text:
            out.append(_parse_shape(text, f"{path}:{i}"))
    if not out:
        raise TuneError(f"{path}: no shapes (one MxNxK per line)")
    return out


# ---------------------------------------------------------------------------------------------------------------
# Commands.
# ---------------------------------------------------------------------------------------------------------------


def _open(path: str, seed_from_results: bool = True):
    """The records DB at `path`; a new one first imports bench/results (earlier measurements seed the search),
    unless `seed_from_results` is False (an explicit import takes only the files it names)."""
    from .db import DBError, open_db

    try:
        return open_db(path, RESULTS if seed_from_results and Path(RESULTS).is_dir() else None)
    except DBError as e:
        raise TuneError(str(e)) from None


def _read(path: str):
    """The records DB at `path` for a command that only reads it (runs, best, report): a missing file or one that is
    not a records DB is an error, never a new DB."""
    from .db import DBError, open_readonly

    try:
        return open_readonly(path)
    except DBError as e:
        raise TuneError(str(e)) from None


def _mode(args) -> tuple[str, str | None]:
    """The evaluation mode and, when the machine cannot do what was asked, the one line that says what runs."""
    from .preflight import missing

    if args.standin:
        return "standin", None
    toolchain = missing(gpu=False, toolchain=True)
    if args.compile_only:
        if toolchain:
            raise TuneError("l2ir tune --compile-only cannot run here: " + "; ".join(toolchain)
                            + " (--standin searches against the cost model without compiling)")
        return "compile_only", None
    gpu = missing(gpu=True, toolchain=False)
    if not gpu and not toolchain:
        return "gpu", None
    if toolchain and not gpu:
        raise TuneError("l2ir tune cannot run here: " + "; ".join(toolchain)
                        + " (--standin searches against the cost model, clearly not measured)")
    if toolchain:
        # Neither a GPU nor a compiler: the one thing left to show is the search itself, on the cost model.
        return "standin", (f"l2ir tune: {gpu[0]}; {toolchain[0]}; running the search against the stand-in cost "
                           "model instead (--standin: NOT measured; with the CUDA toolkit, --compile-only builds "
                           "the proposals)")
    return "compile_only", (f"l2ir tune: {gpu[0]}; running the CPU path instead: --compile-only ({{n}} candidates "
                            "per shape, lowered and compiled, nothing timed); --standin searches against the cost "
                            "model")


def _workers(mode: str, gpus: str | None) -> list[int]:
    """The devices `--gpus` names (N, all, or a list like 0,1). The stand-in uses no GPU: N (or a list) is how many
    stand-in workers to pool, "all" one."""
    from .pool import parse_gpus

    try:
        if mode == "standin":
            text = "all" if gpus is None else str(gpus).strip()
            return [0] if text == "all" else parse_gpus(text, visible=64)     # workers, not devices
        return parse_gpus(gpus)
    except ValueError as e:
        raise TuneError(str(e)) from None


def _evaluators(mode: str, seed: int, gpus: str | None = None):
    """The search's evaluator (a pool of one worker per device when --gpus names more than one) and the re-timer
    (on the first device: winners are re-timed one after another)."""
    if mode == "standin":
        from .pool import EvaluatorPool
        from .standin import StandinConfig, StandinEvaluator

        n = len(_workers(mode, gpus))
        search = [StandinEvaluator(StandinConfig(("offline",), seed)) for _ in range(n)]
        return (search[0] if n == 1 else EvaluatorPool(search),
                StandinEvaluator(StandinConfig(("offline", "server"), seed)))
    if mode == "gpu":
        from .evaluator import Evaluator
        from .pool import EvaluatorPool

        devices = _workers(mode, gpus)
        if not devices:
            raise TuneError("--gpus: no GPU visible")
        config, retime = eval_configs(devices[0])
        search = Evaluator(config) if len(devices) == 1 else EvaluatorPool.on_devices(devices, config)
        return search, Evaluator(retime)
    return None, None


def eval_configs(device: int):
    """(search, re-time) evaluator configs on `device`. Selection needs only the offline number; the winner is
    re-timed in both scenarios, interleaved with torch.matmul, on fresh samples."""
    from .evaluator import EvalConfig
    from .timing import TimingConfig

    return (EvalConfig(device=device, scenarios=("offline",), timing=TimingConfig(trials=5, target_ms=5.0)),
            EvalConfig(device=device, scenarios=("offline", "server")))


def _cluster_spec(args) -> str | None:
    """--cluster, else Dask's own DASK_SCHEDULER_ADDRESS; None: the local pool (search/pool.py)."""
    from .cluster import ADDRESS_VARIABLE

    return getattr(args, "cluster", None) or os.environ.get(ADDRESS_VARIABLE) or None


def _cluster_mode(args) -> str:
    """On a cluster the GPUs are the workers': the driver needs the toolchain (it lowers and keys every kernel)."""
    from .preflight import missing

    if args.standin:
        return "standin"
    toolchain = missing(gpu=False, toolchain=True)
    if toolchain:
        raise TuneError("l2ir tune --cluster cannot run here: " + "; ".join(toolchain)
                        + " (--standin searches against the cost model, clearly not measured)")
    return "compile_only" if args.compile_only else "gpu"


def _cluster_evaluators(cluster, mode: str, seed: int):
    """The search's evaluator and the re-timer on the cluster's GPU workers (each sees its one GPU as device 0)."""
    import functools

    from .cluster import evaluators, standin_makers
    from .evaluator import Evaluator

    if mode == "standin":
        return evaluators(cluster, *standin_makers(seed))
    if mode == "gpu":
        return evaluators(cluster, *(functools.partial(Evaluator, c) for c in eval_configs(0)))
    return None, None


def cmd_tune(args) -> int:
    from rich.console import Console

    from .db import DBError
    from .loop import Search, TuneConfig

    console = Console(stderr=True)
    if args.resume is None:
        shapes = [tuple(s) for s in (args.shape or [])]
        if args.shapes_file:
            shapes += shapes_from_file(args.shapes_file)
        if args.grid:
            shapes += regime_sample(args.sample)
        seen: set = set()
        shapes = [s for s in shapes if not (s in seen or seen.add(s))]
        if not shapes:
            raise TuneError("no shapes: give --shape MxNxK, --shapes-file F or --grid [--sample N]")
    spec = _cluster_spec(args)
    mode, note = (_cluster_mode(args), None) if spec else _mode(args)
    if args.budget_candidates is None:
        # Without a GPU the fallback only shows that the proposals build: a few, since each CUTLASS build is minutes
        # on a small CPU.
        args.budget_candidates = FALLBACK_CANDIDATES if (note and mode == "compile_only") else DEFAULT_CANDIDATES
    if note:
        print(note.format(n=args.budget_candidates), file=sys.stderr)
    cluster = None
    if spec:
        from .cluster import ClusterError, distribute, open_cluster

        try:
            cluster = open_cluster(spec, mode, _workers(mode, args.gpus) if spec == "local" and mode != "compile_only"
                                   else ())
        except ClusterError as e:
            raise TuneError(str(e)) from None
        print(f"l2ir tune: Dask cluster {cluster.address}"
              + ("" if spec == args.cluster else " ($DASK_SCHEDULER_ADDRESS)")
              + f": {len(cluster.gpu_workers())} GPU worker(s), {len(cluster.workers())} in all", file=sys.stderr)
    db = _open(args.db)
    make = (lambda m, seed: _cluster_evaluators(cluster, m, seed)) if cluster else (
        lambda m, seed: _evaluators(m, seed, args.gpus))
    ev, rt = make(mode, args.seed)
    view = _LiveView(console, mode)
    command = "l2ir " + " ".join(sys.argv[1:])
    try:
        if args.resume is not None:
            row = db.run(args.resume)
            if row is None:
                raise TuneError(f"{args.db}: no run {args.resume} (l2ir runs lists them)")
            if row["config"]["mode"] != mode:
                for e in (ev, rt):
                    if e is not None:
                        e.close()
                ev, rt = make(row["config"]["mode"], row["seed"])
                view = _LiveView(console, row["config"]["mode"])
            try:
                search = Search.resume(db, args.resume, ev, rt, progress=view.update, command=command,
                                       budget_wall_s=args.budget_seconds)
            except DBError as e:                 # a stored policy state this version cannot load
                raise TuneError(str(e)) from None
        else:
            problem = args.problem or "gemm m=1 n=1 k=1 a=f16:row b=f16:col c=f16:row acc=f32"
            cfg = TuneConfig(shapes=tuple(shapes), problem=problem, policy=args.policy, seed=args.seed,
                             budget_candidates=args.budget_candidates, budget_gpu_s=args.budget_gpu_seconds,
                             budget_wall_s=args.budget_seconds, batch=args.batch, arch=args.target, mode=mode,
                             cache_dir=args.cache_dir, device_sm=args.device_sm, interleave=args.interleave,
                             init_size=args.init_size, finalists=args.finalists)
            try:
                search = Search(cfg, db, ev, rt, progress=view.update, command=command)
            except ValueError as e:
                raise TuneError(str(e)) from None
        if cluster is not None:
            distribute(search, cluster)
        if search.run_id is None:
            try:
                search.start()               # the stored policy state loads, or is refused, before the live view
            except DBError as e:
                raise TuneError(str(e)) from None
        view.start(len(search.config.shapes), search.config.budget_candidates)
        try:
            states = search.run()
        except Exception as e:
            if cluster is not None and isinstance(e, ClusterError):
                raise TuneError(f"{e} (l2ir tune --resume {search.run_id} continues the run)") from None
            raise
        finally:
            view.stop()
        print_results(search, states, Console(width=None if sys.stdout.isatty() else 160))
        if callable(getattr(ev, "summary", None)):
            print(ev.summary(), file=sys.stderr)
        elif getattr(ev, "jobs_per_worker", None) is not None:
            gpu = search.config.mode == "gpu"
            devices = [getattr(getattr(w, "config", None), "device", i) if gpu else i for i, w in enumerate(ev.workers)]
            print(f"evaluations per {'GPU' if gpu else 'stand-in worker'}: "
                  + ", ".join(f"{d}: {n}" for d, n in zip(devices, ev.jobs_per_worker)), file=sys.stderr)
    finally:
        for e in (ev, rt):
            if e is not None:
                e.close()
        db.close()
        if cluster is not None:
            cluster.close()
    return 0


class _LiveView:
    """A progress bar over all candidates and a live table: shape, best speedup so far, candidates, failures,
    GPU-seconds."""

    def __init__(self, console, mode: str):
        self.console, self.mode = console, mode
        self.rows: dict = {}
        self.live = None

    def start(self, shapes: int, per_shape: int):
        from rich.console import Group
        from rich.live import Live
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("[bold]tune"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 console=self.console)
        self.task = self.progress.add_task("candidates", total=shapes * per_shape)
        self.group = Group(self.progress, self._table())
        self.live = Live(self.group, console=self.console, refresh_per_second=4, transient=False)
        self.live.start()

    def _table(self):
        from rich.table import Table

        title = "best speedup vs torch.matmul (offline, selection samples)"
        if self.mode == "standin":
            title += f" [red]{STANDIN_LABEL}[/red]"
        elif self.mode == "compile_only":
            title = "compile only: nothing timed"
        t = Table(title=title)
        for col in ("shape", "best x", "candidates", "failures", "illegal", "GPU s", "status"):
            t.add_column(col, justify="right")
        for r in self.rows.values():
            t.add_row(*r)
        return t

    def update(self, st, event: str):
        best = f"{st.best:.3f}" if st.best else "-"
        status = "done" if event == "done" else ("restored" if event == "restored" else "searching")
        self.rows[st.shape] = ("x".join(map(str, st.shape)), best, str(st.candidates), str(st.failures),
                               str(st.illegal), f"{st.gpu_s:.1f}", status)
        if self.live is not None:
            self.progress.update(self.task, completed=sum(int(r[2]) for r in self.rows.values()))
            self.group.renderables[1] = self._table()
        if event == "done" and not self.console.is_terminal:
            # A log file gets one line per finished shape instead of the live table.
            w = (st.done or {}).get("winner") or {}
            f = lambda x: f"{x:.3f}" if isinstance(x, (int, float)) else "-"  # noqa: E731
            print(f"{'x'.join(map(str, st.shape))}: winner {(w.get('kernel') or '-')[:12]} offline "
                  f"{f(w.get('offline_speedup'))}x server {f(w.get('server_speedup'))}x (selected on "
                  f"{f(w.get('selected_speedup'))}x); {st.candidates} candidates, {st.failures} failed, "
                  f"{st.gpu_s:.1f} GPU s; ended by {(st.done or {}).get('stopped_by')}", file=sys.stderr, flush=True)

    def stop(self):
        if self.live is not None:
            self.live.stop()


def print_results(search, states, console) -> None:
    from rich.table import Table

    mode = search.config.mode
    t = Table(title=f"l2ir tune: run {search.run_id} ({search.policy_name}, seed {search.config.seed})"
              + (f" - {STANDIN_LABEL}" if mode == "standin" else ""))
    for col in ("shape", "GFLOP", "winner", "offline x", "server x", "selected on", "candidates", "failures",
                "GPU s", "ended by"):
        t.add_column(col, justify="right")
    for st in states:
        d = st.done or {}
        w = d.get("winner") or {}
        sw = d.get("server_winner") or w
        f = lambda x: f"{x:.3f}" if isinstance(x, (int, float)) else "-"  # noqa: E731
        server = f(sw.get("server_speedup")) + ("" if sw.get("kernel") == w.get("kernel") else
                                                 f" ({sw['kernel'][:8]})")
        t.add_row("x".join(map(str, st.shape)), f"{2 * math.prod(st.shape) / 1e9:.2f}",
                  (w.get("kernel") or "-")[:12], f(w.get("offline_speedup")), server,
                  f(w.get("selected_speedup")), str(st.candidates), str(st.failures), f"{st.gpu_s:.1f}",
                  str(d.get("stopped_by", "not started")))
    console.print(t)
    if mode == "gpu":
        console.print("offline x / server x: each scenario's winner among the finalists, its median over rounds "
                      "re-timed on fresh samples, interleaved with torch.matmul (not the samples it was selected on); "
                      "the server winner's kernel in brackets where it is another one")
    elif mode == "standin":
        console.print(f"[red]{STANDIN_LABEL}[/red]: a model of tiles, waves and stages, for testing the search")
    console.print(f"records: {search.db.path} (l2ir best --shape MxNxK, l2ir report, l2ir tune --resume "
                  f"{search.run_id})")


def cmd_runs(args) -> int:
    from rich.console import Console
    from rich.table import Table

    db = _read(args.db)
    t = Table(title=f"runs in {args.db}")
    for col in ("run", "status", "mode", "policy", "seed", "shapes", "candidates", "failures", "illegal", "GPU s",
                "command"):
        t.add_column(col)
    for r in db.runs():
        cfg = r["config"]
        t.add_row(str(r["id"]), r["status"] or "", cfg.get("mode", ""), r["policy"] or "", str(r["seed"]),
                  str(len(cfg.get("shapes", []))), str(r["candidates"]), str(r["failures"]), str(r["illegal"]),
                  f"{r['gpu_seconds']:.1f}", (r["command"] or "")[:60])
    Console(width=None if sys.stdout.isatty() else 200).print(t)
    return 0


def best_for(db, problem_text: str, environment: str | None = None) -> dict | None:
    """The best kernel of a problem: a winner's re-timed numbers where a run has them (a kernel re-timed several
    times by its median trial, as `l2ir export` judges it), else the fastest gate-clean
    measurement; on the named environment, else on the measured environment with the most records of it
    (a stand-in's numbers only when no GPU measured the problem)."""
    envs = [environment] if environment else _envs_for(db, problem_text)
    for eid in envs:
        retimed = db.ranking(problem_text, eid, "offline", purpose="retime", limit=1, per_kernel="median")
        row = retimed[0] if retimed else next(iter(db.ranking(problem_text, eid, "offline", limit=1)), None)
        if row is None:
            continue
        server = [r for r in db.measurements(problem=problem_text, kernel=row.kernel, environment=eid,
                                             scenario="server") if r.passed]
        return {"row": row, "server": server[-1] if server else None, "environment": db.environment(eid),
                "environment_id": eid, "kernel": db.kernel(row.kernel), "retimed": bool(retimed)}
    return None


def _envs_for(db, problem_text: str) -> list[str]:
    rows = db.conn.execute("SELECT m.environment, e.measured, COUNT(*) AS c FROM measurements m JOIN environments e"
                           " ON e.id = m.environment WHERE m.problem=? AND m.passed=1 GROUP BY m.environment "
                           "ORDER BY e.measured DESC, c DESC", (problem_text,)).fetchall()
    return [r[0] for r in rows]


def cmd_best(args) -> int:
    from l2ir.nodes import Problem
    from l2ir.text import parse_problem, print_problem

    base = parse_problem(args.problem, "--problem") if args.problem else Problem(1, 1, 1)
    ptext = print_problem(base.with_shape(*args.shape))
    db = _read(args.db)
    got = best_for(db, ptext, args.env)
    if got is None:
        raise TuneError(f"no gate-clean measurement of '{ptext}' in {args.db} (l2ir tune --shape "
                        f"{'x'.join(map(str, args.shape))} makes one)")
    row, env = got["row"], got["environment"] or {}
    label = STANDIN_LABEL if env.get("standin") else f"{env.get('gpu')} (driver {env.get('driver')}, CUDA " \
        f"{env.get('cuda_runtime')}, torch {env.get('torch')}, CUTLASS {env.get('cutlass')})"
    kernel = got["kernel"] or {}
    print(f"# {ptext}")
    print(f"# kernel {row.kernel[:12]}, backend {kernel.get('backend') or 'default'}, on {label}")
    how = "re-timed winner (fresh samples)" if got["retimed"] else "best gate-clean measurement"
    from l2ir.export import WIN_CONFIDENCE, win_verdict

    paired = db.paired_speedup(ptext, row.kernel, got["environment_id"], "offline",
                               "retime" if got["retimed"] else None, WIN_CONFIDENCE)
    sure = win_verdict(row.speedup, row.spread, paired)[2]
    print(f"# offline: {row.kernel_median_us:.2f} us vs torch.matmul {row.baseline_median_us:.2f} us = "
          f"{row.speedup:.3f}x ({sure}; {how})")
    srv = got["server"]
    if srv is not None:
        print(f"# server:  {srv.kernel_median_us:.2f} us vs torch.matmul {srv.baseline_median_us:.2f} us = "
              f"{srv.speedup:.3f}x")
    sys.stdout.write(kernel.get("ir") or "# (the IR of this kernel is not in the DB)\n")
    return 0


def cmd_db_import(args) -> int:
    from .db import DBError

    db = _open(args.db, seed_from_results=False)
    total = 0
    for f in args.files:
        try:
            n = db.import_jsonl(f)
        except DBError as e:
            raise TuneError(str(e)) from None
        print(f"{f}: {n} measurements imported" + ("" if n else " (already imported or empty)"))
        total += n
    return 0


def cmd_report(args) -> int:
    db = _read(args.db)
    out = Path(args.out)
    paths = write_report(db, out, args.env, args.run)
    for p in paths:
        print(p)
    return 0


# ---------------------------------------------------------------------------------------------------------------
# The report: a markdown table by FLOP regime and PNG plots, per environment.
# ---------------------------------------------------------------------------------------------------------------


def shape_results(db, environment: str, run: int | None = None) -> list[dict]:
    """Per problem measured on this environment (by run `run`, if given): the reported numbers (a re-timed winner
    where a run made one, else the best gate-clean measurement) in both scenarios."""
    from .db import split_problem

    problems = [r[0] for r in db.conn.execute(
        "SELECT DISTINCT problem FROM measurements WHERE environment=? AND passed=1 AND speedup IS NOT NULL "
        + ("AND run=? " if run is not None else "") + "ORDER BY m * n * k, problem",
        (environment,) + ((run,) if run is not None else ()))]
    out = []
    for p in problems:
        got = best_for(db, p, environment)
        if got is None:
            continue
        row, srv = got["row"], got["server"]
        out.append({"problem": p, "shape": split_problem(p)[0], "kernel": row.kernel, "offline": row.speedup,
                    "server": srv.speedup if srv else None, "retimed": got["retimed"],
                    "kernel_us": row.kernel_median_us, "torch_us": row.baseline_median_us})
    return out


def write_report(db, out: Path, environment: str | None = None, run: int | None = None) -> list[Path]:
    """report.md and PNGs (heat map of the offline speedup over M, N for each K; speedup by regime; search
    curves) under `out`, one section and set of plots per environment. Returns the files written."""
    from .db import split_problem
    from .report import REGIMES, ceilings_for, geomean, median, roofline, roofline_share

    out.mkdir(parents=True, exist_ok=True)
    envs = [(environment, db.environment(environment))] if environment else [(e, env) for e, env, n in
                                                                              db.environments() if n]
    lines = ["# l2ir tune report", "", f"records: `{db.path}`" + (f", run {run}" if run is not None else ""), ""]
    if run is not None and db.run(run) is not None:
        r = db.run(run)
        lines += [f"command: `{r['command']}`; policy {r['policy']}, seed {r['seed']}, status {r['status']}", ""]
    written: list[Path] = []
    summary: dict = {}
    for eid, env in envs:
        env = env or {}
        rows = shape_results(db, eid, run)
        if run is not None and not rows:
            continue
        label = STANDIN_LABEL if env.get("standin") else (
            f"{env.get('gpu')}, {env.get('sms')} SMs, driver {env.get('driver')}, CUDA {env.get('cuda_runtime')}, "
            f"torch {env.get('torch')}, CUTLASS {env.get('cutlass')}")
        ceil = ceilings_for(env)
        for r in rows:
            roof = roofline(r["shape"], split_problem(r["problem"])[1], ceil) if ceil else None
            r["roofline"] = roof and roof | {"kernel_share": roofline_share(roof["floor_us"], r["kernel_us"]),
                                             "torch_share": roofline_share(roof["floor_us"], r["torch_us"])}
        def share(r: dict, who: str) -> float | None:
            return r["roofline"] and r["roofline"][f"{who}_share"]

        def pct(x: float | None) -> str:
            # Above 100% of the floor is faster than the hardware allows: a timing or a ceiling is wrong, never a win.
            return "-" if x is None else (f"**{100 * x:.1f}% > floor!**" if x > 1 else f"{100 * x:.1f}%")

        suspicious = [r for r in rows if any((share(r, w) or 0) > 1 for w in ("kernel", "torch"))]
        lines += [f"## {label} (environment `{eid}`)", "",
                  "Speedup = torch.matmul median / kernel median, device time, interleaved. Re-timed winners where a "
                  "search made them (fresh samples), else the best gate-clean measurement.", ""]
        if ceil:
            lines += [f"Roofline share = floor / offline time, floor = max(FLOPs / {ceil[0] / 1e12:.0f} TFLOP/s, "
                      f"(M*K + K*N + M*N) * dtype bytes / {ceil[1] / 1e12:.1f} TB/s) (the ceilings measured on "
                      "the H200s L2IR is tuned on, l2ir/target.py); the bound says which term is larger.", ""]
        else:
            lines += ["No roofline: no ceilings are recorded for this GPU (l2ir/target.py).", ""]
        for r in suspicious:
            lines += [f"**SUSPICIOUS: {'x'.join(map(str, r['shape']))} ran faster than its roofline floor (kernel "
                      f"{pct(share(r, 'kernel'))}, torch {pct(share(r, 'torch'))} of "
                      f"{r['roofline']['floor_us']:.2f} us): the timing or a ceiling is wrong.**", ""]
            print(f"warning: {'x'.join(map(str, r['shape']))} ran faster than its roofline floor: the timing or a "
                  "ceiling is wrong", file=sys.stderr)
        lines += ["| FLOP regime | shapes | offline geomean | server geomean | faster than torch (offline) | "
                  "kernel roofline (median) | torch roofline (median) |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        f = lambda x: f"{x:.3f}x" if x else "-"  # noqa: E731
        for name, rs in [(name, [r for r in rows if lo <= 2 * math.prod(r["shape"]) < hi]) for lo, hi, name in REGIMES
                         ] + [("all", rows)]:
            lines.append(f"| {name} | {len(rs)} | {f(geomean([r['offline'] for r in rs]))} | "
                         f"{f(geomean([r['server'] for r in rs]))} | {sum(1 for r in rs if r['offline'] > 1)} | "
                         f"{pct(median(share(r, 'kernel') for r in rs))} | "
                         f"{pct(median(share(r, 'torch') for r in rs))} |")
        lines += ["", "| M | N | K | kernel | offline | server | kernel us | torch us | re-timed | floor us | bound | "
                  "kernel roofline | torch roofline |",
                  "|---:|---:|---:|---|---:|---:|---:|---:|---|---:|---|---:|---:|"]
        for r in rows:
            roof = r["roofline"]
            lines.append(f"| {' | '.join(map(str, r['shape']))} | {r['kernel'][:12]} | {f(r['offline'])} | "
                         f"{f(r['server'])} | {r['kernel_us']:.2f} | {r['torch_us']:.2f} | "
                         f"{'yes' if r['retimed'] else 'no'} | "
                         + (f"{roof['floor_us']:.2f} | {roof['bound']} | {pct(roof['kernel_share'])} | "
                            f"{pct(roof['torch_share'])} |" if roof else "- | - | - | - |"))
        furthest = sorted((r for r in rows if share(r, "kernel") is not None), key=lambda r: share(r, "kernel"))[:8]
        if furthest:
            lines += ["", "Furthest from their floor (lowest kernel roofline share): "
                      + "; ".join(f"{'x'.join(map(str, r['shape']))} {pct(share(r, 'kernel'))} "
                                  f"({r['roofline']['bound']}-bound, torch {pct(share(r, 'torch'))})"
                                  for r in furthest) + "."]
            behind = sorted((r for r in rows if share(r, "kernel") is not None),
                            key=lambda r: share(r, "kernel") - share(r, "torch"))[:8]
            lines += ["", "Furthest behind torch's share (points of the floor torch reaches and the kernel does not): "
                      + "; ".join(f"{'x'.join(map(str, r['shape']))} {pct(share(r, 'kernel'))} vs "
                                  f"{pct(share(r, 'torch'))}" for r in behind
                                  if share(r, "kernel") < share(r, "torch")) + "."]
        cost = _costs(db, eid, run)
        if cost["shapes"]:
            lines += ["", f"Search cost over {cost['shapes']} searched shapes: {cost['gpu_seconds_per_shape']:.1f} "
                      f"GPU-seconds and {cost['compile_seconds_per_shape']:.1f} compile-seconds per shape (compile "
                      "is paid once per kernel and shared by the shapes that use it); the whole 1000-shape grid at "
                      f"this rate: {cost['projected_1000_shapes_hours']:.1f} hours on one GPU."]
        summary[eid] = {"environment": env, "label": label, "shapes": rows, "cost": cost,
                        "roofline_ceilings": ceil and {"tensor_flops": ceil[0], "dram_bytes_per_s": ceil[1]},
                        "suspicious": [r["problem"] for r in suspicious],
                        "by_regime": {name: {"shapes": len(rs), "offline_geomean": geomean([r["offline"] for r in rs]),
                                             "server_geomean": geomean([r["server"] for r in rs]),
                                             "kernel_roofline_median": median(share(r, "kernel") for r in rs),
                                             "torch_roofline_median": median(share(r, "torch") for r in rs)}
                                      for lo, hi, name in REGIMES
                                      for rs in [[r for r in rows if lo <= 2 * math.prod(r["shape"]) < hi]]},
                        "overall": {"offline_geomean": geomean([r["offline"] for r in rows]),
                                    "server_geomean": geomean([r["server"] for r in rows])}}
        lines.append("")
        written += _plots(db, eid, rows, out, label, run)
        lines += [f"![{p.stem}]({p.name})" for p in written if p.stem.endswith(eid)] + [""]
    md = out / "report.md"
    md.write_text("\n".join(lines) + "\n")
    js = out / "summary.json"
    js.write_text(json.dumps(summary, indent=1, default=str) + "\n")
    return [md, js] + written


def _costs(db, eid: str, only_run: int | None = None) -> dict:
    """GPU- and compile-seconds per searched shape on this environment (search, re-timing and builds)."""
    per: dict = {}
    for run in db.runs():
        if only_run is not None and run["id"] != only_run:
            continue
        problems = {r.problem for r in db.measurements(run=run["id"], environment=eid)}
        for p in problems:
            e = db.conn.execute("SELECT COALESCE(SUM(gpu_seconds), 0), COALESCE(SUM(compile_seconds), 0) FROM edits "
                                "WHERE run=? AND problem=?", (run["id"], p)).fetchone()
            r = db.conn.execute("SELECT COALESCE(SUM(json_extract(record, '$.gpu_seconds')), 0) FROM measurements "
                                "WHERE run=? AND problem=? AND purpose='retime'", (run["id"], p)).fetchone()
            g, c = per.get(p, (0.0, 0.0))
            per[p] = (g + e[0] + r[0], c + e[1])
    n = len(per)
    gpu = sum(g for g, _ in per.values()) / n if n else 0.0
    comp = sum(c for _, c in per.values()) / n if n else 0.0
    return {"shapes": n, "gpu_seconds_per_shape": gpu, "compile_seconds_per_shape": comp,
            "per_shape": {p: {"gpu_seconds": g, "compile_seconds": c} for p, (g, c) in per.items()},
            "projected_1000_shapes_hours": 1000 * (gpu + comp) / 3600}


def _plots(db, eid: str, rows: list[dict], out: Path, label: str, only_run: int | None = None) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import TwoSlopeNorm
    except ImportError:
        print("matplotlib is not installed (pip install 'l2ir[report]'): no plots", file=sys.stderr)
        return []
    from .report import REGIMES

    paths = []
    if rows:
        ks = sorted({r["shape"][2] for r in rows})
        cols = min(4, len(ks))
        fig, axes = plt.subplots((len(ks) + cols - 1) // cols, cols, figsize=(4 * cols, 3.6 * ((len(ks) + cols - 1)
                                                                                                // cols)),
                                 squeeze=False)
        norm = TwoSlopeNorm(vcenter=1.0, vmin=min(0.5, min(r["offline"] for r in rows)),
                            vmax=max(1.5, max(r["offline"] for r in rows)))
        for ax, k in zip(axes.flat, ks):
            sub = [r for r in rows if r["shape"][2] == k]
            ms, ns = sorted({r["shape"][0] for r in sub}), sorted({r["shape"][1] for r in sub})
            grid = [[math.nan] * len(ns) for _ in ms]
            for r in sub:
                grid[ms.index(r["shape"][0])][ns.index(r["shape"][1])] = r["offline"]
            im = ax.imshow(grid, cmap="RdYlGn", norm=norm, origin="lower", aspect="auto")
            ax.set_xticks(range(len(ns)), [str(n) for n in ns], rotation=60, fontsize=7)
            ax.set_yticks(range(len(ms)), [str(m) for m in ms], fontsize=7)
            ax.set_xlabel("N")
            ax.set_ylabel("M")
            ax.set_title(f"K = {k}", fontsize=9)
        for ax in list(axes.flat)[len(ks):]:
            ax.axis("off")
        fig.colorbar(im, ax=axes, shrink=0.8, label="offline speedup vs torch.matmul")
        fig.suptitle(label, fontsize=9)
        paths.append(out / f"heatmap_{eid}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

        fig, ax = plt.subplots(figsize=(7, 4))
        for i, (lo, hi, name) in enumerate(REGIMES):
            for j, sc in enumerate(("offline", "server")):
                vals = [r[sc] for r in rows if r[sc] and lo <= 2 * math.prod(r["shape"]) < hi]
                xs = [i + (j - 0.5) * 0.3] * len(vals)
                ax.scatter(xs, vals, s=14, alpha=0.7, color="C0" if sc == "offline" else "C1",
                           label=sc if i == 0 else None)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(range(len(REGIMES)), [r[2] for r in REGIMES])
        ax.set_ylabel("speedup vs torch.matmul")
        ax.set_title(label, fontsize=9)
        ax.legend()
        paths.append(out / f"regimes_{eid}.png")
        fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
        plt.close(fig)

    # Search curves: the best selection sample so far against candidates, per shape of every run on this GPU.
    curves = []
    for run in db.runs():
        if only_run is not None and run["id"] != only_run:
            continue
        for e_problem in {r.problem for r in db.measurements(run=run["id"], environment=eid, purpose="search")}:
            best, xs, ys, n = 0.0, [], [], 0
            for e in db.edits(run["id"], e_problem):
                if e["verdict"] in ("measured", "failed"):
                    n += 1
                    if e["verdict"] == "measured" and e["reward"] is not None:
                        best = max(best, math.exp(e["reward"]))
                    if best:
                        xs.append(n)
                        ys.append(best)
            if xs:
                curves.append((run["id"], e_problem, xs, ys))
    if curves:
        fig, ax = plt.subplots(figsize=(7, 4))
        for run_id, p, xs, ys in curves[:60]:
            ax.plot(xs, ys, lw=0.9, alpha=0.7)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xlabel("candidates evaluated")
        ax.set_ylabel("best speedup so far (selection samples)")
        ax.set_title(f"search curves, {len(curves)} shape(s): {label}", fontsize=9)
        paths.append(out / f"curves_{eid}.png")
        fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
        plt.close(fig)
    return paths


def add_parsers(sub, shape_type, count_type) -> None:
    """Register tune, runs, best, report and db on the `l2ir` parser (`count_type`: argparse's type for a count of
    at least 1)."""
    s = sub.add_parser("tune", help="search kernels for shapes (GPU; --compile-only or --standin without one)")
    s.add_argument("--shape", type=shape_type, action="append", help="MxNxK (repeatable)")
    s.add_argument("--shapes-file", help="a file with one MxNxK per line")
    s.add_argument("--grid", action="store_true", help="grid shapes, an equal share from each FLOP regime")
    s.add_argument("--sample", type=count_type, default=48, help="how many grid shapes with --grid (default 48)")
    s.add_argument("--policy", default="random", help="random, rules, learned, llm, or module:Factory")
    s.add_argument("--budget-candidates", type=count_type,
                   help=f"candidates built and timed per shape (default {DEFAULT_CANDIDATES}; "
                        f"{FALLBACK_CANDIDATES} on the no-GPU compile-only path)")
    s.add_argument("--budget-seconds", type=float, default=math.inf, help="wall seconds for this invocation")
    s.add_argument("--budget-gpu-seconds", type=float, default=math.inf, help="GPU seconds for the whole run")
    s.add_argument("--batch", type=count_type, default=4, help="proposals per step, compiled together")
    s.add_argument("--init-size", type=count_type, default=6,
                   help="step 0's candidates per shape: seeds, nearby shapes' winners, sweeps (default 6)")
    s.add_argument("--interleave", action="store_true",
                   help="step all shapes in rounds, each round's kernels compiled together (many shapes)")
    s.add_argument("--finalists", type=count_type, default=3,
                   help="the best candidates per shape re-timed in interleaved rounds; each scenario's winner is "
                        "the best median fresh speedup (default 3; 1: the incumbent alone, timed once)")
    s.add_argument("--seed", type=int, default=0, help="the same seed makes the same proposals")
    s.add_argument("--target", default="sm90a", help="the GPU's target (proposals use any rule it runs)")
    s.add_argument("--problem", help="problem class 'gemm m=1 n=1 k=1 a=f16:row ...' (sizes come from shapes)")
    s.add_argument("--db", default=DEFAULT_DB, help=f"records DB (default {DEFAULT_DB})")
    s.add_argument("--resume", type=int, metavar="RUN", help="continue run RUN from the records DB")
    s.add_argument("--compile-only", action="store_true", help="lower and compile the proposals; time nothing")
    s.add_argument("--standin", action="store_true", help="search against the stand-in cost model (NOT measured)")
    s.add_argument("--cache-dir", default=".l2ir-cache", help="compile cache")
    s.add_argument("--device-sm", default="sm_90", help="SASS target of the GPU that runs the kernels")
    s.add_argument("--gpus", default="all",
                   help="GPUs that evaluate candidates at once, one worker each: N, all (default) or a list 0,1")
    s.add_argument("--cluster", metavar="local|ADDRESS",
                   help="run on Dask: 'local' (a GPU worker per --gpus device, CPU workers compile) or a scheduler's "
                        "address or scheduler file (default: $DASK_SCHEDULER_ADDRESS, else the local pool)")
    s.set_defaults(fn=_guard(cmd_tune))

    s = sub.add_parser("runs", help="the search runs in the records DB")
    s.add_argument("--db", default=DEFAULT_DB)
    s.set_defaults(fn=_guard(cmd_runs))

    s = sub.add_parser("best", help="the best kernel for a shape: its IR and its numbers")
    s.add_argument("--shape", type=shape_type, required=True)
    s.add_argument("--problem", help="problem class line (sizes come from --shape)")
    s.add_argument("--env", help="an environment id (default: the GPU with the most measurements of the shape)")
    s.add_argument("--db", default=DEFAULT_DB)
    s.set_defaults(fn=_guard(cmd_best))

    s = sub.add_parser("report", help="markdown table by FLOP regime and PNG plots from the records DB")
    s.add_argument("--out", default="bench/results/tune_report", help="output folder")
    s.add_argument("--env", help="an environment id (default: every environment, one section each)")
    s.add_argument("--run", type=int, help="only the shapes this run searched")
    s.add_argument("--db", default=DEFAULT_DB)
    s.set_defaults(fn=_guard(cmd_report))

    s = sub.add_parser("db", help="records DB maintenance")
    dsub = s.add_subparsers(dest="db_cmd", required=True)
    d = dsub.add_parser("import", help="import bench/results JSONL measurements")
    d.add_argument("files", nargs="+")
    d.add_argument("--db", default=DEFAULT_DB)
    d.set_defaults(fn=_guard(cmd_db_import))


def _guard(fn):
    """TuneError -> the CLI's one-line error (l2ir.cli prints a ValueError-free CliError the same way)."""
    def run(args) -> int:
        try:
            return fn(args)
        except TuneError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    return run
