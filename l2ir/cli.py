"""The `l2ir` command line.

    l2ir fmt FILE                      print the kernel in canonical text
    l2ir verify FILE                   check every rule; list each violation with its line
    l2ir edit FILE 'EDIT'...           apply edits, print the verified result
    l2ir interp FILE --shape MxNxK     run the reference interpreter against float64 A @ B
    l2ir seed --shape MxNxK --target sm90a
    l2ir lower FILE [--dump]           lower to CUDA source without compiling; --dump prints every stage
    l2ir compile FILE                  lower + compile (nvcc/NVRTC): stages on disk, registers, spills, SASS
    l2ir bench ...                     (GPU) seed + sweep over grid shapes, gated, timed against torch.matmul
    l2ir export --db DB --out DIR      the dispatch package (binaries, table, manifest) that l2ir.matmul loads

FILE is a .l2 file or '-' for standard input. Bad input exits with status 1 (2 for usage errors) and a located
message, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from .edits import apply_edit, parse_edits
from .errors import L2IRError, ParseError, VerifyError
from .nodes import ARCHS, Kernel, Problem
from .passes import PASSES
from .text import parse_kernel_file, parse_problem, print_kernel, print_problem


class CliError(Exception):
    """A usage or input problem reported as one line."""


def _read(path: str) -> tuple[str, str]:
    if path == "-":
        return sys.stdin.read(), "<stdin>"
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read(), path
    except OSError as e:
        raise CliError(f"{path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise CliError(f"{path}: not UTF-8 text (byte {e.start}: {e.object[e.start:e.start + 1]!r})") from None


def _load(path: str) -> tuple[Problem | None, Kernel, dict[str, int], str]:
    text, name = _read(path)
    problem, kernel, lines = parse_kernel_file(text, name)
    return problem, kernel, lines, name


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1 (counts of calls, trials, shapes)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got '{text}'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def shape_arg(text: str) -> tuple[int, int, int]:
    """argparse type: MxNxK with every size at least 1."""
    parts = text.lower().split("x")
    try:
        m, n, k = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MxNxK like 4096x4096x4096, got '{text}'") from None
    if min(m, n, k) < 1:
        raise argparse.ArgumentTypeError(f"sizes must be positive, got '{text}'")
    return m, n, k


def _problem(args, file_problem: Problem | None) -> Problem:
    if args.problem:
        base = parse_problem(args.problem, "--problem")
    else:
        base = file_problem or Problem(1, 1, 1)
    if args.shape:
        base = base.with_shape(*args.shape)
    elif not args.problem and file_problem is None:
        raise CliError("no problem: give --shape MxNxK (or --problem 'gemm ...', or a gemm line in the file)")
    return base


def _located(err: VerifyError, lines: dict[str, int], name: str) -> str:
    line = lines.get(err.node)
    where = f"{name}:{line}" if line else name
    return f"{where}: error [{type(err).__name__}] {err}"


def cmd_fmt(args) -> int:
    problem, kernel, _, _ = _load(args.file)
    if problem is not None:
        sys.stdout.write(print_problem(problem) + "\n")
    sys.stdout.write(print_kernel(kernel))
    return 0


def cmd_verify(args) -> int:
    from .verify import problem_violations, violations

    problem, kernel, lines, name = _load(args.file)
    errs = problem_violations(kernel, problem) if problem is not None else violations(kernel)
    for e in errs:
        print(_located(e, lines, name), file=sys.stderr)
    if errs:
        return 1
    print(f"{name}: ok ({kernel.short_hash})")
    return 0


def cmd_edit(args) -> int:
    problem, kernel, _, _ = _load(args.file)
    result = kernel
    for i, text in enumerate(args.edits, 1):
        for edit in parse_edits(text, f"edit {i}"):
            try:
                result = apply_edit(result, edit)
            except L2IRError as e:
                raise CliError(f"edit {i} ({edit}): [{type(e).__name__}] {e}") from None
    if problem is not None:
        sys.stdout.write(print_problem(problem) + "\n")
    sys.stdout.write(print_kernel(result))
    return 0


def cmd_interp(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from .interp import error_bound, interpret, random_inputs, reference

    file_problem, kernel, lines, name = _load(args.file)
    problem = _problem(args, file_problem)
    m, n, k = problem.shape
    need = 8 * (m * k + k * n) + 16 * m * n     # float64 reference operands, C, write counts, bound
    if need > args.max_bytes:
        raise CliError(f"{m}x{n}x{k} needs about {need / 2**30:.1f} GiB in the interpreter (limit "
                       f"{args.max_bytes / 2**30:.1f} GiB, --max-bytes); it checks schedules, not throughput")
    rng = np.random.default_rng(args.seed)
    a, b = random_inputs(problem, rng, integers=args.integers)
    t0 = time.perf_counter()
    try:
        result = interpret(kernel, problem, a, b)
    except VerifyError as e:
        print(_located(e, lines, name), file=sys.stderr)
        return 1
    seconds = time.perf_counter() - t0
    ref = reference(a, b)
    c = result.c.astype(np.float64)
    err = np.abs(c - ref)
    bound = error_bound(problem, a, b)
    rel = float(np.linalg.norm(c - ref) / max(np.linalg.norm(ref), 1e-300))
    ok = bool(np.all(err <= bound)) and (not args.integers or bool(np.all(err == 0)))
    table = Table(title=f"{name}  {print_problem(problem)}", show_header=False)
    table.add_row("kernel", kernel.short_hash)
    # A multicast cluster grid also has blocks past the tiles; split-K launches this many blocks per slice.
    table.add_row("blocks (launch order)", f"{len(result.order)} blocks, their tiles {result.order[:4]}...")
    table.add_row("inputs", "small integers (exact)" if args.integers else f"randn, seed {args.seed}")
    table.add_row("relative error ||C-AB||/||AB||", f"{rel:.3e}")
    table.add_row("max |C-AB| / bound", f"{float(np.max(err / bound)):.3f}")
    table.add_row("every element written once", "yes")
    table.add_row("interpreter seconds", f"{seconds:.3f}")
    table.add_row("verdict", "[green]PASS[/green]" if ok else "[red]FAIL[/red]")
    Console().print(table)
    return 0 if ok else 1


def cmd_seed(args) -> int:
    from .seed import seed

    problem = Problem(*args.shape) if not args.problem else parse_problem(args.problem, "--problem")
    if args.problem and args.shape:
        problem = problem.with_shape(*args.shape)
    kernel = seed(problem, args.target)
    sys.stdout.write(f"# seed for {args.target}\n{print_problem(problem)}\n{print_kernel(kernel)}")
    return 0


def cmd_lower(args) -> int:
    """Run the pass pipeline and the backend on one kernel file; print the source (--dump: every stage)."""
    from .passes import PassPipeline

    file_problem, kernel, lines, name = _load(args.file)
    pipeline = PassPipeline(tuple(PASSES[p] for p in args.passes or ()), args.backend)
    try:
        lowered = pipeline.run(kernel, file_problem or Problem(1, 1, 1))
    except VerifyError as e:
        print(_located(e, lines, name), file=sys.stderr)
        return 1
    except NotImplementedError as e:
        raise CliError(f"{name}: not lowered: {str(e).splitlines()[0]}") from None
    for i, stage in enumerate(lowered.stages if args.dump else lowered.stages[-1:]):
        if args.dump:
            print(f"// ===== stage {i}: {stage.name} =====")
        print(stage.text, end="" if stage.text.endswith("\n") else "\n")
    return 0


def cmd_compile(args) -> int:
    """Lower and compile one kernel file; report where every stage is on disk, resources and SASS."""
    from l2ir.backends.compile import CompileOptions, compile_plan
    from l2ir.backends.registry import backend_for
    from l2ir.backends.sass import inspect

    from .verify import verify

    file_problem, kernel, lines, name = _load(args.file)
    problem = file_problem or Problem(1, 1, 1)
    try:
        verify(kernel)
    except VerifyError as e:
        print(_located(e, lines, name), file=sys.stderr)
        return 1
    try:
        backend = backend_for(kernel, args.backend, problem)
        plan = backend.lower(kernel, problem)
    except NotImplementedError as e:
        raise CliError(f"{name}: not lowered: {e}") from None
    options = CompileOptions(device_sm=args.device_sm, compiler=args.compiler, cache_dir=args.cache_dir)
    result = compile_plan(plan, options)
    print(f"{name}: kernel {kernel.short_hash}, backend {backend.name}, {plan.form} for {plan.arch}, "
          f"built for {args.device_sm} with {args.compiler}")
    if not result.ok:
        print(f"compile {result.reason}: {result.summary()}", file=sys.stderr)
        print(f"reproduce: {result.repro}", file=sys.stderr)
        return 1
    cached = " (from the cache)" if result.cached else ""
    print(f"stages in {result.dir}: kernel.l2, kernel.cu, {result.binary.name}, compile.log, resources.json")
    print(f"compile seconds: {result.compile_seconds:.1f}{cached}")
    for fn, r in result.resources.items():
        if r.entry:
            label = fn if len(fn) <= 60 else fn[:48] + "..."
            print(f"  {label}: {r.registers} registers, {r.smem_static} B static smem, stack {r.stack_frame} B, "
                  f"spills {r.spill_stores}/{r.spill_loads} B")
    sass = inspect(result.binary) if args.sass else None
    if sass is not None:
        print("  SASS: " + ", ".join(f"{k} {v}" for k, v in sass.items()))
    elif args.sass:
        print("  SASS: not inspected (cuobjdump/nvdisasm not found)")
    return 0


def _bench_family(spec: str):
    """--family BACKEND=SWEEP[:CONFIG,CONFIG...] -> (backend, sweep, ((config, kernel), ...))."""
    from l2ir.backends.registry import BACKENDS

    backend, eq, rest = spec.partition("=")
    sweep, _, picks = rest.partition(":")
    if not eq or not backend or not sweep:
        raise CliError(f"--family {spec!r}: expected BACKEND=SWEEP[:CONFIG,...], e.g. cuda_ptx=cuda_ptx")
    if backend not in BACKENDS:
        raise CliError(f"--family {spec!r}: unknown backend '{backend}' (backends: {', '.join(BACKENDS)})")
    configs = _sweep_configs(sweep, [n for n in picks.split(",") if n] or None, f"--family {spec!r}: ")
    return backend, sweep, tuple(configs.items())


def _sweep_configs(sweep: str, names: list[str] | None, where: str = "") -> dict:
    """The named configurations of a sweep (all of them for None), or a CliError naming the unknown ones."""
    from l2ir.search.sweeps import load_sweep

    known = load_sweep(sweep)
    unknown = [n for n in names or () if n not in known]
    if unknown:
        raise CliError(f"{where}unknown config(s) {', '.join(unknown)} in sweep '{sweep}' "
                       f"(known: {', '.join(known)})")
    return known if names is None else {n: known[n] for n in names}


def cmd_bench(args) -> int:
    """GPU benchmark: seed + a named sweep over grid shapes, through the candidate pipeline (search/bench.py)."""
    from pathlib import Path

    from l2ir.search.bench import BenchConfig, default_sweep, grid_shapes, run_bench
    from l2ir.search.preflight import PreflightError, require
    from l2ir.search.report import print_summary

    problem = parse_problem(args.problem, "--problem") if args.problem else Problem(1, 1, 1)
    families = tuple(_bench_family(spec) for spec in (args.family or []))
    if families and (args.sweep is not None or args.backend):
        raise CliError("--family names its backend and sweep; drop --sweep/--backend")
    sweep_name = default_sweep(args.target, args.backend)
    sweep = _sweep_configs(sweep_name, args.sweep)
    shapes = list(args.shape or [])
    if args.shapes:
        shapes += [s for s in grid_shapes(args.shapes, args.min_gflop, args.max_gflop) if s not in shapes]
    shapes = tuple(sorted(shapes, key=lambda s: (s[0] * s[1] * s[2], s)))
    if not shapes:
        raise CliError("no shapes: give --shapes N and/or --shape MxNxK")
    # Before any work: a report rebuilt from the records needs no GPU; a measurement needs everything.
    if not args.report_only:
        try:
            require("l2ir bench")
        except PreflightError as e:
            raise CliError(str(e)) from None
    cfg = BenchConfig(out=Path(args.out), shapes=shapes, sweep=tuple(sweep.items()), sweep_name=sweep_name,
                      target=args.target, budget_s=args.budget_s, resume=not args.no_resume, backend=args.backend,
                      cache_dir=args.cache_dir, command="l2ir " + " ".join(sys.argv[1:]),
                      baseline_reduced_precision=args.torch_defaults, report_only=args.report_only,
                      device_sm=args.device_sm, problem=problem, families=families, fresh=not args.no_fresh)
    print_summary(run_bench(cfg))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="l2ir", description="L2IR: a typed kernel IR for GEMM kernels.")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("fmt", help="print a kernel file in canonical text")
    s.add_argument("file", help=".l2 file or - for stdin")
    s.set_defaults(fn=cmd_fmt)

    s = sub.add_parser("verify", help="check a kernel (and its gemm line, if any) against every rule")
    s.add_argument("file")
    s.set_defaults(fn=cmd_verify)

    s = sub.add_parser("edit", help="apply edits such as 'set pipeline.stages = 4' and print the result")
    s.add_argument("file")
    s.add_argument("edits", nargs="+", help="edit lines (several per argument with ';')")
    s.set_defaults(fn=cmd_edit)

    s = sub.add_parser("interp", help="run the reference interpreter and compare with float64 A @ B")
    s.add_argument("file")
    s.add_argument("--shape", type=shape_arg, help="MxNxK (overrides the file's gemm line)")
    s.add_argument("--problem", help="a full problem line: 'gemm m=.. n=.. k=.. a=f16:row b=f16:col ...'")
    s.add_argument("--seed", type=int, default=0, help="random seed of the inputs")
    s.add_argument("--integers", action="store_true", help="small-integer inputs: the result must be exact")
    s.add_argument("--max-bytes", type=float, default=2 * 2**30, help="refuse problems needing more memory")
    s.set_defaults(fn=cmd_interp)

    s = sub.add_parser("seed", help="the rule-based seed kernel for a problem and target")
    s.add_argument("--shape", type=shape_arg, required=True)
    s.add_argument("--target", choices=ARCHS, default="sm90a")
    s.add_argument("--problem", help="problem line giving dtypes/layouts; --shape sets the sizes")
    s.set_defaults(fn=cmd_seed)

    s = sub.add_parser("lower", help="lower a kernel file to CUDA source without compiling (--dump: every stage)")
    s.add_argument("file")
    s.add_argument("--backend", help="force a backend (default: the one default backend for the kernel)")
    s.add_argument("--pass", dest="passes", action="append", choices=sorted(PASSES),
                   help="run a shipped pass before lowering (repeatable, in order)")
    s.add_argument("--dump", action="store_true", help="print every stage: input IR, each pass, the plan, the source")
    s.set_defaults(fn=cmd_lower)

    s = sub.add_parser("compile", help="lower and compile a kernel file; report the stages, resources and SASS")
    s.add_argument("file")
    s.add_argument("--backend", help="force a backend (default: the one default backend for the kernel)")
    s.add_argument("--device-sm", default="sm_90", help="the GPU the SASS is for (default sm_90, an H100/H200)")
    s.add_argument("--compiler", choices=("nvcc", "nvrtc"), default="nvcc")
    s.add_argument("--cache-dir", default=".l2ir-cache")
    s.add_argument("--no-sass", dest="sass", action="store_false", help="skip disassembling the binary")
    s.set_defaults(fn=cmd_compile)

    s = sub.add_parser("bench", help="(GPU) evaluate the seed and a config sweep over grid shapes vs torch.matmul")
    s.add_argument("--target", choices=ARCHS, default="sm80", help="target of the seed kernels and the sweep")
    s.add_argument("--shapes", type=int, default=40, help="how many shapes of the {64..16384}^3 grid (0: none)")
    s.add_argument("--shape", type=shape_arg, action="append", help="an explicit MxNxK (repeatable; added to --shapes)")
    s.add_argument("--min-gflop", type=float, default=0.0, help="only grid shapes of at least this many GFLOP")
    s.add_argument("--max-gflop", type=float, default=float("inf"), help="only grid shapes below this many GFLOP")
    s.add_argument("--sweep", nargs="*", help="sweep config names (default: all for the target)")
    s.add_argument("--family", action="append", metavar="BACKEND=SWEEP[:CONFIG,...]",
                   help="measure a kernel family side by side with the others (repeatable), e.g. "
                        "cuda_ptx=cuda_ptx cutlass_sm90=sm90a cuda_ptx_sm80=cuda_ptx_sm80; replaces --sweep")
    s.add_argument("--no-fresh", action="store_true",
                   help="do not re-time each winner on fresh inputs (the report then uses selection samples)")
    s.add_argument("--out", required=True, help="results prefix, e.g. bench/results/sm80_grid40")
    s.add_argument("--budget-s", type=float, default=1e9, help="stop starting shapes after this many seconds")
    s.add_argument("--no-resume", action="store_true", help="discard earlier measurements in OUT.jsonl")
    s.add_argument("--backend", help="force a backend (cute_sm80, cutlass_sm90, cuda_ptx)")
    s.add_argument("--cache-dir", default=".l2ir-cache", help="compile cache")
    s.add_argument("--problem", help="problem class, e.g. 'gemm m=1 n=1 k=1 a=bf16:row b=bf16:row c=bf16:row "
                                     "acc=f32' (sizes come from the shapes)")
    s.add_argument("--device-sm", default="sm_90", help="SASS target of the GPU that runs the kernels")
    s.add_argument("--report-only", action="store_true",
                   help="rebuild OUT.csv/OUT.json from the measurements in OUT.jsonl; run nothing on a GPU")
    s.add_argument("--torch-defaults", action="store_true",
                   help="time torch.matmul with PyTorch's default flags (fp16 reduced-precision reductions allowed) "
                        "instead of holding it to fp32 accumulation")
    s.set_defaults(fn=cmd_bench)

    from l2ir.search.tune import add_parsers      # tune, runs, best, report, db: the search (search/tune.py)

    add_parsers(sub, shape_arg, positive_int)
    from .export import add_parser as add_export  # export: the dispatch package for l2ir.matmul (l2ir/export.py)

    add_export(sub)
    from l2ir.policy.train import add_parser as add_train   # train-policy: RL fine-tuning of the local LLM policy

    add_train(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ParseError, CliError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except L2IRError as e:
        print(f"error [{type(e).__name__}] {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
