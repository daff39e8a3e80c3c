"""Do the multicast kernel's stage release and its exit cost it time? (an A/B on generated cuda_ptx sources)

    python bench/release_probe.py --case 100x3000x4104:cuda_ptx:ptx_w4x1_64x64x64_c1x4 --out FILE [--compile-only]

In a tile.cluster (TMA multicast) kernel every block of a patch row or column writes into a block's stage, so a stage
goes back to the producers only when all of them have been told. The cuda_ptx sm90a kernel tells them from every
consumer warp: lanes 0..CLUSTER_SIZE-1 of each warp arrive at the empty barrier of one cluster rank each, and the empty
barrier counts (CLUSTER_M + CLUSTER_N - 1) x 4 arrivals a phase. CUTLASS's PipelineTmaAsync arrives once per consumer
warpgroup and destination block, the destinations spread over the warpgroup's warps (4 arrivals a phase in a 1x4
cluster, against our 16). At 100x3000x4104 our 64x64 1x4 kernel runs 45% behind CUTLASS's offline and does not speed
up with B in L2 (bench/NOTES.md, ncu-multicast): its k loop waits on something other than bytes. Variants (per_wg
and per_wg_bar: one consumer warpgroup only, tile.warps=4x1):
  as_lowered  the source as generated: the load-tail exit, a relaxed arrival at the entry's cluster barrier
  per_wg      one arrival per destination block from the warpgroup: rank r from warp r % 4, lane r / 4 (the empty
              barrier's count divided by 4), as CUTLASS does: a warp's wgmma.wait_group stands for the warpgroup's
  per_wg_bar  per_wg after a named barrier of the 4 consumer warps (bar.sync 1, 128), so every warp's wait has
              returned before any arrival: the same arrivals without leaning on the warpgroup's collective wait
  exit_barrier  the exit as it was before the load tail: every thread of every block arrives (release) at a
              cluster barrier and waits for the cluster's slowest block before leaving, and the entry's arrival is a
              release too. ncu's samples of that kernel (H100): 37% at the exit's wait, 9% at the membar that the
              release compiles to (it waits for the block's C stores)
  entry_release  the load tail, but the entry's cluster barrier arrives with release semantics
Each variant is checked against torch.matmul on the timed sets and timed in the offline scenario
(bench/source_variants.py). A release that wins becomes the backend's, gated by the evaluator; this probe only
measures.
"""

from __future__ import annotations

import argparse
import re
import sys

from source_variants import replaced, run
from sweep_cases import case_arg

RELEASE = "if (lane < CLUSTER_SIZE && (release_mask >> lane & 1)) mbar_arrive_cluster(bars + 8 * (STAGES + s), lane);"
# Rank r < 16 (the non-portable cluster limit) has exactly one signalling thread in the warpgroup.
RELEASE_PER_WG = ("{ const int r = warp + 4 * lane; if (lane < 4 && r < CLUSTER_SIZE && (release_mask >> r & 1)) "
                  "mbar_arrive_cluster(bars + 8 * (STAGES + s), r); }")
NAMED_BARRIER = 'asm volatile("bar.sync 1, 128;" ::: "memory"); '
ARRIVALS = re.compile(r"constexpr uint32_t EMPTY_ARRIVALS = (\d+);")
TAIL = re.compile(r"      // tile\.cluster: the block may leave only when.*?\n      }\n", re.S)
KERNEL_END = "}\n\n// ---- trusted host code"
EXIT_BARRIER = ('  asm volatile("barrier.cluster.arrive.release;" ::: "memory");\n'
                '  asm volatile("barrier.cluster.wait.acquire;" ::: "memory");\n')
ARRIVE_RELEASE = 'asm volatile("barrier.cluster.arrive.release;" ::: "memory");'
ARRIVE_RELAXED = 'asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory");'


def per_warpgroup(barrier: bool):
    def edit(source: str) -> str:
        if "constexpr int CONSUMER_WGS = 1;" not in source:
            raise ValueError("the release probe edits kernels with one consumer warpgroup (tile.warps=4x1)")
        found = ARRIVALS.findall(source)
        if len(found) != 1 or int(found[0]) % 4:
            raise ValueError(f"the generated source has {len(found)} EMPTY_ARRIVALS counts, not one per-warp count")
        source = ARRIVALS.sub(f"constexpr uint32_t EMPTY_ARRIVALS = {int(found[0]) // 4};", source)
        return replaced(source, [(RELEASE, (NAMED_BARRIER if barrier else "") + RELEASE_PER_WG)])
    return edit


def entry_release(source: str) -> str:
    return replaced(source, [(ARRIVE_RELAXED, ARRIVE_RELEASE)])


def exit_barrier(source: str) -> str:
    """The exit before the load tail: no tail, a release-and-wait cluster barrier at the kernel's end."""
    source, tails = TAIL.subn("", source)
    if tails != 1 or source.count(KERNEL_END) != 1:
        raise ValueError("the generated source has no single load tail and kernel end to edit")
    return entry_release(source.replace(KERNEL_END, EXIT_BARRIER + KERNEL_END))


VARIANTS = {"as_lowered": lambda source: source, "per_wg": per_warpgroup(False), "per_wg_bar": per_warpgroup(True),
            "exit_barrier": exit_barrier, "entry_release": entry_release}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", type=case_arg, action="append", required=True, help="MxNxK:SWEEP:CONFIG (repeatable)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--compile-only", action="store_true", help="only build the variants: ptxas registers and spills")
    args = ap.parse_args(argv)
    command = "python3 bench/release_probe.py " + " ".join(sys.argv[1:] if argv is None else argv)
    return run(args.case, VARIANTS, command, args.out, args.compile_only)


if __name__ == "__main__":
    sys.exit(main())
