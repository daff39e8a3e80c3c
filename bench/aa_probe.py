"""Race generated kernels side by side, each timed twice (an A/A beside every A/B):

    python bench/aa_probe.py --case 8192x4096x128:cuda_ptx:ptx_coop_128x256x64_tma \
                             --case 8192x4096x128:cuda_ptx:ptx_coop_128x256x64_tma2 --out FILE

The cases of one shape share their input sets and are timed one after the other in one process, each as lowered and
then again (variant `again`): the gap between the two timings of one kernel is the noise a difference between two
kernels must clear. Each timing is checked against torch.matmul on the timed sets and made in the offline scenario,
interleaved with torch.matmul (bench/source_variants.py). This probe only measures; the evaluator gates winners.
"""

from __future__ import annotations

import sys

from source_variants import probe_parser, run_probe


def main(argv=None) -> int:
    args = probe_parser(__doc__).parse_args(argv)
    same = lambda source: source  # noqa: E731 (the identity: the A/A's second timing)
    return run_probe("aa_probe.py", args, {"as_lowered": same, "again": same}, argv)


if __name__ == "__main__":
    sys.exit(main())
