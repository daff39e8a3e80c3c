#!/usr/bin/env bash
# The one device runbook: run named recipes on the GPU host, from the repository root, with the wheels in .whl/.
#
#   bash bench/device.sh RECIPE [RECIPE ...]        e.g.  bash bench/device.sh gpu-tests bench-sm90
#   bash bench/device.sh list                       the recipes and what each runs
#
# Every call first installs the carried wheels (nvidia-cutlass, lark, ...) into /tmp/site and L2IR itself in
# editable mode (the folders install under l2ir.* through the editable finder; a bare PYTHONPATH would not map
# them). Each recipe has its own time limit (override: TIMEOUT_<RECIPE with - as _>=seconds); its console output
# goes to $OUT/<recipe>.log and to bench/results/ where the results index says so; bench results land in
# bench/results/ (resumable: rerunning a bench recipe measures only what is missing). $OUT/results.tgz holds
# bench/results/ and the logs at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/l2ir-out}
mkdir -p "$OUT" bench/results

# The Hopper shape set of bench/results (21 shapes of at least 100 GFLOP).
SM90_SHAPES="--shapes 14 --min-gflop 100 --shape 4096x4096x4096 --shape 8192x8192x8192 --shape 16384x16384x256
  --shape 16384x16384x512 --shape 8192x8192x512 --shape 12288x12288x256 --shape 16384x8192x512 --shape 8192x16384x256"

# Shapes with a dimension that is not a multiple of 8 (decode M=1, odd vocab N, odd K, all odd) for issue 11's
# unaligned target, beside the grid's 48 shapes below 100 GFLOP.
UNALIGNED_SHAPES="--shape 1x4096x4096 --shape 127x4096x4096 --shape 333x555x777 --shape 1023x1025x1027
  --shape 4096x1001x4096 --shape 512x50257x768 --shape 1024x1024x999 --shape 4096x4096x1001 --shape 512x512x4097
  --shape 2000x3000x777 --shape 17x9999x3333 --shape 100x3000x4104"

# Shapes whose K is not a multiple of 8 (every row of A and B on a 2-byte boundary): the repack node's target.
ODD_K_SHAPES="--shape 333x555x777 --shape 1023x1025x1027 --shape 1024x1024x999 --shape 4096x4096x1001
  --shape 512x512x4097 --shape 2000x3000x777 --shape 17x9999x3333 --shape 64x64x63 --shape 256x1024x1001
  --shape 2048x2048x2047 --shape 8192x4096x1001"

# The sm80 seed at pad.align 1, 2 and 4 (odd K, K = 2 mod 4, K = 4 mod 8): which mma.sync backend lowers it
# by default (backends/registry.py realigned_sm80).
export SEED_ALIGN_SHAPES="--shape 17x9999x3333 --shape 333x555x777 --shape 1024x1024x999 --shape 333x555x778
  --shape 1024x1024x1002 --shape 333x555x780 --shape 1024x1024x1004"

# name | default timeout (s) | command
recipes() {
  cat <<'EOF'
gpu-tests|300|python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests
backends|400|python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_backends_gpu.py
evaluator|220|python3 -m pytest -q -rs -p no:cacheprovider tests/test_evaluator_gpu.py tests/test_compile.py tests/test_source_backend.py tests/test_evaluator_cpu.py
smoke-sm90|120|python3 -m l2ir.cli bench --target sm90a --shapes 0 --shape 4096x4096x4096 --sweep pingpong_128x128x64_c1x1 --out bench/results/sm90_smoke_4096
bench-sm80|330|python3 -m l2ir.cli bench --target sm80 --shapes 40 --out bench/results/sm80_grid40_h200
bench-sm90|420|python3 -m l2ir.cli bench --target sm90a $SM90_SHAPES --out bench/results/sm90_large_v2_h200
bench-sm90-torchdefault|300|python3 -m l2ir.cli bench --target sm90a $SM90_SHAPES --torch-defaults --out bench/results/sm90_large_torchdefault_h200
bench-sm90-1tflop|470|python3 -m l2ir.cli bench --target sm90a --shapes 20 --min-gflop 1000 --sweep pingpong_128x128x64_c1x1 pingpong_128x128x64_c1x2 pingpong_64x256x64_c1x1 pingpong_64x256x64_c2x1 coop_128x256x64_c1x1 --out bench/results/sm90_1tflop_h200
bench-cuda-ptx|200|python3 -m l2ir.cli bench --target sm90a --backend cuda_ptx --shapes 0 --shape 4096x4096x4096 --shape 8192x8192x8192 --shape 8192x8192x512 --shape 16384x16384x512 --shape 1000x1000x1000 --shape 256x256x256 --out bench/results/cuda_ptx_h200
bench-cuda-ptx-sm80|300|python3 -m l2ir.cli bench --target sm80 --backend cuda_ptx_sm80 --shapes 0 --shape 4096x4096x4096 --shape 1000x1000x1000 --shape 127x136x72 --shape 64x64x64 --shape 8192x8192x512 --out bench/results/cuda_ptx_sm80_h200
families-small|590|python3 -m l2ir.cli bench --target sm90a --shapes 48 --max-gflop 100 $UNALIGNED_SHAPES --family cuda_ptx=cuda_ptx --family cuda_ptx_sm80=cuda_ptx_sm80 --family cute_sm80=sm80 --family cutlass_sm90=sm90a:pingpong_64x256x64_c1x1,pingpong_128x128x64_c1x1,coop_128x256x64_c1x1,coop_128x256x64_c2x1_streamk --out bench/results/families_small_h200
families-small-v2|590|python3 -m l2ir.cli bench --target sm90a --shapes 48 --max-gflop 100 $UNALIGNED_SHAPES --family cuda_ptx=cuda_ptx --family cuda_ptx_sm80=cuda_ptx_sm80 --family cute_sm80=sm80:64x128x32_w2x2_s4,64x64x32_w2x2_s3_splitk4 --family cutlass_sm90=sm90a:pingpong_64x256x64_c1x1,pingpong_128x128x64_c1x1 --budget-s 470 --out bench/results/families_small_v2_h200
splitk-cluster|420|python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_backends_gpu.py -k "splitk_reduction and cluster" && python3 -m l2ir.cli bench --target sm90a --shapes 0 --shape 64x64x2048 --shape 256x64x1024 --shape 64x256x2048 --shape 1024x128x1024 --shape 2048x256x512 --shape 128x128x16384 --shape 512x64x8192 --shape 128x256x12288 --shape 128x512x8192 --shape 512x128x16384 --shape 64x2048x8192 --shape 100x3000x4104 --shape 127x4096x4096 --shape 512x2048x4096 --shape 2048x128x4096 --shape 512x512x2048 --family cuda_ptx=cuda_ptx:ptx_splitk_cluster_w4x1_64x64x64_s2,ptx_splitk_cluster_w4x1_64x64x64_s4,ptx_splitk_cluster_w4x1_64x64x64_s8,ptx_splitk_cluster_w4x1_64x64x64_s16,ptx_splitk_cluster_w4x1_64x128x64_s4,ptx_splitk_cluster_w4x1_64x128x64_s8,ptx_splitk_cluster_w4x1_64x64x64_s8_st4,ptx_splitk_w4x1_64x64x64_s8,ptx_w4x1_64x64x64 --out bench/results/splitk_cluster_h200
splitk-cluster-wide|300|python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_backends_gpu.py -k cluster && python3 -m l2ir.cli bench --target sm90a --shapes 0 --shape 127x4096x4096 --shape 512x2048x4096 --shape 128x4096x16384 --shape 100x3000x4104 --family cuda_ptx=cuda_ptx:ptx_splitk_cluster_coop_128x256x64_s4,ptx_splitk_cluster_coop_128x128x64_s4,ptx_splitk_cluster_coop_128x128x64_s2,ptx_w4x1_64x64x64 --out bench/results/splitk_cluster_wide_h200 && python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_pipeline_gpu.py
families-small-v3|590|python3 -m l2ir.cli bench --target sm90a --shapes 48 --max-gflop 100 $UNALIGNED_SHAPES --family cuda_ptx=cuda_ptx:ptx_w4x1_64x64x64,ptx_w4x1_64x64x64_s4,ptx_coop_128x128x64,ptx_coop_128x256x64,ptx_coop_256x128x64,ptx_splitk_w4x1_64x64x64_s8,ptx_splitk_w4x1_64x128x64_s4,ptx_splitk_w4x1_64x64x64_s4_st4,ptx_splitk_w4x1_64x128x64_s2_st4,ptx_splitk_cluster_coop_128x128x64_s2,ptx_splitk_cluster_coop_128x128x64_s4,ptx_splitk_cluster_coop_128x256x64_s4,ptx_splitk_cluster_w4x1_64x128x64_s2,ptx_splitk_cluster_w4x1_64x128x64_s4,ptx_splitk_cluster_w4x1_64x128x64_s8,ptx_splitk_cluster_w4x1_64x64x64_s16,ptx_splitk_cluster_w4x1_64x64x64_s2,ptx_splitk_cluster_w4x1_64x64x64_s2_st4,ptx_splitk_cluster_w4x1_64x64x64_s4,ptx_splitk_cluster_w4x1_64x64x64_s8,ptx_splitk_cluster_w4x1_64x64x64_s8_st4 --family cuda_ptx_sm80=cuda_ptx_sm80:ptx_sm80_64x64x32_w2x2_s3,ptx_sm80_64x64x64_w2x2_s4_latency,ptx_sm80_64x64x64_w2x2_s4_splitk4_align1,ptx_sm80_128x128x32_w2x4_s4_align1,ptx_sm80_128x128x32_w2x2_s4_align1,ptx_sm80_64x64x32_w2x2_s4_align1,ptx_sm80_32x128x64_w1x4_s6_splitk4_decode,ptx_sm80_32x128x64_w2x4_s4_splitk4_align1_decode,ptx_sm80_128x64x64_w4x1_s4_splitk2_skinny_n --family cute_sm80=sm80:64x128x32_w2x2_s4 --family cutlass_sm90=sm90a:pingpong_64x256x64_c1x1,pingpong_128x128x64_c1x1 --budget-s 470 --out bench/results/families_small_v3_h200
families-small-v4|590|python3 -m l2ir.cli bench --target sm90a --shapes 48 --max-gflop 100 $UNALIGNED_SHAPES --family cuda_ptx=cuda_ptx:ptx_coop_128x64x64,ptx_splitk_cluster_coop_128x64x64_s2,ptx_repack_coop_128x128x64,ptx_repack_coop_128x128x64_v1,ptx_repack_coop_128x256x64,ptx_repack_w4x1_64x128x64,ptx_repack_w4x1_64x64x64_v1,ptx_repack_splitk_cluster_w4x1_64x64x64_s2,ptx_repack_splitk_cluster_w4x1_64x64x64_s2_v1,ptx_repack_splitk_cluster_w4x1_64x64x64_s4,ptx_repack_splitk_cluster_w4x1_64x64x64_s4_v1,ptx_repack_splitk_cluster_w4x1_64x128x64_s4,ptx_w4x1_64x64x64,ptx_w4x1_64x64x64_s4,ptx_coop_128x128x64,ptx_coop_128x256x64,ptx_coop_256x128x64,ptx_splitk_w4x1_64x64x64_s8,ptx_splitk_w4x1_64x128x64_s4,ptx_splitk_w4x1_64x64x64_s4_st4,ptx_splitk_w4x1_64x128x64_s2_st4,ptx_splitk_cluster_coop_128x128x64_s2,ptx_splitk_cluster_coop_128x128x64_s4,ptx_splitk_cluster_coop_128x256x64_s4,ptx_splitk_cluster_w4x1_64x128x64_s2,ptx_splitk_cluster_w4x1_64x128x64_s4,ptx_splitk_cluster_w4x1_64x128x64_s8,ptx_splitk_cluster_w4x1_64x64x64_s16,ptx_splitk_cluster_w4x1_64x64x64_s2,ptx_splitk_cluster_w4x1_64x64x64_s2_st4,ptx_splitk_cluster_w4x1_64x64x64_s4,ptx_splitk_cluster_w4x1_64x64x64_s8,ptx_splitk_cluster_w4x1_64x64x64_s8_st4 --family cuda_ptx_sm80=cuda_ptx_sm80:ptx_sm80_64x64x32_w2x2_s3,ptx_sm80_64x64x64_w2x2_s4_latency,ptx_sm80_64x64x64_w2x2_s4_splitk4_align1,ptx_sm80_128x128x32_w2x4_s4_align1,ptx_sm80_128x128x32_w2x2_s4_align1,ptx_sm80_64x64x32_w2x2_s4_align1,ptx_sm80_32x128x64_w1x4_s6_splitk4_decode,ptx_sm80_32x128x64_w2x4_s4_splitk4_align1_decode,ptx_sm80_128x64x64_w4x1_s4_splitk2_skinny_n --family cute_sm80=sm80:64x128x32_w2x2_s4 --family cutlass_sm90=sm90a:pingpong_64x256x64_c1x1,pingpong_128x128x64_c1x1 --budget-s 470 --out bench/results/families_small_v4_h200
dispatch-families|300|bash -c 'rm -f /tmp/families.db && python3 -m l2ir.cli db import --db /tmp/families.db bench/results/families_small_v2_h200.jsonl bench/results/families_small_v2_h200-fresh.jsonl && python3 bench/dispatch_bench.py --db /tmp/families.db --target sm80 --target sm90a --max-gflop 5 --out bench/results/dispatch_families_h200.json'
dispatch-families-v3|300|bash -c 'rm -f /tmp/families_v3.db && python3 -m l2ir.cli db import --db /tmp/families_v3.db bench/results/families_small_v3_h200.jsonl bench/results/families_small_v3_h200-fresh.jsonl && python3 bench/dispatch_bench.py --db /tmp/families_v3.db --target sm80 --target sm90a --max-gflop 5 --out bench/results/dispatch_families_v3_h200.json'
repack-unaligned|590|python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_backends_gpu.py -k "repack or splitk_reduction or small_shape_families" ; python3 -m l2ir.cli bench --target sm90a --shapes 0 $ODD_K_SHAPES --family cuda_ptx=cuda_ptx:ptx_repack_coop_128x128x64,ptx_repack_coop_128x128x64_v1,ptx_repack_coop_128x256x64,ptx_repack_w4x1_64x128x64,ptx_repack_w4x1_64x64x64_v1,ptx_repack_splitk_cluster_w4x1_64x64x64_s4,ptx_repack_splitk_cluster_w4x1_64x64x64_s4_v1,ptx_repack_splitk_cluster_w4x1_64x128x64_s4 --family cuda_ptx_sm80=cuda_ptx_sm80:ptx_sm80_64x64x64_w2x2_s4_splitk4_align1,ptx_sm80_128x128x32_w2x4_s4_align1,ptx_sm80_128x128x32_w2x2_s4_align1,ptx_sm80_64x64x32_w2x2_s4_align1,ptx_sm80_32x128x64_w2x4_s4_splitk4_align1_decode --budget-s 330 --out bench/results/repack_unaligned_h200
unaligned-v4|590|python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_backends_gpu.py -k repack ; python3 -m l2ir.cli bench --target sm90a --shapes 0 $UNALIGNED_SHAPES --family cuda_ptx=cuda_ptx:ptx_repack_coop_128x128x64,ptx_repack_coop_128x128x64_v1,ptx_repack_coop_128x256x64,ptx_repack_w4x1_64x128x64,ptx_repack_w4x1_64x64x64_v1,ptx_repack_splitk_cluster_w4x1_64x64x64_s2,ptx_repack_splitk_cluster_w4x1_64x64x64_s2_v1,ptx_repack_splitk_cluster_w4x1_64x64x64_s4,ptx_repack_splitk_cluster_w4x1_64x64x64_s4_v1,ptx_repack_splitk_cluster_w4x1_64x128x64_s4,ptx_w4x1_64x64x64,ptx_splitk_cluster_coop_128x128x64_s2,ptx_splitk_cluster_coop_128x128x64_s4,ptx_splitk_cluster_w4x1_64x128x64_s4 --family cuda_ptx_sm80=cuda_ptx_sm80:ptx_sm80_32x128x64_w1x4_s6_splitk4_decode,ptx_sm80_64x64x64_w2x2_s4_splitk4_align1,ptx_sm80_128x128x32_w2x4_s4_align1,ptx_sm80_64x64x32_w2x2_s4_align1,ptx_sm80_128x128x32_w2x2_s4_align1,ptx_sm80_32x128x64_w2x4_s4_splitk4_align1_decode --budget-s 400 --out bench/results/unaligned_v4_h200
dispatch-unaligned-v4|300|python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_dispatch_gpu.py ; bash -c 'rm -f /tmp/unaligned_v4.db && python3 -m l2ir.cli db import --db /tmp/unaligned_v4.db bench/results/unaligned_v4_h200.jsonl bench/results/unaligned_v4_h200-fresh.jsonl && python3 bench/dispatch_bench.py --db /tmp/unaligned_v4.db --target sm80 --target sm90a --max-gflop 100 --out bench/results/dispatch_unaligned_v4_h200.json'
dispatch-unaligned-v4-aligned-alike|420|python3 -m pytest -q -rs -s -m gpu -p no:cacheprovider tests/test_dispatch_gpu.py ; bash -c 'rm -f /tmp/unaligned_v4.db && python3 -m l2ir.cli db import --db /tmp/unaligned_v4.db bench/results/unaligned_v4_h200.jsonl bench/results/unaligned_v4_h200-fresh.jsonl && python3 bench/dispatch_bench.py --db /tmp/unaligned_v4.db --target sm80 --target sm90a --max-gflop 100 --out bench/results/dispatch_unaligned_v4_aligned_alike_h200.json'
skinny-multicast|470|python3 -m l2ir.cli bench --target sm90a --shapes 0 --shape 127x4096x4096 --shape 128x4096x16384 --shape 100x3000x4104 --shape 512x2048x4096 --shape 64x4096x12288 --shape 64x16384x16384 --shape 128x8192x8192 --family cutlass_sm90=sm90a_skinny --family cuda_ptx=cuda_ptx:ptx_w4x1_64x64x64,ptx_splitk_cluster_coop_128x128x64_s2,ptx_splitk_cluster_coop_128x128x64_s4,ptx_splitk_cluster_coop_128x256x64_s4,ptx_splitk_cluster_w4x1_64x128x64_s4,ptx_splitk_cluster_w4x1_64x128x64_s8,ptx_splitk_w4x1_64x256x64_s2 --budget-s 300 --out bench/results/skinny_multicast_h200
skinny-splitk|470|python3 -m l2ir.cli bench --target sm90a --shapes 0 --shape 127x4096x4096 --shape 128x4096x16384 --shape 100x3000x4104 --shape 512x2048x4096 --shape 64x4096x12288 --shape 64x16384x16384 --shape 128x8192x8192 --family cutlass_sm90=sm90a_skinny --family cuda_ptx=cuda_ptx:ptx_w4x1_64x64x64,ptx_splitk_cluster_coop_128x128x64_s2 --budget-s 330 --out bench/results/skinny_splitk_h200
families-recheck|420|python3 -m l2ir.cli bench --target sm90a --shapes 0 --shape 512x512x4097 --shape 4096x1001x4096 --shape 512x50257x768 --shape 4096x4096x1001 --shape 1023x1025x1027 --shape 1024x1024x999 --shape 2000x3000x777 --shape 100x3000x4104 --shape 128x128x16384 --shape 512x64x8192 --family cuda_ptx=cuda_ptx --family cuda_ptx_sm80=cuda_ptx_sm80 --out bench/results/families_recheck_h200
cublas-kernels|200|python3 bench/cublas_kernels_probe.py --shape 127x4096x4096 --shape 128x4096x16384 --shape 100x3000x4104 --shape 512x2048x4096 --shape 128x8192x8192 --shape 64x16384x16384 --shape 2048x256x512 --shape 1024x256x256 --shape 1024x128x1024 --shape 16384x128x64 --shape 256x64x128 --shape 1x4096x4096 --shape 12288x128x64 --shape 128x128x16384 --out bench/results/cublas_kernels_h200.json
cublas-tiles|470|python3 -m l2ir.cli bench --target sm90a --shapes 0 --shape 127x4096x4096 --shape 128x4096x16384 --shape 100x3000x4104 --shape 512x2048x4096 --shape 128x8192x8192 --shape 2048x256x512 --shape 1024x256x256 --shape 1024x128x1024 --shape 16384x128x64 --shape 12288x128x64 --family cuda_ptx=cuda_ptx:ptx_coop_128x64x64,ptx_splitk_cluster_coop_128x64x64_s2,ptx_splitk_cluster_coop_128x64x64_s4,ptx_w4x1_64x64x64_s6,ptx_w4x1_64x64x64,ptx_w4x1_64x64x64_s4,ptx_splitk_cluster_coop_128x128x64_s2,ptx_splitk_cluster_w4x1_64x64x64_s2 --budget-s 330 --out bench/results/cublas_tiles_h200
block-split|590|python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_backends_gpu.py -k block ; python3 -m l2ir.cli bench --target sm90a --shapes 0 --shape 127x4096x4096 --shape 2048x256x512 --shape 512x2048x4096 --shape 100x3000x4104 --shape 1024x128x1024 --shape 128x4096x16384 --shape 1024x256x256 --shape 512x512x2048 --shape 2048x1024x256 --shape 128x128x16384 --shape 128x8192x8192 --shape 1024x2048x1024 --family cuda_ptx=cuda_ptx:ptx_splitk_block_64x64x64,ptx_splitk_block_64x128x64,ptx_splitk_block_64x32x64,ptx_splitk_block_64x48x64,ptx_w4x1_64x64x64,ptx_splitk_cluster_coop_128x64x64_s2,ptx_splitk_cluster_w4x1_64x64x64_s2,ptx_splitk_cluster_coop_128x128x64_s2 --budget-s 330 --out bench/results/block_split_h200
skinny-cluster64|590|python3 -m l2ir.cli bench --target sm90a --shapes 0 --shape 127x4096x4096 --shape 100x3000x4104 --shape 128x4096x16384 --shape 512x2048x4096 --shape 128x8192x8192 --shape 2048x256x512 --shape 1024x2048x1024 --family cutlass_sm90=sm90a_skinny:pingpong_64x64x64_c1x1,pingpong_64x64x64_c2x1,pingpong_64x64x64_c2x2,pingpong_64x64x64_c2x4,pingpong_64x64x64_c1x2 --family cuda_ptx=cuda_ptx:ptx_splitk_cluster_coop_128x128x64_s2 --budget-s 400 --out bench/results/skinny_cluster64_h200
tma-promotion|400|python3 bench/tma_promotion_probe.py --shape 127x4096x4096 --shape 128x4096x16384 --shape 2048x256x512 --shape 512x2048x4096 --config ptx_w4x1_64x64x64 --config ptx_w4x1_64x64x64_g8 --config ptx_splitk_cluster_coop_128x64x64_s2 --config ptx_coop_128x128x64 --promotion L2_256B --promotion L2_128B --promotion NONE --out bench/results/tma_promotion_probe_h200.json
families-focus-v5|590|python3 -m l2ir.cli bench --target sm90a --shapes 0 --shape 127x4096x4096 --shape 128x4096x16384 --shape 2048x256x512 --shape 1024x128x1024 --shape 1024x256x256 --shape 512x2048x4096 --shape 100x3000x4104 --shape 128x128x16384 --shape 128x16384x1024 --shape 512x512x2048 --shape 1024x2048x1024 --shape 2048x1024x256 --shape 1x4096x4096 --shape 256x64x128 --shape 12288x128x64 --shape 16384x128x64 --family cuda_ptx=cuda_ptx:ptx_coop_128x128x64,ptx_splitk_block_64x32x64,ptx_splitk_cluster_coop_128x128x64_s2,ptx_splitk_cluster_coop_128x128x64_s4,ptx_splitk_cluster_w4x1_64x64x64_s16,ptx_splitk_cluster_w4x1_64x64x64_s2,ptx_w4x1_64x64x64,ptx_w4x1_64x64x64_s4,ptx_w4x1_64x64x64_g8 --family cuda_ptx_sm80=cuda_ptx_sm80:ptx_sm80_32x128x64_w1x4_s6_splitk4_decode,ptx_sm80_64x64x32_w2x2_s3,ptx_sm80_64x64x64_w2x2_s4_latency --family cute_sm80=sm80:64x128x32_w2x2_s4 --family cutlass_sm90=sm90a_skinny:coop_128x128x64_c1x2_splitk4,pingpong_64x128x64_c1x4,pingpong_64x64x64_c1x1,pingpong_64x64x64_c2x1 --budget-s 440 --out bench/results/families_focus_v5_h200
dispatch-unaligned-v4-host|300|bash -c 'rm -f /tmp/unaligned_v4.db && python3 -m l2ir.cli db import --db /tmp/unaligned_v4.db bench/results/unaligned_v4_h200.jsonl bench/results/unaligned_v4_h200-fresh.jsonl && python3 bench/dispatch_bench.py --db /tmp/unaligned_v4.db --target sm80 --target sm90a --max-gflop 100 --out bench/results/dispatch_unaligned_v4_host_h200.json'
narrow-tiles|400|python3 -m l2ir.cli bench --target sm90a --shapes 0 --shape 100x3000x4104 --shape 127x4096x4096 --shape 128x8192x8192 --shape 64x4096x12288 --shape 128x16384x1024 --shape 512x2048x4096 --family cuda_ptx=cuda_ptx:ptx_w4x1_64x48x64_g8,ptx_w4x1_64x56x64_g8,ptx_w4x1_64x64x64_g8,ptx_splitk_cluster_coop_128x128x64_s4,ptx_splitk_cluster_coop_128x128x64_s2,ptx_coop_128x128x64,ptx_splitk_cluster_w4x1_64x64x64_s2 --family cutlass_sm90=sm90a_skinny:pingpong_64x64x64_c1x1 --budget-s 300 --out bench/results/narrow_tiles_h200
tune-decode|280|python3 -m l2ir.cli tune --shape 17x9999x3333 --shape 1x4096x4096 --policy rules --budget-candidates 8 --budget-seconds 200 --finalists 2 --db bench/results/tune_decode_h200.db
host-parts|120|python3 bench/host_parts_probe.py --out bench/results/host_parts_probe_h200.json
dispatch-families-v3-host|300|bash -c 'rm -f /tmp/families_v3.db && python3 -m l2ir.cli db import --db /tmp/families_v3.db bench/results/families_small_v3_h200.jsonl bench/results/families_small_v3_h200-fresh.jsonl && python3 bench/dispatch_bench.py --db /tmp/families_v3.db --target sm80 --target sm90a --max-gflop 5 --out bench/results/dispatch_families_v3_host_h200.json'
backends-kept|200|python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_backends_gpu.py -k kept
torch-baseline|300|python3 bench/torch_baseline_probe.py --out bench/results/torch_baseline_probe_h200.json
server-check|570|python3 bench/server_check.py --out bench/results/server_check_h200.json
tune-grid|590|bash bench/tune_grid.sh
loop-gpu|590|python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_loop_gpu.py tests/test_pool_gpu.py tests/test_pipeline_gpu.py
backends-repack|200|python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_backends_gpu.py -k repack
backends-cutlass|400|python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_backends_gpu.py -k "cutlass or kept"
dispatch-tests|480|python3 -m pytest -q -rs -s -m gpu -p no:cacheprovider tests/test_dispatch_gpu.py
dispatch|240|python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_dispatch_gpu.py && python3 bench/dispatch_bench.py --max-gflop 5 --out bench/results/dispatch_h200_v4.json
cluster-x2|590|bash -c 'python3 bench/cluster_bench.py --out bench/results/cluster_h200x2_finalists3.json && python3 bench/cluster_bench.py --finalists 1 --out bench/results/cluster_h200x2_finalists1.json'
policy-compare|540|python3 bench/policy_compare.py --state bench/results/policy_compare_standin_learned_state.json --train-shapes 24 --held-shapes 8 --limit-held 4 --budget 10 --seeds 0 --budget-seconds 230 --out bench/results/policy_compare_h200_s0
train-policy|420|bash -c 'bash bench/stage_model.sh assemble && python3 bench/train_policy.py --out bench/results/train_policy_mean_h200'
dispatch-unaligned-v5-fast|420|bash -c 'rm -f /tmp/unaligned_v4.db && python3 -m l2ir.cli db import --db /tmp/unaligned_v4.db bench/results/unaligned_v4_h200.jsonl bench/results/unaligned_v4_h200-fresh.jsonl && python3 bench/dispatch_bench.py --db /tmp/unaligned_v4.db --target sm80 --target sm90a --max-gflop 100 --out bench/results/dispatch_unaligned_v5_fast_h200.json'
dispatch-families-v4-fast|420|bash -c 'rm -f /tmp/families_v3.db && python3 -m l2ir.cli db import --db /tmp/families_v3.db bench/results/families_small_v3_h200.jsonl bench/results/families_small_v3_h200-fresh.jsonl && python3 bench/dispatch_bench.py --db /tmp/families_v3.db --target sm80 --target sm90a --max-gflop 5 --out bench/results/dispatch_families_v4_fast_h200.json'
seed-align-default|560|bash -c 'python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_backends_gpu.py -k cuda_ptx_sm80_families ; python3 -m l2ir.cli bench --target sm80 --shapes 0 $SEED_ALIGN_SHAPES --sweep 64x128x32_w2x2_s4 --out bench/results/seed_align_default_h200 && python3 -m l2ir.cli bench --target sm80 --shapes 0 $SEED_ALIGN_SHAPES --backend cute_sm80 --sweep 64x128x32_w2x2_s4 --out bench/results/seed_align_cute_h200'
dispatch-fast-v2|590|python3 -m pytest -q -rs -s -m gpu -p no:cacheprovider tests/test_dispatch_gpu.py ; bash -c 'rm -f /tmp/unaligned_v4.db /tmp/families_v3.db && python3 -m l2ir.cli db import --db /tmp/unaligned_v4.db bench/results/unaligned_v4_h200.jsonl bench/results/unaligned_v4_h200-fresh.jsonl && python3 bench/dispatch_bench.py --db /tmp/unaligned_v4.db --target sm80 --target sm90a --max-gflop 100 --out bench/results/dispatch_unaligned_v6_fast_h200.json && python3 -m l2ir.cli db import --db /tmp/families_v3.db bench/results/families_small_v3_h200.jsonl bench/results/families_small_v3_h200-fresh.jsonl && python3 bench/dispatch_bench.py --db /tmp/families_v3.db --target sm80 --target sm90a --max-gflop 5 --out bench/results/dispatch_families_v5_fast_h200.json'
dispatch-fast-v3|590|python3 -m pytest -q -rs -s -m gpu -p no:cacheprovider tests/test_dispatch_gpu.py ; bash -c 'rm -f /tmp/unaligned_v4.db /tmp/families_v3.db && python3 -m l2ir.cli db import --db /tmp/unaligned_v4.db bench/results/unaligned_v4_h200.jsonl bench/results/unaligned_v4_h200-fresh.jsonl && python3 bench/dispatch_bench.py --db /tmp/unaligned_v4.db --target sm80 --target sm90a --max-gflop 100 --out bench/results/dispatch_unaligned_v7_fast_h200.json && python3 -m l2ir.cli db import --db /tmp/families_v3.db bench/results/families_small_v3_h200.jsonl bench/results/families_small_v3_h200-fresh.jsonl && python3 bench/dispatch_bench.py --db /tmp/families_v3.db --target sm80 --target sm90a --max-gflop 5 --out bench/results/dispatch_families_v6_fast_h200.json'
direct-decode|560|python3 -m l2ir.cli bench --target sm90a --shapes 0 --shape 1x4096x4096 --shape 17x9999x3333 --shape 64x2048x8192 --shape 64x4096x12288 --shape 8x4096x4096 --shape 16x8192x8192 --shape 32x4096x4096 --shape 64x12288x64 --family cuda_ptx_direct=cuda_ptx_direct --family cutlass_sm90=sm90a_skinny:pingpong_64x128x64_c1x4 --family cuda_ptx_sm80=cuda_ptx_sm80:ptx_sm80_32x128x64_w2x4_s4_splitk4_align1_decode --family cuda_ptx=cuda_ptx:ptx_splitk_cluster_w4x1_64x64x64_s2,ptx_splitk_cluster_w4x1_64x128x64_s4 --budget-s 420 --out bench/results/direct_decode_h200
EOF
}

if [ "${1:-list}" = list ] || [ $# -eq 0 ]; then
  recipes | while IFS='|' read -r name limit cmd; do printf '%-24s %4ss  %s\n' "$name" "$limit" "$cmd"; done
  exit 0
fi
for r in "$@"; do
  recipes | cut -d'|' -f1 | grep -qx -- "$r" || { echo "bench/device.sh: unknown recipe '$r' (bash bench/device.sh list)" >&2; exit 2; }
done

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "bench/device.sh: installing the wheels in .whl/ failed" >&2; exit 1; }
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . \
  || { echo "bench/device.sh: pip install -e . failed" >&2; exit 1; }

echo "== environment"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv,noheader || true
nvcc --version | tail -1 || true
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu:", torch.cuda.is_available())'

status=0
for r in "$@"; do
  line=$(recipes | grep "^$r|")
  limit=${line#*|}; limit=${limit%%|*}; cmd=${line#*|*|}
  var="TIMEOUT_${r//-/_}"; limit=${!var:-$limit}
  echo "== $r (limit ${limit} s): $cmd"
  eval "timeout $limit $cmd" > "$OUT/$r.log" 2>&1
  rc=$?
  echo "== $r: exit $rc"
  tail -n 30 "$OUT/$r.log"
  [ $rc -eq 0 ] || status=1
done
tar czf "$OUT/results.tgz" bench/results -C "$OUT" $(cd "$OUT" && ls ./*.log 2>/dev/null) 2>/dev/null
exit $status
