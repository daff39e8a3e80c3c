"""A/B of edited generated sources: the probes that ask "would this change to the generated kernel help?" before it
becomes an IR field (bench/cache_policy_probe.py: L2 cache policies; bench/launch_bounds_probe.py: blocks per SM).

Each case (MxNxK:SWEEP:CONFIG, bench/sweep_cases.py) is lowered once; every variant is a function of its CUDA source
(the identity for `as_lowered`; a ValueError when its edit does not apply to this source), or a stored source: with
`--save-sources DIR` a run writes each case's source as lowered (DIR/MxNxK_SWEEP_CONFIG.cu), and `--stored NAME=DIR`
in a later run, at another commit, races it as variant NAME beside what that commit lowers (an A/B of two
lowerings in one process, on the same input sets). All variants are compiled
in parallel first (ptxas registers and spills reported per variant: the part a machine without a GPU can answer);
on a GPU each one is then checked against torch.matmul on the timed sets (max |diff| <= 1e-2 x max |ref|, fp32
accumulation in both) and timed in the evaluator's offline scenario (search.timing.time_offline, interleaved with
torch.matmul). This module only measures; a variant that wins is built into the backend and gated by the evaluator.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

from sweep_cases import case_arg, lower_case, offline_sets

Variants = dict[str, Callable[[str], str] | Path]   # an edit of the lowered source, or a --save-sources folder


def source_file(shape, sweep: str, config: str) -> str:
    """The file name --save-sources writes a case's source under and --stored reads it from."""
    return f"{'x'.join(map(str, shape))}_{sweep}_{config}.cu"


def replaced(source: str, edits) -> str:
    """`source` with each (old, new) text replaced; an `old` the source lacks is a ValueError (the edit no longer
    applies to what the backend generates)."""
    for old, new in edits:
        if old not in source:
            raise ValueError(f"the generated source has no {old[:60]!r}...: the probe's edit no longer applies")
        source = source.replace(old, new)
    return source


def _entry_resources(built) -> dict:
    """Registers and spills of the build's entry point(s), summed over entries for the spills."""
    entries = [r for r in built.resources.values() if r.entry] or list(built.resources.values())
    return {"registers": max((r.registers for r in entries), default=0),
            "spill_bytes": sum(r.spill_stores + r.spill_loads for r in entries)}


def build_variants(cases, variants: Variants) -> list[dict]:
    """Lower every case, apply every variant, compile them all in parallel: one row per (case, variant) with its
    plan and build (or the error that stopped it) and ptxas's registers and spills."""
    from l2ir.backends.compile import CompileOptions, compile_many

    rows, plans = [], []
    for shape, sweep, config in cases:
        _, _, plan = lower_case(shape, sweep, config)
        for name, edit in variants.items():
            row = {"shape": list(shape), "case": f"{sweep}/{config}", "variant": name}
            try:
                source = ((edit / source_file(shape, sweep, config)).read_text() if isinstance(edit, Path)
                          else edit(plan.source))
                row["plan"] = dataclasses.replace(plan, source=source)
                plans.append(row["plan"])
            except ValueError as e:
                row["error"] = str(e)
            except OSError as e:
                row["error"] = f"no stored source: {e.filename}: {e.strerror}"
            rows.append(row)
    built = iter(compile_many(plans, CompileOptions()))
    for row in rows:
        if "plan" in row:
            b = row["built"] = next(built)
            if b.ok:
                row.update(_entry_resources(b))
            else:
                row["error"] = b.summary()
    return rows


def time_variants(rows: list[dict]) -> None:
    """On the GPU: check and time every built variant (offline scenario, interleaved with torch.matmul), in place."""
    import torch

    from l2ir.runtime import load
    from l2ir.search.timing import TimingConfig, l2_bytes, time_offline

    torch.cuda.init()
    l2 = l2_bytes(0)
    cfg = TimingConfig()
    by_shape: dict[tuple, list[dict]] = {}
    for row in rows:
        by_shape.setdefault(tuple(row["shape"]), []).append(row)
    for (m, n, k), group in by_shape.items():
        sets, baseline = offline_sets(m, n, k, l2, cfg)
        n_sets = len(sets)
        for row in group:
            if "error" in row:
                continue
            launcher = load(row["plan"], row["built"].binary)
            ws_bytes = launcher.workspace_bytes(m, n, k)
            ws = torch.zeros(max(ws_bytes, 1), dtype=torch.uint8, device="cuda")

            def kernel(i, launcher=launcher, sets=sets, mnk=(m, n, k), ws=ws, ws_bytes=ws_bytes):
                a, b, c, _ = sets[i]
                launcher(a.data_ptr(), b.data_ptr(), c.data_ptr(), *mnk, ws.data_ptr(), ws_bytes)

            k_us, b_us, reps = time_offline(kernel, baseline, n_sets, cfg)
            torch.cuda.synchronize()
            worst = max(float((c.float() - cb.float()).abs().max() / cb.float().abs().max()) for _, _, c, cb in sets)
            row.update(kernel_us=statistics.median(k_us), torch_us=statistics.median(b_us),
                       kernel_spread=(max(k_us) - min(k_us)) / min(k_us), reps=reps, max_rel_diff_vs_torch=worst,
                       correct=worst <= 1e-2)
            launcher.close()
            print(f"{m}x{n}x{k} {row['case']} {row['variant']:>10}: {row['kernel_us']:8.2f} us "
                  f"(torch {row['torch_us']:.2f}), rel diff {worst:.1e}", flush=True)
        sets.clear()
        torch.cuda.empty_cache()


def run(cases, variants: Variants, command: str, out: str, compile_only: bool = False,
        save_sources: str | None = None) -> int:
    """Build (and, unless compile_only, check and time) every variant of every case; write `out` (JSON: the command,
    the date, the environment, the scenario, one row per variant) and print a table. 1 when a GPU is needed and
    absent or when a timed variant computed a wrong answer; 2 for a case the sweeps do not have."""
    timed = not compile_only
    if timed:
        import torch

        if not torch.cuda.is_available():
            print(f"{command.split()[1]}: no CUDA GPU here (--compile-only reports registers and spills)",
                  file=sys.stderr)
            return 1
    try:
        rows = build_variants(cases, variants)
    except ValueError as e:                  # a case the sweeps do not have
        print(f"{command.split()[1]}: {e}", file=sys.stderr)
        return 2
    if save_sources:
        Path(save_sources).mkdir(parents=True, exist_ok=True)
        for r in rows:
            if r["variant"] == "as_lowered" and "plan" in r:
                sweep, config = r["case"].split("/", 1)
                (Path(save_sources) / source_file(r["shape"], sweep, config)).write_text(r["plan"].source)
    if timed:
        time_variants(rows)
    from l2ir.search.evaluator import environment

    kept = [{k: v for k, v in r.items() if k not in ("plan", "built")} for r in rows]
    doc = {"command": command, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "environment": environment(0) if timed else {"gpu": None, "note": "compile only: ptxas on this host"},
           "scenario": ("offline (CUDA-graph replay over rotated input sets, interleaved with torch.matmul)" if timed
                        else "compile only (ptxas registers and spills, nothing run)"),
           "rows": kept}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"\n{'shape':>16} {'case':<48} {'variant':>10} {'regs':>5} {'spill':>6} {'us':>8} {'torch':>8} "
          f"{'vs as lowered':>13}")
    base = {}
    for r in kept:
        key = (tuple(r["shape"]), r["case"])
        if r["variant"] == "as_lowered" and "kernel_us" in r:
            base[key] = r["kernel_us"]
        s = "x".join(map(str, r["shape"]))
        if "error" in r:
            print(f"{s:>16} {r['case']:<48} {r['variant']:>10} error: {r['error'][:60]}")
            continue
        timing = (f"{r['kernel_us']:8.2f} {r['torch_us']:8.2f} {base.get(key, float('nan')) / r['kernel_us']:13.3f}"
                  if "kernel_us" in r else "")
        print(f"{s:>16} {r['case']:<48} {r['variant']:>10} {r['registers']:5d} {r['spill_bytes']:6d} {timing}")
    return 0 if all(r.get("correct", True) for r in kept) else 1


def probe_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments every source-variant probe takes (its own are added after): the cases, the output file and
    --compile-only."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--case", type=case_arg, action="append", required=True, help="MxNxK:SWEEP:CONFIG (repeatable)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--compile-only", action="store_true", help="only build the variants: ptxas registers and spills")
    ap.add_argument("--save-sources", metavar="DIR", help="write each case's source as lowered to DIR")
    ap.add_argument("--stored", action="append", default=[], metavar="NAME=DIR",
                    help="race the sources an earlier --save-sources wrote to DIR as variant NAME (repeatable)")
    return ap


def run_probe(script: str, args: argparse.Namespace, variants: Variants, argv=None) -> int:
    """run() for a probe's parsed arguments, recording the command line it was given."""
    command = f"python3 bench/{script} " + " ".join(sys.argv[1:] if argv is None else argv)
    variants = dict(variants)
    for spec in args.stored:
        name, sep, folder = spec.partition("=")
        if not sep or not name or not Path(folder).is_dir():
            print(f"{script}: --stored {spec}: expected NAME=DIR with an existing folder", file=sys.stderr)
            return 2
        variants[name] = Path(folder)
    return run(args.case, variants, command, args.out, args.compile_only, args.save_sources)
