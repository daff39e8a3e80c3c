"""Launch chosen sweep kernels and torch.matmul a few times each, for Nsight Compute to read their counters.

An experiment, not a feature: the bench says how long a kernel takes; this says where the time goes (DRAM and L2
throughput, the bytes each level moved, occupancy, what the warps stalled on). Run it under ncu with the clocks
left alone (the device rules: --clock-control none), e.g.

    ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        --section Occupancy --section LaunchStats --csv --page details \
        python3 bench/ncu_probe.py --case 17x9999x3333:cuda_ptx_direct:direct_16x32x64_w1x4_s2_align1 --torch

Each case is MxNxK:SWEEP:CONFIG (a sweep folder and one of its configurations; the backend is the config's default
unless SWEEP names a backend folder such as cuda_ptx_direct). Every kernel is launched --launches times on one set
of random inputs, after one check against torch.matmul (a wrong kernel is reported, not profiled in silence).
"""

from __future__ import annotations

import argparse
import sys

from sweep_cases import MAX_REL_ERR, answer_error, case_arg, lower_case


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", type=case_arg, action="append", required=True, help="MxNxK:SWEEP:CONFIG (repeatable)")
    ap.add_argument("--torch", action="store_true", help="also launch torch.matmul on each case's shape")
    ap.add_argument("--launches", type=int, default=2, help="launches of each kernel (default 2)")
    args = ap.parse_args(argv)

    import torch

    from l2ir.backends.compile import CompileOptions, compile_plan
    from l2ir.runtime import load

    if not torch.cuda.is_available():
        print("ncu_probe: no CUDA GPU", file=sys.stderr)
        return 2
    status = 0
    for (m, n, k), sweep, config in args.case:
        try:
            _, _, plan = lower_case((m, n, k), sweep, config)
        except ValueError as e:
            ap.error(str(e))
        built = compile_plan(plan, CompileOptions())
        if not built.ok:
            print(f"{m}x{n}x{k} {sweep}/{config}: compile failed: {built.summary()}", file=sys.stderr)
            status = 1
            continue
        run = load(plan, built.binary)
        a = torch.randn(m, k, device="cuda", dtype=torch.float16)
        b = torch.randn(n, k, device="cuda", dtype=torch.float16)     # B stored N x K (K-major)
        c = torch.empty(m, n, device="cuda", dtype=torch.float16)
        ws_bytes = run.workspace_bytes(m, n, k)
        ws = torch.zeros(max(ws_bytes, 1), device="cuda", dtype=torch.uint8)
        for _ in range(args.launches):
            run(a.data_ptr(), b.data_ptr(), c.data_ptr(), m, n, k, ws.data_ptr(), ws_bytes)
        err = answer_error(c, a, b)
        print(f"{m}x{n}x{k} {sweep}/{config}: {args.launches} launches, max error {err:.2e} of max |C|", flush=True)
        if not err <= MAX_REL_ERR:
            status = 1
        if args.torch:
            for _ in range(args.launches):
                torch.matmul(a, b.t())
        torch.cuda.synchronize()
    return status


if __name__ == "__main__":
    sys.exit(main())
