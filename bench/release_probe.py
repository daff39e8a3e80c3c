"""Do the cluster kernels' releases and exits cost them time? (an A/B on generated cuda_ptx sources)

    python bench/release_probe.py --case 100x3000x4104:cuda_ptx:ptx_w4x1_64x64x64_c1x4 --out FILE [--compile-only]

In a tile.cluster (TMA multicast) kernel every block of a patch row or column writes into a block's stage, so a stage
goes back to the producers only when all of them have been told: lanes 0..CLUSTER_SIZE-1 of each consumer warp arrive
at the empty barrier of one cluster rank each. At 100x3000x4104 our 64x64 1x4 kernel ran 45% behind CUTLASS's offline
and did not speed up with B in L2 (bench/NOTES.md, ncu-multicast and ncu-stalls). The backend now maps each lane's
remote empty barriers once (mapa) and leaves through the producer's load tail; these variants put back what it did
before, one change at a time:
  as_lowered     the source as generated
  mapa_in_loop   the release maps its remote barrier (mapa, which reads the block's cluster id from a special
                 register) at every k tile, as it did before
  entry_release  the entry's cluster barrier arrives with release semantics (a GPU-scope MEMBAR per warp), not
                 relaxed
  exit_barrier   the exit before the load tail: no tail, every thread of every block arrives (release) at a
                 cluster barrier and waits for the cluster's slowest block before leaving, and the entry's arrival
                 is a release too. ncu's samples of that kernel (H100): 37% at the exit's wait, 9% at the membar
                 that the release compiles to (it waits for the block's C stores)
  --stored pull=bench/results/cluster_pull_sources (split-K reduce=cluster kernels, recipe `push-reduce`) the
                 sources 9cca87e lowered: each block stored its partial in its own shared memory, published it with
                 a release arrival (a GPU-scope MEMBAR per warp), read the units it owns from every block (DSMEM
                 loads), and the cluster met again before any block left. The backend now pushes instead (st.async
                 into the owners' receive buffers, counted by their mbarriers): no release, no exit barrier.
Relaxing that pull protocol's producer arrivals and the consumers' done-reading one won 6-12% on all five
reduce=cluster server shapes on the H100 (h100/release_reduce_h100.json, variants this probe had at 9cca87e).
The per-warpgroup release (one arrival per warpgroup and destination block, as CUTLASS's PipelineTmaAsync does) was
measured by this probe at 9ea71b2 and lost 8-36% (bench/results/h100/release_h100.json).
Each variant is checked against torch.matmul on the timed sets and timed in the offline scenario
(bench/source_variants.py). This probe only measures; what wins is the backend's, gated by the evaluator.
"""

from __future__ import annotations

import re
import sys

from source_variants import probe_parser, replaced, run_probe

RELEASE = "      if (releases) mbar_arrive_remote(remote_empty + 8 * s);"
RELEASE_MAPA = ("      if (releases) { uint32_t remote; asm volatile(\"mapa.shared::cluster.u32 %0, %1, %2;\" : "
                "\"=r\"(remote) : \"r\"(bars + 8 * (STAGES + s)), \"r\"(lane)); mbar_arrive_remote(remote); }")
TAIL = re.compile(r"      // tile\.cluster: the block may leave only when.*?\n      }\n", re.S)
KERNEL_END = "}\n\n// ---- trusted host code"
EXIT_BARRIER = ('  asm volatile("barrier.cluster.arrive.release;" ::: "memory");\n'
                '  asm volatile("barrier.cluster.wait.acquire;" ::: "memory");\n')
ARRIVE_RELEASE = 'asm volatile("barrier.cluster.arrive.release;" ::: "memory");'
ARRIVE_RELAXED = 'asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory");'
def mapa_in_loop(source: str) -> str:
    return replaced(source, [(RELEASE, RELEASE_MAPA)])


def entry_release(source: str) -> str:
    return replaced(source, [(ARRIVE_RELAXED, ARRIVE_RELEASE)])


def exit_barrier(source: str) -> str:
    """The exit before the load tail: no tail, a release-and-wait cluster barrier at the kernel's end."""
    source, tails = TAIL.subn("", source)
    if tails != 1 or source.count(KERNEL_END) != 1:
        raise ValueError("the generated source has no single load tail and kernel end to edit")
    return entry_release(source.replace(KERNEL_END, EXIT_BARRIER + KERNEL_END))


VARIANTS = {"as_lowered": lambda source: source, "mapa_in_loop": mapa_in_loop, "entry_release": entry_release,
            "exit_barrier": exit_barrier}


def main(argv=None) -> int:
    args = probe_parser(__doc__).parse_args(argv)
    return run_probe("release_probe.py", args, VARIANTS, argv)


if __name__ == "__main__":
    sys.exit(main())
