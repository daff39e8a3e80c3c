"""A small model whose Linear layers run L2IR's tuned kernels where a dispatch package says they win.

    l2ir export --db bench/results/tune_grid48_h200.db --out pkg/ --target sm80
    python examples/dispatch_linear.py pkg/

Without a GPU (or without a package) every call goes to torch.matmul, and the counters say why.
"""

import sys

import torch

import l2ir


def main(package: str | None) -> None:
    if package:
        manifest = l2ir.load(package)
        print(f"package {package}: measured on {manifest['environment']['gpu']}, "
              f"content hash {manifest['content_hash'][:16]}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cuda" else torch.float32
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.GELU(), torch.nn.Linear(512, 64)).to(device, dtype)
    x = torch.randn(128, 64, device=device, dtype=dtype)
    with torch.no_grad():
        want = model(x)
        with l2ir.patch_linear():
            got = model(x)
    err = (got.float() - want.float()).abs().max().item()
    print(f"max |l2ir - torch| = {err:.3g}")
    print("calls per path:", l2ir.dispatch_stats())


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
