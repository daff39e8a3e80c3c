"""The records DB: every environment, kernel, measurement, search run, edit and model call, in one SQLite file.

One file, no server (standard-library `sqlite3`), write-ahead log so a reader (`l2ir runs`, `l2ir report`) never
blocks a running search. The schema carries a version (`PRAGMA user_version`); `MIGRATIONS[i]` takes a file from
version i to i+1, so an old DB is brought up to date when it is opened.

Durability: every write that belongs to one candidate (its kernel row, its measurements, the edit that made it,
the run's progress) goes through one `transaction()`, so a `kill -9` at any moment leaves the DB as it was before
or after that candidate, never half of it; a killed run loses at most the candidates in flight.

Rankings never mix machines: every measurement points at an environment row (a hash of the GPU, its SM count and
clocks, driver, CUDA, torch, CUTLASS), and every ranking query names one environment. The stand-in evaluator's
numbers live under their own environment ("stand-in cost model"), so they can never rank against a GPU.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import re
import sqlite3
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from .evaluator import Measurement
from .records import read_results_text, results_file, unarchived

# What makes two timings comparable. The current SM clock, host name and Python version are recorded but left out:
# they change between runs on the very same machine without changing what a kernel costs.
ENV_KEYS = ("gpu", "capability", "sms", "sm_clock_max_mhz", "mem_clock_mhz", "driver", "cuda_runtime", "torch",
            "cutlass")

SCHEMA_V1 = """
CREATE TABLE environments (
    id TEXT PRIMARY KEY, gpu TEXT, capability TEXT, sms INTEGER, sm_clock_max_mhz INTEGER, mem_clock_mhz INTEGER,
    driver TEXT, cuda TEXT, torch TEXT, cutlass TEXT, measured INTEGER NOT NULL DEFAULT 1, json TEXT NOT NULL);
CREATE TABLE kernels (
    hash TEXT PRIMARY KEY, ir TEXT, backend TEXT, target TEXT, compile_ok INTEGER, compile_error TEXT,
    compile_seconds REAL, artifact_key TEXT, resources TEXT, sass TEXT, created REAL);
CREATE TABLE runs (
    id INTEGER PRIMARY KEY, command TEXT, config TEXT, seed INTEGER, policy TEXT, budget TEXT, status TEXT,
    started REAL, finished REAL);
CREATE TABLE measurements (
    id INTEGER PRIMARY KEY, kernel TEXT NOT NULL, problem TEXT NOT NULL, m INTEGER, n INTEGER, k INTEGER,
    problem_class TEXT, environment TEXT NOT NULL REFERENCES environments(id), scenario TEXT NOT NULL,
    passed INTEGER NOT NULL, verdicts TEXT, errors TEXT, kernel_us TEXT, baseline_us TEXT, kernel_median_us REAL,
    baseline_median_us REAL, speedup REAL, spread REAL, backend TEXT, run INTEGER, purpose TEXT, source TEXT,
    record TEXT, created REAL);
CREATE TABLE edits (
    id INTEGER PRIMARY KEY, run INTEGER REFERENCES runs(id), problem TEXT, step INTEGER, parent TEXT, child TEXT,
    backend TEXT, policy TEXT, edit TEXT, verdict TEXT, detail TEXT, reward REAL, gpu_seconds REAL,
    compile_seconds REAL, created REAL);
CREATE TABLE llm_calls (
    id INTEGER PRIMARY KEY, run INTEGER, prompt_hash TEXT, prompt TEXT, reply TEXT, model TEXT,
    prompt_tokens INTEGER, reply_tokens INTEGER, latency_s REAL, created REAL);
"""

# v2: per-kernel gate verdicts that depend only on the problem class (reused across shapes), the learned policies'
# persisted state, and the indexes the ranking and resume queries walk.
SCHEMA_V2 = """
CREATE TABLE class_gates (
    kernel TEXT NOT NULL, problem_class TEXT NOT NULL, environment TEXT NOT NULL, verdicts TEXT NOT NULL,
    passed INTEGER NOT NULL, created REAL, PRIMARY KEY (kernel, problem_class, environment));
CREATE TABLE policy_state (name TEXT PRIMARY KEY, state BLOB, updated REAL);
CREATE INDEX measurements_rank ON measurements (environment, problem, scenario, passed);
CREATE INDEX measurements_run ON measurements (run);
CREATE INDEX edits_run ON edits (run, problem, step);
"""

# v3: an LLM policy's trajectory per model call: the problem and parent it was asked about, the cost, the parse
# verdict with its located errors, the proposals that passed the checks and (JSON, filled in by the loop's feedback)
# each proposal's gate verdict and reward.
SCHEMA_V3 = """
ALTER TABLE llm_calls ADD COLUMN problem TEXT;
ALTER TABLE llm_calls ADD COLUMN parent TEXT;
ALTER TABLE llm_calls ADD COLUMN cost REAL;
ALTER TABLE llm_calls ADD COLUMN verdict TEXT;
ALTER TABLE llm_calls ADD COLUMN errors TEXT;
ALTER TABLE llm_calls ADD COLUMN proposals TEXT;
ALTER TABLE llm_calls ADD COLUMN outcomes TEXT;
CREATE INDEX llm_calls_run ON llm_calls (run, problem);
"""

MIGRATIONS = (SCHEMA_V1, SCHEMA_V2, SCHEMA_V3)
SCHEMA_VERSION = len(MIGRATIONS)


class DBError(Exception):
    """A records DB that cannot be used (newer schema, not a DB, bad import file)."""


def environment_id(env: dict) -> str:
    key = {k: env.get(k) for k in ENV_KEYS}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


_SHAPE = re.compile(r"\bm=(\d+) n=(\d+) k=(\d+)\b")


def split_problem(problem_text: str) -> tuple[tuple[int, int, int] | None, str]:
    """'gemm m=.. n=.. k=.. a=..' -> ((m, n, k), 'a=.. b=.. c=.. acc=..')."""
    mt = _SHAPE.search(problem_text)
    shape = tuple(int(x) for x in mt.groups()) if mt else None
    cls = " ".join(w for w in problem_text.split() if not re.match(r"^(gemm|m=|n=|k=)", w))
    return shape, cls


def spread_of(record: dict) -> float | None:
    """The relative spread a speedup is trusted to: half the kernel's and half the baseline's interquartile range
    over their medians, added (the ratio of two noisy medians is off by about the sum of their relative errors)."""
    total = 0.0
    for key in ("kernel_stats", "baseline_stats"):
        st = record.get(key) or {}
        if not st.get("median"):
            return None
        total += (st["q75"] - st["q25"]) / (2 * st["median"])
    return total


@dataclass
class Row:
    """One measurement as the ranking queries return it."""

    id: int
    kernel: str
    problem: str
    scenario: str
    environment: str
    passed: bool
    speedup: float | None
    spread: float | None
    kernel_median_us: float | None
    baseline_median_us: float | None
    run: int | None
    purpose: str | None

    @property
    def shape(self) -> tuple[int, int, int] | None:
        return split_problem(self.problem)[0]


_ROW_COLS = ("id, kernel, problem, scenario, environment, passed, speedup, spread, kernel_median_us, "
             "baseline_median_us, run, purpose")


def _row(r) -> Row:
    return Row(r[0], r[1], r[2], r[3], r[4], bool(r[5]), r[6], r[7], r[8], r[9], r[10], r[11])


class RecordsDB:
    """The SQLite store. Thread-confined: open one per process (the loop's workers report to the parent)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if str(path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.conn = sqlite3.connect(str(path), timeout=30.0, isolation_level=None)
            self.conn.execute("PRAGMA journal_mode=WAL")
        except sqlite3.DatabaseError as e:
            raise DBError(f"{path}: not a records DB ({e})") from None
        # NORMAL in WAL mode: a committed transaction survives the process being killed (only a power loss can
        # take back the last commits), at a fraction of FULL's fsyncs.
        self.conn.execute("PRAGMA synchronous=NORMAL")
        self.conn.execute("PRAGMA foreign_keys=ON")
        self._depth = 0
        self._migrate()

    # -- schema -------------------------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self.conn.execute("PRAGMA user_version").fetchone()[0]

    def _migrate(self):
        v = self.version
        if v > SCHEMA_VERSION:
            raise DBError(f"{self.path}: schema version {v} is newer than this L2IR's ({SCHEMA_VERSION}); "
                          "upgrade L2IR to read it")
        for i in range(v, SCHEMA_VERSION):
            with self.transaction():
                for stmt in _statements(MIGRATIONS[i]):
                    self.conn.execute(stmt)
                self.conn.execute(f"PRAGMA user_version = {i + 1}")

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """All writes inside commit together or not at all; nested uses join the outer transaction."""
        if self._depth == 0:
            self.conn.execute("BEGIN IMMEDIATE")
        self._depth += 1
        try:
            yield self.conn
        except BaseException:
            self._depth -= 1
            if self._depth == 0:
                self.conn.execute("ROLLBACK")
            raise
        self._depth -= 1
        if self._depth == 0:
            self.conn.execute("COMMIT")

    def close(self):
        self.conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- environments and kernels -------------------------------------------------------------------------------

    def add_environment(self, env: dict, measured: bool = True) -> str:
        eid = environment_id(env)
        with self.transaction() as c:
            c.execute("INSERT OR IGNORE INTO environments VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                      (eid, env.get("gpu"), env.get("capability"), env.get("sms"), env.get("sm_clock_max_mhz"),
                       env.get("mem_clock_mhz"), env.get("driver"), env.get("cuda_runtime"), env.get("torch"),
                       env.get("cutlass"), int(measured), json.dumps(env, sort_keys=True, default=str)))
        return eid

    def environment(self, eid: str) -> dict | None:
        r = self.conn.execute("SELECT json FROM environments WHERE id=?", (eid,)).fetchone()
        return json.loads(r[0]) if r else None

    def environments(self) -> list[tuple[str, dict, int]]:
        """(id, environment, number of measurements) for every environment."""
        rows = self.conn.execute("SELECT e.id, e.json, (SELECT COUNT(*) FROM measurements m WHERE m.environment"
                                 " = e.id) FROM environments e ORDER BY e.rowid").fetchall()
        return [(r[0], json.loads(r[1]), r[2]) for r in rows]

    def add_kernel(self, kernel_hash: str, ir: str | None = None, backend: str | None = None,
                   target: str | None = None, compile_ok: bool | None = None, compile_error: str | None = None,
                   compile_seconds: float | None = None, artifact_key: str | None = None,
                   resources: dict | None = None, sass: dict | None = None):
        """Insert a kernel or fill in what an earlier row lacked (an imported record has no IR until a summary
        file provides it; a proposal has no compile result until it is built)."""
        vals = dict(ir=ir, backend=backend, target=target,
                    compile_ok=None if compile_ok is None else int(compile_ok), compile_error=compile_error,
                    compile_seconds=compile_seconds, artifact_key=artifact_key,
                    resources=None if resources is None else json.dumps(resources, default=str),
                    sass=None if sass is None else json.dumps(sass))
        with self.transaction() as c:
            c.execute("INSERT OR IGNORE INTO kernels (hash, created) VALUES (?, ?)", (kernel_hash, time.time()))
            sets = [(k, v) for k, v in vals.items() if v is not None]
            if sets:
                c.execute(f"UPDATE kernels SET {', '.join(f'{k}=?' for k, _ in sets)} WHERE hash=?",
                          [v for _, v in sets] + [kernel_hash])

    def kernel(self, kernel_hash: str) -> dict | None:
        """The kernel row; `kernel_hash` may be a unique prefix."""
        cur = self.conn.execute("SELECT * FROM kernels WHERE hash LIKE ? LIMIT 2", (kernel_hash + "%",))
        rows = cur.fetchall()
        if len(rows) != 1:
            return None
        d = dict(zip([c[0] for c in cur.description], rows[0]))
        for k in ("resources", "sass"):
            d[k] = json.loads(d[k]) if d[k] else None
        return d

    # -- measurements: the store interface ----------------------------------------------------------------------

    def add(self, measurement, name: str = "", origin: str = "") -> dict:
        """The `Store` interface (search/records.py): record one Measurement; returns the record as stored."""
        rec = measurement.to_json() if isinstance(measurement, Measurement) else dict(measurement)
        rec["config"] = name
        if origin:
            rec["origin"] = origin
        self.add_many([rec], source=origin)
        return rec

    def lookup(self, kernel_hash: str, problem: str, scenario: str, artifact_key: str | None = None) -> dict | None:
        """The `Store` interface: the latest record for this kernel, problem and scenario (and binary)."""
        rows = self.conn.execute("SELECT record FROM measurements WHERE kernel=? AND problem=? AND scenario=? "
                                 "ORDER BY id DESC", (kernel_hash, problem, scenario)).fetchall()
        for (r,) in rows:
            rec = json.loads(r)
            if artifact_key is None or rec.get("artifact_key", "") == artifact_key:
                return rec
        return None

    def __iter__(self):
        """The `Store` interface: every record, in the order they were added."""
        return (json.loads(r[0]) for r in self.conn.execute("SELECT record FROM measurements ORDER BY id"))

    def add_many(self, measurements: Iterable[Measurement | dict], run: int | None = None, purpose: str = "search",
                 source: str = "", backend: str | None = None, measured: bool = True) -> list[int]:
        """Record measurements (Measurement objects or their JSON form) in one transaction; returns their row ids.
        `purpose` says why it was measured: "search" (a candidate), "retime" (a winner on fresh samples),
        "import" (an earlier bench file)."""
        ids = []
        with self.transaction() as c:
            for m in measurements:
                rec = m.to_json() if isinstance(m, Measurement) else dict(m)
                env = rec.get("environment") or {}
                eid = self.add_environment(env, measured and not env.get("standin"))
                shape, cls = split_problem(rec["problem"])
                self.add_kernel(rec["kernel_hash"], compile_seconds=rec.get("compile_seconds"),
                                artifact_key=rec.get("artifact_key") or None)
                verdicts = rec.get("verdicts") or []
                passed = (not rec.get("errors")) and bool(verdicts) and all(v["passed"] for v in verdicts)
                cur = c.execute(
                    "INSERT INTO measurements (kernel, problem, m, n, k, problem_class, environment, scenario, passed,"
                    " verdicts, errors, kernel_us, baseline_us, kernel_median_us, baseline_median_us, speedup, spread,"
                    " backend, run, purpose, source, record, created) "
                    "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    (rec["kernel_hash"], rec["problem"], *(shape or (None, None, None)), cls, eid, rec["scenario"],
                     int(passed), json.dumps(verdicts), json.dumps(rec.get("errors") or []),
                     json.dumps(rec.get("kernel_us") or []), json.dumps(rec.get("baseline_us") or []),
                     rec.get("kernel_median_us"), rec.get("baseline_median_us"), rec.get("speedup"),
                     spread_of(rec), backend, run, purpose, source, json.dumps(rec, sort_keys=True, default=str),
                     time.time()))
                ids.append(cur.lastrowid)
        return ids

    def measurements(self, problem: str | None = None, kernel: str | None = None, environment: str | None = None,
                     scenario: str | None = None, run: int | None = None, purpose: str | None = None) -> list[Row]:
        where, args = _where(problem=problem, kernel=kernel, environment=environment, scenario=scenario, run=run,
                             purpose=purpose)
        return [_row(r) for r in self.conn.execute(f"SELECT {_ROW_COLS} FROM measurements{where} ORDER BY id",
                                                    args)]

    def record(self, row_id: int) -> Measurement:
        r = self.conn.execute("SELECT record FROM measurements WHERE id=?", (row_id,)).fetchone()
        fields = Measurement.__dataclass_fields__
        return Measurement.from_json({k: v for k, v in json.loads(r[0]).items() if k in fields})

    def samples(self, row_id: int) -> tuple[list[float], list[float]]:
        r = self.conn.execute("SELECT kernel_us, baseline_us FROM measurements WHERE id=?", (row_id,)).fetchone()
        return json.loads(r[0]), json.loads(r[1])

    def paired_samples(self, problem: str, kernel: str, environment: str, scenario: str = "offline",
                       purpose: str | None = None) -> list[tuple[list[float], list[float]]]:
        """(kernel samples, baseline samples) of every gate-clean measurement of `kernel` on `problem` (with
        `purpose`, only those): each side's i-th sample comes from the same round (search/timing.py)."""
        where, args = _where(problem=problem, kernel=kernel, environment=environment, scenario=scenario,
                             purpose=purpose)
        return [(json.loads(k or "[]"), json.loads(b or "[]")) for k, b in self.conn.execute(
            f"SELECT kernel_us, baseline_us FROM measurements{where} AND passed=1 ORDER BY id", args)]

    def paired_speedup(self, problem: str, kernel: str, environment: str, scenario: str = "offline",
                       purpose: str | None = None, confidence: float = 0.95):
        """The kernel's paired speedup on `problem` (search/timing.PairedSpeedup: the lower `confidence` bound of
        its median per-round speedup, the speedup of its rounds' totals, the rounds) over `paired_samples`."""
        from .timing import paired_speedup

        return paired_speedup(self.paired_samples(problem, kernel, environment, scenario, purpose), confidence)

    def ranking(self, problem: str, environment: str, scenario: str = "offline", purpose: str | None = None,
                limit: int = 10, per_kernel: str = "best") -> list[Row]:
        """Gate-clean measurements of one problem on one environment, fastest first, one row per kernel: its best,
        or with per_kernel="median" its median trial (the lower one of an even count), so that a kernel re-timed
        N times is judged by its typical trial, not its luckiest. An environment must be named: numbers from two
        machines are never ranked together."""
        if not environment:
            raise ValueError("a ranking needs an environment: timings from different machines do not compare")
        if per_kernel not in ("best", "median"):
            raise ValueError(f"per_kernel must be 'best' or 'median', not {per_kernel!r}")
        where, args = _where(problem=problem, environment=environment, scenario=scenario, purpose=purpose)
        rows = self.conn.execute(
            f"SELECT {_ROW_COLS} FROM measurements{where} AND passed=1 AND speedup IS NOT NULL "
            "ORDER BY speedup DESC, id", args).fetchall()
        trials: dict[str, list] = {}
        for r in rows:                      # fastest first within each kernel too
            trials.setdefault(r[1], []).append(r)
        pick = (lambda rs: rs[0]) if per_kernel == "best" else (lambda rs: rs[len(rs) // 2])
        chosen = [_row(pick(rs)) for rs in trials.values()]
        chosen.sort(key=lambda row: (-row.speedup, row.id))
        return chosen[:limit]

    def solved_problems(self, environment: str, problem_class: str, scenario: str = "offline") -> list[str]:
        rows = self.conn.execute(
            "SELECT DISTINCT problem FROM measurements WHERE environment=? AND problem_class=? AND scenario=? "
            "AND passed=1 AND speedup IS NOT NULL ORDER BY problem", (environment, problem_class, scenario))
        return [r[0] for r in rows]

    def nearest_winners(self, problem: str, environment: str, count: int = 3, per_problem: int = 1,
                        scenario: str = "offline") -> list[str]:
        """The best kernels of the solved problems nearest to `problem` (distance in log M, N, K) on this
        environment: a kernel is shape-independent, so a neighbour's winner is a free candidate here."""
        (m, n, k), cls = split_problem(problem)
        scored = []
        for p in self.solved_problems(environment, cls, scenario):
            if p == problem:
                continue
            (pm, pn, pk), _ = split_problem(p)
            d = math.dist((math.log2(m), math.log2(n), math.log2(k)), (math.log2(pm), math.log2(pn), math.log2(pk)))
            scored.append((d, p))
        out: list[str] = []
        for _, p in sorted(scored)[:count]:
            for r in self.ranking(p, environment, scenario, limit=per_problem):
                if r.kernel not in out:
                    out.append(r.kernel)
        return out

    # -- gates that depend only on the kernel and the problem class ---------------------------------------------

    def add_class_gates(self, kernel: str, problem_class: str, environment: str, verdicts: list[dict]):
        passed = all(v["passed"] for v in verdicts)
        with self.transaction() as c:
            c.execute("INSERT OR REPLACE INTO class_gates VALUES (?,?,?,?,?,?)",
                      (kernel, problem_class, environment, json.dumps(verdicts), int(passed), time.time()))

    def class_gates(self, kernel: str, problem_class: str, environment: str) -> list[dict] | None:
        r = self.conn.execute("SELECT verdicts FROM class_gates WHERE kernel=? AND problem_class=? AND environment=?",
                              (kernel, problem_class, environment)).fetchone()
        return json.loads(r[0]) if r else None

    # -- runs, edits, model calls, policy state -----------------------------------------------------------------

    def start_run(self, command: str, config: dict, seed: int, policy: str, budget: dict) -> int:
        with self.transaction() as c:
            cur = c.execute("INSERT INTO runs (command, config, seed, policy, budget, status, started) "
                            "VALUES (?,?,?,?,?,?,?)", (command, json.dumps(config, sort_keys=True), seed, policy,
                                                       json.dumps(budget, sort_keys=True), "running", time.time()))
            return cur.lastrowid

    def set_run_status(self, run: int, status: str):
        with self.transaction() as c:
            c.execute("UPDATE runs SET status=?, finished=? WHERE id=?",
                      (status, time.time() if status != "running" else None, run))

    def run(self, run: int) -> dict | None:
        cur = self.conn.execute("SELECT * FROM runs WHERE id=?", (run,))
        r = cur.fetchone()
        if r is None:
            return None
        d = dict(zip([c[0] for c in cur.description], r))
        d["config"], d["budget"] = json.loads(d["config"] or "{}"), json.loads(d["budget"] or "{}")
        return d

    def runs(self) -> list[dict]:
        ids = [r[0] for r in self.conn.execute("SELECT id FROM runs ORDER BY id")]
        out = []
        for i in ids:
            d = self.run(i)
            d.update(self.run_totals(i))
            out.append(d)
        return out

    def run_totals(self, run: int, problem: str | None = None) -> dict:
        """Candidates (built or measured), failures (compile, gates, errors), illegal proposals, duplicates and the
        GPU-seconds spent, over the run's edits (of one problem if given)."""
        where, args = _where(run=run, problem=problem)
        r = self.conn.execute(
            "SELECT COALESCE(SUM(verdict IN ('measured', 'failed', 'compiled')), 0), "
            "COALESCE(SUM(verdict = 'failed'), 0), COALESCE(SUM(verdict = 'illegal'), 0), "
            f"COALESCE(SUM(verdict = 'duplicate'), 0), COALESCE(SUM(gpu_seconds), 0) FROM edits{where}",
            args).fetchone()
        retime = self.conn.execute(f"SELECT COALESCE(SUM(json_extract(record, '$.gpu_seconds')), 0) FROM measurements"
                                   f"{_where(run=run, problem=problem)[0]} AND purpose='retime'", args).fetchone()[0]
        return {"candidates": r[0], "failures": r[1], "illegal": r[2], "duplicates": r[3],
                "gpu_seconds": r[4] + (retime or 0)}

    def add_edit(self, run: int | None, problem: str, step: int, parent: str | None, child: str | None, policy: str,
                 edit: str, verdict: str, detail: str = "", reward: float | None = None, backend: str | None = None,
                 gpu_seconds: float = 0.0, compile_seconds: float = 0.0) -> int:
        with self.transaction() as c:
            cur = c.execute("INSERT INTO edits (run, problem, step, parent, child, backend, policy, edit, verdict, "
                            "detail, reward, gpu_seconds, compile_seconds, created) "
                            "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                            (run, problem, step, parent, child, backend, policy, edit, verdict, detail, reward,
                             gpu_seconds, compile_seconds, time.time()))
            return cur.lastrowid

    def edits(self, run: int, problem: str | None = None) -> list[dict]:
        return self._rows("edits", run=run, problem=problem)

    def _rows(self, table: str, **conds) -> list[dict]:
        """The rows of `table` that match `conds` (a None condition matches all), oldest first, as dicts."""
        where, args = _where(**conds)
        cur = self.conn.execute(f"SELECT * FROM {table}{where} ORDER BY id", args)
        cols = [c[0] for c in cur.description]
        return [dict(zip(cols, r)) for r in cur.fetchall()]

    def add_llm_call(self, run: int | None, prompt: str, reply: str, model: str, prompt_tokens: int,
                     reply_tokens: int, latency_s: float, cost: float | None = None, problem: str | None = None,
                     parent: str | None = None, verdict: str | None = None, errors: str | None = None,
                     proposals: str | None = None) -> int:
        with self.transaction() as c:
            cur = c.execute("INSERT INTO llm_calls (run, prompt_hash, prompt, reply, model, prompt_tokens, "
                            "reply_tokens, latency_s, created, cost, problem, parent, verdict, errors, proposals) "
                            "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                            (run, hashlib.sha256(prompt.encode()).hexdigest(), prompt, reply, model, prompt_tokens,
                             reply_tokens, latency_s, time.time(), cost, problem, parent, verdict, errors,
                             proposals))
            return cur.lastrowid

    def set_llm_outcomes(self, call: int, outcomes: list[dict]):
        """The gate verdict and reward of each proposal of model call `call`, as they are known."""
        with self.transaction() as c:
            c.execute("UPDATE llm_calls SET outcomes=? WHERE id=?", (json.dumps(outcomes), call))

    def llm_calls(self, run: int | None = None) -> list[dict]:
        """Model calls (a run's, or all), oldest first, JSON columns decoded."""
        out = self._rows("llm_calls", run=run)
        for d in out:
            for k in ("errors", "proposals", "outcomes"):
                d[k] = json.loads(d[k]) if d[k] else []
        return out

    def save_policy_state(self, name: str, state: bytes):
        with self.transaction() as c:
            c.execute("INSERT OR REPLACE INTO policy_state VALUES (?,?,?)", (name, state, time.time()))

    def load_policy_state(self, name: str) -> bytes | None:
        r = self.conn.execute("SELECT state FROM policy_state WHERE name=?", (name,)).fetchone()
        return r[0] if r else None

    # -- import -------------------------------------------------------------------------------------------------

    def import_jsonl(self, path: str | Path) -> int:
        """Import a bench/results JSONL file or its archive `.jsonl.gz` (one Measurement per line; the last line, cut
        by a kill, is skipped, and so are blank lines; any other line that is not a measurement record is a DBError
        naming file and line, and nothing of the file is imported). The IR and backend of each kernel are taken from
        the summary beside it (<prefix>.json, 'kernels'), where there is one; a bench's `<prefix>-fresh.jsonl` (its
        winners re-timed on fresh samples; a server race's trial N: `<prefix>-tN-fresh.jsonl`) is imported with
        purpose "retime" and the summary of <prefix>. Importing the same file twice adds nothing the second time.
        Returns the number of measurements added."""
        path = results_file(path)       # a file that was archived since its name was written down: its .gz
        try:
            lines = read_results_text(path).splitlines()
        except (OSError, EOFError, zlib.error, UnicodeDecodeError) as e:
            raise DBError(f"{path}: cannot read: {getattr(e, 'strerror', None) or e}") from None
        plain = unarchived(path)               # run.jsonl.gz counts as run.jsonl: same source, same summary
        source = f"import:{plain.name}"
        if self.conn.execute("SELECT 1 FROM measurements WHERE source=? LIMIT 1", (source,)).fetchone():
            return 0
        fresh = plain.stem.endswith("-fresh")
        # PREFIX.jsonl, PREFIX-fresh.jsonl and a server race's later trials PREFIX-tN-fresh.jsonl share PREFIX.json
        summary = plain.with_name(re.sub(r"(-t\d+)?-fresh$", "", plain.stem) + ".json")
        ir = _summary_kernels(summary)
        added = 0
        last = max((i for i, line in enumerate(lines, 1) if line.strip()), default=0)
        with self.transaction():
            for i, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    rec["kernel_hash"], rec["problem"], rec["scenario"]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    if i == last:
                        continue              # the line a kill cut short
                    what = f"no '{e.args[0]}' field" if isinstance(e, KeyError) else type(e).__name__
                    raise DBError(f"{path}:{i}: not a measurement record ({what})") from None
                rec.pop("config", None)
                self.add_many([rec], purpose="retime" if fresh else "import", source=source)
                h = rec["kernel_hash"]
                if h[:12] in ir:
                    self.add_kernel(h, ir=ir[h[:12]][0], backend=ir[h[:12]][1])
                added += 1
        return added

    def import_results_dir(self, folder: str | Path) -> int:
        paths = sorted([*Path(folder).glob("*.jsonl"), *Path(folder).glob("*.jsonl.gz")])
        return sum(self.import_jsonl(p) for p in paths)

    def is_empty(self) -> bool:
        return self.conn.execute("SELECT COUNT(*) FROM measurements").fetchone()[0] == 0


def _summary_kernels(path: Path) -> dict[str, tuple[str, str | None]]:
    """12-hex kernel hash -> (IR, backend it was lowered with; None: the registry's default) from a bench summary."""
    try:
        summary = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return {h: (kr["kernel"], kr.get("backend")) for h, kr in (summary.get("kernels") or {}).items()
            if kr.get("kernel")}


def _where(**conds) -> tuple[str, list]:
    parts = [(k, v) for k, v in conds.items() if v is not None]
    if not parts:
        return " WHERE 1=1", []
    return " WHERE " + " AND ".join(f"{k}=?" for k, _ in parts), [v for _, v in parts]


def _statements(script: str) -> list[str]:
    # executescript() would COMMIT the open transaction first; run the migration's statements one by one inside it.
    return [s.strip() for s in script.split(";") if s.strip()]


def open_readonly(path: str | Path) -> RecordsDB:
    """The records DB at `path` for reading: SQLite opens the file with mode=ro, so nothing here can migrate or
    write it (a DB of an older schema is copied into memory and migrated there). Raises DBError."""
    path = Path(path)
    if not path.is_file():
        raise DBError(f"{path}: no such file")
    try:
        conn = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True, isolation_level=None)
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except sqlite3.DatabaseError as e:
        raise DBError(f"{path}: not a records DB ({e})") from None
    if version > SCHEMA_VERSION:
        conn.close()
        raise DBError(f"{path}: schema version {version} is newer than this L2IR's ({SCHEMA_VERSION}); "
                      "upgrade L2IR to read it")
    if version < SCHEMA_VERSION:
        memory = sqlite3.connect(":memory:", isolation_level=None)
        conn.backup(memory)
        conn.close()
        conn = memory
    db = RecordsDB.__new__(RecordsDB)          # RecordsDB's queries over this connection, without its opening
    db.path, db.conn, db._depth = path, conn, 0
    if version < SCHEMA_VERSION:
        db._migrate()
    return db


def open_db(path: str | Path, import_from: str | Path | None = None) -> RecordsDB:
    """Open (creating or migrating) a records DB; a new, empty one first imports the JSONL results in
    `import_from` (bench/results), so earlier measurements seed the search."""
    db = RecordsDB(path)
    if import_from is not None and db.is_empty() and Path(import_from).is_dir():
        db.import_results_dir(import_from)
    return db
