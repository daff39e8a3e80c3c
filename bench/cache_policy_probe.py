"""Do L2 cache policies close the gap on C-write-bound GEMMs? (an A/B on generated cuda_ptx sources)

    python bench/cache_policy_probe.py --case 8192x4096x128:cuda_ptx:ptx_coop_128x256x64 [...] --out FILE

At K = 64-256 a GEMM's DRAM traffic is mostly C, a stream larger than L2 (8192x4096 fp16: 64 MB against 60 MB).
Every tile re-reads its rows of A and columns of B from L2; if the C stream evicts them, the re-reads come from
DRAM and the kernel moves more than the floor's bytes (bench/NOTES.md, "Where the time goes on C-write-bound
shapes"). This times each case's generated source as lowered and with its text edited:
  cs       the epilogue's 16-byte C stores as st.global.cs (evict first: C is written once);
  last     the TMA loads of A and B with an L2::cache_hint of evict_last (the CUTLASS CacheHintSm90 value);
  cs+last  both.
Each variant is checked against torch.matmul on the timed sets (max |diff| <= 1e-2 x max |ref|, fp32
accumulation in both) and timed in the evaluator's offline scenario (search.timing.time_offline, interleaved with
torch.matmul; bench/source_variants.py). An edit that wins here becomes an IR field, gated by the evaluator; this
probe only measures.
"""

from __future__ import annotations

import sys

from source_variants import probe_parser, replaced, run_probe

STORE = "*reinterpret_cast<uint4*>(C + (size_t)grow * N + gcol) = *reinterpret_cast<const uint4*>(c_tile + off);"
STORE_CS = "__stcs(reinterpret_cast<uint4*>(C + (size_t)grow * N + gcol), *reinterpret_cast<const uint4*>(c_tile + off));"
LOAD = ('"cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"\n'
        '      :: "r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1) : "memory");')
# CUTLASS's CacheHintSm90::EVICT_LAST: the 64-bit L2 policy word for "keep these lines over others".
LOAD_LAST = ('"cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint '
             '[%0], [%1, {%3, %4}], [%2], %5;"\n'
             '      :: "r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), '
             '"l"(0x14F0000000000000ull) : "memory");')
VARIANTS = {"as_lowered": (), "cs": ((STORE, STORE_CS),), "last": ((LOAD, LOAD_LAST),),
            "cs+last": ((STORE, STORE_CS), (LOAD, LOAD_LAST))}


def main(argv=None) -> int:
    args = probe_parser(__doc__).parse_args(argv)
    variants = {name: (lambda source, edits=edits: replaced(source, edits)) for name, edits in VARIANTS.items()}
    return run_probe("cache_policy_probe.py", args, variants, argv)


if __name__ == "__main__":
    sys.exit(main())
