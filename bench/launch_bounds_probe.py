"""Would promising more blocks per SM help a register-bound mma.sync kernel? (an A/B on generated sources)

    python bench/launch_bounds_probe.py --case 17x9999x3333:cuda_ptx_sm80:ptx_sm80_32x128x64_w2x4_s3_splitk3_interleave \
        --blocks 2 3 --out FILE [--compile-only]

The cuda_ptx_sm80 and cuda_ptx_direct kernels are declared `__launch_bounds__(THREADS)`: ptxas may then use up to
255 registers a thread, and registers, not shared memory, can cap the blocks an SM holds. The interleaved odd-K decode
kernel is one: 109 registers x 256 threads leave room for 2 blocks per SM while its 3-stage ring (71 KB) would fit 3
(bench/NOTES.md, the interleave node's profile: 13.8 of 64 warps active). `__launch_bounds__(THREADS, B)` makes ptxas
fit B blocks: at most 65536 / (B x THREADS) registers a thread, spilling what does not fit. Variants:
  as_lowered  the source as generated
  minB        `__launch_bounds__(THREADS, B)` for each B of --blocks
Each variant's registers and spills come from ptxas (on any machine, --compile-only); on a GPU each is checked against
torch.matmul and timed in the offline scenario (bench/source_variants.py). A bound that wins becomes an IR field.
"""

from __future__ import annotations

import re
import sys

from source_variants import probe_parser, run_probe

# The GEMM entry's bound: `__launch_bounds__(THREADS)` right before `l2ir_..._gemm(`. Other kernels of the source
# (the repack copy) and entries already bounded (`THREADS, 1` of the sm90a rule) are left alone.
BOUNDS = re.compile(r"__launch_bounds__\((\d+)\)(\s*l2ir_\w+_gemm\()")


def min_blocks(blocks: int):
    def edit(source: str) -> str:
        out, found = BOUNDS.subn(rf"__launch_bounds__(\1, {blocks})\2", source)
        if found != 1:
            raise ValueError(f"the generated source has {found} GEMM entries bounded by __launch_bounds__(THREADS) "
                             "alone, not one")
        return out
    return edit


def main(argv=None) -> int:
    ap = probe_parser(__doc__)
    ap.add_argument("--blocks", type=int, nargs="+", default=[2, 3], help="minimum blocks per SM to promise")
    args = ap.parse_args(argv)
    if any(b < 1 for b in args.blocks):
        ap.error("--blocks takes positive counts")
    variants = {"as_lowered": lambda source: source, **{f"min{b}": min_blocks(b) for b in args.blocks}}
    return run_probe("launch_bounds_probe.py", args, variants, argv)


if __name__ == "__main__":
    sys.exit(main())
