"""The LLM policy before and after RL fine-tuning (l2ir train-policy), on shapes held out from training.

    python bench/train_policy.py --out bench/results/train_policy_h200                 # one H200, measured rewards
    python bench/train_policy.py --standin --out /tmp/train_policy_standin              # CPU: stand-in cost model

For each decoding mode (--modes: constrained, where the model ranks the legal edit operators and every reply
verifies; free, where it writes the reply and the grammar parses it back), one `l2ir train-policy` run
(policy/train.py): the held-out shapes are scored with the base model (G replies each from the rule-based seed
kernel), the model is trained with LoRA for --steps steps on the training shapes, and the held-out shapes are
scored again with the same sampling seed. Rewards are the log-speedup over torch.matmul measured by the evaluator
(offline scenario: CUDA-graph replay) on the raw-PTX backends, or the penalty for a reply that does not parse,
verify or pass a gate; every kernel measured once is answered by the records DB afterwards (--db; the second mode
reuses the first's measurements).

OUT.json: the environment (GPU, driver, CUDA, torch), the date, the scenario, the command, and per mode the
before/after numbers (valid-reply rate, mean reward, geomean speedup of the measured proposals), the training
curve and how many GPU evaluations it took. OUT.png: the before/after bars and the training curves. The adapters go
to .l2ir/train_policy_<mode>/ (not committed: ~10 MB each).

Device budget (one H200; the run of 2026-12-01, bench/results/train_policy_h200.json, measured 170 s with 10
constrained and 4 free steps): ~20 s to load the model per mode; ~15 s to build the 76 distinct kernels (the seeds
of the 7 shapes and every option of them) in one parallel nvcc batch; ~30 s for the exact held-out scoring before
(3 shapes x 38 options, one evaluation each; the scoring after is answered by the records DB). A constrained step
took ~0.4 s once its kernels were built (a step that moves an incumbent compiles that parent's sampled options
first, a few seconds), so the constrained mode now takes 60 steps, capped by --budget-seconds (90) of training:
~160 s in all. The free mode costs ~6 s a step and learns nothing a 135M model can use (0 of 24 replies parsed,
before and after), so it takes 2 steps: ~50 s. About 3.5 minutes, within 5. Constrained options are scored per
token (`--scoring mean`, policy/train.py); the run's config in OUT.json records it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TRAIN = ["2048x2048x2048", "4096x1024x2048", "1024x4096x1024", "3072x3072x1024"]
HELD = ["2048x4096x2048", "4096x4096x1024", "1536x1536x1536"]


def environment(standin: bool) -> dict:
    import platform

    if standin:
        from l2ir.search.standin import STANDIN_ENV

        return dict(STANDIN_ENV)
    import subprocess

    from l2ir.search.evaluator import environment as gpu_environment

    env = gpu_environment(0)
    try:
        env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        env.setdefault("driver", None)
    env.setdefault("python", platform.python_version())
    return env


def train_args(args, mode: str):
    from l2ir.policy.train import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    steps = args.steps if mode == "constrained" else args.free_steps
    argv = ["--db", args.db, "--mode", mode, "--steps", str(steps), "--group", str(args.group), "--batch",
            str(args.batch), "--lr", str(args.lr), "--lora-r", str(args.lora_r), "--seed", str(args.seed),
            "--budget-seconds", str(args.budget_seconds), "--out", str(ROOT / ".l2ir" / f"train_policy_{mode}"),
            "--train-shapes", *args.train_shapes, "--held-shapes", *args.held_shapes]
    if args.standin:
        argv.append("--standin")
    if args.device:
        argv += ["--device", args.device]
    if args.model:
        argv += ["--model", args.model]
    return p.parse_args(argv)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in result["modes"] if "before" in result["modes"][m]]
    metrics = [("valid_rate", "valid-reply rate"),
               ("mean_reward", "mean reward of the samples (log speedup; fail = -1)"),
               ("expected_reward", "expected reward over all options (constrained)"),
               ("geomean_speedup", "geomean speedup of measured proposals")]
    fig, axes = plt.subplots(1, len(metrics) + 1, figsize=(4.2 * (len(metrics) + 1), 3.8))
    width = 0.38
    for ax, (key, title) in zip(axes, metrics):
        for j, (phase, color) in enumerate((("before", "#999999"), ("after", "#2a7ab9"))):
            vals = [result["modes"][m][phase].get(key) for m in modes]
            xs = [i + (j - 0.5) * width for i in range(len(modes))]
            ax.bar(xs, [0 if v is None else v for v in vals], width, color=color, label=phase)
            for x, v in zip(xs, vals):
                ax.text(x, 0 if v is None else v, "-" if v is None else f"{v:.3f}", ha="center",
                        va="bottom" if (v or 0) >= 0 else "top", fontsize=8)
        ax.set_xticks(range(len(modes)), modes)
        ax.set_title(title, fontsize=9)
        ax.axhline(0, color="black", lw=0.6)
        if key == "geomean_speedup":
            ax.axhline(1, color="#c0392b", lw=0.8, ls="--")
    axes[0].legend(fontsize=8)
    ax = axes[-1]
    for m in result["modes"]:
        curve = result["modes"][m].get("curve") or []
        ax.plot([p["step"] for p in curve], [p["mean_reward"] for p in curve], marker="o", label=m)
    ax.set_xlabel("training step")
    ax.set_title("mean reward of the training groups", fontsize=9)
    ax.legend(fontsize=8)
    label = "stand-in cost model (NOT measured)" if result["standin"] else result["environment"].get("gpu", "GPU")
    fig.suptitle(f"LLM policy before/after RL fine-tuning, held-out shapes ({label})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="results prefix: OUT.json, OUT.png")
    ap.add_argument("--db", default=None, help="records DB (default: OUT.db)")
    ap.add_argument("--modes", nargs="+", default=["constrained", "free"], choices=["constrained", "free"])
    ap.add_argument("--train-shapes", nargs="+", default=TRAIN)
    ap.add_argument("--held-shapes", nargs="+", default=HELD)
    ap.add_argument("--steps", type=int, default=60, help="constrained mode's training steps")
    ap.add_argument("--free-steps", type=int, default=2, help="free mode's training steps")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--lora-r", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-seconds", type=float, default=90.0, help="cap on each mode's training")
    ap.add_argument("--device", default=None, help="the model's torch device (default: cuda when the rewards are "
                    "measured, else cpu)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--standin", action="store_true", help="rewards from the stand-in cost model (NOT measured)")
    args = ap.parse_args(argv)
    args.db = args.db or f"{args.out}.db"
    if args.device is None and not args.standin:
        args.device = "cuda"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)

    from l2ir.errors import L2IRError
    from l2ir.policy.train import run_training

    t0 = time.monotonic()
    result = {"command": "python bench/train_policy.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "scenario": "offline (CUDA-graph replay, interleaved with torch.matmul)" if not args.standin
              else "stand-in cost model: NOT measured", "standin": args.standin, "modes": {}}
    try:
        result["environment"] = environment(args.standin)
        for mode in args.modes:
            print(f"== {mode}", flush=True)
            t = time.monotonic()
            result["modes"][mode] = run_training(train_args(args, mode), log=lambda m: print(m, flush=True))
            result["modes"][mode]["seconds"] = time.monotonic() - t
            # Written after each mode: a run stopped by its time limit keeps what it finished.
            result["seconds"] = time.monotonic() - t0
            Path(f"{args.out}.json").write_text(json.dumps(result, indent=1, default=str))
            plot(result, Path(f"{args.out}.png"))
    except L2IRError as e:
        print(f"error [{type(e).__name__}] {e}", file=sys.stderr)
        return 1
    result["seconds"] = time.monotonic() - t0
    Path(f"{args.out}.json").write_text(json.dumps(result, indent=1, default=str))
    plot(result, Path(f"{args.out}.png"))
    for mode, r in result["modes"].items():
        if "before" in r:
            b, a = r["before"], r["after"]
            fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
            print(f"{mode:12s} valid {fmt(b['valid_rate'])} -> {fmt(a['valid_rate'])}, mean reward "
                  f"{fmt(b['mean_reward'])} -> {fmt(a['mean_reward'])}, geomean speedup "
                  f"{fmt(b['geomean_speedup'])} -> {fmt(a['geomean_speedup'])}"
                  + (f", expected reward over all options {fmt(b['expected_reward'])} -> "
                     f"{fmt(a['expected_reward'])}" if "expected_reward" in b else ""))
    print(f"{args.out}.json, {args.out}.png ({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
