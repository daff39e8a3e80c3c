"""`l2ir export`: the records DB of one GPU -> a self-contained dispatch package that `l2ir.matmul` loads.

A package is a folder:
    manifest.json      format and version, the environment the numbers were measured in (GPU, SM count, capability,
                       driver, CUDA, torch, CUTLASS), the untuned-shape rule, every file's sha256 and the package's
                       content hash (sha256 over those file hashes)
    table.json         one entry per tuned shape and problem class: the kernel (or null: cuBLAS), its measured speedup
                       and spread, the measurement it came from; and per exported kernel its launch plan
                       (form, entries, grid expressions of m, n, k, block, smem, cluster, workspace) and binary
    kernels/<hash>/    kernel.cubin or kernel.so, kernel.l2 (the IR: the loader checks the verifier's problem rules
                       on it before serving an untuned shape), kernel.cu (for reading only)
    fastpath/          l2ir.matmul's compiled eager path for the exporting machine's Python and torch
                       (l2ir/fastpath.py; without a matching build the loader runs the Python path)

Which kernel a tuned shape gets: among the kernels whose every measurement in the chosen environment passed every
gate (and whose class gates passed), the fastest on that shape in the chosen scenario (the re-timed rows when the
shape has any: a search's own rows favour the lucky sample; a kernel re-timed several times counts by its median
trial), and only if it wins with confidence (`win_verdict`): its speedup is above 1, the lower WIN_CONFIDENCE bound
of a distribution-free confidence interval for the median of its per-round speedups (baseline_i / kernel_i, both
timed in round i, pooled over the measurements the ranking counts: the re-timed trials where the shape has any, else
all its gate-clean rows; search/timing.paired_speedup) is above 1, and so is the speedup of those rounds' totals (a
median ignores a minority of catastrophic rounds). A round's shared state (the flush, the clocks) cancels in its
ratio, so a steady 1.06x on cold calls that scatter 8 % round to round is served, which speedup * (1 - spread) > 1
(the rule before, kept only for a record without samples) refused; a kernel with rounds too few for the bound is
refused. If the fastest clean kernel is not sure, the next is tried at 1 - (1 - WIN_CONFIDENCE) / 2, the third at
1 - (1 - WIN_CONFIDENCE) / 3, and no more (MAX_TESTED): among many kernels that tie with cuBLAS one would pass a 95 %
test by chance. Otherwise the table says cuBLAS for that shape, with the reason.

Eager alternative (host time): a shape whose table entry is cuBLAS also names the fastest gate-clean L2IR kernel
on it when an eager call pays for it (l2ir.dispatch.eager_pays): that kernel's measured device time is within
EAGER_SLACK_US of cuBLAS's, and below max(cuBLAS's, TORCH_ISSUE_US) (max(kernel, L2IR_ISSUE_US) < max(cuBLAS,
TORCH_ISSUE_US)). `l2ir.matmul`
runs it on eager calls, where a small GEMM is host-bound (an H200 issues an L2IR launch in ~9.6 us against
torch.matmul's ~11.4 us, bench/results/dispatch_h200_v2.json, while such a kernel runs 2-5 us), so the call finishes
sooner even though the GPU spends up to EAGER_SLACK_US more; back-to-back calls each take the longer of issue and
device time, so once the device time is the longer one a slower kernel loses every call. A call captured in a CUDA
graph, where only device time counts, runs cuBLAS.

Untuned shapes (resolved by the loader, l2ir/dispatch.py, and cached per shape): the tuned shapes of the same problem
class within
`max_distance` in log2 space of (M, N, K), nearest first; the first one whose winner is cuBLAS decides
cuBLAS, the first whose kernel admits the shape (the verifier's problem rules: divisibility, alignment, split-K
slices, Source grid limits) decides that kernel, if its measured speedup there, carried over by the FLOP ratio and the
ratio of tiles the kernel runs (l2ir.dispatch.predicted_speedup), stays at or above BORROW_MIN_PREDICTED (1.1), and
cuBLAS otherwise (reason `unpromising`: a shape one row past a tile boundary pays a whole tile row, and 32 of 92
borrowed neighbours lost to cuBLAS on the device before this bound, 2 after; bench/results/neighbour_rule_h200.json),
whose eager calls still run the kernel where an eager call pays on its predicted device time (eager_pays; the same
test, on the tuned shape's times carried over, for a neighbour of a cuBLAS shape with an eager kernel);
none within reach: cuBLAS. Alignment: cuBLAS leaves its fast kernels
when a row of A, B or C is not 16-byte aligned, so a tuned shape aligned otherwise than the untuned one (all rows
aligned, or not) counts only when it is aligned, the untuned shape is not, and its winner is a kernel that admits
the shape; a speedup over the slow path, or cuBLAS's win on the fast one, does not carry over (reason `alignment`).

Export is a build tool: it reads the records DB (opened read-only: it never migrates or writes it) and rebuilds binaries from the IR through backends/compile.py (the
compile cache serves them when it has them). The package it writes needs none of that to load.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

FORMAT = "l2ir-dispatch"
FORMAT_VERSION = 1
DEFAULT_MAX_DISTANCE = 1.0      # log2 units: within a factor of 2 along one of M, N, K
# Device time an eager alternative may add to cuBLAS's: below the ~1.8 us of host time an L2IR launch saves on an H200
# (bench/results/dispatch_h200_v2.json), so an eager call that becomes GPU-bound loses less than a host-bound one gains.
EAGER_SLACK_US = 1.0
# Host time to issue one call on the exporting machine's H200 host (bench/results/dispatch_h200_v2.json: an L2IR
# launch through l2ir.matmul ~9.6 us, torch.matmul ~11.4 us): back-to-back eager calls are GPU-bound, and an eager
# kernel slower on the device loses, once cuBLAS's device time is above torch's issue time (l2ir.dispatch.eager_pays).
L2IR_ISSUE_US = 9.6
TORCH_ISSUE_US = 11.4
# How sure the export must be that the fastest clean kernel's median paired speedup is above 1 before it replaces
# cuBLAS; the next ones, tried when it is not, must be surer (choose), and no more than MAX_TESTED are tried.
WIN_CONFIDENCE = 0.95
MAX_TESTED = 3
EAGER_RULE = {"eager_slack_us": EAGER_SLACK_US, "l2ir_issue_us": L2IR_ISSUE_US, "torch_issue_us": TORCH_ISSUE_US}
MANIFEST_ENV_KEYS = ("gpu", "capability", "sms", "driver", "cuda_runtime", "torch", "cutlass")


class ExportError(Exception):
    """A DB or option that cannot give a package (no environment, ambiguous environment, unwritable folder)."""


@dataclass
class Choice:
    """The decision for one tuned shape and problem class."""

    m: int
    n: int
    k: int
    problem_class: str
    kernel: str | None               # None: cuBLAS
    backend: str | None = None
    speedup: float | None = None
    spread: float | None = None
    kernel_us: float | None = None
    baseline_us: float | None = None
    measurement: int | None = None
    purpose: str | None = None
    reason: str = ""
    eager_kernel: str | None = None  # cuBLAS shapes: the L2IR kernel eager calls run (see the module doc)
    eager_backend: str | None = None
    eager_kernel_us: float | None = None
    kernel_key: str | None = None    # the packaged binaries of kernel and eager_kernel (set by export)
    eager_kernel_key: str | None = None
    speedup_bound: float | None = None   # the lower confidence bound of the speedup the decision used

    def to_json(self) -> dict:
        return dict(self.__dict__)


def choose_environment(db, env: str | None) -> str:
    envs = [(eid, e, count) for eid, e, count in db.environments() if count and not e.get("standin")]
    if env is not None:
        hits = [eid for eid, _, _ in db.environments() if eid.startswith(env)]
        if len(hits) != 1:
            raise ExportError(f"--env {env}: {'no' if not hits else 'more than one'} environment matches "
                              f"(environments: {', '.join(eid for eid, _, _ in envs) or 'none'})")
        return hits[0]
    if len(envs) != 1:
        listing = "; ".join(f"{eid} ({e.get('gpu')}, {count} measurements)" for eid, e, count in envs)
        raise ExportError(f"{'no measured environment' if not envs else 'several environments'} in the DB; "
                          f"name one with --env ({listing or 'none'})")
    return envs[0][0]


def _clean_kernels(db, environment: str) -> tuple[set[str], dict[str, str]]:
    """(kernels with a failed measurement or failed class gates in this environment, backend per kernel)."""
    dirty = {r[0] for r in db.conn.execute(
        "SELECT DISTINCT kernel FROM measurements WHERE environment=? AND passed=0", (environment,))}
    dirty |= {r[0] for r in db.conn.execute(
        "SELECT DISTINCT kernel FROM class_gates WHERE environment=? AND passed=0", (environment,))}
    backends = {}
    for kernel, backend in db.conn.execute(
            "SELECT kernel, backend FROM measurements WHERE environment=? AND backend IS NOT NULL", (environment,)):
        backends[kernel] = backend
    return dirty, backends


def win_verdict(speedup: float | None, spread: float | None, paired, confidence: float = WIN_CONFIDENCE
                ) -> tuple[bool, float | None, str]:
    """(whether a kernel beats cuBLAS on a shape, the bound that decided, how), from its ranked speedup and spread
    and its paired rounds (search/timing.PairedSpeedup): a speedup above 1, a median per-round speedup above 1 at
    `confidence`, and rounds whose totals are faster too (a median ignores a minority of catastrophic rounds). A
    kernel with paired rounds too few for the bound is refused; only a record without samples (hand-made) falls
    back to speedup * (1 - spread) > 1."""
    if speedup is None:
        return False, None, "no speedup"
    if paired.rounds:
        if paired.bound is None:
            return False, None, f"only {paired.rounds} paired rounds, too few for a {confidence:.1%} bound"
        how = (f"{confidence:.1%} lower bound {paired.bound:.3f} over {paired.rounds} paired rounds, their totals "
               f"{paired.of_totals:.3f}")
        return speedup > 1.0 and paired.bound > 1.0 and paired.of_totals > 1.0, paired.bound, how
    if spread is None:
        return False, None, "no paired samples and no spread"
    return speedup * (1 - spread) > 1.0, speedup * (1 - spread), f"spread {spread:.3f}, no paired samples"


def choose(db, environment: str, scenario: str = "offline", accept=None) -> list[Choice]:
    """One Choice per tuned shape and problem class of `environment` in `scenario` (see the module doc).
    `accept(kernel_row) -> str | None` may rule a kernel out (returning why), e.g. to export only sm80 kernels."""
    from l2ir.dispatch import eager_pays
    from l2ir.search.db import split_problem

    dirty, backends = _clean_kernels(db, environment)

    def backend_of(kernel: str) -> str | None:
        """The backend its measurements name, else the kernel row's (None: the registry's default)."""
        return backends.get(kernel) or (db.kernel(kernel) or {}).get("backend")
    problems = sorted({(r.problem, split_problem(r.problem)[1])
                       for r in db.measurements(environment=environment, scenario=scenario)})
    out = []
    for problem, cls in problems:
        shape, _ = split_problem(problem)
        if shape is None:
            continue
        # A kernel re-timed several times (the server race's --fresh-trials) is judged by its median trial.
        purpose = "retime"
        rows = db.ranking(problem, environment, scenario, purpose=purpose, limit=1000, per_kernel="median")
        if not rows:
            purpose, rows = None, db.ranking(problem, environment, scenario, limit=1000)

        why = "no gate-clean measurement"
        pick = eager = None
        eager_bound = None
        tested = 0
        for r in rows:                      # fastest first; the reason names the fastest kernel ruled out
            if r.kernel in dirty:
                why = why if eager else f"kernel {r.kernel[:12]} failed a gate elsewhere in this environment"
                continue
            row = db.kernel(r.kernel)
            if not row or not row.get("ir"):
                why = why if eager else f"kernel {r.kernel[:12]} has no IR in the DB"
                continue
            if accept is not None and (refusal := accept(row)):
                why = why if eager else f"kernel {r.kernel[:12]} left out: {refusal}"
                continue
            # The j-th clean kernel tested must be sure at 1 - (1 - WIN_CONFIDENCE) / j, and at most MAX_TESTED
            # are: among many kernels that tie with cuBLAS, one would pass a 95 % test by chance.
            tested += 1
            confidence = 1.0 - (1.0 - WIN_CONFIDENCE) / tested
            paired = db.paired_speedup(problem, r.kernel, environment, scenario, purpose, confidence)
            wins, bound, how = win_verdict(r.speedup, r.spread, paired, confidence)
            if eager is None:               # fastest clean kernel, whatever its confidence
                eager, eager_bound = r, bound
                if not wins:
                    speedup = "unknown" if r.speedup is None else f"{r.speedup:.3f}"
                    why = f"best clean speedup {speedup} ({how}) is not above 1 with confidence"
            if wins:
                pick, pick_bound, pick_how = r, bound, how
                break
            if tested == MAX_TESTED:
                break
        if pick is None:
            ch = Choice(*shape, cls, None, reason=why, speedup_bound=eager_bound)
            if (eager is not None and eager.kernel_median_us is not None and eager.baseline_median_us is not None
                    and eager_pays(eager.kernel_median_us, eager.baseline_median_us, EAGER_RULE)):
                ch.eager_kernel = eager.kernel
                ch.eager_backend = backend_of(eager.kernel)
                ch.eager_kernel_us = eager.kernel_median_us
                ch.baseline_us = eager.baseline_median_us      # cuBLAS's own device time on this shape
            out.append(ch)
            continue
        out.append(Choice(*shape, cls, pick.kernel, backend_of(pick.kernel), pick.speedup,
                          pick.spread, pick.kernel_median_us, pick.baseline_median_us, pick.id, pick.purpose,
                          f"fastest gate-clean kernel above 1 with confidence ({pick_how})",
                          speedup_bound=pick_bound))
    return out


def device_sm_of(env: dict) -> str:
    cap = str(env.get("capability") or "")
    if not cap or "." not in cap:
        raise ExportError(f"the environment has no compute capability ({cap!r}); cannot tell which SASS to build")
    return "sm_" + cap.replace(".", "")


def build_binary(ir_text: str, problem_class: str, backend: str | None, device_sm: str, cache_dir: str):
    """(plan, artifact) for one kernel: lowered from its IR for the problem class and compiled (or served from the
    compile cache). Raises ExportError with the compiler's first error line."""
    from l2ir.backends.compile import CompileOptions, compile_plan
    from l2ir.backends.registry import lower
    from l2ir.text import parse_kernel, parse_problem

    kernel = parse_kernel(ir_text)
    problem = parse_problem(f"gemm m=1 n=1 k=1 {problem_class}")
    plan = lower(kernel, problem, backend)
    result = compile_plan(plan, CompileOptions(device_sm=device_sm, cache_dir=cache_dir))
    if not result.ok:
        raise ExportError(f"compile {result.reason}: {result.summary()} (reproduce: {result.repro})")
    return plan, result


def plan_json(plan) -> dict:
    return {"form": plan.form, "arch": plan.arch,
            "launches": [{"entry": ln.entry, "grid": [str(e) for e in ln.grid], "block": list(ln.block),
                          "smem": ln.smem, "cluster": list(ln.cluster), "pdl": ln.pdl} for ln in plan.launches],
            "workspace_bytes": str(plan.workspace_bytes), "zero_workspace": plan.zero_workspace}


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def content_hash(files: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def export(db, out: str | Path, scenario: str = "offline", env: str | None = None, cache_dir: str = ".l2ir-cache",
           max_distance: float = DEFAULT_MAX_DISTANCE, accept=None, build=build_binary, log=print,
           fastpath: bool = True) -> dict:
    """Write the package; returns its manifest. `build(ir, problem_class, backend, device_sm, cache_dir)` makes
    (plan, artifact); a kernel that does not build leaves its shapes to cuBLAS, with the reason in the table.
    `fastpath` also builds l2ir.matmul's compiled eager path into the package (a warning if it cannot)."""
    if scenario not in ("offline", "server"):
        raise ExportError(f"--scenario {scenario}: expected offline or server")
    eid = choose_environment(db, env)
    environment = db.environment(eid)
    device_sm = device_sm_of(environment)
    choices = choose(db, eid, scenario, accept)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        if not (out / "manifest.json").is_file():
            raise ExportError(f"{out}: exists and is not a dispatch package; refusing to overwrite it")
        shutil.rmtree(out)
    (out / "kernels").mkdir(parents=True, exist_ok=True)

    # Build every distinct (kernel, problem class) at once: each compile is its own nvcc process.
    wanted = {(ch.kernel, ch.problem_class): ch.backend for ch in choices if ch.kernel is not None}
    wanted.update({(ch.eager_kernel, ch.problem_class): ch.eager_backend for ch in choices
                   if ch.eager_kernel is not None and (ch.eager_kernel, ch.problem_class) not in wanted})
    from l2ir.backends.compile import COMPILE_PEAK_BYTES_CUTLASS, machine_jobs

    with ThreadPoolExecutor(max_workers=max(1, min(len(wanted), machine_jobs(COMPILE_PEAK_BYTES_CUTLASS)))) as pool:
        futures = {kc: pool.submit(build, db.kernel(kc[0])["ir"], kc[1], backend, device_sm, cache_dir)
                   for kc, backend in wanted.items()}
    built = {}
    for kc, fut in futures.items():
        try:
            built[kc] = fut.result()
        except Exception as e:  # noqa: BLE001 - a kernel that does not build falls back, the export goes on
            built[kc] = e

    kernels: dict[str, dict] = {}
    failed: dict[str, str] = {}

    def package_kernel(kernel: str, cls: str, backend: str | None) -> tuple[str | None, str]:
        """(kernel key in the package, or None with the reason): binary, IR and source copied in once."""
        key = f"{kernel}|{cls}"
        if key in failed:
            return None, failed[key]
        name = f"{kernel[:16]}-{hashlib.sha256(cls.encode()).hexdigest()[:8]}"
        if name not in kernels:
            res = built[(kernel, cls)]
            if isinstance(res, Exception):
                failed[key] = f"binary not built: {(str(res).splitlines() or [type(res).__name__])[0]}"
                log(f"warning: {kernel[:12]} ({cls}): {failed[key]}; its shapes go to cuBLAS")
                return None, failed[key]
            ir = db.kernel(kernel)["ir"]
            plan, art = res
            kdir = out / "kernels" / name
            kdir.mkdir(parents=True, exist_ok=True)
            binary = Path(art.binary)
            shutil.copyfile(binary, kdir / binary.name)
            (kdir / "kernel.l2").write_text(ir if ir.endswith("\n") else ir + "\n")
            (kdir / "kernel.cu").write_text(plan.source)
            kernels[name] = {"hash": kernel, "problem_class": cls, "backend": backend, "dir": f"kernels/{name}",
                             "binary": binary.name, "ir": "kernel.l2", "plan": plan_json(plan)}
        return name, ""

    for ch in choices:
        if ch.kernel is not None:
            ch.kernel_key, why = package_kernel(ch.kernel, ch.problem_class, ch.backend)
            if ch.kernel_key is None:
                ch.reason, ch.kernel = why, None
        if ch.eager_kernel is not None:
            ch.eager_kernel_key, _ = package_kernel(ch.eager_kernel, ch.problem_class, ch.eager_backend)

    entries = [ch.to_json() for ch in choices]
    table = {"environment": eid, "scenario": scenario, "entries": entries, "kernels": kernels}
    (out / "table.json").write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    fast = None
    if fastpath:
        from l2ir import fastpath as fp

        try:
            fast = fp.build(out / "fastpath", cache_dir=cache_dir).name
        except fp.FastPathError as e:
            log(f"warning: {e}; l2ir.matmul will run its Python path")

    files = {str(p.relative_to(out)): sha256_file(p) for p in sorted(out.rglob("*"))
             if p.is_file() and p.name != "manifest.json"}
    manifest = {
        "format": FORMAT, "version": FORMAT_VERSION, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "environment": {"id": eid, **{k: environment.get(k) for k in MANIFEST_ENV_KEYS}},
        "scenario": scenario, "device_sm": device_sm,
        "rule": {"untuned": "nearest tuned shapes of the same problem class in log2(M, N, K); first cuBLAS winner or "
                            "first kernel admitting the shape by the verifier's problem rules; a tuned shape aligned "
                            "otherwise (all rows 16-byte aligned, or not) counts only with a kernel, and only from an "
                            "aligned one to an unaligned shape",
                 "max_distance": max_distance,
                 "eager": "a cuBLAS shape's eager calls run its fastest gate-clean kernel when that kernel's device "
                          "time is within eager_slack_us of cuBLAS's and, where cuBLAS's device time is above "
                          "torch_issue_us, below it (max(kernel, l2ir_issue_us) < max(cuBLAS, torch_issue_us)); "
                          "CUDA-graph captures run cuBLAS",
                 "win_confidence": WIN_CONFIDENCE, **EAGER_RULE},
        "fastpath": fast,
        "files": files, "content_hash": content_hash(files),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    served = sum(1 for e in entries if e["kernel_key"])
    eager = sum(1 for e in entries if e["eager_kernel_key"])
    log(f"{out}: {len(entries)} tuned shapes ({served} served by L2IR kernels, {len(entries) - served} by cuBLAS, "
        f"{eager} of those by an L2IR kernel on eager calls), "
        f"{len(kernels)} binaries, environment {eid} ({environment.get('gpu')}), scenario {scenario}, "
        f"content hash {manifest['content_hash'][:16]}"
        + (f", compiled fast path {fast}" if fast else ""))
    return manifest


def cmd_export(args) -> int:
    """`l2ir export`: the CLI entry (registered in l2ir/cli.py)."""
    from l2ir.search.db import DBError, open_readonly

    if not Path(args.db).is_file():
        print(f"error: --db {args.db}: no such file", file=sys.stderr)
        return 1
    accept = None
    if args.target:
        targets = set(args.target)

        def accept(row):
            import re

            m = re.search(r"target arch=(\S+)", row.get("ir") or "")
            arch = m.group(1) if m else "?"
            return None if arch in targets else f"target {arch} not in --target {','.join(sorted(targets))}"
    try:
        with open_readonly(args.db) as db:
            export(db, args.out, args.scenario, args.env, args.cache_dir, args.max_distance, accept,
                   fastpath=not args.no_fastpath)
    except (ExportError, DBError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def add_parser(sub) -> None:
    s = sub.add_parser("export", help="write a dispatch package (binaries, table, manifest) for l2ir.matmul")
    s.add_argument("--db", required=True, help="records DB (SQLite)")
    s.add_argument("--out", required=True, help="package folder (replaced if it holds an earlier package)")
    s.add_argument("--scenario", choices=("offline", "server"), default="offline")
    s.add_argument("--env", help="environment id (or a unique prefix); needed when the DB holds several")
    s.add_argument("--cache", dest="cache_dir", default=".l2ir-cache",
                   help="compile cache: binaries found there are taken, missing ones are built into it")
    s.add_argument("--max-distance", type=float, default=DEFAULT_MAX_DISTANCE,
                   help="untuned shapes borrow a kernel only from tuned shapes this close in log2(M, N, K)")
    s.add_argument("--target", action="append",
                   help="export only kernels of this target (repeatable, e.g. sm80 for builds of seconds)")
    s.add_argument("--no-fastpath", action="store_true",
                   help="leave out l2ir.matmul's compiled eager path (built for this machine's Python and torch)")
    s.set_defaults(fn=cmd_export)
