"""Raw CUDA with inline PTX: no CUTLASS, every instruction written out.

Two lowering rules, each its own entry in `l2ir.backends.registry` (the only dispatch):
  cuda_ptx        sm90a.py: wgmma + TMA + mbarrier warp-specialized kernels on sm90a, form "host_shim"
  cuda_ptx_sm80   sm80.py: mma.sync + ldmatrix + cp.async multistage kernels on sm80/86/89/90/90a, form "kernels"
common.py holds what both share: the refusal error and the problem-class check.
"""
