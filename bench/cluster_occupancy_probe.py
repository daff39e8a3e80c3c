"""How many thread-block clusters of a kernel does the GPU hold at once? The driver's answer beside the launch.

A cluster's blocks must be co-scheduled on one GPC, so a GPU holds fewer four-block clusters than its SM count / 4
(the H200: 132 SMs in GPCs of up to 18). At 100x3000x4104 the cluster split-K kernel ran 27 four-block clusters of
128x112 tiles in 16.7 us and 32 of 128x96 in 22.4 us, as a second wave would (bench/NOTES.md, ntile-split);
policy/rules.py's FOUR_BLOCK_CLUSTER_WAVE rests on that. This probe asks cuOccupancyMaxActiveClusters for each case's
cluster launch, with the kernel's own block, dynamic shared memory and cluster shape, and says how many waves of
clusters the shape's grid makes. It compiles and loads each kernel; nothing is timed.

    python3 bench/cluster_occupancy_probe.py --case 100x3000x4104:cuda_ptx:ptx_splitk_cluster_coop_128x112x64_s4 \
        --out bench/results/cluster_occupancy_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from l2ir.indexing import ceil_div
from sweep_cases import case_arg, lower_case


def cluster_waves(grid: tuple[int, int, int], cluster: tuple[int, int, int], max_active: int) -> tuple[int, int]:
    """(clusters the grid launches, waves of at most max_active clusters at once)."""
    clusters = 1
    for g, c in zip(grid, cluster):
        clusters *= ceil_div(g, c)
    return clusters, (ceil_div(clusters, max_active) if max_active > 0 else 0)


def max_active_clusters(fn, grid, block, smem: int, cluster, stream) -> int:
    """cuOccupancyMaxActiveClusters for one launch configuration (the grid only sets the config's shape)."""
    from cuda.bindings import driver as cu

    from l2ir.runtime import _check

    config = cu.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = block
    config.sharedMemBytes = smem
    config.hStream = stream
    attr = cu.CUlaunchAttribute()
    attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster
    config.attrs = [attr]
    config.numAttrs = 1
    return int(_check(cu.cuOccupancyMaxActiveClusters(fn, config), "cuOccupancyMaxActiveClusters"))


def shim_row(shape, case: str, kernel, built) -> dict:
    """A host_shim plan launches inside its library, whose statically linked runtime alone can name the kernel: the
    library answers (l2ir_max_active_clusters, cuda_ptx sm90a shims); the grid is the backend's own config's (one
    block per tile and slice; reduce=cluster makes each tile's slices one cluster)."""
    import ctypes

    from l2ir.backends.cuda_ptx.sm90a import canonicalize
    from l2ir.nodes import Problem

    row = {"shape": list(shape), "case": case, "entry": "l2ir_run"}
    lib = ctypes.CDLL(str(built.binary))
    if not hasattr(lib, "l2ir_max_active_clusters"):
        return {**row, "error": "the library exports no l2ir_max_active_clusters (only cuda_ptx sm90a shims do)"}
    cfg = canonicalize(kernel, Problem(*shape))
    if cfg.persistent:
        return {**row, "error": "a persistent grid is one wave by construction"}
    lib.l2ir_max_active_clusters.restype = ctypes.c_int
    active = lib.l2ir_max_active_clusters()
    if active < 0:
        return {**row, "error": "cudaOccupancyMaxActiveClusters refused the launch configuration"}
    m, n, _ = shape
    grid = (ceil_div(m, cfg.bm) * ceil_div(n, cfg.bn) * (cfg.slices if cfg.split else 1), 1, 1)
    size = cfg.slices if cfg.cluster_reduce else 1
    clusters, waves = cluster_waves(grid, (size, 1, 1), active)
    return {**row, "grid": list(grid), "cluster": [size, 1, 1], "smem": None, "clusters": clusters,
            "max_active_clusters": active, "waves": waves}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", type=case_arg, action="append", required=True, help="MxNxK:SWEEP:CONFIG (repeatable)")
    ap.add_argument("--out", required=True, help="JSON file to write")
    args = ap.parse_args(argv)

    import torch
    from cuda.bindings import driver as cu

    from l2ir.backends.compile import CompileOptions, compile_plan
    from l2ir.runtime import CubinLauncher, LaunchError
    from l2ir.search.evaluator import environment

    if not torch.cuda.is_available():
        print("cluster_occupancy_probe: no CUDA GPU here", file=sys.stderr)
        return 1
    torch.cuda.init()
    rows = []
    for (m, n, k), sweep, config in args.case:
        try:
            kernel, _, plan = lower_case((m, n, k), sweep, config)
        except ValueError as e:
            ap.error(str(e))
        built = compile_plan(plan, CompileOptions())
        if not built.ok:
            rows.append({"shape": [m, n, k], "case": f"{sweep}/{config}", "error": built.summary()})
            continue
        if plan.form == "host_shim":
            rows.append(shim_row((m, n, k), f"{sweep}/{config}", kernel, built))
            continue
        try:
            launcher = CubinLauncher(plan, built.binary)
        except LaunchError as e:
            rows.append({"shape": [m, n, k], "case": f"{sweep}/{config}", "error": str(e)})
            continue
        try:
            for fn, ln in zip(launcher._funcs, plan.launches):
                if ln.cluster == (1, 1, 1):
                    continue
                row = {"shape": [m, n, k], "case": f"{sweep}/{config}", "entry": ln.entry}
                grid = ln.grid_for(m, n, k)
                try:
                    active = max_active_clusters(fn, grid, ln.block, ln.smem, ln.cluster, cu.CUstream(0))
                except LaunchError as e:
                    rows.append({**row, "error": str(e)})
                    continue
                clusters, waves = cluster_waves(grid, ln.cluster, active)
                res = built.resources.get(ln.entry)
                rows.append({**row, "grid": list(grid), "block": list(ln.block), "smem": ln.smem,
                             "cluster": list(ln.cluster), "registers": res.registers if res else None,
                             "clusters": clusters, "max_active_clusters": active, "waves": waves})
        finally:
            launcher.close()
    out = {"command": "python3 bench/cluster_occupancy_probe.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "environment": environment(0),
           "scenario": "occupancy query (cuOccupancyMaxActiveClusters), nothing timed", "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"{'shape':>16} {'case':<52} {'cluster':>7} {'smem':>7} {'clusters':>8} {'max active':>10} {'waves':>5}")
    for r in rows:
        shape = "x".join(map(str, r["shape"]))
        if "error" in r:
            print(f"{shape:>16} {r['case']:<52} failed: {r['error']}")
            continue
        print(f"{shape:>16} {r['case']:<52} {'x'.join(map(str, r['cluster'])):>7} {str(r['smem']):>7} {r['clusters']:>8} "
              f"{r['max_active_clusters']:>10} {r['waves']:>5}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
