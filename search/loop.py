"""The search loop: per problem, a population of kernels grows by policy proposals until a budget is spent; the
incumbent changes only on a win larger than the measured noise, and the best few are timed again on fresh samples
before a winner is chosen and reported.

    for each shape:
        step 0   the initial population: the rule-based seeds (l2ir/seed.py), the best kernels of the nearest solved
                 problems in the records DB on this GPU (kernels are shape-independent), the sweeps (search/bench.py)
        step s   parent = tournament over the population; policy.propose(Context) -> Proposals
                 legalize (verifier, problem rules, lowering: an illegal proposal is a recorded verdict, never a
                 crash) -> dedupe (content hash + backend) -> lower + compile the batch in parallel (each kernel once
                 per problem class, cached on disk) -> evaluate (the batch at once on a pool of GPUs, search/pool.py)
                 -> record, in proposal order -> policy.update(Feedback)
        end      re-time the top `finalists` members (the incumbent first) in rounds, round-robin, on fresh samples
                 (offline and server, interleaved with torch.matmul); each scenario's winner is the best median
                 fresh speedup, and those are the reported numbers, never the sample it was selected on
    budgets: candidates per shape, GPU-seconds per run (shared fairly among the shapes left), wall seconds.
Lowering, compiling and evaluating go through the one candidate pipeline (search/pipeline.py); the loop legalizes
and dedupes per shape (a duplicate is a recorded verdict) and writes the records.

Determinism: every random draw depends on (seed, problem, step) and the population, and the population is what the
DB holds, so the same seed gives the same proposals (a policy whose factory takes a seed, the learned one, gets the
run's), and a resumed run (`l2ir tune --resume RUN`) makes the same proposals the killed one would have made. Every
candidate's records (kernel, measurements, edit, class gates) commit in one transaction: a kill loses at most the
candidates in flight.

Policy state: a run starts from the state stored for its policy by earlier runs on the DB (`policy:NAME`, saved at
the end of every shape and round). For --resume the state as of the start of each step (round, when interleaved)
is written once, with the step's first record; a resume re-makes the step's proposals from it and gives the
policy the feedback of the step's recorded candidates again, in order, so it continues as the killed run would
have.

Cheap evaluation: the gates that depend only on the kernel and the problem class (stale output, ragged shapes:
CLASS_GATES) are kept per kernel in the DB. A kernel that failed one is failed on every later shape without
touching the GPU; one that passed them is evaluated with `skip_gates` (search/evaluator.Evaluator and the stand-in
take it), and the reused verdicts are written into its measurement, marked as reused.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from l2ir.backends.compile import CompileOptions
from l2ir.edits import parse_edits
from l2ir.errors import L2IRError
from l2ir.nodes import Kernel, Problem
from l2ir.seed import seed as rule_seed
from l2ir.text import parse_kernel, parse_problem, print_problem, print_problem_class

from .db import DBError, RecordsDB, environment_id, spread_of
from .evaluator import Measurement
from .pipeline import Candidate, Pipeline, PipelineConfig, Prepared, _first_line

# The gates that depend only on the kernel and the problem class, not on M, N, K: a stale output on fresh inputs in
# the same buffers, and the shapes no tile divides (chosen from the tile, not from the problem's sizes).
CLASS_GATES = ("stale_output", "ragged_shapes")
FAIL_REWARD = -1.0        # what a failed or illegal candidate is worth in the edits table (log speedup scale)
DONE = "done"             # the edits-table verdict that closes a shape (with the winner's numbers in detail)


@dataclass(frozen=True)
class TuneConfig:
    shapes: tuple[tuple[int, int, int], ...]
    problem: str = "gemm m=1 n=1 k=1 a=f16:row b=f16:col c=f16:row acc=f32"   # the class; shapes set the sizes
    policy: str = "random"
    seed: int = 0
    budget_candidates: int = 24          # per shape: candidates built and measured (illegal/duplicates are free)
    budget_gpu_s: float = math.inf       # whole run; each shape gets an equal share of what is left
    budget_wall_s: float = math.inf      # this invocation
    batch: int = 4                       # proposals per step, compiled together
    init_size: int = 6                   # the initial population's size (seeds, neighbours, sweeps)
    arch: str = "sm90a"                  # the GPU's target: proposals may use any rule it runs
    neighbours: int = 3                  # nearest solved problems whose winners join the initial population
    sweeps: bool = True
    mode: str = "gpu"                    # "gpu", "standin" (cost model, not measured) or "compile_only"
    retime: bool = True
    # The end of a shape: this many of the best members are re-timed in this many interleaved rounds, and each
    # scenario's winner is the one with the best median fresh speedup (1: the incumbent alone, timed once).
    finalists: int = 3
    finalist_rounds: int = 3
    reuse_class_gates: bool = True
    # Step every shape in rounds and build each round's kernels together (see Search._search_interleaved); the
    # search keeps the wall budget free of this much per unfinished shape for re-timing the winners.
    interleave: bool = False
    retime_reserve_s: float = 4.0
    cache_dir: str = ".l2ir-cache"
    compile_jobs: int = 0
    device_sm: str = "sm_90"

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["shapes"] = [list(s) for s in self.shapes]
        return d

    @staticmethod
    def from_json(d: dict) -> "TuneConfig":
        d = dict(d)
        d["shapes"] = tuple(tuple(s) for s in d["shapes"])
        return TuneConfig(**d)


@dataclass
class Member:
    kernel: Kernel
    backend: str | None
    speedup: float | None = None
    spread: float = 0.0

    @property
    def key(self) -> str:
        return member_key(self.kernel, self.backend)


def member_key(kernel: Kernel, backend: str | None) -> str:
    return kernel.content_hash() + "|" + (backend or "")


@dataclass
class ShapeState:
    shape: tuple[int, int, int]
    problem: Problem
    ptext: str
    members: dict[str, Member] = field(default_factory=dict)
    seen: set[str] = field(default_factory=set)
    incumbent: str | None = None
    candidates: int = 0
    failures: int = 0
    illegal: int = 0
    duplicates: int = 0
    gpu_s: float = 0.0
    step: int = 0
    rows_at_step: int = 0              # edits already recorded at `step` (a resumed step skips that many)
    last_step: int = -1                # the step of the last recorded candidate
    # The population and history as they were when `step` began: a resumed step picks its parent and builds its
    # context from these, as the killed run did, not from what the step itself added.
    step_view: tuple[list, int] | None = None
    history: list = field(default_factory=list)
    curve: list[tuple[int, float]] = field(default_factory=list)   # (candidates, incumbent's speedup)
    proposed: dict = field(default_factory=dict)   # step -> its proposals, made again on resume (see _propose)
    done: dict | None = None

    @property
    def best(self) -> float | None:
        return self.members[self.incumbent].speedup if self.incumbent else None


def accepts(new: Member, incumbent: Member | None) -> bool:
    """Noise-aware acceptance: a challenger replaces the incumbent only when its speedup is higher by more than
    the larger of the two measured spreads (a smaller win is as likely to be noise as a real difference)."""
    if new.speedup is None:
        return False
    if incumbent is None or incumbent.speedup is None:
        return True
    return new.speedup > incumbent.speedup * (1.0 + max(new.spread, incumbent.spread))


def _bind_records(policy, db: RecordsDB, run_id: int):
    # A policy that records its own trajectories (the LLM policy's model calls) writes them into the run's DB.
    bind = getattr(policy, "bind_records", None)
    if callable(bind):
        bind(db, run_id)


def _policy(name, seed: int):
    """The policy by name, seeded by the run's seed when its factory takes one (the learned policy's initial
    weights); random edits and rules draw from the context's seed (the run's seed plus the step) alone."""
    from l2ir.policy.base import get_policy, policy_factory

    try:
        takes_seed = "seed" in inspect.signature(policy_factory(name)).parameters
    except (TypeError, ValueError):      # a factory without a signature: no seed to give
        takes_seed = False
    return get_policy(name, **({"seed": seed} if takes_seed else {}))


def _build_error(item: Prepared) -> str:
    """Why a kernel has no binary, as the edits table says it ("" when it has one)."""
    if item.ok:
        return ""
    return item.error if item.status == "compile_failed" else f"not lowered: {item.error}"


class Search:
    """One tuning run over the config's shapes. `evaluator` scores candidates (offline scenario), `retimer` times
    the winners again (offline and server); both None in compile-only mode. `progress(state, event)` is called
    after every candidate and at the end of each shape."""

    def __init__(self, config: TuneConfig, db: RecordsDB, evaluator=None, retimer=None, policy=None,
                 progress: Callable | None = None, clock: Callable[[], float] = time.monotonic, command: str = ""):
        if config.mode not in ("gpu", "standin", "compile_only"):
            raise ValueError(f"unknown mode '{config.mode}' (gpu, standin, compile_only)")
        if config.mode != "compile_only" and evaluator is None:
            raise ValueError(f"mode '{config.mode}' needs an evaluator")
        self.config = config
        self.db = db
        self.evaluator = evaluator
        self.retimer = retimer if retimer is not None else evaluator
        self.policy = policy if policy is not None else _policy(config.policy, config.seed)
        self.policy_name = getattr(self.policy, "name", str(config.policy))
        self.progress = progress or (lambda state, event: None)
        self.clock = clock
        self.command = command
        self.pclass = parse_problem(config.problem, "the run's problem class")
        self.cls_text = print_problem_class(self.pclass)
        # Every candidate is built and measured through the one candidate pipeline. The loop writes a candidate's
        # records itself, in one transaction with its edit (record=False), and measures every candidate afresh
        # (reuse=False: a selection sample is never one an earlier run took).
        self.pipeline = Pipeline(PipelineConfig(
            compile=CompileOptions(cache_dir=config.cache_dir, jobs=config.compile_jobs, device_sm=config.device_sm),
            compile_kernels=config.mode != "standin", reuse=False, record=False, class_gates=CLASS_GATES,
            reuse_class_gates=config.reuse_class_gates), evaluator, db)
        self.builds: dict[str, Prepared] = {}          # member key -> the kernel lowered and compiled
        self._compile_paid: set[str] = set()           # member keys whose compile seconds an edit already carries
        # Outcomes of a batch evaluated ahead on a pool of GPUs, by (problem, member key), taken in candidate order
        # when the candidates are recorded (see _evaluate_ahead).
        self._ahead: dict[tuple[str, str], object] = {}
        self.run_id: int | None = None
        self.states: list[ShapeState] = []
        self._status: str | None = None
        self._t0 = clock()
        # The policy's state as of the start of the current step (a round when interleaved), written with that
        # step's first record: (state, newest edit row whose feedback it holds, step). `_last_edit` is the newest
        # edit row written or restored; a resume feeds the rows after `_replay_after` to the policy again, in order.
        self._snapshot: tuple[bytes, int, int] | None = None
        self._last_edit = 0
        self._replay_after: int | None = None
        self._resume_step: int | None = None
        self._learned = False                           # the policy had feedback in this invocation
        if evaluator is not None and getattr(evaluator, "environment", None):
            self.env_id = environment_id(evaluator.environment)

    @property
    def env_id(self) -> str | None:
        """The environment the run's measurements and class gates are kept under (the evaluator's)."""
        return self.pipeline.env_id

    @env_id.setter
    def env_id(self, value: str | None):
        self.pipeline.env_id = value

    # -- run ----------------------------------------------------------------------------------------------------

    def start(self) -> int:
        cfg = self.config
        budget = {"candidates_per_shape": cfg.budget_candidates, "gpu_seconds": cfg.budget_gpu_s,
                  "wall_seconds": cfg.budget_wall_s}
        # A learning policy continues from what it learned in earlier runs on this DB (any shapes, any run).
        _load_policy(self.policy, self.db, f"policy:{self.policy_name}")
        self.run_id = self.db.start_run(self.command, cfg.to_json(), cfg.seed, self.policy_name, budget)
        # A resume starts from the state this run started from (the stored one may change meanwhile).
        with self.db.transaction():
            self._save_run_state(_dumps_state(self.policy.state_dict()), 0, 0)
        _bind_records(self.policy, self.db, self.run_id)
        return self.run_id

    @classmethod
    def resume(cls, db: RecordsDB, run_id: int, evaluator=None, retimer=None, policy=None, progress=None,
               clock=time.monotonic, command: str = "", budget_wall_s: float | None = None) -> "Search":
        """The Search of a killed (or stopped) run, continuing where its records end."""
        row = db.run(run_id)
        if row is None:
            raise ValueError(f"no run {run_id} in {db.path}")
        cfg = TuneConfig.from_json(row["config"])
        if budget_wall_s is not None:
            cfg = dataclasses.replace(cfg, budget_wall_s=budget_wall_s)
        s = cls(cfg, db, evaluator, retimer, policy, progress, clock, command)
        s.run_id = run_id
        _bind_records(s.policy, db, run_id)
        if _load_policy(s.policy, db, f"run:{run_id}"):
            at = db.load_policy_state(f"run:{run_id}:at")
            if at is not None:
                # The state is as of the start of a step: the feedback of the rows recorded since is replayed.
                at = json.loads(at)
                s._replay_after, s._resume_step = at["edit"], at["step"]
        db.set_run_status(run_id, "running")
        return s

    def prebuild(self):
        """Build every shape's step-0 kernels (seeds and sweeps: a few dozen, shared by all shapes) in one parallel
        compile, so the first shapes do not pay for everyone's and the compile pool is full once."""
        wanted = []
        for shape in self.config.shapes:
            st = ShapeState(tuple(shape), self.pclass.with_shape(*shape), "")
            for p in self._initial(st, neighbours=False)[:self.config.init_size + 4]:
                wanted.append((p.kernel, p.backend))
        self._build(wanted)

    def run(self) -> list[ShapeState]:
        if self.run_id is None:
            self.start()
        cfg = self.config
        status = "done"
        try:
            if len(cfg.shapes) > 1 and cfg.mode != "standin":
                self.prebuild()
            if cfg.interleave:
                self._run_interleaved()
                status = self._status
            else:
                for i, shape in enumerate(cfg.shapes):
                    st = self._restore(shape)
                    self.states.append(st)
                    self._resume_feedback([st])
                    if st.done is not None:
                        self.progress(st, "restored")
                        continue
                    if self._wall_left() <= 0:
                        status = "stopped: wall-time budget"
                        break
                    gpu_cap = self._gpu_share(len(cfg.shapes) - i)
                    wall_cap = self._wall_left() / (len(cfg.shapes) - i) + (self.clock() - self._t0)
                    why = self._search_shape(st, gpu_cap, wall_cap)
                    self._finish_shape(st, why)
                    if why in ("GPU-seconds budget", "wall-time budget"):
                        status = f"stopped: {why}"
        except BaseException as e:
            # Not finished: `l2ir tune --resume RUN` continues it (a kill -9 leaves "running", as this would).
            status = "interrupted" if isinstance(e, KeyboardInterrupt) else f"failed: {type(e).__name__}"
            raise
        finally:
            self.db.set_run_status(self.run_id, status)
        return self.states

    def _run_interleaved(self) -> list[ShapeState]:
        self.states = [self._restore(shape) for shape in self.config.shapes]
        for i, st in enumerate(self.states):
            # A resume continues each shape at the step the killed run would have taken next: step 0 ran shape
            # after shape, so a later shape's records close an earlier one's step 0 (made again, it would see the
            # later shapes' winners); killed in the middle of a round, the shapes that round had not reached yet
            # take their step in it now, from the state the round began with.
            if st.done is not None:
                continue
            if st.rows_at_step and st.step < (self._resume_step or 0):
                st.step, st.rows_at_step, st.step_view = self._resume_step, 0, None
            elif st.step == 0 and st.rows_at_step and any(x.rows_at_step for x in self.states[i + 1:]):
                st.step, st.rows_at_step, st.step_view = 1, 0, None
        self._resume_feedback(self.states)
        for st in self.states:
            if st.done is not None:
                self.progress(st, "restored")
        ended = self._search_interleaved(self.states)
        for i, st in enumerate(self.states):
            if st.done is None:
                self._finish_shape(st, ended.get(i, "candidate budget"))
        budgets = {w for w in ended.values() if w in ("GPU-seconds budget", "wall-time budget")}
        self._status = f"stopped: {sorted(budgets)[0]}" if budgets else "done"
        return self.states

    # -- budgets ------------------------------------------------------------------------------------------------

    def _wall_left(self) -> float:
        return self.config.budget_wall_s - (self.clock() - self._t0)

    def _gpu_used(self) -> float:
        return self.db.run_totals(self.run_id)["gpu_seconds"]

    def _gpu_share(self, shapes_left: int) -> float:
        if math.isinf(self.config.budget_gpu_s):
            return math.inf
        return max(0.0, self.config.budget_gpu_s - self._gpu_used()) / shapes_left

    # -- one shape ----------------------------------------------------------------------------------------------

    def _restore(self, shape) -> ShapeState:
        """The shape's state as the DB has it: members, incumbent (replaying acceptance in order), counts, step."""
        problem = self.pclass.with_shape(*shape)
        st = ShapeState(tuple(shape), problem, print_problem(problem))
        for e in self.db.edits(self.run_id, st.ptext):
            self._last_edit = max(self._last_edit, e["id"])
            if e["verdict"] == DONE:
                st.done = json.loads(e["detail"])
                continue
            st.last_step = e["step"]
            if e["step"] != st.step or st.step_view is None:
                st.step, st.rows_at_step = e["step"], 0
                st.step_view = (list(st.members.values()), len(st.history))
            st.rows_at_step += 1
            st.gpu_s += e["gpu_seconds"] or 0.0
            self._count(st, e["verdict"])
            if e["child"] is None:
                continue
            kernel = self._kernel(e["child"])
            backend = e["backend"]
            key = member_key(kernel, backend)
            st.seen.add(key)
            reward = e["reward"] if e["verdict"] == "measured" else None
            st.history.append(_step(kernel, e["edit"], reward))
            if e["verdict"] in ("measured", "compiled"):
                m = Member(kernel, backend)
                if e["verdict"] == "measured":
                    rows = self.db.measurements(problem=st.ptext, kernel=e["child"], run=self.run_id,
                                                purpose="search")
                    if rows:
                        m.speedup, m.spread = rows[-1].speedup, rows[-1].spread or 0.0
                        self.env_id = self.env_id or rows[-1].environment
                self._admit(st, m)
        return st

    def _kernel(self, kernel_hash: str) -> Kernel:
        row = self.db.kernel(kernel_hash)
        return parse_kernel(row["ir"], f"kernel {kernel_hash[:12]}")

    @staticmethod
    def _count(st: ShapeState, verdict: str):
        if verdict in ("measured", "failed", "compiled"):
            st.candidates += 1
        st.failures += verdict == "failed"
        st.illegal += verdict == "illegal"
        st.duplicates += verdict == "duplicate"

    def _admit(self, st: ShapeState, m: Member):
        st.members[m.key] = m
        if self.config.mode == "compile_only":
            return
        if accepts(m, st.members.get(st.incumbent) if st.incumbent else None):
            st.incumbent = m.key
        if st.incumbent:
            st.curve.append((st.candidates, st.best))

    def _initial(self, st: ShapeState, neighbours: bool = True) -> list:
        """Step 0's proposals: the rule-based seeds, the nearest solved problems' winners, the sweeps."""
        from l2ir.policy.base import Proposal

        from .sweeps import load_sweep, sweep_names

        cfg = self.config
        out = []
        archs = [cfg.arch] + (["sm80"] if cfg.arch != "sm80" else [])
        for arch in archs:
            try:
                out.append(Proposal(kernel=rule_seed(st.problem, arch), note=f"seed {arch}"))
            except (L2IRError, ValueError):
                pass
        if neighbours and self.env_id and cfg.neighbours:
            for h in self.db.nearest_winners(st.ptext, self.env_id, cfg.neighbours):
                row = self.db.kernel(h)
                if row and row.get("ir"):
                    out.append(Proposal(kernel=parse_kernel(row["ir"], h[:12]), backend=row.get("backend"),
                                        note=f"winner of a nearby shape ({h[:12]})"))
        if cfg.sweeps:
            hopper = cfg.arch in ("sm90", "sm90a")
            # The library-style sweeps first (the default backends), then the raw CUDA/PTX rules by name.
            for group in sorted(sweep_names(), key=lambda g: (g.startswith("cuda_ptx"), g != cfg.arch, g)):
                if not hopper and group not in ("sm80", "cuda_ptx_sm80"):
                    continue
                backend = group if group.startswith("cuda_ptx") else None
                out.extend(Proposal(kernel=k, backend=backend, note=f"sweep {group}/{name}")
                           for name, k in load_sweep(group).items())
        return out

    def _context(self, st: ShapeState, parent: Member, history: list):
        from l2ir.policy.base import Context, Measured

        return Context(problem=st.problem, parent=parent.kernel, measured=Measured(speedup=parent.speedup),
                       history=tuple(history[-32:]), arch=self.config.arch, seed=self.config.seed + st.step,
                       count=self.config.batch, backend=parent.backend)

    def _parent(self, st: ShapeState, pool: list[Member]) -> Member:
        """Tournament of three over the population (ties and unmeasured members by insertion order)."""
        rng = np.random.default_rng([self.config.seed & 0xFFFFFFFF, *st.shape, st.step])
        picks = [pool[int(i)] for i in rng.integers(0, len(pool), size=min(3, len(pool)))]
        return max(picks, key=lambda m: m.speedup if m.speedup is not None else -math.inf)

    def _search_shape(self, st: ShapeState, gpu_cap: float, wall_cap: float) -> str:
        """Search one shape until a budget ends it; returns which one."""
        stalled = [0]
        while True:
            why = self._step_shape(st, gpu_cap, wall_cap, stalled)
            if why is not None:
                return why

    def _step_shape(self, st: ShapeState, gpu_cap: float, wall_end: float, stalled: list[int]) -> str | None:
        """One step of one shape: plan, build, record. Returns why the shape ends, if it does."""
        why = self._budget_reason(st, gpu_cap, wall_end)
        if why is not None:
            return why
        self._mark_step([st])
        planned = self._plan(st)
        if isinstance(planned, str):
            return planned
        self._build([(c, p.backend) for p, c, v, _ in planned[0] if v == "new"])
        self._evaluate_ahead([(st, planned[0])])
        try:
            return self._record(st, *planned, gpu_cap, stalled)
        finally:
            self._ahead.clear()

    def _search_interleaved(self, states: list[ShapeState]) -> dict[int, str]:
        """Every shape's step 0 in order (so each can start from the winners of the shapes before it), then rounds:
        one step of every shape still searching, with all of the round's new kernels built in one parallel
        compile. A compile is the slow part of a step (about a minute for a CUTLASS kernel), and one shape's step
        rarely fills the compile pool; a round of many shapes does. Returns why each shape ended, by index."""
        cfg = self.config
        n = len(cfg.shapes)
        gpu_cap = math.inf if math.isinf(cfg.budget_gpu_s) else cfg.budget_gpu_s / n
        end = cfg.budget_wall_s - cfg.retime_reserve_s * sum(1 for st in states if st.done is None)
        ended: dict[int, str] = {}
        stalled = {i: [0] for i in range(len(states))}
        for i, st in enumerate(states):
            while st.done is None and st.step == 0 and i not in ended:
                why = self._step_shape(st, gpu_cap, end, stalled[i])
                if why is not None:
                    ended[i] = why
        while True:
            live = [i for i, st in enumerate(states) if st.done is None and i not in ended]
            if not live:
                return ended
            self._mark_step([states[i] for i in live])
            plans = []
            for i in live:
                why = self._budget_reason(states[i], gpu_cap, end)
                planned = self._plan(states[i]) if why is None else why
                if isinstance(planned, str):
                    ended[i] = planned
                else:
                    plans.append((i, planned))
            self._build([(c, p.backend) for _, planned in plans for p, c, v, _ in planned[0] if v == "new"])
            self._evaluate_ahead([(states[i], planned[0]) for i, planned in plans])
            try:
                for i, planned in plans:
                    why = self._record(states[i], *planned, gpu_cap, stalled[i])
                    if why is not None:
                        ended[i] = why
            finally:
                self._ahead.clear()
            self._save_policy()

    def _budget_reason(self, st: ShapeState, gpu_cap: float, wall_end: float) -> str | None:
        if st.candidates >= self.config.budget_candidates:
            return "candidate budget"
        if st.gpu_s + self._finalist_reserve(st) >= gpu_cap:
            return "GPU-seconds budget"
        if (self.clock() - self._t0) >= wall_end:
            return "wall-time budget"
        return None

    def _finalist_reserve(self, st: ShapeState) -> float:
        """The GPU-seconds the shape's finalist rounds will take beyond the one re-time of a single winner, at this
        shape's cost per candidate so far: kept free of the search so the shapes after it keep their share."""
        cfg = self.config
        if cfg.mode == "compile_only" or not cfg.retime or cfg.finalists <= 1 or not st.candidates:
            return 0.0
        return (cfg.finalists * max(1, cfg.finalist_rounds) - 1) * st.gpu_s / st.candidates

    def _propose(self, st: ShapeState):
        """The step's (proposals, parent, context), made from the population and history as they were when the step
        began (so a resumed step makes the killed run's proposals again), or why the shape cannot go on."""
        if st.step == 0:
            return self._initial(st), None, None
        pool, hist = list(st.members.values()), st.history
        if st.rows_at_step and st.step_view is not None:
            pool, hist = st.step_view[0], st.history[:st.step_view[1]]
        if not pool:
            return "no legal kernel"
        parent = self._parent(st, pool)
        ctx = self._context(st, parent, hist)
        return list(self.policy.propose(ctx))[:self.config.batch], parent, ctx

    def _plan(self, st: ShapeState):
        """The shape's next step up to its build: proposals (the recorded ones of a resumed step skipped),
        legalized and deduped, cut to what the candidate budget leaves room for. Returns (items, parent, context),
        or why the shape cannot go on."""
        made = st.proposed.pop(st.step, None) or self._propose(st)
        if isinstance(made, str):
            return made
        proposals, parent, ctx = made
        limit = self.config.init_size - st.candidates if st.step == 0 else None
        skip, st.rows_at_step = st.rows_at_step, 0
        return self._legalize(st, proposals[skip:], parent, limit), parent, ctx

    def _record(self, st: ShapeState, items, parent, ctx, gpu_cap: float, stalled: list[int]) -> str | None:
        """Evaluate and record a planned step in proposal order; returns why the shape ends, if it does."""
        before = st.candidates
        for p, child, verdict, detail in items:
            if st.gpu_s >= gpu_cap:
                break
            self._candidate(st, p, parent, ctx, child, verdict, detail)
        stalled[0] = stalled[0] + 1 if st.candidates == before else 0
        st.step += 1
        if st.candidates >= self.config.budget_candidates:
            return "candidate budget"
        if stalled[0] >= 5:
            return "the policy proposed nothing new"
        return None

    # -- the learned state: once per step, enough to resume exactly ------------------------------------------------

    def _resume_feedback(self, states: list[ShapeState]):
        """After a resume, before anything new: the proposals of each shape's current step are made again from the
        state loaded (the killed run made them from it, all of a round's before any of its records), then the
        policy is given the feedback of the candidates recorded after that state, in the order they were
        recorded."""
        if self._replay_after is None:
            return
        replay = []
        for st in states:
            if st.done is not None or st.step == 0:
                continue
            rows = [e for e in self.db.edits(self.run_id, st.ptext) if e["step"] == st.step and e["verdict"] != DONE]
            if not any(e["id"] > self._replay_after for e in rows) and st.step != self._resume_step:
                continue
            made = self._propose(st)
            if isinstance(made, str):
                continue
            st.proposed[st.step] = made
            proposals, _, ctx = made
            replay += [(e, ctx, p) for p, e in zip(proposals, rows) if e["id"] > self._replay_after]
        for e, ctx, p in sorted(replay, key=lambda r: r[0]["id"]):
            fb = _feedback(ctx, p, e["verdict"], e["reward"] if e["verdict"] == "measured" else None, e["detail"],
                           self._kernel(e["child"]) if e["child"] else None)
            if fb is not None:
                self._update(fb)

    def _mark_step(self, states: list[ShapeState]):
        """Keep the policy's state as it is at the start of this step (this round, when interleaved), to be written
        with the step's first record: a resume re-makes the step's proposals from it and replays the feedback of
        the step's recorded candidates. A step already begun (resumed) has its state in the DB; step 0 learns
        nothing."""
        if any(st.rows_at_step for st in states) or all(st.step == 0 for st in states):
            return
        self._snapshot = (_dumps_state(self.policy.state_dict()), self._last_edit, max(st.step for st in states))

    def _save_run_state(self, state: bytes, edit: int, step: int):
        """This run's policy state for --resume: it holds the feedback of every edit row up to `edit`, and was
        taken at the start of step `step` (0: not in a step)."""
        self.db.save_policy_state(f"run:{self.run_id}", state)
        self.db.save_policy_state(f"run:{self.run_id}:at", json.dumps({"edit": edit, "step": step}).encode())

    def _update(self, feedback):
        self.policy.update([feedback])
        self._learned = True

    def _save_policy(self, state: bytes | None = None):
        """The next run's starting point (any shapes): the policy as it is now, once it has learned something in
        this run."""
        if self._learned:
            self.db.save_policy_state(f"policy:{self.policy_name}",
                                      state if state is not None else _dumps_state(self.policy.state_dict()))

    def _legalize(self, st: ShapeState, proposals, parent: Member | None, limit: int | None) -> list:
        """(proposal, child, "new" | "illegal" | "duplicate", detail) per proposal, cut after the last new one the
        budget (and step 0's size) leaves room for: only those are built, and a CUTLASS build is a minute."""
        from l2ir.policy.base import legalize

        cfg = self.config
        items = []
        fresh_keys: set[str] = set()
        for p in proposals:
            try:
                base = parent.kernel if parent is not None else None
                child = p.kernel if p.kernel is not None else p.apply(base, st.problem, lowerable=False)
                child = legalize(child, st.problem, p.backend)
            except (L2IRError, NotImplementedError) as e:
                items.append((p, None, "illegal", _first_line(e)))
                continue
            except Exception as e:  # noqa: BLE001 - a policy or backend bug is the candidate's verdict
                items.append((p, None, "illegal", f"legalizing failed: {_first_line(e)}"))
                continue
            key = member_key(child, p.backend)
            if key in st.seen or key in fresh_keys:
                items.append((p, child, "duplicate", "already in this shape's population"))
                continue
            fresh_keys.add(key)
            items.append((p, child, "new", ""))
        room = cfg.budget_candidates - st.candidates
        room = room if limit is None else min(room, limit)
        keep, new = [], 0
        for item in items:
            if item[2] == "new":
                if new >= room:
                    break
                new += 1
            keep.append(item)
        return keep

    def _build(self, kernels: list[tuple[Kernel, str | None]]):
        """Lower and compile the kernels this run has not built yet, in one parallel batch through the pipeline
        (each kernel once per problem class; the compile cache is on disk)."""
        todo: dict[str, Candidate] = {}
        for k, backend in kernels:
            key = member_key(k, backend)
            if key not in self.builds and key not in todo:
                todo[key] = Candidate(key[:12], k, "search", backend)
        if todo:
            for key, item in zip(todo, self.pipeline.prepare(list(todo.values()), self.pclass)):
                self.builds[key] = item

    def _evaluate_ahead(self, steps: list[tuple[ShapeState, list]]):
        """With a pool of GPUs (an evaluator with `evaluate_many` and more than one worker), evaluate the planned
        candidates of these steps (a step, or a round of them) at the same time, before they are recorded one by
        one in candidate order: the records, their order and the one transaction per candidate are what one GPU
        writes. A kernel that more than one shape of a round evaluates is evaluated ahead only for the first; the
        others are evaluated when they are recorded, after the first kept its class gates (as one GPU does). A
        candidate the GPU-seconds budget stops before it is recorded is evaluated and not kept (one batch at
        most); a kill loses at most the batch in flight."""
        ev = self.evaluator
        if self.config.mode == "compile_only" or not callable(getattr(ev, "evaluate_many", None)) \
                or getattr(ev, "size", 1) < 2:
            return
        if self.env_id is None and not getattr(ev, "environment", None):
            # The GPU is not known until a worker has started, and the class gates kept for it with it: one step
            # goes one by one (its first evaluation starts every worker) so each candidate sees what one GPU sees.
            return
        keys, jobs, kernels = [], [], set()
        for st, items in steps:
            for p, child, verdict, _ in items:
                if verdict != "new":
                    continue
                key = member_key(child, p.backend)
                h = child.content_hash()
                if _build_error(self.builds[key]) or h in kernels or (st.ptext, key) in self._ahead:
                    continue
                kernels.add(h)
                keys.append((st.ptext, key))
                jobs.append((self._built(key, child), st.problem))
        if len(jobs) > 1:
            self._ahead.update(zip(keys, self.pipeline.evaluate_many(jobs)))

    def _built(self, key: str, kernel: Kernel) -> Prepared:
        """The build of `key`, carrying this very kernel (the build may have come from an equal one)."""
        item = self.builds[key]
        return dataclasses.replace(item, candidate=dataclasses.replace(item.candidate, kernel=kernel))

    def _compile_seconds(self, key: str) -> float:
        """The kernel's fresh compile seconds for the first edit that uses it, 0 after: paid once per kernel,
        never per shape."""
        if key in self._compile_paid:
            return 0.0
        self._compile_paid.add(key)
        art = self.builds[key].artifact
        return 0.0 if art is None or getattr(art, "cached", False) else float(art.compile_seconds)

    def _candidate(self, st: ShapeState, p, parent: Member | None, ctx, child: Kernel | None, verdict: str,
                   detail: str):
        """Evaluate one candidate and commit everything it produced in one transaction."""
        cfg = self.config
        edit_text = p.text().strip() if p.kernel is None else f"# {p.note}\n{p.text()}".strip()
        measurements: list[Measurement] = []
        cost = 0.0
        member = None
        built = None
        error = ""
        class_verdicts = None
        compile_seconds = 0.0
        key = member_key(child, p.backend) if child is not None else None
        if verdict == "new":
            built = self.builds[key]
            error = _build_error(built)
            compile_seconds = self._compile_seconds(key)
            if error:
                verdict, detail = "failed", error
            elif cfg.mode == "compile_only":
                verdict, member = "compiled", Member(child, p.backend)
            else:
                out = self._ahead.pop((st.ptext, key), None) or self.pipeline.evaluate(self._built(key, child),
                                                                                        st.problem)
                measurements, cost, class_verdicts = out.measurements, out.cost_s, out.class_verdicts
                ms = measurements[0] if measurements else None
                if ms is not None and ms.passed and ms.speedup:
                    verdict = "measured"
                    member = Member(child, p.backend, float(ms.speedup), spread_of(ms.to_json()) or 0.0)
                else:
                    verdict = "failed"
                    detail = _failure(measurements) if (measurements or not out.error) else out.error[:300]
        reward = math.log(member.speedup) if member is not None and member.speedup else None
        feedback = _feedback(ctx, p, verdict, reward, detail, child)
        if feedback is not None:
            self._update(feedback)
        st.gpu_s += cost
        child_hash = child.content_hash() if child is not None else None
        with self.db.transaction():
            if self._snapshot is not None:
                self._save_run_state(*self._snapshot)
            if child is not None:
                art = built.artifact if built is not None else None
                res = getattr(art, "resources", None) or {}
                self.db.add_kernel(child_hash, ir=child.text(), backend=p.backend, target=child.target.arch,
                                   compile_ok=None if art is None else bool(art.ok),
                                   compile_error=(error or None) if built is not None else None,
                                   resources={f: dataclasses.asdict(r) for f, r in res.items()
                                              if dataclasses.is_dataclass(r)} or None)
            if measurements:
                self.db.add_many(measurements, run=self.run_id, purpose="search", backend=p.backend,
                                 measured=cfg.mode == "gpu")
            if class_verdicts is not None:
                self.db.add_class_gates(child_hash, self.cls_text, self.env_id, class_verdicts)
            edit_id = self.db.add_edit(self.run_id, st.ptext, st.step,
                                       parent.kernel.content_hash() if parent else None, child_hash,
                                       self.policy_name if parent else "init", edit_text, verdict, detail,
                                       reward if reward is not None else
                                       FAIL_REWARD if verdict in ("illegal", "failed") else None,
                                       backend=p.backend, gpu_seconds=cost, compile_seconds=compile_seconds)
        self._snapshot = None
        self._last_edit = edit_id
        self._count(st, verdict)
        st.last_step = st.step
        if child is not None:
            st.seen.add(key)
            st.history.append(_step(child, edit_text, reward))
        if member is not None:
            self._admit(st, member)
        self.progress(st, verdict)

    # -- the end of a shape: re-time the finalists on fresh samples, choose per scenario -------------------------

    def _finish_shape(self, st: ShapeState, stopped_by: str):
        """The shape's winner: the top `finalists` members by selection speedup (the incumbent first) are timed again
        in `finalist_rounds` rounds, round-robin, each a fresh evaluation gated in full; the winner of each scenario
        is the finalist with the best median of its fresh speedups there, and a finalist that fails any round is
        out. One sample per candidate is not enough: on ~30 us shapes one kernel's median moves 4-7% between runs
        (clocks, L2 state, placement), more than the gap between the top candidates. Each round's records
        ("finalist") commit together, so a resume never redoes a finished round; the winners' median rounds are
        copied as "retime" records, the one row per scenario that `l2ir export --scenario` and `l2ir best` rank."""
        cfg = self.config
        summary = {"candidates": st.candidates, "failures": st.failures, "illegal": st.illegal,
                   "gpu_seconds": st.gpu_s, "stopped_by": stopped_by, "winner": None}
        ranked = sorted((m for m in st.members.values() if m.speedup is not None),
                        key=lambda m: (m.key != st.incumbent, -m.speedup))
        copies: list[tuple[Member, int, str]] = []
        if cfg.mode != "compile_only" and cfg.retime:
            k = max(1, cfg.finalists)
            rounds = max(1, cfg.finalist_rounds) if k > 1 else 1
            pool = ranked[:max(3, k)]
            # Waves of k: when every finalist of one fails its re-check the next k best are tried (k=1: one by one,
            # up to three, as the incumbent alone used to be).
            for w in range(0, len(pool), k):
                wave = pool[w:w + k]
                self._finalist_rounds(st, wave, rounds)
                chosen = self._choose(st, wave)
                if chosen:
                    off = (chosen.get("offline") or next(iter(chosen.values())))[0]
                    summary["winner"] = self._winner_summary(st, off, chosen)
                    srv = chosen["server"][0] if "server" in chosen else None
                    # The server scenario's winner, where it is another kernel (`l2ir export --scenario server`).
                    summary["server_winner"] = None if srv is None else \
                        summary["winner"] if srv is off else self._winner_summary(st, srv, chosen)
                    summary["finalists"] = [m.kernel.content_hash() for m in wave]
                    summary["rounds"] = rounds
                    copies = [(m, row_id, sc) for sc, (m, row_id, _) in chosen.items()]
                    break
                # Passed during the search, failed when gated again: no result; the next wave is tried.
        elif ranked:
            m = ranked[0]
            summary["winner"] = {"kernel": m.kernel.content_hash(), "backend": m.backend,
                                 "selected_speedup": None if m.speedup is None else float(m.speedup)}
        cost = self._finalist_cost(st)
        summary["retime_gpu_seconds"] = cost
        st.gpu_s += cost
        state = _dumps_state(self.policy.state_dict())
        with self.db.transaction():
            for m, row_id, scenario in copies:
                rec = json.loads(self.db.conn.execute("SELECT record FROM measurements WHERE id=?",
                                                      (row_id,)).fetchone()[0])
                rec.pop("round", None)
                # The finalist rounds' GPU time is carried here once (the budgets count "retime" records; with
                # no winner, the shape's last edit carries it).
                rec["gpu_seconds"] = cost / len(copies)
                rec["chosen_for"] = scenario
                rec["finalist_record"] = row_id
                self.db.add_many([rec], run=self.run_id, purpose="retime", backend=m.backend,
                                 measured=cfg.mode == "gpu")
            edit_id = self.db.add_edit(self.run_id, st.ptext, st.last_step + 1, None, None, "loop", "end of shape",
                                       DONE, json.dumps(summary), gpu_seconds=0.0 if copies else cost)
            # Once per shape: the state for --resume (every feedback so far) and the next run's starting point.
            self._save_run_state(state, edit_id, 0)
            self._save_policy(state)
        self._snapshot = None
        self._last_edit = edit_id
        st.done = summary
        self.progress(st, DONE)

    def _finalist_rows(self, st: ShapeState) -> list[tuple]:
        """The shape's finalist records of this run: (id, kernel, scenario, passed, speedup, round, gpu_seconds)."""
        return self.db.conn.execute(
            "SELECT id, kernel, scenario, passed, speedup, json_extract(record, '$.round'), "
            "COALESCE(json_extract(record, '$.gpu_seconds'), 0) FROM measurements "
            "WHERE run=? AND problem=? AND purpose='finalist' ORDER BY id", (self.run_id, st.ptext)).fetchall()

    def _finalist_cost(self, st: ShapeState) -> float:
        return float(sum(r[6] for r in self._finalist_rows(st)))

    def _finalist_rounds(self, st: ShapeState, wave: list[Member], rounds: int) -> float:
        """Time the wave's finalists in rounds, the rounds the records already hold skipped (a resumed shape), and
        return the GPU-seconds of the rounds run now. A round's evaluations are independent jobs (a pool of GPUs or
        a cluster runs them at once); its records commit in one transaction."""
        hashes = {m.kernel.content_hash() for m in wave}
        rows = [r for r in self._finalist_rows(st) if r[1] in hashes]
        done = 1 + max((r[5] for r in rows), default=-1)
        out_of = {r[1] for r in rows if not r[3]} | _missed_a_round(rows, hashes, done)
        for m in wave:
            if m.kernel.content_hash() in out_of:
                continue
            built = self.builds.get(m.key)
            if built is None or built.artifact is None:
                self._build([(m.kernel, m.backend)])
        cost = 0.0
        for r in range(done, rounds):
            live = [m for m in wave if m.kernel.content_hash() not in out_of and not _build_error(self.builds[m.key])]
            if not live:
                break
            # Gated again in full (no class gate taken from the search) and timed on fresh samples.
            outs = self.pipeline.evaluate_many([(self._built(m.key, m.kernel), st.problem) for m in live],
                                               evaluator=self.retimer, class_gates=False)
            with self.db.transaction():
                for m, out in zip(live, outs):
                    ms = out.measurements if out is not None else []
                    c = out.cost_s if out is not None else 0.0
                    cost += c
                    if not (ms and all(x.passed for x in ms)):
                        out_of.add(m.kernel.content_hash())
                    recs = []
                    for x in ms:
                        rec = x.to_json()
                        rec["round"] = r
                        rec["gpu_seconds"] = c / len(ms)
                        recs.append(rec)
                    if recs:
                        self.db.add_many(recs, run=self.run_id, purpose="finalist", backend=m.backend,
                                         measured=self.config.mode == "gpu")
        return cost

    def _choose(self, st: ShapeState, wave: list[Member]) -> dict:
        """Per scenario, the finalist of the wave with the best median fresh speedup (the lower median: a real
        round's record), among those that passed every round: {scenario: (member, record id, speedups)}."""
        hashes = {m.kernel.content_hash() for m in wave}
        rows = [r for r in self._finalist_rows(st) if r[1] in hashes]
        # An evaluation that ended in an error left no record: that finalist is out as if it had failed a gate.
        missed = _missed_a_round(rows, hashes, 1 + max((r[5] for r in rows), default=-1))
        best: dict = {}
        for m in wave:
            h = m.kernel.content_hash()
            mine = [r for r in rows if r[1] == h]
            if not mine or h in missed or not all(r[3] and r[4] for r in mine):
                continue
            for scenario in sorted({r[2] for r in mine}):
                got = sorted((r for r in mine if r[2] == scenario), key=lambda r: (r[4], r[0]))
                med = got[(len(got) - 1) // 2]
                fresh = [float(r[4]) for r in sorted(got, key=lambda r: r[0])]
                if scenario not in best or med[4] > best[scenario][3]:
                    best[scenario] = (m, med[0], fresh, med[4])
        return {sc: v[:3] for sc, v in best.items()}

    def _winner_summary(self, st: ShapeState, m: Member, chosen: dict) -> dict:
        """A winner's numbers: its median round in each scenario it was timed in (fresh samples), every round's
        offline speedup, and the scenarios it won."""
        h = m.kernel.content_hash()
        rows = [r for r in self._finalist_rows(st) if r[1] == h]
        med = {}
        for scenario in ("offline", "server"):
            got = sorted((r for r in rows if r[2] == scenario), key=lambda r: (r[4], r[0]))
            if got:
                med[scenario] = self.db.conn.execute(
                    "SELECT speedup, kernel_median_us, baseline_median_us FROM measurements WHERE id=?",
                    (got[(len(got) - 1) // 2][0],)).fetchone()

        def num(scenario, i):
            r = med.get(scenario)
            return None if r is None or r[i] is None else float(r[i])

        return {"kernel": h, "backend": m.backend, "selected_speedup": float(m.speedup),
                "offline_speedup": num("offline", 0), "server_speedup": num("server", 0),
                "offline_us": num("offline", 1), "torch_us": num("offline", 2),
                "server_us": num("server", 1), "server_torch_us": num("server", 2),
                "offline_rounds": [float(r[4]) for r in rows if r[2] == "offline"],
                "chosen_for": sorted(sc for sc, v in chosen.items() if v[0] is m)}


def _missed_a_round(rows: list[tuple], hashes: set[str], rounds: int) -> set[str]:
    """The finalists (of `hashes`) without a record in one of the first `rounds` rounds."""
    return {h for h in hashes if {r[5] for r in rows if r[1] == h} != set(range(rounds))}


def _feedback(ctx, p, verdict: str, reward: float | None, detail: str, child: Kernel | None):
    """What the policy learns from one recorded candidate: nothing at step 0 (no context), from a duplicate or from
    a kernel only compiled."""
    if ctx is None or verdict in ("duplicate", "compiled"):
        return None
    from l2ir.policy.base import Feedback

    return Feedback(ctx, p, {"measured": "measured", "illegal": "illegal"}.get(verdict, "failed"), reward, detail,
                    child)


def _failure(ms: list[Measurement]) -> str:
    for m in ms:
        if m.errors:
            return m.errors[0][:300]
        for v in m.verdicts:
            if not v.passed:
                return f"gate {v.name}: {v.detail}"[:300]
    return "not timed" if ms else "no measurement"


def _step(kernel: Kernel, edit_text: str, reward: float | None):
    from l2ir.policy.base import Step

    edits = ()
    if edit_text and not edit_text.lstrip().startswith(("#", "kernel")):
        try:
            edits = tuple(parse_edits(edit_text))
        except L2IRError:
            edits = ()
    return Step(kernel=kernel, edits=edits, reward=reward)


def _dumps_state(state) -> bytes:
    if isinstance(state, (bytes, bytearray)):
        return b"B" + bytes(state)
    return b"J" + json.dumps(state, sort_keys=True).encode()


def _loads_state(blob: bytes):
    return bytes(blob[1:]) if blob[:1] == b"B" else json.loads(blob[1:].decode())


def _load_policy(policy, db: RecordsDB, name: str) -> bool:
    """Load the DB's stored policy state `name` into the policy; False when there is none. A state this version
    cannot place (written by another L2IR, garbled) is a DBError that names the DB and the state, not a traceback."""
    blob = db.load_policy_state(name)
    if blob is None:
        return False
    try:
        policy.load_state_dict(_loads_state(blob))
    except Exception as e:      # noqa: BLE001 - whatever a foreign or garbled state raises, it is not loadable
        # (a mismatched field, a weight of another shape in torch's copy, JSON that is not an object)
        raise DBError(f"{db.path}: the stored policy state '{name}' cannot be loaded: {e} (another --db starts the "
                      "policy afresh)") from None
    return True
