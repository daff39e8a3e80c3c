#!/usr/bin/env bash
# On the GPU host: the compile tests and the evaluator's GPU tests (planted defects vs gates, fault and hang
# recovery, offline/server timing against torch.matmul), verbose, then a short summary.
# Usage: bash bench/gpu_evaluator_check.sh [extra pytest args]
set -uo pipefail
cd "$(dirname "$0")/.."

echo "== environment"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv,noheader || true
nvcc --version | tail -2 || true
python - <<'PY'
import importlib.metadata as md
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu available:", torch.cuda.is_available())
for pkg in ("cuda-bindings", "nvidia-cuda-nvrtc", "nvidia-cutlass", "numpy", "pytest"):
    try:
        print(pkg, md.version(pkg))
    except md.PackageNotFoundError:
        print(pkg, "not installed")
PY

echo "== tests"
report=$(mktemp -d)/junit.xml
python -m pytest -v -rs -p no:cacheprovider --junitxml="$report" \
    tests/test_evaluator_gpu.py tests/test_compile.py tests/test_source_backend.py tests/test_evaluator_cpu.py "$@"
rc=$?

echo "== summary"
python - "$report" <<'PY'
import sys
import xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suite = root if root.tag == "testsuite" else root.find("testsuite")
cases = suite.findall("testcase")
by = {"passed": [], "failed": [], "skipped": []}
for c in cases:
    name = f"{c.get('classname').split('.')[-1]}::{c.get('name')}"
    if c.find("failure") is not None or c.find("error") is not None:
        by["failed"].append(name)
    elif c.find("skipped") is not None:
        by["skipped"].append(name + "  (" + (c.find("skipped").get("message") or "") + ")")
    else:
        by["passed"].append(name)
gpu = [n for n in by["passed"] if n.startswith("test_evaluator_gpu") and "compile" not in n]
print(f"{len(by['passed'])} passed, {len(by['failed'])} failed, {len(by['skipped'])} skipped "
      f"({len(gpu)} of the GPU evaluator tests ran and passed)")
for n in by["failed"]:
    print("FAILED ", n)
for n in by["skipped"]:
    print("skipped", n)
PY
exit $rc
