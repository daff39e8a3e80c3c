"""Lowering an L2IR kernel to CUDA source (one module per backend, chosen by `registry.lower`) and compiling it
(`compile.py`: nvcc or NVRTC, content-addressed cache). Every backend is a pure function IR -> LaunchPlan."""
